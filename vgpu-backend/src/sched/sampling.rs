//! The `sampling` policy, for HALs without busy counters (NEON's draining and sampling,
//! Fleig §3/§4): the scheduler cannot read how long a channel's work takes, only that its
//! GP_GET moved. So, every `period`, it samples each active channel in turn:
//!
//! 1. **Drain**: shadow every other channel and wait until the work they already released
//!    has finished (their real GP_PUT reached GP_GET), so the GPU runs the target alone.
//! 2. **Measure**: while the target runs alone and has work released to the GPU, GPU
//!    time is wall time. Between ticks the scheduler polls the target's control page
//!    ([`Sampler::observe_backlog`], every [`POLL`]) and counts the time its real GP_PUT
//!    was ahead of GP_GET; the cost per GP entry is that time divided by the entries
//!    completed (so a guest that is slow to refill its ring is not charged for the gaps).
//!    A sample ends after at least [`MIN_ENTRIES`] entries and
//!    [`MIN_MEASURE_TICKS`] intervals, when the target runs out of work, or after
//!    [`MAX_MEASURE_NS`].
//!
//! Between samples ("freerun") the fair policy runs on estimated busy time: entries
//! completed × cost per entry ([`super::account::Estimator`]). Sampling costs exclusive
//! GPU time (everyone else waits while one channel is measured), so it runs rarely.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use vgpu_host_shim::ChannelId;

use super::account::Estimator;

/// Entries a sample should see before it ends.
pub const MIN_ENTRIES: u32 = 8;
/// Intervals a sample lasts at least (the readings are an interval apart).
pub const MIN_MEASURE_TICKS: u32 = 3;
/// How often the target's control page is polled while it is measured.
pub const POLL: std::time::Duration = std::time::Duration::from_micros(50);
/// A gap between two polls longer than this (the scheduler thread waited for a core)
/// leaves the target's activity unknown: the sample is dropped.
pub const MAX_POLL_GAP_NS: u64 = 5_000_000;
/// Longest sample and longest drain.
pub const MAX_MEASURE_NS: u64 = 300_000_000;
pub const MAX_DRAIN_NS: u64 = 100_000_000;

/// A channel as the sampler sees it at a tick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleObs {
    pub key: (String, u32),
    pub hal: ChannelId,
    /// GP_GET of the real page.
    pub gp_get: u32,
    /// Work released to the GPU (real GP_PUT) that has not finished.
    pub in_flight: bool,
    /// Work submitted (released or held back) that has not finished.
    pub pending: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    Freerun,
    Drain {
        target: ChannelId,
        since_ns: u64,
    },
    Measure {
        target: ChannelId,
        start: (u64, u32),
        ticks: u32,
        /// Time seen with work released to the GPU, and the last poll (time, backlogged).
        busy_ns: u64,
        last: Option<(u64, bool)>,
        /// A poll gap exceeded [`MAX_POLL_GAP_NS`].
        disturbed: bool,
    },
}

/// Counters of the sampler.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SamplerStats {
    pub rounds: u64,
    pub samples: u64,
    /// Samples dropped (the target ran out of work too early or vanished).
    pub aborted: u64,
}

/// The sampling state machine.
#[derive(Debug)]
pub struct Sampler {
    period_ns: u64,
    phase: Phase,
    last_round_end_ns: Option<u64>,
    queue: VecDeque<ChannelId>,
    pub stats: SamplerStats,
}

impl Sampler {
    pub fn new(period_ns: u64) -> Self {
        Sampler {
            period_ns,
            phase: Phase::Freerun,
            last_round_end_ns: None,
            queue: VecDeque::new(),
            stats: SamplerStats::default(),
        }
    }

    /// Whether a sample is under way (the fair decision is overridden).
    pub fn sampling(&self) -> bool {
        self.phase != Phase::Freerun
    }

