//! Requests on contexts: CREATE_CONTEXT, DESTROY_CONTEXT (which frees everything the context owns).

use super::*;

impl Session {
    // ---- contexts ---------------------------------------------------------------------

    pub(in crate::vm) fn create_context(&mut self, pid: u32, mem: &GuestMemory) -> Reply {
        let reply = self.new_context(pid, mem);
        // The GPU's book counts what the session has (one more, or none if it failed).
        self.sync_capacity();
        reply
    }

    fn new_context(&mut self, pid: u32, mem: &GuestMemory) -> Reply {
        let have = self.state.contexts.len();
        if have >= self.limits.max_contexts as usize {
            return Err(ErrorCode::LimitExceeded);
        }
        // Within the VM's reserve, or borrowed from what no other VM's reserve covers.
        if !self.capacity.take_one(Resource::Contexts, have as u32) {
            return Err(ErrorCode::LimitExceeded);
        }
        let contexts = &self.state.contexts;
        let id = fresh_id(&mut self.state.last_context, |i| contexts.contains_key(&i));
        let sys = Arc::new(GuestSysMemory::new(mem.clone()));
        // The GPU also reaches the VM's swap store (above guest RAM, see crate::vram).
        let store = self.swap_store()?;
        let gpu_sys = Arc::new(crate::vram::store::VmSysMemory::new(sys.clone(), store));
        let hctx = self
            .gpu
            .create_context_for(pid, gpu_sys)
            .map_err(|e| e.code())?;
        let huge_slot = self.free_huge_slot();
        self.state.contexts.insert(id, ContextState { pid });
        self.hal.contexts.insert(id, (hctx, sys));
        if let Some(s) = huge_slot {
            self.hal.huge_slots.insert(id, s);
        }
        debug!("pid {pid}: context {id} ({hctx:?}), huge slot {huge_slot:?}");
        Ok(ReplyBody::Context { ctx: id, huge_slot })
    }

    /// The lowest huge-page slot no context of this VM uses (one it was told to use, or
    /// one its mappings lie in), so that two of the VM's contexts never want the same
    /// device addresses for identity addressing (they share one device address space
    /// in the VM's GPU worker). `None` when every slot is taken: the runtime then picks.
    fn free_huge_slot(&self) -> Option<u32> {
        let contexts = &self.state.contexts;
        let mut used: std::collections::BTreeSet<u32> = self
            .hal
            .huge_slots
            .iter()
            .filter(|(c, _)| contexts.contains_key(c))
            .map(|(_, &s)| s)
            .collect();
        used.extend(
            self.state
                .mappings
                .keys()
                .filter_map(|&(_, va)| vgpu_protocol::mem::huge_slot_of(va)),
        );
        (0..vgpu_protocol::mem::HUGE_SLOTS).find(|s| !used.contains(s))
    }

    pub(super) fn destroy_context(&mut self, pid: u32, ctx: u32, shm: &dyn ShmMapper) -> Reply {
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
        // The context's page tables go with it.
        let tables = self.gpu.page_table_bytes(hctx).unwrap_or(0);
        if let Err(e) = self.gpu.destroy_context(hctx) {
            warn!("DESTROY_CONTEXT: destroy context {ctx}: {e}");
        }
        let u = &mut self.state.usage;
        u.page_table_bytes = u.page_table_bytes.saturating_sub(tables);
        self.hal.contexts.remove(&ctx);
        self.hal.huge_slots.remove(&ctx);
        self.state.contexts.remove(&ctx);
        // Its modules and functions went with the GPU's context.
        self.state.modules.retain(|_, m| m.ctx != ctx);
        self.state.functions.retain(|_, f| f.ctx != ctx);
        // 3. Mappings and VRAM objects of the context.
        let keys: Vec<(u32, u64)> = self
            .state
            .mappings
            .range((ctx, 0)..=(ctx, u64::MAX))
            .map(|(k, _)| *k)
            .collect();
        for k in keys {
            self.forget_mapping(k);
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
        self.sync_capacity();
        Ok(ReplyBody::Empty)
    }
}
