//! GPU virtual-address allocation for one context.
//!
//! The GPU refuses to mix page sizes inside one 2 MiB region, so small-page and big-page
//! buffers come from separate, 2 MiB-aligned arenas. Every buffer is followed by an
//! unmapped guard gap of one page, so running off its end faults instead of silently
//! touching a neighbour.

use std::collections::BTreeMap;

use vgpu_host_shim::hal::PageSize;

/// Where small-page buffers start. Low addresses stay unmapped so that small integers
/// used as pointers fault.
pub const SMALL_BASE: u64 = 0x1_0000_0000;
/// Where big-page buffers start (and small-page ones end).
pub const BIG_BASE: u64 = 0x40_0000_0000;
/// Where huge-page buffers start (and big-page ones end).
pub const HUGE_BASE: u64 = 0x400_0000_0000;
/// End of the runtime's part of the address space.
pub const VA_END: u64 = 0x8000_0000_0000;

/// First-fit allocator over one arena with coalescing free ranges.
#[derive(Debug)]
struct Arena {
    /// Free ranges: start → length.
    free: BTreeMap<u64, u64>,
}

impl Arena {
    fn new(start: u64, end: u64) -> Self {
        let mut free = BTreeMap::new();
        free.insert(start, end - start);
        Arena { free }
    }

    fn alloc(&mut self, size: u64, align: u64) -> Option<u64> {
        let (start, len, at) = self.free.iter().find_map(|(&s, &l)| {
            let at = s.checked_add(align - 1)? & !(align - 1);
            let end = at.checked_add(size)?;
            (end <= s + l).then_some((s, l, at))
        })?;
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, at - start);
        }
        let end = at + size;
        if end < start + len {
            self.free.insert(end, start + len - end);
        }
        Some(at)
    }

    fn release(&mut self, mut start: u64, mut size: u64) {
        if let Some((&ps, &pl)) = self.free.range(..start).next_back() {
            if ps + pl == start {
                self.free.remove(&ps);
                start = ps;
                size += pl;
            }
        }
        if let Some(&nl) = self.free.get(&(start + size)) {
            self.free.remove(&(start + size));
            size += nl;
        }
        self.free.insert(start, size);
    }
}

/// The VA space of one context.
#[derive(Debug)]
pub struct VaSpace {
    small: Arena,
    big: Arena,
    huge: Arena,
}

impl Default for VaSpace {
    fn default() -> Self {
        VaSpace {
            small: Arena::new(SMALL_BASE, BIG_BASE),
            big: Arena::new(BIG_BASE, HUGE_BASE),
            huge: Arena::new(HUGE_BASE, VA_END),
        }
    }
}

impl VaSpace {
    fn arena(&mut self, page: PageSize) -> &mut Arena {
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
        self.arena(page).alloc(total, p)
    }

    /// Returns a reservation made by [`VaSpace::alloc`] with the same size and page.
    pub fn release(&mut self, va: u64, size: u64, page: PageSize) {
        let p = page.bytes();
        self.arena(page).release(va, size + p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_gaps_and_reuse() {
        let mut v = VaSpace::default();
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
        assert_eq!(v.small.free.len(), 1);
    }

    #[test]
    fn exhaustion_is_reported() {
        let mut v = VaSpace::default();
        assert!(v.alloc(BIG_BASE, PageSize::Small4K).is_none());
        assert!(v.alloc(u64::MAX - 10, PageSize::Big64K).is_none());
    }
}
