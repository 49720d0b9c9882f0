//! `vgpu-bench`: the project's benchmark runner. One subcommand per suite; a table for
//! people by default, `--json` for one JSON object per figure per line.

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use vgpu_bench::report::{print_json, print_table, Figure};
use vgpu_bench::suites::api::{self, ApiOpts};
use vgpu_bench::suites::cuda::{self, CudaOpts};
use vgpu_bench::suites::flood::{self, FloodOpts};
use vgpu_bench::suites::guest::{self, GuestArgs};
use vgpu_bench::suites::migrate::{self, MigrateOpts};
use vgpu_bench::suites::scale::{self, ScaleOpts};
use vgpu_bench::suites::sched::{self, SchedOpts};
use vgpu_bench::suites::sim::{self, SimOpts};
use vgpu_bench::suites::swap::{self, SwapOpts};
use vgpu_bench::suites::virt::{self, VirtOpts};

#[derive(Parser)]
#[command(version, about = "vgpu benchmarks")]
struct Cli {
    /// Print one JSON object per figure instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// Small sizes: a smoke run, not a measurement.
    #[arg(long, global = true)]
    quick: bool,
    #[command(subcommand)]
    suite: Suite,
}

#[derive(Subcommand)]
enum Suite {
    /// The GPU model natively: dispatch rate, submission latency, copy engine, sgemm.
    Sim,
    /// The same workloads natively and through vgpu-backend + a loopback VM, side by side.
    Virt,
    /// The operator control API: weight-change delay under load, request latency.
    Api,
    /// The workloads and submission round trips through /dev/vgpu (in a VM), or on an
    /// in-process sim with --native (the baseline to run outside the VM).
    Guest(GuestArgs),
    /// vgpu on an NVIDIA GPU (`cuda`): the workloads natively and in a loopback VM,
    /// submission latency, back-to-back launches, fairness, front-end CPU; with
    /// --baseline, the native CUDA program's figures beside them.
    Cuda {
        /// The GPU: `cuda[:INDEX]`.
        #[arg(long, default_value = "cuda")]
        gpu: vgpu_host_shim::GpuChoice,
        /// The native CUDA baseline program (built from bench/cuda-native/native.cu).
        #[arg(long, value_name = "PATH")]
        baseline: Option<PathBuf>,
        /// Timed runs of each workload per side (the best counts).
        #[arg(long)]
        reps: Option<u32>,
        /// VRAM of the cuda GPU, MiB (device memory).
        #[arg(long)]
        vram_mib: Option<u64>,
        /// Run on the CPU stand-in for the CUDA device (checks the plumbing without a GPU).
        #[arg(long)]
        fake: bool,
        /// The realistic sizes: saxpy 2^28, sgemm 4096^3, stencil 8192^2 (CPU references on
        /// every core; the baseline program gets `--large` too).
        #[arg(long)]
        large: bool,
        /// Only the two-VM fairness runs (the same as `--only fairness`).
        #[arg(long)]
        fairness_only: bool,
        /// Only these sections (comma-separated); the baseline program runs the same ones.
        #[arg(long, value_delimiter = ',', value_name = "SECTION,...")]
        only: Vec<cuda::Section>,
        /// Only these workloads (comma-separated: throttle, saxpy, sgemm, hotspot,
        /// reduction, copy_heavy); the baseline program runs the same ones.
        #[arg(long, value_delimiter = ',', value_name = "NAME,...")]
        workloads: Vec<String>,
        /// GP entries per completion mark while one channel is busy [default: 32].
        #[arg(long)]
        batch: Option<u32>,
        /// Completion marks in flight per channel [default: 64].
        #[arg(long)]
        max_inflight: Option<usize>,
        /// Each VM's GPU work in a worker process of its own (issue 30): `vgpu-backend
        /// worker`, the `vgpu-backend` beside this program (or `$VGPU_BACKEND_BIN`).
        #[arg(long)]
        workers: bool,
        /// With `--workers`: the GPU turn's quantum, microseconds (0: no turn; the GPU
        /// time-slices the workers' contexts) [default: 4000].
        #[arg(long, default_value_t = 4000)]
        turn_us: u64,
        /// With `--workers --only granularity`: guest processes of the one VM, each with a
        /// worker of its own under `--gpu-workers=process` [default: 4].
        #[arg(long, default_value_t = 4)]
        processes: u32,
        /// Rounds of the back-to-back figure, each CUDA native (with `--baseline`), vgpu
        /// native and the VM one after the other; the median round is reported
        /// [default: 5, 1 with --quick].
        #[arg(long)]
        b2b_rounds: Option<u32>,
        /// Kernels of grids up to this many blocks write their GP entry's fence
        /// themselves, in the in-process GPU (0: never) [default: 1].
        #[arg(long)]
        signal_max_blocks: Option<u64>,
        /// Longest sleep of the idle front end with the doorbell armed, µs, in the
        /// in-process GPU and the workers (0: no doorbell, idle polls) [default: 10000].
        #[arg(long)]
        doorbell_sleep_us: Option<u64>,
        /// How long the in-process front end spins after activity before it sleeps, µs
        /// [default: 200].
        #[arg(long)]
        busy_poll_us: Option<u64>,
        /// How long the in-process front end polls after a channel appears, µs (0: it
        /// sleeps at once, as before 2026-11-28) [default: 2000].
        #[arg(long)]
        new_channel_poll_us: Option<u64>,
        /// How long a channel of the in-process GPU with nothing on the GPU still counts
        /// as active after its last entry, µs: while channels of two contexts are active
        /// every GP entry gets its own completion mark [default: 100000].
        #[arg(long)]
        batch_quiet_us: Option<u64>,
        /// Time the in-process front end's parts (fetch and plan, issue, marks, retire):
        /// the b2b section reports each part's host time per GP entry.
        #[arg(long)]
        time_frontend: bool,
        /// A channel whose entries take this long on the GPU (or are not timed yet)
        /// leaves the REF write its last kernel owes to a completion mark, µs, or
        /// `never` (the next kernel's store always; 0: a mark always; default: 10; see
        /// `CudaConfig::mark_owed_ref_over_ns`).
        #[arg(long, value_parser = parse_us_or_never)]
        mark_owed_ref_over_us: Option<u64>,
    },
    /// Fair service of control requests: a victim VM's request latency alone and while
    /// another VM floods its control queue, or its event queue, side by side.
    Flood,
    /// VRAM oversubscription: slowdown vs all-in-VRAM, swap throughput, pauses, convergence.
    Swap {
        /// The GPU: `sim` (default) or `cuda[:INDEX]` (oversubscription and convergence on
        /// a real GPU).
        #[arg(long, default_value = "sim")]
        gpu: vgpu_host_shim::GpuChoice,
    },
    /// Live migration of a loopback VM between two backends: channel pause, control-queue
    /// freeze, total time and pre-copy rounds by VRAM in use and by guest write rate.
    Migrate,
    /// One backend, many VMs: scheduler CPU per tick, shadow switches, RSS/fds/threads per
    /// VM and channel, control-request latency (64 VMs × 4 processes × 4 channels).
    Scale {
        /// VMs (default 64; 8 with --quick).
        #[arg(long)]
        vms: Option<u32>,
    },
    /// The GPU scheduler over loopback VMs: Fleig §5.4 fairness, weights, two levels,
    /// overhead, shadow switch cost, weight-change reaction, timeslice and sampling.
    Sched {
        /// Write SVG plots into this directory.
        #[arg(long, value_name = "DIR")]
        plots: Option<PathBuf>,
        /// Only these scenarios (comma-separated): fleig, throttles, weights, two_levels,
        /// overhead, policies, hostile, burst, mixed, evict_wait.
        #[arg(long, value_delimiter = ',', value_name = "SCENARIO,...")]
        only: Vec<String>,
    },
}

