//! The fake device's VMM API (`cuMemCreate`, `cuMemAddressReserve`, `cuMemMap`): device
//! pointers are host pointers on the fake, so physical memory is one memfd, a reservation
//! is an inaccessible host mapping, and a mapping places the memfd's pages in it with
//! `mmap(MAP_FIXED)`. Two addresses of one physical allocation then alias, as on the GPU,
//! and a kernel of the fake that follows a pointer reads what a real one would.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Mutex;

use super::error::DeviceError;

#[derive(Default)]
struct Inner {
    /// All physical memory, grown as allocations need it.
    fd: Option<OwnedFd>,
    fd_len: u64,
    /// Handle → (offset in the memfd, length).
    physical: HashMap<u64, (u64, u64)>,
    /// Released extents of the memfd, by length, for reuse.
    free: Vec<(u64, u64)>,
    next_handle: u64,
    /// Reservations: start → length.
    reserved: BTreeMap<u64, u64>,
    /// Mappings: start → (length, writable).
    mapped: BTreeMap<u64, (u64, bool)>,
}

/// The fake's VMM state.
#[derive(Default)]
pub(crate) struct FakeVmm {
    inner: Mutex<Inner>,
}

fn fake_err(what: &'static str) -> DeviceError {
    DeviceError::Fake(what)
}

