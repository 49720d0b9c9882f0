//! Workers started by the launcher process (what a backend under seccomp does:
//! `vgpu_gpu_worker::launcher`), on the fake device: they run the GPU's cases, are the
//! launcher's children under their own seccomp filter with no privileges and only their
//! own fds, their ends reach this side with how they ended, and the launcher runs
//! nothing but its worker.

#[path = "../../host-shim/tests/common/mod.rs"]
mod common;

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use common::cuda_cases::*;
use common::*;
use vgpu_gpu_worker::launcher::start_process_launcher;
use vgpu_gpu_worker::{LossKind, WorkerGpu, WorkerOptions, WorkerProgram};
use vgpu_host_shim::Gpu;

const BIN: &str = env!("CARGO_BIN_EXE_vgpu-gpu-worker");

/// What the launcher runs.
fn base() -> WorkerProgram {
    WorkerProgram {
        program: BIN.into(),
        args: ["--gpu", "cuda-fake", "--seccomp", "kill"]
            .map(String::from)
            .to_vec(),
    }
}

fn program(extra: &[&str]) -> WorkerProgram {
    let mut p = base();
    p.args.extend(
        ["--vram-mib", "64", "--max-channels", "64"]
            .iter()
            .chain(extra)
            .map(|s| s.to_string()),
    );
    p
}

/// The launcher of this test process, started once from a thread that lives as long as
/// the process (its parent-death signal is tied to the thread that forked it).
fn launcher_pid() -> u32 {
    static PID: OnceLock<u32> = OnceLock::new();
    *PID.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let pid = start_process_launcher(BIN.as_ref(), &["launcher".into()], &base())
                .expect("the launcher");
            tx.send(pid).unwrap();
            loop {
                std::thread::park();
            }
        });
        rx.recv().unwrap()
    })
}

fn worker_with(extra: &[&str]) -> Arc<WorkerGpu> {
    launcher_pid();
    WorkerGpu::start(&program(extra), &WorkerOptions::default()).unwrap()
}

fn worker() -> Arc<WorkerGpu> {
    worker_with(&[])
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn process_exists(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// The `status` lines of `pid` starting with `key`.
fn status_line(pid: u32, key: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
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

/// The processes whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|c| parent_of(*c) == Some(pid))
        .collect()
}

/// `pid`'s fds and what each is (`socket:[…]`, `anon_inode:[pidfd]`, `/memfd:…`).
fn fds_of(pid: u32) -> Vec<(u32, String)> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let n = e.file_name().to_str()?.parse().ok()?;
            let l = std::fs::read_link(e.path()).ok()?;
            Some((n, l.to_string_lossy().into_owned()))
        })
        .collect()
}

#[test]
fn a_launched_worker_runs_the_gpu_cases() {
    every_kernel_on_system_memory(&worker());
    every_kernel_on_vram(&worker());
    host_copies_and_kernels_agree_on_vram(&worker());
    hostile_pointers_fault_and_change_nothing(&worker());
}

