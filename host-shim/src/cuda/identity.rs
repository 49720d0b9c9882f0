//! Guest GPU addresses that are device addresses, for kernels that follow pointers
//! stored in memory (issue 31, docs/design/guest-modules.md, "Identity addressing").
//!
//! vgpu translates every pointer it is shown (builtin kernels' operands, a module
//! launch's relocated parameters) through the context's page tables, but a pointer a
//! kernel reads from memory is the guest's own virtual address, which the device knows
//! nothing of. So a 2 MiB-page VRAM mapping at guest VA `va` is mapped a second time in
//! the device's address space *at `va` itself*: each granule's physical allocation
//! ([`DeviceVram::granule`]), placed in a reservation made at the guest's address. The
//! guest's runtime puts each context's 2 MiB-page buffers in a terabyte slot of its own
//! choosing, so different contexts of one VM rarely want the same addresses.
//!
//! Reservations come in [`WINDOW`]-sized, [`WINDOW`]-aligned windows, each made for one
//! context at its first mapping there, with the window's address as the driver's hint. A
//! window the driver places elsewhere (the range is taken: another context of the VM,
//! the worker's own memory) is given back and marked refused for that context: its
//! mappings there are translated only, as before this module, and a kernel following a
//! stored pointer into them faults (its VM's worker is lost, nobody else's).
//!
//! Why a kernel never reaches memory that is not its context's current data:
//! 1. A mirror page exists only while the context's page table maps that VA to that
//!    granule: [`Mirrors::map`] adds it after the page table took the mapping;
//!    [`Mirrors::unmap`] and [`Mirrors::remap`] drop it before the page table changes
//!    (the caller drains the context's work first, as a TLB invalidation does), and a
//!    remap re-adds it only for a whole granule moved to VRAM.
//! 2. Windows belong to one context; another context's mapping in them is never
//!    mirrored, and a context's destruction unmaps all its pages and frees its windows.
//! 3. Granules are VRAM of this GPU's own pool, so a mirror can only show memory the
//!    worker's VM was given; while a granule is evicted its mirror is absent (a fault, not
//!    stale data).
//!
//! A launch's relocated parameter is passed as the guest's own address when every page
//! it may touch is mirrored ([`Mirrors::covers`]), so pointers a kernel derives from it
//! and stores are guest addresses too.

use std::collections::BTreeMap;

use super::device::{Device, VM_GRANULE};
use super::vram::DeviceVram;
use crate::hal::ContextId;

/// Size and alignment of one reservation: 32 GiB, the most a context is likely to map in
/// one place (a VM's VRAM and its swap), and a size the driver reserves at a hint.
pub const WINDOW: u64 = 32 << 30;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Window {
    /// Reserved at its own address for this context.
    Owned(ContextId),
    /// The driver would not reserve it there for this context.
    Refused(ContextId),
}

#[derive(Debug, Clone, Copy)]
struct Page {
    ctx: ContextId,
    writable: bool,
    /// Mapped on the device; `false` while the granule is in host memory (evicted), so
    /// that its return to VRAM mirrors it again.
    present: bool,
}

/// The mirrored pages of every context of one GPU.
#[derive(Debug, Default)]
pub(crate) struct Mirrors {
    windows: BTreeMap<u64, Window>,
    /// Mirrored 2 MiB pages (present or evicted) by guest VA.
    pages: BTreeMap<u64, Page>,
}

fn window_of(va: u64) -> u64 {
    va & !(WINDOW - 1)
}

impl Mirrors {
    /// Whether every window of `va..va+size` is `ctx`'s, reserving those not yet made.
    fn windows_for<D: Device>(&mut self, dev: &D, ctx: ContextId, va: u64, size: u64) -> bool {
        let mut w = window_of(va);
        while w < va + size {
            match self.windows.get(&w) {
                Some(Window::Owned(c)) if *c == ctx => {}
                Some(_) => return false,
                None => {
                    let owned = match dev.reserve_va(w, WINDOW) {
                        Ok(p) if p == w => true,
                        Ok(p) => {
                            dev.free_va(p, WINDOW);
                            false
                        }
                        Err(e) => {
                            log::debug!("cuda: no reservation at {w:#x}: {e}");
                            false
                        }
                    };
                    if !owned {
                        log::info!(
                            "cuda: context {ctx:?}: addresses at {w:#x} are taken; its \
                             buffers there are not device addresses"
                        );
                        self.windows.insert(w, Window::Refused(ctx));
                        return false;
                    }
                    self.windows.insert(w, Window::Owned(ctx));
                }
            }
            w += WINDOW;
        }
        true
    }