/// `$VGPU_BACKEND_BIN`, else the `vgpu-backend` beside this program.
fn backend_beside_me() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("VGPU_BACKEND_BIN") {
        return Ok(p.into());
    }
    let me = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    let bin = me.with_file_name("vgpu-backend");
    if bin.exists() {
        Ok(bin)
    } else {
        Err(format!(
            "--workers: no {} (build vgpu-backend or set VGPU_BACKEND_BIN)",
            bin.display()
        ))
    }
}

fn main() {
    env_logger::init();
    let cli = Cli::parse();
    let result: Result<Vec<Figure>, String> = match cli.suite {
        Suite::Guest(args) => guest::run(&args.opts(cli.quick)).map_err(|e| e.to_string()),
        Suite::Cuda {
            gpu,
            baseline,
            reps,
            vram_mib,
            fake,
            large,
            fairness_only,
            only,
            workloads,
            batch,
            max_inflight,
            workers,
            turn_us,
            processes,
            b2b_rounds,
            signal_max_blocks,
            doorbell_sleep_us,
            busy_poll_us,
            new_channel_poll_us,
            batch_quiet_us,
            time_frontend,
            mark_owed_ref_over_us,
        } => match gpu {
            vgpu_host_shim::GpuChoice::Sim => {
                Err("vgpu-bench cuda needs --gpu cuda[:INDEX]".into())
            }
            vgpu_host_shim::GpuChoice::Cuda { index } => {
                let mut opts = if cli.quick {
                    CudaOpts::quick(index)
                } else {
                    CudaOpts::full(index)
                };
                opts.reps = reps.unwrap_or(opts.reps);
                opts.vram_mib = vram_mib.unwrap_or(opts.vram_mib);
                opts.baseline = baseline;
                opts.fake = fake;
                opts.large = large;
                opts.only = only;
                opts.workloads = workloads;
                if fairness_only {
                    opts.only.push(cuda::Section::Fairness);
                }
                opts.batch = batch.unwrap_or(opts.batch);
                opts.max_inflight = max_inflight.unwrap_or(opts.max_inflight);
                opts.signal_max_blocks = signal_max_blocks.unwrap_or(opts.signal_max_blocks);
                opts.doorbell_sleep_ns =
                    doorbell_sleep_us.map_or(opts.doorbell_sleep_ns, |us| us.saturating_mul(1000));
                opts.busy_poll_ns =
                    busy_poll_us.map_or(opts.busy_poll_ns, |us| us.saturating_mul(1000));
                opts.new_channel_poll_ns = new_channel_poll_us
                    .map_or(opts.new_channel_poll_ns, |us| us.saturating_mul(1000));
                opts.batch_quiet_ns =
                    batch_quiet_us.map_or(opts.batch_quiet_ns, |us| us.saturating_mul(1000));
                opts.time_frontend = time_frontend;
                opts.mark_owed_ref_over_ns = mark_owed_ref_over_us
                    .map_or(opts.mark_owed_ref_over_ns, |us| us.saturating_mul(1000));
                match workers.then(backend_beside_me).transpose() {
                    Ok(w) => {
                        opts.workers = w;
                        opts.turn_us = turn_us;
                        opts.processes = processes;
                        if let Some(r) = b2b_rounds {
                            opts.b2b_rounds = r;
                        }
                        cuda::run(&opts).map_err(|e| e.to_string())
                    }
                    Err(e) => Err(e),
                }
            }
        },
        Suite::Sim => {
            let opts = if cli.quick {
                SimOpts::quick()
            } else {
                SimOpts::full()
            };
            sim::run(&opts).map_err(|e| e.to_string())
        }
        Suite::Virt => {
            let opts = if cli.quick {
                VirtOpts::quick()
            } else {
                VirtOpts::full()
            };
            virt::run(&opts).map_err(|e| e.to_string())
        }
        Suite::Api => {
            let opts = if cli.quick {
                ApiOpts::quick()
            } else {
                ApiOpts::full()
            };
            api::run(&opts).map_err(|e| e.to_string())
        }
        Suite::Flood => {
            let opts = if cli.quick {
                FloodOpts::quick()
            } else {
                FloodOpts::full()
            };
            flood::run(&opts).map_err(|e| e.to_string())
        }
        Suite::Swap { gpu } => {
            let mut opts = if cli.quick {
                SwapOpts::quick()
            } else {
                SwapOpts::full()
            };
            opts.gpu = gpu;
            swap::run(&opts).map_err(|e| e.to_string())
        }
        Suite::Migrate => {
            let opts = if cli.quick {
                MigrateOpts::quick()
            } else {
                MigrateOpts::full()
            };
            migrate::run(&opts).map_err(|e| e.to_string())
        }
        Suite::Scale { vms } => {
            let mut opts = if cli.quick {
                ScaleOpts::quick()
            } else {
                ScaleOpts::full()
            };
            opts.vms = vms.unwrap_or(opts.vms);
            scale::run(&opts).map_err(|e| e.to_string())
        }
        Suite::Sched { plots, only } => {
            let mut opts = if cli.quick {
                SchedOpts::quick()
            } else {
                SchedOpts::full()
            };
            opts.plots = plots;
            opts.only = only;
            sched::run(&opts).map_err(|e| e.to_string())
        }
    };
    match result {
        Ok(figs) => {
            if cli.json {
                print_json(&figs)
            } else {
                print_table(&figs)
            }
        }
        Err(e) => {
            eprintln!("vgpu-bench: {e}");
            std::process::exit(1);
        }
    }
}

/// A count of microseconds, or `never` (`u64::MAX`, which stays so once scaled to ns).
fn parse_us_or_never(s: &str) -> Result<u64, String> {
    if s == "never" {
        return Ok(u64::MAX);
    }
    s.parse()
        .map_err(|e| format!("{s:?}: a count of microseconds or `never`: {e}"))
}
