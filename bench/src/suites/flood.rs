//! Suite `flood`: fair service of control requests (issue 16). One backend, two loopback
//! VMs. VM `victim` makes a steady stream of control round trips (ALLOC_VRAM, MAP_VRAM,
//! UNMAP, FREE_MEM of a 4 KiB buffer) and records each request's latency: first alone,
//! then while VM `flooder` floods its control queue from several guest processes with the
//! most expensive requests it may make, then while it floods its event queue (which it
//! never drains). The victim's p50/p99/max of each phase are printed side by side with
//! the ratio to the phase alone, and the flooder's request rate.
//!
//! The rig ([`Victim`], [`Flood`]) is public: `bench/tests/flood_fair.rs` drives it over
//! a `vgpu-test-support` host.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;
use vgpu_backend::{VgpuBackend, VmLimits};
use vgpu_guest::Device;
use vgpu_host_shim::{HalError, SimConfig, SimGpu};
use vgpu_loopback::{LoopbackConfig, LoopbackError, LoopbackVm};
use vgpu_protocol::request::{
    decode_reply, GuestRange, Op, ReplyBody, Request, RequestError, PAGE_2M, PAGE_4K,
};
use vgpu_protocol::ErrorCode;

use crate::report::{Better, Figure};

const SUITE: &str = "flood";
const MIB: u64 = 1 << 20;
/// The bound on a victim's request latency, whatever another VM does (docs/BENCHMARKS.md
/// suite `flood`): what remains is CPU time on a host whose cores the flood shares, no
/// backend lock; one scheduling period of a loaded 2-core host fits in it.
pub const P99_BOUND_US: f64 = 2_000.0;
/// The longest single request, same reason.
pub const MAX_BOUND_US: f64 = 50_000.0;
/// Where the rig maps things in a context's GPU address space.
const VA_VRAM: u64 = 1 << 32;
const VA_GUEST: u64 = 1 << 34;
/// A GP ring nothing maps: a SUBMIT to it faults (a CHANNEL_ERROR event).
const VA_UNMAPPED_RING: u64 = 1 << 30;

