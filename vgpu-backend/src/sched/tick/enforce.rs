//! Enforcing a decision: shadows, unshadows and capped releases, the kernel watchdog,
//! and `sampling`'s polling of the channel it measures.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use log::{debug, warn};

use vgpu_host_shim::clock::now_ns;
use vgpu_protocol::ErrorCode;

use super::*;
use crate::sched::fair::Decision;
use crate::sched::handle::{HoldChange, VmHolds};
use crate::VgpuBackend;

impl Sched {
    /// Kills channels whose single kernel ran past the limit; returns how many.
    pub(super) fn watch(&mut self, be: &VgpuBackend, vms: &[VmObs], obs: &[Obs]) -> u64 {
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

    /// While `sampling` measures a channel: polls its control page until `until` and
    /// tells the sampler when it had work released to the GPU.
    pub(super) fn poll_measured(
        &mut self,
        be: &VgpuBackend,
        vms: &[VmObs],
        obs: &[Obs],
        until: Instant,
    ) {
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
    pub(super) fn release_changes(
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
    pub(super) fn enforce(
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
    pub(super) fn release_all(&mut self, be: &VgpuBackend) {
        let mut un = 0;
        for vm in be.sched_vms() {
            un += vm.release_scheduler();
        }
        self.shadowed.clear();
        self.update_stats(|st| st.unshadows += un);
    }
}
