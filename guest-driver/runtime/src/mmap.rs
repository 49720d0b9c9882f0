//! A minimal RAII wrapper around `mmap`/`munmap`, so no mapping outlives its owner.

use std::os::fd::RawFd;
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// The host's base page size; every mapping is a multiple of it.
pub const HOST_PAGE: usize = 4096;

/// One private mapping owned by this value; unmapped on drop.
#[derive(Debug)]
pub struct Mmap {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned exclusively by this value; it carries no
// thread affinity. Access goes through raw pointers whose users synchronise explicitly.
unsafe impl Send for Mmap {}
// SAFETY: `Mmap` itself never reads or writes the memory; it only hands out its address.
unsafe impl Sync for Mmap {}

impl Mmap {
    /// Maps `len` bytes of zeroed anonymous memory whose start is aligned to `align`
    /// (a power of two, at least the host page). Over-maps and trims the slack.
    pub fn anonymous(len: usize, align: usize) -> Result<Self> {
        if len == 0 || !align.is_power_of_two() || align < HOST_PAGE {
            return Err(Error::InvalidArgument(
                "anonymous mapping size or alignment",
            ));
        }
        let len = round_up(len, HOST_PAGE).ok_or(Error::InvalidArgument("mapping too large"))?;
        let slack = align - HOST_PAGE;
        let total = len
            .checked_add(slack)
            .ok_or(Error::InvalidArgument("mapping too large"))?;
        // SAFETY: a fresh anonymous mapping with no address hint cannot alias anything;
        // the result is checked against MAP_FAILED before use.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(Error::os("mmap(anonymous)"));
        }
        let base = raw as usize;
        let start = (base + align - 1) & !(align - 1);
        let head = start - base;
        let tail = total - head - len;
        // SAFETY: `base..start` and `start+len..base+total` lie inside the mapping just
        // created and nothing refers to them; unmapping them trims the slack.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
        }
        Ok(Mmap {
            ptr: NonNull::new(start as *mut u8).ok_or(Error::InvalidArgument("null mapping"))?,
            len,
        })
    }

    /// Maps `len` bytes of `fd` at `offset` shared and read/write (what the GPU sees).
    pub fn shared(fd: RawFd, offset: u64, len: usize) -> Result<Self> {
        if len == 0 || offset & (HOST_PAGE as u64 - 1) != 0 {
            return Err(Error::InvalidArgument("shared mapping size or offset"));
        }
        let off = libc::off_t::try_from(offset)
            .map_err(|_| Error::InvalidArgument("mapping offset too large"))?;
        // SAFETY: a fresh shared mapping with no address hint cannot alias any Rust
        // object; the kernel validates `fd` and `off`; the result is checked before use.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                off,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(Error::os("mmap(shared)"));
        }
        Ok(Mmap {
            ptr: NonNull::new(raw.cast()).ok_or(Error::InvalidArgument("null mapping"))?,
            len,
        })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_non_null(&self) -> NonNull<u8> {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mmap {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+len` is exactly the mapping this value created and owns;
        // after drop nothing can reach it through this value.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        if rc != 0 {
            log::warn!("munmap failed: {}", std::io::Error::last_os_error());
        }
    }
}

/// Rounds `v` up to a multiple of the power of two `to`.
pub(crate) fn round_up(v: usize, to: usize) -> Option<usize> {
    Some(v.checked_add(to - 1)? & !(to - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anonymous_is_aligned_and_zeroed() {
        let m = Mmap::anonymous(5000, 64 << 10).unwrap();
        assert_eq!(m.as_ptr() as usize % (64 << 10), 0);
        assert_eq!(m.len(), 8192);
        // SAFETY: the mapping is 8192 bytes long and owned by `m`.
        let s = unsafe { std::slice::from_raw_parts(m.as_ptr(), m.len()) };
        assert!(s.iter().all(|&b| b == 0));
    }

    #[test]
    fn rejects_bad_requests() {
        assert!(Mmap::anonymous(0, 4096).is_err());
        assert!(Mmap::anonymous(4096, 3000).is_err());
        assert!(Mmap::shared(-1, 0, 4096).is_err());
        assert!(Mmap::shared(0, 100, 4096).is_err());
    }
}
