//! A record of a GPU's host copies to and from VRAM (`Gpu::vram_read`/`vram_write` and
//! their batched `_many` forms), for tests that check how the backend copies VRAM; the
//! sim keeps one when [`crate::SimConfig::host_copy_log`] asks for it.

use std::sync::Mutex;

/// Which way a host copy went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyDir {
    /// VRAM to host memory (`vram_read`).
    FromVram,
    /// Host memory to VRAM (`vram_write`).
    ToVram,
}

/// One host-copy call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostCopy {
    /// One buffer (`vram_read`/`vram_write`).
    Single(CopyDir),
    /// One batched call (`vram_read_many`/`vram_write_many`) of this many buffers.
    Batch(CopyDir, usize),
}

/// The host copies so far, in call order.
#[derive(Debug, Default)]
pub struct HostCopyLog {
    copies: Mutex<Vec<HostCopy>>,
}

impl HostCopyLog {
    pub fn record(&self, copy: HostCopy) {
        self.lock().push(copy);
    }

    /// The copies so far, leaving the log empty.
    pub fn take(&self) -> Vec<HostCopy> {
        std::mem::take(&mut *self.lock())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<HostCopy>> {
        // A panic while pushing cannot leave the Vec half-changed: the record stands.
        self.copies.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Records `copy` in `log`, if there is one.
pub(crate) fn record_in(log: Option<&HostCopyLog>, copy: HostCopy) {
    if let Some(log) = log {
        log.record(copy);
    }
}
