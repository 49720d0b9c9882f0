//! Control-queue request handling: decode, validate, act on the HAL and the BAR, reply.
//! This file decodes and dispatches and holds the ownership checks; the handlers live by
//! subject in `contexts`, `memory` and `channels`.
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

mod channels;
mod contexts;
mod memory;
mod modules;

#[cfg(test)]
pub(in crate::vm) use memory::record_of;

use std::sync::Arc;

use log::{debug, trace, warn};
use vgpu_host_shim::{ChannelConfig, ChannelResume, ContextId, MapFlags, MapTarget, PageSize};
use vgpu_protocol::channel::valid_gp_entries;
use vgpu_protocol::device::{slot_offset, CHANNEL_SLOTS, NO_SLOT};
use vgpu_protocol::gp::{GPU_VA_LIMIT, GP_ENTRY_SIZE};
use vgpu_protocol::request::{
    encode_reply, ChannelStatusReply, GuestRange, InfoReply, Op, ReplyBody, Request, StatsReply,
    MAP_READ_ONLY, PAGE_2M, PAGE_4K, PAGE_64K,
};
use vgpu_protocol::{ErrorCode, PAGE_SIZE, PROTOCOL_VERSION};

use crate::capacity::Resource;
use crate::events::ChannelSink;
use crate::guest_mem::{contains_range, GuestMemory, GuestSysMemory};
use crate::shadow::Holder;
use crate::shmem::{aperture_window_free, first_fit_aperture, free_slot, page_round_up, ShmMapper};
use crate::vm::session::{
    ChannelState, ContextState, MappingState, MappingTarget, MemState, Session,
};

/// Largest VRAM alignment a guest may ask for.
pub const MAX_VRAM_ALIGN: u64 = 1 << 30;

pub(in crate::vm) type Reply = Result<ReplyBody, ErrorCode>;

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
                trace!(
                    "request op {} pid {} ctx {}: {}",
                    r.opcode(),
                    r.pid,
                    r.ctx,
                    if res.is_ok() { "ok" } else { "failed" }
                );
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
            // The real GPU's, unchanged (none on the sim); what the guest may use of them
            // is the guest library's to say.
            Op::GetAttributes => self
                .gpu
                .device_attributes(pid)
                .map(ReplyBody::Attributes)
                .map_err(|e| e.code()),
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
            Op::ChannelStatus { channel } => self.channel_status(pid, ctx, *channel),
            Op::ModuleLoad { ranges } => self.module_load(pid, ctx, ranges, mem),
            Op::ModuleUnload { module } => self.module_unload(pid, ctx, *module),
            Op::FunctionGet { module, name } => self.function_get(pid, ctx, *module, name),
            Op::GlobalGet { module, name } => self.global_get(pid, ctx, *module, name),
            Op::GlobalWrite(copy) => self.global_write(pid, ctx, copy, mem),
            Op::GlobalRead(copy) => self.global_read(pid, ctx, copy, mem),
        }
    }

    fn info(&self) -> InfoReply {
        let info = self.gpu.info();
        InfoReply {
            version: PROTOCOL_VERSION,
            compute_engines: info.compute_engines,
            vram_bytes: info.vram_bytes.min(self.shared.vram_quota()),
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
            vram_limit: self.shared.vram_quota(),
        }
    }

    // ---- ownership checks -------------------------------------------------------------

    /// The HAL context and sysmem of `ctx`, if `pid` owns it.
    pub(in crate::vm) fn owned_ctx(
        &self,
        pid: u32,
        ctx: u32,
    ) -> Result<(ContextId, Arc<GuestSysMemory>), ErrorCode> {
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
}
