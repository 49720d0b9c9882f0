//! Recording an interval: the shares history the API reads, and the per-interval trace
//! line (`RUST_LOG=vgpu_backend::sched=trace`).

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;

use log::trace;

use super::*;
use crate::sched::fair::{ChannelSample, Decision, FairState, VmSample};
use crate::sched::shares::{ChannelBusy, IntervalRecord, ProcBusy, VmBusy};

impl Sched {
    /// Records who used the GPU in the interval; `held`: the channels the scheduler held
    /// shadowed during it.
    pub(super) fn record(
        &self,
        vms: &[VmObs],
        samples: &[VmSample],
        held: &BTreeSet<(String, u32)>,
        len_ns: u64,
    ) {
        let held_back = |vm: &str, c: &ChannelSample| {
            c.pending && !held.is_empty() && held.contains(&(vm.to_string(), c.ch))
        };
        let seq = self.shared.seq.fetch_add(1, Ordering::Relaxed);
        let rec = IntervalRecord {
            seq,
            end_ns: self.last_tick_ns,
            len_ns,
            estimated: !self.use_counters,
            vms: samples
                .iter()
                .zip(vms)
                .filter(|(s, _)| !s.procs.is_empty())
                .map(|(s, _)| {
                    let procs: Vec<ProcBusy> = s
                        .procs
                        .iter()
                        .map(|p| ProcBusy {
                            pid: p.pid,
                            weight: p.weight,
                            held: p.channels.iter().any(|c| held_back(&s.name, c)),
                            busy_ns: p
                                .channels
                                .iter()
                                .map(|c| c.busy_delta_ns)
                                .sum::<u64>()
                                .saturating_add(p.retired_busy_ns),
                            channels: p
                                .channels
                                .iter()
                                .map(|c| ChannelBusy {
                                    channel: c.ch,
                                    busy_ns: c.busy_delta_ns,
                                })
                                .collect(),
                        })
                        .collect();
                    VmBusy {
                        held: procs.iter().any(|p| p.held),
                        name: s.name.clone(),
                        weight: s.weight,
                        busy_ns: procs.iter().map(|p| p.busy_ns).sum(),
                        procs,
                    }
                })
                .collect(),
        };
        lock(&self.shared.history).push(rec);
    }
}

/// One line per interval at `trace`: each VM's GPU time, held channels, pending
/// channels, whether it is over its share now and its clock, to follow the policy's
/// decisions through a run (`RUST_LOG=vgpu_backend::sched=trace`).
pub(super) fn trace_interval(
    samples: &[VmSample],
    held: &BTreeSet<(String, u32)>,
    decision: &Decision,
    (idle_ns, len_ns): (u64, u64),
    fair: &FairState,
) {
    let ms = |ns: u64| ns as f64 / 1e6;
    let mut line = format!("interval {:.2} ms, idle {:.2} ms:", ms(len_ns), ms(idle_ns));
    for v in samples.iter().filter(|v| !v.procs.is_empty()) {
        let chans = || v.procs.iter().flat_map(|p| &p.channels);
        let busy = chans().map(|c| c.busy_delta_ns).sum::<u64>()
            + v.procs.iter().map(|p| p.retired_busy_ns).sum::<u64>();
        let span = (v.name.clone(), 0)..=(v.name.clone(), u32::MAX);
        line.push_str(&format!(
            " {} busy {:.2} held {} pending {} {} clock {:.1};",
            v.name,
            ms(busy),
            held.range(span).count(),
            chans().filter(|c| c.pending).count(),
            if decision.over_vms.contains(&v.name) {
                "OVER"
            } else {
                "ok"
            },
            fair.vm_clock_ms(&v.name).unwrap_or(0.0),
        ));
    }
    trace!("{line}");
}
