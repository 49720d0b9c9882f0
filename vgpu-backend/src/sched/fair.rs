//! Hierarchical weighted fair queuing over measured GPU time: VMs by operator weight,
//! then processes (guest PIDs) inside each VM.
//!
//! Each entity carries a virtual time. Every interval it is charged the GPU time it was
//! measured to use, divided by its weight (`vtime += busy_ns * SCALE / weight`). Among the
//! *active* siblings of a level (those with pending work or that ran in the interval),
//! the one with the least virtual time is the most underserved; a sibling whose lead over
//! it, converted back to GPU time at the sibling's weight, exceeds the threshold is
//! shadowed for the next interval (all its channels). The least-served active sibling is
//! never over the threshold, so some entity with pending work always runs
//! (work-conserving).
//!
//! No banking: an idle entity's virtual time is raised to the least virtual time of the
//! active siblings each interval, so credit it did not use while idle is lost; an entity
//! that appears starts there too.
//!
//! [`FairState::decide`] is pure: the clocks are its only state and the caller passes the
//! measurements in.

use std::collections::{BTreeMap, BTreeSet};

/// Virtual-time scale: the largest weight, so `SCALE / weight` is exact for weight 1.
const SCALE: u128 = 10_000;

/// One channel's measurements over the last interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelSample {
    /// Guest channel id.
    pub ch: u32,
    /// GPU time the channel used in the interval.
    pub busy_delta_ns: u64,
    /// Whether the channel has submitted work that has not finished.
    pub pending: bool,
}

impl ChannelSample {
    fn active(&self) -> bool {
        self.pending || self.busy_delta_ns > 0
    }
}

/// A guest process and its channels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcSample {
    pub pid: u32,
    /// Share weight among the VM's processes (1..=10000; 0 is treated as 1).
    pub weight: u32,
    pub channels: Vec<ChannelSample>,
}

/// A VM and its processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmSample {
    pub name: String,
    /// Operator weight (1..=10000; 0 is treated as 1).
    pub weight: u32,
    pub procs: Vec<ProcSample>,
}

/// Virtual time of one entity.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Clock {
    vtime: u128,
}

/// One level of the hierarchy: the clocks of a set of siblings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Level<K: Ord> {
    clocks: BTreeMap<K, Clock>,
}

/// A sibling's input to [`Level::step`].
struct Entry<K> {
    key: K,
    weight: u32,
    busy_delta_ns: u64,
    active: bool,
}

impl<K: Ord + Clone> Level<K> {
    /// Charges the siblings, applies the no-banking rule, forgets vanished siblings and
    /// returns those over their share by more than `threshold_ns`.
    fn step(&mut self, entries: &[Entry<K>], threshold_ns: u64) -> BTreeSet<K> {
        // Newcomers start at the least virtual time of the known active siblings.
        let floor = entries
            .iter()
            .filter(|e| e.active)
            .filter_map(|e| self.clocks.get(&e.key))
            .map(|c| c.vtime)
            .min()
            .unwrap_or(0);
        let keep: BTreeSet<K> = entries.iter().map(|e| e.key.clone()).collect();
        self.clocks.retain(|k, _| keep.contains(k));
        for e in entries {
            let c = self
                .clocks
                .entry(e.key.clone())
                .or_insert(Clock { vtime: floor });
            c.vtime += u128::from(e.busy_delta_ns) * SCALE / u128::from(e.weight.max(1));
        }
        let Some(vmin) = entries
            .iter()
            .filter(|e| e.active)
            .filter_map(|e| self.clocks.get(&e.key))
            .map(|c| c.vtime)
            .min()
        else {
            return BTreeSet::new();
        };
        let mut over = BTreeSet::new();
        for e in entries {
            let Some(c) = self.clocks.get_mut(&e.key) else {
                continue;
            };
            if !e.active {
                // No banking of idle credit.
                c.vtime = c.vtime.max(vmin);
                continue;
            }
            // The lead in GPU time at the sibling's own weight.
            let lead_ns = (c.vtime - vmin) * u128::from(e.weight.max(1)) / SCALE;
            if lead_ns > u128::from(threshold_ns) {
                over.insert(e.key.clone());
            }
        }
        over
    }
}

/// The clocks of the two levels.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FairState {
    vms: Level<String>,
    procs: BTreeMap<String, Level<u32>>,
}

/// What [`FairState::decide`] chose.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Decision {
    /// (VM, guest channel) pairs to shadow for the next interval; all others run.
    pub shadow: BTreeSet<(String, u32)>,
    /// VMs over their share.
    pub over_vms: BTreeSet<String>,
    /// (VM, PID) pairs over their share inside a VM that is not itself over.
    pub over_procs: BTreeSet<(String, u32)>,
}