#[test]
fn a_launched_worker_is_sandboxed_with_only_its_own_fds() {
    // A pipe of ours without close-on-exec (another VM's memory or a migration's pipe
    // might be one): neither the launcher nor a worker may hold it.
    let mut pipe = [0i32; 2];
    // SAFETY: pipe(2) into a two-element array.
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    // (0–2 are shared on purpose: workers log to the backend's stderr.)
    let ours: Vec<String> = fds_of(std::process::id())
        .into_iter()
        .filter(|(n, l)| *n > 2 && l.starts_with("pipe:"))
        .map(|(_, l)| l)
        .collect();
    assert!(!ours.is_empty());
    // Two workers: the second must not inherit the launcher's fds for the first (its
    // status socket and pidfd) nor the launcher's socket to us.
    let (a, b) = (worker(), worker());
    let launcher = launcher_pid();
    for w in [&a, &b] {
        let pid = w.pid();
        assert_eq!(parent_of(pid), Some(launcher), "the launcher's child");
        for want in [
            "Seccomp: 2",
            "NoNewPrivs: 1",
            "CapEff: 0000000000000000",
            "CapPrm: 0000000000000000",
        ] {
            let key = want.split(' ').next().unwrap_or_default();
            assert_eq!(status_line(pid, key), want, "worker {pid}");
        }
        for (n, link) in fds_of(pid).into_iter().filter(|(n, _)| *n > 2) {
            assert!(!ours.contains(&link), "worker {pid} holds our {link}");
            assert!(
                n <= 4 || !(link.starts_with("socket:") || link.contains("pidfd")),
                "worker {pid}: fd {n} is {link}"
            );
        }
    }
    // The launcher holds its socket to us, and per worker a status socket and a pidfd.
    for (n, link) in fds_of(launcher).into_iter().filter(|(n, _)| *n > 2) {
        assert!(!ours.contains(&link), "the launcher holds our {link}");
        assert!(
            n <= 3 || link.starts_with("socket:") || link.contains("pidfd"),
            "launcher: fd {n} is {link}"
        );
    }
    drop((a, b));
    // SAFETY: closing the two fds opened above, once.
    unsafe {
        libc::close(pipe[0]);
        libc::close(pipe[1]);
    }
}

/// How a worker ended crosses from the launcher (its parent) to this side: a kill from
/// outside is a crash, the backend's kill a kill, a GPU fault (exit 75) a GPU fault; each
/// is reaped.
#[test]
fn launched_workers_report_how_they_ended() {
    let crashed = worker();
    // SAFETY: kill(2) of a worker process this test started.
    let rc = unsafe { libc::kill(crashed.pid() as i32, libc::SIGKILL) };
    assert_eq!(rc, 0);
    let killed = worker();
    killed.kill();
    let faulted = worker_with(&["--test-fault-after-ms", "100"]);
    let p = Proc::new(&faulted, SYS_BASE);
    let mut ch = p.channel(0);
    let m = ch.launch(&vgpu_protocol::KernelArgs::Memset {
        dst: SYS_VA + DATA_OFF,
        len: 4096,
        pattern: 1,
    });
    ch.submit(&[m]);
    wait_for("the fault", || faulted.is_lost());
    // The crash is seen at the next call.
    let _ = crashed.create_context(Arc::new(TestSysMem::new(SYS_BASE, SYS_LEN)));
    let pids = [crashed.pid(), killed.pid(), faulted.pid()];
    drop(ch);
    drop(p);
    // Reaped, and the kind refined by the status the launcher reported.
    for pid in pids {
        wait_for("the worker reaped", || !process_exists(pid));
    }
    let kinds: Vec<_> = [&crashed, &killed, &faulted]
        .iter()
        .map(|w| {
            let t = Instant::now();
            while w.loss_kind() == Some(LossKind::Exited) && t.elapsed() < Duration::from_secs(3) {
                std::thread::sleep(Duration::from_millis(5));
            }
            w.loss_kind()
        })
        .collect();
    drop((crashed, killed, faulted));
    assert_eq!(
        kinds,
        [
            Some(LossKind::Crashed),
            Some(LossKind::Killed),
            Some(LossKind::GpuFault)
        ]
    );
}

#[test]
fn the_launcher_runs_its_worker_only() {
    launcher_pid();
    let before = children_of(launcher_pid()).len();
    for bad in [
        // Another program.
        WorkerProgram {
            program: "/bin/sh".into(),
            args: base().args,
        },
        // Its worker, unsandboxed or on another GPU.
        program(&["--seccomp", "off"]),
        program(&["--seccomp=off"]),
        program(&["--gpu", "sim"]),
    ] {
        assert!(
            WorkerGpu::start(&bad, &WorkerOptions::default()).is_err(),
            "{bad:?}"
        );
    }
    assert!(children_of(launcher_pid()).len() <= before);
}
