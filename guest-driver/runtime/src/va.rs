//! GPU virtual-address allocation for one context.
//!
//! The GPU refuses to mix page sizes inside one 2 MiB region, so small-page and big-page
//! buffers come from separate, 2 MiB-aligned arenas. Every buffer is followed by an
//! unmapped guard gap of one page, so running off its end faults instead of silently
//! touching a neighbour.
//!
//! Huge-page (2 MiB) buffers are where the `cuda` GPU makes the guest's address the
//! device's own, so kernels can follow pointers stored in memory (docs/design/
//! guest-modules.md, "Identity addressing"). The host does that per context in its GPU
//! worker's one address space, so each context starts its huge-page buffers in a
//! terabyte slot of its own ([`HUGE_SLOTS`] of them): the one the host names in
//! `CREATE_CONTEXT`'s reply, none of the VM's other contexts' (else, from a host that
//! names none, one picked at random).

use vgpu_protocol::mem::PageSize;
use vgpu_protocol::range::RangeAllocator;

/// Where small-page buffers start. Low addresses stay unmapped so that small integers
/// used as pointers fault.
pub const SMALL_BASE: u64 = 0x1_0000_0000;
/// Where big-page buffers start (and small-page ones end).
pub const BIG_BASE: u64 = 0x40_0000_0000;
/// Where huge-page buffers start (and big-page ones end).
pub const HUGE_BASE: u64 = vgpu_protocol::mem::HUGE_BASE;
/// End of the runtime's part of the address space.
pub const VA_END: u64 = 0x8000_0000_0000;
/// How many 1 TiB slots a context's huge-page buffers may start in, from [`HUGE_BASE`].
pub const HUGE_SLOTS: u64 = vgpu_protocol::mem::HUGE_SLOTS as u64;
/// The span of one slot.
pub const HUGE_SLOT_BYTES: u64 = vgpu_protocol::mem::HUGE_SLOT_BYTES;

/// A slot for a new context: random (std's per-process random keys, varied per call).
fn random_huge_slot() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish() % HUGE_SLOTS
}

/// The VA space of one context.
#[derive(Debug)]
pub struct VaSpace {
    small: RangeAllocator,
    big: RangeAllocator,
    huge: RangeAllocator,
}

impl Default for VaSpace {
    fn default() -> Self {
        VaSpace::with_huge_slot(random_huge_slot())
    }
}

impl VaSpace {
    /// A space whose huge-page buffers start in slot `slot` (below [`HUGE_SLOTS`]).
    pub fn with_huge_slot(slot: u64) -> Self {
        let huge_start = HUGE_BASE + (slot % HUGE_SLOTS) * HUGE_SLOT_BYTES;
        VaSpace {
            small: RangeAllocator::with_range(SMALL_BASE, BIG_BASE, 4 << 10),
            big: RangeAllocator::with_range(BIG_BASE, HUGE_BASE, 64 << 10),
            huge: RangeAllocator::with_range(huge_start, VA_END, 2 << 20),
        }
    }

    fn arena(&mut self, page: PageSize) -> &mut RangeAllocator {
        match page {
            PageSize::Small4K => &mut self.small,
            PageSize::Big64K => &mut self.big,
            PageSize::Huge2M => &mut self.huge,
        }
    }

    /// Reserves `size` bytes (a multiple of `page`) plus a guard page; returns the VA.
    pub fn alloc(&mut self, size: u64, page: PageSize) -> Option<u64> {
        let p = page.bytes();
        let total = size.checked_add(p)?;
        self.arena(page).alloc(total, p).map(|(va, _)| va)
    }

    /// Returns a reservation made by [`VaSpace::alloc`] with the same size and page.
    pub fn release(&mut self, va: u64, _size: u64, page: PageSize) {
        self.arena(page).free(va);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_gaps_and_reuse() {
        let mut v = VaSpace::with_huge_slot(0);
        let a = v.alloc(0x1000, PageSize::Small4K).unwrap();
        let b = v.alloc(0x2000, PageSize::Small4K).unwrap();
        assert_eq!(a, SMALL_BASE);
        assert_eq!(b, a + 0x2000, "one guard page between buffers");
        let c = v.alloc(0x10000, PageSize::Big64K).unwrap();
        assert_eq!(c, BIG_BASE);
        let d = v.alloc(2 << 20, PageSize::Huge2M).unwrap();
        assert_eq!(d, HUGE_BASE);
        assert_eq!(
            v.alloc(2 << 20, PageSize::Huge2M),
            Some(HUGE_BASE + (4 << 20))
        );
        v.release(a, 0x1000, PageSize::Small4K);
        v.release(b, 0x2000, PageSize::Small4K);
        // Coalesced back into one range: the next allocation starts at the base again.
        assert_eq!(v.alloc(0x4000, PageSize::Small4K), Some(SMALL_BASE));
        assert_eq!(v.small.allocations(), 1);
    }

    #[test]
    fn contexts_start_their_huge_buffers_in_slots_of_their_own() {
        let mut v = VaSpace::with_huge_slot(5);
        assert_eq!(
            v.alloc(2 << 20, PageSize::Huge2M),
            Some(HUGE_BASE + 5 * HUGE_SLOT_BYTES)
        );
        let slots: std::collections::HashSet<u64> = (0..64)
            .filter_map(|_| VaSpace::default().alloc(2 << 20, PageSize::Huge2M))
            .collect();
        assert!(
            slots.len() > 16,
            "random slots: {} distinct of 64",
            slots.len()
        );
        assert!(slots.iter().all(|&va| (HUGE_BASE..VA_END).contains(&va)));
    }

    #[test]
    fn exhaustion_is_reported() {
        let mut v = VaSpace::default();
        assert!(v.alloc(BIG_BASE, PageSize::Small4K).is_none());
        assert!(v.alloc(u64::MAX - 10, PageSize::Big64K).is_none());
    }
}
