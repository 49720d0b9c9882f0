//! The GPU MMU: one address space per context, two-level page tables with small (4 KiB),
//! big (64 KiB) and huge (2 MiB) pages, VRAM and SYSRAM targets, valid/read-only bits,
//! per-page access counters, and a TLB that holds translations until explicitly
//! invalidated (so page-table rewrites that skip the invalidation are visibly wrong,
//! as on hardware).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use vgpu_protocol::gp::GPU_VA_LIMIT;

use crate::hal::{HalError, MapFlags, MapTarget, PageSize, Result, SysMemory};
use crate::write_log::WriteLog;

/// VA span of one page directory entry.
const PDE_SPAN: u64 = 2 << 20;

// Host memory of the page tables, as [`AddressSpace::table_bytes`] counts it: what a
// guest's mappings cost the host. Upper bounds of what the allocator hands out.
/// A page's access counter: its own heap block (an `Arc`: two counts and a `u32`, 20
/// bytes, which malloc rounds up to a 32-byte chunk).
const COUNTER_BYTES: u64 = 32;
/// Heap block overhead of a page table (malloc's chunk header and rounding).
const BLOCK_OVERHEAD: u64 = 16;

/// Host bytes of one page directory entry of `page`'s size: its slot in the directory's
/// hash table (counted twice: the table may be up to half empty after it grows) and, for
/// big and small pages, its page table.
fn pde_bytes(page: PageSize) -> u64 {
    let entry = 2 * (std::mem::size_of::<(u64, Pde)>() as u64 + 1);
    match page {
        PageSize::Huge2M => entry,
        PageSize::Big64K | PageSize::Small4K => {
            let slots = PDE_SPAN / page.bytes();
            entry + slots * std::mem::size_of::<Option<Pte>>() as u64 + BLOCK_OVERHEAD
        }
    }
}
/// TLB capacity in entries; on overflow it is simply flushed.
const TLB_ENTRIES: usize = 1024;

/// A page-table entry. The access counter is shared with TLB entries so hits count too.
#[derive(Debug, Clone)]
struct Pte {
    target: MapTarget,
    read_only: bool,
    accesses: Arc<AtomicU32>,
}

#[derive(Debug)]
enum Pde {
    Huge(Pte),
    Big(Box<[Option<Pte>]>),
    Small(Box<[Option<Pte>]>),
}

impl Pde {
    fn page_size(&self) -> PageSize {
        match self {
            Pde::Huge(_) => PageSize::Huge2M,
            Pde::Big(_) => PageSize::Big64K,
            Pde::Small(_) => PageSize::Small4K,
        }
    }

    /// The slot for `va` in a table of big or small pages; a huge PDE has none.
    fn slot(&mut self, va: u64) -> Option<&mut Option<Pte>> {
        match self {
            Pde::Big(t) => t.get_mut(((va % PDE_SPAN) >> 16) as usize),
            Pde::Small(t) => t.get_mut(((va % PDE_SPAN) >> 12) as usize),
            Pde::Huge(_) => None,
        }
    }

    fn get(&self, va: u64) -> Option<&Pte> {
        match self {
            Pde::Huge(p) => Some(p),
            Pde::Big(t) => t.get(((va % PDE_SPAN) >> 16) as usize)?.as_ref(),
            Pde::Small(t) => t.get(((va % PDE_SPAN) >> 12) as usize)?.as_ref(),
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Pde::Huge(_) => false,
            Pde::Big(t) | Pde::Small(t) => t.iter().all(Option::is_none),
        }
    }
}

/// A successful translation: the target at `va` and how many bytes stay contiguous (to
/// the end of the page).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Translation {
    pub target: MapTarget,
    pub contiguous: u64,
}

/// Why a translation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TranslateError {
    NotMapped,
    ReadOnly,
}

#[derive(Debug, Clone)]
struct TlbEntry {
    page: PageSize,
    target: MapTarget,
    read_only: bool,
    accesses: Arc<AtomicU32>,
}

/// Hashes the TLB's keys (page-aligned GPU addresses) with one multiplication: the front
/// end translates a few addresses per GP entry, and SipHash's cost was a visible part of
/// its time per entry (H100, 2026-11-27: fetch and plan 0.8 µs of a 4.9 µs entry). The
/// keys come from guests, but the table never holds more than `TLB_ENTRIES`, so keys made
/// to collide slow only that address space's lookups, and only by so much.
#[derive(Default)]
struct PageKeyHasher(u64);

