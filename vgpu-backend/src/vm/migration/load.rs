//! Loading a device state into a fresh session: `Session::load_device_state` and
//! `Session::apply_tail`.
//!
//! Every object is re-created through the same handler a guest request would reach, so
//! a hostile stream gets exactly the validation a hostile guest gets (ids, ranges, page
//! sizes, limits, ownership); only the ids, BAR slots and aperture offsets are forced to
//! the saved ones, and a forced one that is taken or invalid is refused.

use std::collections::BTreeSet;

use log::{info, warn};
use vgpu_host_shim::ChannelResume;
use vgpu_protocol::channel::valid_gp_entries;
use vgpu_protocol::device::{CHANNEL_SLOTS, NO_SLOT};
use vgpu_protocol::gp::{GPU_VA_LIMIT, GP_ENTRY_SIZE};
use vgpu_protocol::migration::{
    ContextRecord, DeviceState, MappingTargetRecord, MemRecord, TailState,
};
use vgpu_protocol::request::{GuestRange, ReplyBody};
use vgpu_protocol::{ErrorCode, PAGE_SIZE};

use super::MigrationError;
use crate::guest_mem::GuestMemory;
use crate::shmem::{aperture_window_free, ShmMapper};
use crate::vm::requests::Reply;
use crate::vm::session::Session;
use crate::vram::backing::{Chunk, Loc, ObjBacking};

fn restore_err(what: &'static str, id: u64) -> impl FnOnce(ErrorCode) -> MigrationError {
    move |code| MigrationError::Restore { what, id, code }
}

/// Runs `f` with the session's id counter `last` set so that the next fresh id is `id`,
/// and checks that it was.
pub(super) fn with_id(last: &mut u32, id: u32) -> Result<(), ErrorCode> {
    if id == 0 {
        return Err(ErrorCode::InvalidArgument);
    }
    *last = id.wrapping_sub(1);
    Ok(())
}

fn expect_id(r: Reply, id: u32) -> Result<ReplyBody, ErrorCode> {
    let body = r?;
    let got = match body {
        ReplyBody::Context { ctx, .. } => ctx,
        ReplyBody::Mem { mem, .. } => mem,
        ReplyBody::Channel { channel, .. } => channel,
        _ => return Ok(body),
    };
    if got != id {
        // A duplicate id in the stream: the handler skipped to a fresh one.
        return Err(ErrorCode::InvalidArgument);
    }
    Ok(body)
}

impl Session {
    /// Re-creates every object of `st` in this (empty) session at the same ids, GPU VAs,
    /// BAR slots and aperture offsets; channels continue at their saved position, held
    /// shadowed by the pause with the guest's GP_PUT in their shadow page. The session is
    /// left paused. On failure everything created so far is torn down (BAR views through
    /// `shm`), and the session is empty again.
    pub(crate) fn load_device_state(
        &mut self,
        st: &DeviceState,
        mem: &GuestMemory,
        shm: &dyn ShmMapper,
    ) -> Result<(), MigrationError> {
        let precopied = self.precopy.incoming.is_some();
        if !precopied && !self.is_empty() {
            return Err(MigrationError::NotEmpty);
        }
        self.hold.paused = true;
        let r = self.restore(st, mem, shm);
        if r.is_err() {
            self.teardown(shm);
        }
        self.publish();
        r
    }

    fn restore(
        &mut self,
        st: &DeviceState,
        mem: &GuestMemory,
        shm: &dyn ShmMapper,
    ) -> Result<(), MigrationError> {
        if self.precopy_check_full(st)? {
            // The objects exist (pre-copy); contents the state still carries go in.
            for m in st.mems.iter().filter(|m| !m.data.is_empty()) {
                let e = restore_err("VRAM object", u64::from(m.id));
                self.write_object(m.id, &m.data).map_err(e)?;
            }
        } else {
            // Without a pre-copy every object carries its contents.
            if let Some(m) = st.mems.iter().find(|m| m.data.is_empty() && m.size > 0) {
                return Err(MigrationError::Restore {
                    what: "VRAM object without contents (no pre-copy)",
                    id: u64::from(m.id),
                    code: ErrorCode::InvalidArgument,
                });
            }
            self.restore_objects(&st.contexts, &st.mems, mem)?;
        }
        self.restore_rest(st, shm)
    }

