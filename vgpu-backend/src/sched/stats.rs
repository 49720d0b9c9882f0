//! The scheduler's counters, as the API and `/metrics` show them.

/// Counters of the scheduler.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedStats {
    pub intervals: u64,
    pub shadows: u64,
    pub unshadows: u64,
    pub capped_releases: u64,
    /// Remaps that failed (the channel is left as it was).
    pub failures: u64,
    /// Channels shadowed by the scheduler now.
    pub shadowed_now: u32,
    /// Time of the last interval's work (sampling, deciding, remapping), and the worst.
    pub tick_ns_last: u64,
    pub tick_ns_max: u64,
    /// Channels the watchdog killed.
    pub watchdog_kills: u64,
    /// Times a VM was left as it was for an interval because its session stayed locked
    /// past [`SESSION_LOCK_WAIT`](super::SESSION_LOCK_WAIT) (a long request, a frontend slow to ack a remap).
    pub busy_skips: u64,
    /// Channels the last interval looked at in full, and the quiet ones it only counted
    /// (idle since the previous look: see [`SchedVm::observe`](super::handle::SchedVm::observe)).
    pub observed_channels: u32,
    pub quiet_channels: u32,
    /// `sampling`: rounds started, samples taken, samples dropped.
    pub sample_rounds: u64,
    pub samples: u64,
    pub samples_aborted: u64,
}
