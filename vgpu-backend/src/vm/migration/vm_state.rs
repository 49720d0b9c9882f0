//! A served VM's side of a migration: save (pause, drain, serialize), load (decode,
//! restore, stay paused), resume, and forgetting a migration whose connection ended.

use std::sync::atomic::Ordering;
use std::time::Duration;

use log::info;
use vgpu_protocol::migration::{Stream, VmRecord};

use super::MigrationError;
use crate::guest_mem::GuestMemory;
use crate::shmem::ShmMapper;
use crate::vm::VmState;

/// How long a save waits for the engines to finish what they fetched.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

impl VmState {
    /// The VM's device state as a stream. The first save of a migration pauses and drains
    /// the VM and writes the full state; a later one (the VM still paused for it) writes
    /// the tail: the guest's final GP_PUTs.
    pub(crate) fn migration_save(&self, shm: &dyn ShmMapper) -> Result<Vec<u8>, MigrationError> {
        if self.control.migrating() {
            let tail = self.lock_session().save_tail()?;
            info!(
                "VM {}: saved the tail ({} channels)",
                self.name,
                tail.puts.len()
            );
            return Ok(tail.encode());
        }
        self.control.set_migrating(true);
        self.control.set_saved(true);
        let drained = self.drain(Some(shm), DRAIN_TIMEOUT);
        let out = drained.map_err(MigrationError::from).and_then(|d| {
            let rec = VmRecord {
                weight: self.weight.load(Ordering::Relaxed),
                vram_quota: self.control.vram_quota(),
                ..VmRecord::default()
            };
            let mut session = self.lock_session();
            session.mirror_shadows();
            let st = session.save_device_state(rec)?;
            info!(
                "VM {}: saved for migration after a {} µs drain ({} channels, {} VRAM objects)",
                self.name,
                d.waited_ns / 1000,
                st.channels.len(),
                st.mems.len()
            );
            Ok(st.encode())
        });
        if out.is_err() {
            // Nothing left this host: the pause stays until the rings restart (resume).
            info!(
                "VM {}: migration save failed; the VM stays paused until its rings restart",
                self.name
            );
        }
        out
    }

    /// Loads a stream: a full state into the (empty) session, which stays paused for the
    /// migration; a tail into the session loaded before.
    pub(crate) fn migration_load(
        &self,
        bytes: &[u8],
        mem: &GuestMemory,
        shm: &dyn ShmMapper,
    ) -> Result<(), MigrationError> {
        match Stream::decode(bytes)? {
            Stream::Full(st) => {
                let mut session = self.lock_session();
                session.load_device_state(&st, mem, shm)?;
                self.control.set_paused(true);
                self.control.set_migrating(true);
                if (crate::sched::MIN_WEIGHT..=crate::sched::MAX_WEIGHT).contains(&st.vm.weight) {
                    self.weight.store(st.vm.weight, Ordering::Relaxed);
                }
                if st.vm.vram_quota != self.control.vram_quota() {
                    info!(
                        "VM {}: the source's VRAM quota was {} bytes, this host's is {}",
                        self.name,
                        st.vm.vram_quota,
                        self.control.vram_quota()
                    );
                }
                info!(
                    "VM {}: device state loaded ({} bytes)",
                    self.name,
                    bytes.len()
                );
                Ok(())
            }
            Stream::Tail(t) => {
                if !self.control.migrating() {
                    return Err(MigrationError::NotPaused);
                }
                self.lock_session().apply_tail(&t)
            }
        }
    }

    /// Ends the migration pause (the rings run again here): the channels unshadow.
    pub(crate) fn migration_resume(&self, shm: &dyn ShmMapper) {
        if !self.control.migrating() {
            return;
        }
        self.control.set_migrating(false);
        if self.control.take_saved() {
            // The source after a failed migration: its pages back over whatever the
            // destination had mapped, before the channels unshadow.
            self.lock_session().remap_views(shm);
        }
        if let Err(e) = self.resume(Some(shm)) {
            log::warn!("VM {}: resume after migration: {e}", self.name);
        }
        // Events queued while the event ring was stopped: deliver them now.
        if let Some(fd) = self.shared.events.notifier() {
            if let Err(e) = fd.write(1) {
                log::warn!("VM {}: waking event delivery: {e}", self.name);
            }
        }
    }

    /// The connection of a migrating VM ended (its state moved away, or the frontend
    /// gave up): the torn-down session must not stay paused for the next connection.
    pub(crate) fn migration_forget(&self) {
        if self.control.migrating() {
            self.control.set_migrating(false);
            self.control.take_saved();
            self.lock_session().hold.paused = false;
            self.control.set_paused(false);
        }
    }
}
