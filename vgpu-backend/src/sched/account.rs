//! Accounting: per-channel busy-time deltas from the HAL's counters, interval by interval.
//!
//! Counters are keyed by the HAL's channel id, which is never reused, so a channel that
//! is destroyed and a new one with the same guest id are not confused. The first interval
//! after the scheduler starts only takes a baseline (a channel's history before the start
//! is not charged); afterwards a channel seen for the first time is charged everything its
//! counter shows (it was created during the interval). Busy time a channel accumulates between the last sample and its
//! destruction is not charged (at most one interval's worth).
//!
//! Fallback (not implemented): on a HAL without busy counters
//! ([`GpuInfo::has_busy_counters`](vgpu_host_shim::hal::GpuInfo) false) the scheduler
//! would have to estimate busy time from GP_GET progress (entries completed per interval
//! times an estimated entry cost, NEON-style sampling). [`crate::sched::start`] refuses
//! the `fair` policy on such a HAL for now.

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

    /// Ends an interval: forgets channels not read since the previous call.
    pub fn end_interval(&mut self) {
        let seen = std::mem::take(&mut self.seen);
        self.last.retain(|ch, _| seen.contains(ch));
        self.primed = true;
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
        a.end_interval();
        assert_eq!(a.delta(ChannelId(1), 500), 300);
        a.end_interval();
        assert_eq!(a.delta(ChannelId(1), 800), 300);
        assert_eq!(a.delta(ChannelId(2), 100), 100);
        a.end_interval();
        // Channel 1 vanished: forgotten after this interval.
        assert_eq!(a.delta(ChannelId(2), 100), 0);
        a.end_interval();
        assert_eq!(a.delta(ChannelId(1), 900), 900);
    }
}
