//! The memfd that holds every channel's control page, one 4 KiB slot per channel.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use vgpu_protocol::{ControlPage, ErrorCode, PAGE_SIZE};

use crate::hal::{ChannelResume, FdRange};
use crate::shared_mem::{SharedMem, SharedMemError};

pub struct ControlPages {
    mem: SharedMem,
    free: Mutex<Vec<u32>>,
    /// A device writes these pages at their host addresses (registered host memory).
    device_mapped: AtomicBool,
}

impl ControlPages {
    pub fn new(slots: u32) -> Result<Self, SharedMemError> {
        let mem = SharedMem::new("vgpu-control-pages", slots as u64 * PAGE_SIZE)?;
        // Hand out low slots first.
        let free = Mutex::new((0..slots).rev().collect());
        Ok(ControlPages {
            mem,
            free,
            device_mapped: AtomicBool::new(false),
        })
    }

    fn lock_free(&self) -> std::sync::MutexGuard<'_, Vec<u32>> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every slot's host memory, to register with a device.
    pub fn host_range(&self) -> Option<(*mut u8, usize)> {
        let len = self.mem.len();
        self.mem.range_ptr(0, len).map(|p| (p, len as usize))
    }

    /// Records whether a device can write the pages at their host addresses.
    pub fn set_device_mapped(&self, on: bool) {
        self.device_mapped.store(on, Ordering::Release);
    }

    pub fn device_mapped(&self) -> bool {
        self.device_mapped.load(Ordering::Acquire)
    }

    /// The address at which a device writes `field` of `slot`, if the pages are
    /// registered with one.
    pub fn gpu_field_addr(&self, slot: u32, field: usize) -> Option<u64> {
        if !self.device_mapped() {
            return None;
        }
        self.word(slot, field).map(|w| w.as_ptr() as u64)
    }

    /// Takes a zeroed slot.
    pub fn take(&self) -> Option<u32> {
        let slot = self.lock_free().pop()?;
        self.mem.zero(slot as u64 * PAGE_SIZE, PAGE_SIZE);
        Some(slot)
    }

    pub fn give_back(&self, slot: u32) {
        self.lock_free().push(slot);
    }

    pub fn slots_in_use(&self) -> usize {
        (self.mem.len() / PAGE_SIZE) as usize - self.lock_free().len()
    }

    /// Every slot's page.
    pub fn whole(&self) -> FdRange {
        FdRange {
            fd: self.mem.fd(),
            offset: 0,
            len: self.mem.len(),
        }
    }

    pub fn fd_range(&self, slot: u32) -> FdRange {
        FdRange {
            fd: self.mem.fd(),
            offset: slot as u64 * PAGE_SIZE,
            len: PAGE_SIZE,
        }
    }

    fn word(&self, slot: u32, field: usize) -> Option<&AtomicU32> {
        self.mem.atomic_u32(slot as u64 * PAGE_SIZE + field as u64)
    }

    /// Loads a control-page field (Acquire: GP_PUT publishes the ring entry before it).
    pub fn load(&self, slot: u32, field: usize) -> u32 {
        self.word(slot, field)
            .map(|w| w.load(Ordering::Acquire))
            .unwrap_or(0)
    }

    /// Stores a control-page field (Release: results are visible before GP_GET/REF move).
    pub fn store(&self, slot: u32, field: usize, v: u32) {
        if let Some(w) = self.word(slot, field) {
            w.store(v, Ordering::Release);
        }
    }

    pub fn store_u64(&self, slot: u32, field: usize, v: u64) {
        if let Some(w) = self.mem.atomic_u64(slot as u64 * PAGE_SIZE + field as u64) {
            w.store(v, Ordering::Release);
        }
    }

    /// Stores `new` into a field that holds `current`; whether it did.
    pub fn compare_store(&self, slot: u32, field: usize, current: u32, new: u32) -> bool {
        self.word(slot, field).is_some_and(|w| {
            w.compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        })
    }

    pub fn bump(&self, slot: u32, field: usize) {
        if let Some(w) = self.word(slot, field) {
            w.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Shows a channel's error in its page (ERROR_INFO first: a reader that sees ERROR
    /// finds its info).
    pub fn show_error(&self, slot: u32, code: ErrorCode, info: u64) {
        self.store_u64(slot, ControlPage::ERROR_INFO, info);
        self.store(slot, ControlPage::ERROR, code.as_u32());
    }

    /// Writes the fields of a channel resumed at a saved position (live migration):
    /// GP_GET = GP_PUT = the saved GP_GET, REF, NOTIFY_SEQ and the saved error, if any.
    pub fn restore(&self, slot: u32, at: &ChannelResume) {
        self.store(slot, ControlPage::REF, at.reference);
        self.store(slot, ControlPage::NOTIFY_SEQ, at.notify_seq);
        self.store(slot, ControlPage::GP_GET, at.gp_get);
        self.store(slot, ControlPage::GP_PUT, at.gp_get);
        if let Some((code, info)) = at.error {
            self.show_error(slot, code, info);
        }
    }

    /// Writes the fields a fresh channel starts with.
    pub fn init(&self, slot: u32, gp_entries: u32) {
        self.store(slot, ControlPage::VERSION, vgpu_protocol::PROTOCOL_VERSION);
        self.store(slot, ControlPage::GP_ENTRIES, gp_entries);
    }
}

/// Atomic 64-bit counter helper used by channel accounting.
pub fn add(c: &AtomicU64, v: u64) {
    c.fetch_add(v, Ordering::Relaxed);
}
