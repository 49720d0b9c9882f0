//! The GPU scheduler: shares the GPU among VMs by operator weight, then among the guest
//! processes of each VM, by shadowing over-users (see [`crate::shadow`]) for the next
//! interval. Disengaged: nothing traps on the submission fast path; the scheduler only
//! remaps control pages between intervals.
//!
//! Each interval the scheduler thread
//! 1. reads every live channel's busy time from the HAL ([`account`]) and whether it has
//!    pending work (its real or shadow GP_PUT ahead of GP_GET);
//! 2. decides with the policy ([`fair`]: hierarchical WFQ over measured GPU time);
//! 3. shadows the chosen channels, unshadows (or, with an unshadow cap, capped-releases)
//!    the channels it shadowed before and no longer picks, and mirrors GPU progress into
//!    the shadow pages so guests see their released work finish.
//!
//! The scheduler only ever unshadows channels it shadowed itself; stopping it (or
//! switching to [`Policy::None`]) unshadows them all.
//!
//! Policies: `none` (the GPU's own round-robin) and `fair` work; `timeslice` and
//! `sampling` are not implemented yet and are refused.

pub mod account;
pub mod fair;

use std::collections::{BTreeMap, BTreeSet};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{debug, info, warn};
use thiserror::Error;

use crate::shadow::ShadowError;
use crate::VgpuBackend;
use account::Accounting;
use fair::{ChannelSample, FairState, ProcSample, VmSample};

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
    #[error("the GPU reports no per-channel busy time; the GP_GET fallback is not implemented")]
    NoBusyCounters,
    #[error("weight {0} out of range {MIN_WEIGHT}..={MAX_WEIGHT}")]
    InvalidWeight(u32),
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
    /// Round-robin time slices (not implemented yet).
    Timeslice,
    /// Two-level weighted fair queuing over measured GPU time.
    #[default]
    Fair,
    /// NEON-style draining and sampling for HALs without counters (not implemented yet).
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
    /// GPU time an entity may run ahead of its least-served active sibling (beyond its
    /// weighted share) before it is shadowed.
    pub threshold_us: u64,
    /// When set, a channel the policy lets run again is not unshadowed while its backlog
    /// exceeds this many entries: it gets a capped release of that many per interval
    /// instead (bounds the non-preemptible burst a released over-user dumps on the GPU).
    pub unshadow_cap: Option<u32>,
}

impl Default for SchedConfig {
    fn default() -> Self {
        SchedConfig {
            policy: Policy::Fair,
            interval_ms: 10,
            threshold_us: 5_000,
            unshadow_cap: None,
        }
    }
}

