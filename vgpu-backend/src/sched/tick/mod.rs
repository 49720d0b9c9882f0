//! The scheduler thread and its state: one tick per interval observes every VM's
//! channels ([`observe`]), charges their GPU time and builds the policy's input
//! ([`inputs`]), decides, enforces the decision and watches ([`enforce`]), and records
//! the interval ([`record`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use log::debug;

use vgpu_host_shim::clock::now_ns;
use vgpu_host_shim::{ChannelCounters, ChannelId};

use crate::sched::account::{Accounting, Estimator};
use crate::sched::config::*;
use crate::sched::fair::{ChannelSample, Decision, FairState, VmSample};
use crate::sched::handle::{RetiredChannel, SchedVm};
use crate::sched::sampling::Sampler;
use crate::sched::shares::History;
use crate::sched::slot::*;
use crate::sched::stall::Stalls;
use crate::sched::stats::*;
use crate::sched::timeslice::Timeslice;
use crate::sched::watchdog::Watchdog;
use crate::sched::*;
use crate::shadow::{ChannelPeek, Holders};
use crate::VgpuBackend;

mod enforce;
mod inputs;
mod observe;
mod record;

use record::trace_interval;

/// What the thread shares with the backend's observers.
pub(in crate::sched) struct Shared {
    pub(in crate::sched) stats: Arc<Mutex<SchedStats>>,
    pub(in crate::sched) history: Arc<Mutex<History>>,
    pub(in crate::sched) hints: Arc<Mutex<Hints>>,
    pub(in crate::sched) seq: Arc<AtomicU64>,
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

pub(in crate::sched) fn thread_main(
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
    /// One interval: observe, account, decide, enforce, watch, record; then, if
    /// `sampling` is measuring a channel, poll it until `next_tick`.
    pub(super) fn tick(&mut self, be: &VgpuBackend, next_tick: Instant) {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::fair::ProcSample;

    fn vm(name: &str, procs: &[(u32, &[u32])]) -> VmSample {
        VmSample {
            name: name.into(),
            weight: 100,
            procs: procs
                .iter()
                .map(|(pid, chans)| ProcSample {
                    pid: *pid,
                    weight: 1,
                    channels: chans
                        .iter()
                        .map(|ch| ChannelSample {
                            ch: *ch,
                            busy_delta_ns: 0,
                            pending: true,
                        })
                        .collect(),
                    retired_busy_ns: 0,
                })
                .collect(),
        }
    }

    fn decision(shadow: &[(&str, u32)], over_vms: &[&str], over_procs: &[(&str, u32)]) -> Decision {
        Decision {
            shadow: shadow.iter().map(|(v, c)| (v.to_string(), *c)).collect(),
            over_vms: over_vms.iter().map(|v| v.to_string()).collect(),
            over_procs: over_procs
                .iter()
                .map(|(v, p)| (v.to_string(), *p))
                .collect(),
        }
    }

    #[test]
    fn an_owner_is_held_when_over_or_when_all_its_channels_are_shadowed() {
        let samples = [
            vm("a", &[(1, &[1, 2]), (2, &[3])]),
            vm("b", &[(7, &[1])]),
            vm("c", &[(9, &[])]),
        ];
        // Over by the policy: the VM is held, whatever its channels.
        let h = owner_holds(&samples, &decision(&[], &["b"], &[("a", 2)]));
        assert_eq!(h["b"], (true, BTreeSet::new()));
        assert_eq!(h["a"], (false, BTreeSet::from([2])));
        // Every channel of process 1 shadowed (timeslice): the process is held, the VM not.
        let h = owner_holds(&samples, &decision(&[("a", 1), ("a", 2)], &[], &[]));
        assert_eq!(h["a"], (false, BTreeSet::from([1])));
        // Every channel of the VM shadowed: the VM and both processes are held.
        let h = owner_holds(
            &samples,
            &decision(&[("a", 1), ("a", 2), ("a", 3)], &[], &[]),
        );
        assert_eq!(h["a"], (true, BTreeSet::from([1, 2])));
        // A VM or process without channels is never held for its channels' sake.
        assert_eq!(h["c"], (false, BTreeSet::new()));
        assert_eq!(h["b"], (false, BTreeSet::new()));
    }
}
