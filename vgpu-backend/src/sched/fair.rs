//! Hierarchical weighted fair queuing over measured GPU time: VMs by operator weight,
//! then processes (guest PIDs) inside each VM.
//!
//! Each entity carries a virtual time. Every interval it is charged the GPU time it was
//! measured to use, divided by its weight (`vtime += busy_ns * SCALE / weight`). A
//! sibling is *active* if it has pending work or ran in the interval; an active one is
//! *light* if its queue drained (no work pending at the end of one of the last
//! [`SATURATING_STEPS`] intervals) and its use (smoothed) is under a quarter of an equal
//! split of the GPU by weight, and *saturating* otherwise. (A shallow queue alone does not
//! make a tenant light: a throttle two kernels deep drains between its submissions but
//! uses its share.) Among the saturating siblings of a level the one with the least
//! virtual time is the most underserved; a sibling whose lead over it, converted back to
//! GPU time at the sibling's weight, exceeds the threshold is shadowed for the next
//! interval (all its channels). The least-served saturating sibling is never over the
//! threshold, so some entity with pending work always runs (work-conserving).
//!
//! Light siblings (active, not saturating: a guest loop that computes on its CPU and
//! submits a small kernel now and then) are served by the GPU's own round-robin as soon
//! as they submit, so holding others back for them only idles the GPU: they keep at most
//! the threshold's worth of credit over the least-served saturating sibling (bounded
//! lag), and they never set the reference others are measured against. They are still
//! held back themselves when they get ahead (a tenant whose queue drains because it
//! submits one long kernel at a time). Before this rule, the demo's mix held three VMs
//! behind a fourth that used 1 % of the GPU while the GPU idled 93 % of the time
//! (issue 15).
//!
//! No banking: an idle entity's virtual time is raised to the least virtual time of the
//! active siblings each interval, so credit it did not use while idle is lost; an entity
//! that appears starts there too.
//!
//! Use it or lose it: when a sibling was held back (shadowed with work pending) and the
//! GPU still went idle during the interval, the siblings that were allowed to run left
//! that time unused; they are charged for it (equally in virtual time, so in proportion
//! to their weights), as if they had used it. Otherwise an entity whose own submissions
//! cannot keep the GPU busy (short kernels, a slow guest) would hold a shadowed sibling
//! back while the GPU idles, and the shadowed one would get less than its share of the
//! GPU's time.
//!
//! Quiet siblings: the scheduler leaves channels that did nothing since its last look
//! out of most intervals, and VMs with nothing but such channels out of most intervals
//! (issue 15), so a process or a VM may be missing from a few intervals.
//! Its clock is kept and, when it is back, raised to the least active virtual time of the
//! last interval it missed, exactly what the no-banking rule would have done had it been
//! present and idle. Clocks of siblings that are gone are dropped only at a `full`
//! interval (one that saw everything).
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
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcSample {
    pub pid: u32,
    /// Share weight among the VM's processes (1..=10000; 0 is treated as 1).
    pub weight: u32,
    pub channels: Vec<ChannelSample>,
    /// GPU time, in the interval, of the process's channels destroyed before its end:
    /// charged like the live channels' (a tenant must not escape its clock by churning
    /// channels), and it makes the process active.
    pub retired_busy_ns: u64,
}

impl ProcSample {
    fn busy_ns(&self) -> u64 {
        self.channels
            .iter()
            .map(|c| c.busy_delta_ns)
            .sum::<u64>()
            .saturating_add(self.retired_busy_ns)
    }

    fn active(&self) -> bool {
        self.retired_busy_ns > 0 || self.channels.iter().any(|c| c.active())
    }
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
    /// The last step that saw it.
    seen: u64,
    /// Steps in a row that ended with work pending.
    backlogged_steps: u32,
    /// GPU time used per step, smoothed (1/4 new).
    use_ns: u64,
}

