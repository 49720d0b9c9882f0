//! Who used the GPU: per-interval records of busy time rolled up VM → guest process (PID)
//! → channel, kept for a while, and shares over recent windows computed from them (for the
//! operator API, benchmarks and plots).

use std::collections::{BTreeMap, VecDeque};

use super::entitle::{max_min, Claim};
use super::Policy;

/// How many interval records are kept (at 10 ms intervals about 40 s).
pub const HISTORY_LEN: usize = 4096;

/// One channel's busy time in an interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelBusy {
    /// Guest channel id.
    pub channel: u32,
    pub busy_ns: u64,
}

/// One guest process's busy time in an interval.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcBusy {
    pub pid: u32,
    /// Effective weight among the VM's processes (1 unless hinted).
    pub weight: u32,
    pub busy_ns: u64,
    pub channels: Vec<ChannelBusy>,
    /// Held back by the scheduler (a channel shadowed with work pending) in the interval.
    pub held: bool,
}

/// One VM's busy time in an interval.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmBusy {
    pub name: String,
    pub weight: u32,
    pub busy_ns: u64,
    pub procs: Vec<ProcBusy>,
    /// Held back by the scheduler in the interval.
    pub held: bool,
}

/// What the scheduler measured in one interval.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntervalRecord {
    /// Interval number since the scheduler (re)started.
    pub seq: u64,
    /// End of the interval, ns of CLOCK_MONOTONIC.
    pub end_ns: u64,
    /// Length of the interval, ns.
    pub len_ns: u64,
    /// Whether busy times are estimates from GP_GET progress (no HAL counters used).
    pub estimated: bool,
    /// VMs with at least one channel.
    pub vms: Vec<VmBusy>,
}

/// A channel's part of a window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChannelShare {
    pub channel: u32,
    pub busy_ns: u64,
}

/// A guest process's part of a window.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcShare {
    pub pid: u32,
    pub weight: u32,
    pub busy_ns: u64,
    /// Fraction of all GPU time used in the window (0..=1).
    pub share: f64,
    /// Fraction of its VM's GPU time (0..=1).
    pub share_of_vm: f64,
    /// What it was owed of all GPU time used in the window (0..=1): its part of its VM's
    /// entitlement by max-min over its processes' demands ([`super::entitle`]).
    pub entitled: f64,
    /// Intervals in which the scheduler held it back.
    pub held_intervals: u32,
    pub channels: Vec<ChannelShare>,
}

/// A VM's part of a window.
#[derive(Debug, Clone, PartialEq)]
pub struct VmShare {
    pub name: String,
    pub weight: u32,
    pub busy_ns: u64,
    /// Fraction of all GPU time used in the window (0..=1).
    pub share: f64,
    /// What it was owed of all GPU time used in the window (0..=1), by weighted max-min
    /// over the VMs' demands: a VM held back in at least [`SATURATED`] of the intervals
    /// wanted more than it got (unbounded demand); any other used what it wanted.
    pub entitled: f64,
    /// Intervals in which the scheduler held it back.
    pub held_intervals: u32,
    pub procs: Vec<ProcShare>,
}

/// Fraction of a window's intervals in which an entity must have been held back for its
/// demand to count as unbounded (below it, what it used is what it wanted).
pub const SATURATED: f64 = 0.05;

/// GPU shares over a recent window ([`crate::VgpuBackend::gpu_shares`]).
#[derive(Debug, Clone, PartialEq)]
pub struct GpuShares {
    pub policy: Policy,
    /// Intervals in the window and their total length, ns.
    pub intervals: u32,
    pub window_ns: u64,
    /// GPU time used by everyone in the window, ns.
    pub total_busy_ns: u64,
    /// `total_busy_ns / window_ns` (can exceed 1 with several engines).
    pub utilization: f64,
    /// Whether busy times are estimates from GP_GET progress.
    pub estimated: bool,
    pub vms: Vec<VmShare>,
}

/// The kept interval records.
#[derive(Debug, Default)]
pub struct History {
    records: VecDeque<IntervalRecord>,
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

impl History {
    pub fn push(&mut self, r: IntervalRecord) {
        if self.records.len() >= HISTORY_LEN {
            self.records.pop_front();
        }
        self.records.push_back(r);
    }

    pub fn clear(&mut self) {
        self.records.clear();
    }