impl std::hash::Hasher for PageKeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, key: u64) {
        // The low 12 bits of a page base are zero; the multiplication spreads the rest.
        self.0 = (key >> 12).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type Tlb = HashMap<u64, TlbEntry, std::hash::BuildHasherDefault<PageKeyHasher>>;

/// One GPU address space.
pub struct AddressSpace {
    tables: RwLock<HashMap<u64, Pde>>,
    /// page base VA → cached entry. Filled on miss, emptied by `invalidate_tlb`.
    tlb: Mutex<Tlb>,
    sysmem: Arc<dyn SysMemory>,
    /// Engines hold this for reading while they touch memory through a translation;
    /// invalidation and teardown take it for writing, so once they return no engine is
    /// still using a host pointer obtained before (the owner may then free that memory).
    access: RwLock<()>,
    /// Set when the context is destroyed: every later access faults.
    dead: AtomicBool,
    /// Writes through this space, while migration asks ([`crate::Gpu::track_writes`]).
    writes: WriteLog,
    /// Host bytes the page tables take (see [`pde_bytes`]); changed under the tables'
    /// write lock.
    table_bytes: AtomicU64,
}

fn offset_target(t: MapTarget, by: u64) -> MapTarget {
    match t {
        MapTarget::Vram { offset } => MapTarget::Vram {
            offset: offset.wrapping_add(by),
        },
        MapTarget::Sysram { addr } => MapTarget::Sysram {
            addr: addr.wrapping_add(by),
        },
    }
}

fn target_addr(t: MapTarget) -> u64 {
    match t {
        MapTarget::Vram { offset } => offset,
        MapTarget::Sysram { addr } => addr,
    }
}

fn check_range(va: u64, size: u64, align: u64) -> Result<()> {
    if size == 0 {
        return Err(HalError::InvalidArgument("empty range"));
    }
    if !va.is_multiple_of(align) || !size.is_multiple_of(align) {
        return Err(HalError::InvalidArgument(
            "range not aligned to the page size",
        ));
    }
    match va.checked_add(size) {
        Some(end) if end <= GPU_VA_LIMIT => Ok(()),
        _ => Err(HalError::InvalidArgument(
            "range outside the GPU address space",
        )),
    }
}

impl AddressSpace {
    pub fn new(sysmem: Arc<dyn SysMemory>) -> Self {
        AddressSpace {
            tables: RwLock::new(HashMap::new()),
            tlb: Mutex::new(Tlb::default()),
            sysmem,
            access: RwLock::new(()),
            dead: AtomicBool::new(false),
            writes: WriteLog::default(),
            table_bytes: AtomicU64::new(0),
        }
    }

    /// Host bytes this space's page tables take now: per page directory entry its slot and
    /// page table, per mapped page its access counter.
    pub fn table_bytes(&self) -> u64 {
        self.table_bytes.load(Ordering::Relaxed)
    }

    /// What mapping `va..va+size` with pages of `page` would add to
    /// [`AddressSpace::table_bytes`] (0 for a range `map` would refuse).
    pub fn map_cost(&self, va: u64, size: u64, page: PageSize) -> u64 {
        let ps = page.bytes();
        if check_range(va, size, ps).is_err() {
            return 0;
        }
        let tables = self.read_tables();
        let first = va / PDE_SPAN;
        let last = (va + size - 1) / PDE_SPAN;
        let new_pdes = (first..=last).filter(|k| !tables.contains_key(k)).count() as u64;
        new_pdes * pde_bytes(page) + (size / ps) * COUNTER_BYTES
    }

    pub fn sysmem(&self) -> &dyn SysMemory {
        &*self.sysmem
    }

