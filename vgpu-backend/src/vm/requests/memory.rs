//! Requests on memory: VRAM objects (ALLOC_VRAM, FREE_MEM), GPU mappings (MAP_VRAM, MAP_GUEST, UNMAP) and aperture windows (MAP_APERTURE, UNMAP_APERTURE).
//!
//! GPU mappings cost the host memory (page tables, and the session's record of each),
//! however little guest memory or VRAM they reach: one object may be mapped at many
//! addresses. So the VM's mappings are bounded in number (`VmLimits::max_mappings`) and
//! in that memory (`VmLimits::page_table_bytes`), which is counted against the VM as the
//! GPU reports it (`Usage::page_table_bytes`).

use super::*;

/// Host bytes of the session's record of one mapping (its entry in the mappings map,
/// generously), besides its guest ranges.
const MAPPING_RECORD_BYTES: u64 = 128;

/// Host bytes of the record of a mapping with `ranges` guest ranges.
fn record_bytes(ranges: usize) -> u64 {
    MAPPING_RECORD_BYTES + (ranges * std::mem::size_of::<GuestRange>()) as u64
}

/// Host bytes of `m`'s record.
pub(in crate::vm) fn record_of(m: &MappingState) -> u64 {
    match &m.target {
        MappingTarget::Vram { .. } => record_bytes(0),
        MappingTarget::Guest { ranges } => record_bytes(ranges.len()),
    }
}

impl Session {
    // ---- VRAM objects -----------------------------------------------------------------

    pub(in crate::vm) fn alloc_vram(&mut self, pid: u32, ctx: u32, size: u64, align: u64) -> Reply {
        self.owned_ctx(pid, ctx)?;
        let gpu_vram = self.gpu.info().vram_bytes;
        // What the VM may hold: its VRAM quota plus its swap limit.
        let limit = self
            .shared
            .vram_quota()
            .saturating_add(self.limits.swap_bytes);
        if size == 0
            || size > limit.min(gpu_vram.saturating_add(self.limits.swap_bytes))
            || !align.is_power_of_two()
            || !(PAGE_SIZE..=MAX_VRAM_ALIGN).contains(&align)
        {
            return Err(ErrorCode::InvalidArgument);
        }
        let rounded = page_round_up(size).ok_or(ErrorCode::InvalidArgument)?;
        let fits = |used: u64, n: u64, limit: u64| used.checked_add(n).is_some_and(|t| t <= limit);
        if !fits(self.state.usage.vram_bytes, rounded, limit) {
            return Err(ErrorCode::LimitExceeded);
        }
        // Chunks that do not fit in free VRAM go to swap (the VRAM manager rebalances), or
        // fail the request for a VM without a swap limit.
        let backing = self.alloc_object(pid, rounded, align)?;
        // The VM is charged the frames its small pieces pin, not only their bytes: islands
        // of tiny objects count as the VRAM they make unusable.
        let charged = self
            .state
            .usage
            .vram_bytes
            .saturating_add(self.vram_charged_slack());
        if !fits(charged, rounded, limit) {
            self.free_object(&backing);
            return Err(ErrorCode::LimitExceeded);
        }
        let mems = &self.state.mems;
        let id = fresh_id(&mut self.state.last_mem, |i| mems.contains_key(&i));
        self.state.mems.insert(
            id,
            MemState {
                pid,
                ctx,
                size: rounded,
                align,
                aperture: None,
            },
        );
        self.hal.vram.insert(id, backing);
        self.state.usage.vram_bytes += rounded;
        Ok(ReplyBody::Mem {
            mem: id,
            size: rounded,
        })
    }

    /// Frees a VRAM object that nothing maps any more.
    pub(super) fn release_vram(&mut self, id: u32) {
        if let Some(m) = self.state.mems.remove(&id) {
            let u = &mut self.state.usage;
            u.vram_bytes = u.vram_bytes.saturating_sub(m.size);
        }
        if let Some(b) = self.hal.vram.remove(&id) {
            self.free_object(&b);
        }
    }

