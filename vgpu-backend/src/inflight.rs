//! Requests the vring worker took off a ring and has not answered yet, so that stopping
//! a ring (`GET_VRING_BASE`, through [`VhostUserBackend::stop_vring`]) waits for them.
//!
//! Without this, a stop that falls between the worker's pop and its `add_used` reports
//! an avail index past a request whose effect and reply come later: on a live migration
//! the destination never sees the request, and the source may apply it after its state
//! was saved (the guest then uses a mapping the destination lacks, or waits for a reply
//! that never comes). The worker enters a ticket while it still holds the ring's lock
//! for the pop; the stop marks the ring not ready under that same lock first, so after
//! it no pop succeeds and every pop before it is counted.
//!
//! [`VhostUserBackend::stop_vring`]: vhost_user_backend::VhostUserBackend::stop_vring

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use thiserror::Error;

/// How long a stop waits for answers before it reports the ring busy.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of [`InFlight::wait_idle`].
#[derive(Debug, Error, PartialEq, Eq)]
pub enum InFlightError {
    #[error("queue {queue}: {count} request(s) still being served after {waited_ms} ms")]
    Busy {
        queue: usize,
        count: u32,
        waited_ms: u64,
    },
    #[error("queue {0} does not exist")]
    NoQueue(usize),
}

/// Per-queue counts of taken, unanswered chains.
#[derive(Debug)]
pub struct InFlight {
    counts: Mutex<Vec<u32>>,
    idle: Condvar,
}

/// One chain being served; dropping it (after the used entry and the signal) ends it.
#[derive(Debug)]
#[must_use = "the chain counts as in flight until the ticket drops"]
pub struct Ticket {
    owner: Arc<InFlight>,
    queue: usize,
}

impl InFlight {
    pub fn new(queues: usize) -> Arc<Self> {
        Arc::new(InFlight {
            counts: Mutex::new(vec![0; queues]),
            idle: Condvar::new(),
        })
    }

    /// Counts one chain of `queue` as taken (call it while the ring's lock is held).
    pub fn enter(self: &Arc<Self>, queue: usize) -> Ticket {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = c.get_mut(queue) {
            *n += 1;
        }
        Ticket {
            owner: self.clone(),
            queue,
        }
    }

    /// Chains of `queue` taken and not yet answered.
    #[cfg(test)]
    pub fn count(&self, queue: usize) -> u32 {
        let c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.get(queue).copied().unwrap_or(0)
    }

    /// Waits (at most `timeout`) until every chain taken from `queue` is answered.
    pub fn wait_idle(&self, queue: usize, timeout: Duration) -> Result<(), InFlightError> {
        let t0 = Instant::now();
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let n = *c.get(queue).ok_or(InFlightError::NoQueue(queue))?;
            if n == 0 {
                return Ok(());
            }
            let waited = t0.elapsed();
            if waited >= timeout {
                return Err(InFlightError::Busy {
                    queue,
                    count: n,
                    waited_ms: u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
                });
            }
            c = self
                .idle
                .wait_timeout(c, timeout - waited)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut c = self.owner.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = c.get_mut(self.queue) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.owner.idle.notify_all();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_waits_for_the_taken_chain_and_not_longer() {
        let f = InFlight::new(2);
        let t = f.enter(0);
        let other = f.clone();
        let h = std::thread::spawn(move || {
            let t0 = Instant::now();
            other
                .wait_idle(0, Duration::from_secs(5))
                .map(|()| t0.elapsed())
        });
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(f.count(0), 1);
        drop(t);
        let waited = h.join().expect("waiter").expect("idle");
        assert!(waited >= Duration::from_millis(90), "{waited:?}");
        assert_eq!(f.count(0), 0);
    }

    #[test]
    fn an_unanswered_chain_makes_the_stop_report_busy() {
        let f = InFlight::new(2);
        let _t = f.enter(1);
        assert_eq!(f.wait_idle(0, Duration::from_millis(10)), Ok(()));
        assert!(matches!(
            f.wait_idle(1, Duration::from_millis(20)),
            Err(InFlightError::Busy {
                queue: 1,
                count: 1,
                ..
            })
        ));
        assert_eq!(
            f.wait_idle(7, Duration::ZERO),
            Err(InFlightError::NoQueue(7))
        );
    }
}
