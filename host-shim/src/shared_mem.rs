//! Shared memory regions backed by a memfd, so other processes (the VMM, a test's child
//! process) can map exactly what the GPU sees.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, AtomicU64};

use thiserror::Error;

#[derive(Debug, Error)]
pub enum SharedMemError {
    #[error("memfd_create({0}) failed: {1}")]
    Create(String, std::io::Error),
    #[error("ftruncate to {0} bytes failed: {1}")]
    Truncate(u64, std::io::Error),
    #[error("mmap of {0} bytes failed: {1}")]
    Map(u64, std::io::Error),
    #[error("bad region name")]
    Name,
    #[error("sealing the region's size failed: {0}")]
    Seal(std::io::Error),
}

/// A memfd of fixed size mapped `MAP_SHARED` into this process. Pages are committed
/// lazily by the kernel on first touch, so a large VRAM costs nothing until used.
pub struct SharedMem {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this object for its whole life;
// all access goes through raw pointers with explicit bounds checks, and concurrent access
// by GPU engines, the host and guests is the point of the region (like guest RAM in a VMM).
unsafe impl Send for SharedMem {}
// SAFETY: see `Send`; no method hands out references that alias mutably.
unsafe impl Sync for SharedMem {}

impl SharedMem {
    pub fn new(name: &str, len: u64) -> Result<Self, SharedMemError> {
        Self::create(name, len, false)
    }

    /// A region whose size nobody can change once made (sealed against shrinking and
    /// growing): for a region shared with a less trusted process, which could otherwise
    /// truncate it and make this process's next access fault (SIGBUS).
    pub fn new_sealed(name: &str, len: u64) -> Result<Self, SharedMemError> {
        Self::create(name, len, true)
    }

