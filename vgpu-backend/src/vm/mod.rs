//! The one owner of a VM's state: `VmState` (what the backend keeps per served VM) with
//! its [`session::Session`] (every GPU object the guest created, behind one lock), and
//! every operation on them:
//! - [`session`]: the state — plain data keyed by guest-visible ids (`SessionState`, what
//!   migration serializes), this host's HAL handles (`HalHandles`), counters observers read
//!   without the lock (`SessionShared`), limits, teardown;
//! - [`requests`]: control-queue requests, by subject (contexts, memory, channels);
//! - `sched_handle`: the scheduler's narrow handle on a VM
//!   ([`crate::sched::handle::SchedVm`]);
//! - [`shadowing`]: the session's channels through the shadow mechanism
//!   ([`crate::shadow`], which knows nothing of sessions);
//! - [`vram_objects`], [`vram_recency`], [`vram_move`]: VRAM objects in chunks, what the
//!   VRAM manager ([`crate::vram`]) reads of them, and the pause dance that moves them;
//!   `vram_handle`: the manager's narrow handle ([`crate::vram::handle::VramVm`]).
//!
//! No other module has an `impl` block for these types.

pub mod control;
pub(crate) mod device_state;
pub mod migration;
mod pause;
pub mod requests;
mod sched_handle;
pub mod session;
pub mod shadowing;
mod vram_handle;
pub mod vram_move;
pub mod vram_objects;
pub mod vram_recency;

#[cfg(test)]
mod session_tests;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use vhost_user_backend::ShutdownHandle;

use crate::shmem::VhostShm;
use session::{Session, SessionShared, VmLimits};

/// One served VM.
pub(crate) struct VmState {
    pub(crate) name: String,
    pub(crate) socket: PathBuf,
    pub(crate) limits: VmLimits,
    pub(crate) gpu_vram: u64,
    /// The session's GPU, for doorbells rung without the session's lock.
    gpu: Arc<dyn vgpu_host_shim::Gpu>,
    pub(crate) shared: Arc<SessionShared>,
    pub(crate) session: Mutex<Session>,
    pub(crate) connected: AtomicBool,
    pub(crate) conn: Mutex<Option<ShutdownHandle>>,
    /// The connected frontend's BAR mapper (for shadow remaps requested by the operator).
    pub(crate) shm: Mutex<Option<Arc<VhostShm>>>,
    /// Operator weight for the scheduler ([`sched::MIN_WEIGHT`]..=[`sched::MAX_WEIGHT`]).
    pub(crate) weight: AtomicU32,
    /// Operator pause and VRAM quota ([`control`]).
    pub(crate) control: control::VmControl,
    /// The last migration's progress, and the pre-copy's tuning.
    pub(crate) progress: migration::progress::ProgressCell,
    pub(crate) precopy_cfg: Mutex<migration::progress::PrecopyConfig>,
}

impl VmState {
    /// A VM named `name` on `socket` (not listening yet) with a fresh session on `gpu`
    /// whose events go to `events` and which takes the GPU's contexts and channels
    /// through `capacity`.
    pub(crate) fn new(
        name: &str,
        socket: PathBuf,
        limits: VmLimits,
        gpu: Arc<dyn vgpu_host_shim::Gpu>,
        events: Arc<crate::EventQueue>,
        capacity: crate::capacity::VmCapacity,
    ) -> Self {
        let shared = Arc::new(SessionShared::new(events, limits.vram_bytes));
        VmState {
            name: name.to_string(),
            socket,
            limits,
            gpu_vram: gpu.info().vram_bytes,
            gpu: gpu.clone(),
            session: Mutex::new(Session::with_capacity(
                gpu,
                limits,
                shared.clone(),
                capacity,
            )),
            shared,
            connected: AtomicBool::new(false),
            conn: Mutex::new(None),
            shm: Mutex::new(None),
            weight: AtomicU32::new(crate::sched::DEFAULT_WEIGHT),
            control: control::VmControl::new(),
            progress: Default::default(),
            precopy_cfg: Default::default(),
        }
    }

    /// The guest rang the doorbell (a control-queue kick): its GPU's front end looks at
    /// the VM's channels now (protocol.md, "Doorbell"). Takes no session lock, so a ring
    /// never waits behind a long request.
    pub(crate) fn ring_doorbell(&self) {
        self.shared.ring_doorbell(self.gpu.as_ref());
    }

    pub(crate) fn lock_session(&self) -> MutexGuard<'_, Session> {
        self.session.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The session, waiting at most `wait` for its lock.
    pub(crate) fn lock_session_within(&self, wait: Duration) -> Option<MutexGuard<'_, Session>> {
        let deadline = std::time::Instant::now() + wait;
        loop {
            if let Some(g) = self.try_lock_session() {
                return Some(g);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// The session if nobody holds its lock now.
    pub(crate) fn try_lock_session(&self) -> Option<MutexGuard<'_, Session>> {
        match self.session.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Ends the frontend connection (the VM's socket then listens again).
    pub(crate) fn end_connection(&self) {
        if let Some(h) = self.conn.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            h.shutdown();
        }
    }

    /// VRAM the config space advertises: the VM's limit, at most the GPU's size.
    pub(crate) fn config_vram_bytes(&self) -> u64 {
        self.shared.vram_quota().min(self.gpu_vram)
    }
}
