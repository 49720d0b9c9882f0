//! The scheduler's configuration: the policy, its parameters and their validation, and
//! the errors of the operator interface.

use std::str::FromStr;

use thiserror::Error;

use crate::sched::*;

/// Errors of the scheduler's operator interface.
#[derive(Debug, Error)]
pub enum SchedError {
    #[error("scheduling policy {0:?} is not implemented")]
    NotImplemented(Policy),
    #[error("invalid scheduler configuration: {0}")]
    InvalidConfig(String),
    #[error(
        "the GPU reports no per-channel busy time: use the `sampling` policy (GP_GET \
         progress × sampled entry cost); the watchdog needs busy counters"
    )]
    NoBusyCounters,
    #[error("weight {0} out of range {MIN_WEIGHT}..={MAX_WEIGHT}")]
    InvalidWeight(u32),
    #[error("too many process weight hints for VM {0:?}")]
    TooManyHints(String),
    #[error("no VM named {0:?}")]
    NoVm(String),
    #[error("the backend is shutting down")]
    ShuttingDown,
    #[error("cannot start the scheduler thread: {0}")]
    Thread(std::io::Error),
}

/// How the GPU is shared.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Policy {
    /// No scheduling: the GPU's own round-robin arbitration (unfair: long kernels win).
    None,
    /// Round-robin time slices: one guest process of one VM at a time runs.
    Timeslice,
    /// Two-level weighted fair queuing over measured GPU time.
    #[default]
    Fair,
    /// NEON-style draining and sampling: fair shares from GP_GET progress × a sampled
    /// cost per entry, for HALs without busy counters.
    Sampling,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::None => "none",
            Policy::Timeslice => "timeslice",
            Policy::Fair => "fair",
            Policy::Sampling => "sampling",
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = SchedError;
    fn from_str(s: &str) -> Result<Self, SchedError> {
        match s {
            "none" => Ok(Policy::None),
            "timeslice" => Ok(Policy::Timeslice),
            "fair" => Ok(Policy::Fair),
            "sampling" => Ok(Policy::Sampling),
            _ => Err(SchedError::InvalidConfig(format!("unknown policy {s:?}"))),
        }
    }
}

/// Scheduler tunables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedConfig {
    pub policy: Policy,
    /// Length of a scheduling interval (1..=1000 ms).
    pub interval_ms: u32,
    /// GPU time an entity may run ahead of its least-served saturating sibling (beyond its
    /// weighted share) before it is shadowed (`fair`, `sampling`).
    pub threshold_us: u64,
    /// When set, a channel the policy lets run again is not unshadowed while its backlog
    /// exceeds this many entries: it gets a capped release of that many per interval
    /// instead (bounds the non-preemptible burst a released over-user dumps on the GPU).
    pub unshadow_cap: Option<u32>,
    /// Length of a `timeslice` slice (1..=10000 ms; rounded up to whole intervals).
    pub slice_ms: u32,
    /// How often `sampling` re-measures every active channel's cost per entry
    /// (10..=600000 ms).
    pub sample_period_ms: u32,
    /// Kill a channel whose single kernel has run longer than this (ms; `None`: no
    /// watchdog). Needs busy counters.
    pub watchdog_ms: Option<u32>,
    /// Use it or lose it (`fair`, `sampling`): when a sibling was held back and the GPU
    /// still idled, charge the idle time to the siblings that were allowed to run (see
    /// [`fair`]). Favours GPU utilization over exact busy-time shares when some tenant
    /// cannot keep the GPU busy by itself.
    pub charge_idle: bool,
}

impl Default for SchedConfig {
    fn default() -> Self {
        SchedConfig {
            policy: Policy::Fair,
            interval_ms: 10,
            threshold_us: 5_000,
            unshadow_cap: None,
            slice_ms: 50,
            sample_period_ms: 2_000,
            watchdog_ms: None,
            charge_idle: false,
        }
    }
}

impl SchedConfig {
    pub(in crate::sched) fn validate(&self) -> Result<(), SchedError> {
        let bad = |m: String| Err(SchedError::InvalidConfig(m));
        if !(1..=1000).contains(&self.interval_ms) {
            return bad(format!("interval_ms {} not in 1..=1000", self.interval_ms));
        }
        if self.unshadow_cap == Some(0) {
            return bad("unshadow_cap of 0".into());
        }
        if !(1..=10_000).contains(&self.slice_ms) {
            return bad(format!("slice_ms {} not in 1..=10000", self.slice_ms));
        }
        if !(10..=600_000).contains(&self.sample_period_ms) {
            return bad(format!(
                "sample_period_ms {} not in 10..=600000",
                self.sample_period_ms
            ));
        }
        if self.watchdog_ms == Some(0) {
            return bad("watchdog_ms of 0".into());
        }
        if self.threshold_us > 10_000_000 {
            return bad(format!("threshold_us {} above 10 s", self.threshold_us));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_by_their_names_and_nothing_else() {
        for p in [
            Policy::None,
            Policy::Timeslice,
            Policy::Fair,
            Policy::Sampling,
        ] {
            assert_eq!(p.name().parse::<Policy>().ok(), Some(p));
            assert_eq!(p.to_string(), p.name());
        }
        for bad in ["", "Fair", "wfq", "fair "] {
            assert!(matches!(
                bad.parse::<Policy>(),
                Err(SchedError::InvalidConfig(_))
            ));
        }
        assert_eq!(Policy::default(), Policy::Fair);
    }

    #[test]
    fn the_default_is_valid_and_every_bound_is_checked() {
        assert!(SchedConfig::default().validate().is_ok());
        let with = |f: fn(&mut SchedConfig)| {
            let mut c = SchedConfig::default();
            f(&mut c);
            c.validate()
        };
        let bad: [fn(&mut SchedConfig); 8] = [
            |c| c.interval_ms = 0,
            |c| c.interval_ms = 1001,
            |c| c.unshadow_cap = Some(0),
            |c| c.slice_ms = 0,
            |c| c.sample_period_ms = 9,
            |c| c.sample_period_ms = 600_001,
            |c| c.watchdog_ms = Some(0),
            |c| c.threshold_us = 10_000_001,
        ];
        for f in bad {
            assert!(matches!(with(f), Err(SchedError::InvalidConfig(_))));
        }
        let good: [fn(&mut SchedConfig); 5] = [
            |c| c.interval_ms = 1,
            |c| c.interval_ms = 1000,
            |c| c.slice_ms = 10_000,
            |c| c.watchdog_ms = Some(1),
            |c| c.threshold_us = 10_000_000,
        ];
        for f in good {
            assert!(with(f).is_ok());
        }
    }
}
