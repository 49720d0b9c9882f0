//! Live migration of a VM's GPU state (the backend's part of issue 14, first slice).
//!
//! - **Pause** (`crate::vm::pause`): the migration pause *is* the operator's pause —
//!   every channel held shadowed by [`crate::shadow::Holder::Operator`], new channels
//!   born held, the scheduler treating the VM as idle — plus a drain (bounded) until the
//!   engines finished what they had fetched. While it lasts the operator cannot resume
//!   the VM ([`crate::control::ControlError::Migrating`]).
//! - **Pre-copy** (`chunks`, `vm_state`): before the pause, rounds of VRAM chunks
//!   written since they were sent (the GPU's write record, moves, aperture windows in the
//!   last round), so that the pause copies only what changed (`progress`: the view).
//! - **Save** ([`save`]): the paused session as a
//!   [`DeviceState`](vgpu_protocol::migration::DeviceState): contexts, VRAM objects with
//!   their contents (resident or swapped), GPU mappings, aperture windows, channels with
//!   GP_GET, the guest's GP_PUT (its shadow page), REF, NOTIFY_SEQ and error, pending
//!   events, the VM's weight and VRAM quota (informational) and last ids.
//! - **Load** ([`load`]): into an empty session on the destination, by the same code as
//!   the guest's requests (so every field is validated as a request's would be) with ids,
//!   BAR slots and aperture offsets forced to the saved ones, and channels re-created at
//!   their saved position ([`vgpu_host_shim::Gpu::create_channel_resumed`]), shadowed,
//!   with the guest's GP_PUT in the shadow page. Any failure tears the session down
//!   again: the destination is left clean. The VM keeps this host's operator policy
//!   ([`policy`]): the stream's weight and quota are reported, never applied.
//! - **Tail**: if the guest kept storing into the source's shadow pages after the save
//!   (a frontend that cannot stop its vCPUs, like the loopback VM), a second save on the
//!   source — after the destination mapped its pages over the BAR, so those pages are
//!   final — carries each channel's last GP_PUT, which the destination raises into its
//!   shadow pages with the same compare-and-swap as every reconcile.
//! - **Resume**: when the frontend starts the rings again (the first control-queue kick
//!   after a load on the destination, or after a save on the source when the migration
//!   failed; taken while the ring is ready, under a ticket that the ring's stop waits
//!   for), the pause is dropped and the channels unshadow through the normal path.

pub(crate) mod chunks;
pub mod load;
mod modules;
pub mod policy;
pub(crate) mod progress;
pub mod save;
mod vm_state;

pub use vm_state::DRAIN_TIMEOUT;

use thiserror::Error;
use vgpu_protocol::migration::StateError;
use vgpu_protocol::ErrorCode;

use crate::control::ControlError;

/// Errors of saving or loading a VM's device state.
#[derive(Debug, Error)]
pub enum MigrationError {
    #[error("pausing the VM: {0}")]
    Pause(#[from] ControlError),
    #[error("the VM has GPU objects already: state loads only into a fresh session")]
    NotEmpty,
    #[error("the VM is not paused for migration")]
    NotPaused,
    #[error("device state: {0}")]
    Format(#[from] StateError),
    #[error("restoring {what} {id}: {code}")]
    Restore {
        what: &'static str,
        id: u64,
        code: ErrorCode,
    },
    #[error("reading GPU state of {what} {id}: {detail}")]
    Read {
        what: &'static str,
        id: u64,
        detail: String,
    },
    #[error("device-state fd: {0}")]
    Io(#[from] std::io::Error),
    #[error("no device-state transfer was started")]
    NoTransfer,
    #[error("the transfer thread panicked")]
    Panicked,
    #[error("pre-copy stream: {0}")]
    Unexpected(&'static str),
    /// A guest module whose variables cannot be listed (docs/design/guest-modules.md):
    /// the VM stays where it is, running.
    #[error("guest module {module}: {why}: its variables could not be carried")]
    ModuleVariables {
        module: u32,
        why: vgpu_protocol::module_image::ImageError,
    },
}
