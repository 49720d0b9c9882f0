//! Requests on channels: CREATE_CHANNEL (born into its owners' holds), SUBMIT (the
//! API-remoting baseline, and the submission path of forwarded mode), CHANNEL_STATUS
//! (forwarded mode's view of the control page), DESTROY_CHANNEL.

use super::*;

impl Session {
    // ---- channels ---------------------------------------------------------------------

    pub(super) fn create_channel(
        &mut self,
        pid: u32,
        ctx: u32,
        gp_ring_va: u64,
        gp_entries: u32,
        shm: &dyn ShmMapper,
    ) -> Reply {
        self.new_channel(pid, ctx, gp_ring_va, gp_entries, None, shm)
    }

    /// A channel that continues a migrated one: at BAR slot `slot`, resuming at `at`,
    /// born shadowed (the VM is paused while it is restored), never showing the real page
    /// before the pause ends.
    pub(in crate::vm) fn restore_channel(
        &mut self,
        pid: u32,
        ctx: u32,
        ring: (u64, u32),
        slot: u32,
        at: ChannelResume,
        shm: &dyn ShmMapper,
    ) -> Reply {
        if !self.hold.paused {
            return Err(ErrorCode::Busy);
        }
        self.new_channel(pid, ctx, ring.0, ring.1, Some((slot, at)), shm)
    }

    /// CREATE_CHANNEL, or a restored channel (`resume`: its slot and position).
    fn new_channel(
        &mut self,
        pid: u32,
        ctx: u32,
        gp_ring_va: u64,
        gp_entries: u32,
        resume: Option<(u32, ChannelResume)>,
        shm: &dyn ShmMapper,
    ) -> Reply {
        let reply = self.make_channel(pid, ctx, gp_ring_va, gp_entries, resume, shm);
        // The GPU's book counts what the session has (one more, or none if it failed).
        self.sync_capacity();
        reply
    }

