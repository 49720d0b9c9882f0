//! What the VRAM manager needs of a VM, as a narrow handle ([`VramVm`]): its figures, its
//! coldest and hottest chunks, and moves. The VM's state owner ([`crate::vm`]) implements
//! it; the manager never sees a session.

use std::collections::BTreeSet;
use std::time::Duration;

use super::{MoveError, MoveReport, VramReport};

/// Chunks of one object: (object id, chunk indices).
pub type Batch = (u32, Vec<usize>);

/// Direction of a move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// VRAM → the VM's swap store.
    Out,
    /// Swap store → VRAM.
    In,
}

/// A VM's figures at the start of a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassFigures {
    /// Its VRAM quota.
    pub quota: u64,
    /// Bytes of its objects, resident or swapped, with the slack of its frames for small
    /// pieces ([`crate::vram::slabs`]).
    pub allocated: u64,
    /// Bytes of them in VRAM.
    pub resident: u64,
    /// Whether the VM has a swap limit: without one its VRAM is never moved out.
    pub swappable: bool,
}

/// What the VRAM manager asks of a VM.
pub trait VramVm: Send + Sync {
    fn name(&self) -> &str;
    /// Operator weight (shares follow it).
    fn weight(&self) -> u32;
    /// Whether a frontend is connected that can remap the VM's BAR (moves need one).
    fn movable(&self) -> bool;
    /// Starts a pass numbered `epoch`: chunk recency from the GPU's access counters, then
    /// the VM's figures.
    fn begin_pass(&self, epoch: u64) -> PassFigures;
    /// Records the VM's share computed by the pass (reported in its statistics).
    fn set_share(&self, bytes: u64);
    /// Its coldest resident chunks, up to `max` bytes of one object, skipping contexts in
    /// `skip`, with their last use.
    fn coldest_resident(&self, max: u64, skip: &BTreeSet<u32>) -> Option<(Batch, u64)>;
    /// Its hottest swapped chunks, likewise.
    fn hottest_swapped(&self, max: u64, skip: &BTreeSet<u32>) -> Option<(Batch, u64)>;
    /// Of chunks `idx` of object `mem`, those last used before `epoch`.
    fn colder_than(&self, mem: u32, idx: Vec<usize>, epoch: u64) -> Vec<usize>;
    /// The context object `mem` belongs to.
    fn object_context(&self, mem: u32) -> Option<u32>;
    /// Moves chunks `idx` of object `mem` (see `crate::vm::vram_move`).
    fn move_chunks(
        &self,
        mem: u32,
        idx: &[usize],
        dir: Dir,
        timeout: Duration,
    ) -> Result<MoveReport, MoveError>;
    /// Its VRAM figures and swap counters.
    fn report(&self) -> VramReport;
    /// Sets its VRAM quota (ALLOC_VRAM's limit with the swap limit).
    fn set_quota(&self, bytes: u64);
}
