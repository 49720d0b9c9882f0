//! The GPU scheduler: shares the GPU among VMs by operator weight, then among the guest
//! processes of each VM, by shadowing over-users (see [`crate::shadow`]) for the next
//! interval. Disengaged: nothing traps on the submission fast path; the scheduler only
//! remaps control pages between intervals.
//!
//! Each interval the scheduler thread
//! 1. reads every live channel's counters from the HAL and its submission state (real or
//!    shadow GP_PUT ahead of GP_GET) and charges its GPU time ([`account`]: busy counters,
//!    or GP_GET progress × sampled entry cost on HALs without counters), rolled up
//!    VM → guest process → channel ([`shares`]);
//! 2. decides with the policy: [`fair`] (hierarchical WFQ over measured GPU time, the
//!    default), [`timeslice`] (round-robin slices), [`sampling`] (NEON-style draining and
//!    sampling, for HALs without counters) or none (the GPU's own round-robin);
//! 3. shadows the chosen channels, unshadows (or, with an unshadow cap, capped-releases)
//!    the channels it shadowed before and no longer picks, and mirrors GPU progress into
//!    the shadow pages so guests see their released work finish;
//! 4. runs the kernel [`watchdog`] if one is configured.
//!
//! The thread runs under every policy (with `none` it only accounts and watches), so
//! shares and the watchdog are always available. The scheduler only ever unshadows
//! channels it shadowed itself; stopping it (or switching policy) unshadows them all.

pub mod account;
pub mod api;
pub mod cli;
pub mod entitle;
pub mod fair;
pub mod handle;
pub mod sampling;
pub mod shares;
pub mod stall;
pub mod timeslice;
pub mod watchdog;

use std::collections::{BTreeMap, BTreeSet};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{debug, info, trace, warn};
use thiserror::Error;

use vgpu_host_shim::clock::now_ns;
use vgpu_host_shim::{ChannelCounters, ChannelId};
use vgpu_protocol::ErrorCode;

use crate::shadow::{ChannelPeek, Holder, Holders};
use crate::VgpuBackend;
use account::{Accounting, Estimator};
use fair::{ChannelSample, Decision, FairState, ProcSample, VmSample};
use handle::{HoldChange, RetiredChannel, SchedVm, VmHolds};
use sampling::{SampleObs, Sampler};
use shares::{ChannelBusy, History, IntervalRecord, ProcBusy, VmBusy};
use stall::Stalls;
use timeslice::Timeslice;
use watchdog::Watchdog;

/// How long the scheduler waits for a VM's session lock before it leaves that VM as it
/// was for the interval: whatever holds the lock, a tick stays bounded.
pub const SESSION_LOCK_WAIT: Duration = Duration::from_millis(1);

/// A VM's held backlog, in intervals of GPU time, that is released at once; beyond it the
/// release is spread over intervals (see `Sched::release_changes`).
pub const RELEASE_BUDGET_INTERVALS: u64 = 1;

/// Every this many intervals (10 s at the default interval) the scheduler looks at every
/// channel, quiet or not, and forgets what it knew of channels and processes it no longer
/// sees; in between, quiet channels cost a control-page read each and dormant VMs one
/// read of their activity count. Nothing waits for a sweep to be seen (destroyed channels
/// are reported, dormant VMs' activity moves their count): it only collects what was
/// left behind, so it can be rare. A sweep at 1,024 channels costs ~4–6 ms on the
/// 2-core development host (issue 15): every 100 intervals that was 0.4–0.6 % of a core
/// on its own.
pub const FULL_SWEEP_INTERVALS: u64 = 1000;

/// A VM whose every channel was quiet at its last observation (dormant) is looked at
/// again when its activity count ([`handle::SchedVm::activity`], kept by the GPU's front
/// end) has moved since that look: a channel can use GPU time only for an entry the GPU
/// fetched, and each fetch moves the count, so an unmoved count proves the VM still idle
/// without locking its session or reading a page. On a GPU that keeps no such count a
/// dormant VM is observed only every this many intervals, staggered across VMs: work it
/// starts runs unshadowed until its next look (at most this many intervals) and is charged
/// in full then: the busy counters keep counting, so only the reaction is later, not the
/// accounting.
pub const DORMANT_LOOK_INTERVALS: u64 = 4;

/// Operator weights of VMs: 1..=[`MAX_WEIGHT`], [`DEFAULT_WEIGHT`] unless set.
pub const MIN_WEIGHT: u32 = 1;
pub const MAX_WEIGHT: u32 = 10_000;
pub const DEFAULT_WEIGHT: u32 = 100;

/// Errors of the scheduler's operator interface.
#[derive(Debug, Error)]
pub enum SchedError {
    #[error("scheduling policy {0:?} is not implemented")]
    NotImplemented(Policy),
    #[error("invalid scheduler configuration: {0}")]
    InvalidConfig(String),
    #[error(
        "the GPU reports no per-channel busy time: use the `sampling` policy (GP_GET \
         progress × sampled entry cost); the watchdog needs busy counters"
    )]
    NoBusyCounters,
    #[error("weight {0} out of range {MIN_WEIGHT}..={MAX_WEIGHT}")]
    InvalidWeight(u32),
    #[error("too many process weight hints for VM {0:?}")]
    TooManyHints(String),
    #[error("no VM named {0:?}")]
    NoVm(String),
    #[error("the backend is shutting down")]
    ShuttingDown,
    #[error("cannot start the scheduler thread: {0}")]
    Thread(std::io::Error),
}