    pub(super) fn free_mem(&mut self, pid: u32, ctx: u32, mem: u32, shm: &dyn ShmMapper) -> Reply {
        let (hctx, _) = self.owned_ctx(pid, ctx)?;
        let aperture = self.owned_mem(pid, ctx, mem)?.aperture;
        if aperture.is_some() {
            self.unmap_aperture(pid, ctx, mem, shm)?;
        }
        let keys: Vec<(u32, u64)> = self
            .state
            .mappings
            .range((ctx, 0)..=(ctx, u64::MAX))
            .filter(|(_, m)| m.target == MappingTarget::Vram { mem })
            .map(|(k, _)| *k)
            .collect();
        for (_, va) in keys {
            self.unmap_gpu(hctx, ctx, va)?;
        }
        self.release_vram(mem);
        Ok(ReplyBody::Empty)
    }

    // ---- GPU mappings -----------------------------------------------------------------

    pub(in crate::vm) fn map_vram(
        &mut self,
        pid: u32,
        ctx: u32,
        mem: u32,
        flags: u32,
        va: u64,
        page: u32,
    ) -> Reply {
        let (hctx, _) = self.owned_ctx(pid, ctx)?;
        let size = self.owned_mem(pid, ctx, mem)?.size;
        let ps = page_size(page)?;
        check_va_range(va, size, ps)?;
        if flags & !MAP_READ_ONLY != 0 || self.overlaps(ctx, va, size) {
            return Err(ErrorCode::InvalidArgument);
        }
        self.admit_mapping(hctx, va, size, ps, 0)?;
        let before = self.table_bytes(hctx);
        let mapped = match self.hal.vram.get(&mem) {
            Some(backing) => self
                .map_object(hctx, va, backing, ps, map_flags(flags))
                .map_err(|e| e.code()),
            None => Err(ErrorCode::Internal),
        };
        self.tally_tables(hctx, before);
        mapped?;
        self.record_mapping(
            (ctx, va),
            MappingState {
                pid,
                size,
                page,
                flags,
                target: MappingTarget::Vram { mem },
            },
        );
        Ok(ReplyBody::Empty)
    }

    /// Checks that the VM may add a mapping of `va..va+size` with pages of `ps` and
    /// `ranges` guest ranges: one more mapping, and the page-table memory it would add
    /// with its record, within the VM's limits.
    fn admit_mapping(
        &self,
        hctx: ContextId,
        va: u64,
        size: u64,
        ps: PageSize,
        ranges: usize,
    ) -> Result<(), ErrorCode> {
        if self.state.mappings.len() >= self.limits.max_mappings as usize {
            return Err(ErrorCode::LimitExceeded);
        }
        let cost = self
            .gpu
            .map_cost(hctx, va, size, ps)
            .map_err(|e| e.code())?
            .saturating_add(record_bytes(ranges));
        let used = self.state.usage.page_table_bytes;
        if used
            .checked_add(cost)
            .is_none_or(|t| t > self.limits.page_table_bytes)
        {
            return Err(ErrorCode::LimitExceeded);
        }
        Ok(())
    }

    /// Host memory of `hctx`'s page tables now.
    fn table_bytes(&self, hctx: ContextId) -> u64 {
        self.gpu.page_table_bytes(hctx).unwrap_or(0)
    }

    /// Counts the change of `hctx`'s page tables since they took `before` bytes.
    fn tally_tables(&mut self, hctx: ContextId, before: u64) {
        let after = self.table_bytes(hctx);
        let u = &mut self.state.usage;
        u.page_table_bytes = u
            .page_table_bytes
            .saturating_sub(before)
            .saturating_add(after);
    }

    /// Books a mapping the page tables now hold.
    fn record_mapping(&mut self, key: (u32, u64), m: MappingState) {
        let u = &mut self.state.usage;
        u.page_table_bytes = u.page_table_bytes.saturating_add(record_of(&m));
        if let MappingTarget::Guest { .. } = m.target {
            u.mapped_guest_bytes = u.mapped_guest_bytes.saturating_add(m.size);
        }
        self.state.mappings.insert(key, m);
    }

    /// Drops the record of a mapping the page tables no longer hold.
    pub(super) fn forget_mapping(&mut self, key: (u32, u64)) {
        if let Some(m) = self.state.mappings.remove(&key) {
            let u = &mut self.state.usage;
            u.page_table_bytes = u.page_table_bytes.saturating_sub(record_of(&m));
            if let MappingTarget::Guest { .. } = m.target {
                u.mapped_guest_bytes = u.mapped_guest_bytes.saturating_sub(m.size);
            }
        }
    }