    /// One tick. Returns the channels to shadow while sampling (everything but the
    /// target), or `None` in freerun (the fair policy decides). Finished samples are
    /// recorded in `est`.
    pub fn tick(
        &mut self,
        obs: &[SampleObs],
        now_ns: u64,
        est: &mut Estimator,
    ) -> Option<BTreeSet<(String, u32)>> {
        let by_hal: BTreeMap<ChannelId, &SampleObs> = obs.iter().map(|o| (o.hal, o)).collect();
        // At most a few transitions per tick (drain done → measure, sample done → next).
        for _ in 0..4 {
            match self.phase.clone() {
                Phase::Freerun => {
                    let due = self
                        .last_round_end_ns
                        .is_none_or(|t| now_ns.saturating_sub(t) >= self.period_ns);
                    let unsampled = obs.iter().any(|o| o.pending && est.cost(o.hal).is_none());
                    if !(due || unsampled) {
                        return None;
                    }
                    self.queue = obs
                        .iter()
                        .filter(|o| o.pending && (due || est.cost(o.hal).is_none()))
                        .map(|o| o.hal)
                        .collect();
                    if self.queue.is_empty() {
                        // Nothing to sample; try again a period later.
                        self.last_round_end_ns = Some(now_ns);
                        return None;
                    }
                    self.stats.rounds += 1;
                    self.next_target(now_ns);
                }
                Phase::Drain { target, since_ns } => {
                    if !by_hal.contains_key(&target) {
                        self.stats.aborted += 1;
                        self.next_target(now_ns);
                        continue;
                    }
                    let drained = obs.iter().all(|o| o.hal == target || !o.in_flight);
                    if !drained && now_ns.saturating_sub(since_ns) < MAX_DRAIN_NS {
                        return Some(self.others(obs, target));
                    }
                    let get = by_hal.get(&target).map_or(0, |o| o.gp_get);
                    self.phase = Phase::Measure {
                        target,
                        start: (now_ns, get),
                        ticks: 0,
                        busy_ns: 0,
                        last: None,
                        disturbed: false,
                    };
                    return Some(self.others(obs, target));
                }
                Phase::Measure {
                    target,
                    start,
                    ticks,
                    busy_ns,
                    last,
                    disturbed,
                } => {
                    let Some(o) = by_hal.get(&target) else {
                        self.stats.aborted += 1;
                        self.next_target(now_ns);
                        continue;
                    };
                    let ticks = ticks + 1;
                    let entries = (o.gp_get.wrapping_sub(start.1) as i32).max(0) as u32;
                    let elapsed = now_ns.saturating_sub(start.0);
                    let enough = entries >= MIN_ENTRIES && ticks >= MIN_MEASURE_TICKS;
                    let out_of_work = !o.pending;
                    if enough || out_of_work || elapsed >= MAX_MEASURE_NS {
                        // A channel that ran dry mid-sample idled part of the time; its
                        // sample would overstate the cost unless it is long enough.
                        if entries > 0 && !disturbed && (!out_of_work || entries >= MIN_ENTRIES) {
                            // Polled busy time if there was polling, else wall time.
                            let ns = if last.is_some() { busy_ns } else { elapsed };
                            est.record(target, entries, ns);
                            self.stats.samples += 1;
                        } else {
                            self.stats.aborted += 1;
                        }
                        self.next_target(now_ns);
                        continue;
                    }
                    self.phase = Phase::Measure {
                        target,
                        start,
                        ticks,
                        busy_ns,
                        last,
                        disturbed,
                    };
                    return Some(self.others(obs, target));
                }
            }
        }
        match &self.phase {
            Phase::Freerun => None,
            Phase::Drain { target, .. } | Phase::Measure { target, .. } => {
                Some(self.others(obs, *target))
            }
        }
    }

    /// The channel being measured, if any: poll it with [`Sampler::observe_backlog`].
    pub fn measuring(&self) -> Option<ChannelId> {
        match self.phase {
            Phase::Measure { target, .. } => Some(target),
            _ => None,
        }
    }

    /// A poll of the measured channel: whether it had work released to the GPU at
    /// `now_ns`. The time since the previous poll counts as busy if it had then.
    pub fn observe_backlog(&mut self, now_ns: u64, backlogged: bool) {
        if let Phase::Measure {
            busy_ns,
            last,
            disturbed,
            ..
        } = &mut self.phase
        {
            if let Some((t, was)) = *last {
                let gap = now_ns.saturating_sub(t);
                *disturbed |= gap > MAX_POLL_GAP_NS;
                if was {
                    *busy_ns += gap;
                }
            }
            *last = Some((now_ns, backlogged));
        }
    }

    fn next_target(&mut self, now_ns: u64) {
        self.phase = match self.queue.pop_front() {
            Some(target) => Phase::Drain {
                target,
                since_ns: now_ns,
            },
            None => {
                self.last_round_end_ns = Some(now_ns);
                Phase::Freerun
            }
        };
    }

