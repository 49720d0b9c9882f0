//! The VM's shared-memory region (the device's BAR window): channel control-page slots
//! followed by the VRAM aperture, and the SHMEM_MAP / SHMEM_UNMAP requests that place host
//! file ranges there.
//!
//! The layout is fixed by `vgpu_protocol::device`: slot `i` is the 4 KiB page at
//! `slot_offset(i)`, the aperture is `[APERTURE_OFFSET, APERTURE_OFFSET + APERTURE_SIZE)`.
//! Which slots and aperture windows are in use is derived from the session's state (each
//! channel records its slot, each VRAM object its window), so there is no separate
//! allocator state to keep consistent or to migrate.

use std::os::fd::RawFd;
use std::sync::Mutex;

use log::debug;
use vgpu_protocol::device::{APERTURE_OFFSET, APERTURE_SIZE, CHANNEL_SLOTS, SHM_REGION_ID};
use vgpu_protocol::PAGE_SIZE;
use vhost::vhost_user::message::{VhostUserMMap, VhostUserMMapFlags};
use vhost::vhost_user::{Backend, VhostUserFrontendReqHandler};

use crate::error::ShmError;

/// Places file ranges into the VM's shared-memory region (offsets are relative to the
/// region start). Implemented over the vhost-user backend request channel, and by fakes in
/// tests.
pub trait ShmMapper: Send + Sync {
    fn map(
        &self,
        shm_offset: u64,
        fd: RawFd,
        fd_offset: u64,
        len: u64,
        writable: bool,
    ) -> Result<(), ShmError>;
    fn unmap(&self, shm_offset: u64, len: u64) -> Result<(), ShmError>;
}

/// A mapper for a frontend that is gone: unmaps "succeed" without doing anything, maps
/// fail. Used when tearing down a session after a disconnect (the frontend must drop its
/// mappings of the region when the connection goes; see the crate docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct NullShm;

impl ShmMapper for NullShm {
    fn map(&self, _: u64, _: RawFd, _: u64, _: u64, _: bool) -> Result<(), ShmError> {
        Err(ShmError::NoChannel)
    }
    fn unmap(&self, _: u64, _: u64) -> Result<(), ShmError> {
        Ok(())
    }
}

/// SHMEM_MAP / SHMEM_UNMAP over the vhost-user backend request channel
/// (`VHOST_USER_SET_BACKEND_REQ_FD`).
#[derive(Default)]
pub struct VhostShm {
    backend: Mutex<Option<Backend>>,
}

impl VhostShm {
    pub fn new() -> Self {
        Self::default()
    }

    /// Installs (or replaces) the backend request channel.
    pub fn set_backend(&self, backend: Backend) {
        *self.backend.lock().unwrap_or_else(|e| e.into_inner()) = Some(backend);
    }

    /// Whether the frontend has given us a backend request channel.
    pub fn is_connected(&self) -> bool {
        self.backend
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    fn backend(&self) -> Result<Backend, ShmError> {
        self.backend
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or(ShmError::NoChannel)
    }
}

impl ShmMapper for VhostShm {
    fn map(
        &self,
        shm_offset: u64,
        fd: RawFd,
        fd_offset: u64,
        len: u64,
        writable: bool,
    ) -> Result<(), ShmError> {
        let backend = self.backend()?;
        let flags = if writable {
            VhostUserMMapFlags::WRITABLE
        } else {
            VhostUserMMapFlags::empty()
        };
        let msg = VhostUserMMap {
            shmid: SHM_REGION_ID,
            fd_offset,
            shm_offset,
            len,
            flags: flags.bits(),
            ..Default::default()
        };
        debug!("SHMEM_MAP shm {shm_offset:#x}+{len:#x} <- fd {fd} @ {fd_offset:#x}");
        backend
            .shmem_map(&msg, &fd)
            .map(|_| ())
            .map_err(|e| ShmError::Frontend(e.to_string()))
    }