/// How the GPU is shared.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Policy {
    /// No scheduling: the GPU's own round-robin arbitration (unfair: long kernels win).
    None,
    /// Round-robin time slices: one guest process of one VM at a time runs.
    Timeslice,
    /// Two-level weighted fair queuing over measured GPU time.
    #[default]
    Fair,
    /// NEON-style draining and sampling: fair shares from GP_GET progress × a sampled
    /// cost per entry, for HALs without busy counters.
    Sampling,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::None => "none",
            Policy::Timeslice => "timeslice",
            Policy::Fair => "fair",
            Policy::Sampling => "sampling",
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = SchedError;
    fn from_str(s: &str) -> Result<Self, SchedError> {
        match s {
            "none" => Ok(Policy::None),
            "timeslice" => Ok(Policy::Timeslice),
            "fair" => Ok(Policy::Fair),
            "sampling" => Ok(Policy::Sampling),
            _ => Err(SchedError::InvalidConfig(format!("unknown policy {s:?}"))),
        }
    }
}

/// Scheduler tunables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedConfig {
    pub policy: Policy,
    /// Length of a scheduling interval (1..=1000 ms).
    pub interval_ms: u32,
    /// GPU time an entity may run ahead of its least-served saturating sibling (beyond its
    /// weighted share) before it is shadowed (`fair`, `sampling`).
    pub threshold_us: u64,
    /// When set, a channel the policy lets run again is not unshadowed while its backlog
    /// exceeds this many entries: it gets a capped release of that many per interval
    /// instead (bounds the non-preemptible burst a released over-user dumps on the GPU).
    pub unshadow_cap: Option<u32>,
    /// Length of a `timeslice` slice (1..=10000 ms; rounded up to whole intervals).
    pub slice_ms: u32,
    /// How often `sampling` re-measures every active channel's cost per entry
    /// (10..=600000 ms).
    pub sample_period_ms: u32,
    /// Kill a channel whose single kernel has run longer than this (ms; `None`: no
    /// watchdog). Needs busy counters.
    pub watchdog_ms: Option<u32>,
    /// Use it or lose it (`fair`, `sampling`): when a sibling was held back and the GPU
    /// still idled, charge the idle time to the siblings that were allowed to run (see
    /// [`fair`]). Favours GPU utilization over exact busy-time shares when some tenant
    /// cannot keep the GPU busy by itself.
    pub charge_idle: bool,
}

impl Default for SchedConfig {
    fn default() -> Self {
        SchedConfig {
            policy: Policy::Fair,
            interval_ms: 10,
            threshold_us: 5_000,
            unshadow_cap: None,
            slice_ms: 50,
            sample_period_ms: 2_000,
            watchdog_ms: None,
            charge_idle: false,
        }
    }
}

impl SchedConfig {
    fn validate(&self) -> Result<(), SchedError> {
        let bad = |m: String| Err(SchedError::InvalidConfig(m));
        if !(1..=1000).contains(&self.interval_ms) {
            return bad(format!("interval_ms {} not in 1..=1000", self.interval_ms));
        }
        if self.unshadow_cap == Some(0) {
            return bad("unshadow_cap of 0".into());
        }
        if !(1..=10_000).contains(&self.slice_ms) {
            return bad(format!("slice_ms {} not in 1..=10000", self.slice_ms));
        }
        if !(10..=600_000).contains(&self.sample_period_ms) {
            return bad(format!(
                "sample_period_ms {} not in 10..=600000",
                self.sample_period_ms
            ));
        }
        if self.watchdog_ms == Some(0) {
            return bad("watchdog_ms of 0".into());
        }
        if self.threshold_us > 10_000_000 {
            return bad(format!("threshold_us {} above 10 s", self.threshold_us));
        }
        Ok(())
    }
}

/// Counters of the scheduler.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedStats {
    pub intervals: u64,
    pub shadows: u64,
    pub unshadows: u64,
    pub capped_releases: u64,
    /// Remaps that failed (the channel is left as it was).
    pub failures: u64,
    /// Channels shadowed by the scheduler now.
    pub shadowed_now: u32,
    /// Time of the last interval's work (sampling, deciding, remapping), and the worst.
    pub tick_ns_last: u64,
    pub tick_ns_max: u64,
    /// Channels the watchdog killed.
    pub watchdog_kills: u64,
    /// Times a VM was left as it was for an interval because its session stayed locked
    /// past [`SESSION_LOCK_WAIT`] (a long request, a frontend slow to ack a remap).
    pub busy_skips: u64,
    /// Channels the last interval looked at in full, and the quiet ones it only counted
    /// (idle since the previous look: see [`handle::SchedVm::observe`]).
    pub observed_channels: u32,
    pub quiet_channels: u32,
    /// `sampling`: rounds started, samples taken, samples dropped.
    pub sample_rounds: u64,
    pub samples: u64,
    pub samples_aborted: u64,
}

/// A running scheduler thread.
pub(crate) struct Running {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<()>,
}

/// Per-VM guest process weight hints: VM name -> PID -> weight.
type Hints = BTreeMap<String, BTreeMap<u32, u32>>;

/// Most weight hints kept per VM.
pub const MAX_HINTS_PER_VM: usize = 4096;

