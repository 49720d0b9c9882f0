//! Typed access to a mapped channel control page.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use vgpu_protocol::{ControlPage, ErrorCode};

use crate::error::{Error, Result};
use crate::transport::CpuPtr;

/// A view of a control page. The GPU (or the backend's shadow logic) writes it
/// concurrently, so every field is accessed atomically.
#[derive(Debug)]
pub(crate) struct ControlView {
    page: CpuPtr,
}

impl ControlView {
    pub(crate) fn new(page: CpuPtr) -> Result<Self> {
        if page.len() < ControlPage::USED_BYTES || page.as_ptr() as usize & 7 != 0 {
            return Err(Error::InvalidArgument(
                "control page mapping too small or misaligned",
            ));
        }
        Ok(ControlView { page })
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        // SAFETY: `off` is one of the 4-aligned `ControlPage` offsets below USED_BYTES,
        // inside the mapping (checked in `new`), which the transport keeps mapped until
        // the channel is destroyed (after this view is gone). Shared memory written by
        // others is exactly what atomics are for.
        unsafe { &*(self.page.as_ptr().add(off) as *const AtomicU32) }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: as in `u32_at`; `off` is 8-aligned and the page base is 8-aligned.
        unsafe { &*(self.page.as_ptr().add(off) as *const AtomicU64) }
    }

    pub(crate) fn gp_put(&self) -> u32 {
        self.u32_at(ControlPage::GP_PUT).load(Ordering::Relaxed)
    }

    /// Publishes new GP entries: everything written before (ring entries, push
    /// buffers, arguments, input data) is visible to the GPU once it sees this value.
    pub(crate) fn set_gp_put(&self, v: u32) {
        self.u32_at(ControlPage::GP_PUT).store(v, Ordering::Release);
    }

    pub(crate) fn gp_get(&self) -> u32 {
        self.u32_at(ControlPage::GP_GET).load(Ordering::Acquire)
    }

    /// The last `SET_REF` value; Acquire so results written before it are visible.
    pub(crate) fn reference(&self) -> u32 {
        self.u32_at(ControlPage::REF).load(Ordering::Acquire)
    }

    pub(crate) fn notify_seq(&self) -> u32 {
        self.u32_at(ControlPage::NOTIFY_SEQ).load(Ordering::Acquire)
    }

    pub(crate) fn version(&self) -> u32 {
        self.u32_at(ControlPage::VERSION).load(Ordering::Relaxed)
    }

    /// The channel's error and its detail, if it has stopped.
    pub(crate) fn error(&self) -> Option<(ErrorCode, u64)> {
        let raw = self.u32_at(ControlPage::ERROR).load(Ordering::Acquire);
        if raw == 0 {
            return None;
        }
        let info = self.u64_at(ControlPage::ERROR_INFO).load(Ordering::Relaxed);
        let code = ErrorCode::from_u32(raw).unwrap_or_else(|e| {
            log::warn!("channel reports {e}");
            ErrorCode::Internal
        });
        Some((code, info))
    }

    /// `Err(ChannelFault)` if the channel has stopped.
    pub(crate) fn check(&self) -> Result<()> {
        match self.error() {
            Some((code, info)) => Err(Error::ChannelFault { code, info }),
            None => Ok(()),
        }
    }
}
