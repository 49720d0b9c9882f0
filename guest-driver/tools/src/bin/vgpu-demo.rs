//! `vgpu-demo`: several tenants share one sim GPU; a live table shows each tenant's share
//! of GPU time, and a summary closes the run. Tenants run the shared workloads through
//! the native runtime; with no scheduler in between, the GPU's own round-robin decides,
//! and the tenant with the longest kernels takes most of the GPU.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use clap::Parser;
use vgpu_guest::workloads::{HotspotConfig, SaxpyConfig, SgemmConfig, ThrottleConfig, Workload};
use vgpu_guest::Device;
use vgpu_host_shim::{ContextId, SimConfig, SimGpu};

#[derive(Parser)]
#[command(
    version,
    about = "Several tenants sharing the sim GPU, with live GPU shares"
)]
struct Cli {
    /// How long the tenants run, in seconds.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Seconds between table updates.
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
    /// Small workload sizes (for tests).
    #[arg(long)]
    quick: bool,
}

struct Tenant {
    name: &'static str,
    workload: Workload,
}

fn tenants(quick: bool) -> Vec<Tenant> {
    let small = |w: &str| Workload::by_name(w, true);
    let throttle = |ns| {
        Workload::Throttle(ThrottleConfig {
            kernel_ns: ns,
            iterations: None,
            ..Default::default()
        })
    };
    let mut t = vec![
        Tenant {
            name: "vm1/throttle-2ms",
            workload: throttle(2_000_000),
        },
        Tenant {
            name: "vm2/throttle-200us",
            workload: throttle(200_000),
        },
    ];
    let compute = if quick {
        [small("saxpy"), small("hotspot"), small("sgemm")]
    } else {
        [
            Some(Workload::Saxpy(SaxpyConfig {
                n: 1 << 18,
                iterations: 20,
                ..Default::default()
            })),
            Some(Workload::Hotspot(HotspotConfig {
                width: 256,
                height: 256,
                iterations: 20,
                ..Default::default()
            })),
            Some(Workload::Sgemm(SgemmConfig {
                m: 128,
                n: 128,
                k: 128,
                iterations: 4,
                ..Default::default()
            })),
        ]
    };
    let names = ["vm3/saxpy", "vm3/hotspot", "vm4/sgemm"];
    for (name, w) in names.into_iter().zip(compute) {
        if let Some(workload) = w {
            t.push(Tenant { name, workload });
        }
    }
    t
}

#[derive(Default)]
struct Progress {
    runs: AtomicU64,
    failures: AtomicU64,
}

fn main() {
    env_logger::init();
    let cli = Cli::parse();
    if let Err(e) = run(&cli) {
        eprintln!("vgpu-demo: {e}");
        std::process::exit(1);
    }
}

fn run(cli: &Cli) -> Result<(), Box<dyn std::error::Error>> {
    let gpu = SimGpu::new(SimConfig::default())?;
    let dev = Device::native(gpu.clone())?;
    let stop = Arc::new(AtomicBool::new(false));
    let tenants = tenants(cli.quick);
    let mut owners: HashMap<ContextId, usize> = HashMap::new();
    let mut progress = Vec::new();
    let mut handles = Vec::new();
    for (i, t) in tenants.iter().enumerate() {
        let ctx = dev.create_context()?;
        owners.insert(ContextId(ctx.handle().0 as u32), i);
        let p = Arc::new(Progress::default());
        progress.push(p.clone());
        // Throttle runs until the stop flag (one run covers the demo); the others loop.
        let w = match &t.workload {
            Workload::Throttle(c) => Workload::Throttle(ThrottleConfig {
                stop: Some(stop.clone()),
                ..c.clone()
            }),
            other => other.clone(),
        };
        let stop = stop.clone();
        let name = t.name;
        handles.push(thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match w.run(&ctx) {
                    Ok(r) if r.verified || matches!(w, Workload::Throttle(_)) => {
                        p.runs.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {
                        p.failures.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        eprintln!("{name}: {e}");
                        p.failures.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                }
            }
        }));
    }

    let names: Vec<&str> = tenants.iter().map(|t| t.name).collect();
    // Workloads open a channel per run, so account per context: the sim keeps each
    // context's engine time across its channels' lifetimes.
    let ctx_ids: Vec<ContextId> = {
        let mut v: Vec<(usize, ContextId)> = owners.iter().map(|(c, i)| (*i, *c)).collect();
        v.sort();
        v.into_iter().map(|(_, c)| c).collect()
    };
    let mut seen = vec![0u64; names.len()];
    let mut sample = |gpu: &SimGpu| {
        let mut delta = vec![0u64; names.len()];
        for (i, ctx) in ctx_ids.iter().enumerate() {
            let busy = gpu.context_busy_ns(*ctx).unwrap_or(seen[i]);
            delta[i] = busy.saturating_sub(seen[i]);
            seen[i] = busy;
        }
        delta
    };
    sample(&gpu);
    let mut total = vec![0u64; names.len()];
    let live = std::io::stdout().is_terminal();
    let t0 = Instant::now();
    let interval = Duration::from_secs_f64(cli.interval.max(0.05));
    let mut printed_lines = 0;
    while t0.elapsed().as_secs_f64() < cli.duration {
        thread::sleep(interval);
        let delta = sample(&gpu);
        for (t, d) in total.iter_mut().zip(&delta) {
            *t += d;
        }
        let mut out = String::new();
        out.push_str(&format!(
            "t={:5.1}s  {:<20} {:>10} {:>10} {:>6}\n",
            t0.elapsed().as_secs_f64(),
            "tenant",
            "share now",
            "share all",
            "runs"
        ));
        let dsum = delta.iter().sum::<u64>().max(1) as f64;
        let tsum = total.iter().sum::<u64>().max(1) as f64;
        for (i, n) in names.iter().enumerate() {
            out.push_str(&format!(
                "         {:<20} {:>9.1}% {:>9.1}% {:>6}\n",
                n,
                100.0 * delta[i] as f64 / dsum,
                100.0 * total[i] as f64 / tsum,
                progress[i].runs.load(Ordering::Relaxed)
            ));
        }
        if live && printed_lines > 0 {
            // Redraw the table in place on a terminal.
            print!("\x1b[{printed_lines}A");
        }
        print!("{out}");
        printed_lines = out.lines().count();
        let _ = std::io::stdout().flush();
    }
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        let _ = h.join();
    }
    let tsum = total.iter().sum::<u64>().max(1) as f64;
    println!("\nsummary (policy: none — the GPU's own round-robin; the scheduler comes with the backend)");
    println!(
        "{:<20} {:>10} {:>12} {:>6} {:>9}",
        "tenant", "GPU share", "GPU time ms", "runs", "failures"
    );
    let mut failed = 0;
    for (i, n) in names.iter().enumerate() {
        let f = progress[i].failures.load(Ordering::Relaxed);
        failed += f;
        println!(
            "{:<20} {:>9.1}% {:>12.1} {:>6} {:>9}",
            n,
            100.0 * total[i] as f64 / tsum,
            total[i] as f64 / 1e6,
            progress[i].runs.load(Ordering::Relaxed),
            f
        );
    }
    if failed > 0 {
        return Err(format!("{failed} workload runs failed verification").into());
    }
    Ok(())
}
