//! `vgpu-demo`: several VMs share one GPU. A `vgpu-backend` serves each VM on its own
//! vhost-user socket; loopback VMMs connect as a VMM would; inside each VM, guest
//! "processes" (each with its own PID) run the shared workloads through the runtime's
//! loopback transport: allocation requests go over the control virtqueue, submissions are
//! plain stores to channel control pages mapped in the VM's BAR. A live table shows each
//! VM's and each process's share of GPU time (from the backend's accounting); a summary
//! closes the run. The fair scheduler shares the GPU by VM weight; halfway through, the
//! demo raises one VM's weight through the operator control API — the same request
//! `vgpuctl vm set-weight` sends over the API's unix socket — and the shares follow.
//! `--policy none` shows the GPU's own round-robin instead, where the tenant with the
//! longest kernels takes most of the GPU.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use clap::Parser;
use vgpu_backend::api::client::ApiClient;
use vgpu_backend::api::{ApiOptions, ApiServer};
use vgpu_backend::{Policy, SchedConfig, VgpuBackend, VmLimits};
use vgpu_guest::workloads::{HotspotConfig, SaxpyConfig, SgemmConfig, ThrottleConfig, Workload};
use vgpu_guest::Device;
use vgpu_host_shim::cuda::{CudaConfig, CudaGpu};
use vgpu_host_shim::{Gpu, GpuChoice, SimConfig, SimGpu};
use vgpu_loopback::{LoopbackConfig, LoopbackVm};

#[derive(Parser)]
#[command(
    version,
    about = "Several VMs sharing one GPU (sim or cuda) through vgpu-backend, with live GPU shares"
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
    /// Scheduling policy: fair or none.
    #[arg(long, default_value = "fair")]
    policy: String,
    /// The weight change sent through the control API mid-run, `VM=WEIGHT` (VMs start at
    /// 100).
    #[arg(long, default_value = "vm2=400")]
    set_weight: String,
    /// When to send it, seconds from the start (default: half the duration).
    #[arg(long)]
    weight_at: Option<f64>,
    /// The GPU: `sim`, or `cuda[:INDEX]` for an NVIDIA GPU through the CUDA driver.
    #[arg(long, default_value = "sim", value_name = "sim|cuda[:INDEX]")]
    gpu: GpuChoice,
}

/// One guest process: which VM, its PID, what it runs.
struct Tenant {
    vm: &'static str,
    pid: u32,
    label: &'static str,
    workload: Workload,
}

fn tenants(quick: bool) -> Vec<Tenant> {
    let throttle = |ns| {
        Workload::Throttle(ThrottleConfig {
            kernel_ns: ns,
            iterations: None,
            ..Default::default()
        })
    };
    let pick = |w: &str, big: Workload| {
        if quick {
            Workload::by_name(w, true).unwrap_or(big)
        } else {
            big
        }
    };
    vec![
        Tenant {
            vm: "vm1",
            pid: 101,
            label: "throttle-2ms",
            workload: throttle(2_000_000),
        },
        Tenant {
            vm: "vm2",
            pid: 201,
            label: "throttle-200us",
            workload: throttle(200_000),
        },
        Tenant {
            vm: "vm3",
            pid: 301,
            label: "saxpy",
            workload: pick(
                "saxpy",
                Workload::Saxpy(SaxpyConfig {
                    n: 1 << 18,
                    iterations: 20,
                    ..Default::default()
                }),
            ),
        },
        Tenant {
            vm: "vm3",
            pid: 302,
            label: "hotspot",
            workload: pick(
                "hotspot",
                Workload::Hotspot(HotspotConfig {
                    width: 256,
                    height: 256,
                    iterations: 20,
                    ..Default::default()
                }),
            ),
        },
        Tenant {
            vm: "vm4",
            pid: 401,
            label: "sgemm",
            workload: pick(
                "sgemm",
                Workload::Sgemm(SgemmConfig {
                    m: 128,
                    n: 128,
                    k: 128,
                    iterations: 4,
                    ..Default::default()
                }),
            ),
        },
    ]
}

#[derive(Default)]
struct Progress {
    runs: AtomicU64,
    failures: AtomicU64,
}

/// How far a VM's share may be from its entitlement for the demo to call it fair (pp).
const TOLERANCE_PP: f64 = 3.0;

fn main() {
    env_logger::init();
    let cli = Cli::parse();
    if let Err(e) = run(&cli) {
        eprintln!("vgpu-demo: {e}");
        std::process::exit(1);
    }
}

