//! Accounting: how much GPU time each channel used in the last interval.
//!
//! Two sources:
//! - [`Accounting`]: the HAL's per-channel busy counters (deltas between readings);
//! - [`Estimator`]: the fallback for HALs without counters
//!   ([`GpuInfo::has_busy_counters`](vgpu_host_shim::hal::GpuInfo) false): GP_GET progress
//!   (entries completed in the interval, read from the real control page) times the
//!   channel's cost per entry, which the `sampling` policy measures by letting the channel
//!   run alone on the GPU for a while (NEON; see [`super::sampling`]).
//!
//! Both are keyed by the HAL's channel id, which is never reused, so a channel that is
//! destroyed and a new one with the same guest id are not confused. The first interval
//! after the scheduler starts only takes a baseline (a channel's history before the start
//! is not charged); afterwards a channel seen for the first time is charged everything its
//! counter shows (it was created during the interval). Busy time a channel accumulates
//! between the last sample and its destruction is not charged (at most one interval's
//! worth).
//!
//! The scheduler rolls the per-channel figures up to guest processes (the PID tag of the
//! request that created the channel) and VMs ([`super::shares`]).

use std::collections::{BTreeMap, BTreeSet};

use vgpu_host_shim::ChannelId;

/// The last busy-time reading of each live channel.
#[derive(Debug, Default)]
pub struct Accounting {
    last: BTreeMap<ChannelId, u64>,
    seen: BTreeSet<ChannelId>,
    /// Whether a baseline was taken (one interval has ended).
    primed: bool,
}

impl Accounting {
    pub fn new() -> Self {
        Self::default()
    }

    /// Busy time of channel `ch` since its previous reading, given its counter now.
    pub fn delta(&mut self, ch: ChannelId, busy_ns: u64) -> u64 {
        self.seen.insert(ch);
        let prev = self.last.insert(ch, busy_ns);
        match (self.primed, prev) {
            (false, _) => 0,
            (true, prev) => busy_ns.saturating_sub(prev.unwrap_or(0)),
        }
    }

    /// Ends an interval. After a `full` one (every live channel was read) it forgets the
    /// channels not read since the previous full one; otherwise the unread ones are quiet
    /// (their counters did not move) and keep their reading.
    pub fn end_interval(&mut self, full: bool) {
        if full {
            let seen = std::mem::take(&mut self.seen);
            self.last.retain(|ch, _| seen.contains(ch));
        }
        self.primed = true;
    }

    /// Forgets a destroyed channel.
    pub fn forget(&mut self, ch: ChannelId) {
        self.last.remove(&ch);
        self.seen.remove(&ch);
    }
}

/// Cost per GP entry assumed for a channel that was never sampled: every entry counts the
/// same, so unsampled channels share by entry count until a sample says better.
pub const DEFAULT_ENTRY_COST_NS: u64 = 1_000_000;

/// The GP_GET-progress fallback: entries completed per interval times an estimated cost.
#[derive(Debug, Default)]
pub struct Estimator {
    last_get: BTreeMap<ChannelId, u32>,
    cost_ns: BTreeMap<ChannelId, u64>,
    seen: BTreeSet<ChannelId>,
}

impl Estimator {
    pub fn new() -> Self {
        Self::default()
    }

    /// Entries channel `ch` completed since its previous reading, given its GP_GET now
    /// (a counter modulo 2^32; a reading that moved backwards counts nothing).
    pub fn progress(&mut self, ch: ChannelId, gp_get: u32) -> u32 {
        self.seen.insert(ch);
        match self.last_get.insert(ch, gp_get) {
            Some(prev) => (gp_get.wrapping_sub(prev) as i32).max(0) as u32,
            None => 0,
        }
    }

    /// Estimated busy time of `entries` entries of channel `ch`.
    pub fn busy_ns(&self, ch: ChannelId, entries: u32) -> u64 {
        u64::from(entries).saturating_mul(self.cost(ch).unwrap_or(DEFAULT_ENTRY_COST_NS))
    }

    /// The measured cost per entry of `ch`, if it was sampled.
    pub fn cost(&self, ch: ChannelId) -> Option<u64> {
        self.cost_ns.get(&ch).copied()
    }

    /// Records a sample: `entries` entries took `ns` of the GPU's time. Blends with the
    /// previous estimate so one disturbed sample does not swing the shares.
    pub fn record(&mut self, ch: ChannelId, entries: u32, ns: u64) {
        if entries == 0 {
            return;
        }
        let sample = (ns / u64::from(entries)).max(1);
        let cost = match self.cost_ns.get(&ch) {
            Some(&prev) => (prev + sample * 3) / 4,
            None => sample,
        };
        self.cost_ns.insert(ch, cost);
    }

    /// Ends an interval; like [`Accounting::end_interval`].
    pub fn end_interval(&mut self, full: bool) {
        if full {
            let seen = std::mem::take(&mut self.seen);
            self.last_get.retain(|ch, _| seen.contains(ch));
            self.cost_ns.retain(|ch, _| seen.contains(ch));
        }
    }

    /// Forgets a destroyed channel.
    pub fn forget(&mut self, ch: ChannelId) {
        self.last_get.remove(&ch);
        self.cost_ns.remove(&ch);
        self.seen.remove(&ch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_and_forgetting() {
        let mut a = Accounting::new();
        // Baseline: history before the start is not charged.
        assert_eq!(a.delta(ChannelId(1), 200), 0);
        a.end_interval(true);
        assert_eq!(a.delta(ChannelId(1), 500), 300);
        a.end_interval(true);
        assert_eq!(a.delta(ChannelId(1), 800), 300);
        assert_eq!(a.delta(ChannelId(2), 100), 100);
        a.end_interval(true);
        // Channel 1 unread in a partial interval (quiet): it keeps its reading.
        assert_eq!(a.delta(ChannelId(2), 100), 0);
        a.end_interval(false);
        assert_eq!(a.delta(ChannelId(1), 800), 0);
        a.end_interval(true);
        // Channel 1 vanished: forgotten after a full interval without it.
        assert_eq!(a.delta(ChannelId(2), 100), 0);
        a.end_interval(true);
        assert_eq!(a.delta(ChannelId(1), 900), 900);
        // A destroyed channel is forgotten at once.
        a.forget(ChannelId(2));
        assert_eq!(a.delta(ChannelId(2), 150), 150);
    }

    #[test]
    fn estimator_counts_progress_modulo_2_32() {
        let mut e = Estimator::new();
        let ch = ChannelId(3);
        assert_eq!(e.progress(ch, u32::MAX - 1), 0, "baseline");
        assert_eq!(e.progress(ch, 2), 4, "wraps");
        assert_eq!(e.progress(ch, 1), 0, "never negative");
        assert_eq!(e.busy_ns(ch, 2), 2 * DEFAULT_ENTRY_COST_NS);
        e.record(ch, 10, 5_000_000);
        assert_eq!(e.cost(ch), Some(500_000));
        assert_eq!(e.busy_ns(ch, 4), 2_000_000);
        // Blended: 3/4 of the new sample.
        e.record(ch, 1, 100_000);
        assert_eq!(e.cost(ch), Some((500_000 + 300_000) / 4));
        e.record(ch, 0, 1);
        e.end_interval(false);
        assert_eq!(e.cost(ch), Some((500_000 + 300_000) / 4), "quiet: kept");
        e.end_interval(true);
        e.end_interval(true);
        assert_eq!(e.cost(ch), None, "forgotten with the channel");
    }
}
