//! The backend's own mapping of a channel's control page (used only by SUBMIT, the
//! API-remoting baseline; guests store GP_PUT themselves through their BAR).

use std::sync::atomic::{AtomicU32, Ordering};

use vgpu_host_shim::FdRange;

/// A shared read/write mapping of one control page, unmapped on drop.
#[derive(Debug)]
pub struct ControlMap {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this object; it is only accessed
// through atomics, so moving or sharing the pointer between threads is sound.
unsafe impl Send for ControlMap {}
// SAFETY: see Send.
unsafe impl Sync for ControlMap {}

impl ControlMap {
    pub fn new(page: FdRange) -> std::io::Result<Self> {
        let len = usize::try_from(page.len).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        let off =
            libc::off_t::try_from(page.offset).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        if len < vgpu_protocol::ControlPage::USED_BYTES {
            return Err(std::io::ErrorKind::InvalidInput.into());
        }
        // SAFETY: a fresh shared mapping of a page of the GPU's control-page memfd; the
        // result is checked for MAP_FAILED before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                page.fd,
                off,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(ControlMap {
            ptr: ptr.cast(),
            len,
        })
    }

    /// Stores a control-page field with release ordering, as a guest's store would be.
    pub fn store(&self, field: usize, v: u32) {
        if !field.is_multiple_of(4) || field + 4 > self.len {
            return;
        }
        // SAFETY: `field` is 4-aligned and inside the mapping (checked above); the page
        // is page-aligned, so the word is naturally aligned for an AtomicU32.
        let word = unsafe { &*(self.ptr.add(field) as *const AtomicU32) };
        word.store(v, Ordering::Release);
    }
}

impl Drop for ControlMap {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `new`, once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}
