//! Operator controls of a VM that the control API ([`crate::api`]) exposes: pause, resume
//! and drain (through shadow channels), the VRAM quota, and a per-channel view.
//!
//! **Pause** holds every channel of the VM shadowed for the operator
//! ([`Holder::Operator`], one of the three holders of [`crate::shadow::holds`]), so the
//! guest's submissions stall in the shadow pages (the guest keeps running; only its GPU
//! work waits). While a VM is paused, the scheduler's unshadow only drops its own hold and
//! a capped release lets nothing through. Peeking at a paused VM's channels
//! ([`Session::peek_channel`], what the scheduler samples) fails, so the scheduler counts
//! the VM as idle — otherwise its held-back work would make it look underserved and the
//! scheduler would shadow every other VM in its favour. Channels the guest creates while
//! paused are born held, before the reply reaches it (channel creation in
//! [`crate::vm::requests`]). A pause outlives frontend reconnects. **Resume** drops the
//! operator's holds: channels that the scheduler or a VRAM move still hold stay shadowed.
//! **Drain** is pause plus waiting until the GPU completed everything already released to
//! it (each channel's real `GP_GET` reached its real `GP_PUT`, or the channel stopped on an
//! error).
//!
//! The **VRAM quota** goes through the VRAM manager ([`VgpuBackend::set_vram_quota`]): it
//! is the VM's `vram_bytes` limit, which `ALLOC_VRAM` checks (with the swap limit) for new
//! allocations; objects already allocated stay even when the quota drops below the VM's
//! usage. The config space and `GET_INFO` report the new value when next read (no
//! config-change interrupt is sent).
//!
//! [`Holder::Operator`]: crate::shadow::Holder::Operator
//! [`Session::peek_channel`]: crate::vm::session::Session::peek_channel

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use vgpu_protocol::ErrorCode;

use crate::shadow::ShadowError;
use crate::shmem::ShmMapper;
use crate::{VgpuBackend, VmState};

/// Smallest VRAM quota: one 4 KiB page.
pub const MIN_VRAM_QUOTA: u64 = 4096;
/// Largest VRAM quota (1 TiB, the VRAM manager's bound).
pub const MAX_VRAM_QUOTA: u64 = crate::vram::MAX_SWAP_STORE;

/// The one check of a VRAM quota, whoever sets it: one page to [`MAX_VRAM_QUOTA`], in
/// whole pages.
pub fn validate_vram_quota(bytes: u64) -> Result<u64, ControlError> {
    if (MIN_VRAM_QUOTA..=MAX_VRAM_QUOTA).contains(&bytes) && bytes.is_multiple_of(4096) {
        Ok(bytes)
    } else {
        Err(ControlError::InvalidQuota(bytes))
    }
}

/// Errors of the operator controls.
#[derive(Debug, Error)]
pub enum ControlError {
    #[error("no VM named {0:?}")]
    NoVm(String),
    #[error("VRAM quota {0} not in {MIN_VRAM_QUOTA}..={MAX_VRAM_QUOTA} or not a multiple of 4096")]
    InvalidQuota(u64),
    #[error("shadowing channel {channel}: {source}")]
    Shadow {
        channel: u32,
        #[source]
        source: ShadowError,
    },
    #[error("VRAM manager: {0}")]
    Vram(String),
    #[error("drain timed out after {waited_ms} ms with {pending} channel(s) still running")]
    DrainTimeout { waited_ms: u64, pending: u32 },
    #[error("VM {0:?} is being migrated: its pause ends with the migration")]
    Migrating(String),
}

/// Operator state of one VM outside its session (read without the session lock).
#[derive(Debug)]
pub(crate) struct VmControl {
    /// Mirrors the session's [`OwnerHolds::paused`](crate::shadow::OwnerHolds).
    pub(crate) paused: AtomicBool,
    /// A live migration holds the pause ([`crate::vm::migration`]).
    migrating: AtomicBool,
    /// This host saved the VM's state for the migration (it is the source).
    saved: AtomicBool,
}

impl VmControl {
    pub(crate) fn new() -> Self {
        VmControl {
            paused: AtomicBool::new(false),
            migrating: AtomicBool::new(false),
            saved: AtomicBool::new(false),
        }
    }

    pub(crate) fn set_saved(&self, on: bool) {
        self.saved.store(on, Ordering::Release);
    }

    /// Whether this host saved the VM's state; clears the mark.
    pub(crate) fn take_saved(&self) -> bool {
        self.saved.swap(false, Ordering::AcqRel)
    }

    pub(crate) fn set_paused(&self, on: bool) {
        self.paused.store(on, Ordering::Release);
    }

    pub(crate) fn migrating(&self) -> bool {
        self.migrating.load(Ordering::Acquire)
    }

    pub(crate) fn set_migrating(&self, on: bool) {
        self.migrating.store(on, Ordering::Release);
    }

    pub(crate) fn paused(&self) -> bool {
        self.paused.load(Ordering::Acquire)
    }
}

