//! Control-queue request handling: decode, validate, act on the HAL and the BAR, reply.
//!
//! Every field of a request is guest-controlled. Each handler validates its arguments
//! (→ `InvalidArgument`), then ownership (→ `NotFound` / `PermissionDenied`), then limits
//! (→ `LimitExceeded`) before it allocates anything, and undoes partial work when a later
//! step fails, so that a failed request leaves the session as it was.
//!
//! A BAR view (control-page slot, aperture window) is always removed *before* the object
//! behind it is destroyed or freed; if the frontend fails to remove it, the object is kept
//! (the request fails with `Internal`), so that no guest can keep a window onto memory
//! that is handed to someone else.

use std::sync::Arc;

use log::{debug, warn};
use vgpu_host_shim::{ChannelConfig, ContextId, MapFlags, MapTarget, PageSize};
use vgpu_protocol::channel::valid_gp_entries;
use vgpu_protocol::device::{slot_offset, CHANNEL_SLOTS};
use vgpu_protocol::gp::{GPU_VA_LIMIT, GP_ENTRY_SIZE};
use vgpu_protocol::request::{
    encode_reply, GuestRange, InfoReply, Op, ReplyBody, Request, StatsReply, MAP_READ_ONLY,
    PAGE_2M, PAGE_4K, PAGE_64K,
};
use vgpu_protocol::{ErrorCode, PAGE_SIZE, PROTOCOL_VERSION};

use crate::events::ChannelSink;
use crate::guest_mem::{GuestMemory, GuestSysMemory};
use crate::session::{ChannelState, ContextState, MappingState, MappingTarget, MemState, Session};
use crate::shadow::Holder;
use crate::shmem::{first_fit_aperture, free_slot, page_round_up, ShmMapper};

/// Largest VRAM alignment a guest may ask for.
pub const MAX_VRAM_ALIGN: u64 = 1 << 30;

type Reply = Result<ReplyBody, ErrorCode>;

fn page_size(code: u32) -> Result<PageSize, ErrorCode> {
    match code {
        PAGE_4K => Ok(PageSize::Small4K),
        PAGE_64K => Ok(PageSize::Big64K),
        PAGE_2M => Ok(PageSize::Huge2M),
        _ => Err(ErrorCode::InvalidArgument),
    }
}

fn map_flags(flags: u32) -> MapFlags {
    MapFlags {
        read_only: flags & MAP_READ_ONLY != 0,
    }
}

/// `va..va+size` is a valid, page-aligned GPU virtual range.
fn check_va_range(va: u64, size: u64, page: PageSize) -> Result<(), ErrorCode> {
    let ps = page.bytes();
    if size == 0 || !va.is_multiple_of(ps) || !size.is_multiple_of(ps) {
        return Err(ErrorCode::InvalidArgument);
    }
    match va.checked_add(size) {
        Some(end) if end <= GPU_VA_LIMIT => Ok(()),
        _ => Err(ErrorCode::InvalidArgument),
    }
}

/// Creates a fresh non-zero id after `last` that `used` does not know.
fn fresh_id(last: &mut u32, used: impl Fn(u32) -> bool) -> u32 {
    loop {
        *last = last.wrapping_add(1);
        if *last != 0 && !used(*last) {
            return *last;
        }
    }
}

impl Session {
    /// Handles one control request: `req` is the request's bytes as read from the
    /// descriptor chain, `mem` the VM's current memory table, `shm` the way to the
    /// frontend's BAR. Always returns a reply (an error reply for anything malformed).
    pub fn handle(&mut self, req: &[u8], mem: &GuestMemory, shm: &dyn ShmMapper) -> Vec<u8> {
        let result = match Request::decode(req) {
            Ok(r) => {
                let res = self.execute(&r, mem, shm);
                if let Err(code) = res {
                    debug!(
                        "request op {} pid {} ctx {} failed: {code}",
                        r.opcode(),
                        r.pid,
                        r.ctx
                    );
                }
                res
            }
            Err(e) => {
                debug!("malformed request ({} bytes): {e}", req.len());
                Err(e.code())
            }
        };
        self.shared.count_request(result.is_err());
        self.publish();
        encode_reply(result)
    }

    /// The reply for a descriptor chain that did not carry a readable request.
    pub fn reject(&self, code: ErrorCode) -> Vec<u8> {
        self.shared.count_request(true);
        encode_reply(Err(code))
    }

