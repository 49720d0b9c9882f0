//! The scheduler's operator interface on [`VgpuBackend`] beyond start/stop and VM weights
//! (which live in `lib.rs`): GPU shares over recent windows, the per-interval history,
//! and guest process weight hints. Plain structs, for the control API to serve.

use std::time::Duration;

use log::info;

use super::shares::{GpuShares, IntervalRecord};
use super::{lock, Policy, SchedError, MAX_HINTS_PER_VM, MAX_WEIGHT, MIN_WEIGHT};
use crate::VgpuBackend;

impl VgpuBackend {
    /// GPU shares per VM, guest process and channel over (about) the last `window`,
    /// from the scheduler's accounting (busy counters, or GP_GET-progress estimates
    /// under `sampling`). Empty until the scheduler has run an interval.
    pub fn gpu_shares(&self, window: Duration) -> GpuShares {
        let policy = self.sched.config().map_or(Policy::None, |c| c.policy);
        let ns = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX);
        lock(&self.sched.history).shares(ns, policy)
    }

    /// GPU shares and entitlements over the intervals numbered `from..to` (see
    /// [`VgpuBackend::next_interval`]).
    pub fn gpu_shares_between(&self, from: u64, to: u64) -> GpuShares {
        let policy = self.sched.config().map_or(Policy::None, |c| c.policy);
        lock(&self.sched.history).shares_between(from, to, policy)
    }

    /// The number the scheduler's next interval record will get.
    pub fn next_interval(&self) -> u64 {
        self.sched.seq.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The scheduler's per-interval records with interval number `since` or later
    /// (the last few thousand intervals are kept), oldest first.
    pub fn sched_history(&self, since: u64) -> Vec<IntervalRecord> {
        lock(&self.sched.history).since(since)
    }

    /// Sets the weight of guest process `pid` among VM `name`'s processes (1..=10000;
    /// processes are equal, weight 1, unless hinted). Process weights only divide the
    /// VM's share among its processes: whatever the hints, the VM as a whole never gets
    /// more than its operator weight allows. There is no wire-protocol field for a guest
    /// to send a hint yet; a guest agent or the operator sets it here.
    pub fn set_process_weight(&self, name: &str, pid: u32, weight: u32) -> Result<(), SchedError> {
        if !(MIN_WEIGHT..=MAX_WEIGHT).contains(&weight) {
            return Err(SchedError::InvalidWeight(weight));
        }
        if self.vm(name).is_none() {
            return Err(SchedError::NoVm(name.to_string()));
        }
        let mut hints = lock(&self.sched.hints);
        let vm = hints.entry(name.to_string()).or_default();
        if vm.len() >= MAX_HINTS_PER_VM && !vm.contains_key(&pid) {
            return Err(SchedError::TooManyHints(name.to_string()));
        }
        vm.insert(pid, weight);
        info!("VM {name}: process {pid} weight {weight}");
        Ok(())
    }

    /// Drops VM `name`'s weight hint for `pid` (back to 1).
    pub fn clear_process_weight(&self, name: &str, pid: u32) {
        if let Some(vm) = lock(&self.sched.hints).get_mut(name) {
            vm.remove(&pid);
        }
    }

    /// The weight of guest process `pid` in VM `name` (1 unless hinted).
    pub fn process_weight(&self, name: &str, pid: u32) -> u32 {
        lock(&self.sched.hints)
            .get(name)
            .and_then(|h| h.get(&pid))
            .copied()
            .unwrap_or(1)
    }
}