impl Clock {
    /// What `steps` steps listed idle would have done to the backlog and use records
    /// (a sibling left out of steps was quiet in them).
    fn quiet_for(&mut self, steps: u64) {
        self.backlogged_steps = 0;
        for _ in 0..steps.min(64) {
            self.use_ns -= self.use_ns / 4;
        }
    }
}

/// Steps in a row with work pending at the end after which a sibling counts as
/// *saturating*; any other active sibling is *light* (see the module's comment).
pub const SATURATING_STEPS: u32 = 3;

/// One level of the hierarchy: the clocks of a set of siblings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Level<K: Ord> {
    clocks: BTreeMap<K, Clock>,
    /// Steps so far.
    steps: u64,
    /// The least virtual time of the active siblings at the last step that had any.
    vmin: u128,
    /// For a VM's processes: the VM level's step at this level's last step.
    parent_step: u64,
}

/// A sibling's input to [`Level::step`].
struct Entry<K> {
    key: K,
    weight: u32,
    busy_delta_ns: u64,
    active: bool,
    /// Shadowed with work pending during the interval.
    held: bool,
    /// Active and not held back.
    runnable: bool,
    /// Work pending at the interval's end (held back or not).
    backlogged: bool,
}

/// Which siblings are saturating (see the module's comment); the other active ones are
/// light. `runs`: steps in a row each sibling ended with work pending; `uses`: its
/// smoothed use per step; `capacity_ns`: the GPU time of a step (0: unknown, and what the
/// active siblings used stands in).
fn saturating<K>(entries: &[Entry<K>], runs: &[u32], uses: &[u64], capacity_ns: u64) -> Vec<bool> {
    let (used, active_w) = entries
        .iter()
        .zip(uses)
        .filter(|(e, _)| e.active)
        .fold((0u128, 0u128), |(u, w), (e, x)| {
            (u + u128::from(*x), w + u128::from(e.weight.max(1)))
        });
    let capacity = if capacity_ns > 0 {
        u128::from(capacity_ns)
    } else {
        used
    };
    entries
        .iter()
        .zip(runs)
        .zip(uses)
        .map(|((e, run), used)| {
            let quarter = capacity * u128::from(e.weight.max(1)) / active_w.max(1) / 4;
            let drained = !(e.backlogged && *run >= SATURATING_STEPS);
            e.active && !(drained && u128::from(*used) < quarter)
        })
        .collect()
}