    /// Executes a decoded request.
    pub fn execute(&mut self, r: &Request, mem: &GuestMemory, shm: &dyn ShmMapper) -> Reply {
        let (pid, ctx) = (r.pid, r.ctx);
        match &r.op {
            Op::GetInfo => Ok(ReplyBody::Info(self.info())),
            Op::GetStats => Ok(ReplyBody::Stats(self.stats_reply())),
            Op::CreateContext => self.create_context(pid, mem),
            Op::DestroyContext => self.destroy_context(pid, ctx, shm),
            Op::AllocVram { size, align } => self.alloc_vram(pid, ctx, *size, *align),
            Op::FreeMem { mem } => self.free_mem(pid, ctx, *mem, shm),
            Op::MapVram {
                mem,
                flags,
                va,
                page,
            } => self.map_vram(pid, ctx, *mem, *flags, *va, *page),
            Op::MapGuest {
                va,
                page,
                flags,
                ranges,
            } => self.map_guest(pid, ctx, *va, *page, *flags, ranges),
            Op::Unmap { va } => self.unmap(pid, ctx, *va),
            Op::MapAperture { mem } => self.map_aperture(pid, ctx, *mem, shm),
            Op::UnmapAperture { mem } => self.unmap_aperture(pid, ctx, *mem, shm),
            Op::CreateChannel {
                gp_ring_va,
                gp_entries,
            } => self.create_channel(pid, ctx, *gp_ring_va, *gp_entries, shm),
            Op::DestroyChannel { channel } => self.destroy_channel(pid, ctx, *channel, shm),
            Op::Submit { channel, gp_put } => self.submit(pid, ctx, *channel, *gp_put),
        }
    }

    fn info(&self) -> InfoReply {
        let info = self.gpu.info();
        InfoReply {
            version: PROTOCOL_VERSION,
            compute_engines: info.compute_engines,
            vram_bytes: info.vram_bytes.min(self.limits.vram_bytes),
            // What this VM may use: its channel limit, at most the BAR's slots.
            channel_slots: CHANNEL_SLOTS.min(self.limits.max_channels),
            max_contexts: self.limits.max_contexts,
        }
    }

    fn stats_reply(&self) -> StatsReply {
        let u = self.state.usage;
        StatsReply {
            contexts: self.state.contexts.len() as u32,
            channels: self.state.channels.len() as u32,
            vram_bytes: u.vram_bytes,
            mapped_guest_bytes: u.mapped_guest_bytes,
            aperture_bytes: u.aperture_bytes,
            vram_limit: self.limits.vram_bytes,
        }
    }

    // ---- ownership checks -------------------------------------------------------------

    /// The HAL context and sysmem of `ctx`, if `pid` owns it.
    fn owned_ctx(&self, pid: u32, ctx: u32) -> Result<(ContextId, Arc<GuestSysMemory>), ErrorCode> {
        let c = self.state.contexts.get(&ctx).ok_or(ErrorCode::NotFound)?;
        if c.pid != pid {
            return Err(ErrorCode::PermissionDenied);
        }
        self.hal
            .contexts
            .get(&ctx)
            .map(|(id, sys)| (*id, sys.clone()))
            .ok_or(ErrorCode::Internal)
    }

    /// Checks that VRAM object `mem` belongs to (pid, ctx).
    fn owned_mem(&self, pid: u32, ctx: u32, mem: u32) -> Result<&MemState, ErrorCode> {
        let m = self.state.mems.get(&mem).ok_or(ErrorCode::NotFound)?;
        if m.pid != pid {
            return Err(ErrorCode::PermissionDenied);
        }
        if m.ctx != ctx {
            return Err(ErrorCode::NotFound);
        }
        Ok(m)
    }

    /// Whether `va..va+size` overlaps a mapping of `ctx`.
    fn overlaps(&self, ctx: u32, va: u64, size: u64) -> bool {
        let end = va.saturating_add(size);
        self.state
            .mappings
            .range((ctx, 0)..(ctx, end))
            .next_back()
            .is_some_and(|((_, start), m)| start.saturating_add(m.size) > va)
    }

    // ---- contexts ---------------------------------------------------------------------

    fn create_context(&mut self, pid: u32, mem: &GuestMemory) -> Reply {
        if self.state.contexts.len() >= self.limits.max_contexts as usize {
            return Err(ErrorCode::LimitExceeded);
        }
        let contexts = &self.state.contexts;
        let id = fresh_id(&mut self.state.last_context, |i| contexts.contains_key(&i));
        let sys = Arc::new(GuestSysMemory::new(mem.clone()));
        // The GPU also reaches the VM's swap store (above guest RAM, see crate::vram).
        let store = self.swap_store()?;
        let gpu_sys = Arc::new(crate::vram::store::VmSysMemory::new(sys.clone(), store));
        let hctx = self.gpu.create_context(gpu_sys).map_err(|e| e.code())?;
        self.state.contexts.insert(id, ContextState { pid });
        self.hal.contexts.insert(id, (hctx, sys));
        debug!("pid {pid}: context {id} ({hctx:?})");
        Ok(ReplyBody::Context { ctx: id })
    }

