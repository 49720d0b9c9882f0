//! Range allocation: first fit over a free list with coalescing. Used for VRAM by the
//! host-shim GPUs (`vgpu_host_shim::vram`) and for GPU virtual addresses by the runtime.

use std::collections::BTreeMap;

/// Smallest unit of VRAM allocation (the GPU's small page).
pub const VRAM_GRANULE: u64 = 4096;

/// Tracks which parts of `start..end` are in use. Offsets and sizes are multiples of
/// the granule.
#[derive(Debug)]
pub struct RangeAllocator {
    start: u64,
    end: u64,
    granule: u64,
    /// Free ranges: start → length.
    free: BTreeMap<u64, u64>,
    /// Allocations: start → length.
    used: BTreeMap<u64, u64>,
}

/// The VRAM allocator: a range allocator over `0..size` in 4 KiB granules.
pub type VramAllocator = RangeAllocator;

impl RangeAllocator {
    /// VRAM of `size` bytes (rounded down to the granule).
    pub fn new(size: u64) -> Self {
        Self::with_range(0, size, VRAM_GRANULE)
    }

    /// Manages `start..end` in units of `granule` (a power of two; `start` and `end` are
    /// rounded inwards to it).
    pub fn with_range(start: u64, end: u64, granule: u64) -> Self {
        let granule = granule.max(1).next_power_of_two();
        let start = start.checked_next_multiple_of(granule).unwrap_or(u64::MAX);
        let end = end / granule * granule;
        let mut free = BTreeMap::new();
        if end > start {
            free.insert(start, end - start);
        }
        RangeAllocator {
            start,
            end,
            granule,
            free,
            used: BTreeMap::new(),
        }
    }

    /// Bytes managed.
    pub fn size(&self) -> u64 {
        self.end.saturating_sub(self.start)
    }

    pub fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }

    /// Allocates `size` bytes (rounded up to the granule) aligned to `align` (a power of
    /// two, at least the granule). Returns the offset and the rounded size.
    pub fn alloc(&mut self, size: u64, align: u64) -> Option<(u64, u64)> {
        if size == 0 || !align.is_power_of_two() {
            return None;
        }
        let align = align.max(self.granule);
        let size = size.checked_next_multiple_of(self.granule)?;
        let (start, len, at) = self.free.iter().find_map(|(&start, &len)| {
            let at = start.checked_next_multiple_of(align)?;
            let end = at.checked_add(size)?;
            (end <= start + len).then_some((start, len, at))
        })?;
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, at - start);
        }
        let end = at + size;
        if end < start + len {
            self.free.insert(end, start + len - end);
        }
        self.used.insert(at, size);
        Some((at, size))
    }

    /// Frees the allocation at `offset`; returns its size, or `None` if there is none.
    pub fn free(&mut self, offset: u64) -> Option<u64> {
        let size = self.used.remove(&offset)?;
        let mut start = offset;
        let mut len = size;
        if let Some((&pstart, &plen)) = self.free.range(..offset).next_back() {
            if pstart + plen == offset {
                self.free.remove(&pstart);
                start = pstart;
                len += plen;
            }
        }
        if let Some(&nlen) = self.free.get(&(offset + size)) {
            self.free.remove(&(offset + size));
            len += nlen;
        }
        self.free.insert(start, len);
        Some(size)
    }

    /// Size of the allocation at `offset`.
    pub fn allocation(&self, offset: u64) -> Option<u64> {
        self.used.get(&offset).copied()
    }

    /// Number of live allocations.
    pub fn allocations(&self) -> usize {
        self.used.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn alloc_free_coalesce() {
        let mut a = VramAllocator::new(1 << 20);
        let (x, _) = a.alloc(4096, 4096).unwrap();
        let (y, ys) = a.alloc(5000, 4096).unwrap();
        assert_eq!(ys, 8192);
        let (z, _) = a.alloc(65536, 65536).unwrap();
        assert_eq!(z % 65536, 0);
        assert!(a.alloc(1 << 21, 4096).is_none());
        assert_eq!(a.free(y), Some(8192));
        assert_eq!(a.free(y), None);
        a.free(x);
        a.free(z);
        assert_eq!(a.free_bytes(), 1 << 20);
        assert_eq!(a.alloc(1 << 20, 4096), Some((0, 1 << 20)));
        assert_eq!(a.alloc(0, 4096), None);
        assert_eq!(a.alloc(4096, 3), None);
        assert_eq!(a.alloc(u64::MAX, 4096), None);
    }

    proptest! {
        #[test]
        fn never_overlaps(ops in proptest::collection::vec((1u64..200_000, 0u32..6, any::<bool>()), 1..100)) {
            let mut a = VramAllocator::new(4 << 20);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (size, align_shift, free_one) in ops {
                if free_one && !live.is_empty() {
                    let (off, len) = live.remove(size as usize % live.len());
                    prop_assert_eq!(a.free(off), Some(len));
                } else if let Some((off, len)) = a.alloc(size, 4096 << align_shift) {
                    prop_assert_eq!(off % (4096 << align_shift), 0);
                    prop_assert!(off + len <= 4 << 20);
                    for &(o, l) in &live {
                        prop_assert!(off + len <= o || o + l <= off);
                    }
                    live.push((off, len));
                }
                let used: u64 = live.iter().map(|l| l.1).sum();
                prop_assert_eq!(a.free_bytes() + used, 4 << 20);
            }
        }
    }
}
