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

use super::{
    kick, lock, loopback_requirements, with_queues, IrqThread, LoopbackError, LoopbackVm,
    DRIVER_FEATURES,
};
use crate::frontend::VhostUserDevice;

/// What a migration moved and how long the guest's GPU work stood still.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrationReport {
    /// Bytes of the full device state.
    pub state_bytes: usize,
    /// Bytes of the tail.
    pub tail_bytes: usize,
    /// From the freeze of the control queue to the kick on the destination.
    pub downtime: Duration,
}

impl LoopbackVm {
    /// Moves this VM's device from its backend to the one listening on `socket`, while
    /// the guest keeps running. On failure the VM keeps running on the current backend
    /// (see the module docs) and the error says what failed.
    pub fn migrate_to(&self, socket: &Path) -> Result<MigrationReport, LoopbackError> {
        let t0 = Instant::now();
        self.ctrl.freeze()?;
        let r = self.migrate_frozen(socket);
        // The rings run again: on the destination, or on the source after a rollback.
        kick(&self.ctrl.kick);
        self.ctrl.thaw();
        r.map(|(state_bytes, tail_bytes)| {
            let rep = MigrationReport {
                state_bytes,
                tail_bytes,
                downtime: t0.elapsed(),
            };
            info!("loopback VM migrated: {rep:?}");
            rep
        })
    }

    fn migrate_frozen(&self, socket: &Path) -> Result<(usize, usize), LoopbackError> {
        let mut dev = lock(&self.dev);
        let queues = [CONTROL_QUEUE as usize, EVENT_QUEUE as usize];
        let bases = dev.stop_queues(&queues)?;
        // The irq thread watches the source's socket; it restarts on whichever serves.
        lock(&self.irq).stop();
        self.ctrl.harvest();
        self.events.harvest();
        let moved = self.move_device(&mut dev, socket, &bases);
        match moved {
            Ok((dest, state, tail)) => {
                // The source frees the VM's objects; the BAR shows the destination's pages.
                let mut source = std::mem::replace(&mut *dev, dest);
                source.disconnect();
                self.restart_irq(&dev)?;
                Ok((state, tail))
            }
            Err(e) => {
                warn!("migration failed ({e}); resuming on the source");
                with_queues(&self.ctrl, &self.events, |q| dev.restart_queues(q, &bases))?;
                self.restart_irq(&dev)?;
                Err(e)
            }
        }
    }

    /// Steps 3 to 5: the destination device with the VM's state loaded, and the sizes of
    /// the state and the tail.
    fn move_device(
        &self,
        source: &mut VhostUserDevice,
        socket: &Path,
        bases: &[u16],
    ) -> Result<(VhostUserDevice, usize, usize), LoopbackError> {
        let state = source.save_state()?;
        let mut dest =
            VhostUserDevice::connect(socket, &loopback_requirements(), self.handler.clone())?;
        with_queues(&self.ctrl, &self.events, |q| {
            dest.activate_at(DRIVER_FEATURES, &self.ram.vhost_regions(), q, bases)
        })?;
        dest.load_state(&state)?;
        let tail = source.save_state()?;
        dest.load_state(&tail)?;
        Ok((dest, state.len(), tail.len()))
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
