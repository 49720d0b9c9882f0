//! Counters of the VRAM manager, per VM and per guest process, as plain structs for the
//! operator API.

use std::collections::{BTreeMap, VecDeque};

/// Pause samples kept per VM for percentiles.
const PAUSE_SAMPLES: usize = 4096;

/// One VM's VRAM figures and swap counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VmVramStats {
    /// Quota (`VmLimits::vram_bytes`) and the share the policy computed last.
    pub quota_bytes: u64,
    pub share_bytes: u64,
    /// Swap limit (`VmLimits::swap_bytes`).
    pub swap_limit_bytes: u64,
    pub resident_bytes: u64,
    pub swapped_bytes: u64,
    /// VRAM its resident objects take from others: `resident_bytes` plus the unused
    /// parts of its 2 MiB frames for pieces smaller than a chunk (charged to it).
    pub footprint_bytes: u64,
    /// Chunks moved out and back in.
    pub evictions: u64,
    pub swap_ins: u64,
    pub bytes_out: u64,
    pub bytes_in: u64,
    /// Chunks of new allocations placed straight into swap (VRAM was full).
    pub spilled_chunks: u64,
    /// Channel pauses for moves, their total and worst time.
    pub pauses: u64,
    pub pause_ns_total: u64,
    pub pause_ns_max: u64,
    /// Moves abandoned because the channels did not drain in time.
    pub drain_timeouts: u64,
    /// Moves abandoned on a HAL or frontend failure (the chunk stayed where it was).
    pub move_failures: u64,
}

/// One guest process's share of a VM's figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcVramStats {
    pub pid: u32,
    pub resident_bytes: u64,
    pub swapped_bytes: u64,
    pub evictions: u64,
    pub swap_ins: u64,
    pub bytes_out: u64,
    pub bytes_in: u64,
    /// Time this process's channels spent paused for moves.
    pub pause_ns: u64,
}

/// A VM's report: totals and per process (by PID).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VramReport {
    pub vm: VmVramStats,
    pub procs: Vec<ProcVramStats>,
    /// Pause time per move over the last 4096 pauses.
    pub pause_p50_ns: u64,
    pub pause_p99_ns: u64,
}

/// Backend-wide figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VramOverview {
    pub vram_bytes: u64,
    pub free_bytes: u64,
    /// Manager passes and moves (batches) done.
    pub passes: u64,
    pub batches: u64,
}

/// What one move (a batch of chunks of one context) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MoveReport {
    pub chunks: u32,
    pub bytes: u64,
    /// Channels paused; time from the first shadow to the last unshadow.
    pub channels_paused: u32,
    pub pause_ns: u64,
    /// Of the pause: waiting for the channels to drain, copying.
    pub drain_ns: u64,
    pub copy_ns: u64,
}

/// Counters kept in the session.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) vm: VmVramStats,
    pub(crate) procs: BTreeMap<u32, ProcVramStats>,
    pub(crate) pause_samples: VecDeque<u64>,
}

impl Counters {
    pub(crate) fn proc(&mut self, pid: u32) -> &mut ProcVramStats {
        self.procs.entry(pid).or_insert(ProcVramStats {
            pid,
            ..Default::default()
        })
    }

    pub(crate) fn record_move(&mut self, pid: u32, r: &MoveReport, out: bool) {
        let vm = &mut self.vm;
        if out {
            vm.evictions += u64::from(r.chunks);
            vm.bytes_out += r.bytes;
        } else {
            vm.swap_ins += u64::from(r.chunks);
            vm.bytes_in += r.bytes;
        }
        if r.channels_paused > 0 {
            vm.pauses += 1;
            vm.pause_ns_total += r.pause_ns;
            vm.pause_ns_max = vm.pause_ns_max.max(r.pause_ns);
            if self.pause_samples.len() == PAUSE_SAMPLES {
                self.pause_samples.pop_front();
            }
            self.pause_samples.push_back(r.pause_ns);
        }
        let p = self.proc(pid);
        if out {
            p.evictions += u64::from(r.chunks);
            p.bytes_out += r.bytes;
        } else {
            p.swap_ins += u64::from(r.chunks);
            p.bytes_in += r.bytes;
        }
        p.pause_ns += r.pause_ns;
    }
}

/// The `q`-quantile (0..=1) of `samples` (0 when empty).
pub fn quantile(samples: &[u64], q: f64) -> u64 {
    if samples.is_empty() {
        return 0;
    }
    let mut v = samples.to_vec();
    v.sort_unstable();
    let i = ((v.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
    v[i.min(v.len() - 1)]
}