    fn create(name: &str, len: u64, sealed: bool) -> Result<Self, SharedMemError> {
        let cname = CString::new(name).map_err(|_| SharedMemError::Name)?;
        let flags = if sealed {
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING
        } else {
            libc::MFD_CLOEXEC
        };
        // SAFETY: `cname` is a valid NUL-terminated string; the flags are valid.
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
        if raw < 0 {
            return Err(SharedMemError::Create(
                name.to_string(),
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: `raw` is a freshly created fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: `fd` is a valid memfd; ftruncate has no memory-safety preconditions.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(SharedMemError::Truncate(
                len,
                std::io::Error::last_os_error(),
            ));
        }
        if sealed {
            let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
            // SAFETY: fcntl on a memfd we own; it changes no memory.
            if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
                return Err(SharedMemError::Seal(std::io::Error::last_os_error()));
            }
        }
        Self::map(fd, len)
    }

    /// Maps the whole of a memfd that another process made (at least `len` bytes; a
    /// longer file maps only `len`). The caller must trust the file not to shrink, or
    /// check that it is sealed against it.
    pub fn from_fd(fd: OwnedFd, len: u64) -> Result<Self, SharedMemError> {
        // SAFETY: fstat into a zeroed struct of the right type on an fd we own.
        let size = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
                return Err(SharedMemError::Map(len, std::io::Error::last_os_error()));
            }
            st.st_size
        };
        if u64::try_from(size).unwrap_or(0) < len {
            return Err(SharedMemError::Map(
                len,
                std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
            ));
        }
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: u64) -> Result<Self, SharedMemError> {
        let ulen = usize::try_from(len).map_err(|_| {
            SharedMemError::Map(len, std::io::Error::from(std::io::ErrorKind::InvalidInput))
        })?;
        // SAFETY: mapping a fresh region (no address hint) of a file we own; the result is
        // checked against MAP_FAILED before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                ulen.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(SharedMemError::Map(len, std::io::Error::last_os_error()));
        }
        Ok(SharedMem {
            fd,
            ptr: ptr.cast(),
            len: ulen,
        })
    }

    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub fn len(&self) -> u64 {
        self.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Pointer to `len` bytes at `offset`, if the range lies inside the region.
    pub fn range_ptr(&self, offset: u64, len: u64) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        if end > self.len as u64 {
            return None;
        }
        // SAFETY: `offset + len <= self.len`, so the result stays inside the mapping.
        Some(unsafe { self.ptr.add(offset as usize) })
    }

    /// Copies out of the region; false if the range is out of bounds.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> bool {
        match self.range_ptr(offset, buf.len() as u64) {
            Some(p) => {
                // SAFETY: `p..p+buf.len()` is inside the mapping (checked above) and cannot
                // overlap `buf`, which is ordinary process memory.
                unsafe { std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), buf.len()) };
                true
            }
            None => false,
        }
    }

    /// Copies into the region; false if the range is out of bounds.
    pub fn write(&self, offset: u64, buf: &[u8]) -> bool {
        match self.range_ptr(offset, buf.len() as u64) {
            Some(p) => {
                // SAFETY: as in `read`, with the direction reversed.
                unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), p, buf.len()) };
                true
            }
            None => false,
        }
    }

    /// Zeroes a range; false if out of bounds.
    pub fn zero(&self, offset: u64, len: u64) -> bool {
        match self.range_ptr(offset, len) {
            Some(p) => {
                // SAFETY: the range is inside the mapping (checked by `range_ptr`).
                unsafe { std::ptr::write_bytes(p, 0, len as usize) };
                true
            }
            None => false,
        }
    }

    /// Zeroes a range by returning its pages to the kernel (they read as zero and cost no
    /// memory until written again); falls back to writing zeros where that fails.
    pub fn discard(&self, offset: u64, len: u64) -> bool {
        if self.range_ptr(offset, len).is_none() {
            return false;
        }
        let (Ok(off), Ok(n)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
            return self.zero(offset, len);
        };
        // SAFETY: fallocate on our own memfd inside its size; it changes no mapping, only
        // the pages' contents (to zero), which any sharer may see at any time.
        let r = unsafe {
            libc::fallocate(
                self.fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off,
                n,
            )
        };
        // A hole punch leaves partial pages' bytes zeroed too, so only failure needs more.
        r == 0 || self.zero(offset, len)
    }

    /// The 32-bit word at `offset` as an atomic, for fields shared with other agents.
    pub fn atomic_u32(&self, offset: u64) -> Option<&AtomicU32> {
        if !offset.is_multiple_of(4) {
            return None;
        }
        let p = self.range_ptr(offset, 4)?;
        // SAFETY: in bounds and 4-byte aligned (the mapping is page aligned); AtomicU32 has
        // the layout of u32, and the memory lives as long as `self`, which bounds the borrow.
        Some(unsafe { &*(p as *const AtomicU32) })
    }

    /// The 64-bit word at `offset` as an atomic.
    pub fn atomic_u64(&self, offset: u64) -> Option<&AtomicU64> {
        if !offset.is_multiple_of(8) {
            return None;
        }
        let p = self.range_ptr(offset, 8)?;
        // SAFETY: as in `atomic_u32`, with 8-byte alignment checked.
        Some(unsafe { &*(p as *const AtomicU64) })
    }
}

impl Drop for SharedMem {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe the mapping made in `new`, unmapped exactly once here.
        unsafe { libc::munmap(self.ptr.cast(), self.len.max(1)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_checked() {
        let m = SharedMem::new("t", 8192).unwrap();
        assert!(m.write(8188, &[1, 2, 3, 4]));
        assert!(!m.write(8189, &[1, 2, 3, 4]));
        assert!(!m.write(u64::MAX, &[1]));
        let mut b = [0u8; 4];
        assert!(m.read(8188, &mut b));
        assert_eq!(b, [1, 2, 3, 4]);
        assert!(m.atomic_u32(2).is_none());
        assert!(m.atomic_u32(8192).is_none());
        assert!(m.atomic_u64(8184).is_some());
    }
}
