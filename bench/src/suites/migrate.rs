//! Suite `migrate`: live migration of a loopback VM between two backends (two sim GPUs in
//! this process, the real vhost-user sockets and device-state transfer between them).
//!
//! Figures:
//! - by VRAM in use (a buffer filled by the GPU, a writer channel idle): the channel
//!   pause (source pausing the channels → the kick that resumes them on the
//!   destination), the control-queue freeze (the whole migration: the guest's control
//!   requests wait meanwhile), total time, pre-copy rounds and bytes, and the same VM
//!   moved stop-and-copy (pre-copy off) beside it, with the ratio of the pauses;
//! - by the guest's GPU write rate (a writer channel dirtying distinct 2 MiB chunks of
//!   the buffer at a fixed rate, running through the migration): the same figures plus
//!   the bytes of every round.
//!
//! The target is a channel pause ≤ 300 ms with 1 GiB of VRAM and an idle writer.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;
use vgpu_backend::{PrecopyConfig, VgpuBackend, VmLimits};
use vgpu_guest::{Device, KernelArgs};
use vgpu_host_shim::{HalError, SimConfig, SimGpu};
use vgpu_loopback::{LoopbackConfig, LoopbackVm, MigrationReport};

use crate::report::{Better, Figure};

const SUITE: &str = "migrate";
const MIB: u64 = 1 << 20;
const CHUNK: u64 = 2 * MIB;
const VM: &str = "vm";
/// The writer's period: every tick it dirties `rate × tick` bytes of distinct chunks.
const TICK: Duration = Duration::from_millis(10);