    /// Records with `seq >= since`, oldest first.
    pub fn since(&self, since: u64) -> Vec<IntervalRecord> {
        self.records
            .iter()
            .filter(|r| r.seq >= since)
            .cloned()
            .collect()
    }

    /// Shares over the newest records covering at most `window_ns` (at least one record
    /// if there is any).
    pub fn shares(&self, window_ns: u64, policy: Policy) -> GpuShares {
        let mut len_ns = 0u64;
        let mut picked = Vec::new();
        for r in self.records.iter().rev() {
            if !picked.is_empty() && len_ns.saturating_add(r.len_ns) > window_ns {
                break;
            }
            len_ns = len_ns.saturating_add(r.len_ns);
            picked.push(r);
        }
        summarize(&picked, policy)
    }

    /// Shares over the records numbered `from..to`.
    pub fn shares_between(&self, from: u64, to: u64, policy: Policy) -> GpuShares {
        let picked: Vec<&IntervalRecord> = self
            .records
            .iter()
            .rev()
            .filter(|r| (from..to).contains(&r.seq))
            .collect();
        summarize(&picked, policy)
    }
}

/// Demand of an entity held back in `held` of `n` intervals that used `busy`.
fn demand(held: u32, n: u32, busy: u64) -> Option<f64> {
    if n > 0 && f64::from(held) >= SATURATED * f64::from(n) {
        None
    } else {
        Some(busy as f64)
    }
}

/// Busy time per VM, process and channel, with held-back counts.
#[derive(Default)]
struct Tally {
    weight: u32,
    busy: u64,
    held: u32,
    /// pid -> (weight, busy, held, channel -> busy)
    procs: BTreeMap<u32, (u32, u64, u32, BTreeMap<u32, u64>)>,
}

/// Shares and entitlements over `records`, newest first.
fn summarize(records: &[&IntervalRecord], policy: Policy) -> GpuShares {
    let mut len_ns = 0u64;
    let n = records.len() as u32;
    let mut estimated = false;
    let mut vms: BTreeMap<String, Tally> = BTreeMap::new();
    for r in records {
        len_ns = len_ns.saturating_add(r.len_ns);
        estimated |= r.estimated;
        for v in &r.vms {
            let e = vms.entry(v.name.clone()).or_default();
            // The newest record comes first: it sets the weights shown.
            if e.weight == 0 {
                e.weight = v.weight;
            }
            e.busy += v.busy_ns;
            e.held += u32::from(v.held);
            for p in &v.procs {
                let pe = e.procs.entry(p.pid).or_default();
                if pe.0 == 0 {
                    pe.0 = p.weight;
                }
                pe.1 += p.busy_ns;
                pe.2 += u32::from(p.held);
                for c in &p.channels {
                    *pe.3.entry(c.channel).or_default() += c.busy_ns;
                }
            }
        }
    }
    let total: u64 = vms.values().map(|v| v.busy).sum();
    let claims: Vec<Claim> = vms
        .values()
        .map(|v| Claim {
            weight: v.weight,
            demand: demand(v.held, n, v.busy),
        })
        .collect();
    let entitled = max_min(total as f64, &claims);
    GpuShares {
        policy,
        intervals: n,
        window_ns: len_ns,
        total_busy_ns: total,
        utilization: ratio(total, len_ns),
        estimated,
        vms: vms
            .into_iter()
            .zip(entitled)
            .map(|((name, v), vm_entitled)| {
                let claims: Vec<Claim> = v
                    .procs
                    .values()
                    .map(|p| Claim {
                        weight: p.0,
                        demand: demand(p.2, n, p.1),
                    })
                    .collect();
                let proc_entitled = max_min(vm_entitled, &claims);
                VmShare {
                    name,
                    weight: v.weight,
                    busy_ns: v.busy,
                    share: ratio(v.busy, total),
                    entitled: fraction(vm_entitled, total),
                    held_intervals: v.held,
                    procs: v
                        .procs
                        .into_iter()
                        .zip(proc_entitled)
                        .map(|((pid, (weight, pbusy, held, chans)), pe)| ProcShare {
                            pid,
                            weight,
                            busy_ns: pbusy,
                            share: ratio(pbusy, total),
                            share_of_vm: ratio(pbusy, v.busy),
                            entitled: fraction(pe, total),
                            held_intervals: held,
                            channels: chans
                                .into_iter()
                                .map(|(channel, busy_ns)| ChannelShare { channel, busy_ns })
                                .collect(),
                        })
                        .collect(),
                }
            })
            .collect(),
    }
}

fn fraction(part: f64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        part / total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(seq: u64, a: u64, b1: u64, b2: u64) -> IntervalRecord {
        let p = |pid, busy| ProcBusy {
            pid,
            weight: 1,
            busy_ns: busy,
            channels: vec![ChannelBusy {
                channel: pid,
                busy_ns: busy,
            }],
            held: false,
        };
        IntervalRecord {
            seq,
            end_ns: seq * 10,
            len_ns: 10,
            estimated: false,
            vms: vec![
                VmBusy {
                    name: "a".into(),
                    weight: 100,
                    busy_ns: a,
                    procs: vec![p(1, a)],
                    held: false,
                },
                VmBusy {
                    name: "b".into(),
                    weight: 100,
                    busy_ns: b1 + b2,
                    procs: vec![p(2, b1), p(3, b2)],
                    held: false,
                },
            ],
        }
    }

    #[test]
    fn shares_roll_up_over_the_window() {
        let mut h = History::default();
        h.push(rec(0, 10, 0, 0));
        h.push(rec(1, 5, 3, 2));
        h.push(rec(2, 5, 1, 4));
        let s = h.shares(20, Policy::Fair);
        assert_eq!(s.intervals, 2);
        assert_eq!(s.window_ns, 20);
        assert_eq!(s.total_busy_ns, 20);
        assert!((s.utilization - 1.0).abs() < 1e-9);
        assert_eq!(s.vms[0].busy_ns, 10);
        assert!((s.vms[0].share - 0.5).abs() < 1e-9);
        let b = &s.vms[1];
        assert_eq!(b.procs.len(), 2);
        assert!((b.procs[0].share - 0.2).abs() < 1e-9);
        assert!((b.procs[1].share_of_vm - 0.6).abs() < 1e-9);
        assert_eq!(b.procs[1].channels[0].busy_ns, 6);
        // Nobody was held back: everyone got what it wanted, so entitlement = use.
        assert!((s.vms[0].entitled - 0.5).abs() < 1e-9);
        assert!((b.procs[1].entitled - b.procs[1].share).abs() < 1e-9);
        // A window shorter than one interval still reports the newest.
        assert_eq!(h.shares(1, Policy::Fair).intervals, 1);
        assert_eq!(h.since(2).len(), 1);
    }

    #[test]
    fn history_is_bounded_and_empty_is_zero() {
        let mut h = History::default();
        let s = h.shares(1000, Policy::None);
        assert_eq!((s.intervals, s.total_busy_ns, s.utilization), (0, 0, 0.0));
        for i in 0..HISTORY_LEN as u64 + 5 {
            h.push(rec(i, 1, 1, 1));
        }
        assert_eq!(h.since(0).len(), HISTORY_LEN);
    }

    #[test]
    fn a_held_back_vm_is_owed_what_a_light_one_left() {
        // a (held back every interval) used 7, b (never held) used 3 of 10 per interval:
        // b wanted no more than it got, so a is owed the 7 it got; with a held and b at
        // 6 of 10 while held too, both are owed 5.
        let mut h = History::default();
        for seq in 0..10 {
            let mut r = rec(seq, 7, 3, 0);
            r.vms[0].held = true;
            h.push(r);
        }
        let s = h.shares_between(0, 10, Policy::Fair);
        assert_eq!(s.intervals, 10);
        assert!((s.vms[0].entitled - 0.7).abs() < 1e-9, "{s:?}");
        assert!((s.vms[1].entitled - 0.3).abs() < 1e-9);
        let mut h = History::default();
        for seq in 0..10 {
            let mut r = rec(seq, 4, 6, 0);
            r.vms[0].held = true;
            r.vms[1].held = true;
            h.push(r);
        }
        let s = h.shares_between(0, 10, Policy::Fair);
        assert!((s.vms[0].entitled - 0.5).abs() < 1e-9, "{s:?}");
        assert!((s.vms[1].entitled - 0.5).abs() < 1e-9);
        assert_eq!(s.vms[1].held_intervals, 10);
        assert_eq!(h.shares_between(3, 5, Policy::Fair).intervals, 2);
    }
}