    fn read_tables(&self) -> std::sync::RwLockReadGuard<'_, HashMap<u64, Pde>> {
        self.tables.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write_tables(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<u64, Pde>> {
        self.tables.write().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_tlb(&self) -> std::sync::MutexGuard<'_, Tlb> {
        self.tlb.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Maps `size` bytes at `va` to consecutive target addresses from `target`.
    pub fn map(
        &self,
        va: u64,
        size: u64,
        target: MapTarget,
        page: PageSize,
        flags: MapFlags,
    ) -> Result<()> {
        let ps = page.bytes();
        check_range(va, size, ps)?;
        if !target_addr(target).is_multiple_of(ps) {
            return Err(HalError::InvalidArgument(
                "target not aligned to the page size",
            ));
        }
        if target_addr(target).checked_add(size).is_none() {
            return Err(HalError::InvalidArgument("target range overflows"));
        }
        let mut tables = self.write_tables();
        // Validate everything first so a failed map changes nothing.
        let mut p = va;
        while p < va + size {
            if let Some(pde) = tables.get(&(p / PDE_SPAN)) {
                if pde.page_size() != page {
                    return Err(HalError::PageSizeConflict(p - p % PDE_SPAN));
                }
                if pde.get(p).is_some() {
                    return Err(HalError::Overlap { va, size });
                }
            }
            p += ps;
        }
        let mut p = va;
        let mut added = 0;
        while p < va + size {
            let pte = Pte {
                target: offset_target(target, p - va),
                read_only: flags.read_only,
                accesses: Arc::new(AtomicU32::new(0)),
            };
            added += COUNTER_BYTES;
            let key = p / PDE_SPAN;
            match page {
                PageSize::Huge2M => {
                    tables.insert(key, Pde::Huge(pte));
                    added += pde_bytes(page);
                }
                PageSize::Big64K | PageSize::Small4K => {
                    let pde = tables.entry(key).or_insert_with(|| {
                        added += pde_bytes(page);
                        let n = (PDE_SPAN / ps) as usize;
                        let t = vec![None; n].into_boxed_slice();
                        if page == PageSize::Big64K {
                            Pde::Big(t)
                        } else {
                            Pde::Small(t)
                        }
                    });
                    if let Some(slot) = pde.slot(p) {
                        *slot = Some(pte);
                    }
                }
            }
            p += ps;
        }
        self.table_bytes.fetch_add(added, Ordering::Relaxed);
        Ok(())
    }

    /// Visits every page in `va..va+size`, which must be covered exactly by mapped pages.
    fn for_each_mapped(
        tables: &mut HashMap<u64, Pde>,
        va: u64,
        size: u64,
        mut f: impl FnMut(u64, &mut Pde),
    ) -> Result<()> {
        check_range(va, size, PageSize::Small4K.bytes())?;
        // First pass: the range must consist of whole mapped pages.
        let mut p = va;
        while p < va + size {
            let pde = tables
                .get(&(p / PDE_SPAN))
                .ok_or(HalError::NotMapped { va, size })?;
            let ps = pde.page_size().bytes();
            if !p.is_multiple_of(ps) || p + ps > va + size || pde.get(p).is_none() {
                return Err(HalError::NotMapped { va, size });
            }
            p += ps;
        }
        let mut p = va;
        while p < va + size {
            let key = p / PDE_SPAN;
            let Some(pde) = tables.get_mut(&key) else {
                break;
            };
            let ps = pde.page_size().bytes();
            f(p, pde);
            p += ps;
        }
        Ok(())
    }

    /// Unmaps whole pages covering exactly `va..va+size`. Needs a TLB invalidation to take
    /// effect for the engines.
    pub fn unmap(&self, va: u64, size: u64) -> Result<()> {
        let mut tables = self.write_tables();
        let mut emptied = Vec::new();
        let mut freed = 0;
        Self::for_each_mapped(&mut tables, va, size, |p, pde| {
            freed += COUNTER_BYTES;
            if let Pde::Huge(_) = pde {
                emptied.push(p / PDE_SPAN);
            } else {
                if let Some(slot) = pde.slot(p) {
                    *slot = None;
                }
                if pde.is_empty() {
                    emptied.push(p / PDE_SPAN);
                }
            }
        })?;
        for k in emptied {
            if let Some(pde) = tables.remove(&k) {
                freed += pde_bytes(pde.page_size());
            }
        }
        // Saturating: the count never goes below what the tables hold.
        let _ = self
            .table_bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some(b.saturating_sub(freed))
            });
        Ok(())
    }