    /// Contexts and VRAM objects (with their contents, where the records carry them).
    pub(crate) fn restore_objects(
        &mut self,
        contexts: &[ContextRecord],
        mems: &[MemRecord],
        mem: &GuestMemory,
    ) -> Result<(), MigrationError> {
        // A GPU with a worker per guest process starts the processes' workers side by side.
        let owners: Vec<u32> = contexts.iter().map(|c| c.pid).collect();
        self.gpu.prepare_owners(&owners);
        for c in contexts {
            let e = restore_err("context", u64::from(c.id));
            with_id(&mut self.state.last_context, c.id).map_err(e)?;
            let e = restore_err("context", u64::from(c.id));
            expect_id(self.create_context(c.pid, mem), c.id).map_err(e)?;
        }
        for m in mems {
            let e = || restore_err("VRAM object", u64::from(m.id));
            with_id(&mut self.state.last_mem, m.id).map_err(e())?;
            match expect_id(self.alloc_vram(m.pid, m.ctx, m.size, m.align), m.id) {
                Ok(ReplyBody::Mem { size, .. }) if size == m.size => {}
                Ok(_) => return Err(e()(ErrorCode::InvalidArgument)),
                Err(code) => return Err(e()(code)),
            }
            if !m.data.is_empty() {
                self.write_object(m.id, &m.data).map_err(e())?;
            }
        }
        Ok(())
    }

    /// Mappings, aperture windows, channels, ids and events (the objects exist).
    fn restore_rest(
        &mut self,
        st: &DeviceState,
        shm: &dyn ShmMapper,
    ) -> Result<(), MigrationError> {
        // Before anything of the guest's BAR changes (modules touch none of it).
        self.restore_modules(&st.modules)?;
        for m in &st.mappings {
            let e = restore_err("mapping at VA", m.va);
            let r = match &m.target {
                MappingTargetRecord::Vram { mem } => {
                    self.map_vram(m.pid, m.ctx, *mem, m.flags, m.va, m.page)
                }
                MappingTargetRecord::Guest { ranges } => {
                    let ranges: Vec<GuestRange> = ranges
                        .iter()
                        .map(|&(gpa, len)| GuestRange { gpa, len })
                        .collect();
                    self.map_guest(m.pid, m.ctx, m.va, m.page, m.flags, &ranges)
                }
            };
            r.map_err(e)?;
            let size = self.state.mappings.get(&(m.ctx, m.va)).map(|x| x.size);
            if size != Some(m.size) {
                return Err(restore_err("mapping at VA", m.va)(
                    ErrorCode::InvalidArgument,
                ));
            }
        }
        // Nothing of the guest's BAR has changed yet: refuse here whatever would fail
        // once pages start replacing the source's views.
        self.check_views(st)?;
        for m in &st.mems {
            if let Some(off) = m.aperture {
                let e = restore_err("aperture of VRAM object", u64::from(m.id));
                self.restore_aperture(m.pid, m.ctx, m.id, off, shm)
                    .map_err(e)?;
            }
        }
        for c in &st.channels {
            let e = || restore_err("channel", u64::from(c.id));
            let error = match c.error {
                None => None,
                Some((code, info)) => Some((
                    ErrorCode::from_u32(code).map_err(|_| e()(ErrorCode::InvalidArgument))?,
                    info,
                )),
            };
            let at = ChannelResume {
                gp_get: c.gp_get,
                reference: c.reference,
                notify_seq: c.notify_seq,
                error,
            };
            with_id(&mut self.state.last_channel, c.id).map_err(e())?;
            let r =
                self.restore_channel(c.pid, c.ctx, (c.gp_ring_va, c.gp_entries), c.slot, at, shm);
            match expect_id(r, c.id) {
                Ok(ReplyBody::Channel { slot, .. }) if slot == c.slot => {}
                Ok(_) => return Err(e()(ErrorCode::Internal)),
                Err(code) => return Err(e()(code)),
            }
            if !self.shadows.raise_shadow_put(c.id, c.gp_put) {
                return Err(e()(ErrorCode::Internal));
            }
        }
        let v = &st.vm;
        self.state.last_context = self.state.last_context.max(v.last_context);
        self.state.last_mem = self.state.last_mem.max(v.last_mem);
        self.state.last_channel = self.state.last_channel.max(v.last_channel);
        let epoch = self.shared.events.epoch();
        for ev in &st.events {
            self.shared.events.push(epoch, *ev);
        }
        info!(
            "restored {} contexts, {} VRAM objects, {} mappings, {} channels, {} events",
            st.contexts.len(),
            st.mems.len(),
            st.mappings.len(),
            st.channels.len(),
            st.events.len()
        );
        Ok(())
    }

