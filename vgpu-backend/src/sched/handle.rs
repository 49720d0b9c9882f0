//! What the scheduler needs of a VM, as a narrow handle ([`SchedVm`]): read its channels
//! at a tick, apply the scheduler's holds, drop them all. The VM's state owner
//! ([`crate::vm`]) implements it; the scheduler never sees a session.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use vgpu_host_shim::{ActivityCounter, ChannelCounters, ChannelId, Gpu};

use crate::shadow::{ChannelPeek, Holders, ShadowError};

/// A destroyed channel's final busy time, for the scheduler's accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetiredChannel {
    pub pid: u32,
    pub hal: ChannelId,
    pub busy_ns: u64,
}

/// One live channel at a tick.
#[derive(Debug, Clone, Copy)]
pub struct ChannelView {
    /// Guest channel id.
    pub ch: u32,
    /// Owning guest PID.
    pub pid: u32,
    pub hal: ChannelId,
    pub counters: ChannelCounters,
    /// Its control pages; `None` when the slot is not mapped, the VM is paused, or the
    /// VM's session could not be locked.
    pub peek: Option<ChannelPeek>,
    /// Who holds it shadowed (empty when the session could not be locked).
    pub holders: Holders,
}

/// A VM at a tick.
#[derive(Debug, Clone, Default)]
pub struct VmView {
    pub channels: Vec<ChannelView>,
    /// Channels destroyed since the previous tick.
    pub retired: Vec<RetiredChannel>,
    /// Whether the session was locked in time (else `peek` and `holders` are unknown).
    pub locked: bool,
    /// Live channels left out because they were quiet (see [`SchedVm::observe`]).
    pub quiet: u32,
    /// Whether it has shadowed channels (whose progress `apply` mirrors) or failed
    /// unshadows to retry: `apply` has work even without changes.
    pub shadowing: bool,
    /// Its connections so far: the owner holds start anew with each one.
    pub connection: u64,
    /// Whether the GPU counts the work of every channel it had into
    /// [`SchedVm::activity`].
    pub counted: bool,
}

/// One change of the scheduler's hold on a channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldChange {
    /// Take the scheduler's hold (shadow).
    Hold,
    /// Drop it (unshadow unless someone else holds it).
    Release,
    /// Keep it, but let at most this many more entries run.
    ReleaseCapped(u32),
}

/// The scheduler's decision for one VM.
#[derive(Debug, Clone, Default)]
pub struct VmHolds {
    /// The whole VM is held back: channels born before the next tick start held.
    pub vm: bool,
    /// Guest processes held back (likewise).
    pub pids: BTreeSet<u32>,
    /// Changes to the scheduler's holds of channels.
    pub changes: Vec<(u32, HoldChange)>,
}

/// What the scheduler asks of a VM.
pub trait SchedVm: Send + Sync {
    fn name(&self) -> &str;
    /// Operator weight.
    fn weight(&self) -> u32;
    /// Whether a frontend is connected (only connected VMs are scheduled).
    fn connected(&self) -> bool;
    /// The VM's activity count: it moves whenever one of its channels fetches or
    /// completes work or stops, or a channel comes or goes or a hold on one changes (see
    /// [`vgpu_host_shim::ActivityCounter`]), as long as the GPU counts every channel's
    /// work ([`VmView::counted`]; otherwise only reading the channels tells). The same
    /// counter for the VM's lifetime.
    fn activity(&self) -> Arc<ActivityCounter>;
    /// Its live channels and the ones destroyed since the last call, waiting at most
    /// `wait` for the session. Unless `full`, channels that provably did nothing since the
    /// previous observation (unshadowed, unheld, GP_PUT = GP_GET where it was) are left
    /// out and only counted, so a tick costs what the active channels cost.
    fn observe(&self, gpu: &dyn Gpu, wait: Duration, full: bool) -> VmView;
    /// Applies `holds` (waiting at most `wait` for the session): the result of each
    /// change in order, then mirrors GPU progress into shadow pages and retries failed
    /// unshadows. `None`: the session could not be locked in time, nothing changed.
    fn apply(&self, holds: &VmHolds, wait: Duration) -> Option<Vec<Result<(), ShadowError>>>;
    /// Whether channel `ch` has work released to the GPU (`sampling`'s poll).
    fn backlogged(&self, ch: u32, wait: Duration) -> bool;
    /// Drops every hold of the scheduler (it stops); returns the channels unshadowed.
    fn release_scheduler(&self) -> u64;
}
