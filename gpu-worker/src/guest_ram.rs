//! The worker's view of its VM's RAM: the regions the backend sent (memfds), mapped here,
//! as the [`SysMemory`] of every context the worker creates.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::RwLock;

use vgpu_host_shim::{HostRange, SysMemory};

use crate::mapping::{file_len, Mapping};

struct Region {
    gpa: u64,
    map: Mapping,
    _fd: OwnedFd,
}

/// Guest RAM regions; they stay mapped while the worker lives (the GPU may hold pointers
/// into them), so a region is never removed, only added.
#[derive(Default)]
pub struct GuestRam {
    regions: RwLock<Vec<Region>>,
}

/// Why a region was refused.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error("region {gpa:#x}+{len:#x} overlaps one already added")]
    Overlap { gpa: u64, len: u64 },
    #[error("region {gpa:#x}+{len:#x} reaches past its file ({file} bytes)")]
    PastFile { gpa: u64, len: u64, file: u64 },
    #[error("mapping the region: {0}")]
    Map(std::io::Error),
}

impl GuestRam {
    /// Adds `len` bytes of `fd` from `fd_offset`, seen at guest address `gpa`.
    pub fn add(&self, fd: OwnedFd, gpa: u64, len: u64, fd_offset: u64) -> Result<(), RegionError> {
        let file = file_len(fd.as_fd()).map_err(RegionError::Map)?;
        if fd_offset.checked_add(len).is_none_or(|e| e > file) {
            return Err(RegionError::PastFile { gpa, len, file });
        }
        let mut regions = self.regions.write().unwrap_or_else(|e| e.into_inner());
        let end = gpa.saturating_add(len);
        if regions
            .iter()
            .any(|r| gpa < r.gpa + r.map.len() && r.gpa < end)
        {
            return Err(RegionError::Overlap { gpa, len });
        }
        let map = Mapping::new(fd.as_fd(), fd_offset, len, true).map_err(RegionError::Map)?;
        regions.push(Region { gpa, map, _fd: fd });
        Ok(())
    }
}

impl GuestRam {
    /// Forgets every region (only while no context, and so no GPU work, uses them).
    pub fn clear(&self) {
        self.regions
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}

impl SysMemory for GuestRam {
    fn translate(&self, addr: u64, len: u64) -> Option<HostRange> {
        if len == 0 {
            return None;
        }
        let regions = self.regions.read().unwrap_or_else(|e| e.into_inner());
        let r = regions
            .iter()
            .find(|r| addr >= r.gpa && addr - r.gpa < r.map.len())?;
        let off = addr - r.gpa;
        let n = len.min(r.map.len() - off);
        Some(HostRange {
            ptr: r.map.ptr(off, n)?,
            len: usize::try_from(n).ok()?,
        })
    }
}