#[derive(Debug, Error)]
pub enum MigrateSuiteError {
    #[error("GPU: {0}")]
    Hal(#[from] HalError),
    #[error("runtime: {0}")]
    Runtime(#[from] vgpu_guest::Error),
    #[error("backend: {0}")]
    Backend(String),
    #[error("loopback VM: {0}")]
    Loopback(String),
    #[error("the writer failed: {0}")]
    Writer(String),
}

type Result<T> = std::result::Result<T, MigrateSuiteError>;

#[derive(Debug, Clone)]
pub struct MigrateOpts {
    /// VRAM in use for the idle-writer runs, MiB.
    pub sizes_mib: Vec<u64>,
    /// VRAM in use for the write-rate runs, MiB.
    pub rate_size_mib: u64,
    /// Guest GPU write rates, MiB dirtied per second.
    pub rates_mib_s: Vec<u64>,
}

impl MigrateOpts {
    pub fn full() -> Self {
        MigrateOpts {
            sizes_mib: vec![64, 256, 1024],
            rate_size_mib: 256,
            rates_mib_s: vec![8, 32, 128, 512],
        }
    }

    pub fn quick() -> Self {
        MigrateOpts {
            sizes_mib: vec![16],
            rate_size_mib: 16,
            rates_mib_s: vec![64],
        }
    }
}

/// Two backends, each on its own sim GPU, serving the VM's socket.
struct Pair {
    backends: [Arc<VgpuBackend>; 2],
    sockets: [PathBuf; 2],
    dir: PathBuf,
}

impl Pair {
    fn new(tag: &str, vram: u64) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("vgpu-bench-mig-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| MigrateSuiteError::Backend(e.to_string()))?;
        let limits = VmLimits {
            vram_bytes: vram,
            ..VmLimits::default()
        };
        let make = |side: &str| -> Result<(Arc<VgpuBackend>, PathBuf)> {
            let gpu = SimGpu::new(SimConfig {
                vram_bytes: vram + 64 * MIB,
                ..SimConfig::default()
            })?;
            let be = VgpuBackend::new(gpu, limits);
            let sock = dir.join(format!("{side}.sock"));
            be.serve_vm(VM, &sock)
                .map_err(|e| MigrateSuiteError::Backend(e.to_string()))?;
            Ok((be, sock))
        };
        let (a, sa) = make("a")?;
        let (b, sb) = make("b")?;
        Ok(Pair {
            backends: [a, b],
            sockets: [sa, sb],
            dir,
        })
    }

    fn precopy(&self, cfg: PrecopyConfig) {
        for be in &self.backends {
            be.set_precopy(VM, cfg);
        }
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for be in &self.backends {
            be.shutdown();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A guest process: a VRAM buffer of `size` filled by the GPU, and a writer thread that
/// dirties `rate` bytes per second of distinct chunks of it (0: idle).
struct Guest {
    stop: Arc<AtomicBool>,
    writer: Option<JoinHandle<std::result::Result<u64, String>>>,
}

impl Guest {
    fn start(vm: &Arc<LoopbackVm>, size: u64, rate: u64) -> Result<Self> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let (vm, stop2) = (vm.clone(), stop.clone());
        let writer = std::thread::spawn(move || -> std::result::Result<u64, String> {
            let dev = Device::loopback(vm, 100).map_err(|e| e.to_string())?;
            let ctx = dev.create_context().map_err(|e| e.to_string())?;
            let buf = ctx.alloc_vram(size).map_err(|e| e.to_string())?;
            let mut ch = ctx.create_channel().map_err(|e| e.to_string())?;
            // Every byte written once by the GPU: the pages are real.
            let mut off = 0;
            while off < size {
                let len = CHUNK.min(size - off);
                let pattern = (off / CHUNK) as u32 | 0x5a00_0000;
                ch.launch(
                    &KernelArgs::Memset {
                        dst: buf.gpu_va() + off,
                        len,
                        pattern,
                    },
                    [1, 1, 1],
                )
                .map_err(|e| e.to_string())?;
                off += len;
            }
            let f = ch.submit().map_err(|e| e.to_string())?;
            ch.wait(f).map_err(|e| e.to_string())?;
            let _ = ready_tx.send(());
            let chunks = size.div_ceil(CHUNK).max(1);
            // Chunks owed so far: a fraction carries over to the next tick, so low rates
            // are not rounded up to a chunk per tick.
            let per_tick = rate as f64 * TICK.as_secs_f64() / CHUNK as f64;
            let mut owed = 0.0f64;
            let (mut next, mut n, mut writes, mut tick) = (0u64, 0u32, 0u64, 0u32);
            let t0 = Instant::now();
            while !stop2.load(Ordering::Acquire) {
                owed += per_tick;
                let due_chunks = (owed.floor() as u64).min(chunks);
                owed -= due_chunks as f64;
                if due_chunks > 0 {
                    for _ in 0..due_chunks {
                        // 4 KiB into each chunk: the chunk is dirty as a whole.
                        ch.launch(
                            &KernelArgs::Memset {
                                dst: buf.gpu_va() + next * CHUNK,
                                len: 4096,
                                pattern: n,
                            },
                            [1, 1, 1],
                        )
                        .map_err(|e| e.to_string())?;
                        next = (next + 1) % chunks;
                        writes += 1;
                    }
                    n = n.wrapping_add(1);
                    let f = ch.submit().map_err(|e| e.to_string())?;
                    ch.wait_timeout(f, Duration::from_secs(60))
                        .map_err(|e| e.to_string())?;
                }
                // Paced by wall time, so a slow round does not make it catch up in bursts.
                tick += 1;
                let due = t0 + TICK * tick;
                let now = Instant::now();
                std::thread::sleep(
                    due.saturating_duration_since(now)
                        .max(Duration::from_millis(1)),
                );
            }
            Ok(writes)
        });
        ready_rx
            .recv_timeout(Duration::from_secs(300))
            .map_err(|_| MigrateSuiteError::Writer("the guest did not start".into()))?;
        Ok(Guest {
            stop,
            writer: Some(writer),
        })
    }

    fn finish(mut self) -> Result<u64> {
        self.stop.store(true, Ordering::Release);
        match self.writer.take().map(|w| w.join()) {
            Some(Ok(Ok(n))) => Ok(n),
            Some(Ok(Err(e))) => Err(MigrateSuiteError::Writer(e)),
            _ => Err(MigrateSuiteError::Writer("the writer panicked".into())),
        }
    }
}

/// One migration A → B of a VM with `size` bytes in use and a writer at `rate`.
struct Run {
    report: MigrationReport,
    total: Duration,
}

fn migrate_once(tag: &str, size: u64, rate: u64, cfg: PrecopyConfig) -> Result<Run> {
    let pair = Pair::new(tag, size + 32 * MIB)?;
    pair.precopy(cfg);
    let vm = LoopbackVm::connect(&pair.sockets[0], LoopbackConfig::with_mem(64 << 20))
        .map_err(|e| MigrateSuiteError::Loopback(e.to_string()))?;
    let guest = Guest::start(&vm, size, rate)?;
    // Let the writer reach its rate.
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    let report = vm
        .migrate_to(&pair.sockets[1])
        .map_err(|e| MigrateSuiteError::Loopback(e.to_string()))?;
    let total = t0.elapsed();
    std::thread::sleep(Duration::from_millis(100));
    guest.finish()?;
    Ok(Run { report, total })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn mib(b: u64) -> f64 {
    b as f64 / MIB as f64
}

/// The figures of one run, names prefixed.
fn figures(prefix: &str, r: &Run, per_round: bool) -> Vec<Figure> {
    let rep = &r.report;
    let mut f = vec![
        Figure::new(
            SUITE,
            &format!("{prefix}_channel_pause"),
            ms(rep.channel_pause),
            "ms",
            Better::Lower,
        ),
        Figure::new(
            SUITE,
            &format!("{prefix}_control_freeze"),
            ms(rep.downtime),
            "ms",
            Better::Lower,
        ),
        Figure::new(
            SUITE,
            &format!("{prefix}_total"),
            ms(r.total),
            "ms",
            Better::Lower,
        ),
        Figure::new(
            SUITE,
            &format!("{prefix}_precopy_rounds"),
            rep.rounds.iter().filter(|x| !x.last).count() as f64,
            "rounds",
            Better::Lower,
        ),
        Figure::new(
            SUITE,
            &format!("{prefix}_precopy_bytes"),
            mib(rep.precopy_bytes()),
            "MiB",
            Better::Lower,
        ),
        Figure::new(
            SUITE,
            &format!("{prefix}_paused_bytes"),
            mib(rep.last_round_bytes()),
            "MiB",
            Better::Lower,
        ),
    ];
    if per_round {
        for x in &rep.rounds {
            let name = if x.last {
                format!("{prefix}_round_{}_paused_bytes", x.round)
            } else {
                format!("{prefix}_round_{}_bytes", x.round)
            };
            f.push(Figure::new(
                SUITE,
                &name,
                mib(x.bytes),
                "MiB",
                Better::Lower,
            ));
        }
    }
    f
}

pub fn run(opts: &MigrateOpts) -> Result<Vec<Figure>> {
    let mut figs = Vec::new();
    let precopy = PrecopyConfig::default();
    let stop_and_copy = PrecopyConfig {
        max_rounds: 0,
        ..precopy
    };
    for &s in &opts.sizes_mib {
        let size = s * MIB;
        let pre = migrate_once(&format!("idle{s}"), size, 0, precopy)?;
        let stop = migrate_once(&format!("stop{s}"), size, 0, stop_and_copy)?;
        let mut f = figures(&format!("idle_{s}mib"), &pre, false);
        if s == 1024 {
            f[0] = f[0].clone().target(300.0);
        }
        figs.extend(f);
        figs.push(Figure::new(
            SUITE,
            &format!("idle_{s}mib_stop_and_copy_channel_pause"),
            ms(stop.report.channel_pause),
            "ms",
            Better::Lower,
        ));
        figs.push(Figure::new(
            SUITE,
            &format!("idle_{s}mib_pause_precopy_over_stop_and_copy"),
            ms(pre.report.channel_pause) / ms(stop.report.channel_pause).max(1e-3),
            "x",
            Better::Lower,
        ));
    }
    let s = opts.rate_size_mib;
    for &rate in &opts.rates_mib_s {
        let r = migrate_once(&format!("rate{rate}"), s * MIB, rate * MIB, precopy)?;
        figs.extend(figures(&format!("{s}mib_write_{rate}mib_s"), &r, true));
    }
    Ok(figs)
}