/// One channel of a VM as the operator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelInfo {
    /// Guest channel id.
    pub channel: u32,
    /// Owning guest PID.
    pub pid: u32,
    pub shadowed: bool,
    /// Entries submitted and not completed (released or held back); 0 when the slot is
    /// not mapped.
    pub backlog: u32,
    /// GPU busy time of the channel.
    pub busy_ns: u64,
    /// The error the channel stopped on, if any.
    pub error: Option<ErrorCode>,
}

/// What a pause or resume did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PauseOutcome {
    /// Channels of the VM.
    pub channels: u32,
    /// Channels remapped by this call.
    pub switched: u32,
}

/// What a drain did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainOutcome {
    pub pause: PauseOutcome,
    /// Time spent waiting for the GPU.
    pub waited_ns: u64,
}

impl VgpuBackend {
    fn control_vm(&self, name: &str) -> Result<Arc<VmState>, ControlError> {
        self.vm(name)
            .ok_or_else(|| ControlError::NoVm(name.to_string()))
    }

    /// The unix socket VM `name` is served on.
    pub fn vm_socket(&self, name: &str) -> Option<std::path::PathBuf> {
        self.vm(name).map(|vm| vm.socket.clone())
    }

    /// Whether VM `name` is paused.
    pub fn vm_paused(&self, name: &str) -> Option<bool> {
        self.vm(name).map(|vm| vm.control.paused())
    }

    /// Sets VM `name`'s VRAM quota (its `vram_bytes` limit) for new allocations.
    pub fn set_vm_vram_quota(&self, name: &str, bytes: u64) -> Result<(), ControlError> {
        validate_vram_quota(bytes)?;
        self.control_vm(name)?;
        // The VRAM manager sets the VM's one quota and rebalances.
        self.set_vram_quota(name, bytes)
            .map_err(|e| ControlError::Vram(e.to_string()))
    }

    /// Pauses VM `name`: shadows all its channels (see the module docs). Tries every
    /// channel; the VM is marked paused even if one fails (the error names it).
    pub fn pause_vm(&self, name: &str) -> Result<PauseOutcome, ControlError> {
        let vm = self.control_vm(name)?;
        let shm = vm.shm.lock().unwrap_or_else(|e| e.into_inner()).clone();
        vm.pause(shm.as_deref().map(|s| s as &dyn ShmMapper))
    }

    /// Resumes VM `name`: drops the operator's holds (channels nobody else holds are
    /// unshadowed). Refused while the VM is being migrated.
    pub fn resume_vm(&self, name: &str) -> Result<PauseOutcome, ControlError> {
        let vm = self.control_vm(name)?;
        if vm.control.migrating() {
            return Err(ControlError::Migrating(name.to_string()));
        }
        let shm = vm.shm.lock().unwrap_or_else(|e| e.into_inner()).clone();
        vm.resume(shm.as_deref().map(|s| s as &dyn ShmMapper))
    }

    /// Pauses VM `name` and waits (at most `timeout`) until the GPU completed all the work
    /// that had been released to it. On timeout the VM stays paused.
    pub fn drain_vm(&self, name: &str, timeout: Duration) -> Result<DrainOutcome, ControlError> {
        let vm = self.control_vm(name)?;
        let shm = vm.shm.lock().unwrap_or_else(|e| e.into_inner()).clone();
        vm.drain(shm.as_deref().map(|s| s as &dyn ShmMapper), timeout)
    }

    /// Copies GPU progress into the shadow pages of every paused VM, so guests see the
    /// work they released before the pause complete.
    pub fn mirror_paused(&self) {
        let vms: Vec<Arc<VmState>> = self.lock_vms().values().cloned().collect();
        for vm in vms.iter().filter(|vm| vm.control.paused()) {
            vm.lock_session().mirror_shadows();
        }
    }

    /// VM `name`'s channels with their state, by channel id.
    pub fn vm_channel_info(&self, name: &str) -> Option<Vec<ChannelInfo>> {
        let vm = self.vm(name)?;
        let mut session = vm.lock_session();
        let gpu = session.gpu.clone();
        let list = session.channel_list();
        let mut out = Vec::with_capacity(list.len());
        for (ch, pid) in list {
            let hch = session.hal.channels.get(&ch).copied();
            let backlog = session
                .peek_channel_any(ch)
                .map(|p| p.backlog())
                .unwrap_or(0);
            let (busy_ns, error) = match hch {
                Some(h) => (
                    gpu.channel_counters(h).map(|c| c.busy_ns).unwrap_or(0),
                    gpu.channel_error(h).ok().flatten().map(|(code, _)| code),
                ),
                None => (0, None),
            };
            out.push(ChannelInfo {
                channel: ch,
                pid,
                shadowed: session.is_shadowed(ch),
                backlog,
                busy_ns,
                error,
            });
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vram_quota_is_whole_pages_from_one_page_to_the_bound() {
        for ok in [MIN_VRAM_QUOTA, 1 << 20, MAX_VRAM_QUOTA] {
            assert_eq!(validate_vram_quota(ok).ok(), Some(ok));
        }
        for bad in [0, 4095, 4097, MAX_VRAM_QUOTA + 4096, u64::MAX] {
            assert!(matches!(
                validate_vram_quota(bad),
                Err(ControlError::InvalidQuota(b)) if b == bad
            ));
        }
    }
}
