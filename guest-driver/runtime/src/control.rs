//! Typed access to a mapped channel control page.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use vgpu_protocol::{ControlPage, ErrorCode};

use crate::error::{Error, Result};
use crate::transport::{CpuPtr, LostProbe};

/// Brings a forwarded channel's copy of its control page up to date (a request).
pub(crate) type Refresh = std::sync::Arc<dyn Fn() -> Result<()> + Send + Sync>;

/// A view of a control page. The GPU (or the backend's shadow logic) writes it
/// concurrently, so every field is accessed atomically.
///
/// GP_GET, REF and NOTIFY_SEQ are read as lower bounds: while the host swaps a channel's page for a
/// shadow (scheduling), a read can briefly return an older value (protocol.md, "Shadow
/// channels"), so the view keeps the largest value it has seen.
pub(crate) struct ControlView {
    page: CpuPtr,
    /// Whether the device was reset under us (then the page is not ours any more).
    lost: Option<LostProbe>,
    /// Forwarded channels: refreshes the page (which is a copy) from the device.
    refresh: Option<Refresh>,
    seen_get: AtomicU32,
    seen_ref: AtomicU32,
    seen_notify: AtomicU32,
}

/// Returns the later of `page` and the value remembered in `seen` (wrapping compare), and
/// remembers it.
fn monotonic(seen: &AtomicU32, page: u32) -> u32 {
    let mut prev = seen.load(Ordering::Relaxed);
    loop {
        if !vgpu_protocol::counter_after(page, prev) {
            return prev;
        }
        match seen.compare_exchange_weak(prev, page, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return page,
            Err(now) => prev = now,
        }
    }
}

impl std::fmt::Debug for ControlView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlView")
            .field("page", &self.page)
            .field("seen_get", &self.seen_get)
            .field("seen_ref", &self.seen_ref)
            .finish()
    }
}

impl ControlView {
    pub(crate) fn new(
        page: CpuPtr,
        lost: Option<LostProbe>,
        refresh: Option<Refresh>,
    ) -> Result<Self> {
        if page.len() < ControlPage::USED_BYTES || page.as_ptr() as usize & 7 != 0 {
            return Err(Error::InvalidArgument(
                "control page mapping too small or misaligned",
            ));
        }
        Ok(ControlView {
            page,
            lost,
            refresh,
            seen_get: AtomicU32::new(0),
            seen_ref: AtomicU32::new(0),
            seen_notify: AtomicU32::new(0),
        })
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

    /// Whether the GPU's front end sleeps and wants the doorbell rung for the GP_PUT just
    /// published. The full fence orders that store before this load, as the front end
    /// orders its flag store before its GP_PUT loads (protocol.md, "Doorbell"): one of
    /// the two sees the other.
    pub(crate) fn doorbell_wanted(&self) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.u32_at(ControlPage::WANT_DOORBELL)
            .load(Ordering::Relaxed)
            != 0
    }

    /// Arms the channel's fence wake-up for REF reaching `target` (docs/protocol.md,
    /// "Blocking fence waits"): the value first, then the armed word, then a full fence,
    /// so the caller's next look at REF is ordered after the arming (the front end
    /// orders its look at the armed word after REF moved).
    pub(crate) fn arm_fence_wake(&self, target: u32) {
        self.u32_at(ControlPage::REF_WAKE)
            .store(target, Ordering::Relaxed);
        self.u32_at(ControlPage::REF_WAKE_ARMED)
            .store(1, Ordering::Release);
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Disarms the fence wake-up (nobody sleeps on the channel any more).
    pub(crate) fn disarm_fence_wake(&self) {
        self.u32_at(ControlPage::REF_WAKE_ARMED)
            .store(0, Ordering::Relaxed);
    }

    pub(crate) fn gp_get(&self) -> u32 {
        let page = self.u32_at(ControlPage::GP_GET).load(Ordering::Acquire);
        monotonic(&self.seen_get, page)
    }

    /// The last `SET_REF` value; Acquire so results written before it are visible.
    pub(crate) fn reference(&self) -> u32 {
        let page = self.u32_at(ControlPage::REF).load(Ordering::Acquire);
        monotonic(&self.seen_ref, page)
    }

    pub(crate) fn notify_seq(&self) -> u32 {
        let page = self.u32_at(ControlPage::NOTIFY_SEQ).load(Ordering::Acquire);
        monotonic(&self.seen_notify, page)
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

    /// Forwarded channels: fetches the GPU-written fields from the device. Waiters call it
    /// before each look at GP_GET, REF or ERROR; on a direct channel it does nothing.
    pub(crate) fn refresh(&self) -> Result<()> {
        match &self.refresh {
            Some(r) => {
                self.check_device()?;
                r()
            }
            None => Ok(()),
        }
    }

    /// `Err(DeviceLost)` if the device was reset under this process.
    pub(crate) fn check_device(&self) -> Result<()> {
        match &self.lost {
            Some(lost) if lost() => Err(Error::DeviceLost),
            _ => Ok(()),
        }
    }

    /// `Err(DeviceLost)` if the device was reset, `Err(ChannelFault)` if the channel has
    /// stopped.
    pub(crate) fn check(&self) -> Result<()> {
        self.check_device()?;
        match self.error() {
            Some((code, info)) => Err(Error::ChannelFault { code, info }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_never_go_backwards() {
        let seen = AtomicU32::new(0);
        assert_eq!(monotonic(&seen, 5), 5);
        assert_eq!(
            monotonic(&seen, 3),
            5,
            "an older value reads as the newest seen"
        );
        assert_eq!(monotonic(&seen, 9), 9);
        let seen = AtomicU32::new(u32::MAX - 1);
        assert_eq!(monotonic(&seen, 2), 2, "wraps");
        assert_eq!(monotonic(&seen, u32::MAX), 2);
    }
}