    fn make_channel(
        &mut self,
        pid: u32,
        ctx: u32,
        gp_ring_va: u64,
        gp_entries: u32,
        resume: Option<(u32, ChannelResume)>,
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
        let have = self.state.channels.len();
        if have >= self.limits.max_channels as usize {
            return Err(ErrorCode::LimitExceeded);
        }
        // Within the VM's reserve, or borrowed from what no other VM's reserve covers.
        if !self.capacity.take_one(Resource::Channels, have as u32) {
            return Err(ErrorCode::LimitExceeded);
        }
        // Forwarded (the driver has no shared-memory region): the channel gets no slot and
        // its control page stays the backend's; the guest uses SUBMIT and CHANNEL_STATUS.
        // A restored channel keeps its mode: slot-less was forwarded, and only a VM whose
        // driver submits forwarded may have one (and only such a VM lacks slots).
        let forwarded = match resume {
            None => self.shared.forwarded(),
            Some((slot, _)) if (slot == NO_SLOT) != self.shared.forwarded() => {
                return Err(ErrorCode::InvalidArgument);
            }
            Some((slot, _)) => slot == NO_SLOT,
        };
        let slot = match resume {
            None if forwarded => NO_SLOT,
            None => free_slot(self.state.channels.values().map(|c| c.slot))
                .ok_or(ErrorCode::LimitExceeded)?,
            Some(_) if forwarded => NO_SLOT,
            Some((slot, _)) => {
                if slot >= CHANNEL_SLOTS || self.state.channels.values().any(|c| c.slot == slot) {
                    return Err(ErrorCode::InvalidArgument);
                }
                slot
            }
        };
        let slot_off = if forwarded {
            None
        } else {
            Some(slot_offset(slot).ok_or(ErrorCode::Internal)?)
        };
        let channels = &self.state.channels;
        let id = fresh_id(&mut self.state.last_channel, |i| channels.contains_key(&i));
        let sink = Arc::new(ChannelSink::new(self.shared.events.clone(), id));
        let cfg = ChannelConfig {
            gp_ring_va,
            gp_entries,
        };
        let hch = match resume {
            None => self.gpu.create_channel(hctx, cfg, sink),
            Some((_, at)) => self.gpu.create_channel_resumed(hctx, cfg, sink, at),
        }
        .map_err(|e| e.code())?;
        let mapped = match self.gpu.control_page(hch) {
            // A restored channel's slot shows its shadow page first (its hold below).
            Ok(page) if page.len >= PAGE_SIZE && (resume.is_some() || forwarded) => Ok(()),
            Ok(page) if page.len >= PAGE_SIZE => shm
                .map(
                    slot_off.ok_or(ErrorCode::Internal)?,
                    page.fd,
                    page.offset,
                    PAGE_SIZE,
                    true,
                )
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
                slot_mapped: !forwarded,
                gp_ring_va,
                gp_entries,
            },
        );
        self.hal.channels.insert(id, hch);
        let activity = self.shared.count_activity(self.gpu.as_ref(), hch);
        let page = match self.gpu.control_page(hch) {
            Ok(p) => crate::shadow::PageMap::new(p).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        }
        .inspect_err(|e| warn!("channel {id}: mapping its control page: {e}"))
        .ok();
        self.shared.busy().add_live(id, pid, hch, activity, page);
        // Born into its owners' holds: shadowed before the guest learns of the slot, so
        // a new channel cannot run ahead of a hold on its VM, process or context.
        let born = self.hold.at_birth(pid, ctx);
        for who in [Holder::Operator, Holder::Scheduler, Holder::Vram] {
            if born.contains(who) {
                if let Err(e) = self.hold_channel(id, who, true, shm) {
                    warn!("CREATE_CHANNEL: cannot hold channel {id} for {who:?}: {e}");
                    if resume.is_some() {
                        // Nothing shows the restored channel: undo it.
                        if let Some(c) = self.state.channels.get_mut(&id) {
                            c.slot_mapped = false;
                        }
                        let _ = self.destroy_channel(pid, ctx, id, shm);
                        return Err(ErrorCode::Internal);
                    }
                }
            }
        }
        debug!("pid {pid} ctx {ctx}: channel {id} ({hch:?}) at slot {slot}");
        Ok(ReplyBody::Channel { channel: id, slot })
    }

    /// Checks that `channel` is `pid`'s, in `ctx`.
    fn owned_channel(&self, pid: u32, ctx: u32, channel: u32) -> Result<(), ErrorCode> {
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
        Ok(())
    }

    /// API-remoting baseline and forwarded submission: stores GP_PUT into the channel's
    /// real control page.
    pub(super) fn submit(&mut self, pid: u32, ctx: u32, channel: u32, gp_put: u32) -> Reply {
        self.owned_channel(pid, ctx, channel)?;
        if self.shadows.submit(channel, gp_put) {
            // Shadowed: held back like a store through the BAR would be.
            return Ok(ReplyBody::Empty);
        }
        let map = self.control_map(channel)?;
        map.store(vgpu_protocol::ControlPage::GP_PUT, gp_put);
        self.shared.ring_doorbell(self.gpu.as_ref());
        Ok(ReplyBody::Empty)
    }

    /// Forwarded mode's view of the control page: the fields the GPU writes, read from
    /// the real page (never a shadow's copy, so they are current), and GP_PUT as the GPU
    /// sees it.
    pub(super) fn channel_status(&mut self, pid: u32, ctx: u32, channel: u32) -> Reply {
        use vgpu_protocol::ControlPage as P;
        self.owned_channel(pid, ctx, channel)?;
        let map = self.control_map(channel)?;
        // ERROR_INFO is written before ERROR: read ERROR first (acquire), then its detail.
        let error = map.load(P::ERROR);
        let error_info = map.load_u64(P::ERROR_INFO);
        Ok(ReplyBody::ChannelStatus(ChannelStatusReply {
            gp_put: map.load(P::GP_PUT),
            gp_get: map.load(P::GP_GET),
            reference: map.load(P::REF),
            notify_seq: map.load(P::NOTIFY_SEQ),
            error,
            error_info,
        }))
    }

    /// The backend's own mapping of channel `channel`'s real control page.
    fn control_map(&mut self, channel: u32) -> Result<&crate::shadow::PageMap, ErrorCode> {
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
        self.hal.control_maps.get(&hch).ok_or(ErrorCode::Internal)
    }

    pub(super) fn destroy_channel(
        &mut self,
        pid: u32,
        ctx: u32,
        channel: u32,
        shm: &dyn ShmMapper,
    ) -> Reply {
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
        self.sync_capacity();
        Ok(ReplyBody::Empty)
    }
}
