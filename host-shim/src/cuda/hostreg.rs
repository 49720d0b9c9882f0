//! Host memory the device may reach: which ranges are registered with the driver and
//! which mappings use them. Ranges are registered once (the driver refuses overlapping
//! registrations) and unregistered when the last mapping using them is gone — promptly,
//! because the owner may free the memory and a later allocation may land at the same
//! address with other pages behind it, which a stale registration would not see.

use std::collections::{BTreeMap, BTreeSet};

use super::device::Device;
use super::error::DeviceError;
use crate::hal::ContextId;

const PAGE: usize = 4096;

/// A system-memory mapping: its context and GPU virtual address.
pub type MapKey = (ContextId, u64);

struct Piece {
    len: usize,
    users: BTreeSet<MapKey>,
}

/// Disjoint registered pieces, keyed by start address.
#[derive(Default)]
pub struct HostRegistry {
    pieces: BTreeMap<usize, Piece>,
}

impl HostRegistry {
    /// Makes `ptr..ptr+len` (widened to whole pages) reachable for mapping `key`.
    pub fn register<D: Device>(
        &mut self,
        dev: &D,
        key: MapKey,
        ptr: *mut u8,
        len: usize,
    ) -> Result<(), DeviceError> {
        let start = ptr as usize & !(PAGE - 1);
        let end = (ptr as usize).saturating_add(len).next_multiple_of(PAGE);
        let mut at = start;
        // Pieces that begin before `start` may still cover it.
        let first = self
            .pieces
            .range(..=start)
            .next_back()
            .map(|(&s, _)| s)
            .unwrap_or(start);
        let existing: Vec<(usize, usize)> = self
            .pieces
            .range(first..end)
            .map(|(&s, p)| (s, p.len))
            .filter(|&(s, l)| s + l > start)
            .collect();
        let mut fresh = Vec::new();
        for (s, l) in existing {
            if s > at {
                fresh.push((at, s - at));
            }
            if let Some(p) = self.pieces.get_mut(&s) {
                p.users.insert(key);
            }
            at = at.max(s + l);
        }
        if at < end {
            fresh.push((at, end - at));
        }
        for (s, l) in fresh {
            dev.register_host(s as *mut u8, l)?;
            self.pieces.insert(
                s,
                Piece {
                    len: l,
                    users: BTreeSet::from([key]),
                },
            );
        }
        Ok(())
    }

    /// Drops the mappings `gone` selects from every piece; pieces nobody uses any more
    /// are unregistered.
    pub fn release<D: Device>(&mut self, dev: &D, gone: impl Fn(&MapKey) -> bool) {
        self.pieces.retain(|&s, p| {
            p.users.retain(|k| !gone(k));
            if p.users.is_empty() {
                if let Err(e) = dev.unregister_host(s as *mut u8) {
                    log::warn!("cuda: unregistering host memory at {s:#x}: {e}");
                }
                false
            } else {
                true
            }
        });
    }

    /// The end of the registered piece that contains `addr`, if one does.
    pub fn piece_end(&self, addr: usize) -> Option<usize> {
        self.pieces
            .range(..=addr)
            .next_back()
            .map(|(&s, p)| s + p.len)
            .filter(|&end| end > addr)
    }

    /// How many bytes of `addr..addr+len` lie in registered pieces.
    pub fn registered_bytes(&self, addr: usize, len: usize) -> usize {
        let end = addr.saturating_add(len);
        let first = self
            .pieces
            .range(..=addr)
            .next_back()
            .map(|(&s, _)| s)
            .unwrap_or(addr);
        self.pieces
            .range(first..end)
            .map(|(&s, p)| (s.max(addr), (s + p.len).min(end)))
            .filter(|(a, b)| b > a)
            .map(|(a, b)| b - a)
            .sum()
    }

    /// Registered pieces (leak checks).
    pub fn pieces(&self) -> usize {
        self.pieces.len()
    }
}