fn run(cli: &Cli) -> Result<(), Box<dyn std::error::Error>> {
    let policy: Policy = cli.policy.parse()?;
    let (weight_vm, new_weight) = cli
        .set_weight
        .split_once('=')
        .and_then(|(v, w)| Some((v.to_string(), w.parse::<u32>().ok()?)))
        .ok_or("--set-weight: expected VM=WEIGHT")?;
    let weight_at = cli.weight_at.unwrap_or(cli.duration / 2.0);
    let gpu: Arc<dyn Gpu> = match cli.gpu {
        GpuChoice::Sim => SimGpu::new(SimConfig::default())?,
        GpuChoice::Cuda { index } => CudaGpu::open(index, CudaConfig::default())?,
    };
    let backend = VgpuBackend::new(gpu, VmLimits::default());
    let dir = std::env::temp_dir().join(format!("vgpu-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let tenants = tenants(cli.quick);
    let mut vm_names: Vec<&'static str> = tenants.iter().map(|t| t.vm).collect();
    vm_names.dedup();
    let mut vms = Vec::new();
    for name in &vm_names {
        let sock = dir.join(format!("{name}.sock"));
        backend.serve_vm(name, &sock)?;
        vms.push(LoopbackVm::connect(
            &sock,
            LoopbackConfig::with_mem(256 << 20),
        )?);
    }
    if !vm_names.contains(&weight_vm.as_str()) {
        return Err(format!("--set-weight: no VM {weight_vm:?}").into());
    }
    backend.start_scheduler(SchedConfig {
        policy,
        ..SchedConfig::default()
    })?;
    let api_sock = dir.join("api.sock");
    let api = ApiServer::start(&backend, &api_sock, ApiOptions::default())?;
    let client = ApiClient::new(&api_sock);
    println!(
        "vgpu-backend serving {} VMs ({}) on {}; policy: {policy}; control API: {}",
        vm_names.len(),
        vm_names.join(", "),
        dir.display(),
        api_sock.display()
    );
    let stop = Arc::new(AtomicBool::new(false));
    let mut progress = Vec::new();
    let mut handles = Vec::new();
    for t in &tenants {
        let vm_index = vm_names.iter().position(|n| *n == t.vm).unwrap_or(0);
        let dev = Device::loopback(vms[vm_index].clone(), t.pid)?;
        let ctx = dev.create_context()?;
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
        let name = format!("{}/{}", t.vm, t.label);
        handles.push(thread::spawn(move || {
            let _dev = dev;
            while !stop.load(Ordering::Relaxed) {
                match w.run(&ctx) {
                    Ok(_) => {
                        p.runs.fetch_add(1, Ordering::Relaxed);
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

    // GPU time per (VM, PID) from the backend's books, which outlive channels.
    let busy = |backend: &VgpuBackend| -> Vec<u64> {
        tenants
            .iter()
            .map(|t| {
                backend
                    .process_busy_ns(t.vm)
                    .iter()
                    .filter(|(pid, _)| *pid == t.pid)
                    .map(|(_, ns)| *ns)
                    .sum()
            })
            .collect()
    };
    let mut last = busy(&backend);
    let start = last.clone();
    let seq_start = backend.next_interval();
    let mut seq_change = None;
    let live = std::io::stdout().is_terminal();
    let t0 = Instant::now();
    let interval = Duration::from_secs_f64(cli.interval.max(0.05));
    let mut printed = 0;
    // GPU time at the weight change, to split the summary in before and after.
    let mut at_change: Option<Vec<u64>> = None;
    let mut note = String::new();
    let mut old_weight = None;
    while t0.elapsed().as_secs_f64() < cli.duration {
        thread::sleep(interval);
        if at_change.is_none() && t0.elapsed().as_secs_f64() >= weight_at {
            old_weight = backend.vm_weight(&weight_vm);
            // What `vgpuctl --socket API vm set-weight VM W` does.
            let r = client.set_weight(&weight_vm, new_weight)?;
            at_change = Some(busy(&backend));
            seq_change = Some(backend.next_interval());
            note = format!(
                "t={:.1}s: vgpuctl --socket {} vm set-weight {weight_vm} {} -> ok\n",
                t0.elapsed().as_secs_f64(),
                api_sock.display(),
                r.weight
            );
        }
        let now = busy(&backend);
        let delta: Vec<u64> = now
            .iter()
            .zip(&last)
            .map(|(n, l)| n.saturating_sub(*l))
            .collect();
        last = now.clone();
        let dsum = delta.iter().sum::<u64>().max(1) as f64;
        let mut out = format!(
            "t={:5.1}s  {:<6} {:>6} {:<6} {:<16} {:>10} {:>10} {:>6}\n",
            t0.elapsed().as_secs_f64(),
            "vm",
            "weight",
            "pid",
            "workload",
            "proc share",
            "vm share",
            "runs"
        );
        for (i, t) in tenants.iter().enumerate() {
            let vm_delta: u64 = tenants
                .iter()
                .zip(&delta)
                .filter(|(o, _)| o.vm == t.vm)
                .map(|(_, d)| *d)
                .sum();
            out.push_str(&format!(
                "         {:<6} {:>6} {:<6} {:<16} {:>9.1}% {:>9.1}% {:>6}\n",
                t.vm,
                backend.vm_weight(t.vm).unwrap_or(0),
                t.pid,
                t.label,
                100.0 * delta[i] as f64 / dsum,
                100.0 * vm_delta as f64 / dsum,
                progress[i].runs.load(Ordering::Relaxed)
            ));
        }
        out.push_str(&note);
        if live && printed > 0 {
            print!("\x1b[{printed}A");
        }
        print!("{out}");
        printed = out.lines().count();
        let _ = std::io::stdout().flush();
    }
    let seq_end = backend.next_interval();
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        let _ = h.join();
    }
    let total: Vec<u64> = busy(&backend)
        .iter()
        .zip(&start)
        .map(|(n, s)| n.saturating_sub(*s))
        .collect();
    let tsum = total.iter().sum::<u64>().max(1) as f64;
    println!("\nsummary (policy: {policy})");
    println!(
        "{:<6} {:<6} {:<16} {:>10} {:>12} {:>6} {:>9}",
        "vm", "pid", "workload", "GPU share", "GPU time ms", "runs", "failures"
    );
    let mut failed = 0;
    for (i, t) in tenants.iter().enumerate() {
        let f = progress[i].failures.load(Ordering::Relaxed);
        failed += f;
        println!(
            "{:<6} {:<6} {:<16} {:>9.1}% {:>12.1} {:>6} {:>9}",
            t.vm,
            t.pid,
            t.label,
            100.0 * total[i] as f64 / tsum,
            total[i] as f64 / 1e6,
            progress[i].runs.load(Ordering::Relaxed),
            f
        );
    }
    // Each VM's share of the GPU time before and after the weight change.
    let end = busy(&backend);
    let mid = at_change.clone().unwrap_or_else(|| end.clone());
    let share_of = |from: &[u64], to: &[u64], vm: &str| -> f64 {
        let d: Vec<u64> = to
            .iter()
            .zip(from)
            .map(|(b, a)| b.saturating_sub(*a))
            .collect();
        let all = d.iter().sum::<u64>().max(1) as f64;
        let mine: u64 = tenants
            .iter()
            .zip(&d)
            .filter(|(t, _)| t.vm == vm)
            .map(|(_, b)| *b)
            .sum();
        100.0 * mine as f64 / all
    };
    println!(
        "\n{:<6} {:>14} {:>14} {:>14} {:>14}",
        "vm", "weight before", "share before", "weight after", "share after"
    );
    for name in &vm_names {
        let after = backend.vm_weight(name).unwrap_or(0);
        let before = match old_weight {
            Some(w) if *name == weight_vm.as_str() => w,
            _ => after,
        };
        println!(
            "{:<6} {:>14} {:>13.1}% {:>14} {:>13.1}%",
            name,
            before,
            share_of(&start, &mid, name),
            after,
            share_of(&mid, &end, name)
        );
    }
    // Each VM's share beside what it was owed: weighted max-min over the VMs' demands (a
    // VM the scheduler never held back used what it wanted; see vgpu-backend's
    // `sched::entitle`), from the scheduler's interval records.
    let seq_mid = seq_change.unwrap_or(seq_end);
    let phases = [
        ("before", backend.gpu_shares_between(seq_start, seq_mid)),
        ("after", backend.gpu_shares_between(seq_mid, seq_end)),
    ];
    println!(
        "\n{:<6} {:<7} {:>7} {:>10} {:>10} {:>11}  verdict (±{TOLERANCE_PP} pp)",
        "vm", "phase", "weight", "share", "entitled", "deviation"
    );
    let mut misses = 0;
    for (phase, shares) in &phases {
        for v in &shares.vms {
            let dev = 100.0 * (v.share - v.entitled);
            let ok = dev.abs() <= TOLERANCE_PP;
            misses += u32::from(!ok);
            println!(
                "{:<6} {:<7} {:>7} {:>9.1}% {:>9.1}% {:>+8.1} pp  {}",
                v.name,
                phase,
                v.weight,
                100.0 * v.share,
                100.0 * v.entitled,
                dev,
                if ok {
                    "fair"
                } else if dev < 0.0 {
                    "got less than its entitlement"
                } else {
                    "got more than its entitlement"
                }
            );
        }
    }
    println!(
        "verdict: {}",
        if misses == 0 {
            "every VM within its entitlement".to_string()
        } else {
            format!("{misses} VM/phase result(s) outside ±{TOLERANCE_PP} pp")
        }
    );
    drop(api);
    for vm in &vms {
        vm.disconnect();
    }
    backend.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
    if failed > 0 {
        return Err(format!("{failed} workload runs failed").into());
    }
    Ok(())
}