    /// Points the existing pages of `va..va+size` at consecutive addresses from `target`,
    /// keeping page sizes, flags and access counters.
    pub fn remap(&self, va: u64, size: u64, target: MapTarget) -> Result<()> {
        let mut tables = self.write_tables();
        // The new target must be aligned like every page it backs; check the largest.
        let mut largest = PageSize::Small4K.bytes();
        Self::for_each_mapped(&mut tables, va, size, |_, pde| {
            largest = largest.max(pde.page_size().bytes());
        })?;
        if !target_addr(target).is_multiple_of(largest)
            || target_addr(target).checked_add(size).is_none()
        {
            return Err(HalError::InvalidArgument(
                "target not aligned to the page size",
            ));
        }
        Self::for_each_mapped(&mut tables, va, size, |p, pde| {
            let new = offset_target(target, p - va);
            match pde {
                Pde::Huge(pte) => pte.target = new,
                _ => {
                    if let Some(Some(pte)) = pde.slot(p) {
                        pte.target = new;
                    }
                }
            }
        })
    }

    /// Drops every cached translation, after waiting for engine accesses in progress.
    pub fn invalidate_tlb(&self) {
        let _quiesced = self.access.write().unwrap_or_else(|e| e.into_inner());
        self.lock_tlb().clear();
    }

    /// Marks the address space destroyed: waits for accesses in progress, then makes every
    /// later translation fail.
    pub fn kill(&self) {
        let _quiesced = self.access.write().unwrap_or_else(|e| e.into_inner());
        self.dead.store(true, Ordering::Release);
        self.lock_tlb().clear();
    }

    /// The record of writes through this space (see [`WriteLog`]).
    pub fn writes(&self) -> &WriteLog {
        &self.writes
    }

    /// Held by an engine for the duration of one access through a translation.
    pub fn access_guard(&self) -> RwLockReadGuard<'_, ()> {
        self.access.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Translates `va` for a read or write, through the TLB, counting the access.
    pub fn translate(
        &self,
        va: u64,
        write: bool,
    ) -> std::result::Result<Translation, TranslateError> {
        if self.dead.load(Ordering::Acquire) {
            return Err(TranslateError::NotMapped);
        }
        // An access is counted where it is allowed, under the TLB's lock (no clone of the
        // entry's counter).
        let count = |e: &TlbEntry| {
            if !(write && e.read_only) {
                e.accesses.fetch_add(1, Ordering::Relaxed);
            }
            (e.page, e.target, e.read_only)
        };
        let mut tlb = self.lock_tlb();
        let hit = PageSize::ALL.iter().find_map(|ps| {
            let base = va - va % ps.bytes();
            tlb.get(&base)
                .filter(|e| e.page == *ps)
                .map(|e| (base, count(e)))
        });
        let (base, (page, target, read_only)) = match hit {
            Some(hit) => hit,
            None => {
                let tables = self.read_tables();
                let pde = tables
                    .get(&(va / PDE_SPAN))
                    .ok_or(TranslateError::NotMapped)?;
                let pte = pde.get(va).ok_or(TranslateError::NotMapped)?;
                let page = pde.page_size();
                let base = va - va % page.bytes();
                let e = TlbEntry {
                    page,
                    target: pte.target,
                    read_only: pte.read_only,
                    accesses: pte.accesses.clone(),
                };
                if tlb.len() >= TLB_ENTRIES {
                    tlb.clear();
                }
                let seen = count(&e);
                tlb.insert(base, e);
                (base, seen)
            }
        };
        drop(tlb);
        if write && read_only {
            return Err(TranslateError::ReadOnly);
        }
        let off = va - base;
        Ok(Translation {
            target: offset_target(target, off),
            contiguous: page.bytes() - off,
        })
    }

    /// Access counts of the mapped pages overlapping `va..va+size`, in address order.
    pub fn access_counts(&self, va: u64, size: u64, reset: bool) -> Result<Vec<(u64, u32)>> {
        let end = va.checked_add(size).filter(|&e| e <= GPU_VA_LIMIT).ok_or(
            HalError::InvalidArgument("range outside the GPU address space"),
        )?;
        let tables = self.read_tables();
        let mut out = Vec::new();
        let mut key = va / PDE_SPAN;
        while key * PDE_SPAN < end {
            if let Some(pde) = tables.get(&key) {
                let ps = pde.page_size().bytes();
                let mut p = key * PDE_SPAN;
                while p < (key + 1) * PDE_SPAN {
                    if p + ps > va && p < end {
                        if let Some(pte) = pde.get(p) {
                            let n = if reset {
                                pte.accesses.swap(0, Ordering::Relaxed)
                            } else {
                                pte.accesses.load(Ordering::Relaxed)
                            };
                            out.push((p, n));
                        }
                    }
                    p += ps;
                }
            }
            key += 1;
        }
        Ok(out)
    }

