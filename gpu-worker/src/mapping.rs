//! A file range mapped `MAP_SHARED` into this process (guest RAM, the copy buffer, the
//! counters page), unmapped on drop.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::AtomicU64;

pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is shared memory owned by this object for its whole life; it is
// reached through raw pointers with bounds checks, and other processes writing it at the
// same time is the point of it (as with guest RAM in a VMM).
unsafe impl Send for Mapping {}
// SAFETY: see `Send`; no method hands out a mutable reference into it.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` from `offset`, writable or not.
    pub fn new(fd: BorrowedFd<'_>, offset: u64, len: u64, writable: bool) -> io::Result<Self> {
        let ulen = usize::try_from(len)
            .ok()
            .filter(|l| *l > 0)
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        let off = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh mapping (no address hint) of a file the caller holds open; the
        // result is checked against MAP_FAILED before use. A file shorter than the range
        // faults on access (SIGBUS), so callers check the size first (`file_len`).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                ulen,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                off,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len: ulen,
        })
    }

    pub(crate) fn len(&self) -> u64 {
        self.len as u64
    }

    /// A pointer to `len` bytes at `offset`, if they lie inside the mapping.
    pub fn ptr(&self, offset: u64, len: u64) -> Option<*mut u8> {
        if offset.checked_add(len)? > self.len as u64 {
            return None;
        }
        // SAFETY: `offset + len <= self.len`, so the result stays inside the mapping.
        Some(unsafe { self.ptr.add(offset as usize) })
    }

    /// The mapping as 64-bit words (it is page-aligned; a trailing partial word is left out).
    pub fn words(&self) -> &[AtomicU64] {
        // SAFETY: the mapping is page-aligned, lives as long as `self`, and is only ever
        // accessed through atomics by this view.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<AtomicU64>(), self.len / 8) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `new`, once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// The size of the file behind `fd`.
pub fn file_len(fd: BorrowedFd<'_>) -> io::Result<u64> {
    // SAFETY: stat is plain data, filled by fstat before it is read.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid out pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.st_size as u64)
}

/// A new memfd of `len` bytes (close-on-exec), named for `/proc/PID/fd`.
pub fn memfd(name: &str, len: u64) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let cname =
        std::ffi::CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `cname` is a valid NUL-terminated string; the flags are valid.
    let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh fd nothing else owns.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
    let l = libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: ftruncate on a memfd we own; no memory-safety preconditions.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), l) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// A sealed memfd holding `bytes`: once sealed, nobody (the backend included) can write,
/// grow or shrink it, so the worker reads exactly what the backend read from the guest.
pub fn sealed_memfd(name: &str, bytes: &[u8]) -> io::Result<std::os::fd::OwnedFd> {
    use std::io::Write;
    use std::os::fd::FromRawFd;
    let cname =
        std::ffi::CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `cname` is a valid NUL-terminated string; the flags are valid.
    let raw =
        unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh fd nothing else owns.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
    let mut file = std::fs::File::from(fd);
    // write(2) at the fresh file's start (what the backend's filters allow; not pwrite).
    file.write_all(bytes)?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a memfd we own; no memory-safety preconditions.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file.into())
}
