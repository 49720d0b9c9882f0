//! What a frontend does when its backend dies or stops answering: the policy (how long
//! each vhost-user request may wait; whether and how often to reconnect) and the retry
//! loop with exponential backoff. The loopback VM and `vgpu-vmm` share both.

use std::fmt::Display;
use std::time::Duration;

use log::{error, info, warn};
use thiserror::Error;

/// How often to try the backend's socket again after losing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconnectPolicy {
    /// Wait before the first retry; doubled after each failure...
    pub initial_backoff: Duration,
    /// ...up to this.
    pub max_backoff: Duration,
    /// Give up after this many failed attempts (`None`: retry forever).
    pub max_attempts: Option<u32>,
}

impl Default for ReconnectPolicy {
    fn default() -> Self {
        ReconnectPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            max_attempts: None,
        }
    }
}

impl ReconnectPolicy {
    /// The wait after `failures` failed attempts.
    pub fn backoff(&self, failures: u32) -> Duration {
        let factor = 1u32.checked_shl(failures.min(16)).unwrap_or(u32::MAX);
        self.initial_backoff
            .saturating_mul(factor)
            .min(self.max_backoff)
    }
}

/// A frontend's answer to a lost or silent backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultPolicy {
    /// Reconnect after the backend went away (`None`: the device stays broken, the
    /// behaviour before reconnect existed).
    pub reconnect: Option<ReconnectPolicy>,
    /// How long a request that waits for the backend's reply may take before the backend
    /// counts as hung and the connection is closed (`None`: wait forever).
    pub request_timeout: Option<Duration>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ReconnectError {
    #[error("gave up after {0} failed attempts")]
    GaveUp(u32),
    #[error("stopped")]
    Stopped,
}

/// Calls `attempt` until it succeeds, sleeping the policy's backoff between failures
/// (`sleep` sleeps and returns false when the caller wants to stop, e.g. the VM is going
/// away). Every failure is logged.
pub fn retry<T, E: Display>(
    policy: &ReconnectPolicy,
    what: &str,
    mut sleep: impl FnMut(Duration) -> bool,
    mut attempt: impl FnMut() -> Result<T, E>,
) -> Result<T, ReconnectError> {
    let mut failures = 0u32;
    loop {
        match attempt() {
            Ok(v) => {
                info!("{what}: reconnected after {failures} failed attempt(s)");
                return Ok(v);
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                if policy.max_attempts.is_some_and(|m| failures >= m) {
                    error!("{what}: attempt {failures} failed ({e}); giving up");
                    return Err(ReconnectError::GaveUp(failures));
                }
                let wait = policy.backoff(failures - 1);
                warn!("{what}: attempt {failures} failed ({e}); retrying in {wait:?}");
                if !sleep(wait) {
                    return Err(ReconnectError::Stopped);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let p = ReconnectPolicy {
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(70),
            max_attempts: None,
        };
        let waits: Vec<_> = (0..5).map(|f| p.backoff(f).as_millis()).collect();
        assert_eq!(waits, [10, 20, 40, 70, 70]);
        assert_eq!(p.backoff(u32::MAX), Duration::from_millis(70));
    }

    #[test]
    fn retries_until_success_and_gives_up_at_the_limit() {
        let p = ReconnectPolicy {
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(1),
            max_attempts: Some(4),
        };
        let mut n = 0;
        let mut slept = Vec::new();
        let r = retry(
            &p,
            "test",
            |d| {
                slept.push(d);
                true
            },
            || {
                n += 1;
                if n < 3 {
                    Err("down")
                } else {
                    Ok(n)
                }
            },
        );
        assert_eq!(r, Ok(3));
        assert_eq!(slept.len(), 2);
        let r: Result<(), _> = retry(&p, "test", |_| true, || Err("down"));
        assert_eq!(r, Err(ReconnectError::GaveUp(4)));
        let r: Result<(), _> = retry(&p, "test", |_| false, || Err("down"));
        assert_eq!(r, Err(ReconnectError::Stopped));
    }
}