    /// Number of mapped pages (for leak checks).
    pub fn mapped_pages(&self) -> usize {
        self.read_tables()
            .values()
            .map(|pde| match pde {
                Pde::Huge(_) => 1,
                Pde::Big(t) | Pde::Small(t) => t.iter().filter(|p| p.is_some()).count(),
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hal::HostRange;

    struct NoSys;
    impl SysMemory for NoSys {
        fn translate(&self, _: u64, _: u64) -> Option<HostRange> {
            None
        }
    }

    fn space() -> AddressSpace {
        AddressSpace::new(Arc::new(NoSys))
    }

    const RW: MapFlags = MapFlags { read_only: false };

    #[test]
    fn translate_each_page_size() {
        let s = space();
        s.map(
            0x20_0000,
            0x40_0000,
            MapTarget::Vram { offset: 0x60_0000 },
            PageSize::Huge2M,
            RW,
        )
        .unwrap();
        s.map(
            0x100_0000,
            0x2_0000,
            MapTarget::Vram { offset: 0x1_0000 },
            PageSize::Big64K,
            RW,
        )
        .unwrap();
        s.map(
            0x200_0000,
            0x2000,
            MapTarget::Sysram { addr: 0x5000 },
            PageSize::Small4K,
            RW,
        )
        .unwrap();
        let t = s.translate(0x20_0000 + 0x20_0123, false).unwrap();
        assert_eq!(t.target, MapTarget::Vram { offset: 0x80_0123 });
        assert_eq!(t.contiguous, 0x20_0000 - 0x123);
        let t = s.translate(0x101_0010, true).unwrap();
        assert_eq!(t.target, MapTarget::Vram { offset: 0x2_0010 });
        let t = s.translate(0x200_1fff, false).unwrap();
        assert_eq!(t.target, MapTarget::Sysram { addr: 0x6fff });
        assert_eq!(t.contiguous, 1);
        assert_eq!(
            s.translate(0x200_2000, false),
            Err(TranslateError::NotMapped)
        );
        assert_eq!(s.translate(u64::MAX, false), Err(TranslateError::NotMapped));
    }

    #[test]
    fn rejects_bad_maps_without_side_effects() {
        let s = space();
        let v = MapTarget::Vram { offset: 0 };
        assert!(s.map(0x1000, 0x1000, v, PageSize::Big64K, RW).is_err());
        assert!(s.map(0, 0, v, PageSize::Small4K, RW).is_err());
        assert!(s
            .map(GPU_VA_LIMIT - 0x1000, 0x2000, v, PageSize::Small4K, RW)
            .is_err());
        assert!(s
            .map(
                0,
                0x1000,
                MapTarget::Vram { offset: 0x800 },
                PageSize::Small4K,
                RW
            )
            .is_err());
        s.map(0x3000, 0x1000, v, PageSize::Small4K, RW).unwrap();
        // Overlap: the whole map fails, including its non-overlapping first page.
        assert!(matches!(
            s.map(0x2000, 0x2000, v, PageSize::Small4K, RW),
            Err(HalError::Overlap { .. })
        ));
        assert_eq!(s.translate(0x2000, false), Err(TranslateError::NotMapped));
        assert!(matches!(
            s.map(0x1_0000, 0x1_0000, v, PageSize::Big64K, RW),
            Err(HalError::PageSizeConflict(0))
        ));
        assert_eq!(s.mapped_pages(), 1);
    }

    #[test]
    fn killed_space_translates_nothing() {
        let s = space();
        s.map(
            0,
            0x1000,
            MapTarget::Vram { offset: 0 },
            PageSize::Small4K,
            RW,
        )
        .unwrap();
        assert!(s.translate(0, false).is_ok());
        s.kill();
        assert_eq!(s.translate(0, false), Err(TranslateError::NotMapped));
    }

    #[test]
    fn read_only_faults_writes() {
        let s = space();
        s.map(
            0,
            0x1000,
            MapTarget::Vram { offset: 0 },
            PageSize::Small4K,
            MapFlags { read_only: true },
        )
        .unwrap();
        assert!(s.translate(0, false).is_ok());
        assert_eq!(s.translate(8, true), Err(TranslateError::ReadOnly));
    }

    #[test]
    fn tlb_holds_stale_translations_until_invalidated() {
        let s = space();
        s.map(
            0,
            0x1000,
            MapTarget::Vram { offset: 0 },
            PageSize::Small4K,
            RW,
        )
        .unwrap();
        assert_eq!(
            s.translate(0, false).unwrap().target,
            MapTarget::Vram { offset: 0 }
        );
        s.remap(0, 0x1000, MapTarget::Sysram { addr: 0x9000 })
            .unwrap();
        assert_eq!(
            s.translate(0, false).unwrap().target,
            MapTarget::Vram { offset: 0 }
        );
        s.invalidate_tlb();
        assert_eq!(
            s.translate(0, false).unwrap().target,
            MapTarget::Sysram { addr: 0x9000 }
        );
        s.unmap(0, 0x1000).unwrap();
        assert!(s.translate(0, false).is_ok(), "stale until invalidated");
        s.invalidate_tlb();
        assert_eq!(s.translate(0, false), Err(TranslateError::NotMapped));
        assert_eq!(s.mapped_pages(), 0);
    }

    #[test]
    fn table_bytes_count_what_maps_add_and_unmaps_free() {
        let s = space();
        let v = MapTarget::Vram { offset: 0 };
        let va = 0x1_0000_0000;
        for page in [PageSize::Small4K, PageSize::Big64K, PageSize::Huge2M] {
            // Three 2 MiB regions, the last one half used.
            let size = 3 * PDE_SPAN
                - if page == PageSize::Huge2M {
                    0
                } else {
                    PDE_SPAN / 2
                };
            let cost = s.map_cost(va, size, page);
            let pages = size / page.bytes();
            assert_eq!(
                cost,
                3 * pde_bytes(page) + pages * COUNTER_BYTES,
                "{page:?}"
            );
            s.map(va, size, v, page, RW).unwrap();
            assert_eq!(s.table_bytes(), cost, "{page:?}");
            if page != PageSize::Huge2M {
                // More pages in a region already mapped cost only their counters.
                let more = page.bytes();
                assert_eq!(s.map_cost(va + size, more, page), COUNTER_BYTES);
                s.map(va + size, more, v, page, RW).unwrap();
                assert_eq!(s.table_bytes(), cost + COUNTER_BYTES);
                s.unmap(va + size, more).unwrap();
            }
            // A refused map costs nothing and changes nothing.
            assert!(s.map(va, page.bytes(), v, page, RW).is_err());
            assert_eq!(s.table_bytes(), cost);
            s.unmap(va, size).unwrap();
            assert_eq!(s.table_bytes(), 0, "{page:?}");
        }
        // 1 GiB with 4 KiB pages: about 16 MiB of host memory.
        let gib = s.map_cost(va, 1 << 30, PageSize::Small4K);
        assert!((15 << 20..17 << 20).contains(&gib), "{gib}");
    }

    #[test]
    fn unmap_needs_whole_pages() {
        let s = space();
        s.map(
            0,
            0x2_0000,
            MapTarget::Vram { offset: 0 },
            PageSize::Big64K,
            RW,
        )
        .unwrap();
        assert!(s.unmap(0, 0x1000).is_err());
        assert!(s.unmap(0, 0x3_0000).is_err());
        assert_eq!(s.mapped_pages(), 2);
        s.unmap(0x1_0000, 0x1_0000).unwrap();
        assert_eq!(s.mapped_pages(), 1);
    }

    #[test]
    fn access_counts_count_hits_and_reset() {
        let s = space();
        s.map(
            0,
            0x3000,
            MapTarget::Vram { offset: 0 },
            PageSize::Small4K,
            RW,
        )
        .unwrap();
        for _ in 0..3 {
            s.translate(0x1008, false).unwrap();
        }
        s.translate(0x2000, true).unwrap();
        assert_eq!(
            s.access_counts(0, 0x3000, true).unwrap(),
            vec![(0, 0), (0x1000, 3), (0x2000, 1)]
        );
        assert_eq!(
            s.access_counts(0x1000, 1, false).unwrap(),
            vec![(0x1000, 0)]
        );
    }
}