impl<K: Ord + Clone> Level<K> {
    /// Charges the siblings (their busy time, and `idle_ns` of idle GPU time if a sibling
    /// was held back meanwhile), applies the no-banking rule, forgets vanished siblings
    /// and returns those over their share by more than `threshold_ns`.
    fn step(
        &mut self,
        entries: &[Entry<K>],
        threshold_ns: u64,
        idle_ns: u64,
        capacity_ns: u64,
        full: bool,
    ) -> BTreeSet<K> {
        self.steps += 1;
        let (steps, last_vmin) = (self.steps, self.vmin);
        // One lookup per sibling: the clocks are copied out here and written back once
        // (the keys may be names, and a lookup costs a string compare per node visited).
        let known: Vec<Option<Clock>> = entries
            .iter()
            .map(|e| {
                self.clocks.get_mut(&e.key).map(|c| {
                    // Back from a quiet spell: it was idle meanwhile (no banking).
                    if c.seen + 1 < steps {
                        c.vtime = c.vtime.max(last_vmin);
                        c.quiet_for(steps - c.seen - 1);
                    }
                    c.seen = steps;
                    *c
                })
            })
            .collect();
        let runs: Vec<u32> = entries
            .iter()
            .zip(&known)
            .map(|(e, c)| match (e.backlogged, c) {
                (false, _) => 0,
                (true, Some(c)) => c.backlogged_steps.saturating_add(1),
                (true, None) => 1,
            })
            .collect();
        // Smoothed use per step (1/4 new).
        let uses: Vec<u64> = entries
            .iter()
            .zip(&known)
            .map(|(e, c)| {
                let old = c.map_or(e.busy_delta_ns, |c| c.use_ns);
                old - old / 4 + e.busy_delta_ns / 4
            })
            .collect();
        // Newcomers start at the least virtual time of the known active siblings.
        let floor = entries
            .iter()
            .zip(&known)
            .filter(|(e, _)| e.active)
            .filter_map(|(_, c)| c.map(|c| c.vtime))
            .min()
            .unwrap_or(0);
        if full {
            let keep: BTreeSet<&K> = entries.iter().map(|e| &e.key).collect();
            self.clocks.retain(|k, _| keep.contains(k));
        }
        let mut vt: Vec<u128> = entries
            .iter()
            .zip(&known)
            .map(|(e, c)| {
                c.map_or(floor, |c| c.vtime)
                    + u128::from(e.busy_delta_ns) * SCALE / u128::from(e.weight.max(1))
            })
            .collect();
        let runnable_w: u128 = entries
            .iter()
            .filter(|e| e.runnable)
            .map(|e| u128::from(e.weight.max(1)))
            .sum();
        if idle_ns > 0 && runnable_w > 0 && entries.iter().any(|e| e.held) {
            let dv = u128::from(idle_ns) * SCALE / runnable_w;
            for (e, v) in entries.iter().zip(vt.iter_mut()) {
                if e.runnable {
                    *v += dv;
                }
            }
        }
        let saturating = saturating(entries, &runs, &uses, capacity_ns);
        let vmin_saturating = vt
            .iter()
            .zip(&saturating)
            .filter(|(_, s)| **s)
            .map(|(v, _)| *v)
            .min();
        if let Some(vs) = vmin_saturating {
            // Bounded lag: a light sibling keeps at most the threshold's worth of credit
            // over the least-served saturating one.
            for ((e, v), s) in entries.iter().zip(vt.iter_mut()).zip(&saturating) {
                if e.active && !*s {
                    let slack = u128::from(threshold_ns) * SCALE / u128::from(e.weight.max(1));
                    *v = (*v).max(vs.saturating_sub(slack));
                }
            }
        }
        let vmin = entries
            .iter()
            .zip(&vt)
            .filter(|(e, _)| e.active)
            .map(|(_, v)| *v)
            .min();
        let mut over = BTreeSet::new();
        if let Some(vmin) = vmin {
            self.vmin = vmin;
            for (e, v) in entries.iter().zip(vt.iter_mut()) {
                if !e.active {
                    // No banking of idle credit.
                    *v = (*v).max(vmin);
                    continue;
                }
                // The lead in GPU time at the sibling's own weight, over the
                // least-served saturating sibling: with none, every sibling's queue
                // drains and nobody needs holding back.
                let Some(vs) = vmin_saturating else {
                    continue;
                };
                let lead_ns = v.saturating_sub(vs) * u128::from(e.weight.max(1)) / SCALE;
                if lead_ns > u128::from(threshold_ns) {
                    over.insert(e.key.clone());
                }
            }
        }
        for (((e, v), r), x) in entries.iter().zip(vt).zip(runs).zip(uses) {
            match self.clocks.get_mut(&e.key) {
                Some(c) => {
                    c.vtime = v;
                    c.backlogged_steps = r;
                    c.use_ns = x;
                }
                None => {
                    self.clocks.insert(
                        e.key.clone(),
                        Clock {
                            vtime: v,
                            seen: steps,
                            backlogged_steps: r,
                            use_ns: x,
                        },
                    );
                }
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

    /// VM `name`'s virtual time in GPU milliseconds at weight 100 (for tracing).
    pub fn vm_clock_ms(&self, name: &str) -> Option<f64> {
        let c = self.vms.clocks.get(name)?;
        Some(c.vtime as f64 * 100.0 / SCALE as f64 / 1e6)
    }

    /// One interval: charges the measured busy time and returns the channels to shadow.
    /// `threshold_ns` is the lead (GPU time beyond the entity's share, relative to its
    /// least-served saturating sibling) tolerated before shadowing.
    pub fn decide(&mut self, vms: &[VmSample], threshold_ns: u64) -> Decision {
        self.decide_with_idle(vms, threshold_ns, (0, 0), &BTreeSet::new(), true)
    }

    /// [`FairState::decide`], knowing that the GPU was idle for `idle_ns` of the interval
    /// (charged, see the module's comment) while the channels in `held` were shadowed,
    /// and that the interval held `capacity_ns` of GPU time (0: unknown). `full`: `vms`
    /// holds every VM and process (quiet ones included), so the clocks of those missing
    /// are dropped.
    pub fn decide_with_idle(
        &mut self,
        vms: &[VmSample],
        threshold_ns: u64,
        (idle_ns, capacity_ns): (u64, u64),
        held: &BTreeSet<(String, u32)>,
        full: bool,
    ) -> Decision {
        // Each VM's held channels (most VMs have none: no key is built per channel).
        let held_in: Vec<BTreeSet<u32>> = vms
            .iter()
            .map(|v| {
                let span = (v.name.clone(), 0)..=(v.name.clone(), u32::MAX);
                held.range(span).map(|(_, ch)| *ch).collect()
            })
            .collect();
        let is_held = |h: &BTreeSet<u32>, c: &ChannelSample| c.pending && h.contains(&c.ch);
        let runs = |h: &BTreeSet<u32>, c: &ChannelSample| c.active() && !h.contains(&c.ch);
        let vm_entries: Vec<Entry<String>> = vms
            .iter()
            .zip(&held_in)
            .map(|(v, h)| {
                let chans = || v.procs.iter().flat_map(|p| &p.channels);
                Entry {
                    key: v.name.clone(),
                    weight: v.weight,
                    busy_delta_ns: v.procs.iter().map(ProcSample::busy_ns).sum(),
                    active: v.procs.iter().any(ProcSample::active),
                    held: chans().any(|c| is_held(h, c)),
                    runnable: chans().any(|c| runs(h, c)),
                    backlogged: chans().any(|c| c.pending),
                }
            })
            .collect();
        let over_vms = self
            .vms
            .step(&vm_entries, threshold_ns, idle_ns, capacity_ns, full);
        let active_w: u64 = vm_entries
            .iter()
            .filter(|e| e.active)
            .map(|e| u64::from(e.weight.max(1)))
            .sum();
        // Each runnable VM's part of the idle time, for its processes.
        let runnable_w: u64 = vm_entries
            .iter()
            .filter(|e| e.runnable)
            .map(|e| u64::from(e.weight.max(1)))
            .sum();
        if full {
            let names: BTreeSet<&str> = vms.iter().map(|v| v.name.as_str()).collect();
            self.procs.retain(|k, _| names.contains(k.as_str()));
        }
        let mut d = Decision {
            over_vms: over_vms.clone(),
            ..Decision::default()
        };
        for (v, h) in vms.iter().zip(&held_in) {
            let entries: Vec<Entry<u32>> = v
                .procs
                .iter()
                .map(|p| Entry {
                    key: p.pid,
                    weight: p.weight,
                    busy_delta_ns: p.busy_ns(),
                    active: p.active(),
                    held: p.channels.iter().any(|c| is_held(h, c)),
                    runnable: p.channels.iter().any(|c| runs(h, c)),
                    backlogged: p.channels.iter().any(|c| c.pending),
                })
                .collect();
            let vm_idle = if entries.iter().any(|e| e.runnable) && runnable_w > 0 {
                idle_ns.saturating_mul(u64::from(v.weight.max(1))) / runnable_w
            } else {
                0
            };
            // The process clocks run even while the VM is held back.
            let level = match self.procs.get_mut(&v.name) {
                Some(l) => l,
                None => self.procs.entry(v.name.clone()).or_default(),
            };
            // A VM left out of intervals (quiet) had its processes idle meanwhile.
            if level.parent_step + 1 < self.vms.steps {
                for c in level.clocks.values_mut() {
                    c.quiet_for(self.vms.steps - level.parent_step - 1);
                }
            }
            level.parent_step = self.vms.steps;
            let vm_capacity =
                capacity_ns.saturating_mul(u64::from(v.weight.max(1))) / active_w.max(1);
            let over_procs = level.step(&entries, threshold_ns, vm_idle, vm_capacity, full);
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
            ..ProcSample::default()
        }
    }

    const MS: u64 = 1_000_000;

    /// A state that has seen `sample`'s siblings with their work pending, and no GPU
    /// time used, for as many intervals as it takes to count them as saturating.
    fn primed(sample: &[VmSample]) -> FairState {
        let idle: Vec<VmSample> = sample
            .iter()
            .map(|v| VmSample {
                procs: v
                    .procs
                    .iter()
                    .map(|p| ProcSample {
                        channels: p
                            .channels
                            .iter()
                            .map(|c| ChannelSample {
                                busy_delta_ns: 0,
                                ..*c
                            })
                            .collect(),
                        retired_busy_ns: 0,
                        ..p.clone()
                    })
                    .collect(),
                ..v.clone()
            })
            .collect();
        let mut s = FairState::new();
        for _ in 1..SATURATING_STEPS {
            s.decide(&idle, 0);
        }
        s
    }

    #[test]
    fn over_user_is_shadowed_least_served_never() {
        let sample = [
            vm("a", 100, vec![proc_(1, vec![ch(1, MS, true)])]),
            vm("b", 100, vec![proc_(2, vec![ch(7, 9 * MS, true)])]),
        ];
        let d = primed(&sample).decide(&sample, 2 * MS);
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
        // VM a: two processes, pid 10 hogs. VM b: light. a as a whole is not over
        // (10 ms vs b's 10 ms), but pid 10 is over inside a.
        let sample = [
            vm(
                "a",
                1,
                vec![
                    proc_(10, vec![ch(1, 9 * MS, true), ch(2, 0, true)]),
                    proc_(11, vec![ch(3, MS, true)]),
                ],
            ),
            vm("b", 1, vec![proc_(20, vec![ch(4, 10 * MS, true)])]),
        ];
        let mut s = primed(&sample);
        let d = s.decide(&sample, 2 * MS);
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

    /// A VM of the toy GPU: name, weight, processes as (PID, channel, pull).
    type ToyVm<'a> = (&'a str, u32, &'a [(u32, u32, u64)]);

    /// A toy GPU for the long-run tests: each interval the unshadowed active channels
    /// split 10 ms in proportion to `pull` (the GPU's own arbitration: long kernels win).
    fn simulate(
        s: &mut FairState,
        layout: &[ToyVm],
        intervals: usize,
    ) -> BTreeMap<(String, u32), u64> {
        let mut shadow = BTreeSet::new();
        let mut total = BTreeMap::new();
        for _ in 0..intervals {
            let running: Vec<(String, u32, u64)> = layout
                .iter()
                .flat_map(|(v, _, ps)| {
                    ps.iter()
                        .map(move |(_, ch, pull)| (v.to_string(), *ch, *pull))
                })
                .filter(|(v, ch, pull)| *pull > 0 && !shadow.contains(&(v.clone(), *ch)))
                .collect();
            let pull_sum: u64 = running.iter().map(|r| r.2).sum();
            assert!(pull_sum > 0, "not work-conserving");
            let got = |v: &str, ch: u32| {
                running
                    .iter()
                    .find(|r| r.0 == v && r.1 == ch)
                    .map_or(0, |r| 10 * MS * r.2 / pull_sum)
            };
            let sample: Vec<VmSample> = layout
                .iter()
                .map(|(v, w, ps)| {
                    vm(
                        v,
                        *w,
                        ps.iter()
                            .map(|(pid, ch, pull)| {
                                *total.entry((v.to_string(), *pid)).or_default() += got(v, *ch);
                                proc_(*pid, vec![ch_(*ch, got(v, *ch), *pull > 0)])
                            })
                            .collect(),
                    )
                })
                .collect();
            shadow = s.decide(&sample, 2 * MS).shadow;
        }
        total
    }

    fn ch_(c: u32, busy: u64, pending: bool) -> ChannelSample {
        ch(c, busy, pending)
    }

    fn shares_of(total: &BTreeMap<(String, u32), u64>) -> BTreeMap<(String, u32), f64> {
        let sum: u64 = total.values().sum();
        total
            .iter()
            .map(|(k, v)| (k.clone(), *v as f64 / sum as f64))
            .collect()
    }

    #[test]
    fn two_levels_converge_and_an_idle_sibling_s_share_goes_to_the_others() {
        let mut s = FairState::new();
        // VMs 1:1; B's three processes pull 1:4:16 on the raw GPU; A pulls 1.
        let all: &[ToyVm] = &[
            ("a", 1, &[(1, 1, 1)]),
            ("b", 1, &[(21, 2, 1), (22, 3, 4), (23, 4, 16)]),
        ];
        let sh = shares_of(&simulate(&mut s, all, 2000));
        assert!((sh[&("a".into(), 1)] - 0.5).abs() < 0.02, "{sh:?}");
        for pid in [21, 22, 23] {
            assert!((sh[&("b".into(), pid)] - 1.0 / 6.0).abs() < 0.02, "{sh:?}");
        }
        // PID 23 goes idle: 21 and 22 get a quarter each, A keeps half.
        let idle: &[ToyVm] = &[
            ("a", 1, &[(1, 1, 1)]),
            ("b", 1, &[(21, 2, 1), (22, 3, 4), (23, 4, 0)]),
        ];
        let sh = shares_of(&simulate(&mut s, idle, 2000));
        assert!((sh[&("a".into(), 1)] - 0.5).abs() < 0.02, "{sh:?}");
        assert!((sh[&("b".into(), 21)] - 0.25).abs() < 0.02, "{sh:?}");
        assert!((sh[&("b".into(), 22)] - 0.25).abs() < 0.02, "{sh:?}");
    }

    #[test]
    fn process_weights_split_the_vm_share_and_never_raise_it() {
        let mut s = FairState::new();
        let sample = |w1: u32| {
            vec![
                vm(
                    "a",
                    1,
                    vec![ProcSample {
                        pid: 1,
                        weight: w1,
                        channels: vec![ch(1, 5 * MS, true)],
                        ..ProcSample::default()
                    }],
                ),
                vm("b", 1, vec![proc_(2, vec![ch(2, 5 * MS, true)])]),
            ]
        };
        // A's only process hints 10000: A is still exactly as entitled as B.
        for _ in 0..100 {
            assert!(s.decide(&sample(10_000), MS).shadow.is_empty());
        }
        let d = s.decide(
            &[
                vm(
                    "a",
                    1,
                    vec![ProcSample {
                        pid: 1,
                        weight: 10_000,
                        channels: vec![ch(1, 9 * MS, true)],
                        ..ProcSample::default()
                    }],
                ),
                vm("b", 1, vec![proc_(2, vec![ch(2, MS, true)])]),
            ],
            MS,
        );
        assert_eq!(d.over_vms, BTreeSet::from(["a".to_string()]));
        // Inside B, weights 3:1 give 3/4 and 1/4 of B's half.
        let mut s = FairState::new();
        // (By hand: simulate() gives every process weight 1.)
        let mut shadow = BTreeSet::new();
        let mut tot = [0u64; 3];
        for _ in 0..2000 {
            let run: Vec<bool> = [("a", 1), ("b", 2), ("b", 3)]
                .iter()
                .map(|(v, c)| !shadow.contains(&(v.to_string(), *c)))
                .collect();
            let n = run.iter().filter(|r| **r).count() as u64;
            let got: Vec<u64> = run
                .iter()
                .map(|r| if *r { 10 * MS / n } else { 0 })
                .collect();
            for i in 0..3 {
                tot[i] += got[i];
            }
            shadow = s
                .decide(
                    &[
                        vm("a", 1, vec![proc_(1, vec![ch(1, got[0], true)])]),
                        vm(
                            "b",
                            1,
                            vec![
                                ProcSample {
                                    pid: 21,
                                    weight: 3,
                                    channels: vec![ch(2, got[1], true)],
                                    ..ProcSample::default()
                                },
                                proc_(22, vec![ch(3, got[2], true)]),
                            ],
                        ),
                    ],
                    2 * MS,
                )
                .shadow;
        }
        let sum: u64 = tot.iter().sum();
        let f = |i: usize| tot[i] as f64 / sum as f64;
        assert!((f(0) - 0.5).abs() < 0.02, "{tot:?}");
        assert!((f(1) - 0.375).abs() < 0.02, "{tot:?}");
        assert!((f(2) - 0.125).abs() < 0.02, "{tot:?}");
    }

    #[test]
    fn idle_time_is_charged_to_who_was_let_run_only_when_someone_waited() {
        let held = BTreeSet::from([("b".to_string(), 2)]);
        let sample = [
            vm("a", 1, vec![proc_(1, vec![ch(1, 2 * MS, true)])]),
            vm("b", 1, vec![proc_(2, vec![ch(2, 0, true)])]),
        ];
        // b was held back while a left 8 ms of the GPU idle: a is charged 10 ms, so
        // b (at 0) is 10 ms behind and a is over a 5 ms threshold.
        let mut s = primed(&sample);
        let d = s.decide_with_idle(&sample, 5 * MS, (8 * MS, 0), &held, true);
        assert_eq!(d.over_vms, BTreeSet::from(["a".to_string()]));
        // Without the charge a is only 2 ms ahead.
        let mut s = primed(&sample);
        assert!(s
            .decide_with_idle(&sample, 5 * MS, (0, 0), &held, true)
            .shadow
            .is_empty());
        // Nobody held back: idle time is nobody's loss.
        let mut s = primed(&sample);
        assert!(s
            .decide_with_idle(&sample, 5 * MS, (8 * MS, 0), &BTreeSet::new(), true)
            .shadow
            .is_empty());
    }

    /// The demo's mix (issue 15): two saturating VMs, ahead of two light ones that
    /// are active but use almost nothing. Light ones never hold the saturating ones
    /// back; the saturating ones still hold each other back.
    #[test]
    fn light_siblings_do_not_hold_saturating_ones_back() {
        let mut s = FairState::new();
        let heavy = |name: &str, busy: u64| vm(name, 1, vec![proc_(1, vec![ch(1, busy, true)])]);
        let light =
            |name: &str, pending: bool| vm(name, 1, vec![proc_(1, vec![ch(1, MS / 10, pending)])]);
        let mut held_saturating = 0;
        for step in 0..100 {
            // The light ones have work pending at every other interval's end.
            let pending = step % 2 == 0;
            let d = s.decide(
                &[
                    heavy("a", 5 * MS),
                    heavy("b", 5 * MS),
                    light("c", pending),
                    light("d", !pending),
                ],
                5 * MS,
            );
            held_saturating += d.over_vms.len();
        }
        assert_eq!(held_saturating, 0, "the saturating VMs were held back");
        // b runs ahead of a: held back, light ones or not.
        let d = s.decide(
            &[
                heavy("a", 0),
                heavy("b", 9 * MS),
                light("c", true),
                light("d", true),
            ],
            5 * MS,
        );
        assert_eq!(d.over_vms, BTreeSet::from(["b".to_string()]));
    }

    #[test]
    fn a_light_sibling_that_runs_ahead_is_held_back() {
        // c submits one 40 ms kernel at a time: its queue drains, but it is far ahead.
        let sample = |c_busy: u64| {
            [
                vm("a", 1, vec![proc_(1, vec![ch(1, 2 * MS, true)])]),
                vm("c", 1, vec![proc_(3, vec![ch(1, c_busy, false)])]),
            ]
        };
        let mut s = FairState::new();
        for _ in 0..SATURATING_STEPS {
            s.decide(&sample(0), 5 * MS);
        }
        let d = s.decide(&sample(40 * MS), 5 * MS);
        assert_eq!(d.over_vms, BTreeSet::from(["c".to_string()]));
    }

    #[test]
    fn vanished_entities_are_forgotten() {
        let mut s = FairState::new();
        s.decide(&[vm("a", 1, vec![proc_(1, vec![ch(1, MS, true)])])], 0);
        s.decide(&[], 0);
        assert!(s.vms.clocks.is_empty() && s.procs.is_empty(), "{s:?}");
    }

    /// A tiny deterministic generator (the test must not depend on a seed crate).
    fn lcg(x: &mut u64) -> u64 {
        *x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *x >> 33
    }

    proptest::proptest! {
        /// Leaving quiet processes and VMs out of an interval (what the scheduler does
        /// between full sweeps) decides exactly as listing them idle would: the same
        /// over-users every interval, whatever the busy pattern, and the same shadows
        /// among the channels listed. (The scheduler lists every channel of a VM or
        /// process it holds back, so a held owner cannot escape through a quiet one.)
        #[test]
        fn absent_quiet_siblings_decide_as_idle_ones(seed in 0u64..u64::MAX, threshold_ms in 0u64..5) {
            let (mut listed, mut sparse) = (FairState::new(), FairState::new());
            let mut x = seed;
            for step in 0..300u64 {
                let full = step.is_multiple_of(25);
                let mut all = Vec::new();
                let mut present = Vec::new();
                for (name, weight) in [("a", 100), ("b", 300), ("c", 100)] {
                    let mut procs_all = Vec::new();
                    let mut procs_present = Vec::new();
                    for pid in 1..=3u32 {
                        // Each process works in bursts and idles in between.
                        let busy = !lcg(&mut x).is_multiple_of(4) && !lcg(&mut x).is_multiple_of(3);
                        let p = if busy {
                            let ns = (lcg(&mut x) % 12) * MS;
                            proc_(pid, vec![ch(pid, ns, lcg(&mut x).is_multiple_of(2))])
                        } else {
                            proc_(pid, vec![ch(pid, 0, false)])
                        };
                        if busy || full {
                            procs_present.push(p.clone());
                        }
                        procs_all.push(p);
                    }
                    let quiet = procs_present.is_empty();
                    all.push(vm(name, weight, procs_all));
                    if !quiet || full {
                        present.push(vm(name, weight, procs_present));
                    }
                }
                let none = BTreeSet::new();
                let t = threshold_ms * MS;
                let d1 = listed.decide_with_idle(&all, t, (0, 0), &none, true);
                let d2 = sparse.decide_with_idle(&present, t, (0, 0), &none, full);
                proptest::prop_assert_eq!(&d1.over_vms, &d2.over_vms, "step {}", step);
                proptest::prop_assert_eq!(&d1.over_procs, &d2.over_procs, "step {}", step);
                let listed_present: BTreeSet<(String, u32)> = d1
                    .shadow
                    .iter()
                    .filter(|(v, c)| {
                        present.iter().any(|s| {
                            s.name == *v
                                && s.procs.iter().any(|p| p.channels.iter().any(|ch| ch.ch == *c))
                        })
                    })
                    .cloned()
                    .collect();
                proptest::prop_assert_eq!(listed_present, d2.shadow, "step {}", step);
            }
        }
    }
}
