//! What two workers lose when the GPU time-slices their contexts: the same saxpy kernels
//! in VRAM run by one worker alone, then split between two workers running at once;
//! prints kernels per second of each and the ratio (issue 30, "time-slicing").
//!
//! `cargo run --release -p vgpu-gpu-worker --example worker_timeslice -- GPU [KERNELS]`

#[path = "../../host-shim/tests/common/mod.rs"]
mod common;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::*;
use vgpu_gpu_worker::{Ids, WorkerGpu, WorkerOptions, WorkerProgram};
use vgpu_host_shim::{Gpu, MapFlags, MapTarget, PageSize};
use vgpu_protocol::KernelArgs;

const VRAM_VA: u64 = 0x20_0000_0000;
/// Floats per buffer (64 MiB each).
const N: u64 = 16 << 20;

fn start(gpu: &str, ids: &Arc<Ids>) -> Arc<WorkerGpu> {
    let bin = std::env::var_os("VGPU_GPU_WORKER").map_or_else(
        || {
            std::env::current_exe()
                .expect("this program")
                .parent()
                .and_then(|d| d.parent())
                .expect("target dir")
                .join("vgpu-gpu-worker")
        },
        Into::into,
    );
    let prog = WorkerProgram {
        program: bin,
        args: ["--gpu", gpu, "--vram-mib", "512", "--max-channels", "8"]
            .map(String::from)
            .to_vec(),
    };
    let opts = WorkerOptions {
        ids: ids.clone(),
        ..WorkerOptions::default()
    };
    WorkerGpu::start(&prog, &opts).expect("worker")
}

/// A context on worker `w` with two VRAM buffers mapped at `VRAM_VA`, set up once: a
/// second context would need a new guest memory table, which a worker takes only while
/// no context lives.
fn setup(w: &Arc<WorkerGpu>) -> Proc<WorkerGpu> {
    let p = Proc::new(w, SYS_BASE);
    let bytes = 2 * N * 4;
    let buf = w.alloc_vram(bytes, 2 << 20).unwrap();
    w.map(
        p.ctx,
        VRAM_VA,
        bytes,
        MapTarget::Vram { offset: buf.offset },
        PageSize::Huge2M,
        MapFlags::default(),
    )
    .unwrap();
    p
}

/// Runs `kernels` saxpys over the two VRAM buffers, in batches, starting when everyone at
/// `start` is ready; returns the seconds they took.
fn run(p: &Proc<WorkerGpu>, kernels: u32, start: &Barrier) -> f64 {
    let mut ch = p.channel(0);
    let saxpy = KernelArgs::Saxpy {
        x: VRAM_VA,
        y: VRAM_VA + N * 4,
        n: N,
        a: 1.0001,
    };
    // Warm up (first launch, clocks).
    let m = ch.launch(&saxpy);
    ch.submit(&[m]);
    ch.wait_idle(Duration::from_secs(30)).unwrap();
    start.wait();
    let t = Instant::now();
    let mut left = kernels;
    while left > 0 {
        let batch = left.min(8);
        let ms: Vec<_> = (0..batch).map(|_| ch.launch(&saxpy)).collect();
        ch.submit(&ms);
        left -= batch;
        // Keep a few entries queued, never the whole ring.
        while ch
            .put
            .wrapping_sub(ch.ctrl.load(vgpu_protocol::ControlPage::GP_GET))
            > 4
        {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    ch.wait_idle(Duration::from_secs(60)).unwrap();
    t.elapsed().as_secs_f64()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let gpu = args.get(1).cloned().unwrap_or_else(|| "cuda".into());
    let kernels: u32 = args.get(2).and_then(|k| k.parse().ok()).unwrap_or(4000);
    let ids = Arc::new(Ids::default());
    let (a, b) = (start(&gpu, &ids), start(&gpu, &ids));
    let (a, b) = (Arc::new(setup(&a)), Arc::new(setup(&b)));
    let alone = run(&a, kernels, &Barrier::new(1));
    let (a2, b2) = (a.clone(), b.clone());
    let go = Arc::new(Barrier::new(2));
    let g2 = go.clone();
    let ta = std::thread::spawn(move || run(&a2, kernels / 2, &go));
    let tb = std::thread::spawn(move || run(&b2, kernels / 2, &g2));
    let (sa, sb) = (ta.join().unwrap(), tb.join().unwrap());
    // Both started together; the pair is done when the later one is.
    let both = sa.max(sb);
    let one_rate = f64::from(kernels) / alone;
    let two_rate = f64::from(kernels) / both;
    println!(
        "worker_timeslice gpu={gpu} kernels={kernels} saxpy_n={N} one_worker_kps={one_rate:.1} two_workers_kps={two_rate:.1} two_over_one={:.3} (a {sa:.3} s, b {sb:.3} s, alone {alone:.3} s)",
        two_rate / one_rate
    );
}
