//! The hostile-fault figure of issue 30, at the worker level: three "VMs" (a worker
//! each) run verified work while a fourth VM's worker is killed mid-kernel (what a GPU
//! fault does to its process) and replaced, CYCLES times. Prints each steady VM's rounds,
//! failures and share of the GPU time they used (from the workers' counters), and the
//! fourth's restarts (start to first verified kernel).
//!
//! `cargo run --release -p vgpu-gpu-worker --example worker_faults -- GPU [CYCLES] [kill|wild]`
//! (`wild`: instead of a SIGKILL the fourth worker runs a kernel that writes a wild
//! address, through the worker's test-only `--test-fault-after-ms`: a real GPU fault,
//! after which the worker finds its context lost and exits).
//! (GPU: `cuda`, `cuda:N`, or `cuda-fake` without a GPU; the `vgpu-gpu-worker` binary is
//! looked for in this example's target directory, or at `$VGPU_GPU_WORKER`).

#[path = "../../host-shim/tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::kernels::{data, f32s, from_f32s};
use common::*;
use vgpu_gpu_worker::{Ids, WorkerGpu, WorkerOptions, WorkerProgram};
use vgpu_host_shim::kernels::reference;
use vgpu_protocol::KernelArgs;

fn worker_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("VGPU_GPU_WORKER") {
        return p.into();
    }
    let exe = std::env::current_exe().expect("this program");
    // target/<profile>/examples/worker_faults -> target/<profile>/vgpu-gpu-worker
    exe.parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .join("vgpu-gpu-worker")
}

fn start(gpu: &str, n: u32, ids: &Arc<Ids>, fault_after_ms: Option<u64>) -> Arc<WorkerGpu> {
    let mut prog = WorkerProgram {
        program: worker_bin(),
        args: ["--gpu", gpu, "--vram-mib", "256", "--max-channels", "16"]
            .map(String::from)
            .to_vec(),
    };
    if let Some(ms) = fault_after_ms {
        prog.args
            .extend(["--test-fault-after-ms".to_string(), ms.to_string()]);
    }
    let opts = WorkerOptions {
        worker: n,
        ids: ids.clone(),
        ..WorkerOptions::default()
    };
    WorkerGpu::start(&prog, &opts).unwrap_or_else(|e| panic!("worker {n}: {e}"))
}

const N: usize = 1 << 16;

/// One verified saxpy on the process's system memory, with a spin kernel of `spin_ns`
/// before it (the load).
fn round(ch: &mut Chan, p: &Proc<WorkerGpu>, seed: u32, spin_ns: u64) -> bool {
    let x = data(N, seed);
    let y = data(N, seed + 1);
    p.poke(DATA_OFF, &f32s(&x));
    p.poke(DATA_OFF + (N as u64) * 4, &f32s(&y));
    let s = ch.launch(&spin(spin_ns));
    let m = ch.launch(&KernelArgs::Saxpy {
        x: SYS_VA + DATA_OFF,
        y: SYS_VA + DATA_OFF + (N as u64) * 4,
        n: N as u64,
        a: 1.5,
    });
    ch.submit(&[s, m]);
    if ch.wait_idle(Duration::from_secs(30)).is_err() {
        return false;
    }
    let mut want = y;
    reference::saxpy(1.5, &x, &mut want);
    from_f32s(&p.peek(DATA_OFF + (N as u64) * 4, N * 4)) == want
}

fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let gpu = args.get(1).cloned().unwrap_or_else(|| "cuda".into());
    let cycles: u32 = args.get(2).and_then(|c| c.parse().ok()).unwrap_or(100);
    let wild = args.get(3).is_some_and(|m| m == "wild");
    // The wild write lands this long after the worker starts: after its verified round
    // (a worker's start to its first verified kernel: ~0.3 s on an H100).
    let fault_after_ms = wild.then_some(if gpu == "cuda-fake" { 300 } else { 700 });
    let mut gpu_faults = 0u32;
    let ids = Arc::new(Ids::default());
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let steady: Vec<_> = (0..3u32)
        .map(|i| {
            let (gpu, ids, stop) = (gpu.clone(), ids.clone(), stop.clone());
            std::thread::spawn(move || {
                let w = start(&gpu, i, &ids, None);
                let p = Proc::new(&w, SYS_BASE);
                let mut ch = p.channel(0);
                let (mut ok, mut bad, mut seed) = (0u64, 0u64, 1000 * i);
                while !stop.load(Ordering::Relaxed) {
                    if round(&mut ch, &p, seed, 2_000_000) {
                        ok += 1;
                    } else {
                        bad += 1;
                        eprintln!("VM {i}: round {seed} FAILED");
                    }
                    seed += 1;
                }
                let busy = counters_after(&*w, ch.id, u64::from(ch.put)).busy_ns;
                (ok, bad, busy, w.is_lost())
            })
        })
        .collect();
    // Let the three settle before the faults start.
    std::thread::sleep(Duration::from_secs(2));
    let mut restart_ms = Vec::new();
    let mut recovered = 0;
    for c in 0..cycles {
        let t = Instant::now();
        let w = start(&gpu, 100 + c, &ids, fault_after_ms);
        let p = Proc::new(&w, SYS_BASE);
        let mut ch = p.channel(0);
        let good = round(&mut ch, &p, 7, 0);
        restart_ms.push(t.elapsed().as_secs_f64() * 1e3);
        recovered += u32::from(good);
        // A long kernel in flight, then the process dies.
        let m = ch.launch(&spin(50_000_000));
        ch.submit(&[m]);
        std::thread::sleep(Duration::from_millis(10));
        if !wild {
            w.kill();
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while !w.is_lost() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        if wild {
            // Its exit status is read when the event thread reaps it.
            let deadline = Instant::now() + Duration::from_secs(2);
            while w.loss_kind() != Some(vgpu_gpu_worker::LossKind::GpuFault)
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            gpu_faults += u32::from(w.loss_kind() == Some(vgpu_gpu_worker::LossKind::GpuFault));
        }
        drop((ch, p, w));
    }
    stop.store(true, Ordering::Relaxed);
    let results: Vec<_> = steady.into_iter().map(|t| t.join().unwrap()).collect();
    let total_busy: u64 = results.iter().map(|r| r.2).sum();
    println!(
        "worker_faults gpu={gpu} cycles={cycles} mode={} seconds={:.1}",
        if wild { "wild" } else { "kill" },
        t0.elapsed().as_secs_f64()
    );
    if wild {
        println!("faulting vm: gpu_faults_seen={gpu_faults}/{cycles}");
    }
    for (i, (ok, bad, busy, lost)) in results.iter().enumerate() {
        println!(
            "steady vm={i} rounds_ok={ok} rounds_failed={bad} gpu_share_pct={:.2} lost={lost}",
            100.0 * *busy as f64 / total_busy.max(1) as f64
        );
    }
    let n = restart_ms.len();
    println!(
        "faulting vm: cycles={cycles} recovered={recovered} restart_to_verified_ms p50={:.1} p90={:.1} max={:.1}",
        pct(&mut restart_ms, 0.5),
        pct(&mut restart_ms, 0.9),
        pct(&mut restart_ms, 1.0),
    );
    let failed: u64 = results.iter().map(|r| r.1).sum();
    let shares: Vec<f64> = results
        .iter()
        .map(|r| 100.0 * r.2 as f64 / total_busy.max(1) as f64)
        .collect();
    let spread = shares.iter().cloned().fold(f64::MIN, f64::max)
        - shares.iter().cloned().fold(f64::MAX, f64::min);
    println!(
        "RESULT steady_failures={failed} share_spread_pp={spread:.2} recovered={recovered}/{n} {}",
        if failed == 0
            && recovered as usize == n
            && spread <= 4.0
            && (!wild || gpu_faults == cycles)
        {
            "PASS"
        } else {
            "FAIL"
        }
    );
}
