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
mod config;
pub mod entitle;
pub mod fair;
pub mod handle;
pub mod sampling;
pub mod shares;
mod slot;
pub mod stall;
mod stats;
mod tick;
pub mod timeslice;
pub mod watchdog;

use std::sync::Mutex;
use std::time::Duration;

pub use config::{Policy, SchedConfig, SchedError};
pub use slot::MAX_HINTS_PER_VM;
pub(crate) use slot::{start, SchedSlot};
pub use stats::SchedStats;

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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
