//! Per-channel busy time from completion events, on one GPU-wide timeline.
//!
//! A channel's entry is charged from when it could start (its start event, or the end of
//! the previous entry on its stream when it was queued behind it) to its end event, minus
//! any part before the latest end of *another* entry on the GPU: an entry queued behind
//! another channel's kernel that fills the GPU is not charged for that wait. Event times
//! are taken against a reference event, re-based every few seconds so the driver's f32
//! milliseconds keep sub-microsecond precision.

use std::collections::BTreeSet;

use super::device::Device;

const REBASE_NS: u64 = 4_000_000_000;
const KEEP_ENDS: usize = 4096;

/// The GPU-wide timeline (front-end thread only).
pub struct Timeline<D: Device> {
    stream: D::Stream,
    /// The reference mark and its time on the timeline.
    base: (D::Mark, u64),
    /// A newer reference, adopted once reached.
    next: Option<D::Mark>,
    /// Recent entry end times.
    ends: BTreeSet<u64>,
    /// Mean GPU time charged per GP entry (exponentially weighted).
    mean_entry_ns: u64,
}

impl<D: Device> Timeline<D> {
    pub fn new(dev: &D) -> Option<Self> {
        let stream = dev.create_stream().ok()?;
        let m = dev.mark(&stream).ok()?;
        // Times are measured from this mark, so it must have been reached before the first
        // entry completes (immediate on a GPU; a thread's first turn on the fake).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !dev.reached(&m).ok()? {
            if std::time::Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
        Some(Timeline {
            stream,
            base: (m, 0),
            next: None,
            ends: BTreeSet::new(),
            mean_entry_ns: 0,
        })
    }

    /// The time of reached mark `m` on the timeline.
    pub fn at(&mut self, dev: &D, m: &D::Mark) -> Option<u64> {
        self.maybe_rebase(dev);
        Some(self.base.1 + dev.elapsed_ns(&self.base.0, m)?)
    }

    fn maybe_rebase(&mut self, dev: &D) {
        if let Some(n) = &self.next {
            if dev.reached(n).unwrap_or(false) {
                if let Some(d) = dev.elapsed_ns(&self.base.0, n) {
                    if let Some(n) = self.next.take() {
                        self.base = (n, self.base.1 + d);
                    }
                }
            }
            return;
        }
        let age = self
            .ends
            .last()
            .copied()
            .unwrap_or(0)
            .saturating_sub(self.base.1);
        if age > REBASE_NS {
            self.next = dev.mark(&self.stream).ok();
        }
    }

    /// Records `entries` GP entries that ran from no earlier than `start` to `end`;
    /// returns the GPU time to charge them.
    pub fn charge(&mut self, start: u64, end: u64, entries: u32) -> u64 {
        let others = self.ends.range(..end).next_back().copied().unwrap_or(0);
        self.ends.insert(end);
        while self.ends.len() > KEEP_ENDS {
            self.ends.pop_first();
        }
        let ns = end.saturating_sub(start.max(others));
        // Weight 1/8: follows a change of workload within a few dozen marks.
        let per_entry = ns / u64::from(entries.max(1));
        self.mean_entry_ns = self.mean_entry_ns - self.mean_entry_ns / 8 + per_entry / 8;
        ns
    }

    /// The mean GPU time of a GP entry that ran work, recently.
    pub fn mean_entry_ns(&self) -> u64 {
        self.mean_entry_ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::fake::FakeDevice;

    #[test]
    fn queued_time_behind_another_channel_is_not_charged() {
        let dev = FakeDevice::default();
        let mut t = Timeline::new(&dev).unwrap();
        // A runs 0..10 ms; B was issued at 1 ms but waited for A, then ran to 11 ms.
        assert_eq!(t.charge(0, 10_000_000, 1), 10_000_000);
        assert_eq!(t.charge(1_000_000, 11_000_000, 1), 1_000_000);
        // Idle gap, then C alone.
        assert_eq!(t.charge(20_000_000, 21_000_000, 1), 1_000_000);
    }
}
