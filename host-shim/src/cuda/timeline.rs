//! Per-channel busy time from completion events, on one GPU-wide timeline.
//!
//! A channel's entry is charged from when it could start (its start event, or the end of
//! the previous entry on its stream when it was queued behind it) to its end event, minus
//! any part before the latest end of *another* entry on the GPU: an entry queued behind
//! another channel's kernel that fills the GPU is not charged for that wait. Event times
//! are taken against a reference event, re-based every few seconds so the driver's f32
//! milliseconds keep sub-microsecond precision.
//!
//! The timeline also maps the host clock: a batch issued to an idle stream is charged from
//! the host time it was issued (mapped here) rather than from a start event recorded in
//! front of it, which would put a driver call between the guest's store and its kernel's
//! launch (measured on the H100, 2026-11-27: about 1 µs of submit → start). A calibration
//! event on the timeline's own stream, which is always idle, is reached a launch latency
//! after the host time read just after recording it, and a kernel issued at host time `t`
//! starts about a launch latency after `t`: the mapping gives the kernel's start, not its
//! issue, to within the difference of the two latencies. A calibration mark reached late
//! (another worker's context had the GPU) only makes the offset smaller, so the largest of
//! the last [`CALIBRATIONS_KEPT`] counts; they are taken every [`CALIBRATE_NS`], so the
//! two clocks cannot drift apart in between.

use std::collections::{BTreeSet, VecDeque};

use super::device::Device;
use crate::clock::now_ns;

const REBASE_NS: u64 = 4_000_000_000;
const KEEP_ENDS: usize = 4096;
/// How often the host clock's mapping is taken again (tens of ppm of drift between the
/// GPU's timer and the host's stay well under a microsecond over this).
pub const CALIBRATE_NS: u64 = 20_000_000;
/// Calibrations the mapping takes the best of.
pub const CALIBRATIONS_KEPT: usize = 8;
/// Calibrations taken when the timeline is made.
const STARTUP_CALIBRATIONS: usize = 3;

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
    /// The host clock's mapping.
    host: HostClock,
    /// A calibration mark in flight and the host time read right after recording it.
    calibration: Option<(D::Mark, u64)>,
    /// Host time the last calibration mark was recorded.
    calibrated_at: u64,
}

impl<D: Device> Timeline<D> {
    pub fn new(dev: &D) -> Option<Self> {
        let stream = dev.create_stream().ok()?;
        let m = dev.mark(&stream).ok()?;
        // Times are measured from this mark, so it must have been reached before the first
        // entry completes (immediate on a GPU; a thread's first turn on the fake).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let wait = |m: &D::Mark| -> Option<()> {
            while !dev.reached(m).ok()? {
                if std::time::Instant::now() > deadline {
                    return None;
                }
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
            Some(())
        };
        wait(&m)?;
        // The first calibrations, with the stream awake: the mapping is good from the
        // first batch on (one taken while the device wakes up would be late).
        let mut host = HostClock::default();
        for _ in 0..STARTUP_CALIBRATIONS {
            let c = dev.mark(&stream).ok()?;
            let at = now_ns();
            wait(&c)?;
            host.record(at, dev.elapsed_ns(&m, &c)?);
        }
        Some(Timeline {
            stream,
            base: (m, 0),
            next: None,
            ends: BTreeSet::new(),
            mean_entry_ns: 0,
            host,
            calibration: None,
            calibrated_at: now_ns(),
        })
    }

    /// The time of reached mark `m` on the timeline.
    pub fn at(&mut self, dev: &D, m: &D::Mark) -> Option<u64> {
        self.calibrate(dev);
        self.maybe_rebase(dev);
        Some(self.base.1 + dev.elapsed_ns(&self.base.0, m)?)
    }

    /// Whether host times can be mapped onto the timeline ([`Timeline::from_host`]).
    #[cfg(test)]
    pub fn maps_host_clock(&self) -> bool {
        !self.host.offsets.is_empty()
    }

    /// The timeline time of host time `host_ns` (`None` only if no calibration was ever
    /// recorded; `new` takes the first ones).
    pub fn from_host(&self, host_ns: u64) -> Option<u64> {
        self.host.to_timeline(host_ns)
    }