fn lock(m: &Mutex<Inner>) -> std::sync::MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An inaccessible anonymous mapping of `len` bytes at `at` (`fixed`: exactly there, over
/// whatever was there; else a hint). Returns where it lies.
fn placeholder(at: u64, len: u64, fixed: bool) -> Option<u64> {
    let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    if fixed {
        flags |= libc::MAP_FIXED;
    }
    // SAFETY: a new inaccessible mapping; with MAP_FIXED it replaces only a range this
    // fake reserved (callers check), which nothing else in the process uses.
    let p = unsafe {
        libc::mmap(
            at as *mut libc::c_void,
            len as usize,
            libc::PROT_NONE,
            flags,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some(p as u64)
}

impl FakeVmm {
    pub(crate) fn create_physical(&self, len: u64) -> Result<u64, DeviceError> {
        let mut g = lock(&self.inner);
        let offset = match g.free.iter().position(|&(_, l)| l == len) {
            Some(i) => g.free.swap_remove(i).0,
            None => {
                if g.fd.is_none() {
                    // SAFETY: a NUL-terminated name; no memory is touched.
                    let raw = unsafe { libc::memfd_create(c"vgpu-fake-vram".as_ptr(), 0) };
                    if raw < 0 {
                        return Err(fake_err("memfd_create failed"));
                    }
                    // SAFETY: `raw` is a new descriptor nobody else owns.
                    g.fd = Some(unsafe { OwnedFd::from_raw_fd(raw) });
                }
                let at = g.fd_len;
                let fd = g.fd.as_ref().map_or(-1, |f| f.as_raw_fd());
                // SAFETY: ftruncate on our memfd changes no memory of this process.
                if unsafe { libc::ftruncate(fd, (at + len) as libc::off_t) } != 0 {
                    return Err(fake_err("growing the fake's physical memory failed"));
                }
                g.fd_len = at + len;
                at
            }
        };
        g.next_handle += 1;
        let h = g.next_handle;
        g.physical.insert(h, (offset, len));
        Ok(h)
    }

    pub(crate) fn release_physical(&self, handle: u64) {
        let mut g = lock(&self.inner);
        if let Some((offset, len)) = g.physical.remove(&handle) {
            if let Some(fd) = &g.fd {
                // SAFETY: frees the extent's pages; mappings of it (the caller's bug)
                // would read zeros, never another process's memory.
                unsafe {
                    libc::fallocate(
                        fd.as_raw_fd(),
                        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                        offset as libc::off_t,
                        len as libc::off_t,
                    )
                };
            }
            g.free.push((offset, len));
        }
    }

    pub(crate) fn reserve_va(&self, hint: u64, len: u64) -> Result<u64, DeviceError> {
        let at = placeholder(hint, len, false).ok_or(fake_err("reserving address space"))?;
        lock(&self.inner).reserved.insert(at, len);
        Ok(at)
    }

    pub(crate) fn free_va(&self, ptr: u64, len: u64) {
        let mut g = lock(&self.inner);
        if g.reserved.get(&ptr) == Some(&len) {
            g.reserved.remove(&ptr);
            // SAFETY: a whole reservation of this fake; nothing else lives there.
            unsafe { libc::munmap(ptr as *mut libc::c_void, len as usize) };
        }
    }

    fn in_reservation(g: &Inner, ptr: u64, len: u64) -> bool {
        g.reserved
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&s, &l)| ptr + len <= s + l)
    }

    pub(crate) fn map_physical(
        &self,
        ptr: u64,
        len: u64,
        handle: u64,
        writable: bool,
    ) -> Result<(), DeviceError> {
        let mut g = lock(&self.inner);
        let &(offset, plen) = g
            .physical
            .get(&handle)
            .ok_or(fake_err("mapping a handle never created"))?;
        if plen != len || !Self::in_reservation(&g, ptr, len) {
            return Err(fake_err(
                "cuMemMap outside a reservation or of part of a handle",
            ));
        }
        if g.mapped.range(ptr..ptr + len).next().is_some()
            || g.mapped
                .range(..ptr)
                .next_back()
                .is_some_and(|(&s, &(l, _))| s + l > ptr)
        {
            return Err(fake_err("cuMemMap over a mapping"));
        }
        let fd = g.fd.as_ref().map_or(-1, |f| f.as_raw_fd());
        // SAFETY: `ptr..ptr+len` lies in a reservation of this fake with nothing mapped
        // (checked above); the memfd's extent is the handle's own.
        let p = unsafe {
            libc::mmap(
                ptr as *mut libc::c_void,
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(fake_err("mmap of physical memory failed"));
        }
        g.mapped.insert(ptr, (len, writable));
        Ok(())
    }

    pub(crate) fn unmap_va(&self, ptr: u64, len: u64) -> Result<(), DeviceError> {
        let mut g = lock(&self.inner);
        if g.mapped.get(&ptr).map(|m| m.0) != Some(len) {
            return Err(fake_err("cuMemUnmap of something not mapped"));
        }
        placeholder(ptr, len, true).ok_or(fake_err("unmapping"))?;
        g.mapped.remove(&ptr);
        Ok(())
    }

    /// Every mapped range `(start, length)`: memory a fake kernel may touch.
    pub(crate) fn mapped(&self) -> Vec<(u64, u64)> {
        lock(&self.inner)
            .mapped
            .iter()
            .map(|(&s, &(l, _))| (s, l))
            .collect()
    }
}

impl Drop for FakeVmm {
    fn drop(&mut self) {
        let g = lock(&self.inner);
        for (&p, &l) in &g.reserved {
            // SAFETY: the fake's own reservations, unused once the fake goes.
            unsafe { libc::munmap(p as *mut libc::c_void, l as usize) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 2 << 20;

    #[test]
    fn two_addresses_of_one_handle_alias_and_unmapped_ranges_are_gone() {
        let v = FakeVmm::default();
        let h = v.create_physical(G).unwrap();
        let a = v.reserve_va(0, 4 * G).unwrap();
        let b = v.reserve_va(0, 2 * G).unwrap();
        v.map_physical(a + G, G, h, true).unwrap();
        v.map_physical(b, G, h, true).unwrap();
        assert!(
            v.map_physical(b, G, h, true).is_err(),
            "no map over a mapping"
        );
        assert!(v.map_physical(a + 4 * G, G, h, true).is_err(), "outside");
        // SAFETY: both ranges are mapped writable just above.
        unsafe {
            *((a + G + 8) as *mut u64) = 0x1234;
            assert_eq!(*((b + 8) as *const u64), 0x1234);
        }
        assert_eq!(v.mapped().len(), 2);
        v.unmap_va(b, G).unwrap();
        assert!(v.unmap_va(b, G).is_err());
        assert_eq!(v.mapped(), vec![(a + G, G)]);
        v.unmap_va(a + G, G).unwrap();
        v.release_physical(h);
        let h2 = v.create_physical(G).unwrap();
        v.map_physical(b, G, h2, true).unwrap();
        // SAFETY: mapped above.
        let word = unsafe { *((b + 8) as *const u64) };
        assert_eq!(word, 0, "released memory is zero");
        v.unmap_va(b, G).unwrap();
        v.free_va(a, 4 * G);
        v.free_va(b, 2 * G);
    }

    #[test]
    fn a_hint_is_kept_when_the_range_is_free() {
        let v = FakeVmm::default();
        let hint = 0x500_0000_0000;
        let a = v.reserve_va(hint, 4 * G).unwrap();
        assert_eq!(a, hint);
        let b = v.reserve_va(hint, 4 * G).unwrap();
        assert_ne!(b, hint, "a taken range moves the second reservation");
        v.free_va(a, 4 * G);
        v.free_va(b, 4 * G);
    }
}
