//! Accounting and the policy's input: each channel's GPU time and semaphore waits of the
//! interval, rolled up VM → process → channel, and the policy's decision.

use std::collections::BTreeMap;

use vgpu_host_shim::clock::now_ns;

use super::*;
use crate::sched::fair::{ChannelSample, Decision, ProcSample, VmSample};
use crate::sched::sampling::SampleObs;

impl Sched {
    /// Charges each channel its GPU time of the interval, and each process the time of
    /// its channels destroyed since the previous tick.
    pub(super) fn account(&mut self, vms: &mut [VmObs], obs: &mut [Obs], full: bool) {
        for o in obs.iter_mut() {
            o.busy_delta_ns = if self.use_counters {
                self.acct.delta(o.hal, o.counters.busy_ns)
            } else {
                match o.peek {
                    Some(p) => {
                        let n = self.est.progress(o.hal, p.gp_get);
                        self.est.busy_ns(o.hal, n)
                    }
                    None => 0,
                }
            };
            if self.use_counters {
                o.sem_wait_delta_ns = self.sem_waits.delta(o.hal, o.counters.sem_wait_ns);
            }
        }
        if self.use_counters {
            for o in obs.iter() {
                if let Some(p) = o.peek {
                    let n = self.entry_cost.progress(o.hal, p.gp_get);
                    if n > 0 && o.busy_delta_ns > 0 {
                        self.entry_cost.record(o.hal, n, o.busy_delta_ns);
                    }
                }
            }
            self.entry_cost.end_interval(full);
        }
        for v in vms.iter_mut() {
            for r in std::mem::take(&mut v.retired) {
                // Without counters the last progress of a destroyed channel is unknown.
                let d = if self.use_counters {
                    self.acct.delta(r.hal, r.busy_ns)
                } else {
                    0
                };
                *v.retired_busy.entry(r.pid).or_default() += d;
                // HAL channel ids are never reused: nothing of it is needed again.
                self.acct.forget(r.hal);
                self.sem_waits.forget(r.hal);
                self.est.forget(r.hal);
                self.entry_cost.forget(r.hal);
                self.stalls.forget(r.hal);
            }
        }
        self.acct.end_interval(full);
        self.sem_waits.end_interval(full);
        self.est.end_interval(full);
    }

    /// The policy's input: VMs → processes (with their weight hints) → channels.
    ///
    /// A channel counts as having pending work only if it could use the GPU: not dead,
    /// and not *blocked* — submitted work, not held back by us, no GPU time for
    /// [`stall::BLOCKED_AFTER_INTERVALS`] intervals in a row or more, and the GPU idled
    /// in one of them (waiting on a semaphore, say). A blocked channel counted as
    /// pending would hold its siblings back (its clock never moves) — and if a held-back
    /// sibling is the one that would release it, forever. See [`stall`] for why one
    /// interval is not enough. Nor does a channel whose work waited on a semaphore for
    /// half the interval or more by the GPU's own count (`sem_wait_ns`): a queue that
    /// waits between short kernels never stalls three intervals in a row, and counted as
    /// pending it held a steady VM at 0.0 % of the GPU while the GPU idled (issue 28).
    pub(super) fn samples(
        &mut self,
        vms: &[VmObs],
        obs: &[Obs],
        idle_ns: u64,
        len_ns: u64,
        full: bool,
    ) -> Vec<VmSample> {
        let gpu_idled = idle_ns.saturating_mul(10) > len_ns;
        // `len_ns` is the capacity of all compute engines; a channel runs on one.
        let interval_ns = len_ns / u64::from(self.engines.max(1));
        let hints = lock(&self.shared.hints);
        let mut out: Vec<VmSample> = vms
            .iter()
            .map(|v| VmSample {
                name: v.name.clone(),
                weight: v.weight,
                procs: Vec::new(),
            })
            .collect();
        let mut procs: BTreeMap<(usize, u32), (Vec<ChannelSample>, u64)> = BTreeMap::new();
        for o in obs {
            let held = !self.shadowed.is_empty()
                && vms
                    .get(o.vm)
                    .is_some_and(|v| self.shadowed.contains(&(v.name.clone(), o.ch)));
            let stalled = o.pending && !o.dead && o.busy_delta_ns == 0 && !held;
            let blocked = self.stalls.note(o.hal, stalled, gpu_idled);
            // Its work waited on a semaphore for half the interval or more, by the GPU's
            // own count: it could not have used the GPU then (issue 28).
            let sem_waiting = o.sem_wait_delta_ns.saturating_mul(2) >= interval_ns;
            procs
                .entry((o.vm, o.pid))
                .or_default()
                .0
                .push(ChannelSample {
                    ch: o.ch,
                    busy_delta_ns: o.busy_delta_ns,
                    pending: o.pending && !o.dead && !blocked && !sem_waiting,
                });
        }
        for (i, v) in vms.iter().enumerate() {
            for (pid, busy) in &v.retired_busy {
                if *busy > 0 {
                    procs.entry((i, *pid)).or_default().1 += busy;
                }
            }
        }
        for ((vm, pid), (channels, retired_busy_ns)) in procs {
            if let Some(v) = out.get_mut(vm) {
                let weight = hints
                    .get(&v.name)
                    .and_then(|h| h.get(&pid))
                    .copied()
                    .unwrap_or(1);
                v.procs.push(ProcSample {
                    pid,
                    weight,
                    channels,
                    retired_busy_ns,
                });
            }
        }
        drop(hints);
        self.stalls.end_interval(full);
        out
    }

    pub(super) fn decide(
        &mut self,
        samples: &[VmSample],
        obs: &[Obs],
        vms: &[VmObs],
        idle: (u64, u64),
        full: bool,
    ) -> Decision {
        let threshold_ns = self.cfg.threshold_us.saturating_mul(1000);
        // Channels shadowed during the interval that just ended.
        let held = self.shadowed.clone();
        match self.cfg.policy {
            Policy::None => Decision::default(),
            Policy::Fair => self
                .fair
                .decide_with_idle(samples, threshold_ns, idle, &held, full),
            Policy::Timeslice => {
                let slice = u64::from(self.cfg.slice_ms) * 1_000_000;
                self.timeslice.decide(samples, now_ns(), slice)
            }
            Policy::Sampling => {
                // The fair clocks are charged even while a sample overrides them.
                let fair = self
                    .fair
                    .decide_with_idle(samples, threshold_ns, idle, &held, full);
                // Dead channels are never sampled (they would never finish a sample).
                let sobs: Vec<SampleObs> = obs
                    .iter()
                    .filter(|o| !o.dead)
                    .filter_map(|o| {
                        let p = o.peek?;
                        Some(SampleObs {
                            key: (vms.get(o.vm)?.name.clone(), o.ch),
                            hal: o.hal,
                            gp_get: p.gp_get,
                            in_flight: p.real_put != p.gp_get,
                            pending: p.pending(),
                        })
                    })
                    .collect();
                let over = self.sampler.tick(&sobs, now_ns(), &mut self.est);
                let st = self.sampler.stats;
                self.update_stats(|s| {
                    s.sample_rounds = st.rounds;
                    s.samples = st.samples;
                    s.samples_aborted = st.aborted;
                });
                match over {
                    Some(shadow) => Decision {
                        shadow,
                        ..Decision::default()
                    },
                    None => fair,
                }
            }
        }
    }
}
