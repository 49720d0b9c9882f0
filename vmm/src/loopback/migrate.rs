//! Live migration of a loopback VM from one backend to another ([`LoopbackVm::migrate_to`]).
//!
//! The loopback VM cannot stop its "vCPUs" (test threads keep storing GP_PUT into the
//! BAR), so it moves the device in the order that keeps every submission:
//!
//! 1. freeze the control queue (new requests wait, none is in flight);
//! 2. stop both rings on the source (GET_VRING_BASE);
//! 3. **save** on the source: the backend pauses and drains the VM (guests now store into
//!    its shadow pages) and writes the full state;
//! 4. connect to the destination, share RAM, set up the rings at the source's positions,
//!    **load**: the destination re-creates everything and maps its pages (shadow pages for
//!    the channels) over the same BAR offsets — from here on guest stores reach it;
//! 5. **tail**: a second save on the source carries the GP_PUTs guests stored there
//!    between 3 and 4, and the destination raises its shadow pages to them;
//! 6. drop the source connection (it frees the VM's objects), kick the control queue
//!    (the destination resumes: its channels unshadow) and thaw the queue.
//!
//! If anything fails before 6, the destination connection is dropped and the source's
//! rings are restarted: the kick in 6 then resumes the VM on the source, which maps its
//! pages over the BAR again.

use std::path::Path;
use std::time::{Duration, Instant};

use log::{info, warn};
use vgpu_protocol::device::{CONTROL_QUEUE, EVENT_QUEUE};
use vgpu_protocol::migration::DeviceState;

use super::{
    kick, lock, loopback_requirements, with_queues, IrqThread, LoopbackError, LoopbackVm,
    DRIVER_FEATURES,
};
use crate::frontend::VhostUserDevice;

/// What a migration moved and how long the guest's GPU work stood still.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MigrationReport {
    /// Bytes of the full device state.
    pub state_bytes: usize,
    /// Bytes of the tail.
    pub tail_bytes: usize,
    /// Objects in the state: contexts, VRAM objects (and their bytes), channels.
    pub contexts: usize,
    pub mems: usize,
    pub vram_bytes: u64,
    /// Of `vram_bytes`, what was swapped out to system memory on the source.
    pub swapped_bytes: u64,
    pub channels: usize,
    /// GP entries the guest had submitted that had not run when the source paused
    /// (they ran on the destination).
    pub queued_entries: u64,
    /// From the freeze of the control queue to the kick on the destination.
    pub downtime: Duration,
}

impl MigrationReport {
    fn of(state: &[u8], tail_bytes: usize) -> Self {
        let mut r = MigrationReport {
            state_bytes: state.len(),
            tail_bytes,
            ..Default::default()
        };
        if let Ok(st) = DeviceState::decode(state) {
            r.contexts = st.contexts.len();
            r.mems = st.mems.len();
            r.vram_bytes = st.mems.iter().map(|m| m.size).sum();
            r.swapped_bytes = st
                .mems
                .iter()
                .map(|m| {
                    let chunk = 2u64 << 20;
                    let mut bytes = 0;
                    for (i, resident) in m.resident.iter().enumerate() {
                        if !resident {
                            let off = i as u64 * chunk;
                            bytes += m.size.saturating_sub(off).min(chunk);
                        }
                    }
                    bytes
                })
                .sum();
            r.channels = st.channels.len();
            r.queued_entries = st
                .channels
                .iter()
                .map(|c| u64::from(c.gp_put.wrapping_sub(c.gp_get)))
                .sum();
        }
        r
    }
}

/// A test's hook on the byte streams between the backends (fault injection): called
/// with each stream (the full state, then the tail) before the destination gets it.
pub type StreamFilter<'a> = &'a mut dyn FnMut(&mut Vec<u8>);

impl LoopbackVm {
    /// Moves this VM's device from its backend to the one listening on `socket`, while
    /// the guest keeps running. On failure the VM keeps running on the current backend
    /// (see the module docs) and the error says what failed.
    pub fn migrate_to(&self, socket: &Path) -> Result<MigrationReport, LoopbackError> {
        self.migrate_to_filtered(socket, &mut |_| {})
    }