    /// Mirrors a new 2 MiB-page mapping at `va`: of VRAM at `offset` (`Some`), or of host
    /// memory (`None`: a VRAM buffer placed in host memory at allocation, whose pages are
    /// listed as evicted so that they are mirrored when they move to VRAM). Best effort:
    /// a mapping that cannot be mirrored whole is not mirrored at all.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn map<D: Device>(
        &mut self,
        dev: &D,
        vram: &DeviceVram,
        ctx: ContextId,
        va: u64,
        size: u64,
        offset: Option<u64>,
        writable: bool,
    ) {
        let aligned = [va, size, offset.unwrap_or(0)]
            .iter()
            .all(|v| v.is_multiple_of(VM_GRANULE));
        if !aligned || size == 0 || va.checked_add(size).is_none() {
            return;
        }
        if !self.windows_for(dev, ctx, va, size) {
            return;
        }
        let Some(offset) = offset else {
            let mut at = va;
            while at < va + size {
                self.pages.entry(at).or_insert(Page {
                    ctx,
                    writable,
                    present: false,
                });
                at += VM_GRANULE;
            }
            return;
        };
        if let Err(e) = self.place(dev, vram, ctx, va, size, offset, writable) {
            log::warn!("cuda: context {ctx:?}: mirroring {va:#x}+{size:#x}: {e}");
        }
    }

    /// Maps `size / VM_GRANULE` granules from `offset` at `va`, or none of them.
    #[allow(clippy::too_many_arguments)]
    fn place<D: Device>(
        &mut self,
        dev: &D,
        vram: &DeviceVram,
        ctx: ContextId,
        va: u64,
        size: u64,
        offset: u64,
        writable: bool,
    ) -> Result<(), String> {
        let mut done = 0;
        while done < size {
            let at = va + done;
            let taken = self
                .pages
                .get(&at)
                .is_some_and(|p| p.present || p.ctx != ctx);
            let placed = match vram.granule(offset + done) {
                _ if taken => Err("a page there is mirrored".to_string()),
                Some(h) => dev
                    .map_physical(at, VM_GRANULE, h, writable)
                    .map_err(|e| e.to_string()),
                None => Err("outside VRAM".to_string()),
            };
            if let Err(e) = placed {
                self.drop_pages(dev, ctx, va, done, false);
                return Err(e);
            }
            self.pages.insert(
                at,
                Page {
                    ctx,
                    writable,
                    present: true,
                },
            );
            done += VM_GRANULE;
        }
        Ok(())
    }

    /// Unmaps `ctx`'s mirrored pages overlapping `va..va+size` from the device; returns
    /// them (present or evicted) with their writability. `keep`: they stay listed as
    /// evicted, else they are forgotten.
    fn drop_pages<D: Device>(
        &mut self,
        dev: &D,
        ctx: ContextId,
        va: u64,
        size: u64,
        keep: bool,
    ) -> Vec<(u64, bool)> {
        let from = va - va % VM_GRANULE;
        let hit: Vec<(u64, Page)> = self
            .pages
            .range(from..va.saturating_add(size))
            .filter(|(_, p)| p.ctx == ctx)
            .map(|(&at, p)| (at, *p))
            .collect();
        for (at, p) in &hit {
            if p.present {
                if let Err(e) = dev.unmap_va(*at, VM_GRANULE) {
                    log::warn!("cuda: unmapping the mirror at {at:#x}: {e}");
                }
            }
            if keep {
                self.pages.insert(
                    *at,
                    Page {
                        present: false,
                        ..*p
                    },
                );
            } else {
                self.pages.remove(at);
            }
        }
        hit.into_iter().map(|(at, p)| (at, p.writable)).collect()
    }

    /// `ctx`'s listed pages (present or evicted) overlapping `va..va+size`.
    fn overlapping(&self, ctx: ContextId, va: u64, size: u64) -> impl Iterator<Item = &Page> {
        let from = va - va % VM_GRANULE;
        self.pages
            .range(from..va.saturating_add(size))
            .map(|(_, p)| p)
            .filter(move |p| p.ctx == ctx)
    }

    /// Whether `ctx` has pages mapped on the device overlapping `va..va+size` (the caller
    /// then drains the context's work before [`Mirrors::unmap`] or [`Mirrors::remap`]).
    pub(crate) fn touches(&self, ctx: ContextId, va: u64, size: u64) -> bool {
        self.overlapping(ctx, va, size).any(|p| p.present)
    }

    /// Whether `ctx` has mirrored pages, present or evicted, overlapping `va..va+size`.
    pub(crate) fn has_pages(&self, ctx: ContextId, va: u64, size: u64) -> bool {
        self.overlapping(ctx, va, size).next().is_some()
    }

    /// The mapping at `va..va+size` is gone.
    pub(crate) fn unmap<D: Device>(&mut self, dev: &D, ctx: ContextId, va: u64, size: u64) {
        self.drop_pages(dev, ctx, va, size, false);
    }

    /// `va..va+size` now maps VRAM at `offset` (`Some`) or host memory (`None`): mirrors
    /// follow whole granules into VRAM and vanish otherwise.
    pub(crate) fn remap<D: Device>(
        &mut self,
        dev: &D,
        vram: &DeviceVram,
        ctx: ContextId,
        va: u64,
        size: u64,
        offset: Option<u64>,
    ) {
        // Whole granules moved to host memory stay listed, to come back with them.
        for (at, writable) in self.drop_pages(dev, ctx, va, size, true) {
            let inside = at >= va && at + VM_GRANULE <= va + size;
            let placed = match (offset, inside) {
                (Some(o), true) => {
                    let r = self.place(dev, vram, ctx, at, VM_GRANULE, o + (at - va), writable);
                    if let Err(e) = &r {
                        log::warn!("cuda: context {ctx:?}: re-mirroring {at:#x}: {e}");
                    }
                    r.is_ok()
                }
                (None, true) => continue,
                (_, false) => false,
            };
            if !placed {
                self.pages.remove(&at);
            }
        }
    }

    /// Whether every page of `va..va+len` is mirrored for `ctx` (writable if `write`).
    pub(crate) fn covers(&self, ctx: ContextId, va: u64, len: u64, write: bool) -> bool {
        let Some(end) = va.checked_add(len.max(1)) else {
            return false;
        };
        let mut at = va - va % VM_GRANULE;
        while at < end {
            match self.pages.get(&at) {
                Some(p) if p.ctx == ctx && p.present && (p.writable || !write) => {}
                _ => return false,
            }
            at += VM_GRANULE;
        }
        true
    }

    /// The context is gone: its pages are unmapped and its windows freed.
    pub(crate) fn forget<D: Device>(&mut self, dev: &D, ctx: ContextId) {
        self.drop_pages(dev, ctx, 0, u64::MAX, false);
        self.windows.retain(|&w, win| match *win {
            Window::Owned(c) if c == ctx => {
                dev.free_va(w, WINDOW);
                false
            }
            Window::Refused(c) => c != ctx,
            Window::Owned(_) => true,
        });
    }

    /// The GPU goes: every page unmapped, every window freed.
    pub(crate) fn forget_all<D: Device>(&mut self, dev: &D) {
        for (&at, _) in self.pages.iter().filter(|(_, p)| p.present) {
            if let Err(e) = dev.unmap_va(at, VM_GRANULE) {
                log::warn!("cuda: unmapping the mirror at {at:#x}: {e}");
            }
        }
        self.pages.clear();
        for (&w, win) in &self.windows {
            if let Window::Owned(_) = win {
                dev.free_va(w, WINDOW);
            }
        }
        self.windows.clear();
    }

    /// Mirrored pages mapped on the device.
    #[cfg(test)]
    pub(crate) fn pages(&self) -> usize {
        self.pages.values().filter(|p| p.present).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::FakeDevice;

    const G: u64 = VM_GRANULE;

    /// Each test its own terabyte: tests share the process's address space.
    fn slot(n: u64) -> u64 {
        0x600_0000_0000 + (n << 40)
    }

    /// Reads a `u64` through the device's address space (host addresses on the fake).
    fn read(dev: &FakeDevice, at: u64) -> u64 {
        let mut b = [0u8; 8];
        // SAFETY: `b` is 8 writable bytes; `at` is mapped (the tests check `covers`).
        unsafe { dev.copy_to_host(b.as_mut_ptr(), at, 8) }.unwrap();
        u64::from_le_bytes(b)
    }

    #[test]
    fn a_mapping_is_mirrored_at_the_guests_address_and_follows_moves() {
        let dev = FakeDevice::default();
        let vram = DeviceVram::new(&dev, 16 * G).unwrap();
        let mut m = Mirrors::default();
        let (a, va) = (ContextId(1), slot(0) + 4 * G);
        vram.write(&dev, 2 * G + 16, &7u64.to_le_bytes()).unwrap();
        m.map(&dev, &vram, a, va, 2 * G, Some(2 * G), true);
        assert!(m.covers(a, va, 2 * G, true));
        assert!(
            !m.covers(ContextId(2), va, 8, false),
            "another context's pages"
        );
        assert!(!m.covers(a, va, 3 * G, false), "past the mapping");
        assert_eq!(
            read(&dev, va + 16),
            7,
            "the guest's address reaches its VRAM"
        );
        // The second page moves to host memory, then back to other VRAM.
        m.remap(&dev, &vram, a, va + G, G, None);
        assert!(m.covers(a, va, G, true) && !m.covers(a, va + G, 1, false));
        vram.write(&dev, 9 * G, &9u64.to_le_bytes()).unwrap();
        m.remap(&dev, &vram, a, va + G, G, Some(9 * G));
        assert_eq!(read(&dev, va + G), 9);
        assert!(m.touches(a, va + G + 5, 1));
        m.unmap(&dev, a, va, 2 * G);
        assert_eq!(m.pages(), 0);
        m.forget(&dev, a);
        assert!(m.windows.is_empty());
        vram.free(&dev);
    }

    #[test]
    fn a_buffer_placed_in_host_memory_is_mirrored_when_it_moves_to_vram() {
        let dev = FakeDevice::default();
        let vram = DeviceVram::new(&dev, 8 * G).unwrap();
        let mut m = Mirrors::default();
        let (a, va) = (ContextId(1), slot(3));
        m.map(&dev, &vram, a, va, 2 * G, None, true);
        assert_eq!(m.pages(), 0);
        assert!(!m.covers(a, va, 1, false) && !m.touches(a, va, 2 * G));
        assert!(m.has_pages(a, va, 2 * G));
        vram.write(&dev, 4 * G, &5u64.to_le_bytes()).unwrap();
        m.remap(&dev, &vram, a, va, G, Some(4 * G));
        assert!(m.covers(a, va, G, true) && !m.covers(a, va + G, 1, false));
        assert_eq!(read(&dev, va), 5);
        m.forget(&dev, a);
        assert!(!m.has_pages(a, va, 2 * G));
        vram.free(&dev);
    }

    #[test]
    fn what_cannot_be_mirrored_whole_is_not_mirrored() {
        let dev = FakeDevice::default();
        let vram = DeviceVram::new(&dev, 8 * G).unwrap();
        let mut m = Mirrors::default();
        let (a, b, va) = (ContextId(1), ContextId(2), slot(1));
        m.map(&dev, &vram, a, va + 4096, G, Some(0), true);
        m.map(&dev, &vram, a, va, G, Some(4096), true);
        m.map(&dev, &vram, a, va, 4 * G, Some(6 * G), true);
        assert_eq!(m.pages(), 0, "unaligned, or reaching past VRAM: nothing");
        m.map(&dev, &vram, a, va, G, Some(0), false);
        assert!(m.covers(a, va, G, false) && !m.covers(a, va, G, true));
        // The window is `a`'s: `b` mapping there is translated only.
        m.map(&dev, &vram, b, va + 8 * G, G, Some(G), true);
        assert!(!m.covers(b, va + 8 * G, 1, false));
        // An address the driver will not reserve (taken by someone else) is refused.
        let taken = dev.reserve_va(slot(2), G).unwrap();
        assert_eq!(taken, slot(2));
        m.map(&dev, &vram, b, slot(2), G, Some(2 * G), true);
        assert!(!m.covers(b, slot(2), 1, false));
        assert_eq!(m.windows.get(&slot(2)), Some(&Window::Refused(b)));
        m.forget(&dev, b);
        assert!(!m.windows.contains_key(&slot(2)));
        m.forget_all(&dev);
        assert_eq!(m.pages(), 0);
        dev.free_va(taken, G);
        vram.free(&dev);
    }
}