impl SchedConfig {
    fn validate(&self) -> Result<(), SchedError> {
        if !(1..=1000).contains(&self.interval_ms) {
            return Err(SchedError::InvalidConfig(format!(
                "interval_ms {} not in 1..=1000",
                self.interval_ms
            )));
        }
        if self.unshadow_cap == Some(0) {
            return Err(SchedError::InvalidConfig("unshadow_cap of 0".into()));
        }
        match self.policy {
            Policy::None | Policy::Fair => Ok(()),
            p => Err(SchedError::NotImplemented(p)),
        }
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
}

/// A running scheduler thread.
pub(crate) struct Running {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<()>,
}

/// The scheduler's part of the backend.
#[derive(Default)]
pub(crate) struct SchedSlot {
    running: Mutex<Option<Running>>,
    config: Mutex<Option<SchedConfig>>,
    stats: Arc<Mutex<SchedStats>>,
}

impl SchedSlot {
    pub(crate) fn config(&self) -> Option<SchedConfig> {
        *self.config.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn stats(&self) -> SchedStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops the thread (which unshadows what it shadowed) and waits for it, unless
    /// called from the thread itself.
    pub(crate) fn stop(&self) {
        let running = self
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
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
    if cfg.policy == Policy::Fair && !be.gpu().info().has_busy_counters {
        return Err(SchedError::NoBusyCounters);
    }
    let slot = &be.sched;
    slot.stop();
    *slot.config.lock().unwrap_or_else(|e| e.into_inner()) = Some(cfg);
    if cfg.policy == Policy::None {
        info!("scheduler: policy none");
        return Ok(());
    }
    let mut running = slot.running.lock().unwrap_or_else(|e| e.into_inner());
    if be.stop.load(Ordering::Acquire) {
        return Err(SchedError::ShuttingDown);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let weak = Arc::downgrade(be);
    let (stop2, stats) = (stop.clone(), slot.stats.clone());
    let handle = std::thread::Builder::new()
        .name("vgpu-sched".into())
        .spawn(move || thread_main(weak, cfg, stop2, stats))
        .map_err(SchedError::Thread)?;
    *running = Some(Running { stop, handle });
    info!(
        "scheduler: policy {}, interval {} ms, threshold {} us, unshadow cap {:?}",
        cfg.policy, cfg.interval_ms, cfg.threshold_us, cfg.unshadow_cap
    );
    Ok(())
}

/// State of the scheduler thread.
struct Sched {
    cfg: SchedConfig,
    acct: Accounting,
    fair: FairState,
    /// Channels this scheduler shadowed: (VM, guest channel).
    shadowed: BTreeSet<(String, u32)>,
    stats: Arc<Mutex<SchedStats>>,
}

fn thread_main(
    be: Weak<VgpuBackend>,
    cfg: SchedConfig,
    stop: Arc<AtomicBool>,
    stats: Arc<Mutex<SchedStats>>,
) {
    let mut s = Sched {
        cfg,
        acct: Accounting::new(),
        fair: FairState::new(),
        shadowed: BTreeSet::new(),
        stats,
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
        s.tick(&be);
    }
    if let Some(be) = be.upgrade() {
        s.release_all(&be);
    }
    debug!("scheduler thread stopped");
}

impl Sched {
    fn update_stats(&self, f: impl FnOnce(&mut SchedStats)) {
        let mut st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut st);
        st.shadowed_now = self.shadowed.len() as u32;
    }

    /// One interval: sample, decide, enforce.
    fn tick(&mut self, be: &VgpuBackend) {
        let t0 = Instant::now();
        let gpu = be.gpu().clone();
        let vms: Vec<_> = be.lock_vms().values().cloned().collect();
        let mut samples = Vec::with_capacity(vms.len());
        let mut backlog: BTreeMap<(String, u32), u32> = BTreeMap::new();
        for vm in &vms {
            if !vm.connected.load(Ordering::Acquire) {
                continue;
            }
            let busy = vm.shared.channel_busy_ns(gpu.as_ref());
            let mut procs: BTreeMap<u32, Vec<ChannelSample>> = BTreeMap::new();
            {
                let mut session = vm.lock_session();
                for (ch, pid, hch, busy_ns) in busy {
                    let delta = self.acct.delta(hch, busy_ns);
                    // A channel whose slot is not mapped (or that just went away) cannot
                    // be shadowed; it is still charged.
                    let peek = session.peek_channel(ch).ok();
                    let pending = peek.is_some_and(|p| p.pending());
                    if let Some(p) = peek {
                        backlog.insert((vm.name.clone(), ch), p.backlog());
                    }
                    procs.entry(pid).or_default().push(ChannelSample {
                        ch,
                        busy_delta_ns: delta,
                        pending,
                    });
                }
            }
            samples.push(VmSample {
                name: vm.name.clone(),
                weight: vm.weight.load(Ordering::Relaxed),
                procs: procs
                    .into_iter()
                    .map(|(pid, channels)| ProcSample {
                        pid,
                        weight: 1,
                        channels,
                    })
                    .collect(),
            });
        }
        self.acct.end_interval();
        let decision = self
            .fair
            .decide(&samples, self.cfg.threshold_us.saturating_mul(1000));
        // Channels that went away (destroyed, VM disconnected) are no longer ours.
        self.shadowed.retain(|k| backlog.contains_key(k));
        let (mut sh, mut un, mut capped, mut failed) = (0u64, 0u64, 0u64, 0u64);
        for key in &decision.shadow {
            if self.shadowed.contains(key) || !backlog.contains_key(key) {
                continue;
            }
            match be.shadow_channel(&key.0, key.1, true) {
                Ok(_) => {
                    self.shadowed.insert(key.clone());
                    sh += 1;
                }
                Err(e) => {
                    failed += 1;
                    debug!("scheduler: shadow {}/{}: {e}", key.0, key.1);
                }
            }
        }
        let release: Vec<(String, u32)> = self
            .shadowed
            .iter()
            .filter(|k| !decision.shadow.contains(*k))
            .cloned()
            .collect();
        for key in release {
            if let Some(cap) = self.cfg.unshadow_cap {
                if backlog.get(&key).copied().unwrap_or(0) > cap {
                    match be.release_capped(&key.0, key.1, cap) {
                        Ok(_) => capped += 1,
                        Err(e) => {
                            failed += 1;
                            debug!("scheduler: capped release {}/{}: {e}", key.0, key.1);
                        }
                    }
                    continue;
                }
            }
            match be.shadow_channel(&key.0, key.1, false) {
                Ok(_) => {
                    self.shadowed.remove(&key);
                    un += 1;
                }
                Err(ShadowError::NoChannel(_) | ShadowError::NoVm(_)) => {
                    self.shadowed.remove(&key);
                }
                Err(e) => {
                    failed += 1;
                    warn!("scheduler: unshadow {}/{}: {e}", key.0, key.1);
                }
            }
        }
        let mirrored: BTreeSet<&str> = self.shadowed.iter().map(|k| k.0.as_str()).collect();
        for name in mirrored {
            let _ = be.mirror_shadows(name);
        }
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.update_stats(|st| {
            st.intervals += 1;
            st.shadows += sh;
            st.unshadows += un;
            st.capped_releases += capped;
            st.failures += failed;
            st.tick_ns_last = ns;
            st.tick_ns_max = st.tick_ns_max.max(ns);
        });
    }

    /// Unshadows every channel this scheduler shadowed (stop, policy change).
    fn release_all(&mut self, be: &VgpuBackend) {
        let mut un = 0;
        for key in std::mem::take(&mut self.shadowed) {
            match be.shadow_channel(&key.0, key.1, false) {
                Ok(_) => un += 1,
                Err(ShadowError::NoChannel(_) | ShadowError::NoVm(_)) => {}
                Err(e) => warn!("scheduler: final unshadow {}/{}: {e}", key.0, key.1),
            }
        }
        self.update_stats(|st| st.unshadows += un);
    }
}