    fn destroy_context(&mut self, pid: u32, ctx: u32, shm: &dyn ShmMapper) -> Reply {
        let (hctx, _) = self.owned_ctx(pid, ctx)?;
        // 1. Remove the guest's BAR views of the context's objects. On failure the context
        //    stays (consistent: what was unmapped is recorded as such) and may be retried.
        for ch in self.state.channels.values_mut().filter(|c| c.ctx == ctx) {
            if ch.slot_mapped {
                let off = slot_offset(ch.slot).ok_or(ErrorCode::Internal)?;
                shm.unmap(off, PAGE_SIZE).map_err(|e| {
                    warn!("DESTROY_CONTEXT: SHMEM_UNMAP of slot {}: {e}", ch.slot);
                    ErrorCode::Internal
                })?;
                ch.slot_mapped = false;
            }
        }
        let usage = &mut self.state.usage;
        for m in self.state.mems.values_mut().filter(|m| m.ctx == ctx) {
            if let Some(off) = m.aperture {
                let len = page_round_up(m.size).ok_or(ErrorCode::Internal)?;
                shm.unmap(off, len).map_err(|e| {
                    warn!("DESTROY_CONTEXT: SHMEM_UNMAP of aperture {off:#x}: {e}");
                    ErrorCode::Internal
                })?;
                m.aperture = None;
                usage.aperture_bytes = usage.aperture_bytes.saturating_sub(len);
            }
        }
        // 2. Channels, then the address space (no engine uses it once this returns).
        let channels: Vec<u32> = self
            .state
            .channels
            .iter()
            .filter(|(_, c)| c.ctx == ctx)
            .map(|(id, _)| *id)
            .collect();
        {
            let mut book = self.shared.busy();
            for id in channels {
                self.state.channels.remove(&id);
                self.shadows.forget(id);
                if let Some(ch) = self.hal.channels.remove(&id) {
                    self.hal.control_maps.remove(&ch);
                    book.retire(self.gpu.as_ref(), id);
                    if let Err(e) = self.gpu.destroy_channel(ch) {
                        warn!("DESTROY_CONTEXT: destroy channel {id}: {e}");
                    }
                }
            }
        }
        if let Err(e) = self.gpu.destroy_context(hctx) {
            warn!("DESTROY_CONTEXT: destroy context {ctx}: {e}");
        }
        self.hal.contexts.remove(&ctx);
        self.state.contexts.remove(&ctx);
        // 3. Mappings and VRAM objects of the context.
        let keys: Vec<(u32, u64)> = self
            .state
            .mappings
            .range((ctx, 0)..=(ctx, u64::MAX))
            .map(|(k, _)| *k)
            .collect();
        for k in keys {
            if let Some(m) = self.state.mappings.remove(&k) {
                if let MappingTarget::Guest { .. } = m.target {
                    let u = &mut self.state.usage;
                    u.mapped_guest_bytes = u.mapped_guest_bytes.saturating_sub(m.size);
                }
            }
        }
        let mems: Vec<u32> = self
            .state
            .mems
            .iter()
            .filter(|(_, m)| m.ctx == ctx)
            .map(|(id, _)| *id)
            .collect();
        for id in mems {
            self.release_vram(id);
        }
        Ok(ReplyBody::Empty)
    }

    // ---- VRAM objects -----------------------------------------------------------------