    pub(in crate::vm) fn map_guest(
        &mut self,
        pid: u32,
        ctx: u32,
        va: u64,
        page: u32,
        flags: u32,
        ranges: &[GuestRange],
    ) -> Reply {
        let (hctx, sys) = self.owned_ctx(pid, ctx)?;
        let ps = page_size(page)?;
        let psb = ps.bytes();
        if ranges.is_empty() || flags & !MAP_READ_ONLY != 0 {
            return Err(ErrorCode::InvalidArgument);
        }
        let mut total: u64 = 0;
        for r in ranges {
            if r.len == 0
                || !r.gpa.is_multiple_of(psb)
                || !r.len.is_multiple_of(psb)
                || !sys.contains_range(r.gpa, r.len)
            {
                return Err(ErrorCode::InvalidArgument);
            }
            total = total.checked_add(r.len).ok_or(ErrorCode::InvalidArgument)?;
        }
        check_va_range(va, total, ps)?;
        let mut sorted: Vec<GuestRange> = ranges.to_vec();
        sorted.sort_unstable_by_key(|r| r.gpa);
        if sorted.windows(2).any(|w| w[0].gpa + w[0].len > w[1].gpa) {
            return Err(ErrorCode::InvalidArgument);
        }
        if self.overlaps(ctx, va, total) {
            return Err(ErrorCode::InvalidArgument);
        }
        let used = self.state.usage.mapped_guest_bytes;
        if used
            .checked_add(total)
            .is_none_or(|t| t > self.limits.mapped_guest_bytes)
        {
            return Err(ErrorCode::LimitExceeded);
        }
        self.admit_mapping(hctx, va, total, ps, ranges.len())?;
        let before = self.table_bytes(hctx);
        let mapped = self.map_ranges(hctx, va, ps, flags, ranges);
        self.tally_tables(hctx, before);
        mapped?;
        self.record_mapping(
            (ctx, va),
            MappingState {
                pid,
                size: total,
                page,
                flags,
                target: MappingTarget::Guest {
                    ranges: ranges.to_vec(),
                },
            },
        );
        Ok(ReplyBody::Empty)
    }

    /// Maps `ranges` back to back from `va`, all or nothing.
    fn map_ranges(
        &self,
        hctx: ContextId,
        va: u64,
        ps: PageSize,
        flags: u32,
        ranges: &[GuestRange],
    ) -> Result<(), ErrorCode> {
        let mut at = va;
        for (i, r) in ranges.iter().enumerate() {
            let res = self.gpu.map(
                hctx,
                at,
                r.len,
                MapTarget::Sysram { addr: r.gpa },
                ps,
                map_flags(flags),
            );
            if let Err(e) = res {
                // Undo the pieces mapped so far.
                let mut undo = va;
                for p in &ranges[..i] {
                    if let Err(e) = self.gpu.unmap(hctx, undo, p.len) {
                        warn!("MAP_GUEST: undo unmap {undo:#x}: {e}");
                    }
                    undo += p.len;
                }
                if let Err(e) = self.gpu.invalidate_tlb(hctx) {
                    warn!("MAP_GUEST: undo invalidate: {e}");
                }
                return Err(e.code());
            }
            at += r.len;
        }
        Ok(())
    }

    /// Removes the GPU mapping at (ctx, va) from the page tables and the books. The TLB
    /// is invalidated before returning, so its target may be freed afterwards.
    pub(super) fn unmap_gpu(
        &mut self,
        hctx: ContextId,
        ctx: u32,
        va: u64,
    ) -> Result<(), ErrorCode> {
        let before = self.table_bytes(hctx);
        let m = self
            .state
            .mappings
            .get(&(ctx, va))
            .ok_or(ErrorCode::NotFound)?;
        let res = match &m.target {
            MappingTarget::Vram { .. } => self.gpu.unmap(hctx, va, m.size),
            MappingTarget::Guest { ranges } => {
                let mut at = va;
                let mut res = Ok(());
                for r in ranges {
                    res = res.and(self.gpu.unmap(hctx, at, r.len));
                    at += r.len;
                }
                res
            }
        };
        let inval = self.gpu.invalidate_tlb(hctx);
        self.tally_tables(hctx, before);
        if let Err(e) = res.and(inval) {
            // The page tables disagree with the books: keep the record (and so the target)
            // rather than free memory the GPU might still reach.
            warn!("unmap ctx {ctx} va {va:#x}: {e}");
            return Err(ErrorCode::Internal);
        }
        self.forget_mapping((ctx, va));
        Ok(())
    }

