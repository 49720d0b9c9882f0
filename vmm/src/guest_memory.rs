//! Guest RAM: memfd-backed regions mapped shared into this process (so they can be passed
//! to a vhost-user backend in SET_MEM_TABLE and, in the KVM VMM, registered as memslots),
//! and a small page allocator over guest-physical addresses.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};

use thiserror::Error;
use vhost::VhostUserMemoryRegionInfo;

/// Guest page size.
pub const PAGE_SIZE: u64 = 4096;

#[derive(Debug, Error)]
pub enum GuestMemoryError {
    #[error("memfd_create failed: {0}")]
    Memfd(io::Error),
    #[error("ftruncate of guest memory failed: {0}")]
    Truncate(io::Error),
    #[error("mmap of guest memory failed: {0}")]
    Mmap(io::Error),
    #[error("bad guest memory layout: {0}")]
    Layout(&'static str),
    #[error("out of guest memory ({0} bytes requested)")]
    OutOfMemory(u64),
    #[error("bad allocation parameters (size {size:#x}, align {align:#x})")]
    BadAlloc { size: u64, align: u64 },
    #[error("no allocation at guest-physical address {0:#x}")]
    NotAllocated(u64),
}

/// One contiguous region of guest RAM, backed by its own memfd.
#[derive(Debug)]
pub struct RamRegion {
    gpa: u64,
    len: u64,
    host: *mut u8,
    file: File,
}

// SAFETY: the region is a plain shared mapping owned by this struct; the pointer is only an
// address that stays valid until drop. Concurrent access to the memory itself is the
// business of whoever dereferences it (guest memory is shared with another process anyway).
unsafe impl Send for RamRegion {}
// SAFETY: see `Send`; `&RamRegion` exposes only the address and the file.
unsafe impl Sync for RamRegion {}

impl RamRegion {
    fn new(gpa: u64, len: u64, index: usize) -> Result<Self, GuestMemoryError> {
        if len == 0 || !len.is_multiple_of(PAGE_SIZE) || !gpa.is_multiple_of(PAGE_SIZE) {
            return Err(GuestMemoryError::Layout("region not page aligned"));
        }
        gpa.checked_add(len)
            .ok_or(GuestMemoryError::Layout("region wraps the address space"))?;
        let name = CString::new(format!("vgpu-guest-ram-{index}"))
            .map_err(|_| GuestMemoryError::Layout("bad memfd name"))?;
        // SAFETY: `name` is a valid NUL-terminated string; the flags are valid.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(GuestMemoryError::Memfd(io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just created and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len).map_err(GuestMemoryError::Truncate)?;
        let size =
            usize::try_from(len).map_err(|_| GuestMemoryError::Layout("region too large"))?;
        // SAFETY: a fresh shared mapping of a file we own, at an address of the kernel's
        // choosing; nothing else is affected.
        let host = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                0,
            )
        };
        if host == libc::MAP_FAILED {
            return Err(GuestMemoryError::Mmap(io::Error::last_os_error()));
        }
        Ok(RamRegion {
            gpa,
            len,
            host: host.cast(),
            file,
        })
    }

    pub fn gpa(&self) -> u64 {
        self.gpa
    }
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn host_addr(&self) -> *mut u8 {
        self.host
    }
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The region as SET_MEM_TABLE describes it. The fd stays owned by `self`.
    pub fn vhost_region(&self) -> VhostUserMemoryRegionInfo {
        VhostUserMemoryRegionInfo {
            guest_phys_addr: self.gpa,
            memory_size: self.len,
            userspace_addr: self.host as u64,
            mmap_offset: 0,
            mmap_handle: self.file.as_raw_fd(),
        }
    }
}

impl Drop for RamRegion {
    fn drop(&mut self) {
        // SAFETY: `host`/`len` describe the mapping created in `new`, which nothing else
        // unmaps; after drop no pointer into it is handed out by this type any more.
        unsafe {
            libc::munmap(self.host.cast(), self.len as usize);
        }
    }
}

/// Guest RAM: a set of non-overlapping memfd-backed regions.
#[derive(Debug)]
pub struct GuestRam {
    regions: Vec<RamRegion>,
}

impl GuestRam {
    /// Creates RAM with the given `(gpa, len)` regions (page aligned, non-overlapping).
    pub fn new(layout: &[(u64, u64)]) -> Result<Self, GuestMemoryError> {
        if layout.is_empty() {
            return Err(GuestMemoryError::Layout("no regions"));
        }
        let mut sorted = layout.to_vec();
        sorted.sort_unstable();
        for w in sorted.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(GuestMemoryError::Layout("overlapping regions"));
            }
        }
        let regions = sorted
            .iter()
            .enumerate()
            .map(|(i, &(gpa, len))| RamRegion::new(gpa, len, i))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(GuestRam { regions })
    }

    pub fn regions(&self) -> &[RamRegion] {
        &self.regions
    }

    /// The regions as SET_MEM_TABLE describes them.
    pub fn vhost_regions(&self) -> Vec<VhostUserMemoryRegionInfo> {
        self.regions.iter().map(RamRegion::vhost_region).collect()
    }

    /// Host address of `len` bytes at `gpa`, if the whole range lies in one region.
    pub fn host_ptr(&self, gpa: u64, len: u64) -> Option<*mut u8> {
        let r = self
            .regions
            .iter()
            .find(|r| gpa >= r.gpa && gpa - r.gpa < r.len)?;
        let off = gpa - r.gpa;
        if off.checked_add(len)? > r.len {
            return None;
        }
        // SAFETY: `off` < region length, so the result stays inside the mapping.
        Some(unsafe { r.host.add(off as usize) })
    }
}

