//! The VRAM manager's narrow handle on a VM ([`VramVm`]).

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::vm::vram_move::move_chunks_unlocked;
use crate::vm::VmState;
use crate::vram::handle::{Batch, Dir, PassFigures, VramVm};
use crate::vram::{MoveError, MoveReport, VramReport};

impl VramVm for VmState {
    fn name(&self) -> &str {
        &self.name
    }

    fn weight(&self) -> u32 {
        self.weight.load(Ordering::Relaxed)
    }

    fn movable(&self) -> bool {
        self.connected.load(Ordering::Acquire)
            && self.shm.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    fn begin_pass(&self, epoch: u64) -> PassFigures {
        let mut s = self.lock_session();
        s.refresh_recency(epoch);
        let (allocated, resident) = s.vram_figures();
        PassFigures {
            quota: s.shared.vram_quota(),
            allocated,
            resident,
            swappable: s.limits.swap_bytes > 0,
        }
    }

    fn set_share(&self, bytes: u64) {
        self.lock_session().swap.counters.vm.share_bytes = bytes;
    }

    fn coldest_resident(&self, max: u64, skip: &BTreeSet<u32>) -> Option<(Batch, u64)> {
        self.lock_session().coldest_resident(max, skip)
    }

    fn hottest_swapped(&self, max: u64, skip: &BTreeSet<u32>) -> Option<(Batch, u64)> {
        self.lock_session().hottest_swapped(max, skip)
    }

    fn colder_than(&self, mem: u32, idx: Vec<usize>, epoch: u64) -> Vec<usize> {
        let s = self.lock_session();
        let Some(b) = s.hal.vram.get(&mem) else {
            return Vec::new();
        };
        idx.into_iter()
            .filter(|&i| b.chunks.get(i).is_some_and(|c| c.last_used < epoch))
            .collect()
    }

    fn object_context(&self, mem: u32) -> Option<u32> {
        self.lock_session().state.mems.get(&mem).map(|m| m.ctx)
    }

    fn move_chunks(
        &self,
        mem: u32,
        idx: &[usize],
        dir: Dir,
        timeout: Duration,
    ) -> Result<MoveReport, MoveError> {
        let shm = self
            .shm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or(MoveError::Disconnected)?;
        move_chunks_unlocked(self, mem, idx, dir, shm.as_ref(), timeout)
    }

    fn report(&self) -> VramReport {
        self.lock_session().vram_report()
    }

    fn set_quota(&self, bytes: u64) {
        self.shared.set_vram_quota(bytes);
    }
}
