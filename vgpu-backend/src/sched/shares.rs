//! Who used the GPU: per-interval records of busy time rolled up VM → guest process (PID)
//! → channel, kept for a while, and shares over recent windows computed from them (for the
//! operator API, benchmarks and plots).

use std::collections::{BTreeMap, VecDeque};

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
}

/// One VM's busy time in an interval.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmBusy {
    pub name: String,
    pub weight: u32,
    pub busy_ns: u64,
    pub procs: Vec<ProcBusy>,
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
    pub procs: Vec<ProcShare>,
}

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
        let mut n = 0u32;
        let mut estimated = false;
        // name -> (weight, busy, pid -> (weight, busy, channel -> busy))
        type Procs = BTreeMap<u32, (u32, u64, BTreeMap<u32, u64>)>;
        let mut vms: BTreeMap<String, (u32, u64, Procs)> = BTreeMap::new();
        for r in self.records.iter().rev() {
            if n > 0 && len_ns.saturating_add(r.len_ns) > window_ns {
                break;
            }
            len_ns = len_ns.saturating_add(r.len_ns);
            n += 1;
            estimated |= r.estimated;
            for v in &r.vms {
                let e = vms.entry(v.name.clone()).or_default();
                // The newest record comes first: it sets the weights shown.
                if e.0 == 0 {
                    e.0 = v.weight;
                }
                e.1 += v.busy_ns;
                for p in &v.procs {
                    let pe = e.2.entry(p.pid).or_default();
                    if pe.0 == 0 {
                        pe.0 = p.weight;
                    }
                    pe.1 += p.busy_ns;
                    for c in &p.channels {
                        *pe.2.entry(c.channel).or_default() += c.busy_ns;
                    }
                }
            }
        }
        let total: u64 = vms.values().map(|v| v.1).sum();
        GpuShares {
            policy,
            intervals: n,
            window_ns: len_ns,
            total_busy_ns: total,
            utilization: ratio(total, len_ns),
            estimated,
            vms: vms
                .into_iter()
                .map(|(name, (weight, busy, procs))| VmShare {
                    name,
                    weight,
                    busy_ns: busy,
                    share: ratio(busy, total),
                    procs: procs
                        .into_iter()
                        .map(|(pid, (weight, pbusy, chans))| ProcShare {
                            pid,
                            weight,
                            busy_ns: pbusy,
                            share: ratio(pbusy, total),
                            share_of_vm: ratio(pbusy, busy),
                            channels: chans
                                .into_iter()
                                .map(|(channel, busy_ns)| ChannelShare { channel, busy_ns })
                                .collect(),
                        })
                        .collect(),
                })
                .collect(),
        }
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
                },
                VmBusy {
                    name: "b".into(),
                    weight: 100,
                    busy_ns: b1 + b2,
                    procs: vec![p(2, b1), p(3, b2)],
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
}
