//! The backend's side of the GPU turn ([`vgpu_host_shim::gpu_turn`]): one page for all of
//! a backend's workers, a slot in it for each running worker, cleared the moment the
//! worker is lost (a dead holder or waiter must not hold the others up) and given to a
//! later worker once the lost one is gone.

use std::collections::BTreeSet;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};

use vgpu_host_shim::gpu_turn::{GpuTurnPage, TURN_SLOTS};
use vgpu_host_shim::shared_mem::SharedMemError;

/// The page and its free slots.
pub struct TurnSlots {
    page: GpuTurnPage,
    free: Mutex<BTreeSet<u32>>,
    quantum_us: u64,
}

impl std::fmt::Debug for TurnSlots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnSlots")
            .field("quantum_us", &self.quantum_us)
            .finish()
    }
}

/// A worker's slot; cleared and freed when dropped.
pub struct TurnLease {
    slots: Arc<TurnSlots>,
    slot: u32,
}

impl TurnSlots {
    /// A turn whose holders give way to waiters after `quantum_us`.
    pub fn new(quantum_us: u64) -> Result<Arc<Self>, SharedMemError> {
        Ok(Arc::new(TurnSlots {
            page: GpuTurnPage::new()?,
            free: Mutex::new((0..TURN_SLOTS).collect()),
            quantum_us,
        }))
    }

    pub fn quantum_us(&self) -> u64 {
        self.quantum_us
    }

    /// Times any worker took the turn.
    pub fn takes(&self) -> u32 {
        self.page.takes()
    }

    /// A free slot, if any (`None`: more workers than slots; that one runs without the
    /// turn, time-sliced by the GPU).
    pub fn lease(self: &Arc<Self>) -> Option<TurnLease> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let slot = free.pop_first()?;
        Some(TurnLease {
            slots: self.clone(),
            slot,
        })
    }
}

impl TurnLease {
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The page's fd, for the worker to map.
    pub fn fd(&self) -> RawFd {
        self.slots.page.fd()
    }

    pub fn quantum_us(&self) -> u64 {
        self.slots.quantum_us
    }

    /// The worker is gone: it neither holds nor waits for the turn any more.
    pub fn clear(&self) {
        self.slots.page.clear_slot(self.slot);
    }
}

impl Drop for TurnLease {
    fn drop(&mut self) {
        self.clear();
        self.slots
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(self.slot);
    }
}
