//! The GPU turn between worker processes (on the CPU fake device, where two workers' spin
//! kernels really run at the same time, as two contexts time-sliced on a GPU seem to):
//! without the turn both workers are charged for the same wall time; with it they take
//! the GPU one at a time, the busy time charged adds up to no more than the time that
//! passed, and the turn passes back and forth so both make progress.

#[path = "../../host-shim/tests/common/mod.rs"]
mod common;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::*;
use vgpu_gpu_worker::{Ids, TurnSlots, WorkerGpu, WorkerOptions, WorkerProgram};

const KERNEL_NS: u64 = 1_000_000;
const KERNELS: u32 = 300;

fn start(ids: &Arc<Ids>, turn: Option<Arc<TurnSlots>>) -> Arc<WorkerGpu> {
    let prog = WorkerProgram {
        program: env!("CARGO_BIN_EXE_vgpu-gpu-worker").into(),
        args: [
            "--gpu",
            "cuda-fake",
            "--vram-mib",
            "16",
            "--max-channels",
            "8",
        ]
        .map(String::from)
        .to_vec(),
    };
    let opts = WorkerOptions {
        ids: ids.clone(),
        turn,
        ..WorkerOptions::default()
    };
    WorkerGpu::start(&prog, &opts).expect("worker")
}

/// Runs `KERNELS` 1 ms spins on one channel of `w`, a few queued at a time; returns the
/// channel's busy time.
fn run(w: &Arc<WorkerGpu>, go: &Barrier) -> u64 {
    let p = Proc::new(w, SYS_BASE);
    let mut ch = p.channel(0);
    go.wait();
    let mut left = KERNELS;
    while left > 0 {
        let ms: Vec<_> = (0..left.min(4))
            .map(|_| ch.launch(&spin(KERNEL_NS)))
            .collect();
        ch.submit(&ms);
        left -= ms.len() as u32;
        while ch
            .put
            .wrapping_sub(ch.ctrl.load(vgpu_protocol::ControlPage::GP_GET))
            > 8
        {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    ch.wait_idle(Duration::from_secs(60))
        .expect("the spins complete");
    counters_after(&**w, ch.id, ch.put as u64).busy_ns
}

/// Two workers at once: (wall seconds, busy seconds of each).
fn pair(turn: Option<Arc<TurnSlots>>) -> (f64, [f64; 2]) {
    let ids = Arc::new(Ids::default());
    let (a, b) = (start(&ids, turn.clone()), start(&ids, turn));
    let go = Arc::new(Barrier::new(3));
    let t: Vec<_> = [a, b]
        .into_iter()
        .map(|w| {
            let go = go.clone();
            std::thread::spawn(move || run(&w, &go))
        })
        .collect();
    go.wait();
    let t0 = Instant::now();
    let busy: Vec<u64> = t.into_iter().map(|t| t.join().unwrap()).collect();
    let wall = t0.elapsed().as_secs_f64();
    (wall, [busy[0] as f64 / 1e9, busy[1] as f64 / 1e9])
}

#[test]
fn with_the_turn_workers_take_the_gpu_one_at_a_time_and_are_charged_once() {
    let (wall, busy) = pair(None);
    println!("without the turn: wall {wall:.3} s, busy {busy:.3?} s");
    assert!(
        busy[0] + busy[1] > 1.5 * wall,
        "the fake runs two workers' spins at once: both are charged for the same time"
    );

    let turn = TurnSlots::new(2000).unwrap();
    let (wall, busy) = pair(Some(turn.clone()));
    let takes = turn.takes();
    println!("with the turn: wall {wall:.3} s, busy {busy:.3?} s, {takes} takes");
    let sum = busy[0] + busy[1];
    assert!(
        sum <= wall * 1.05,
        "one at a time: {sum:.3} s charged in {wall:.3} s"
    );
    // Each ran all of its spins: its busy time is about what it asked for.
    let want = KERNELS as f64 * KERNEL_NS as f64 / 1e9;
    for b in busy {
        assert!(b >= want * 0.95, "busy {b:.3} s, spins of {want:.3} s");
    }
    // The turn went back and forth (a 2 ms quantum in ~0.3 s of work each), not once.
    assert!(takes >= 20, "only {takes} takes");
}

#[test]
fn a_killed_holder_does_not_stop_the_other_worker() {
    let ids = Arc::new(Ids::default());
    let turn = TurnSlots::new(2000).unwrap();
    let (a, b) = (
        start(&ids, Some(turn.clone())),
        start(&ids, Some(turn.clone())),
    );
    // a takes the turn with a long spin, then dies with it.
    let pa = Proc::new(&a, SYS_BASE);
    let mut ca = pa.channel(0);
    let m = ca.launch(&spin(5_000_000_000));
    ca.submit(&[m]);
    std::thread::sleep(Duration::from_millis(100));
    a.kill();
    // b's spins run at once: its slot was cleared when the backend saw a lost.
    let pb = Proc::new(&b, SYS_BASE);
    let mut cb = pb.channel(0);
    let t0 = Instant::now();
    let ms: Vec<_> = (0..4).map(|_| cb.launch(&spin(KERNEL_NS))).collect();
    cb.submit(&ms);
    cb.wait_idle(Duration::from_secs(10))
        .expect("b's spins complete");
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(150),
        "b waited {took:?} behind a dead holder"
    );
}
