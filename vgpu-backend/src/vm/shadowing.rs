//! A session's channels through the shadow mechanism ([`crate::shadow`]): where each
//! channel's control page is and where the BAR shows it, the holders' one path to shadow
//! and unshadow, peeks and mirrors.

use std::io;

use log::debug;
use vgpu_protocol::device::{slot_offset, NO_SLOT};
use vgpu_protocol::PAGE_SIZE;

use crate::shadow::{
    ChannelPeek, Holder, Holders, ShadowError, ShadowStats, ShadowSwitch, ShadowTarget,
};
use crate::shmem::ShmMapper;
use crate::vm::session::Session;

impl Session {
    /// Where channel `ch`'s control page is and where the BAR shows it.
    pub(crate) fn shadow_target(&self, ch: u32) -> Result<ShadowTarget, ShadowError> {
        let c = self
            .state
            .channels
            .get(&ch)
            .ok_or(ShadowError::NoChannel(ch))?;
        let slot_off = if c.slot == NO_SLOT {
            // Forwarded: no BAR view to switch, SUBMIT writes the shadow while held.
            None
        } else if !c.slot_mapped {
            return Err(ShadowError::SlotNotMapped(ch));
        } else {
            Some(slot_offset(c.slot).ok_or(ShadowError::SlotNotMapped(ch))?)
        };
        let hch = *self
            .hal
            .channels
            .get(&ch)
            .ok_or(ShadowError::NoChannel(ch))?;
        let page = self.gpu.control_page(hch)?;
        if page.len < PAGE_SIZE {
            return Err(io::Error::other("control page shorter than a page").into());
        }
        Ok(ShadowTarget { ch, page, slot_off })
    }

    /// `who` takes (`on`) or drops its hold of channel `ch` (see [`Shadows::set_hold`]).
    ///
    /// [`Shadows::set_hold`]: crate::shadow::Shadows::set_hold
    pub fn hold_channel(
        &mut self,
        ch: u32,
        who: Holder,
        on: bool,
        shm: &dyn ShmMapper,
    ) -> Result<ShadowSwitch, ShadowError> {
        let t = self.shadow_target(ch)?;
        // The scheduler looks at a VM whose count moved: a dormant VM's new hold (and any
        // failed unshadow to retry) is seen at the next tick.
        self.shared.note_change();
        let switch = self.shadows.set_hold(t, who, on, shm)?;
        if who == Holder::Vram {
            // The VRAM manager waits only for what the GPU fetched, where it can keep
            // the GPU from fetching more (see `Session::context_drained`).
            let hch = self.hal.channels.get(&ch).copied();
            if let Some(Err(e)) = hch.map(|h| self.gpu.hold_fetch(h, on)) {
                debug!("channel {ch}: hold fetch {on}: {e}");
            }
        }
        if !on && switch.changed {
            // The unshadow raised the real GP_PUT to what the guest stored meanwhile.
            self.shared.ring_doorbell(self.gpu.as_ref());
        }
        Ok(switch)
    }

    /// Who holds channel `ch` shadowed.
    pub fn channel_holders(&self, ch: u32) -> Holders {
        self.shadows.holders(ch)
    }

    /// Unshadows the shadowed channels nobody holds (failed unshadows); returns how many
    /// are still shadowed.
    pub fn retry_orphans(&mut self, shm: &dyn ShmMapper) -> usize {
        let mut left = 0;
        for ch in self.shadows.orphans() {
            let done = self
                .shadow_target(ch)
                .and_then(|t| self.shadows.unshadow_orphan(t, shm));
            match done {
                Err(e) => {
                    debug!("channel {ch}: unshadow retry: {e}");
                    left += 1;
                }
                Ok(_) => self.shared.ring_doorbell(self.gpu.as_ref()),
            }
        }
        left
    }

    /// See [`Shadows::release_capped`](crate::shadow::Shadows::release_capped).
    pub fn release_capped(&mut self, ch: u32, n: u32) -> Result<u32, ShadowError> {
        if !self.state.channels.contains_key(&ch) {
            return Err(ShadowError::NoChannel(ch));
        }
        let released = self.shadows.release_capped(ch, n)?;
        if released > 0 {
            self.shared.ring_doorbell(self.gpu.as_ref());
        }
        Ok(released)
    }

    /// See [`Shadows::peek`]. While the operator has the VM paused this fails with
    /// [`ShadowError::Paused`], so that a scheduler leaves the channel alone (and counts
    /// the VM as idle rather than starving everyone else for it); see [`crate::control`].
    ///
    /// [`Shadows::peek`]: crate::shadow::Shadows::peek
    pub fn peek_channel(&mut self, ch: u32) -> Result<ChannelPeek, ShadowError> {
        if self.hold.paused {
            return Err(ShadowError::Paused(ch));
        }
        self.peek_channel_any(ch)
    }

    /// Whether channel `ch` did nothing since the scheduler's last look (see
    /// [`crate::shadow::Shadows::quiet`]). Never while the VM is paused, nor while the
    /// scheduler holds its owner back: every channel of a held owner is looked at (and
    /// shadowed), so a tenant over its share cannot run on through an idle channel.
    pub fn quiet_channel(&mut self, ch: u32) -> bool {
        self.may_skip(ch) && self.shadows.quiet(ch)
    }

    /// Whether channel `ch`, found quiet by the last [`Session::quiet_channel`], still
    /// counts as quiet when its GPU activity count has not moved since (see
    /// [`crate::shadow::Shadows::still_quiet`]): no page is read.
    pub fn quiet_unmoved(&self, ch: u32) -> bool {
        self.may_skip(ch) && self.shadows.still_quiet(ch)
    }

    /// Neither paused nor held back by the scheduler as a whole VM or process.
    fn may_skip(&self, ch: u32) -> bool {
        if self.hold.paused {
            return false;
        }
        let held = self.hold.sched_vm
            || (!self.hold.sched_pids.is_empty()
                && self
                    .state
                    .channels
                    .get(&ch)
                    .is_none_or(|c| self.hold.sched_holds(c.pid)));
        !held
    }

    /// [`Session::peek_channel`], paused or not.
    pub fn peek_channel_any(&mut self, ch: u32) -> Result<ChannelPeek, ShadowError> {
        // Looked at before: its page is mapped here (no HAL lookup).
        if self.state.channels.get(&ch).is_some_and(|c| c.holdable()) {
            if let Some(p) = self.shadows.peek_mapped(ch) {
                return Ok(p);
            }
        }
        let t = self.shadow_target(ch)?;
        Ok(self.shadows.peek(ch, t.page)?)
    }

    /// See [`Shadows::mirror`](crate::shadow::Shadows::mirror).
    pub fn mirror_shadows(&mut self) -> usize {
        self.shadows.mirror()
    }

    pub fn is_shadowed(&self, ch: u32) -> bool {
        self.shadows.is_shadowed(ch)
    }

    pub fn shadow_stats(&self) -> ShadowStats {
        self.shadows.stats()
    }

    /// The VM's channels: (guest channel id, owning guest PID).
    pub fn channel_list(&self) -> Vec<(u32, u32)> {
        self.state
            .channels
            .iter()
            .map(|(id, c)| (*id, c.pid))
            .collect()
    }
}
