//! A session's VRAM as the manager sees it: chunk recency from the MMU's access
//! counters, resident and allocated figures, the coldest resident and hottest swapped
//! batches, and the per-VM report.

use std::collections::BTreeSet;

use crate::vm::session::Session;
use crate::vram::backing::{Loc, CHUNK};
use crate::vram::handle::Batch;
use crate::vram::{stats, ProcVramStats, VramReport};

impl Session {
    /// Updates chunk recency from the MMU's access counters (read and reset).
    pub(crate) fn refresh_recency(&mut self, epoch: u64) {
        self.swap.epoch = epoch;
        let maps: Vec<(u32, u64, u32, u64)> = self
            .state
            .mappings
            .iter()
            .filter_map(|((ctx, va), m)| match m.target {
                crate::vm::session::MappingTarget::Vram { mem } => Some((*ctx, *va, mem, m.size)),
                _ => None,
            })
            .collect();
        for (ctx, va, mem, size) in maps {
            let Some((hctx, _)) = self.hal.contexts.get(&ctx) else {
                continue;
            };
            let Ok(counts) = self.gpu.access_counts(*hctx, va, size, true) else {
                continue;
            };
            let Some(b) = self.hal.vram.get_mut(&mem) else {
                continue;
            };
            for (page_va, n) in counts {
                if n == 0 {
                    continue;
                }
                let i = ((page_va - va) / CHUNK) as usize;
                if let Some(c) = b.chunks.get_mut(i) {
                    c.last_used = epoch;
                }
            }
        }
    }

    /// (allocated, resident) bytes of the VM's VRAM objects, each with the slack of its
    /// frames for small pieces: the VRAM manager shares what VMs take from each other.
    pub(crate) fn vram_figures(&self) -> (u64, u64) {
        let resident: u64 = self.hal.vram.values().map(|b| b.resident_bytes()).sum();
        let slack = self.vram_slack();
        (
            self.state.usage.vram_bytes.saturating_add(slack),
            resident.saturating_add(slack),
        )
    }

    /// The coldest resident chunks: the object of the coldest chunk, its resident chunks
    /// coldest first, up to `max` bytes. Objects in `skip_ctx` are left alone.
    pub(crate) fn coldest_resident(
        &self,
        max: u64,
        skip_ctx: &BTreeSet<u32>,
    ) -> Option<(Batch, u64)> {
        self.pick(max, skip_ctx, true)
    }

    /// The hottest swapped chunks, likewise.
    pub(crate) fn hottest_swapped(
        &self,
        max: u64,
        skip_ctx: &BTreeSet<u32>,
    ) -> Option<(Batch, u64)> {
        self.pick(max, skip_ctx, false)
    }

    /// Returns the batch and the recency of its first chunk.
    pub(crate) fn pick(
        &self,
        max: u64,
        skip_ctx: &BTreeSet<u32>,
        resident: bool,
    ) -> Option<(Batch, u64)> {
        let want = |l: &Loc| matches!(l, Loc::Vram(_)) == resident;
        let mut best: Option<(u32, u64)> = None;
        for (mem, b) in &self.hal.vram {
            let Some(m) = self.state.mems.get(mem) else {
                continue;
            };
            if skip_ctx.contains(&m.ctx) {
                continue;
            }
            for c in b.chunks.iter().filter(|c| want(&c.loc)) {
                let better = match best {
                    None => true,
                    Some((_, t)) if resident => c.last_used < t,
                    Some((_, t)) => c.last_used > t,
                };
                if better {
                    best = Some((*mem, c.last_used));
                }
            }
        }
        let (mem, t) = best?;
        let b = self.hal.vram.get(&mem)?;
        let mut idx: Vec<usize> = (0..b.chunks.len())
            .filter(|&i| want(&b.chunks[i].loc))
            .collect();
        if resident {
            idx.sort_by_key(|&i| b.chunks[i].last_used);
        } else {
            idx.sort_by_key(|&i| std::cmp::Reverse(b.chunks[i].last_used));
        }
        let mut bytes = 0;
        let mut out = Vec::new();
        for i in idx {
            if bytes >= max {
                break;
            }
            bytes += b.chunks[i].len;
            out.push(i);
        }
        Some(((mem, out), t))
    }

    /// Per-process resident and swapped bytes merged into the counters.
    pub(crate) fn vram_report(&self) -> VramReport {
        let c = &self.swap.counters;
        let mut procs = c.procs.clone();
        for (p, st) in procs.iter_mut() {
            st.pid = *p;
            st.resident_bytes = 0;
            st.swapped_bytes = 0;
        }
        let (mut res, mut swp) = (0, 0);
        for (mem, b) in &self.hal.vram {
            let Some(m) = self.state.mems.get(mem) else {
                continue;
            };
            let p = procs.entry(m.pid).or_insert(ProcVramStats {
                pid: m.pid,
                ..Default::default()
            });
            p.resident_bytes += b.resident_bytes();
            p.swapped_bytes += b.swapped_bytes();
            res += b.resident_bytes();
            swp += b.swapped_bytes();
        }
        let mut vm = c.vm;
        vm.quota_bytes = self.shared.vram_quota();
        vm.swap_limit_bytes = self.limits.swap_bytes;
        vm.resident_bytes = res;
        vm.swapped_bytes = swp;
        vm.footprint_bytes = res.saturating_add(self.vram_slack());
        let samples: Vec<u64> = c.pause_samples.iter().copied().collect();
        VramReport {
            vm,
            procs: procs.into_values().collect(),
            pause_p50_ns: stats::quantile(&samples, 0.5),
            pause_p99_ns: stats::quantile(&samples, 0.99),
        }
    }
}