    fn alloc_vram(&mut self, pid: u32, ctx: u32, size: u64, align: u64) -> Reply {
        self.owned_ctx(pid, ctx)?;
        let gpu_vram = self.gpu.info().vram_bytes;
        // What the VM may hold: its VRAM quota plus its swap limit.
        let limit = self
            .limits
            .vram_bytes
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
        // Chunks that do not fit in free VRAM go to swap (the VRAM manager rebalances).
        let backing = self.alloc_object(rounded, align)?;
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
    fn release_vram(&mut self, id: u32) {
        if let Some(m) = self.state.mems.remove(&id) {
            let u = &mut self.state.usage;
            u.vram_bytes = u.vram_bytes.saturating_sub(m.size);
        }
        if let Some(b) = self.hal.vram.remove(&id) {
            self.free_object(&b);
        }
    }

    fn free_mem(&mut self, pid: u32, ctx: u32, mem: u32, shm: &dyn ShmMapper) -> Reply {
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

    fn map_vram(&mut self, pid: u32, ctx: u32, mem: u32, flags: u32, va: u64, page: u32) -> Reply {
        let (hctx, _) = self.owned_ctx(pid, ctx)?;
        let size = self.owned_mem(pid, ctx, mem)?.size;
        let ps = page_size(page)?;
        check_va_range(va, size, ps)?;
        if flags & !MAP_READ_ONLY != 0 || self.overlaps(ctx, va, size) {
            return Err(ErrorCode::InvalidArgument);
        }
        let backing = self.hal.vram.get(&mem).ok_or(ErrorCode::Internal)?;
        self.map_object(hctx, va, backing, ps, map_flags(flags))
            .map_err(|e| e.code())?;
        self.state.mappings.insert(
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

    fn map_guest(
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
        self.state.mappings.insert(
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
        self.state.usage.mapped_guest_bytes += total;
        Ok(ReplyBody::Empty)
    }

    /// Removes the GPU mapping at (ctx, va) from the page tables and the books. The TLB
    /// is invalidated before returning, so its target may be freed afterwards.
    fn unmap_gpu(&mut self, hctx: ContextId, ctx: u32, va: u64) -> Result<(), ErrorCode> {
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
        if let Err(e) = res.and(inval) {
            // The page tables disagree with the books: keep the record (and so the target)
            // rather than free memory the GPU might still reach.
            warn!("unmap ctx {ctx} va {va:#x}: {e}");
            return Err(ErrorCode::Internal);
        }
        if let Some(m) = self.state.mappings.remove(&(ctx, va)) {
            if let MappingTarget::Guest { .. } = m.target {
                let u = &mut self.state.usage;
                u.mapped_guest_bytes = u.mapped_guest_bytes.saturating_sub(m.size);
            }
        }
        Ok(())
    }

    fn unmap(&mut self, pid: u32, ctx: u32, va: u64) -> Reply {
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

    fn map_aperture(&mut self, pid: u32, ctx: u32, mem: u32, shm: &dyn ShmMapper) -> Reply {
        self.owned_ctx(pid, ctx)?;
        let m = self.owned_mem(pid, ctx, mem)?;
        if m.aperture.is_some() {
            return Err(ErrorCode::InvalidArgument);
        }
        let len = page_round_up(m.size).ok_or(ErrorCode::Internal)?;
        let used = self
            .state
            .mems
            .values()
            .filter_map(|m| m.aperture.map(|o| (o, m.size)));
        let off = first_fit_aperture(used, len).ok_or(ErrorCode::LimitExceeded)?;
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

    fn unmap_aperture(&mut self, pid: u32, ctx: u32, mem: u32, shm: &dyn ShmMapper) -> Reply {
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

    // ---- channels ---------------------------------------------------------------------

    fn create_channel(
        &mut self,
        pid: u32,
        ctx: u32,
        gp_ring_va: u64,
        gp_entries: u32,
        shm: &dyn ShmMapper,
    ) -> Reply {
        let (hctx, _) = self.owned_ctx(pid, ctx)?;
        let ring_ok = valid_gp_entries(gp_entries)
            && gp_ring_va.is_multiple_of(GP_ENTRY_SIZE as u64)
            && gp_ring_va
                .checked_add(u64::from(gp_entries) * GP_ENTRY_SIZE as u64)
                .is_some_and(|end| end <= GPU_VA_LIMIT);
        if !ring_ok {
            return Err(ErrorCode::InvalidArgument);
        }
        if self.state.channels.len() >= self.limits.max_channels as usize {
            return Err(ErrorCode::LimitExceeded);
        }
        let slot = free_slot(self.state.channels.values().map(|c| c.slot))
            .ok_or(ErrorCode::LimitExceeded)?;
        let slot_off = slot_offset(slot).ok_or(ErrorCode::Internal)?;
        let channels = &self.state.channels;
        let id = fresh_id(&mut self.state.last_channel, |i| channels.contains_key(&i));
        let sink = Arc::new(ChannelSink::new(self.shared.events.clone(), id));
        let cfg = ChannelConfig {
            gp_ring_va,
            gp_entries,
        };
        let hch = self
            .gpu
            .create_channel(hctx, cfg, sink)
            .map_err(|e| e.code())?;
        let mapped = match self.gpu.control_page(hch) {
            Ok(page) if page.len >= PAGE_SIZE => shm
                .map(slot_off, page.fd, page.offset, PAGE_SIZE, true)
                .map_err(|e| {
                    warn!("CREATE_CHANNEL: SHMEM_MAP of slot {slot}: {e}");
                    e.code()
                }),
            Ok(_) => Err(ErrorCode::Internal),
            Err(e) => {
                warn!("CREATE_CHANNEL: control page: {e}");
                Err(ErrorCode::Internal)
            }
        };
        if let Err(code) = mapped {
            if let Err(e) = self.gpu.destroy_channel(hch) {
                warn!("CREATE_CHANNEL: undo: {e}");
            }
            return Err(code);
        }
        self.state.channels.insert(
            id,
            ChannelState {
                pid,
                ctx,
                slot,
                slot_mapped: true,
                gp_ring_va,
                gp_entries,
            },
        );
        self.hal.channels.insert(id, hch);
        self.shared.busy().add_live(id, pid, hch);
        // Born into its owners' holds: shadowed before the guest learns of the slot, so
        // a new channel cannot run ahead of a hold on its VM, process or context.
        let born = self.hold.at_birth(pid, ctx);
        for who in [Holder::Operator, Holder::Scheduler, Holder::Vram] {
            if born.contains(who) {
                if let Err(e) = self.hold_channel(id, who, true, shm) {
                    warn!("CREATE_CHANNEL: cannot hold channel {id} for {who:?}: {e}");
                }
            }
        }
        debug!("pid {pid} ctx {ctx}: channel {id} ({hch:?}) at slot {slot}");
        Ok(ReplyBody::Channel { channel: id, slot })
    }

    /// API-remoting baseline: stores GP_PUT into the channel's real control page.
    fn submit(&mut self, pid: u32, ctx: u32, channel: u32, gp_put: u32) -> Reply {
        self.owned_ctx(pid, ctx)?;
        let c = self
            .state
            .channels
            .get(&channel)
            .ok_or(ErrorCode::NotFound)?;
        if c.pid != pid {
            return Err(ErrorCode::PermissionDenied);
        }
        if c.ctx != ctx {
            return Err(ErrorCode::NotFound);
        }
        if self.shadows.submit(channel, gp_put) {
            // Shadowed: held back like a store through the BAR would be.
            return Ok(ReplyBody::Empty);
        }
        let hch = *self.hal.channels.get(&channel).ok_or(ErrorCode::NotFound)?;
        if !self.hal.control_maps.contains_key(&hch) {
            // Drop mappings of channels that are gone before adding one.
            let live = &self.hal.channels;
            self.hal
                .control_maps
                .retain(|id, _| live.values().any(|h| h == id));
            let page = self.gpu.control_page(hch).map_err(|e| e.code())?;
            let map = crate::shadow::PageMap::new(page).map_err(|e| {
                warn!("SUBMIT: mapping the control page: {e}");
                ErrorCode::Internal
            })?;
            self.hal.control_maps.insert(hch, map);
        }
        let map = self.hal.control_maps.get(&hch).ok_or(ErrorCode::Internal)?;
        map.store(vgpu_protocol::ControlPage::GP_PUT, gp_put);
        Ok(ReplyBody::Empty)
    }

    fn destroy_channel(&mut self, pid: u32, ctx: u32, channel: u32, shm: &dyn ShmMapper) -> Reply {
        self.owned_ctx(pid, ctx)?;
        let c = self
            .state
            .channels
            .get_mut(&channel)
            .ok_or(ErrorCode::NotFound)?;
        if c.pid != pid {
            return Err(ErrorCode::PermissionDenied);
        }
        if c.ctx != ctx {
            return Err(ErrorCode::NotFound);
        }
        if c.slot_mapped {
            let off = slot_offset(c.slot).ok_or(ErrorCode::Internal)?;
            shm.unmap(off, PAGE_SIZE).map_err(|e| {
                warn!("DESTROY_CHANNEL: SHMEM_UNMAP of slot {}: {e}", c.slot);
                ErrorCode::Internal
            })?;
            c.slot_mapped = false;
        }
        self.state.channels.remove(&channel);
        self.shadows.forget(channel);
        if let Some(hch) = self.hal.channels.remove(&channel) {
            self.hal.control_maps.remove(&hch);
            let mut book = self.shared.busy();
            book.retire(self.gpu.as_ref(), channel);
            if let Err(e) = self.gpu.destroy_channel(hch) {
                warn!("DESTROY_CHANNEL: {e}");
            }
        } else {
            self.shared.busy().forget(channel);
        }
        Ok(ReplyBody::Empty)
    }
}
