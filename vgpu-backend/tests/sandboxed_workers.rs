//! `vgpu-backend --gpu cuda` with its default GPU workers under its default seccomp
//! filters (`--seccomp kill`), without a GPU: the workers run the `cuda` GPU on its CPU
//! stand-in (`--test-worker-gpu cuda-fake`; with `VGPU_WORKER_GPU=cuda` on the GPU
//! itself). Through the real binary and vhost-user sockets: two
//! loopback VMs run verified work, each on a worker started by the launcher process (the
//! backend's threads may not start processes), every worker under its own filter with no
//! privileges; a killed worker fails its VM only, is counted as a crash (its status came
//! through the launcher), and the VM comes back on a new worker; VRAM pressure moves a
//! VM's chunks to its swap store and back through its worker; at the backend's exit no
//! launcher and no worker is left, not even as a zombie.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vgpu_guest::workloads::Workload;
use vgpu_guest::{Buffer, Context, Device};
use vgpu_loopback::LoopbackVm;
use vgpu_test_support::{BackendLauncher, BackendProcess};
use vgpu_vmm::reconnect::FaultPolicy;

const MIB: u64 = 1 << 20;

/// The backend on `cuda` as it starts by default: a worker per VM, with no flag asking for
/// it. The workers run on the fake device unless `VGPU_WORKER_GPU=cuda` (the same test on
/// a GPU: `ci/device/run.sh run workers`).
fn start(tag: &str) -> (BackendProcess, BackendLauncher) {
    start_with(tag, None)
}

/// As [`start`], with `workers_flag` (`--gpu-workers=process`: a worker per guest process).
fn start_with(tag: &str, workers_flag: Option<&str>) -> (BackendProcess, BackendLauncher) {
    let on_gpu = std::env::var("VGPU_WORKER_GPU").is_ok_and(|g| g.starts_with("cuda"));
    let mut args: Vec<&str> = workers_flag.into_iter().collect();
    if !on_gpu {
        args.extend(["--test-worker-gpu", "cuda-fake"]);
    }
    let launcher = BackendLauncher::new(
        tag,
        "[gpu]\nmodel = \"cuda\"\nvram_mib = 32\n\
         [[vm]]\nname = \"a\"\nvram_mib = 16\nswap_mib = 32\n[[vm]]\nname = \"b\"\n",
    )
    .bin(env!("CARGO_BIN_EXE_vgpu-backend"))
    .with_api()
    .args(&args);
    (launcher.start(), launcher)
}

fn run_workloads(ctx: &Context, names: &[&str]) -> Result<(), String> {
    for name in names {
        let r = Workload::by_name(name, true)
            .ok_or_else(|| format!("no workload {name}"))?
            .run(ctx)
            .map_err(|e| format!("{name}: {e}"))?;
        if !r.verified {
            return Err(format!("{name}: not verified"));
        }
    }
    Ok(())
}

/// `n` VRAM buffers of 4 MiB, buffer `i` filled with `seed + i`.
fn fill_buffers(ctx: &Context, n: u8, seed: u8) -> Vec<Buffer> {
    (0..n)
        .map(|i| {
            let b = ctx.alloc_vram(4 * MIB).expect("vram");
            b.fill(0, 4 * MIB, seed + i).expect("fill");
            b
        })
        .collect()
}

/// Each buffer of [`fill_buffers`] still holds its bytes.
fn check_buffers(bufs: &[Buffer], seed: u8) {
    for (i, b) in bufs.iter().enumerate() {
        let mut got = vec![0u8; b.len() as usize];
        b.read(0, &mut got).expect("read");
        assert!(
            got.iter().all(|&x| x == seed + i as u8),
            "buffer {i} changed"
        );
    }
}

fn status_of(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default()
}

/// The `key` line of `pid`'s status, whitespace collapsed.
fn status_line(pid: u32, key: &str) -> String {
    status_of(pid)
        .lines()
        .find(|l| l.starts_with(key))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn parent_of(pid: u32) -> Option<u32> {
    status_line(pid, "PPid:")
        .strip_prefix("PPid: ")
        .and_then(|p| p.parse().ok())
}

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// The processes whose parent is `pid` (zombies included).
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
                .filter(|c| parent_of(*c) == Some(pid))
                .collect()
        })
        .unwrap_or_default()
}

