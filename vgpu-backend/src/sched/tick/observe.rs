//! Observing: every connected VM's channels and what its session records of the
//! scheduler's holds, with dormant VMs skipped on their activity count.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::*;
use crate::shadow::Holder;
use crate::VgpuBackend;

impl Sched {
    pub(super) fn update_stats(&self, f: impl FnOnce(&mut SchedStats)) {
        let mut st = lock(&self.shared.stats);
        f(&mut st);
        st.shadowed_now = self.shadowed.len() as u32;
    }

    /// Reads every connected VM's channels, and what the sessions record of the
    /// scheduler's holds (its channels born held included). A VM whose session stays
    /// locked past [`SESSION_LOCK_WAIT`] is left as it was.
    pub(super) fn observe(&mut self, be: &VgpuBackend, full: bool) -> (Vec<VmObs>, Vec<Obs>) {
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
    pub(super) fn refresh_vms(&mut self, be: &VgpuBackend) {
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
}
