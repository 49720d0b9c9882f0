//! The `vgpu-backend` binary under its default seccomp filters (`--seccomp kill`): a VM
//! workload over the real vhost-user socket through the loopback VMM, VRAM swapping,
//! control-API requests (a scheduler restart among them), a disconnect and a reconnect,
//! and a clean shutdown on SIGTERM. A syscall the filters lack kills the daemon with
//! SIGSYS, which this test sees as a failed request or a non-zero exit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vgpu_backend::api::client::ApiClient;
use vgpu_backend::api::types::VmVramBody;
use vgpu_guest::workloads::Workload;
use vgpu_guest::{Buffer, Context, Device, KernelArgs};
use vgpu_host_shim::kernels::reference;
use vgpu_loopback::LoopbackVm;
use vgpu_test_support::{BackendLauncher, BackendProcess};
use vgpu_vmm::reconnect::FaultPolicy;

const MIB: u64 = 1 << 20;

/// The daemon and the directory of its sockets and log.
struct Daemon {
    process: BackendProcess,
    _launcher: BackendLauncher,
}

impl Daemon {
    /// Starts the binary on a config with two VMs on a 32 MiB GPU, each with 32 MiB of
    /// swap, and the control API; `extra` flags go after `--config`. The GPU is the sim
    /// unless `VGPU_TEST_GPU` names another (`cuda`: the same test on a real GPU, see
    /// docs/testing.md); `VGPU_BACKEND_BIN` runs the test against another build, e.g.
    /// the static (musl) binary the nested rig uses.
    fn start(tag: &str, extra: &[&str]) -> Daemon {
        let model = std::env::var("VGPU_TEST_GPU").unwrap_or_else(|_| "sim".into());
        // On `cuda`: the backend's own context (its roles are what this test checks;
        // `sandboxed_workers.rs` checks the workers, `cuda`'s default).
        let mut args = if model.starts_with("cuda") {
            vec!["--gpu-workers=off"]
        } else {
            Vec::new()
        };
        args.extend_from_slice(extra);
        let launcher = BackendLauncher::new(
            tag,
            &format!(
                "[gpu]\nmodel = \"{model}\"\nvram_mib = 32\n\
                 [scheduler]\npolicy = \"fair\"\ninterval_ms = 10\n\
                 [[vm]]\nname = \"a\"\nswap_mib = 32\n[[vm]]\nname = \"b\"\nswap_mib = 32\n"
            ),
        )
        .bin(env!("CARGO_BIN_EXE_vgpu-backend"))
        .with_api()
        .args(&args);
        Daemon {
            process: launcher.start(),
            _launcher: launcher,
        }
    }

    fn log(&self) -> String {
        self.process.log()
    }

    fn connect(&self, vm: &str) -> Arc<LoopbackVm> {
        self.process.connect(vm, FaultPolicy::default())
    }

    /// Still running? (A seccomp kill ends it with SIGSYS.)
    fn assert_alive(&mut self, at: &str) {
        if let Err(e) = self.process.alive() {
            panic!("daemon died {at}: {e}");
        }
    }
}

