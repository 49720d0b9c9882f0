//! Command-line flags of the scheduler for `vgpu-backend`'s daemon (flattened into its
//! clap CLI), and applying them to a backend.

use std::sync::Arc;

use clap::Args;

use super::{Policy, SchedConfig, SchedError};
use crate::VgpuBackend;

/// Scheduler flags.
#[derive(Debug, Clone, Args)]
pub struct SchedArgs {
    /// Scheduling policy: none, timeslice, fair or sampling.
    #[arg(long, default_value = "fair", value_parser = parse_policy)]
    pub sched_policy: Policy,
    /// Scheduling interval, ms.
    #[arg(long, default_value_t = SchedConfig::default().interval_ms)]
    pub sched_interval_ms: u32,
    /// GPU time an entity may run ahead of its share before it is shadowed, µs.
    #[arg(long, default_value_t = SchedConfig::default().threshold_us)]
    pub sched_threshold_us: u64,
    /// Release at most this many GP entries per interval to a channel the policy lets
    /// run again while its backlog is larger (default: unshadow outright).
    #[arg(long)]
    pub sched_unshadow_cap: Option<u32>,
    /// Time slice of the timeslice policy, ms.
    #[arg(long, default_value_t = SchedConfig::default().slice_ms)]
    pub sched_slice_ms: u32,
    /// How often the sampling policy re-measures each channel, ms.
    #[arg(long, default_value_t = SchedConfig::default().sample_period_ms)]
    pub sched_sample_period_ms: u32,
    /// Kill a channel whose single kernel runs longer than this, ms (default: off).
    #[arg(long)]
    pub watchdog_ms: Option<u32>,
    /// Charge GPU idle time to the tenants that were allowed to run while another was
    /// held back (favours utilization over exact busy-time shares).
    #[arg(long)]
    pub sched_charge_idle: bool,
    /// A VM's scheduling weight, NAME=WEIGHT (1..=10000, default 100; repeatable).
    #[arg(long = "vm-weight", value_name = "NAME=WEIGHT", value_parser = parse_weight)]
    pub vm_weights: Vec<(String, u32)>,
}

fn parse_policy(s: &str) -> Result<Policy, String> {
    s.parse().map_err(|e: SchedError| e.to_string())
}

fn parse_weight(s: &str) -> Result<(String, u32), String> {
    let (name, w) = s.split_once('=').ok_or("expected NAME=WEIGHT")?;
    let w: u32 = w.parse().map_err(|e| format!("weight {w:?}: {e}"))?;
    Ok((name.to_string(), w))
}

impl SchedArgs {
    /// The configuration the flags describe.
    pub fn config(&self) -> SchedConfig {
        SchedConfig {
            policy: self.sched_policy,
            interval_ms: self.sched_interval_ms,
            threshold_us: self.sched_threshold_us,
            unshadow_cap: self.sched_unshadow_cap,
            slice_ms: self.sched_slice_ms,
            sample_period_ms: self.sched_sample_period_ms,
            watchdog_ms: self.watchdog_ms,
            charge_idle: self.sched_charge_idle,
        }
    }

    /// Sets the VM weights (the VMs must be served already) and starts the scheduler.
    pub fn apply(&self, be: &Arc<VgpuBackend>) -> Result<(), SchedError> {
        for (name, w) in &self.vm_weights {
            be.set_vm_weight(name, *w)?;
        }
        be.start_scheduler(self.config())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        sched: SchedArgs,
    }

    #[test]
    fn flags_parse_into_a_config() {
        let c = Cli::try_parse_from([
            "x",
            "--sched-policy",
            "timeslice",
            "--sched-slice-ms",
            "30",
            "--watchdog-ms",
            "500",
            "--vm-weight",
            "a=300",
            "--vm-weight",
            "b=100",
        ])
        .expect("parse");
        let cfg = c.sched.config();
        assert_eq!(cfg.policy, Policy::Timeslice);
        assert_eq!(cfg.slice_ms, 30);
        assert_eq!(cfg.watchdog_ms, Some(500));
        assert_eq!(cfg.interval_ms, 10);
        assert_eq!(
            c.sched.vm_weights,
            vec![("a".into(), 300), ("b".into(), 100)]
        );
        assert_eq!(
            Cli::try_parse_from(["x"]).expect("defaults").sched.config(),
            SchedConfig::default()
        );
        assert!(Cli::try_parse_from(["x", "--sched-policy", "lottery"]).is_err());
        assert!(Cli::try_parse_from(["x", "--vm-weight", "a"]).is_err());
    }
}