impl FairState {
    pub fn new() -> Self {
        Self::default()
    }

    /// One interval: charges the measured busy time and returns the channels to shadow.
    /// `threshold_ns` is the lead (GPU time beyond the entity's share, relative to its
    /// least-served active sibling) tolerated before shadowing.
    pub fn decide(&mut self, vms: &[VmSample], threshold_ns: u64) -> Decision {
        let vm_entries: Vec<Entry<String>> = vms
            .iter()
            .map(|v| Entry {
                key: v.name.clone(),
                weight: v.weight,
                busy_delta_ns: v
                    .procs
                    .iter()
                    .flat_map(|p| &p.channels)
                    .map(|c| c.busy_delta_ns)
                    .sum(),
                active: v.procs.iter().flat_map(|p| &p.channels).any(|c| c.active()),
            })
            .collect();
        let over_vms = self.vms.step(&vm_entries, threshold_ns);
        let names: BTreeSet<&str> = vms.iter().map(|v| v.name.as_str()).collect();
        self.procs.retain(|k, _| names.contains(k.as_str()));
        let mut d = Decision {
            over_vms: over_vms.clone(),
            ..Decision::default()
        };
        for v in vms {
            let entries: Vec<Entry<u32>> = v
                .procs
                .iter()
                .map(|p| Entry {
                    key: p.pid,
                    weight: p.weight,
                    busy_delta_ns: p.channels.iter().map(|c| c.busy_delta_ns).sum(),
                    active: p.channels.iter().any(|c| c.active()),
                })
                .collect();
            // The process clocks run even while the VM is held back.
            let over_procs = self
                .procs
                .entry(v.name.clone())
                .or_default()
                .step(&entries, threshold_ns);
            let vm_over = over_vms.contains(&v.name);
            for p in &v.procs {
                let proc_over = !vm_over && over_procs.contains(&p.pid);
                if proc_over {
                    d.over_procs.insert((v.name.clone(), p.pid));
                }
                if vm_over || proc_over {
                    for c in &p.channels {
                        d.shadow.insert((v.name.clone(), c.ch));
                    }
                }
            }
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ch(ch: u32, busy: u64, pending: bool) -> ChannelSample {
        ChannelSample {
            ch,
            busy_delta_ns: busy,
            pending,
        }
    }

    fn vm(name: &str, weight: u32, procs: Vec<ProcSample>) -> VmSample {
        VmSample {
            name: name.into(),
            weight,
            procs,
        }
    }

    fn proc_(pid: u32, channels: Vec<ChannelSample>) -> ProcSample {
        ProcSample {
            pid,
            weight: 1,
            channels,
        }
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn over_user_is_shadowed_least_served_never() {
        let mut s = FairState::new();
        let d = s.decide(
            &[
                vm("a", 100, vec![proc_(1, vec![ch(1, MS, true)])]),
                vm("b", 100, vec![proc_(2, vec![ch(7, 9 * MS, true)])]),
            ],
            2 * MS,
        );
        assert_eq!(d.shadow, BTreeSet::from([("b".to_string(), 7)]));
        assert_eq!(d.over_vms, BTreeSet::from(["b".to_string()]));
    }

    #[test]
    fn within_threshold_nothing_is_shadowed() {
        let mut s = FairState::new();
        let d = s.decide(
            &[
                vm("a", 1, vec![proc_(1, vec![ch(1, 4 * MS, true)])]),
                vm("b", 1, vec![proc_(2, vec![ch(2, 5 * MS, true)])]),
            ],
            2 * MS,
        );
        assert!(d.shadow.is_empty());
    }

    #[test]
    fn weights_scale_the_share() {
        // b has weight 3: 3 ms against a's 1 ms is its exact share.
        let mut s = FairState::new();
        let sample = [
            vm("a", 1, vec![proc_(1, vec![ch(1, MS, true)])]),
            vm("b", 3, vec![proc_(2, vec![ch(2, 3 * MS, true)])]),
        ];
        for _ in 0..100 {
            assert!(s.decide(&sample, MS / 2).shadow.is_empty());
        }
        // At 4 ms per interval b gets ahead and is held back.
        let sample = [
            vm("a", 1, vec![proc_(1, vec![ch(1, MS, true)])]),
            vm("b", 3, vec![proc_(2, vec![ch(2, 4 * MS, true)])]),
        ];
        let d = s.decide(&sample, MS / 2);
        assert_eq!(d.over_vms, BTreeSet::from(["b".to_string()]));
    }

    #[test]
    fn idle_entities_do_not_bank_credit() {
        let mut s = FairState::new();
        // a idles for 100 intervals while b runs alone: nobody is shadowed.
        for _ in 0..100 {
            let d = s.decide(
                &[
                    vm("a", 1, vec![proc_(1, vec![ch(1, 0, false)])]),
                    vm("b", 1, vec![proc_(2, vec![ch(2, 10 * MS, true)])]),
                ],
                2 * MS,
            );
            assert!(d.shadow.is_empty(), "work-conserving");
        }
        // a wakes up: b is not shadowed for the 1 s a did not use.
        let d = s.decide(
            &[
                vm("a", 1, vec![proc_(1, vec![ch(1, 5 * MS, true)])]),
                vm("b", 1, vec![proc_(2, vec![ch(2, 5 * MS, true)])]),
            ],
            2 * MS,
        );
        assert!(d.shadow.is_empty(), "{d:?}");
    }

    #[test]
    fn an_idle_over_user_is_not_shadowed() {
        let mut s = FairState::new();
        let d = s.decide(
            &[
                vm("a", 1, vec![proc_(1, vec![ch(1, MS, true)])]),
                vm("b", 1, vec![proc_(2, vec![ch(2, 0, false)])]),
            ],
            0,
        );
        assert!(d.shadow.is_empty());
    }

    #[test]
    fn processes_share_their_vm_and_vm_level_comes_first() {
        let mut s = FairState::new();
        // VM a: two processes, pid 10 hogs. VM b: light. a as a whole is not over
        // (10 ms vs b's 10 ms), but pid 10 is over inside a.
        let d = s.decide(
            &[
                vm(
                    "a",
                    1,
                    vec![
                        proc_(10, vec![ch(1, 9 * MS, true), ch(2, 0, true)]),
                        proc_(11, vec![ch(3, MS, true)]),
                    ],
                ),
                vm("b", 1, vec![proc_(20, vec![ch(4, 10 * MS, true)])]),
            ],
            2 * MS,
        );
        assert!(d.over_vms.is_empty());
        assert_eq!(d.over_procs, BTreeSet::from([("a".to_string(), 10)]));
        assert_eq!(
            d.shadow,
            BTreeSet::from([("a".to_string(), 1), ("a".to_string(), 2)])
        );
        // Now VM a is over as a whole: all its channels, and only the VM is reported.
        let d = s.decide(
            &[
                vm(
                    "a",
                    1,
                    vec![
                        proc_(10, vec![ch(1, 20 * MS, true)]),
                        proc_(11, vec![ch(3, 0, true)]),
                    ],
                ),
                vm("b", 1, vec![proc_(20, vec![ch(4, 0, true)])]),
            ],
            2 * MS,
        );
        assert_eq!(d.over_vms, BTreeSet::from(["a".to_string()]));
        assert!(d.over_procs.is_empty());
        assert_eq!(
            d.shadow,
            BTreeSet::from([("a".to_string(), 1), ("a".to_string(), 3)])
        );
    }

    #[test]
    fn long_run_shares_follow_weights() {
        // A toy GPU: each interval the unshadowed active VMs split 10 ms, but the GPU's
        // own arbitration gives b (long kernels) 90 % when both run.
        let mut s = FairState::new();
        let (mut ta, mut tb) = (0u64, 0u64);
        let mut shadow = BTreeSet::new();
        for _ in 0..1000 {
            let a_runs = !shadow.contains(&("a".to_string(), 1));
            let b_runs = !shadow.contains(&("b".to_string(), 2));
            let (da, db) = match (a_runs, b_runs) {
                (true, true) => (MS, 9 * MS),
                (true, false) => (10 * MS, 0),
                (false, true) => (0, 10 * MS),
                (false, false) => panic!("not work-conserving"),
            };
            ta += da;
            tb += db;
            shadow = s
                .decide(
                    &[
                        vm("a", 2, vec![proc_(1, vec![ch(1, da, true)])]),
                        vm("b", 1, vec![proc_(2, vec![ch(2, db, true)])]),
                    ],
                    5 * MS,
                )
                .shadow;
        }
        let share_a = ta as f64 / (ta + tb) as f64;
        assert!((share_a - 2.0 / 3.0).abs() < 0.01, "a's share {share_a}");
    }

    #[test]
    fn vanished_entities_are_forgotten() {
        let mut s = FairState::new();
        s.decide(&[vm("a", 1, vec![proc_(1, vec![ch(1, MS, true)])])], 0);
        s.decide(&[], 0);
        assert_eq!(s, FairState::new());
    }
}
