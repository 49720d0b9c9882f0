//! The kernel watchdog: a channel whose single kernel (or copy) has occupied the GPU
//! longer than a limit is killed with [`ErrorCode::WatchdogKilled`]; the HAL stops it and
//! its owner gets a channel-error event through the VM's event queue, like any fault.
//! Other channels keep running (kernels are not preemptible, so killing is the only way
//! to take the engine back from a runaway).
//!
//! Detection uses only the HAL's per-channel counters: the channel's busy time keeps
//! growing while its progress signature (kernels launched + copies + GP entries
//! completed) stays the same. A channel waiting on a semaphore accrues no busy time and is
//! never killed. Needs busy counters that tick while a kernel runs.
//!
//! [`ErrorCode::WatchdogKilled`]: vgpu_protocol::ErrorCode::WatchdogKilled

use std::collections::{BTreeMap, BTreeSet};

use vgpu_host_shim::{ChannelCounters, ChannelId};

/// Progress seen last for a channel.
#[derive(Debug, Clone, Copy)]
struct Seen {
    signature: u64,
    busy_at_progress: u64,
}

/// Watches channels for kernels running past `limit_ns`.
#[derive(Debug)]
pub struct Watchdog {
    limit_ns: u64,
    seen: BTreeMap<ChannelId, Seen>,
    killed: BTreeSet<ChannelId>,
    present: BTreeSet<ChannelId>,
}

impl Watchdog {
    pub fn new(limit_ns: u64) -> Self {
        Watchdog {
            limit_ns,
            seen: BTreeMap::new(),
            killed: BTreeSet::new(),
            present: BTreeSet::new(),
        }
    }

    /// Looks at one channel's counters; true if it must be killed now (once per channel).
    pub fn check(&mut self, ch: ChannelId, c: &ChannelCounters) -> bool {
        self.present.insert(ch);
        let signature = c
            .kernels
            .wrapping_add(c.copies)
            .wrapping_add(c.gp_completed);
        let s = self.seen.entry(ch).or_insert(Seen {
            signature,
            busy_at_progress: c.busy_ns,
        });
        if s.signature != signature {
            *s = Seen {
                signature,
                busy_at_progress: c.busy_ns,
            };
            return false;
        }
        if c.busy_ns.saturating_sub(s.busy_at_progress) > self.limit_ns {
            return self.killed.insert(ch);
        }
        false
    }

    /// Ends a round of checks: forgets channels not checked since the previous call.
    pub fn end_round(&mut self) {
        let present = std::mem::take(&mut self.present);
        self.seen.retain(|ch, _| present.contains(ch));
        self.killed.retain(|ch| present.contains(ch));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(busy_ns: u64, kernels: u64, gp_completed: u64) -> ChannelCounters {
        ChannelCounters {
            busy_ns,
            gp_completed,
            kernels,
            copies: 0,
            sem_wait_ns: 0,
        }
    }

    #[test]
    fn kills_a_long_kernel_once_and_spares_progress() {
        let mut w = Watchdog::new(1_000);
        let ch = ChannelId(1);
        assert!(!w.check(ch, &c(0, 1, 0)));
        // Many short kernels: lots of busy time, but progress each time.
        for i in 1..100 {
            assert!(!w.check(ch, &c(i * 900, i + 1, i)));
        }
        // One kernel running: busy grows, no progress.
        assert!(!w.check(ch, &c(99 * 900 + 1_000, 100, 99)));
        assert!(w.check(ch, &c(99 * 900 + 1_001, 100, 99)));
        assert!(!w.check(ch, &c(99 * 900 + 5_000, 100, 99)), "only once");
        // A waiting channel (no busy time) is never killed.
        let idle = ChannelId(2);
        for _ in 0..10 {
            assert!(!w.check(idle, &c(7, 3, 2)));
        }
        w.end_round();
        w.end_round();
        assert!(w.seen.is_empty() && w.killed.is_empty());
    }
}
