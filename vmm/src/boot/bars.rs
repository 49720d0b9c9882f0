//! What backs the vgpu function's BARs outside the MMIO-exit path, kept in step with where
//! the guest puts them: the shared-memory window as a KVM memslot at the shared-memory
//! BAR (so channel pages and apertures are plain memory to the guest, and a SHMEM_MAP is
//! seen at once), and one ioeventfd per queue doorbell in BAR0 (so a kick never exits to
//! userspace). Both follow [`BarEvent`]s: they go when the guest turns memory decoding
//! off (BAR sizing) and come back, possibly elsewhere, when it turns it on again.

use std::sync::{Arc, Mutex};

use crate::kvm::{IoEventAddress, NoDatamatch, SlotId, Vm};
use log::{debug, error, info, warn};
use vmm_sys_util::eventfd::EventFd;

use crate::pci::BarEvent;
use crate::shm_window::ShmWindow;
use crate::virtio_pci::{BAR0_INDEX, NOTIFY_MULTIPLIER, NOTIFY_OFFSET, SHM_BAR_INDEX};

#[derive(Debug, Default)]
struct Placed {
    /// Guest-physical address and number of the memslot, while there is one.
    shm: Option<(u64, SlotId)>,
    /// BAR0's address, while the doorbell ioeventfds are registered there.
    bar0: Option<u64>,
}

/// The BAR backing of one vgpu function (see the module documentation).
pub struct BarWiring {
    vm: Arc<Vm>,
    pci_slot: u8,
    window: Arc<ShmWindow>,
    kicks: Vec<Arc<EventFd>>,
    placed: Mutex<Placed>,
}

impl BarWiring {
    /// Backing for the function in `pci_slot`: `window` goes into a KVM memslot (the VM
    /// keeps the window alive while the slot exists), `kicks[q]` onto queue `q`'s
    /// doorbell. Nothing is registered until the BARs decode.
    pub fn new(
        vm: Arc<Vm>,
        pci_slot: u8,
        window: Arc<ShmWindow>,
        kicks: Vec<Arc<EventFd>>,
    ) -> Self {
        BarWiring {
            vm,
            pci_slot,
            window,
            kicks,
            placed: Mutex::new(Placed::default()),
        }
    }

    /// Where the memslot is now (for tests and logs).
    /// The shared-memory window behind BAR2.
    pub fn window(&self) -> &ShmWindow {
        &self.window
    }

    /// A guest store that reached userspace as an MMIO write inside the window (the KVM
    /// emulates stores to read-only pages): performed on the window, waiting while the
    /// backend holds the page read-only. Returns whether `gpa` was in the window.
    pub fn store_to_window(&self, gpa: u64, data: &[u8]) -> bool {
        let Some(base) = self.shm_gpa() else {
            return false;
        };
        let Some(off) = gpa.checked_sub(base).filter(|o| *o < self.window.len()) else {
            return false;
        };
        if let Err(e) = self.window.complete_store(off, data) {
            warn!("guest store at {gpa:#x} in the shared-memory window: {e}");
        }
        true
    }

    pub fn shm_gpa(&self) -> Option<u64> {
        self.lock().shm.map(|(gpa, _)| gpa)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Placed> {
        self.placed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Follows the BAR changes of a configuration write.
    pub fn apply(&self, events: &[BarEvent]) {
        let mut placed = self.lock();
        for ev in events.iter().filter(|e| e.slot == self.pci_slot) {
            match ev.bar {
                SHM_BAR_INDEX => self.move_window(&mut placed, ev.new.map(|(a, _)| a)),
                BAR0_INDEX => self.move_doorbells(&mut placed, ev.new.map(|(a, _)| a)),
                _ => {}
            }
        }
    }

    fn move_window(&self, placed: &mut Placed, to: Option<u64>) {
        if placed.shm.map(|(gpa, _)| gpa) == to {
            return;
        }
        if let Some((old, slot)) = placed.shm.take() {
            match self.vm.remove_memslot(slot) {
                Ok(_) => debug!("vgpu: shared-memory memslot removed from {old:#x}"),
                Err(e) => error!("vgpu: removing the shared-memory memslot: {e}"),
            }
        }
        if let Some(gpa) = to {
            match self.vm.add_shm_window(gpa, &self.window) {
                Ok(slot) => {
                    info!(
                        "vgpu: shared-memory window ({:#x} bytes) at GPA {gpa:#x}",
                        self.window.len()
                    );
                    placed.shm = Some((gpa, slot));
                }
                // The BAR then reads as zeros through MMIO exits: the device is unusable,
                // but the guest keeps running.
                Err(e) => error!("vgpu: mapping the shared-memory window at {gpa:#x}: {e}"),
            }
        }
    }

    fn doorbell(bar0: u64, q: usize) -> IoEventAddress {
        IoEventAddress::Mmio(bar0 + NOTIFY_OFFSET + q as u64 * u64::from(NOTIFY_MULTIPLIER))
    }

    fn move_doorbells(&self, placed: &mut Placed, to: Option<u64>) {
        if placed.bar0 == to {
            return;
        }
        if let Some(old) = placed.bar0.take() {
            for (q, k) in self.kicks.iter().enumerate() {
                if let Err(e) =
                    self.vm
                        .unregister_ioevent(k.as_ref(), Self::doorbell(old, q), NoDatamatch)
                {
                    error!("vgpu: unregistering the queue {q} doorbell: {e}");
                }
            }
        }
        if let Some(bar0) = to {
            let mut ok = true;
            for (q, k) in self.kicks.iter().enumerate() {
                // Any width: Linux writes the queue index as 16 bits.
                if let Err(e) =
                    self.vm
                        .register_ioevent(k.as_ref(), Self::doorbell(bar0, q), NoDatamatch)
                {
                    // The doorbell still works through the MMIO exit.
                    error!("vgpu: ioeventfd for the queue {q} doorbell: {e}");
                    ok = false;
                }
            }
            debug!(
                "vgpu: doorbells at {:#x} (ioeventfds: {ok})",
                bar0 + NOTIFY_OFFSET
            );
            placed.bar0 = Some(bar0);
        }
    }
}
