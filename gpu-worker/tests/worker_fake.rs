//! The worker boundary without a GPU: `vgpu-gpu-worker --gpu cuda-fake` (the whole `cuda`
//! GPU on the CPU fake device) in a process of its own, driven through [`WorkerGpu`] by
//! the same cases the in-process `cuda` GPU passes (host-shim's `cuda_cases`), plus what
//! only a process boundary has: a killed worker, a lying worker, reaping.

#[path = "../../host-shim/tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cuda_cases::*;
use common::kernels::T;
use common::*;
use vgpu_gpu_worker::{WorkerGpu, WorkerOptions, WorkerProgram};
use vgpu_host_shim::*;
use vgpu_protocol::{ErrorCode, KernelArgs};

fn program(gpu: &str) -> WorkerProgram {
    WorkerProgram {
        program: env!("CARGO_BIN_EXE_vgpu-gpu-worker").into(),
        args: ["--gpu", gpu, "--vram-mib", "64", "--max-channels", "64"]
            .map(String::from)
            .to_vec(),
    }
}

fn worker_of(gpu: &str) -> Arc<WorkerGpu> {
    WorkerGpu::start(&program(gpu), &WorkerOptions::default()).unwrap()
}

fn worker() -> Arc<WorkerGpu> {
    worker_of("cuda-fake")
}

#[test]
fn worker_every_kernel_on_system_memory() {
    every_kernel_on_system_memory(&worker());
}

#[test]
fn worker_every_kernel_on_vram() {
    every_kernel_on_vram(&worker());
}

#[test]
fn worker_host_copies_and_kernels_agree_on_vram() {
    host_copies_and_kernels_agree_on_vram(&worker());
}

#[test]
fn worker_batched_host_copies_move_many_chunks_exactly() {
    batched_host_copies_move_many_chunks_exactly(&worker());
}

#[test]
fn worker_hostile_pointers_fault_and_change_nothing() {
    hostile_pointers_fault_and_change_nothing(&worker());
}

#[test]
fn worker_semaphores_order_channels() {
    semaphores_order_channels(&worker());
}

#[test]
fn worker_resumed_channel_continues_at_its_saved_position() {
    resumed_channel_continues_at_its_saved_position(&worker());
}

#[test]
fn worker_fence_signals_before_its_batch_ends() {
    fence_signals_before_its_batch_ends(&worker());
}

#[test]
fn a_sim_in_a_worker_runs_the_same_kernels() {
    every_kernel_on_system_memory(&worker_of("sim"));
}

