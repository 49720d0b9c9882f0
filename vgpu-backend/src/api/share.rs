//! GPU shares over recent windows. The scheduler exposes cumulative busy time only, so the
//! API samples every VM's and process's busy-time counters itself (every
//! [`SAMPLE_PERIOD`]) and keeps a minute of history; a share over a window is the
//! difference between the newest sample and the oldest one inside the window.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::api::types::WindowShare;
use crate::VgpuBackend;

/// Time between samples.
pub const SAMPLE_PERIOD: Duration = Duration::from_millis(200);
/// The windows reported, in seconds.
pub const WINDOWS_S: [u32; 3] = [1, 10, 60];
/// History kept (the longest window plus a margin).
const HISTORY: Duration = Duration::from_secs(62);

/// Busy time of every VM and process at one instant.
#[derive(Debug, Clone, Default)]
struct Sample {
    at: Option<Instant>,
    /// VM → (VM total, PID → busy ns).
    vms: BTreeMap<String, (u64, BTreeMap<u32, u64>)>,
}

impl Sample {
    fn total(&self) -> u64 {
        self.vms.values().map(|(t, _)| *t).sum()
    }
}

/// The sample history.
#[derive(Debug, Default)]
pub struct ShareBook {
    samples: Mutex<VecDeque<Sample>>,
}

/// Which entity a share is asked for.
#[derive(Debug, Clone, Copy)]
pub enum Entity<'a> {
    Vm(&'a str),
    Process(&'a str, u32),
}

impl ShareBook {
    pub fn new() -> Arc<Self> {
        Arc::new(ShareBook::default())
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<Sample>> {
        self.samples.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a sample of `be` now.
    pub fn sample(&self, be: &VgpuBackend) {
        let mut s = Sample {
            at: Some(Instant::now()),
            vms: BTreeMap::new(),
        };
        for name in be.vm_names() {
            let procs: BTreeMap<u32, u64> = be.process_busy_ns(&name).into_iter().collect();
            let total = procs.values().sum();
            s.vms.insert(name, (total, procs));
        }
        let mut q = self.lock();
        q.push_back(s);
        while q
            .front()
            .and_then(|f| f.at)
            .is_some_and(|t| t.elapsed() > HISTORY)
        {
            q.pop_front();
        }
    }

    /// Shares of `who` over each of [`WINDOWS_S`]; empty before two samples exist.
    pub fn windows(&self, who: Entity<'_>, engines: u32) -> Vec<WindowShare> {
        let q = self.lock();
        let Some(last) = q.back() else {
            return Vec::new();
        };
        let Some(t_last) = last.at else {
            return Vec::new();
        };
        let busy = |s: &Sample| -> u64 {
            match who {
                Entity::Vm(vm) => s.vms.get(vm).map_or(0, |v| v.0),
                Entity::Process(vm, pid) => s
                    .vms
                    .get(vm)
                    .and_then(|v| v.1.get(&pid))
                    .copied()
                    .unwrap_or(0),
            }
        };
        let mut out = Vec::new();
        for w in WINDOWS_S {
            let span = Duration::from_secs(u64::from(w));
            // The oldest sample inside the window (the history may be shorter).
            let Some(first) = q
                .iter()
                .find(|s| s.at.is_some_and(|t| t_last.duration_since(t) <= span))
            else {
                continue;
            };
            let Some(t_first) = first.at else { continue };
            let dt = t_last.duration_since(t_first);
            if dt.is_zero() {
                continue;
            }
            let mine = busy(last).saturating_sub(busy(first));
            let all = last.total().saturating_sub(first.total());
            out.push(WindowShare {
                window_s: w,
                covered_s: dt.as_secs_f64(),
                share: if all == 0 {
                    0.0
                } else {
                    mine as f64 / all as f64
                },
                utilization: mine as f64 / (dt.as_nanos() as f64 * f64::from(engines.max(1))),
                entitled: None,
                deviation_pp: None,
            });
        }
        out
    }
}

/// Fills in each window's entitlement (and the deviation from it) for `who`, from the
/// scheduler's interval records over the same span ([`VgpuBackend::gpu_shares`]).
pub fn with_entitlement(
    be: &VgpuBackend,
    who: Entity<'_>,
    mut windows: Vec<WindowShare>,
) -> Vec<WindowShare> {
    for w in windows.iter_mut() {
        let shares = be.gpu_shares(Duration::from_secs(u64::from(w.window_s)));
        if shares.intervals == 0 {
            continue;
        }
        let found = match who {
            Entity::Vm(vm) => shares
                .vms
                .iter()
                .find(|v| v.name == vm)
                .map(|v| (v.share, v.entitled)),
            Entity::Process(vm, pid) => shares
                .vms
                .iter()
                .find(|v| v.name == vm)
                .and_then(|v| v.procs.iter().find(|p| p.pid == pid))
                .map(|p| (p.share, p.entitled)),
        };
        let (share, entitled) = found.unwrap_or((0.0, 0.0));
        w.entitled = Some(entitled);
        w.deviation_pp = Some(100.0 * (share - entitled));
    }
    windows
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at: Instant, a: u64, b: u64) -> Sample {
        let mut vms = BTreeMap::new();
        vms.insert("a".to_string(), (a, BTreeMap::from([(1, a)])));
        vms.insert("b".to_string(), (b, BTreeMap::from([(2, b)])));
        Sample { at: Some(at), vms }
    }

    #[test]
    fn window_shares_from_counter_differences() {
        let book = ShareBook::default();
        assert!(book.windows(Entity::Vm("a"), 1).is_empty());
        let t0 = Instant::now();
        // 20 s of history: a got 3/4 of the GPU in the last second, 1/2 before.
        {
            let mut q = book.lock();
            q.push_back(sample(t0, 0, 0));
            q.push_back(sample(t0 + Duration::from_secs(19), 950, 950));
            q.push_back(sample(
                t0 + Duration::from_secs(20),
                1_000_000_950,
                333_333_950,
            ));
        }
        let w = book.windows(Entity::Vm("a"), 1);
        assert_eq!(w.len(), 3);
        assert_eq!(w[0].window_s, 1);
        assert!((w[0].share - 0.75).abs() < 1e-6, "{w:?}");
        assert!((w[0].utilization - 1.0).abs() < 1e-6);
        // 10 s: the oldest sample inside is the one at 19 s too.
        assert!((w[1].covered_s - 1.0).abs() < 1e-9);
        // 60 s: the history covers 20 s.
        assert!((w[2].covered_s - 20.0).abs() < 1e-9);
        let p = book.windows(Entity::Process("b", 2), 2);
        assert!((p[0].share - 0.25).abs() < 1e-6);
        assert!((p[0].utilization - 1.0 / 6.0).abs() < 1e-6);
        assert_eq!(book.windows(Entity::Process("b", 9), 1)[0].share, 0.0);
    }
}