#[derive(Debug, Error)]
pub enum FloodError {
    #[error("GPU: {0}")]
    Hal(#[from] HalError),
    #[error("backend: {0}")]
    Backend(String),
    #[error("loopback VM: {0}")]
    Loopback(#[from] LoopbackError),
    #[error("runtime: {0}")]
    Runtime(#[from] vgpu_guest::Error),
    #[error("malformed reply: {0}")]
    Reply(#[from] RequestError),
    #[error("{what} failed: {code}")]
    Refused { what: &'static str, code: ErrorCode },
    #[error("unexpected reply to {0}")]
    Unexpected(&'static str),
    #[error("a flooder thread panicked")]
    Panicked,
}

#[derive(Debug, Clone)]
pub struct FloodOpts {
    /// Length of each phase.
    pub secs: f64,
    /// Guest processes per kind of flood request.
    pub procs_per_kind: u32,
    /// The flooder's VRAM objects (mapped with 4 KiB pages: the most page-table work).
    pub big_alloc_bytes: u64,
    /// Pause of the victim between its rounds of four requests.
    pub victim_gap: Duration,
}

impl FloodOpts {
    pub fn full() -> Self {
        FloodOpts {
            secs: 3.0,
            procs_per_kind: 1,
            big_alloc_bytes: 128 * MIB,
            victim_gap: Duration::from_micros(200),
        }
    }

    pub fn quick() -> Self {
        FloodOpts {
            secs: 0.5,
            big_alloc_bytes: 16 * MIB,
            ..Self::full()
        }
    }
}

/// One control request from guest process `pid`, answered.
pub fn call(
    vm: &LoopbackVm,
    pid: u32,
    ctx: u32,
    op: Op,
) -> Result<Result<ReplyBody, ErrorCode>, FloodError> {
    let req = Request { pid, ctx, op };
    let reply = vm.request(&req.encode())?;
    Ok(decode_reply(req.opcode(), &reply)?)
}

/// As [`call`], for requests that must succeed.
fn must(
    vm: &LoopbackVm,
    pid: u32,
    ctx: u32,
    op: Op,
    what: &'static str,
) -> Result<ReplyBody, FloodError> {
    call(vm, pid, ctx, op)?.map_err(|code| FloodError::Refused { what, code })
}

fn create_context(vm: &LoopbackVm, pid: u32) -> Result<u32, FloodError> {
    match must(vm, pid, 0, Op::CreateContext, "CREATE_CONTEXT")? {
        ReplyBody::Context { ctx, .. } => Ok(ctx),
        _ => Err(FloodError::Unexpected("CREATE_CONTEXT")),
    }
}

/// Latencies of one phase, in µs, sorted.
#[derive(Debug, Clone, Default)]
pub struct Latencies(Vec<f64>);

impl Latencies {
    fn from_unsorted(mut v: Vec<f64>) -> Self {
        v.sort_by(f64::total_cmp);
        Latencies(v)
    }

    pub fn count(&self) -> usize {
        self.0.len()
    }

    /// The `p`th percentile (0 without samples).
    pub fn pct(&self, p: f64) -> f64 {
        let s = &self.0;
        if s.is_empty() {
            return 0.0;
        }
        let i = ((p / 100.0) * (s.len() - 1) as f64).round() as usize;
        s[i.min(s.len() - 1)]
    }

    pub fn max(&self) -> f64 {
        self.0.last().copied().unwrap_or(0.0)
    }
}

/// The victim: one guest process with one context, doing ALLOC+MAP+UNMAP+FREE rounds.
pub struct Victim {
    vm: Arc<LoopbackVm>,
    pid: u32,
    ctx: u32,
}

impl Victim {
    pub fn new(vm: Arc<LoopbackVm>) -> Result<Self, FloodError> {
        let pid = 1;
        let ctx = create_context(&vm, pid)?;
        Ok(Victim { vm, pid, ctx })
    }

    /// Rounds for `dur`, `gap` apart; every request's latency.
    pub fn run(&self, dur: Duration, gap: Duration) -> Result<Latencies, FloodError> {
        let (vm, pid, ctx) = (&*self.vm, self.pid, self.ctx);
        let mut lat = Vec::new();
        let mut timed = |op: Op, what: &'static str| -> Result<ReplyBody, FloodError> {
            let t = Instant::now();
            let r = must(vm, pid, ctx, op, what);
            lat.push(t.elapsed().as_secs_f64() * 1e6);
            r
        };
        let end = Instant::now() + dur;
        while Instant::now() < end {
            let mem = match timed(
                Op::AllocVram {
                    size: 4096,
                    align: 4096,
                },
                "ALLOC_VRAM",
            )? {
                ReplyBody::Mem { mem, .. } => mem,
                _ => return Err(FloodError::Unexpected("ALLOC_VRAM")),
            };
            let map = Op::MapVram {
                mem,
                flags: 0,
                va: VA_VRAM,
                page: PAGE_4K,
            };
            timed(map, "MAP_VRAM")?;
            timed(Op::Unmap { va: VA_VRAM }, "UNMAP")?;
            timed(Op::FreeMem { mem }, "FREE_MEM")?;
            std::thread::sleep(gap);
        }
        Ok(Latencies::from_unsorted(lat))
    }
}

/// What a flooder floods with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloodKind {
    /// The control queue: big VRAM objects mapped with 4 KiB pages, MAP_GUEST with the
    /// most scatter-gather entries, context + channel churn whose SUBMITs fault (events),
    /// invalid requests.
    Control,
    /// The event queue (never drained): channels posting NOTIFYs as fast as the GPU runs
    /// them, and the faulting churn.
    Events,
}

/// Counts of a flood.
#[derive(Debug, Default)]
struct FloodCounts {
    requests: AtomicU64,
    refused: AtomicU64,
    notifies: AtomicU64,
}

/// A running flood: guest processes of one VM, each in a thread.
pub struct Flood {
    stop: Arc<AtomicBool>,
    counts: Arc<FloodCounts>,
    threads: Vec<JoinHandle<Result<(), FloodError>>>,
    started: Instant,
}

/// What a flood did.
#[derive(Debug, Clone, Copy)]
pub struct FloodReport {
    pub requests: u64,
    /// Of those, answered with an error (invalid ones, limits).
    pub refused: u64,
    /// NOTIFY methods the GPU ran for the flooder.
    pub notifies: u64,
    pub secs: f64,
}

impl FloodReport {
    pub fn rate(&self) -> f64 {
        self.requests as f64 / self.secs.max(1e-9)
    }
}

impl Flood {
    /// Starts `procs_per_kind` guest processes of each request kind of `kind` on `vm`.
    pub fn start(
        vm: &Arc<LoopbackVm>,
        kind: FloodKind,
        procs_per_kind: u32,
        big_alloc_bytes: u64,
    ) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let counts = Arc::new(FloodCounts::default());
        let loops: &[Loop] = match kind {
            FloodKind::Control => &[Loop::BigMap, Loop::MapGuest, Loop::Churn, Loop::Invalid],
            FloodKind::Events => &[Loop::Notify, Loop::Churn],
        };
        let mut threads = Vec::new();
        let mut pid = 100;
        for _ in 0..procs_per_kind {
            for &l in loops {
                pid += 1;
                let (vm, stop, counts) = (vm.clone(), stop.clone(), counts.clone());
                let cfg = LoopCfg {
                    pid,
                    big_alloc_bytes,
                };
                threads.push(std::thread::spawn(move || l.run(&vm, cfg, &stop, &counts)));
            }
        }
        Flood {
            stop,
            counts,
            threads,
            started: Instant::now(),
        }
    }

    /// Stops the flood; what it did, or the first error of a flooder process.
    pub fn finish(self) -> Result<FloodReport, FloodError> {
        self.stop.store(true, Ordering::Relaxed);
        let secs = self.started.elapsed().as_secs_f64();
        let mut first_err = None;
        for t in self.threads {
            let r = t.join().unwrap_or(Err(FloodError::Panicked));
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        Ok(FloodReport {
            requests: self.counts.requests.load(Ordering::Relaxed),
            refused: self.counts.refused.load(Ordering::Relaxed),
            notifies: self.counts.notifies.load(Ordering::Relaxed),
            secs,
        })
    }
}

#[derive(Debug, Clone, Copy)]
struct LoopCfg {
    pid: u32,
    big_alloc_bytes: u64,
}

/// One flooder process's loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loop {
    BigMap,
    MapGuest,
    Churn,
    Invalid,
    Notify,
}

impl Loop {
    fn run(
        self,
        vm: &Arc<LoopbackVm>,
        cfg: LoopCfg,
        stop: &AtomicBool,
        counts: &FloodCounts,
    ) -> Result<(), FloodError> {
        let pid = cfg.pid;
        // Each request counts; the flood goes on whatever the answer.
        let req = |ctx: u32, op: Op| -> Result<Option<ReplyBody>, FloodError> {
            counts.requests.fetch_add(1, Ordering::Relaxed);
            let r = call(vm, pid, ctx, op)?;
            if r.is_err() {
                counts.refused.fetch_add(1, Ordering::Relaxed);
            }
            Ok(r.ok())
        };
        match self {
            Loop::BigMap => {
                let ctx = create_context(vm, pid)?;
                while !stop.load(Ordering::Relaxed) {
                    let op = Op::AllocVram {
                        size: cfg.big_alloc_bytes,
                        align: 2 * MIB,
                    };
                    let Some(ReplyBody::Mem { mem, .. }) = req(ctx, op)? else {
                        continue;
                    };
                    let map = Op::MapVram {
                        mem,
                        flags: 0,
                        va: VA_VRAM,
                        page: PAGE_4K,
                    };
                    req(ctx, map)?;
                    req(ctx, Op::Unmap { va: VA_VRAM })?;
                    req(ctx, Op::FreeMem { mem })?;
                }
            }
            Loop::MapGuest => {
                let ctx = create_context(vm, pid)?;
                // The most scatter-gather entries a request may carry, 64 KiB each.
                let n = vgpu_protocol::request::MAX_SG_ENTRIES as u64;
                let piece = 64 * 1024;
                let g = vm.alloc_guest(n * piece, 4096)?;
                let ranges: Vec<GuestRange> = (0..n)
                    .rev()
                    .map(|i| GuestRange {
                        gpa: g.gpa + i * piece,
                        len: piece,
                    })
                    .collect();
                while !stop.load(Ordering::Relaxed) {
                    let op = Op::MapGuest {
                        va: VA_GUEST,
                        page: PAGE_4K,
                        flags: 0,
                        ranges: ranges.clone(),
                    };
                    req(ctx, op)?;
                    req(ctx, Op::Unmap { va: VA_GUEST })?;
                }
                vm.free_guest(g.gpa)?;
            }
            Loop::Churn => {
                while !stop.load(Ordering::Relaxed) {
                    let Some(ReplyBody::Context { ctx, .. }) = req(0, Op::CreateContext)? else {
                        continue;
                    };
                    let op = Op::CreateChannel {
                        gp_ring_va: VA_UNMAPPED_RING,
                        gp_entries: 256,
                    };
                    if let Some(ReplyBody::Channel { channel, .. }) = req(ctx, op)? {
                        // The GPU fetches from an unmapped ring: a CHANNEL_ERROR event.
                        req(ctx, Op::Submit { channel, gp_put: 1 })?;
                        req(ctx, Op::DestroyChannel { channel })?;
                    }
                    req(ctx, Op::DestroyContext)?;
                }
            }
            Loop::Invalid => {
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    i = i.wrapping_add(1);
                    counts.requests.fetch_add(1, Ordering::Relaxed);
                    counts.refused.fetch_add(1, Ordering::Relaxed);
                    // Garbage, then well-formed requests on objects that do not exist.
                    let garbage = [0xffu8, 0xee, 0xdd, 0xcc, i as u8, 0, 0, 0, 1, 2, 3];
                    vm.request(&garbage)?;
                    let op = match i % 3 {
                        0 => Op::FreeMem { mem: i },
                        1 => Op::MapVram {
                            mem: i,
                            flags: 0,
                            va: VA_VRAM,
                            page: PAGE_2M,
                        },
                        _ => Op::DestroyChannel { channel: i },
                    };
                    req(i % 7, op)?;
                }
            }
            Loop::Notify => {
                let dev = Device::loopback(vm.clone(), pid)?;
                let ctx = dev.create_context()?;
                let mut ch = ctx.create_channel()?;
                let mut token = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..64 {
                        token = token.wrapping_add(1);
                        ch.notify(token)?;
                    }
                    let f = ch.submit()?;
                    ch.wait_timeout(f, Duration::from_secs(5))?;
                    counts.notifies.fetch_add(64, Ordering::Relaxed);
                }
            }
        }
        Ok(())
    }
}

fn fig(name: &str, value: f64, unit: &str, better: Better) -> Figure {
    Figure::new(SUITE, name, value, unit, better)
}

/// The victim's figures of one phase, named `<phase>_p50` etc.
fn phase_figures(figs: &mut Vec<Figure>, phase: &str, l: &Latencies) {
    figs.push(fig(
        &format!("victim_{phase}_p50"),
        l.pct(50.0),
        "us",
        Better::Lower,
    ));
    figs.push(
        fig(
            &format!("victim_{phase}_p99"),
            l.pct(99.0),
            "us",
            Better::Lower,
        )
        .target(P99_BOUND_US),
    );
    figs.push(
        fig(&format!("victim_{phase}_max"), l.max(), "us", Better::Lower).target(MAX_BOUND_US),
    );
}

pub fn run(opts: &FloodOpts) -> Result<Vec<Figure>, FloodError> {
    let sim = SimGpu::new(SimConfig::default())?;
    let backend = VgpuBackend::new(sim, VmLimits::default());
    let dir =
        vgpu_test_support::try_temp_dir("flood").map_err(|e| FloodError::Backend(e.to_string()))?;
    let result = measure(opts, &backend, &dir);
    backend.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn measure(
    opts: &FloodOpts,
    backend: &Arc<VgpuBackend>,
    dir: &std::path::Path,
) -> Result<Vec<Figure>, FloodError> {
    let mut vms = Vec::new();
    for name in ["victim", "flooder"] {
        let sock = dir.join(format!("{name}.sock"));
        backend
            .serve_vm(name, &sock)
            .map_err(|e| FloodError::Backend(e.to_string()))?;
        let cfg = LoopbackConfig::with_mem(96 * MIB);
        vms.push(vgpu_test_support::connect_retry(
            &sock,
            cfg,
            Duration::from_secs(10),
        )?);
    }
    let (victim_vm, flooder) = (vms[0].clone(), vms[1].clone());
    let victim = Victim::new(victim_vm)?;
    let dur = Duration::from_secs_f64(opts.secs);
    // Warm-up: first-touch costs are nobody's flood.
    victim.run(dur / 4, opts.victim_gap)?;
    let alone = victim.run(dur, opts.victim_gap)?;
    let mut phases = Vec::new();
    for kind in [FloodKind::Control, FloodKind::Events] {
        let flood = Flood::start(&flooder, kind, opts.procs_per_kind, opts.big_alloc_bytes);
        // Let the flood reach its pace before measuring.
        std::thread::sleep(Duration::from_millis(100));
        let lat = victim.run(dur, opts.victim_gap)?;
        let report = flood.finish()?;
        phases.push((kind, lat, report));
    }
    let stats = backend.vm_stats("flooder").unwrap_or_default();

    let mut figs = vec![fig(
        "victim_requests_alone",
        alone.count() as f64,
        "requests",
        Better::Higher,
    )];
    phase_figures(&mut figs, "alone", &alone);
    for (kind, lat, report) in &phases {
        let phase = match kind {
            FloodKind::Control => "flood",
            FloodKind::Events => "events",
        };
        phase_figures(&mut figs, phase, lat);
        figs.push(fig(
            &format!("victim_p99_{phase}_vs_alone"),
            lat.pct(99.0) / alone.pct(99.0).max(1e-9),
            "x",
            Better::Lower,
        ));
        figs.push(fig(
            &format!("flooder_{phase}_requests_per_s"),
            report.rate(),
            "1/s",
            Better::Higher,
        ));
        if *kind == FloodKind::Events {
            figs.push(fig(
                "flooder_notifies_per_s",
                report.notifies as f64 / report.secs.max(1e-9),
                "1/s",
                Better::Higher,
            ));
        }
    }
    figs.push(fig(
        "flooder_events_dropped",
        stats.events_dropped as f64,
        "events",
        Better::Lower,
    ));
    figs.push(fig(
        "flooder_events_pending",
        stats.events_pending as f64,
        "events",
        Better::Lower,
    ));
    for vm in &vms {
        vm.disconnect();
    }
    Ok(figs)
}
