//! The GPU's view of one VM's guest-physical memory.
//!
//! A context's [`SysMemory`] is a snapshot of the VM's vhost-user memory table taken when
//! the context is created: guest-physical addresses inside one of its regions translate to
//! the backend's mapping of that region, everything else is `None`. Holding the snapshot
//! keeps the regions mapped for as long as the GPU may use them, even if the frontend
//! replaces the table later (a context created before a memory hot-plug does not see the new
//! region; it may re-create itself).

use std::os::fd::AsRawFd;

use vgpu_host_shim::{HostRange, SysMemory, SysRegion};
use vm_memory::{
    GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, MemoryRegionAddress,
};

/// Guest memory of the VMs this backend serves (no dirty bitmap).
pub type GuestMemory = GuestMemoryMmap<()>;

/// [`SysMemory`] over a snapshot of one VM's memory table.
#[derive(Debug, Clone)]
pub struct GuestSysMemory {
    mem: GuestMemory,
}

impl GuestSysMemory {
    pub fn new(mem: GuestMemory) -> Self {
        GuestSysMemory { mem }
    }

    /// The memory table snapshot.
    pub fn memory(&self) -> &GuestMemory {
        &self.mem
    }

    /// Whether `gpa..gpa+len` is non-empty and lies inside one region of the table.
    pub fn contains_range(&self, gpa: u64, len: u64) -> bool {
        contains_range(&self.mem, gpa, len)
    }
}

/// Whether `gpa..gpa+len` is non-empty and lies inside ONE region of `mem`.
pub fn contains_range(mem: &GuestMemory, gpa: u64, len: u64) -> bool {
    if len == 0 {
        return false;
    }
    let Some(end) = gpa.checked_add(len) else {
        return false;
    };
    let Some(region) = mem.find_region(GuestAddress(gpa)) else {
        return false;
    };
    let start = region.start_addr().0;
    start
        .checked_add(region.len())
        .is_some_and(|region_end| end <= region_end)
}

impl SysMemory for GuestSysMemory {
    fn translate(&self, addr: u64, len: u64) -> Option<HostRange> {
        if len == 0 {
            return None;
        }
        let region = self.mem.find_region(GuestAddress(addr))?;
        let offset = addr.checked_sub(region.start_addr().0)?;
        let avail = region.len().checked_sub(offset)?;
        if avail == 0 {
            return None;
        }
        let n = usize::try_from(len.min(avail)).ok()?;
        let ptr = region.get_host_address(MemoryRegionAddress(offset)).ok()?;
        Some(HostRange { ptr, len: n })
    }

    /// Every region of the table as its file (a GPU worker maps them itself); none if a
    /// region has no file behind it.
    fn regions(&self) -> Vec<SysRegion> {
        let mut out = Vec::new();
        for r in self.mem.iter() {
            let Some(fo) = r.file_offset() else {
                return Vec::new();
            };
            out.push(SysRegion {
                addr: r.start_addr().0,
                len: r.len(),
                fd: fo.file().as_raw_fd(),
                fd_offset: fo.start(),
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translates_only_inside_the_table() {
        let mem = GuestMemory::from_ranges(&[
            (GuestAddress(0x10000), 0x4000),
            (GuestAddress(0x20000), 0x2000),
        ])
        .unwrap();
        let s = GuestSysMemory::new(mem);
        assert!(s.translate(0, 16).is_none());
        assert!(s.translate(0x14000, 16).is_none());
        let r = s.translate(0x13ff0, 0x100).unwrap();
        assert_eq!(r.len, 0x10, "clipped to the region end");
        let r = s.translate(0x20000, 0x100).unwrap();
        assert_eq!(r.len, 0x100);
        assert!(s.translate(0x20000, 0).is_none());
        assert!(s.contains_range(0x10000, 0x4000));
        assert!(!s.contains_range(0x10000, 0x4001));
        assert!(
            !s.contains_range(0x13000, 0xd000 + 0x1000),
            "spans two regions"
        );
        assert!(!s.contains_range(u64::MAX - 10, 100));
        assert!(!s.contains_range(0x10000, 0));
    }
}