/// The scheduler's part of the backend.
#[derive(Default)]
pub(crate) struct SchedSlot {
    running: Mutex<Option<Running>>,
    config: Mutex<Option<SchedConfig>>,
    stats: Arc<Mutex<SchedStats>>,
    history: Arc<Mutex<History>>,
    hints: Arc<Mutex<Hints>>,
    /// Interval numbers continue across restarts.
    seq: Arc<AtomicU64>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl SchedSlot {
    pub(crate) fn config(&self) -> Option<SchedConfig> {
        *lock(&self.config)
    }

    pub(crate) fn stats(&self) -> SchedStats {
        *lock(&self.stats)
    }

    /// Stops the thread (which unshadows what it shadowed) and waits for it, unless
    /// called from the thread itself.
    pub(crate) fn stop(&self) {
        let running = lock(&self.running).take();
        if let Some(r) = running {
            r.stop.store(true, Ordering::Release);
            r.handle.thread().unpark();
            if r.handle.thread().id() != std::thread::current().id() {
                let _ = r.handle.join();
            }
        }
    }
}

/// Starts (or restarts with a new configuration) the scheduler of `be`.
pub(crate) fn start(be: &Arc<VgpuBackend>, cfg: SchedConfig) -> Result<(), SchedError> {
    cfg.validate()?;
    let info = be.gpu().info();
    let (counters, engines) = (info.has_busy_counters, info.compute_engines);
    if !counters && (cfg.policy == Policy::Fair || cfg.watchdog_ms.is_some()) {
        return Err(SchedError::NoBusyCounters);
    }
    let slot = &be.sched;
    slot.stop();
    *lock(&slot.config) = Some(cfg);
    let mut running = lock(&slot.running);
    if be.stop.load(Ordering::Acquire) {
        return Err(SchedError::ShuttingDown);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let weak = Arc::downgrade(be);
    let shared = Shared {
        stats: slot.stats.clone(),
        history: slot.history.clone(),
        hints: slot.hints.clone(),
        seq: slot.seq.clone(),
    };
    let stop2 = stop.clone();
    let handle = std::thread::Builder::new()
        .name("vgpu-sched".into())
        .spawn(move || thread_main(weak, cfg, (counters, engines), stop2, shared))
        .map_err(SchedError::Thread)?;
    *running = Some(Running { stop, handle });
    info!(
        "scheduler: policy {}, interval {} ms, threshold {} us, unshadow cap {:?}, \
         slice {} ms, sample period {} ms, watchdog {:?} ms, charge idle {}",
        cfg.policy,
        cfg.interval_ms,
        cfg.threshold_us,
        cfg.unshadow_cap,
        cfg.slice_ms,
        cfg.sample_period_ms,
        cfg.watchdog_ms,
        cfg.charge_idle
    );
    Ok(())
}

/// What the thread shares with the backend's observers.
struct Shared {
    stats: Arc<Mutex<SchedStats>>,
    history: Arc<Mutex<History>>,
    hints: Arc<Mutex<Hints>>,
    seq: Arc<AtomicU64>,
}

/// State of the scheduler thread.
struct Sched {
    cfg: SchedConfig,
    /// Whether busy time comes from the HAL's counters (else GP_GET progress).
    use_counters: bool,
    /// Compute engines of the GPU (idle time is counted over all of them).
    engines: u32,
    acct: Accounting,
    /// Semaphore-wait readings per channel (deltas, as busy time).
    sem_waits: Accounting,
    est: Estimator,
    /// Cost per GP entry of each channel, learnt from busy counters and GP_GET progress
    /// (for the release budget).
    entry_cost: Estimator,
    /// Channels without progress in consecutive intervals (to tell blocked ones).
    stalls: Stalls,
    fair: FairState,
    timeslice: Timeslice,
    sampler: Sampler,
    watchdog: Option<Watchdog>,
    /// Channels this scheduler holds shadowed: (VM, guest channel), as the sessions
    /// recorded them at the last observation.
    shadowed: BTreeSet<(String, u32)>,
    /// Channels with pending work at the last observation (for VMs left alone).
    pending: BTreeSet<(String, u32)>,
    shared: Shared,
    /// Whether the first interval (the accounting baseline) is over.
    primed: bool,
    last_tick_ns: u64,
    /// Intervals so far (for the full sweeps).
    ticks: u64,
    /// The owner holds last applied to each VM, with the VM's connection count then: a
    /// VM without changes, shadows or new owner holds is not locked again.
    applied: BTreeMap<String, (u64, bool, BTreeSet<u32>)>,
    /// The served VMs (refreshed when the backend's set changes), with what the
    /// scheduler remembers of each between ticks.
    vms: Vec<VmSlot>,
    /// The backend's VM-set generation `vms` was taken at.
    vms_gen: Option<u64>,
}

fn thread_main(
    be: Weak<VgpuBackend>,
    cfg: SchedConfig,
    (counters, engines): (bool, u32),
    stop: Arc<AtomicBool>,
    shared: Shared,
) {
    vgpu_sandbox::enter(vgpu_sandbox::Role::Scheduler);
    let mut s = Sched {
        cfg,
        use_counters: counters && cfg.policy != Policy::Sampling,
        engines,
        acct: Accounting::new(),
        sem_waits: Accounting::new(),
        est: Estimator::new(),
        entry_cost: Estimator::new(),
        stalls: Stalls::new(),
        fair: FairState::new(),
        timeslice: Timeslice::new(),
        sampler: Sampler::new(u64::from(cfg.sample_period_ms) * 1_000_000),
        watchdog: cfg
            .watchdog_ms
            .map(|ms| Watchdog::new(u64::from(ms) * 1_000_000)),
        shadowed: BTreeSet::new(),
        pending: BTreeSet::new(),
        shared,
        primed: false,
        last_tick_ns: now_ns(),
        ticks: 0,
        applied: BTreeMap::new(),
        vms: Vec::new(),
        vms_gen: None,
    };
    let interval = Duration::from_millis(u64::from(cfg.interval_ms));
    let mut next = Instant::now() + interval;
    loop {
        while !stop.load(Ordering::Acquire) {
            let now = Instant::now();
            if now >= next {
                break;
            }
            std::thread::park_timeout(next - now);
        }
        if stop.load(Ordering::Acquire) {
            break;
        }
        next += interval;
        if next < Instant::now() {
            // Overran: do not try to catch up with a burst of intervals.
            next = Instant::now() + interval;
        }
        let Some(be) = be.upgrade() else {
            return;
        };
        if be.stop.load(Ordering::Acquire) {
            break;
        }
        s.tick(&be, next);
    }
    if let Some(be) = be.upgrade() {
        s.release_all(&be);
    }
    debug!("scheduler thread stopped");
}

/// A served VM in the scheduler's list: kept across ticks, so that a tick costs a VM that
/// did nothing one read of its activity count (no list, lock or name lookup).
struct VmSlot {
    vm: Arc<dyn SchedVm>,
    activity: Arc<vgpu_host_shim::ActivityCounter>,
    /// Found dormant (disconnected, or nothing active, shadowed or destroyed) at its last
    /// look: the activity count read just before it.
    dormant: Option<u64>,
    /// Whether the GPU counted all its channels' work at the last look (else a dormant
    /// VM is looked at every [`DORMANT_LOOK_INTERVALS`]).
    counted: bool,
}

/// One live channel as seen at a tick.
struct Obs {
    vm: usize,
    ch: u32,
    pid: u32,
    hal: ChannelId,
    counters: ChannelCounters,
    /// `None` when the channel's slot is not mapped (it cannot be shadowed), or its VM's
    /// session could not be locked this tick.
    peek: Option<ChannelPeek>,
    /// Submitted work not finished (from `peek`; for a VM left alone this tick, as at the
    /// previous one).
    pending: bool,
    /// Who holds it shadowed (empty for a VM left alone this tick).
    holders: Holders,
    /// Stopped on an error (faulted, killed): it will never run again.
    dead: bool,
    busy_delta_ns: u64,
    /// Time its next work waited on a semaphore acquire since the previous reading.
    sem_wait_delta_ns: u64,
}

/// One connected VM at a tick.
struct VmObs {
    name: String,
    weight: u32,
    vm: Arc<dyn SchedVm>,
    /// Whether its session was locked for the observation (else it is left as it was).
    locked: bool,
    /// Whether it has shadowed channels (`apply` mirrors their progress).
    shadowing: bool,
    /// Its connection count (owner holds start anew with each connection).
    connection: u64,
    /// Its channels destroyed since the previous tick.
    retired: Vec<RetiredChannel>,
    /// Their GPU time in the interval, per guest PID (filled by `account`).
    retired_busy: BTreeMap<u32, u64>,
}

/// Owner holds of a decision: per VM, whether the whole VM is held and which of its
/// processes are — what a channel created before the next decision is born into. An
/// owner is held when the policy said it is over its share, or when every one of its
/// channels is to be shadowed (`timeslice`, `sampling`).
fn owner_holds(samples: &[VmSample], d: &Decision) -> BTreeMap<String, (bool, BTreeSet<u32>)> {
    let mut out = BTreeMap::new();
    for v in samples {
        let held =
            |c: &ChannelSample| !d.shadow.is_empty() && d.shadow.contains(&(v.name.clone(), c.ch));
        let all_held = |chans: &mut dyn Iterator<Item = &ChannelSample>| {
            let mut any = false;
            for c in chans {
                if !held(c) {
                    return false;
                }
                any = true;
            }
            any
        };
        let vm_held = d.over_vms.contains(&v.name)
            || all_held(&mut v.procs.iter().flat_map(|p| p.channels.iter()));
        let pids: BTreeSet<u32> = v
            .procs
            .iter()
            .filter(|p| {
                d.over_procs.contains(&(v.name.clone(), p.pid)) || all_held(&mut p.channels.iter())
            })
            .map(|p| p.pid)
            .collect();
        out.insert(v.name.clone(), (vm_held, pids));
    }
    out
}

impl Sched {
    fn update_stats(&self, f: impl FnOnce(&mut SchedStats)) {
        let mut st = lock(&self.shared.stats);
        f(&mut st);
        st.shadowed_now = self.shadowed.len() as u32;
    }

    /// Reads every connected VM's channels, and what the sessions record of the
    /// scheduler's holds (its channels born held included). A VM whose session stays
    /// locked past [`SESSION_LOCK_WAIT`] is left as it was.
    fn observe(&mut self, be: &VgpuBackend, full: bool) -> (Vec<VmObs>, Vec<Obs>) {
        let gpu = be.gpu().clone();
        self.refresh_vms(be);
        let (mut vm_obs, mut obs) = (Vec::new(), Vec::new());
        let (mut skips, mut quiet) = (0, 0u32);
        for (pos, slot) in (0u64..).zip(self.vms.iter_mut()) {
            // Read before the look: whatever moves after it moves the count past it.
            let activity = slot.activity.get();
            let look = full
                || match slot.dormant {
                    None => true,
                    Some(seen) if slot.counted => activity != seen,
                    Some(_) => (self.ticks + pos).is_multiple_of(DORMANT_LOOK_INTERVALS),
                };
            if !look {
                // Left out of this interval: no channel of it is active, shadowed or
                // pending, and the policies keep an absent sibling's clock as an idle
                // one's (see `fair`).
                continue;
            }
            let vm = &slot.vm;
            if !vm.connected() {
                // It comes back with new channels, which move its count.
                slot.dormant = Some(activity);
                continue;
            }
            let view = vm.observe(gpu.as_ref(), SESSION_LOCK_WAIT, full);
            let dormant = view.locked
                && view.channels.is_empty()
                && view.retired.is_empty()
                && !view.shadowing;
            slot.dormant = dormant.then_some(activity);
            slot.counted = view.counted;
            skips += u64::from(!view.locked);
            quiet = quiet.saturating_add(view.quiet);
            let idx = vm_obs.len();
            for c in view.channels {
                let pending = if view.locked {
                    c.peek.is_some_and(|p| p.pending())
                } else {
                    self.pending.contains(&(vm.name().to_string(), c.ch))
                };
                obs.push(Obs {
                    vm: idx,
                    ch: c.ch,
                    pid: c.pid,
                    hal: c.hal,
                    counters: c.counters,
                    peek: c.peek,
                    pending,
                    holders: c.holders,
                    dead: gpu.channel_error(c.hal).ok().flatten().is_some(),
                    busy_delta_ns: 0,
                    sem_wait_delta_ns: 0,
                });
            }
            vm_obs.push(VmObs {
                name: vm.name().to_string(),
                weight: vm.weight(),
                locked: view.locked,
                shadowing: view.shadowing,
                connection: view.connection,
                vm: vm.clone(),
                retired: view.retired,
                retired_busy: BTreeMap::new(),
            });
        }
        let mut shadowed = BTreeSet::new();
        let mut pending = BTreeSet::new();
        for o in &obs {
            let Some(v) = vm_obs.get(o.vm) else { continue };
            let key = (v.name.clone(), o.ch);
            let ours = if v.locked {
                o.holders.contains(Holder::Scheduler)
            } else {
                self.shadowed.contains(&key)
            };
            if o.pending {
                pending.insert(key.clone());
            }
            if ours {
                shadowed.insert(key);
            }
        }
        self.shadowed = shadowed;
        self.pending = pending;
        // Forget VMs gone or disconnected (at a full sweep every connected VM is in
        // `vm_obs`).
        if full {
            let names: BTreeSet<&str> = vm_obs.iter().map(|v| v.name.as_str()).collect();
            self.applied.retain(|name, _| names.contains(name.as_str()));
        }
        let observed = u32::try_from(obs.len()).unwrap_or(u32::MAX);
        self.update_stats(|st| {
            st.busy_skips += skips;
            st.observed_channels = observed;
            st.quiet_channels = quiet;
        });
        (vm_obs, obs)
    }

    /// Takes the backend's VM list anew when it changed, keeping what it knew of each VM.
    fn refresh_vms(&mut self, be: &VgpuBackend) {
        let gen = be.sched_vms_gen();
        if self.vms_gen == Some(gen) {
            return;
        }
        let mut old: BTreeMap<String, VmSlot> = std::mem::take(&mut self.vms)
            .into_iter()
            .map(|s| (s.vm.name().to_string(), s))
            .collect();
        self.vms = be
            .sched_vms()
            .into_iter()
            .map(|vm| match old.remove(vm.name()) {
                Some(slot) if std::ptr::addr_eq(Arc::as_ptr(&slot.vm), Arc::as_ptr(&vm)) => slot,
                _ => VmSlot {
                    activity: vm.activity(),
                    vm,
                    dormant: None,
                    counted: false,
                },
            })
            .collect();
        self.vms_gen = Some(gen);
    }

    /// Charges each channel its GPU time of the interval, and each process the time of
    /// its channels destroyed since the previous tick.
    fn account(&mut self, vms: &mut [VmObs], obs: &mut [Obs], full: bool) {
        for o in obs.iter_mut() {
            o.busy_delta_ns = if self.use_counters {
                self.acct.delta(o.hal, o.counters.busy_ns)
            } else {
                match o.peek {
                    Some(p) => {
                        let n = self.est.progress(o.hal, p.gp_get);
                        self.est.busy_ns(o.hal, n)
                    }
                    None => 0,
                }
            };
            if self.use_counters {
                o.sem_wait_delta_ns = self.sem_waits.delta(o.hal, o.counters.sem_wait_ns);
            }
        }
        if self.use_counters {
            for o in obs.iter() {
                if let Some(p) = o.peek {
                    let n = self.entry_cost.progress(o.hal, p.gp_get);
                    if n > 0 && o.busy_delta_ns > 0 {
                        self.entry_cost.record(o.hal, n, o.busy_delta_ns);
                    }
                }
            }
            self.entry_cost.end_interval(full);
        }
        for v in vms.iter_mut() {
            for r in std::mem::take(&mut v.retired) {
                // Without counters the last progress of a destroyed channel is unknown.
                let d = if self.use_counters {
                    self.acct.delta(r.hal, r.busy_ns)
                } else {
                    0
                };
                *v.retired_busy.entry(r.pid).or_default() += d;
                // HAL channel ids are never reused: nothing of it is needed again.
                self.acct.forget(r.hal);
                self.sem_waits.forget(r.hal);
                self.est.forget(r.hal);
                self.entry_cost.forget(r.hal);
                self.stalls.forget(r.hal);
            }
        }
        self.acct.end_interval(full);
        self.sem_waits.end_interval(full);
        self.est.end_interval(full);
    }

    /// The policy's input: VMs → processes (with their weight hints) → channels.
    ///
    /// A channel counts as having pending work only if it could use the GPU: not dead,
    /// and not *blocked* — submitted work, not held back by us, no GPU time for
    /// [`stall::BLOCKED_AFTER_INTERVALS`] intervals in a row or more, and the GPU idled
    /// in one of them (waiting on a semaphore, say). A blocked channel counted as
    /// pending would hold its siblings back (its clock never moves) — and if a held-back
    /// sibling is the one that would release it, forever. See [`stall`] for why one
    /// interval is not enough. Nor does a channel whose work waited on a semaphore for
    /// half the interval or more by the GPU's own count (`sem_wait_ns`): a queue that
    /// waits between short kernels never stalls three intervals in a row, and counted as
    /// pending it held a steady VM at 0.0 % of the GPU while the GPU idled (issue 28).
    fn samples(
        &mut self,
        vms: &[VmObs],
        obs: &[Obs],
        idle_ns: u64,
        len_ns: u64,
        full: bool,
    ) -> Vec<VmSample> {
        let gpu_idled = idle_ns.saturating_mul(10) > len_ns;
        // `len_ns` is the capacity of all compute engines; a channel runs on one.
        let interval_ns = len_ns / u64::from(self.engines.max(1));
        let hints = lock(&self.shared.hints);
        let mut out: Vec<VmSample> = vms
            .iter()
            .map(|v| VmSample {
                name: v.name.clone(),
                weight: v.weight,
                procs: Vec::new(),
            })
            .collect();
        let mut procs: BTreeMap<(usize, u32), (Vec<ChannelSample>, u64)> = BTreeMap::new();
        for o in obs {
            let held = !self.shadowed.is_empty()
                && vms
                    .get(o.vm)
                    .is_some_and(|v| self.shadowed.contains(&(v.name.clone(), o.ch)));
            let stalled = o.pending && !o.dead && o.busy_delta_ns == 0 && !held;
            let blocked = self.stalls.note(o.hal, stalled, gpu_idled);
            // Its work waited on a semaphore for half the interval or more, by the GPU's
            // own count: it could not have used the GPU then (issue 28).
            let sem_waiting = o.sem_wait_delta_ns.saturating_mul(2) >= interval_ns;
            procs
                .entry((o.vm, o.pid))
                .or_default()
                .0
                .push(ChannelSample {
                    ch: o.ch,
                    busy_delta_ns: o.busy_delta_ns,
                    pending: o.pending && !o.dead && !blocked && !sem_waiting,
                });
        }
        for (i, v) in vms.iter().enumerate() {
            for (pid, busy) in &v.retired_busy {
                if *busy > 0 {
                    procs.entry((i, *pid)).or_default().1 += busy;
                }
            }
        }
        for ((vm, pid), (channels, retired_busy_ns)) in procs {
            if let Some(v) = out.get_mut(vm) {
                let weight = hints
                    .get(&v.name)
                    .and_then(|h| h.get(&pid))
                    .copied()
                    .unwrap_or(1);
                v.procs.push(ProcSample {
                    pid,
                    weight,
                    channels,
                    retired_busy_ns,
                });
            }
        }
        drop(hints);
        self.stalls.end_interval(full);
        out
    }

    fn decide(
        &mut self,
        samples: &[VmSample],
        obs: &[Obs],
        vms: &[VmObs],
        idle: (u64, u64),
        full: bool,
    ) -> Decision {
        let threshold_ns = self.cfg.threshold_us.saturating_mul(1000);
        // Channels shadowed during the interval that just ended.
        let held = self.shadowed.clone();
        match self.cfg.policy {
            Policy::None => Decision::default(),
            Policy::Fair => self
                .fair
                .decide_with_idle(samples, threshold_ns, idle, &held, full),
            Policy::Timeslice => {
                let slice = u64::from(self.cfg.slice_ms) * 1_000_000;
                self.timeslice.decide(samples, now_ns(), slice)
            }
            Policy::Sampling => {
                // The fair clocks are charged even while a sample overrides them.
                let fair = self
                    .fair
                    .decide_with_idle(samples, threshold_ns, idle, &held, full);
                // Dead channels are never sampled (they would never finish a sample).
                let sobs: Vec<SampleObs> = obs
                    .iter()
                    .filter(|o| !o.dead)
                    .filter_map(|o| {
                        let p = o.peek?;
                        Some(SampleObs {
                            key: (vms.get(o.vm)?.name.clone(), o.ch),
                            hal: o.hal,
                            gp_get: p.gp_get,
                            in_flight: p.real_put != p.gp_get,
                            pending: p.pending(),
                        })
                    })
                    .collect();
                let over = self.sampler.tick(&sobs, now_ns(), &mut self.est);
                let st = self.sampler.stats;
                self.update_stats(|s| {
                    s.sample_rounds = st.rounds;
                    s.samples = st.samples;
                    s.samples_aborted = st.aborted;
                });
                match over {
                    Some(shadow) => Decision {
                        shadow,
                        ..Decision::default()
                    },
                    None => fair,
                }
            }
        }
    }

    /// Kills channels whose single kernel ran past the limit; returns how many.
    fn watch(&mut self, be: &VgpuBackend, vms: &[VmObs], obs: &[Obs]) -> u64 {
        let Some(wd) = self.watchdog.as_mut() else {
            return 0;
        };
        let mut kills = 0;
        for o in obs {
            if wd.check(o.hal, &o.counters) {
                let vm = vms.get(o.vm).map_or("?", |v| v.name.as_str());
                match be.gpu().kill_channel(o.hal, ErrorCode::WatchdogKilled) {
                    Ok(()) => {
                        kills += 1;
                        warn!(
                            "watchdog: VM {vm} channel {} (PID {}) ran one kernel past {} ms: \
                             killed",
                            o.ch,
                            o.pid,
                            self.cfg.watchdog_ms.unwrap_or(0)
                        );
                    }
                    Err(e) => debug!("watchdog: kill {vm}/{}: {e}", o.ch),
                }
            }
        }
        wd.end_round();
        kills
    }

    /// Records who used the GPU in the interval; `held`: the channels the scheduler held
    /// shadowed during it.
    fn record(
        &self,
        vms: &[VmObs],
        samples: &[VmSample],
        held: &BTreeSet<(String, u32)>,
        len_ns: u64,
    ) {
        let held_back = |vm: &str, c: &ChannelSample| {
            c.pending && !held.is_empty() && held.contains(&(vm.to_string(), c.ch))
        };
        let seq = self.shared.seq.fetch_add(1, Ordering::Relaxed);
        let rec = IntervalRecord {
            seq,
            end_ns: self.last_tick_ns,
            len_ns,
            estimated: !self.use_counters,
            vms: samples
                .iter()
                .zip(vms)
                .filter(|(s, _)| !s.procs.is_empty())
                .map(|(s, _)| {
                    let procs: Vec<ProcBusy> = s
                        .procs
                        .iter()
                        .map(|p| ProcBusy {
                            pid: p.pid,
                            weight: p.weight,
                            held: p.channels.iter().any(|c| held_back(&s.name, c)),
                            busy_ns: p
                                .channels
                                .iter()
                                .map(|c| c.busy_delta_ns)
                                .sum::<u64>()
                                .saturating_add(p.retired_busy_ns),
                            channels: p
                                .channels
                                .iter()
                                .map(|c| ChannelBusy {
                                    channel: c.ch,
                                    busy_ns: c.busy_delta_ns,
                                })
                                .collect(),
                        })
                        .collect();
                    VmBusy {
                        held: procs.iter().any(|p| p.held),
                        name: s.name.clone(),
                        weight: s.weight,
                        busy_ns: procs.iter().map(|p| p.busy_ns).sum(),
                        procs,
                    }
                })
                .collect(),
        };
        lock(&self.shared.history).push(rec);
    }

    /// While `sampling` measures a channel: polls its control page until `until` and
    /// tells the sampler when it had work released to the GPU.
    fn poll_measured(&mut self, be: &VgpuBackend, vms: &[VmObs], obs: &[Obs], until: Instant) {
        let Some(target) = self.sampler.measuring() else {
            return;
        };
        let Some((name, ch)) = obs
            .iter()
            .find(|o| o.hal == target)
            .and_then(|o| Some((vms.get(o.vm)?.name.clone(), o.ch)))
        else {
            return;
        };
        let Some(vm) = be.sched_vms().into_iter().find(|v| v.name() == name) else {
            return;
        };
        while Instant::now() + sampling::POLL < until {
            let backlogged = vm.backlogged(ch, SESSION_LOCK_WAIT);
            self.sampler.observe_backlog(now_ns(), backlogged);
            std::thread::sleep(sampling::POLL);
        }
    }

    /// One interval: observe, account, decide, enforce, watch, record; then, if
    /// `sampling` is measuring a channel, poll it until `next_tick`.
    fn tick(&mut self, be: &VgpuBackend, next_tick: Instant) {
        let t0 = Instant::now();
        let now = now_ns();
        let len_ns = now.saturating_sub(self.last_tick_ns);
        self.last_tick_ns = now;
        // `sampling` measures channels by letting one run alone and needs them all in
        // view each interval (as does `timeslice`'s rotation): they look at everything.
        let skips_quiet =
            self.use_counters && matches!(self.cfg.policy, Policy::Fair | Policy::None);
        let full = !skips_quiet || self.ticks.is_multiple_of(FULL_SWEEP_INTERVALS);
        self.ticks += 1;
        let (mut vms, mut obs) = self.observe(be, full);
        // What the scheduler held during the interval that just ended.
        let held_during = self.shadowed.clone();
        self.account(&mut vms, &mut obs, full);
        // GPU time nobody used in the interval (all compute engines).
        let used: u64 = obs.iter().map(|o| o.busy_delta_ns).sum::<u64>()
            + vms
                .iter()
                .flat_map(|v| v.retired_busy.values())
                .sum::<u64>();
        let capacity = len_ns.saturating_mul(u64::from(self.engines.max(1)));
        let idle_ns = capacity.saturating_sub(used);
        let samples = self.samples(&vms, &obs, idle_ns, capacity, full);
        let charged_idle = if self.cfg.charge_idle { idle_ns } else { 0 };
        let decision = self.decide(&samples, &obs, &vms, (charged_idle, capacity), full);
        if log::log_enabled!(log::Level::Trace) {
            trace_interval(
                &samples,
                &held_during,
                &decision,
                (idle_ns, len_ns),
                &self.fair,
            );
        }
        // Keyed by VM index: no per-channel allocation (this runs for every channel of
        // every VM each tick).
        let backlog: BTreeMap<(usize, u32), u32> = obs
            .iter()
            .filter_map(|o| Some(((o.vm, o.ch), o.peek?.backlog())))
            .collect();
        let holds = owner_holds(&samples, &decision);
        let (sh, un, capped, failed) = self.enforce(&vms, &obs, &decision, &holds, &backlog, full);
        let kills = self.watch(be, &vms, &obs);
        if self.primed {
            self.record(&vms, &samples, &held_during, len_ns);
        }
        self.primed = true;
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.update_stats(|st| {
            st.intervals += 1;
            st.shadows += sh;
            st.unshadows += un;
            st.capped_releases += capped;
            st.failures += failed;
            st.watchdog_kills += kills;
            st.tick_ns_last = ns;
            st.tick_ns_max = st.tick_ns_max.max(ns);
        });
        self.poll_measured(be, &vms, &obs, next_tick);
    }

    /// How the channels of VM `vm` that the policy lets run again are released. With an
    /// operator `unshadow_cap`, a channel whose backlog exceeds it gets that many entries
    /// per interval. Otherwise the **release budget**: what the guest queued while held is
    /// non-preemptible once released, so a VM whose held backlog exceeds
    /// [`RELEASE_BUDGET_INTERVALS`] intervals of GPU time (at each channel's measured cost
    /// per entry) gets its budget's worth per interval, split over its channels, and stays
    /// shadowed until its backlog fits; below the budget the channels are unshadowed.
    /// This bounds the burst a many-channel tenant dumps on the GPU at each release
    /// (issue 19: 16 channels × 16 entries against 1 channel got 52–94 %), while a tenant
    /// with a normal queue is unshadowed at once (no throughput lost).
    fn release_changes(
        &self,
        releases: &[&Obs],
        backlog: &BTreeMap<(usize, u32), u32>,
    ) -> Vec<(u32, HoldChange)> {
        let entries = |o: &Obs| backlog.get(&(o.vm, o.ch)).copied().unwrap_or(0);
        if let Some(cap) = self.cfg.unshadow_cap {
            return releases
                .iter()
                .map(|o| {
                    if entries(o) > cap {
                        (o.ch, HoldChange::ReleaseCapped(cap))
                    } else {
                        (o.ch, HoldChange::Release)
                    }
                })
                .collect();
        }
        let cost = |o: &Obs| {
            self.entry_cost
                .cost(o.hal)
                .unwrap_or(account::DEFAULT_ENTRY_COST_NS)
                .max(1)
        };
        let budget_ns = u64::from(self.cfg.interval_ms) * 1_000_000 * RELEASE_BUDGET_INTERVALS;
        let queued_ns: u64 = releases
            .iter()
            .map(|o| u64::from(entries(o)).saturating_mul(cost(o)))
            .sum();
        if queued_ns <= budget_ns || releases.is_empty() {
            return releases
                .iter()
                .map(|o| (o.ch, HoldChange::Release))
                .collect();
        }
        let share_ns = budget_ns / releases.len() as u64;
        releases
            .iter()
            .map(|o| {
                let cap = u32::try_from((share_ns / cost(o)).max(1)).unwrap_or(u32::MAX);
                if entries(o) <= cap {
                    (o.ch, HoldChange::Release)
                } else {
                    (o.ch, HoldChange::ReleaseCapped(cap))
                }
            })
            .collect()
    }

    /// Applies a decision, one VM (one session lock) at a time: sets the owner holds new
    /// channels are born into, shadows what it picks, releases what it no longer picks
    /// (capped, with an unshadow cap), retries failed unshadows and mirrors GPU progress
    /// into the shadow pages. VMs left alone this tick are not touched. Returns (shadows,
    /// unshadows, capped releases, failures).
    fn enforce(
        &mut self,
        vms: &[VmObs],
        obs: &[Obs],
        decision: &Decision,
        holds: &BTreeMap<String, (bool, BTreeSet<u32>)>,
        backlog: &BTreeMap<(usize, u32), u32>,
        full: bool,
    ) -> (u64, u64, u64, u64) {
        let (mut sh, mut un, mut capped, mut failed) = (0u64, 0u64, 0u64, 0u64);
        for (idx, v) in vms.iter().enumerate() {
            if !v.locked {
                continue;
            }
            let (vm_held, pids) = holds.get(&v.name).cloned().unwrap_or_default();
            let mut plan = VmHolds {
                vm: vm_held,
                pids,
                changes: Vec::new(),
            };
            let mut releases = Vec::new();
            // Most VMs have nothing wanted or held: skip their channels without building a
            // key for each.
            let span = (v.name.clone(), 0)..=(v.name.clone(), u32::MAX);
            let any = decision.shadow.range(span.clone()).next().is_some()
                || self.shadowed.range(span).next().is_some();
            for o in obs.iter().filter(|o| any && o.vm == idx) {
                let key = (v.name.clone(), o.ch);
                let want = decision.shadow.contains(&key);
                let have = self.shadowed.contains(&key);
                if want && !have {
                    plan.changes.push((o.ch, HoldChange::Hold));
                } else if !want && have {
                    releases.push(o);
                }
            }
            plan.changes
                .extend(self.release_changes(&releases, backlog));
            let owner = (v.connection, plan.vm, plan.pids.clone());
            // Nothing to change, mirror or retry: leave the VM's session alone (most VMs
            // at most ticks). A full sweep applies anyway.
            if !full
                && plan.changes.is_empty()
                && !v.shadowing
                && self.applied.get(&v.name) == Some(&owner)
            {
                continue;
            }
            let Some(results) = v.vm.apply(&plan, SESSION_LOCK_WAIT) else {
                failed += 1;
                self.applied.remove(&v.name);
                continue;
            };
            self.applied.insert(v.name.clone(), owner);
            for ((ch, change), r) in plan.changes.iter().zip(results) {
                let key = (v.name.clone(), *ch);
                match (change, r) {
                    (HoldChange::Hold, Ok(())) => {
                        self.shadowed.insert(key);
                        sh += 1;
                    }
                    (HoldChange::Release, Ok(())) => {
                        self.shadowed.remove(&key);
                        un += 1;
                    }
                    (HoldChange::ReleaseCapped(_), Ok(())) => capped += 1,
                    (_, Err(e)) => {
                        failed += 1;
                        debug!("scheduler: {change:?} {}/{ch}: {e}", v.name);
                    }
                }
            }
        }
        (sh, un, capped, failed)
    }

    /// Drops every hold of this scheduler, on channels and owners (stop, policy change).
    fn release_all(&mut self, be: &VgpuBackend) {
        let mut un = 0;
        for vm in be.sched_vms() {
            un += vm.release_scheduler();
        }
        self.shadowed.clear();
        self.update_stats(|st| st.unshadows += un);
    }
}

/// One line per interval at `trace`: each VM's GPU time, held channels, pending
/// channels, whether it is over its share now and its clock, to follow the policy's
/// decisions through a run (`RUST_LOG=vgpu_backend::sched=trace`).
fn trace_interval(
    samples: &[VmSample],
    held: &BTreeSet<(String, u32)>,
    decision: &Decision,
    (idle_ns, len_ns): (u64, u64),
    fair: &FairState,
) {
    let ms = |ns: u64| ns as f64 / 1e6;
    let mut line = format!("interval {:.2} ms, idle {:.2} ms:", ms(len_ns), ms(idle_ns));
    for v in samples.iter().filter(|v| !v.procs.is_empty()) {
        let chans = || v.procs.iter().flat_map(|p| &p.channels);
        let busy = chans().map(|c| c.busy_delta_ns).sum::<u64>()
            + v.procs.iter().map(|p| p.retired_busy_ns).sum::<u64>();
        let span = (v.name.clone(), 0)..=(v.name.clone(), u32::MAX);
        line.push_str(&format!(
            " {} busy {:.2} held {} pending {} {} clock {:.1};",
            v.name,
            ms(busy),
            held.range(span).count(),
            chans().filter(|c| c.pending).count(),
            if decision.over_vms.contains(&v.name) {
                "OVER"
            } else {
                "ok"
            },
            fair.vm_clock_ms(&v.name).unwrap_or(0.0),
        ));
    }
    trace!("{line}");
}