/// Counters come through the shared page within a publication period: a channel's 20
/// kernels show up, then its context's end takes the channel with it.
#[test]
fn worker_counters_arrive_and_teardown_takes_the_channels() {
    let g = worker();
    let p = Proc::new(&g, SYS_BASE);
    let mut ch = p.channel(0);
    for _ in 0..20 {
        let m = ch.launch(&spin(200_000));
        ch.submit(&[m]);
    }
    ch.wait_idle(T).unwrap();
    let deadline = Instant::now() + Duration::from_secs(2);
    let c = loop {
        let c = g.channel_counters(ch.id).unwrap();
        if c.gp_completed == 20 || Instant::now() > deadline {
            break c;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!((c.kernels, c.gp_completed), (20, 20));
    assert!(c.busy_ns >= 20 * 200_000, "busy {} ns", c.busy_ns);
    g.destroy_context(p.ctx).unwrap();
    assert!(g.channel_counters(ch.id).is_err());
    assert_eq!(g.channel_error(ch.id), Err(HalError::NoChannel(ch.id)));
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn process_exists(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// A worker killed mid-work (what a GPU fault does to its process) loses its own GPU
/// only: its channel gets a `DeviceLost` error event, its calls fail at once with
/// `DeviceLost`, and another worker's channel goes on with verified work.
#[test]
fn a_killed_worker_loses_its_gpu_and_no_other() {
    let (a, b) = (worker(), worker());
    let (pa, pb) = (Proc::new(&a, SYS_BASE), Proc::new(&b, SYS_BASE));
    let (mut ca, mut cb) = (pa.channel(0), pb.channel(0));
    let m = ca.launch(&spin(50_000_000));
    ca.submit(&[m]);
    a.kill();
    wait_for("a's DeviceLost event", || {
        ca.events.0.lock().unwrap().iter().any(|e| {
            matches!(e, GpuEvent::Error { channel, code: ErrorCode::DeviceLost, .. } if *channel == ca.id)
        })
    });
    assert!(a.is_lost());
    let t = Instant::now();
    assert!(matches!(
        a.alloc_vram(4096, 4096),
        Err(HalError::DeviceLost(_))
    ));
    assert!(matches!(
        a.create_context(pa.sys.clone()),
        Err(HalError::DeviceLost(_))
    ));
    assert!(
        // Far under the 30 s call timeout: a lost GPU does not wait for its worker.
        t.elapsed() < Duration::from_secs(5),
        "a lost GPU answers at once"
    );
    assert_eq!(a.channel_error(ca.id), Ok(Some((ErrorCode::DeviceLost, 0))));
    // b: a saxpy round, verified.
    let x: Vec<f32> = (0..4096).map(|i| i as f32).collect();
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    pb.poke(DATA_OFF, &bytes);
    let m = cb.launch(&KernelArgs::Saxpy {
        x: SYS_VA + DATA_OFF,
        y: SYS_VA + DATA_OFF,
        n: 4096,
        a: 1.0,
    });
    cb.submit(&[m]);
    cb.wait_idle(T).unwrap();
    let out = pb.peek(DATA_OFF, bytes.len());
    let got: Vec<f32> = out
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert!(got.iter().zip(&x).all(|(g, x)| *g == 2.0 * x));
    assert!(cb.events.0.lock().unwrap().is_empty(), "b saw no error");
    let pid = a.pid();
    drop((ca, pa, a));
    assert!(!process_exists(pid), "the killed worker was reaped");
}

/// A kernel that faults the GPU for good (acted out by the fake device: every later
/// call fails with CUDA's sticky `ILLEGAL_ADDRESS`): the worker exits, the backend counts
/// a GPU fault, the worker's channels get `DeviceLost`, and another worker goes on.
#[test]
fn a_worker_whose_gpu_faults_exits_and_counts_as_a_gpu_fault() {
    let mut prog = program("cuda-fake");
    // Late enough that a loaded machine has set the context up first (300 ms was not
    // always), and inside the spin below.
    prog.args
        .extend(["--test-fault-after-ms", "1500"].map(String::from));
    let a = WorkerGpu::start(&prog, &WorkerOptions::default()).unwrap();
    let b = worker();
    let (pa, pb) = (Proc::new(&a, SYS_BASE), Proc::new(&b, SYS_BASE));
    let (mut ca, mut cb) = (pa.channel(0), pb.channel(0));
    let m = ca.launch(&spin(10_000_000_000));
    ca.submit(&[m]);
    wait_for("a's DeviceLost event", || {
        ca.events.0.lock().unwrap().iter().any(|e| {
            matches!(e, GpuEvent::Error { channel, code: ErrorCode::DeviceLost, .. } if *channel == ca.id)
        })
    });
    // The worker's own stream may report the lost context (DeviceLost) before the
    // backend sees the worker exit.
    wait_for("a's worker lost", || a.is_lost());
    let pid = a.pid();
    wait_for("the faulted worker reaped", || !process_exists(pid));
    assert_eq!(a.loss_kind(), Some(vgpu_gpu_worker::LossKind::GpuFault));
    let m = cb.launch(&spin(1_000_000));
    cb.submit(&[m]);
    cb.wait_idle(T).expect("the other worker goes on");
    assert!(cb.events.0.lock().unwrap().is_empty(), "b saw no error");
}

/// A program that is not a worker, or one that answers with garbage, is refused at
/// start, and its process does not outlive the refusal.
#[test]
fn a_program_that_is_no_worker_is_refused_and_reaped() {
    let no = WorkerProgram {
        program: "/bin/true".into(),
        args: vec![],
    };
    assert!(WorkerGpu::start(&no, &WorkerOptions::default()).is_err());
    let liar = WorkerProgram {
        program: "/bin/sh".into(),
        args: vec![
            "-c".into(),
            "printf 'VGWK garbage' >&3; exec sleep 30".into(),
        ],
    };
    let t = Instant::now();
    let e = WorkerGpu::start(&liar, &WorkerOptions::default());
    assert!(e.is_err(), "a garbage greeting is refused");
    assert!(t.elapsed() < Duration::from_secs(5), "and not waited out");
    let silent = WorkerProgram {
        program: "/bin/sh".into(),
        args: vec!["-c".into(), "exec sleep 30".into()],
    };
    let opts = WorkerOptions {
        call_timeout: Duration::from_millis(300),
        ..WorkerOptions::default()
    };
    let t = Instant::now();
    assert!(
        WorkerGpu::start(&silent, &opts).is_err(),
        "a silent one times out"
    );
    assert!(t.elapsed() < Duration::from_secs(5));
}

/// A worker started by a thread that then ends (a VM's request thread at disconnect)
/// lives on: the parent-death signal is tied to the launcher thread, not the starter.
#[test]
fn a_worker_outlives_the_thread_that_started_it() {
    let g = std::thread::spawn(worker).join().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(!g.is_lost(), "the worker died with its starter thread");
    every_kernel_on_vram(&g);
}

/// A new memory table at the same guest addresses (a VM that reconnected) replaces the
/// worker's regions once no context uses the old ones, and is refused while one does:
/// the GPU never works on a previous connection's memory.
#[test]
fn a_new_memory_table_replaces_the_old_only_when_no_context_uses_it() {
    let g = worker();
    let old = Proc::new(&g, SYS_BASE);
    let sys = Arc::new(TestSysMem::new(SYS_BASE, SYS_LEN));
    assert!(
        matches!(g.create_context(sys.clone()), Err(HalError::Unsupported(_))),
        "a second table over a live context's"
    );
    g.destroy_context(old.ctx).unwrap();
    let new = Proc::new(&g, SYS_BASE);
    let mut ch = new.channel(0);
    let m = ch.launch(&KernelArgs::Memset {
        dst: SYS_VA + DATA_OFF,
        len: 4096,
        pattern: 0x5a5a_5a5a,
    });
    ch.submit(&[m]);
    ch.wait_idle(T).unwrap();
    assert_eq!(new.peek(DATA_OFF, 4096), vec![0x5a; 4096], "the new memory");
    assert_eq!(old.peek(DATA_OFF, 4096), vec![0; 4096], "not the old one");
}

/// The fds of `pid` above stderr that are pipes, as `pipe:[inode]` (0–2 are shared on
/// purpose: the worker logs to the backend's stderr).
fn pipes_of(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .parse::<u32>()
                .is_ok_and(|n| n > 2)
        })
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|l| l.to_string_lossy().into_owned())
        .filter(|l| l.starts_with("pipe:"))
        .collect()
}

#[test]
fn a_worker_inherits_no_fd_of_the_backend_but_its_own() {
    // A pipe opened without close-on-exec, as a migration's state pipe or another VM's
    // memory might be: a worker started meanwhile must not hold it.
    let mut fds = [0i32; 2];
    // SAFETY: pipe(2) into a two-element array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let ours = pipes_of(std::process::id());
    let w = worker();
    let theirs = pipes_of(w.pid());
    for p in &theirs {
        assert!(!ours.contains(p), "the worker inherited {p}");
    }
    drop(w);
    // SAFETY: closing the two fds opened above, once.
    unsafe {
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
}

#[test]
fn worker_module_vector_adds() {
    common::module_cases::module_vector_adds(&worker());
}

#[test]
fn worker_module_global_round_trip() {
    common::module_cases::module_global_round_trip(&worker());
}

#[test]
fn worker_module_hostile_inputs() {
    common::module_cases::module_hostile_inputs(&worker());
}

/// A guest's module kernel that writes a wild pointer faults its worker's context: the
/// worker exits (a GPU fault), and another worker keeps running verified work.
#[test]
fn worker_module_wild_write_loses_its_worker_only() {
    let (a, b) = (worker(), worker());
    let lost = || a.is_lost();
    common::module_cases::module_wild_write_loses_the_context(&a, &lost);
    let pid = a.pid();
    wait_for("the faulted worker reaped", || !process_exists(pid));
    assert_eq!(a.loss_kind(), Some(vgpu_gpu_worker::LossKind::GpuFault));
    common::module_cases::module_vector_adds(&b);
}
