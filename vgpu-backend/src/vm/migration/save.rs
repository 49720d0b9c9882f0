//! Saving a paused session: `Session::save_device_state` and `Session::save_tail`.

use vgpu_protocol::migration::{
    ChannelRecord, ContextRecord, DeviceState, MappingRecord, MappingTargetRecord, MemRecord,
    TailState, VmRecord,
};
use vgpu_protocol::ControlPage;

use super::MigrationError;
use crate::shadow::PageMap;
use crate::vm::session::{MappingTarget, Session};
use crate::vram::backing::{Loc, ObjBacking};

impl Session {
    /// The session as a device state. The VM must be paused and drained (nothing runs, so
    /// VRAM and the control pages are stable); `vm` carries what lives outside the
    /// session (weight, quota), the last ids are filled in here. Pending events are
    /// copied and stay queued (the source keeps them if the migration fails).
    #[cfg(test)]
    pub(crate) fn save_device_state(
        &mut self,
        vm: VmRecord,
    ) -> Result<DeviceState, MigrationError> {
        self.save_state(vm, true)
    }

    /// [`Self::save_device_state`] without the objects' contents (a pre-copy sent them in
    /// chunk frames, see [`super::chunks`]).
    pub(crate) fn save_device_state_precopied(
        &mut self,
        vm: VmRecord,
    ) -> Result<DeviceState, MigrationError> {
        self.save_state(vm, false)
    }

    fn save_state(&mut self, vm: VmRecord, contents: bool) -> Result<DeviceState, MigrationError> {
        if !self.hold.paused {
            return Err(MigrationError::NotPaused);
        }
        let modules = self.save_modules()?;
        let vm = VmRecord {
            last_context: self.state.last_context,
            last_mem: self.state.last_mem,
            last_channel: self.state.last_channel,
            ..vm
        };
        let contexts = self
            .state
            .contexts
            .iter()
            .map(|(id, c)| ContextRecord {
                id: *id,
                pid: c.pid,
            })
            .collect();
        let mut mems = Vec::with_capacity(self.state.mems.len());
        for (id, m) in &self.state.mems {
            let b = self
                .hal
                .vram
                .get(id)
                .ok_or_else(|| read_err("VRAM object", *id, "no backing"))?;
            mems.push(MemRecord {
                id: *id,
                pid: m.pid,
                ctx: m.ctx,
                size: m.size,
                align: m.align,
                aperture: m.aperture,
                resident: b
                    .chunks
                    .iter()
                    .map(|c| matches!(c.loc, Loc::Vram(_)))
                    .collect(),
                data: if contents {
                    self.object_bytes(*id, b)?
                } else {
                    Vec::new()
                },
            });
        }
        let mappings = self
            .state
            .mappings
            .iter()
            .map(|((ctx, va), m)| MappingRecord {
                ctx: *ctx,
                va: *va,
                pid: m.pid,
                size: m.size,
                page: m.page,
                flags: m.flags,
                target: match &m.target {
                    MappingTarget::Vram { mem } => MappingTargetRecord::Vram { mem: *mem },
                    MappingTarget::Guest { ranges } => MappingTargetRecord::Guest {
                        ranges: ranges.iter().map(|r| (r.gpa, r.len)).collect(),
                    },
                },
            })
            .collect();
        let mut channels = Vec::with_capacity(self.state.channels.len());
        let ids: Vec<u32> = self.state.channels.keys().copied().collect();
        for id in ids {
            channels.push(self.channel_record(id)?);
        }
        let events = self.shared.events.snapshot();
        Ok(DeviceState {
            vm,
            contexts,
            mems,
            mappings,
            channels,
            events,
            modules,
        })
    }

    /// The guest's final GP_PUT of every shadowed channel (see [`super`]: the tail).
    pub(crate) fn save_tail(&mut self) -> Result<TailState, MigrationError> {
        if !self.hold.paused {
            return Err(MigrationError::NotPaused);
        }
        let mut puts = Vec::new();
        for (id, _) in self.channel_list() {
            if let Ok(p) = self.peek_channel_any(id) {
                if let Some(put) = p.shadow_put {
                    puts.push((id, put));
                }
            }
        }
        Ok(TailState { puts })
    }

    fn channel_record(&mut self, id: u32) -> Result<ChannelRecord, MigrationError> {
        let c = self
            .state
            .channels
            .get(&id)
            .cloned()
            .ok_or_else(|| read_err("channel", id, "gone"))?;
        let hch = *self
            .hal
            .channels
            .get(&id)
            .ok_or_else(|| read_err("channel", id, "no HAL channel"))?;
        let page = self
            .gpu
            .control_page(hch)
            .map_err(|e| read_err("channel", id, &e.to_string()))?;
        let real = PageMap::new(page).map_err(|e| read_err("channel", id, &e.to_string()))?;
        let peek = self
            .peek_channel_any(id)
            .map_err(|e| read_err("channel", id, &e.to_string()))?;
        let error = self
            .gpu
            .channel_error(hch)
            .map_err(|e| read_err("channel", id, &e.to_string()))?
            .map(|(code, info)| (code.as_u32(), info));
        Ok(ChannelRecord {
            id,
            pid: c.pid,
            ctx: c.ctx,
            slot: c.slot,
            gp_ring_va: c.gp_ring_va,
            gp_entries: c.gp_entries,
            gp_get: peek.gp_get,
            gp_put: peek.shadow_put.unwrap_or(peek.real_put),
            reference: real.load(ControlPage::REF),
            notify_seq: real.load(ControlPage::NOTIFY_SEQ),
            error,
        })
    }

    /// The contents of VRAM object `id`, chunk by chunk from wherever each lives.
    fn object_bytes(&self, id: u32, b: &ObjBacking) -> Result<Vec<u8>, MigrationError> {
        let len =
            usize::try_from(b.size()).map_err(|_| read_err("VRAM object", id, "too large"))?;
        let mut data = vec![0u8; len];
        for c in &b.chunks {
            let (off, n) = (c.off as usize, c.len as usize);
            let dst = data
                .get_mut(off..off + n)
                .ok_or_else(|| read_err("VRAM object", id, "chunk outside the object"))?;
            match c.loc {
                Loc::Vram(o) => self
                    .gpu
                    .vram_read(o, dst)
                    .map_err(|e| read_err("VRAM object", id, &e.to_string()))?,
                Loc::Swap => {
                    let region = b
                        .swap_region
                        .ok_or_else(|| read_err("VRAM object", id, "swapped without a region"))?;
                    let src = self
                        .swap
                        .store
                        .as_ref()
                        .and_then(|s| s.ptr(region + c.off, c.len))
                        .ok_or_else(|| read_err("VRAM object", id, "swap range"))?;
                    // SAFETY: `src` points at `n` bytes inside the VM's swap store (checked
                    // by `ptr`), which lives as long as the session; the VM is drained, so
                    // no engine writes them meanwhile.
                    unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), n) };
                }
            }
        }
        Ok(data)
    }
}

fn read_err(what: &'static str, id: u32, detail: &str) -> MigrationError {
    MigrationError::Read {
        what,
        id: u64::from(id),
        detail: detail.to_string(),
    }
}