fn exists(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(20), "waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The value of the metrics line that starts with `series`.
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

fn device(d: &BackendProcess, vm: &str, pid: u32) -> (Arc<LoopbackVm>, Device) {
    let lb = d.connect(vm, FaultPolicy::default());
    let dev = Device::loopback(lb.clone(), pid).expect("device");
    (lb, dev)
}

#[test]
fn sandboxed_backend_runs_vms_on_sandboxed_workers_and_leaves_none() {
    let (mut d, _launcher) = start("seccomp-workers");
    let api = d.api();
    let backend = d.pid();
    // The launcher: the backend's one child, started before the filters.
    let launchers = children_of(backend);
    assert_eq!(launchers.len(), 1, "{launchers:?}\n{}", d.log_tail());
    let launcher = launchers[0];
    assert!(
        cmdline(launcher).contains("worker-launcher"),
        "{}",
        cmdline(launcher)
    );

    let (lb_a, dev_a) = device(&d, "a", 10);
    let (_lb_b, dev_b) = device(&d, "b", 20);
    let ctx_a = dev_a.create_context().expect("ctx a");
    let ctx_b = dev_b.create_context().expect("ctx b");
    run_workloads(&ctx_a, &["saxpy", "reduction", "copy_heavy"]).expect("a");
    run_workloads(&ctx_b, &["sgemm", "hotspot"]).expect("b");
    // 24 MiB for a, over its 16 MiB quota: 8 MiB go to its swap store, and come back into
    // VRAM through a's worker (commands, the swap memfd passed over) once a freed some;
    // every byte checked.
    let before = api.vm_stats("a").expect("stats").vram;
    let mut bufs_a = fill_buffers(&ctx_a, 6, 0x10);
    let v = api.vm_stats("a").expect("stats").vram;
    assert!(v.swapped_bytes >= 8 * MIB, "{v:?}");
    check_buffers(&bufs_a, 0x10);
    // Keep the last two: the ones that spilled at allocation, unless the VRAM manager
    // already swapped them in for the older ones (then those go, swapped). Either way
    // what is kept must come (or has come) back into VRAM: keeping the first two instead
    // passed only when the manager's rebalance beat the checks (a CI flake).
    let kept = bufs_a.split_off(4);
    drop(bufs_a);
    let t = Instant::now();
    loop {
        let v = api.vm_stats("a").expect("stats").vram;
        if v.swapped_bytes == 0 && v.swap_ins > before.swap_ins {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "a never swapped back in: {v:?}\n{}",
            d.log_tail()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    check_buffers(&kept, 0x14);
    drop(kept);

    // A worker per VM, each the launcher's child, sandboxed in the backend's mode.
    let workers = children_of(launcher);
    assert_eq!(workers.len(), 2, "{workers:?}\n{}", d.log_tail());
    for &w in &workers {
        let cmd = cmdline(w);
        assert!(
            cmd.contains(" worker ") && cmd.contains("--seccomp kill"),
            "{cmd}"
        );
        for want in [
            "Seccomp: 2",
            "NoNewPrivs: 1",
            "CapEff: 0000000000000000",
            "CapPrm: 0000000000000000",
        ] {
            let key = want.split(' ').next().unwrap_or_default();
            assert_eq!(status_line(w, key), want, "worker {w}");
        }
    }
    // The backend's threads are all filtered too.
    for key in ["Seccomp: 2", "NoNewPrivs: 1"] {
        assert_eq!(
            status_line(backend, key.split(' ').next().unwrap_or_default()),
            key
        );
    }

    // Kill the worker of a's VM (not through the backend: a crash). Which worker is a's:
    // the one whose death fails a's work.
    let before = api.metrics().expect("metrics");
    let crashed_before = metric(
        &before,
        "vgpu_gpu_worker_losses_by_kind_total{kind=\"crashed\"}",
    )
    .unwrap_or(0.0);
    let victim = workers[0];
    // SAFETY: kill(2) of a worker process this test's backend started.
    let rc = unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    assert_eq!(rc, 0);
    wait_for("the killed worker reaped", || !exists(victim));
    let (a_failed, b_failed) = (
        run_workloads(&ctx_a, &["saxpy"]).is_err(),
        run_workloads(&ctx_b, &["saxpy"]).is_err(),
    );
    assert!(a_failed ^ b_failed, "exactly one VM lost its GPU");
    let (lost_ctx, lost_dev, lost_vm, kept_ctx) = if a_failed {
        (ctx_a, dev_a, "a", ctx_b)
    } else {
        (ctx_b, dev_b, "b", ctx_a)
    };
    run_workloads(&kept_ctx, &["saxpy", "reduction"]).expect("the other VM goes on");
    // The VM resets (reconnects) and runs on a new worker.
    drop((lost_ctx, lost_dev));
    if lost_vm == "a" {
        lb_a.disconnect();
    } else {
        _lb_b.disconnect();
    }
    let (_lb, dev) = device(&d, lost_vm, 30);
    let ctx = dev.create_context().expect("ctx after the reset");
    run_workloads(&ctx, &["saxpy", "reduction", "copy_heavy"]).expect("after the reset");
    // Counted once replaced, as a crash: its status came through the launcher.
    let t = Instant::now();
    let mut m = String::new();
    while t.elapsed() < Duration::from_secs(20) {
        m = api.metrics().expect("metrics");
        if metric(&m, "vgpu_gpu_worker_losses_by_kind_total{kind=\"crashed\"}")
            == Some(crashed_before + 1.0)
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        metric(&m, "vgpu_gpu_worker_losses_by_kind_total{kind=\"crashed\"}"),
        Some(crashed_before + 1.0),
        "the loss counted as a crash: {}",
        m.lines()
            .filter(|l| l.starts_with("vgpu_gpu_worker"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let now = children_of(launcher);
    assert_eq!(now.len(), 2, "{now:?}");
    assert!(!now.contains(&victim));
    drop((ctx, dev, kept_ctx));
    if let Err(e) = d.alive() {
        panic!("{e}");
    }

    // The backend's exit takes the launcher and every worker with it, reaped.
    let mut all = children_of(launcher);
    all.push(launcher);
    let status = d.terminate();
    assert!(status.success(), "{status:?}\n{}", d.log_tail());
    wait_for("no launcher or worker left", || {
        all.iter().all(|p| !exists(*p))
    });
    let log = d.log();
    assert!(log.contains("seccomp: kill"), "{log}");
}

/// Running (not gone, not a zombie waiting for whoever inherited it).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit(')').next().map(|r| r.trim_start().to_string()))
        .is_some_and(|r| !r.starts_with('Z'))
}

/// A backend killed outright (no shutdown) takes its launcher and workers with it: the
/// launcher's parent-death signal, then each worker's.
#[test]
fn a_killed_backend_leaves_no_launcher_or_worker_running() {
    let (d, _launcher) = start("seccomp-workers-kill");
    let (_lb, dev) = device(&d, "a", 10);
    let ctx = dev.create_context().expect("ctx");
    run_workloads(&ctx, &["saxpy"]).expect("a");
    let launcher = children_of(d.pid())[0];
    let mut all = children_of(launcher);
    assert_eq!(all.len(), 1, "{all:?}");
    all.push(launcher);
    drop(d); // SIGKILL, reaped.
    wait_for("no launcher or worker running", || {
        all.iter().all(|p| !running(*p))
    });
}

/// `--gpu-workers=process` on the real binary under `kill`: two guest processes of one VM
/// run verified work on two sandboxed workers of the launcher; the API and `/metrics` show
/// the granularity and the VM's workers; killing one process's worker fails that process
/// only, counted for its VM; each process's last context takes its worker with it.
#[test]
fn a_worker_per_guest_process_through_the_sandboxed_backend() {
    let (mut d, launcher_cfg) = start_with("seccomp-wproc", Some("--gpu-workers=process"));
    let api = d.api();
    let launcher = children_of(d.pid())[0];
    let (lb, dev1) = device(&d, "b", 41);
    let dev2 = Device::loopback(lb.clone(), 42).expect("device");
    let (ctx1, ctx2) = (
        dev1.create_context().expect("ctx 41"),
        dev2.create_context().expect("ctx 42"),
    );
    run_workloads(&ctx1, &["saxpy"]).unwrap();
    run_workloads(&ctx2, &["saxpy"]).unwrap();
    let workers = children_of(launcher);
    assert_eq!(workers.len(), 2, "a worker per process: {workers:?}");
    for w in &workers {
        assert_eq!(status_line(*w, "Seccomp:"), "Seccomp: 2");
    }
    let info = api.info().expect("info").gpu_workers.expect("gpu_workers");
    assert_eq!(info.granularity, "process");
    assert_eq!(info.vms.get("b").map(|v| v.running), Some(2), "{info:?}");
    let m = api.metrics().expect("metrics");
    assert_eq!(
        metric(&m, "vgpu_vm_gpu_workers_running{vm=\"b\"}"),
        Some(2.0)
    );
    // `VGPUCTL_BIN`: the binary beside the backend on a machine without this build tree.
    let vgpuctl =
        std::env::var_os("VGPUCTL_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_vgpuctl").into());
    let ctl = std::process::Command::new(vgpuctl)
        .arg("--socket")
        .arg(launcher_cfg.dir().join("api.sock"))
        .arg("info")
        .output()
        .expect("vgpuctl");
    let text = String::from_utf8_lossy(&ctl.stdout);
    assert!(
        text.contains("a worker per guest process: 2 running") && text.contains("vm b"),
        "vgpuctl info: {text}"
    );

    // Either process's worker: exactly one process fails and the other verifies on.
    let victim = workers[0];
    // SAFETY: kill(2) on a pid this test just saw as the launcher's child.
    assert_eq!(unsafe { libc::kill(victim as i32, libc::SIGKILL) }, 0);
    wait_for("the loss counted", || {
        api.info()
            .ok()
            .and_then(|i| i.gpu_workers)
            .is_some_and(|w| w.vms.get("b").is_some_and(|v| v.running == 1))
    });
    let r1 = run_workloads(&ctx1, &["saxpy"]);
    let r2 = run_workloads(&ctx2, &["saxpy"]);
    assert!(
        r1.is_err() != r2.is_err(),
        "one process fails, the other goes on: {r1:?} {r2:?}"
    );
    let (failed, ok_ctx) = if r1.is_err() {
        (ctx1, ctx2)
    } else {
        (ctx2, ctx1)
    };
    run_workloads(&ok_ctx, &["saxpy", "reduction"]).unwrap();
    drop(failed);
    wait_for("the lost worker let go of and counted", || {
        metric(
            &api.metrics().unwrap_or_default(),
            "vgpu_vm_gpu_worker_losses_total{vm=\"b\",kind=\"crashed\"}",
        ) == Some(1.0)
    });
    drop(ok_ctx);
    wait_for("no worker once no process has a context", || {
        children_of(launcher).is_empty()
    });
    drop((dev1, dev2, lb));

    // VRAM pressure across two processes' workers of VM a (16 MiB quota, 32 MiB swap):
    // 24 MiB between them, 8 MiB or more in the swap store. Which process's chunks are out
    // depends on timing (the later allocations spill; the VRAM manager's LRU exchange may
    // trade chunks as the checks read them), so the process with chunks out keeps its
    // buffers and the other frees its own: the kept 12 MiB fit the quota, and every
    // chunk of it comes back into VRAM, into its own process's worker; every byte checked.
    let (_lb_a, dev51) = device(&d, "a", 51);
    let dev52 = Device::loopback(_lb_a.clone(), 52).expect("device");
    let (ctx51, ctx52) = (
        dev51.create_context().expect("ctx 51"),
        dev52.create_context().expect("ctx 52"),
    );
    let before = api.vm_stats("a").expect("stats").vram;
    let bufs51 = fill_buffers(&ctx51, 3, 0x20);
    let bufs52 = fill_buffers(&ctx52, 3, 0x40);
    let v = api.vm_stats("a").expect("stats").vram;
    assert!(v.swapped_bytes >= 8 * MIB, "{v:?}");
    check_buffers(&bufs51, 0x20);
    check_buffers(&bufs52, 0x40);
    let v = api.vm_stats("a").expect("stats").vram;
    let out = |pid| {
        v.processes
            .iter()
            .find(|p| p.pid == pid)
            .map_or(0, |p| p.swapped_bytes)
    };
    let (kept, seed) = if out(51) >= out(52) {
        drop(bufs52);
        (bufs51, 0x20)
    } else {
        drop(bufs51);
        (bufs52, 0x40)
    };
    wait_for("a's chunks back in VRAM", || {
        api.vm_stats("a")
            .is_ok_and(|s| s.vram.swapped_bytes == 0 && s.vram.swap_ins > before.swap_ins)
    });
    check_buffers(&kept, seed);
    run_workloads(&ctx51, &["saxpy"]).unwrap();
    run_workloads(&ctx52, &["saxpy"]).unwrap();
    drop((kept, ctx51, ctx52));
    let status = d.terminate();
    assert!(status.success(), "{status:?}\n{}", d.log_tail());
}
