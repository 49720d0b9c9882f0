//! A VM's swap store: one memfd per VM that holds the swapped copies of its VRAM chunks,
//! and the [`SysMemory`] through which the GPU reaches them.
//!
//! The memfd is sized to the VM's VRAM + swap limit once (sparse: pages are committed only
//! when a chunk is written there and returned with `FALLOCATE_PUNCH_HOLE` when it goes back
//! to VRAM) and mapped whole, so host pointers handed to the GPU stay valid as long as the
//! store lives. Swapped chunks are reached by the GPU at system-memory addresses from
//! [`SWAP_BASE`] up, a range no guest-physical address reaches: `MAP_GUEST` validates
//! against the guest memory table alone, so a guest cannot name swap memory, and the
//! frontend can map it into the BAR (the aperture of a swapped buffer) because it is a
//! plain memfd.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::sync::Arc;

use vgpu_host_shim::{HostRange, SysMemory, SysRegion};

use crate::guest_mem::GuestSysMemory;

/// Where swap memory starts in a context's system-memory address space (far above any
/// guest-physical address).
pub const SWAP_BASE: u64 = 1 << 60;

/// Granularity of swap regions (the largest GPU page, so any page size maps them).
pub const REGION_ALIGN: u64 = 2 << 20;

/// The swap memfd of one VM, mapped whole.
#[derive(Debug)]
pub struct SwapStore {
    file: File,
    ptr: *mut u8,
    capacity: u64,
    /// Free regions: offset → length (coalesced).
    free: std::sync::Mutex<BTreeMap<u64, u64>>,
}

// SAFETY: the mapping is owned by the store; concurrent access goes through raw pointers
// whose users (the GPU's engines, the VRAM manager under the session lock) never hold
// Rust references across threads.
unsafe impl Send for SwapStore {}
// SAFETY: see Send.
unsafe impl Sync for SwapStore {}

const PAGE: u64 = 4096;

/// Alignment of a swap region of `len` bytes.
fn region_align(len: u64) -> u64 {
    (1u64 << len.trailing_zeros().min(63)).clamp(PAGE, REGION_ALIGN)
}

fn round_up(v: u64, a: u64) -> Option<u64> {
    v.checked_add(a - 1).map(|x| x & !(a - 1))
}

impl SwapStore {
    /// A store of `capacity` bytes (rounded up to [`REGION_ALIGN`]).
    pub fn new(capacity: u64) -> io::Result<Self> {
        let capacity = round_up(capacity.max(REGION_ALIGN), REGION_ALIGN)
            .ok_or(io::ErrorKind::InvalidInput)?;
        let len = usize::try_from(capacity).map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"vgpu-swap".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(capacity)?;
        // SAFETY: a fresh shared mapping of the whole file; checked for MAP_FAILED. Nothing
        // else is placed at the returned address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let mut free = BTreeMap::new();
        free.insert(0, capacity);
        Ok(SwapStore {
            file,
            ptr: ptr.cast(),
            capacity,
            free: std::sync::Mutex::new(free),
        })
    }

    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Reserves a region of `len` bytes (rounded up to 4 KiB), aligned to the largest
    /// power of two dividing it, at most [`REGION_ALIGN`] (so that the GPU pages that map
    /// an object of that size can map its swap copy); first fit.
    pub fn alloc(&self, len: u64) -> Option<u64> {
        let len = round_up(len.max(1), PAGE)?;
        let align = region_align(len);
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let (off, flen, start) = free.iter().find_map(|(&o, &l)| {
            let start = round_up(o, align)?;
            (start.checked_add(len)? <= o + l).then_some((o, l, start))
        })?;
        free.remove(&off);
        if start > off {
            free.insert(off, start - off);
        }
        if off + flen > start + len {
            free.insert(start + len, off + flen - start - len);
        }
        Some(start)
    }

    /// Returns a region of `len` bytes at `off` (its pages are released to the host).
    pub fn release(&self, off: u64, len: u64) {
        let Some(len) = round_up(len.max(1), PAGE) else {
            return;
        };
        if off.checked_add(len).is_none_or(|e| e > self.capacity) {
            return;
        }
        self.discard(off, len);
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let (mut start, mut end) = (off, off + len);
        if let Some((&p, &pl)) = free.range(..start).next_back() {
            if p + pl == start {
                free.remove(&p);
                start = p;
            }
        }
        if let Some(&nl) = free.get(&end) {
            free.remove(&end);
            end += nl;
        }
        free.insert(start, end - start);
    }