    /// Checks the BAR views of `st` (aperture windows, channel slots) and the channels'
    /// records before any is mapped: a load that fails after it began mapping has
    /// replaced some of the source's pages in the guest's BAR (the source maps them back
    /// when it resumes, but a store a guest made into the destination's page meanwhile
    /// would be lost), so only frontend failures may remain after this.
    fn check_views(&self, st: &DeviceState) -> Result<(), MigrationError> {
        let bad = |what, id: u32| restore_err(what, u64::from(id))(ErrorCode::InvalidArgument);
        let mut windows: Vec<(u64, u64)> = Vec::new();
        for m in &st.mems {
            let Some(off) = m.aperture else { continue };
            let ok = self
                .state
                .mems
                .get(&m.id)
                .is_some_and(|x| x.pid == m.pid && x.ctx == m.ctx && x.size == m.size)
                && aperture_window_free(windows.iter().copied(), off, m.size);
            if !ok {
                return Err(bad("aperture of VRAM object", m.id));
            }
            windows.push((off, m.size));
        }
        if st.channels.len() > self.limits.max_channels as usize {
            return Err(restore_err("channels", st.channels.len() as u64)(
                ErrorCode::LimitExceeded,
            ));
        }
        let mut ids = BTreeSet::new();
        let mut slots = BTreeSet::new();
        for c in &st.channels {
            let ring_ok = valid_gp_entries(c.gp_entries)
                && c.gp_ring_va.is_multiple_of(GP_ENTRY_SIZE as u64)
                && c.gp_ring_va
                    .checked_add(u64::from(c.gp_entries) * GP_ENTRY_SIZE as u64)
                    .is_some_and(|end| end <= GPU_VA_LIMIT);
            // A forwarded channel has no slot (`NO_SLOT`), and a VM's channels are
            // either all forwarded or none (its driver's mode).
            let slot_ok = if self.shared.forwarded() {
                c.slot == NO_SLOT
            } else {
                c.slot < CHANNEL_SLOTS && slots.insert(c.slot)
            };
            let ok = c.id != 0
                && ids.insert(c.id)
                && slot_ok
                && ring_ok
                && self
                    .state
                    .contexts
                    .get(&c.ctx)
                    .is_some_and(|x| x.pid == c.pid)
                && c.error
                    .is_none_or(|(code, _)| ErrorCode::from_u32(code).is_ok());
            if !ok {
                return Err(bad("channel", c.id));
            }
        }
        Ok(())
    }

    /// Raises the shadow GP_PUT of each listed channel to the guest's final value on the
    /// source. Unknown or unshadowed channels are skipped (logged).
    pub(crate) fn apply_tail(&mut self, tail: &TailState) -> Result<(), MigrationError> {
        if !self.hold.paused {
            return Err(MigrationError::NotPaused);
        }
        for &(ch, put) in &tail.puts {
            if !self.shadows.raise_shadow_put(ch, put) {
                warn!("tail: channel {ch} is not a shadowed channel of this VM");
            }
        }
        Ok(())
    }

    /// Maps every BAR view of the session again (aperture windows; channel slots with
    /// their shadow or real page): the source's views after a failed migration, whose
    /// destination may have mapped its own pages over them.
    pub(crate) fn remap_views(&mut self, shm: &dyn ShmMapper) {
        let wins: Vec<(u32, u64)> = self
            .state
            .mems
            .iter()
            .filter_map(|(id, m)| m.aperture.map(|o| (*id, o)))
            .collect();
        for (id, off) in wins {
            let Some(b) = self.hal.vram.get(&id).cloned() else {
                continue;
            };
            if let Err(e) = self.map_object_aperture(off, &b, shm) {
                warn!("remap aperture of VRAM object {id}: {e}");
            }
        }
        for (ch, _) in self.channel_list() {
            let t = match self.shadow_target(ch) {
                Ok(t) => t,
                Err(_) => continue,
            };
            let Some(slot_off) = t.slot_off else {
                continue;
            };
            let page = self.shadows.shadow_page_range(ch).unwrap_or(t.page);
            if let Err(e) = shm.map(slot_off, page.fd, page.offset, PAGE_SIZE, true) {
                warn!("remap slot of channel {ch}: {e}");
            }
        }
    }

    /// Writes an object's contents where its chunks live (VRAM or swap).
    fn write_object(&mut self, id: u32, data: &[u8]) -> Result<(), ErrorCode> {
        let b = self.hal.vram.get(&id).ok_or(ErrorCode::Internal)?;
        if b.size() != data.len() as u64 {
            return Err(ErrorCode::InvalidArgument);
        }
        for c in &b.chunks {
            let (off, n) = (c.off as usize, c.len as usize);
            let src = data.get(off..off + n).ok_or(ErrorCode::InvalidArgument)?;
            self.write_chunk(b, c, src)?;
        }
        Ok(())
    }

    /// Writes one chunk's contents (`src.len() == c.len`) where it lives.
    pub(crate) fn write_chunk(
        &self,
        b: &ObjBacking,
        c: &Chunk,
        src: &[u8],
    ) -> Result<(), ErrorCode> {
        if src.len() as u64 != c.len {
            return Err(ErrorCode::InvalidArgument);
        }
        match c.loc {
            Loc::Vram(o) => self.gpu.vram_write(o, src).map_err(|e| e.code()),
            Loc::Swap => {
                let region = b.swap_region.ok_or(ErrorCode::Internal)?;
                let dst = self
                    .swap
                    .store
                    .as_ref()
                    .and_then(|s| s.ptr(region + c.off, c.len))
                    .ok_or(ErrorCode::Internal)?;
                // SAFETY: `dst` points at `c.len` bytes of this object's swap region
                // (checked by `ptr`), which no engine reaches yet: nothing maps the
                // object until the mappings are restored.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
                Ok(())
            }
        }
    }
}
