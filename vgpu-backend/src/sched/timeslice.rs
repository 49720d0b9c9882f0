//! The `timeslice` policy: round-robin time slices. One guest process of one VM at a time
//! has its channels unshadowed; every other channel is shadowed. VMs take turns in name
//! order; when a VM's turn comes, its next active process (PID order) gets the slice. A
//! slice ends when it has lasted `slice_ns` or its holder has no work left (idle entities
//! are skipped, so the policy is work-conserving between turns). Work already released to
//! the GPU keeps running after a switch: kernels are not preemptible.
//!
//! A baseline for comparison (Fleig, NEON): it shares turns, not GPU time, so an entity
//! whose kernels are short gets less than its share and the switch cost is paid per slice.

use std::collections::{BTreeMap, BTreeSet};

use super::fair::{Decision, VmSample};

/// State of the round-robin.
#[derive(Debug, Default)]
pub struct Timeslice {
    /// Holder of the current slice and when it started (ns).
    current: Option<((String, u32), u64)>,
    /// Last PID served in each VM.
    last_pid: BTreeMap<String, u32>,
}

impl Timeslice {
    pub fn new() -> Self {
        Self::default()
    }

    /// The (VM, PID) holding the slice now.
    pub fn holder(&self) -> Option<&(String, u32)> {
        self.current.as_ref().map(|(k, _)| k)
    }

    /// Chooses who runs for the next interval at time `now_ns`.
    pub fn decide(&mut self, vms: &[VmSample], now_ns: u64, slice_ns: u64) -> Decision {
        let active: BTreeSet<(String, u32)> = vms
            .iter()
            .flat_map(|v| {
                v.procs
                    .iter()
                    .filter(|p| p.channels.iter().any(|c| c.pending || c.busy_delta_ns > 0))
                    .map(|p| (v.name.clone(), p.pid))
            })
            .collect();
        let keep = match &self.current {
            Some((k, start)) => active.contains(k) && now_ns.saturating_sub(*start) < slice_ns,
            None => false,
        };
        if !keep {
            let after = self.current.as_ref().map(|(k, _)| k.0.clone());
            self.current = self.next(&active, after).map(|k| (k, now_ns));
            if let Some(((vm, pid), _)) = &self.current {
                self.last_pid.insert(vm.clone(), *pid);
            }
        }
        let names: BTreeSet<&str> = vms.iter().map(|v| v.name.as_str()).collect();
        self.last_pid.retain(|k, _| names.contains(k.as_str()));
        let mut d = Decision::default();
        let Some((holder, _)) = &self.current else {
            // Nobody has work: let everyone run (nothing to protect).
            return d;
        };
        for v in vms {
            for p in &v.procs {
                if (v.name.as_str(), p.pid) != (holder.0.as_str(), holder.1) {
                    for c in &p.channels {
                        d.shadow.insert((v.name.clone(), c.ch));
                    }
                }
            }
        }
        d
    }

    /// The next active entity: the first VM after `after_vm` (wrapping) with an active
    /// process, and in it the first active PID after the one it ran last.
    fn next(
        &self,
        active: &BTreeSet<(String, u32)>,
        after_vm: Option<String>,
    ) -> Option<(String, u32)> {
        let vms: Vec<&String> = {
            let mut v: Vec<&String> = active.iter().map(|(vm, _)| vm).collect();
            v.dedup();
            v
        };
        if vms.is_empty() {
            return None;
        }
        let start = match &after_vm {
            Some(a) => vms.iter().position(|v| *v > a).unwrap_or(0),
            None => 0,
        };
        let vm = vms[start % vms.len()].clone();
        let pids: Vec<u32> = active
            .iter()
            .filter(|(v, _)| *v == vm)
            .map(|(_, p)| *p)
            .collect();
        let pid = match self.last_pid.get(&vm) {
            Some(last) => pids
                .iter()
                .copied()
                .find(|p| p > last)
                .or_else(|| pids.first().copied()),
            None => pids.first().copied(),
        }?;
        Some((vm, pid))
    }
}

#[cfg(test)]
mod tests {
    use super::super::fair::{ChannelSample, ProcSample};
    use super::*;

    fn vm(name: &str, procs: &[(u32, u32, bool)]) -> VmSample {
        VmSample {
            name: name.into(),
            weight: 1,
            procs: procs
                .iter()
                .map(|&(pid, ch, pending)| ProcSample {
                    pid,
                    weight: 1,
                    channels: vec![ChannelSample {
                        ch,
                        busy_delta_ns: 0,
                        pending,
                    }],
                    ..ProcSample::default()
                })
                .collect(),
        }
    }

    fn unshadowed(d: &Decision, all: &[(&str, u32)]) -> Vec<(String, u32)> {
        all.iter()
            .map(|(v, c)| (v.to_string(), *c))
            .filter(|k| !d.shadow.contains(k))
            .collect()
    }

    #[test]
    fn vms_alternate_and_processes_rotate_inside() {
        let mut t = Timeslice::new();
        let vms = [
            vm("a", &[(1, 10, true)]),
            vm("b", &[(5, 20, true), (6, 21, true)]),
        ];
        let all = [("a", 10), ("b", 20), ("b", 21)];
        let mut order = Vec::new();
        for i in 0..8u64 {
            // Each slice: 3 intervals of 10 with a 25 slice.
            for j in 0..3 {
                let d = t.decide(&vms, (i * 3 + j) * 10, 25);
                let run = unshadowed(&d, &all);
                assert_eq!(run.len(), 1, "exactly one runs: {run:?}");
                if j == 0 {
                    order.push(run[0].1);
                }
            }
        }
        // a, b/5, a, b/6, a, b/5, ...: VM a gets half the turns.
        assert_eq!(order, vec![10, 20, 10, 21, 10, 20, 10, 21]);
    }

    #[test]
    fn idle_holders_lose_the_slice_and_all_idle_runs_everyone() {
        let mut t = Timeslice::new();
        let d = t.decide(
            &[vm("a", &[(1, 1, true)]), vm("b", &[(2, 2, true)])],
            0,
            100,
        );
        assert_eq!(t.holder(), Some(&("a".to_string(), 1)));
        assert!(d.shadow.contains(&("b".to_string(), 2)));
        // a went idle before its slice ended: b gets the GPU at once.
        t.decide(
            &[vm("a", &[(1, 1, false)]), vm("b", &[(2, 2, true)])],
            10,
            100,
        );
        assert_eq!(t.holder(), Some(&("b".to_string(), 2)));
        let d = t.decide(
            &[vm("a", &[(1, 1, false)]), vm("b", &[(2, 2, false)])],
            20,
            100,
        );
        assert!(d.shadow.is_empty());
        assert_eq!(t.holder(), None);
    }
}