    /// Gives the pages of `off..off+len` back to the host (they read as zero afterwards).
    /// Only call while neither the GPU nor a guest mapping reaches the range.
    pub fn discard(&self, off: u64, len: u64) {
        if off.checked_add(len).is_none_or(|e| e > self.capacity) || len == 0 {
            return;
        }
        // SAFETY: punching a hole in our own memfd inside its size; no Rust reference into
        // the range exists.
        let r = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off as libc::off_t,
                len as libc::off_t,
            )
        };
        if r != 0 {
            log::debug!("swap store: punch hole: {}", io::Error::last_os_error());
        }
    }

    /// Commits the pages of `off..off+len` in one call (much cheaper than faulting them
    /// in one by one during a copy). Best effort: older kernels fault them in on use.
    pub fn populate(&self, off: u64, len: u64) {
        const MADV_POPULATE_WRITE: libc::c_int = 23;
        let Some(p) = self.ptr(off, len) else {
            return;
        };
        let Ok(n) = usize::try_from(len) else {
            return;
        };
        // SAFETY: advice on a range inside our own mapping (page-aligned: chunks are).
        let r = unsafe { libc::madvise(p.cast(), n, MADV_POPULATE_WRITE) };
        if r != 0 {
            log::trace!("swap store: populate: {}", io::Error::last_os_error());
        }
    }

    /// The host pointer of `off..off+len`, if inside the store.
    pub fn ptr(&self, off: u64, len: u64) -> Option<*mut u8> {
        if off.checked_add(len)? > self.capacity {
            return None;
        }
        // SAFETY: `off` is inside the mapping (checked above).
        Some(unsafe { self.ptr.add(usize::try_from(off).ok()?) })
    }

    /// Bytes of free swap space.
    pub fn free_bytes(&self) -> u64 {
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .sum()
    }
}

impl Drop for SwapStore {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `new`, once.
        unsafe { libc::munmap(self.ptr.cast(), self.capacity as usize) };
    }
}

/// A context's system memory: the VM's guest RAM (the snapshot taken at `CREATE_CONTEXT`)
/// below [`SWAP_BASE`], the VM's swap store above it.
pub struct VmSysMemory {
    guest: Arc<GuestSysMemory>,
    swap: Arc<SwapStore>,
}

impl VmSysMemory {
    pub fn new(guest: Arc<GuestSysMemory>, swap: Arc<SwapStore>) -> Self {
        VmSysMemory { guest, swap }
    }
}

impl SysMemory for VmSysMemory {
    fn regions(&self) -> Vec<SysRegion> {
        let mut r = self.guest.regions();
        if !r.is_empty() {
            r.push(SysRegion {
                addr: SWAP_BASE,
                len: self.swap.capacity(),
                fd: self.swap.file.as_raw_fd(),
                fd_offset: 0,
            });
        }
        r
    }

    fn translate(&self, addr: u64, len: u64) -> Option<HostRange> {
        if addr < SWAP_BASE {
            return self.guest.translate(addr, len);
        }
        let off = addr - SWAP_BASE;
        let avail = self.swap.capacity().checked_sub(off)?;
        let n = len.min(avail);
        if n == 0 {
            return None;
        }
        Some(HostRange {
            ptr: self.swap.ptr(off, n)?,
            len: usize::try_from(n).ok()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest_mem::GuestMemory;
    use vm_memory::GuestAddress;

    #[test]
    fn regions_are_first_fit_and_coalesce() {
        let s = SwapStore::new(8 << 20).unwrap();
        let a = s.alloc(1).unwrap();
        let b = s.alloc(2 << 20).unwrap();
        assert_eq!((a, b), (0, 2 << 20), "2 MiB regions are 2 MiB aligned");
        let c = s.alloc(64 << 10).unwrap();
        assert_eq!(c, 64 << 10, "64 KiB aligned, in the gap");
        assert!(s.alloc(6 << 20).is_none());
        s.release(a, 1);
        s.release(b, 2 << 20);
        s.release(c, 64 << 10);
        assert_eq!(s.free_bytes(), 8 << 20);
        assert_eq!(s.alloc(8 << 20), Some(0), "coalesced");
    }

    #[test]
    fn sysmem_splits_guest_and_swap() {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0x10000), 0x4000)]).unwrap();
        let swap = Arc::new(SwapStore::new(2 << 20).unwrap());
        let sys = VmSysMemory::new(Arc::new(GuestSysMemory::new(mem)), swap.clone());
        assert!(sys.translate(0x10000, 16).is_some());
        assert!(sys.translate(0x20000, 16).is_none());
        let r = sys.translate(SWAP_BASE + (2 << 20) - 8, 64).unwrap();
        assert_eq!(r.len, 8, "clipped to the store");
        assert!(sys.translate(SWAP_BASE + (2 << 20), 8).is_none());
        // What the GPU sees is what the store holds.
        let p = swap.ptr(16, 4).unwrap();
        // SAFETY: 4 bytes inside the store's mapping; no other access in this test.
        unsafe { std::ptr::copy_nonoverlapping([1u8, 2, 3, 4].as_ptr(), p, 4) };
        let r = sys.translate(SWAP_BASE + 16, 4).unwrap();
        assert_eq!(r.ptr, p);
    }
}