    fn unmap(&self, shm_offset: u64, len: u64) -> Result<(), ShmError> {
        let backend = self.backend()?;
        let msg = VhostUserMMap {
            shmid: SHM_REGION_ID,
            shm_offset,
            len,
            ..Default::default()
        };
        debug!("SHMEM_UNMAP shm {shm_offset:#x}+{len:#x}");
        backend
            .shmem_unmap(&msg)
            .map(|_| ())
            .map_err(|e| ShmError::Frontend(e.to_string()))
    }
}

/// The lowest slot not in `used`.
pub fn free_slot(used: impl IntoIterator<Item = u32>) -> Option<u32> {
    let mut bits = vec![0u64; (CHANNEL_SLOTS as usize).div_ceil(64)];
    for s in used {
        if let Some(w) = bits.get_mut(s as usize / 64) {
            *w |= 1 << (s % 64);
        }
    }
    (0..CHANNEL_SLOTS).find(|&s| bits[s as usize / 64] & (1 << (s % 64)) == 0)
}

/// Rounds `len` up to whole pages (None on overflow).
pub fn page_round_up(len: u64) -> Option<u64> {
    len.checked_add(PAGE_SIZE - 1).map(|l| l & !(PAGE_SIZE - 1))
}

/// First fit: the lowest region-relative offset in the aperture where `len` bytes
/// (page-aligned) fit between the windows in `used` (`(offset, len)`, region-relative).
pub fn first_fit_aperture(used: impl IntoIterator<Item = (u64, u64)>, len: u64) -> Option<u64> {
    let len = page_round_up(len)?;
    if len == 0 || len > APERTURE_SIZE {
        return None;
    }
    let mut used: Vec<(u64, u64)> = used.into_iter().collect();
    used.sort_unstable();
    let end = APERTURE_OFFSET + APERTURE_SIZE;
    let mut at = APERTURE_OFFSET;
    for (off, l) in used {
        if off >= at && off - at >= len {
            return Some(at);
        }
        at = at.max(off.saturating_add(page_round_up(l).unwrap_or(u64::MAX)));
    }
    (at <= end && end - at >= len).then_some(at)
}

/// Whether a window of `len` bytes (rounded to pages) at region-relative `off` lies in
/// the aperture, page-aligned, clear of the windows in `used` (`(offset, len)`).
pub fn aperture_window_free(
    used: impl IntoIterator<Item = (u64, u64)>,
    off: u64,
    len: u64,
) -> bool {
    let Some(len) = page_round_up(len) else {
        return false;
    };
    let Some(end) = off.checked_add(len) else {
        return false;
    };
    len != 0
        && off.is_multiple_of(PAGE_SIZE)
        && off >= APERTURE_OFFSET
        && end <= APERTURE_OFFSET + APERTURE_SIZE
        && used.into_iter().all(|(o, l)| {
            let l = page_round_up(l).unwrap_or(u64::MAX);
            o.saturating_add(l) <= off || end <= o
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots() {
        assert_eq!(free_slot([]), Some(0));
        assert_eq!(free_slot([0, 1, 3]), Some(2));
        assert_eq!(free_slot(0..CHANNEL_SLOTS), None);
        assert_eq!(
            free_slot((0..CHANNEL_SLOTS).filter(|&s| s != 777)),
            Some(777)
        );
    }

    #[test]
    fn aperture_first_fit() {
        let a = APERTURE_OFFSET;
        assert_eq!(first_fit_aperture([], 1), Some(a));
        assert_eq!(first_fit_aperture([], 0), None);
        assert_eq!(first_fit_aperture([], APERTURE_SIZE), Some(a));
        assert_eq!(first_fit_aperture([], APERTURE_SIZE + 1), None);
        assert_eq!(first_fit_aperture([(a, 4096)], 4096), Some(a + 4096));
        assert_eq!(
            first_fit_aperture([(a + 8192, 4096), (a, 4096)], 4096),
            Some(a + 4096)
        );
        assert_eq!(
            first_fit_aperture([(a + 8192, 4096), (a, 4096)], 8192),
            Some(a + 12288)
        );
        assert_eq!(first_fit_aperture([(a, APERTURE_SIZE)], 4096), None);
        assert_eq!(first_fit_aperture([], u64::MAX), None);
    }
}