    /// Takes in a reached calibration mark and records the next one when due. Must run
    /// before a re-base: the pending mark may precede the next base on the stream, and
    /// its time is taken against the current one.
    fn calibrate(&mut self, dev: &D) {
        if let Some((m, host)) = &self.calibration {
            if !dev.reached(m).unwrap_or(false) {
                return;
            }
            if let Some(e) = dev.elapsed_ns(&self.base.0, m) {
                self.host.record(*host, self.base.1 + e);
            }
            self.calibration = None;
        }
        let now = now_ns();
        if now.saturating_sub(self.calibrated_at) < CALIBRATE_NS {
            return;
        }
        if let Ok(m) = dev.mark(&self.stream) {
            self.calibration = Some((m, now_ns()));
            self.calibrated_at = now;
        }
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
        self.mean_entry_ns = mean_with(self.mean_entry_ns, ns / u64::from(entries.max(1)));
        ns
    }

    /// The mean GPU time of a GP entry that ran work, recently.
    pub fn mean_entry_ns(&self) -> u64 {
        self.mean_entry_ns
    }
}

/// `mean` moved 1/8 of the way to `sample`: follows a change of workload within a few
/// dozen marks.
pub(crate) fn mean_with(mean: u64, sample: u64) -> u64 {
    mean - mean / 8 + sample / 8
}

/// Host time ↔ timeline time, from calibration marks.
#[derive(Debug, Default)]
struct HostClock {
    /// Host time minus timeline time of recent calibrations, newest last.
    offsets: VecDeque<i64>,
}

impl HostClock {
    /// A calibration mark reached at timeline time `tl_ns`, recorded just before host
    /// time `host_ns`.
    fn record(&mut self, host_ns: u64, tl_ns: u64) {
        let Ok(off) = i64::try_from(i128::from(host_ns) - i128::from(tl_ns)) else {
            return;
        };
        if self.offsets.len() == CALIBRATIONS_KEPT {
            self.offsets.pop_front();
        }
        self.offsets.push_back(off);
    }

    /// A mark reached late gives a smaller offset: the largest is the best.
    fn to_timeline(&self, host_ns: u64) -> Option<u64> {
        let off = self.offsets.iter().copied().max()?;
        u64::try_from((i128::from(host_ns) - i128::from(off)).max(0)).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::fake::FakeDevice;

    #[test]
    fn the_host_clock_takes_the_promptest_recent_calibration() {
        let mut c = HostClock::default();
        assert_eq!(c.to_timeline(5), None, "not calibrated yet");
        // Host 1,000 µs was timeline 400 µs; a mark reached 3 ms late (another context
        // had the GPU) would move everything 3 ms later: the prompt one wins.
        c.record(1_000_000, 400_000);
        c.record(21_000_000, 20_400_000 + 3_000_000);
        assert_eq!(c.to_timeline(30_000_000), Some(29_400_000));
        // Times before the timeline's origin map to its origin.
        assert_eq!(c.to_timeline(100), Some(0));
        // Drift: once the old calibrations are past, the newer offset counts.
        for i in 0..CALIBRATIONS_KEPT as u64 {
            c.record(40_000_000 + i, 39_000_000 + i);
        }
        assert_eq!(c.to_timeline(50_000_000), Some(49_000_000));
    }

    #[test]
    fn an_idle_batch_is_charged_from_its_mapped_issue_time_on_the_fake() {
        let dev = FakeDevice::default();
        let mut t = Timeline::new(&dev).unwrap();
        let s = dev.create_stream().unwrap();
        // The first `at` takes the calibration mark in (reached on the fake's first turn).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !t.maps_host_clock() {
            assert!(std::time::Instant::now() < deadline, "never calibrated");
            let m = dev.mark(&s).unwrap();
            while !dev.reached(&m).unwrap() {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
            t.at(&dev, &m).unwrap();
        }
        let issued = now_ns();
        let end = dev.mark(&s).unwrap();
        while !dev.reached(&end).unwrap() {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
        let done = now_ns();
        let (start, end) = (t.from_host(issued).unwrap(), t.at(&dev, &end).unwrap());
        // The fake stamps marks with the host clock: the mapping puts the issue before
        // the end, by about what the host saw pass, give or take how long a thread was
        // preempted around a calibration (this one between recording the mark and
        // reading the clock, or the fake's stream thread before stamping it; the largest
        // offset counts): loose, as a loaded test machine preempts for milliseconds.
        let slack = 50_000_000;
        assert!(start <= end + slack, "start {start} after end {end}");
        assert!(
            end - start <= done - issued + slack,
            "{} > {}",
            end - start,
            done - issued
        );
    }

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