    fn others(&self, obs: &[SampleObs], target: ChannelId) -> BTreeSet<(String, u32)> {
        obs.iter()
            .filter(|o| o.hal != target)
            .map(|o| o.key.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn o(ch: u32, gp_get: u32, in_flight: bool, pending: bool) -> SampleObs {
        SampleObs {
            key: ("vm".into(), ch),
            hal: ChannelId(ch),
            gp_get,
            in_flight,
            pending,
        }
    }

    #[test]
    fn drains_then_measures_each_channel_alone() {
        let mut s = Sampler::new(1000 * MS);
        let mut est = Estimator::new();
        // Tick 0: both pending, none sampled: drain for channel 1 (2 shadowed).
        let sh = s
            .tick(&[o(1, 0, true, true), o(2, 0, true, true)], 0, &mut est)
            .expect("sampling");
        assert_eq!(sh, BTreeSet::from([("vm".to_string(), 2)]));
        // Channel 2 still has work in flight: keep draining.
        assert!(s
            .tick(
                &[o(1, 5, true, true), o(2, 1, true, true)],
                10 * MS,
                &mut est
            )
            .is_some());
        // Drained: measurement starts at GP_GET 10.
        s.tick(
            &[o(1, 10, true, true), o(2, 2, false, true)],
            20 * MS,
            &mut est,
        );
        // Channel 1 runs alone at 1 ms per entry.
        for t in 1..=3u32 {
            let sh = s.tick(
                &[o(1, 10 + 10 * t, true, true), o(2, 2, false, true)],
                (20 + 10 * u64::from(t)) * MS,
                &mut est,
            );
            if t < 3 {
                assert_eq!(sh, Some(BTreeSet::from([("vm".to_string(), 2)])));
            } else {
                // Sample done; channel 2's drain starts: 1 is shadowed now.
                assert_eq!(sh, Some(BTreeSet::from([("vm".to_string(), 1)])));
            }
        }
        assert_eq!(est.cost(ChannelId(1)), Some(MS));
        assert_eq!(s.stats.samples, 1);
        assert!(s.sampling());
    }

    #[test]
    fn polled_busy_time_excludes_gaps() {
        let mut s = Sampler::new(1000 * MS);
        let mut est = Estimator::new();
        s.tick(&[o(1, 0, true, true)], 0, &mut est);
        assert_eq!(s.measuring(), Some(ChannelId(1)), "nothing to drain");
        // Backlogged half of the time: 15 ms of 30.
        for i in 0..30u64 {
            s.observe_backlog(i * MS, i % 2 == 0);
        }
        s.observe_backlog(30 * MS, false);
        for t in 1..=3u32 {
            s.tick(&[o(1, 5 * t, true, true)], u64::from(t) * 10 * MS, &mut est);
        }
        assert_eq!(est.cost(ChannelId(1)), Some(MS), "15 entries in 15 ms busy");
        assert_eq!(s.measuring(), None);
    }

    #[test]
    fn a_sample_with_a_long_poll_gap_is_dropped() {
        let mut s = Sampler::new(1000 * MS);
        let mut est = Estimator::new();
        s.tick(&[o(1, 0, true, true)], 0, &mut est);
        s.observe_backlog(MS, true);
        // The scheduler thread waited 20 ms for a core: what happened is unknown.
        s.observe_backlog(21 * MS, true);
        for t in 1..=3u32 {
            s.tick(
                &[o(1, 10 * t, true, true)],
                u64::from(t) * 10 * MS,
                &mut est,
            );
        }
        assert_eq!(est.cost(ChannelId(1)), None);
        assert_eq!((s.stats.samples, s.stats.aborted), (0, 1));
    }

    #[test]
    fn freerun_between_rounds_and_idle_channels_are_skipped() {
        let mut s = Sampler::new(100 * MS);
        let mut est = Estimator::new();
        est.record(ChannelId(1), 1, MS);
        // Channel 1 has a cost, channel 2 idles: the first round is due at once though.
        let r = s.tick(&[o(1, 0, true, true), o(2, 0, false, false)], 0, &mut est);
        assert!(r.is_some(), "first round");
        // Channel 1 runs out of work at once: aborted, round over.
        let r = s.tick(
            &[o(1, 0, false, false), o(2, 0, false, false)],
            MS,
            &mut est,
        );
        let r2 = s.tick(
            &[o(1, 0, false, false), o(2, 0, false, false)],
            2 * MS,
            &mut est,
        );
        assert!(r.is_none() || r2.is_none());
        assert_eq!(s.stats.aborted, 1);
        assert!(!s.sampling());
        // Within the period nothing is sampled.
        assert!(s.tick(&[o(1, 0, true, true)], 50 * MS, &mut est).is_none());
    }
}