/// VM `vm`'s VRAM figures once `pred` holds (or after 10 s).
fn wait_vram(api: &ApiClient, vm: &str, pred: impl Fn(&VmVramBody) -> bool) -> VmVramBody {
    let t0 = Instant::now();
    loop {
        let v = api.vm_stats(vm).expect("stats").vram;
        if pred(&v) || t0.elapsed() > Duration::from_secs(10) {
            return v;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
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

/// Checks each buffer of [`fill_buffers`] by a GPU checksum at its unchanged address and
/// through the CPU aperture.
fn check_buffers(ctx: &Context, bufs: &[Buffer], seed: u8) {
    let mut ch = ctx.create_channel().expect("channel");
    let sum = ctx.alloc_host(4096).expect("host buffer");
    for (i, b) in bufs.iter().enumerate() {
        let want = vec![seed + i as u8; b.len() as usize];
        ch.launch(
            &KernelArgs::Checksum {
                src: b.gpu_va(),
                len: b.len(),
                dst: sum.gpu_va(),
            },
            [1, 1, 1],
        )
        .expect("launch");
        let f = ch.submit().expect("submit");
        ch.wait(f).expect("wait");
        assert_eq!(sum.read_u64(0).expect("sum"), reference::checksum(&want));
        let mut got = vec![0u8; want.len()];
        b.read(0, &mut got).expect("read");
        assert!(got == want, "buffer {i} changed");
    }
}

fn run_workloads(ctx: &Context, names: &[&str]) {
    for name in names {
        let r = Workload::by_name(name, true)
            .expect("workload")
            .run(ctx)
            .expect(name);
        assert!(r.verified, "{name}");
    }
}

/// One session of both VMs: workloads, VRAM pressure that swaps VM `a` out and back in,
/// operator requests while the guests hold GPU state, then a disconnect.
fn run_session(d: &mut Daemon, api: &ApiClient) {
    let before = api.vm_stats("a").expect("stats a").vram;
    let (a, b) = (d.connect("a"), d.connect("b"));
    let dev_a = Device::loopback(a.clone(), 100).expect("device a");
    let dev_b = Device::loopback(b.clone(), 200).expect("device b");
    let (ctx_a, ctx_b) = (
        dev_a.create_context().expect("ctx a"),
        dev_b.create_context().expect("ctx b"),
    );
    run_workloads(&ctx_a, &["saxpy", "reduction", "copy_heavy"]);
    run_workloads(&ctx_b, &["sgemm", "hotspot"]);
    // 24 MiB for A, then 16 MiB for B on a 32 MiB GPU: the VRAM manager evicts A's
    // chunks (over its half) to give B its share.
    let bufs_a = fill_buffers(&ctx_a, 6, 0x10);
    check_buffers(&ctx_a, &bufs_a, 0x10);
    let bufs_b = fill_buffers(&ctx_b, 4, 0x40);
    let v = wait_vram(api, "a", |v| v.evictions > before.evictions);
    assert!(v.evictions > before.evictions, "{v:?}\n{}", d.log());
    check_buffers(&ctx_a, &bufs_a, 0x10);
    check_buffers(&ctx_b, &bufs_b, 0x40);
    // Both VMs keep the GPU busy at weights 100:300 until the fair scheduler has shadowed
    // channels (SHMEM_MAP of shadow pages from the scheduler's thread).
    api.set_weight("b", 300).expect("weight");
    let shadows = api.scheduler().expect("scheduler").stats.shadows;
    let contend = |ctx: &Context| {
        let t0 = Instant::now();
        // Ends at the first shadow (under a second alone); a CI machine busy with other
        // builds once needed more than 3 s.
        while t0.elapsed() < Duration::from_secs(15)
            && api.scheduler().expect("scheduler").stats.shadows == shadows
        {
            run_workloads(ctx, &["throttle"]);
        }
    };
    std::thread::scope(|s| {
        s.spawn(|| contend(&ctx_a));
        s.spawn(|| contend(&ctx_b));
    });
    let st = api.scheduler().expect("scheduler").stats;
    assert!(st.shadows > shadows, "{st:?}");
    // Operator requests: pause/resume, the scheduler restarted from an API thread
    // (twice), metrics.
    api.pause("b").expect("pause");
    api.resume("b").expect("resume");
    api.set_scheduler(&serde_json::json!({"policy": "timeslice", "slice_ms": 5}))
        .expect("scheduler");
    api.set_scheduler(&serde_json::json!({"policy": "fair", "interval_ms": 10}))
        .expect("scheduler");
    assert!(api.metrics().expect("metrics").contains("vgpu_vm_weight"));
    // B's VRAM freed: A is swapped back in.
    drop(bufs_b);
    let v = wait_vram(api, "a", |v| v.swapped_bytes == 0);
    assert!(
        v.swap_ins > before.swap_ins && v.swapped_bytes == 0,
        "{v:?}"
    );
    check_buffers(&ctx_a, &bufs_a, 0x10);
    drop((bufs_a, ctx_a, ctx_b, dev_a, dev_b));
    a.disconnect();
    b.disconnect();
}

/// Each thread of process `pid`: (name, the lines of its /proc status named in `keys`).
fn thread_status(pid: u32, keys: &[&str]) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        let Ok(status) = std::fs::read_to_string(t.path().join("status")) else {
            continue;
        };
        let name = status
            .lines()
            .find_map(|l| l.strip_prefix("Name:"))
            .unwrap_or("?")
            .trim()
            .to_string();
        let lines = status
            .lines()
            .filter(|l| keys.iter().any(|k| l.starts_with(k)))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect();
        out.push((name, lines));
    }
    out
}

fn on_real_gpu() -> bool {
    std::env::var("VGPU_TEST_GPU").is_ok_and(|g| g != "sim")
}

#[test]
fn daemon_under_default_seccomp_serves_vms() {
    let mut d = Daemon::start("seccomp-kill", &[]);
    let api = d.process.api();
    // Every thread: in seccomp filter mode with its role's filters stacked over the
    // process filter, no new privileges, no capabilities (this matters when run as root).
    let _a = d.connect("a");
    let threads = thread_status(
        d.process.pid(),
        &[
            "Seccomp",
            "Seccomp_filters",
            "NoNewPrivs",
            "CapEff",
            "CapPrm",
            "CapBnd",
        ],
    );
    drop(_a);
    assert!(threads.len() >= 8, "{threads:?}");
    for (name, lines) in &threads {
        let has = |l: &str| lines.iter().any(|x| x == l);
        assert!(
            has("Seccomp: 2") && has("NoNewPrivs: 1"),
            "{name}: {lines:?}"
        );
        assert!(
            has("CapEff: 0000000000000000")
                && has("CapPrm: 0000000000000000")
                && has("CapBnd: 0000000000000000"),
            "{name}: {lines:?}"
        );
        // The process filter and the role's, each an allow-list and its refused opens.
        // On a real GPU opening files is not refused (the driver opens its device nodes
        // at any time), so each is one program; and the driver starts threads of its own
        // (`cuda-EvtHandlr`, …, or unnamed ones that carry the process's name), held to the filters
        // of the thread that started them: at least the process filter.
        let filters = lines
            .iter()
            .find_map(|l| l.strip_prefix("Seccomp_filters: "))
            .and_then(|n| n.parse::<u32>().ok());
        let ours = name != "vgpu-backend"
            && (name.starts_with("vgpu") || name == "cuda-pfifo" || name == "vring_worker");
        let want = match (on_real_gpu(), ours) {
            (false, _) => 4,
            (true, true) => 2,
            (true, false) => 1,
        };
        assert!(filters >= Some(want), "{name}: {lines:?}");
    }
    run_session(&mut d, &api);
    d.assert_alive("after the first session");
    // A reconnect after the disconnect: the VM threads start over under their filters.
    run_session(&mut d, &api);
    d.assert_alive("after the second session");
    let status = d.process.terminate();
    let log = d.log();
    assert!(status.success(), "{status:?}\n{log}");
    assert!(log.contains("seccomp: kill"), "{log}");
}