    pub(super) fn unmap(&mut self, pid: u32, ctx: u32, va: u64) -> Reply {
        let (hctx, _) = self.owned_ctx(pid, ctx)?;
        let m = self
            .state
            .mappings
            .get(&(ctx, va))
            .ok_or(ErrorCode::NotFound)?;
        if m.pid != pid {
            return Err(ErrorCode::PermissionDenied);
        }
        self.unmap_gpu(hctx, ctx, va)?;
        Ok(ReplyBody::Empty)
    }

    // ---- VRAM aperture ----------------------------------------------------------------

    pub(super) fn map_aperture(
        &mut self,
        pid: u32,
        ctx: u32,
        mem: u32,
        shm: &dyn ShmMapper,
    ) -> Reply {
        if self.shared.forwarded() {
            // No shared-memory region to place a window in: the driver stages VRAM
            // through guest RAM with the copy engine instead.
            self.owned_ctx(pid, ctx)?;
            return Err(ErrorCode::Unsupported);
        }
        self.aperture_window(pid, ctx, mem, None, shm)
    }

    /// MAP_APERTURE at a given offset (a migrated VM's windows stay where they were).
    pub(in crate::vm) fn restore_aperture(
        &mut self,
        pid: u32,
        ctx: u32,
        mem: u32,
        at: u64,
        shm: &dyn ShmMapper,
    ) -> Reply {
        self.aperture_window(pid, ctx, mem, Some(at), shm)
    }

    fn aperture_window(
        &mut self,
        pid: u32,
        ctx: u32,
        mem: u32,
        at: Option<u64>,
        shm: &dyn ShmMapper,
    ) -> Reply {
        self.owned_ctx(pid, ctx)?;
        let m = self.owned_mem(pid, ctx, mem)?;
        if m.aperture.is_some() {
            return Err(ErrorCode::InvalidArgument);
        }
        // On a GPU whose VRAM the CPU cannot map (`cuda`), guests move VRAM bytes with the
        // copy engine instead; a swapped object has a CPU view but would lose it on swap-in.
        if self.gpu.vram_fd().is_none() {
            return Err(ErrorCode::Unsupported);
        }
        let len = page_round_up(m.size).ok_or(ErrorCode::Internal)?;
        let used = self
            .state
            .mems
            .values()
            .filter_map(|m| m.aperture.map(|o| (o, m.size)));
        let off = match at {
            None => first_fit_aperture(used, len).ok_or(ErrorCode::LimitExceeded)?,
            Some(off) if aperture_window_free(used, off, len) => off,
            Some(_) => return Err(ErrorCode::InvalidArgument),
        };
        let backing = self.hal.vram.get(&mem).ok_or(ErrorCode::Internal)?.clone();
        if backing.size() != len {
            return Err(ErrorCode::Internal);
        }
        // Each run shows its current backing: VRAM, or the swapped copy.
        if let Err(code) = self.map_object_aperture(off, &backing, shm) {
            if let Err(e) = shm.unmap(off, len) {
                warn!("MAP_APERTURE: undo: {e}");
            }
            return Err(code);
        }
        if let Some(m) = self.state.mems.get_mut(&mem) {
            m.aperture = Some(off);
        }
        self.state.usage.aperture_bytes += len;
        Ok(ReplyBody::Aperture { offset: off })
    }

    pub(super) fn unmap_aperture(
        &mut self,
        pid: u32,
        ctx: u32,
        mem: u32,
        shm: &dyn ShmMapper,
    ) -> Reply {
        self.owned_ctx(pid, ctx)?;
        let m = self.owned_mem(pid, ctx, mem)?;
        let off = m.aperture.ok_or(ErrorCode::NotFound)?;
        let len = page_round_up(m.size).ok_or(ErrorCode::Internal)?;
        shm.unmap(off, len).map_err(|e| {
            warn!("UNMAP_APERTURE: SHMEM_UNMAP: {e}");
            ErrorCode::Internal
        })?;
        if let Some(m) = self.state.mems.get_mut(&mem) {
            m.aperture = None;
        }
        let u = &mut self.state.usage;
        u.aperture_bytes = u.aperture_bytes.saturating_sub(len);
        Ok(ReplyBody::Empty)
    }
}