/// First-fit allocator of page-aligned guest-physical ranges inside `[base, base+len)`.
#[derive(Debug)]
pub struct PageAllocator {
    /// Free extents: start → length.
    free: BTreeMap<u64, u64>,
    /// Allocations: start → length.
    used: BTreeMap<u64, u64>,
}

impl PageAllocator {
    pub fn new(base: u64, len: u64) -> Self {
        let mut free = BTreeMap::new();
        let start = base.next_multiple_of(PAGE_SIZE);
        let end = (base + len) / PAGE_SIZE * PAGE_SIZE;
        if end > start {
            free.insert(start, end - start);
        }
        PageAllocator {
            free,
            used: BTreeMap::new(),
        }
    }

    /// Allocates `size` bytes (rounded up to pages) aligned to `align` (a power of two;
    /// at least a page). Returns the guest-physical address and the rounded length.
    pub fn alloc(&mut self, size: u64, align: u64) -> Result<(u64, u64), GuestMemoryError> {
        let align = align.max(PAGE_SIZE);
        if size == 0 || !align.is_power_of_two() {
            return Err(GuestMemoryError::BadAlloc { size, align });
        }
        let len = size
            .checked_next_multiple_of(PAGE_SIZE)
            .ok_or(GuestMemoryError::BadAlloc { size, align })?;
        let found = self.free.iter().find_map(|(&start, &flen)| {
            let at = start.checked_next_multiple_of(align)?;
            let end = at.checked_add(len)?;
            (end <= start + flen).then_some((start, flen, at))
        });
        let (start, flen, at) = found.ok_or(GuestMemoryError::OutOfMemory(size))?;
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, at - start);
        }
        let tail = start + flen - (at + len);
        if tail > 0 {
            self.free.insert(at + len, tail);
        }
        self.used.insert(at, len);
        Ok((at, len))
    }

    /// Frees the allocation starting at `gpa`; returns its length.
    pub fn free(&mut self, gpa: u64) -> Result<u64, GuestMemoryError> {
        let len = self
            .used
            .remove(&gpa)
            .ok_or(GuestMemoryError::NotAllocated(gpa))?;
        let mut start = gpa;
        let mut flen = len;
        // Merge with the previous free extent.
        if let Some((&p, &plen)) = self.free.range(..gpa).next_back() {
            if p + plen == gpa {
                self.free.remove(&p);
                start = p;
                flen += plen;
            }
        }
        // Merge with the next one.
        if let Some(&nlen) = self.free.get(&(gpa + len)) {
            self.free.remove(&(gpa + len));
            flen += nlen;
        }
        self.free.insert(start, flen);
        Ok(len)
    }

    /// Bytes currently free.
    pub fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ram_is_shared_and_translated() {
        let ram = GuestRam::new(&[(0, 1 << 20), (1 << 30, 2 << 20)]).unwrap();
        let p = ram.host_ptr((1 << 30) + 8, 8).unwrap();
        // SAFETY: test; `p` points into the mapping.
        unsafe { p.write(0xab) };
        assert!(ram.host_ptr(1 << 20, 1).is_none());
        assert!(ram.host_ptr((1 << 20) - 4, 8).is_none());
        let r = &ram.vhost_regions()[1];
        assert_eq!(r.guest_phys_addr, 1 << 30);
        let mut b = [0u8; 1];
        use std::os::unix::fs::FileExt;
        ram.regions()[1].file().read_exact_at(&mut b, 8).unwrap();
        assert_eq!(b[0], 0xab);
    }

    #[test]
    fn allocator() {
        let mut a = PageAllocator::new(0x10000, 0x100000);
        let total = a.free_bytes();
        let (x, xl) = a.alloc(1, 0).unwrap();
        assert_eq!((x, xl), (0x10000, PAGE_SIZE));
        let (y, _) = a.alloc(0x3000, 0x10000).unwrap();
        assert_eq!(y % 0x10000, 0);
        let (z, _) = a.alloc(0x1000, 0).unwrap();
        assert_eq!(z, 0x11000);
        assert!(a.alloc(0x200000, 0).is_err());
        assert!(a.alloc(0, 0).is_err());
        assert!(a.alloc(1, 3 << 12).is_err());
        a.free(y).unwrap();
        a.free(x).unwrap();
        assert!(a.free(x).is_err());
        a.free(z).unwrap();
        assert_eq!(a.free_bytes(), total);
        assert_eq!(a.free.len(), 1);
        assert_eq!(a.alloc(total, 0).unwrap().1, total);
    }
}