    /// [`Self::migrate_to`] with `filter` applied to the streams on their way (tests use
    /// it to cut or corrupt them).
    pub fn migrate_to_filtered(
        &self,
        socket: &Path,
        filter: StreamFilter<'_>,
    ) -> Result<MigrationReport, LoopbackError> {
        let t0 = Instant::now();
        self.ctrl.freeze()?;
        let r = self.migrate_frozen(socket, filter);
        // The rings run again: on the destination, or on the source after a rollback.
        kick(&self.ctrl.kick);
        self.ctrl.thaw();
        r.map(|mut rep| {
            rep.downtime = t0.elapsed();
            info!("loopback VM migrated: {rep:?}");
            rep
        })
    }

    fn migrate_frozen(
        &self,
        socket: &Path,
        filter: StreamFilter<'_>,
    ) -> Result<MigrationReport, LoopbackError> {
        let mut dev = lock(&self.dev);
        let queues = [CONTROL_QUEUE as usize, EVENT_QUEUE as usize];
        let bases = dev.stop_queues(&queues)?;
        // The irq thread watches the source's socket; it restarts on whichever serves.
        lock(&self.irq).stop();
        self.ctrl.harvest();
        self.events.harvest();
        let moved = self.move_device(&mut dev, socket, &bases, filter);
        match moved {
            Ok((dest, report)) => {
                // The source frees the VM's objects; the BAR shows the destination's pages.
                let mut source = std::mem::replace(&mut *dev, dest);
                source.disconnect();
                // A reconnect after this goes to the backend that serves the VM now.
                *lock(&self.socket) = socket.to_path_buf();
                self.restart_irq(&dev)?;
                Ok(report)
            }
            Err(e) => {
                warn!("migration failed ({e}); resuming on the source");
                with_queues(&self.ctrl, &self.events, |q| dev.restart_queues(q, &bases))?;
                self.restart_irq(&dev)?;
                Err(e)
            }
        }
    }

    /// Steps 3 to 5: the destination device with the VM's state loaded, and what moved.
    fn move_device(
        &self,
        source: &mut VhostUserDevice,
        socket: &Path,
        bases: &[u16],
        filter: StreamFilter<'_>,
    ) -> Result<(VhostUserDevice, MigrationReport), LoopbackError> {
        let mut state = source.save_state()?;
        let report = MigrationReport::of(&state, 0);
        filter(&mut state);
        let mut dest = VhostUserDevice::connect(
            socket,
            &loopback_requirements(self.faults.request_timeout),
            self.handler.clone(),
        )?;
        let loaded = (|| {
            with_queues(&self.ctrl, &self.events, |q| {
                dest.activate_at(DRIVER_FEATURES, &self.ram.vhost_regions(), q, bases)
            })?;
            dest.load_state(&state)?;
            let mut tail = source.save_state()?;
            filter(&mut tail);
            dest.load_state(&tail)?;
            Ok::<usize, LoopbackError>(tail.len())
        })();
        match loaded {
            Ok(tail_bytes) => Ok((
                dest,
                MigrationReport {
                    tail_bytes,
                    ..report
                },
            )),
            Err(e) => {
                // The destination shares the rings' kick eventfds: it must stop watching
                // them before the source's rings restart, or it could take the kick that
                // resumes the source (or serve the source's requests).
                let queues = [CONTROL_QUEUE as usize, EVENT_QUEUE as usize];
                if let Err(e2) = dest.stop_queues(&queues) {
                    warn!("stopping the refused destination's rings: {e2}");
                }
                dest.disconnect();
                Err(e)
            }
        }
    }

    fn restart_irq(&self, dev: &VhostUserDevice) -> Result<(), LoopbackError> {
        let irq = IrqThread::start(
            self.ctrl.clone(),
            self.events.clone(),
            self.shm.clone(),
            dev.socket_fd(),
        )?;
        *lock(&self.irq) = irq;
        Ok(())
    }
}
