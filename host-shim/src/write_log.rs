//! Which memory the engines wrote through one address space, while someone asks (live
//! migration's pre-copy, [`crate::Gpu::track_writes`]): a set of 4 KiB granules of VRAM
//! and of system memory (4 KiB: the smallest VRAM alignment, so two allocations never
//! share a granule). Engines note a write *after* it landed, and the reader takes (and
//! clears) a range *before* it copies it, so a write is either in that copy or noted for
//! the next one. A take clears only granules wholly inside its range: a granule shared
//! with a neighbour stays noted for the neighbour's take.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::hal::MapTarget;

/// Tracking granule.
pub const WRITE_GRANULE: u64 = 4 << 10;

/// A granule: VRAM or system memory, and its index.
type Granule = (bool, u64);

#[derive(Default)]
pub struct WriteLog {
    on: AtomicBool,
    written: Mutex<HashSet<Granule>>,
}

fn granules(target: MapTarget, len: u64) -> (bool, u64, u64) {
    let (vram, addr) = match target {
        MapTarget::Vram { offset } => (true, offset),
        MapTarget::Sysram { addr } => (false, addr),
    };
    let first = addr / WRITE_GRANULE;
    let last = addr.saturating_add(len.max(1) - 1) / WRITE_GRANULE;
    (vram, first, last)
}

impl WriteLog {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<Granule>> {
        self.written.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts (clearing the record) or stops recording.
    pub fn set(&self, on: bool) {
        let mut w = self.lock();
        w.clear();
        self.on.store(on, Ordering::SeqCst);
    }

    /// Records a write of `len` bytes at `target` (after it landed).
    pub fn note(&self, target: MapTarget, len: u64) {
        if !self.on.load(Ordering::SeqCst) || len == 0 {
            return;
        }
        let (vram, first, last) = granules(target, len);
        let mut w = self.lock();
        for g in first..=last {
            w.insert((vram, g));
        }
    }

    /// Whether anything in `len` bytes at `target` was written since the last take
    /// covering it; clears that part. `true` when not recording (nothing is known).
    pub fn take(&self, target: MapTarget, len: u64) -> bool {
        if !self.on.load(Ordering::SeqCst) {
            return true;
        }
        let (vram, first, last) = granules(target, len);
        let addr = match target {
            MapTarget::Vram { offset } => offset,
            MapTarget::Sysram { addr } => addr,
        };
        let end = addr.saturating_add(len.max(1));
        let mut w = self.lock();
        let mut any = false;
        for g in first..=last {
            let whole = g * WRITE_GRANULE >= addr && (g + 1) * WRITE_GRANULE <= end;
            any |= if whole {
                w.remove(&(vram, g))
            } else {
                w.contains(&(vram, g))
            };
        }
        any
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_noted_write_is_taken_once_and_only_where_it_landed() {
        let log = WriteLog::default();
        let v = |offset| MapTarget::Vram { offset };
        assert!(log.take(v(0), 4096), "not recording: everything written");
        log.set(true);
        assert!(!log.take(v(0), 2 << 20));
        log.note(v(0x30_0000), 8);
        log.note(MapTarget::Sysram { addr: 0x10_0000 }, 1);
        assert!(!log.take(v(0), 2 << 20));
        assert!(
            !log.take(v(0x10_0000), 4096),
            "a sysram write is not VRAM's"
        );
        assert!(log.take(v(0x20_0000), 2 << 20));
        assert!(!log.take(v(0x20_0000), 2 << 20), "taken");
        assert!(log.take(MapTarget::Sysram { addr: 0x10_0000 }, 4096));
        // A write straddling two granules shows in either half.
        log.note(v(WRITE_GRANULE - 4), 8);
        assert!(log.take(v(WRITE_GRANULE), WRITE_GRANULE));
        assert!(log.take(v(0), WRITE_GRANULE));
        // Two neighbours sharing a granule: one's take does not hide the other's write.
        log.note(v(3 * WRITE_GRANULE + 100), 4);
        assert!(
            log.take(v(3 * WRITE_GRANULE), 512),
            "the shared granule is dirty"
        );
        assert!(
            log.take(v(3 * WRITE_GRANULE + 512), 512),
            "still noted for the neighbour"
        );
        assert!(log.take(v(3 * WRITE_GRANULE), WRITE_GRANULE));
        assert!(!log.take(v(3 * WRITE_GRANULE + 512), 512));
        log.set(false);
        assert!(log.take(v(0), 1));
    }
}
