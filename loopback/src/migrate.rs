//! Live migration of a loopback VM from one backend to another ([`LoopbackVm::migrate_to`]).
//!
//! The loopback VM cannot stop its "vCPUs" (test threads keep storing GP_PUT into the
//! BAR), so it moves the device in the order that keeps every submission:
//!
//! 1. freeze the control queue (new requests wait, none is in flight);
//! 2. stop both rings on the source (GET_VRING_BASE);
//! 3. connect to the destination, share RAM, set up the rings at the source's positions;
//! 4. **save** on the source piped frame by frame into a **load** on the destination: the
//!    source's pre-copy rounds run while the guest's channels run, then the backend
//!    pauses and drains the VM (guests now store into its shadow pages) and sends the
//!    last round and the state; the destination re-creates everything and maps its pages
//!    (shadow pages for the channels) over the same BAR offsets — from here on guest
//!    stores reach it;
//! 5. **tail**: a second save on the source carries the GP_PUTs guests stored there
//!    between 3 and 4, and the destination raises its shadow pages to them;
//! 6. drop the source connection (it frees the VM's objects), kick the control queue
//!    (the destination resumes: its channels unshadow) and thaw the queue.
//!
//! If anything fails before 6, the destination connection is dropped and the source's
//! rings are restarted: the kick in 6 then resumes the VM on the source, which maps its
//! pages over the BAR again.
//!
//! [`StateOrder::StateFirst`] moves the device as Cloud Hypervisor v53.0 does instead of
//! 3 and 4: the source's whole save is read first, then loaded into the destination
//! right after it connected — before its features and its memory table — and only then
//! the memory table and the rings follow.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use log::{debug, info, warn};
use vgpu_protocol::device::{CONTROL_QUEUE, EVENT_QUEUE};
use vgpu_protocol::migration::precopy::{ChunkFrame, PauseRecord};
use vgpu_protocol::migration::{
    stream_kind, stream_len, DeviceState, MappingTargetRecord, KIND_CHUNKS, KIND_FULL, KIND_PAUSED,
};

use super::{lock, loopback_requirements, with_queues, IrqThread, LoopbackError, LoopbackVm};
use vgpu_vmm::frontend::{read_state_frame, VhostUserDevice};

/// One pre-copy round as it went through the frontend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoundReport {
    pub round: u32,
    /// Sent after the source paused the channels.
    pub last: bool,
    /// Frame bytes (chunk contents plus framing).
    pub bytes: u64,
}

/// What a migration moved and how long the guest's GPU work stood still.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigrationReport {
    /// Bytes of the saved stream (every frame).
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
    /// GPU mappings of guest RAM in the state.
    pub guest_mappings: usize,
    /// GP entries the guest had submitted that had not run when the source paused
    /// (they ran on the destination).
    pub queued_entries: u64,
    /// Pre-copy rounds, the last one (after the pause) included.
    pub rounds: Vec<RoundReport>,
    /// The source's drain at the pause.
    pub drain: Duration,
    /// From the freeze of the control queue to the kick on the destination: how long
    /// the guest's control requests (allocations, new channels) waited.
    pub downtime: Duration,
    /// From the source pausing the channels to the kick that resumes them on the
    /// destination: how long the guest's submitted GPU work stood still.
    pub channel_pause: Duration,
    /// When the source paused (its wall clock, ns since the epoch; same host).
    pub paused_unix_ns: u64,
}

impl MigrationReport {
    /// Notes one frame of the saved stream.
    fn note(&mut self, frame: &[u8]) {
        self.state_bytes += frame.len();
        match stream_kind(frame) {
            Ok(KIND_CHUNKS) => {
                let Some((round, last)) = ChunkFrame::peek(frame) else {
                    return;
                };
                match self.rounds.last_mut() {
                    Some(r) if r.round == round => r.bytes += frame.len() as u64,
                    _ => self.rounds.push(RoundReport {
                        round,
                        last,
                        bytes: frame.len() as u64,
                    }),
                }
            }
            Ok(KIND_PAUSED) => {
                if let Ok(p) = PauseRecord::decode(frame) {
                    self.paused_unix_ns = p.paused_unix_ns;
                    self.drain = Duration::from_nanos(p.drain_ns);
                }
            }
            Ok(KIND_FULL) => {
                if let Ok(st) = DeviceState::decode(frame) {
                    self.of_state(&st);
                }
            }
            _ => {}
        }
    }

    fn of_state(&mut self, st: &DeviceState) {
        self.contexts = st.contexts.len();
        self.mems = st.mems.len();
        self.vram_bytes = st.mems.iter().map(|m| m.size).sum();
        self.swapped_bytes = st
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
        self.channels = st.channels.len();
        self.guest_mappings = st
            .mappings
            .iter()
            .filter(|m| matches!(m.target, MappingTargetRecord::Guest { .. }))
            .count();
        self.queued_entries = st
            .channels
            .iter()
            .map(|c| u64::from(c.gp_put.wrapping_sub(c.gp_get)))
            .sum();
    }

    /// Bytes sent before the pause (the pre-copy rounds).
    pub fn precopy_bytes(&self) -> u64 {
        self.rounds
            .iter()
            .filter(|r| !r.last)
            .map(|r| r.bytes)
            .sum()
    }

    /// Bytes of the last round (sent while paused).
    pub fn last_round_bytes(&self) -> u64 {
        self.rounds.iter().filter(|r| r.last).map(|r| r.bytes).sum()
    }
}

/// Wall-clock now, ns since the Unix epoch.
fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// A test's hook on the byte streams between the backends (fault injection): called
/// with each frame of the saved stream (objects, chunk rounds, the pause mark, the full
/// state), then with the tail, before the destination gets it.
pub type StreamFilter<'a> = &'a mut dyn FnMut(&mut Vec<u8>);

/// When the destination gets the device state, relative to its memory table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StateOrder {
    /// Features and memory table first, then the state streamed from the source
    /// (vgpu-vmm, QEMU).
    #[default]
    MemoryFirst,
    /// The source's whole save first, loaded before the destination's features and
    /// memory table (Cloud Hypervisor v53.0: the load comes from the device's
    /// constructor, the table at its activation).
    StateFirst,
}

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
        self.migrate_to_ordered(socket, StateOrder::MemoryFirst, filter)
    }

    /// [`Self::migrate_to_filtered`] with the destination's steps in `order`.
    pub fn migrate_to_ordered(
        &self,
        socket: &Path,
        order: StateOrder,
        filter: StreamFilter<'_>,
    ) -> Result<MigrationReport, LoopbackError> {
        let t0 = Instant::now();
        self.ctrl.freeze()?;
        let r = self.migrate_frozen(socket, order, filter);
        // The rings run again: on the destination, or on the source after a rollback
        // (the event queue's kick delivers the events restored with the state).
        self.ctrl.kick();
        self.events.kick();
        self.ctrl.thaw();
        r.map(|mut rep| {
            rep.downtime = t0.elapsed();
            if rep.paused_unix_ns > 0 {
                rep.channel_pause =
                    Duration::from_nanos(unix_ns().saturating_sub(rep.paused_unix_ns));
            }
            info!("loopback VM migrated: {rep:?}");
            rep
        })
    }

    fn migrate_frozen(
        &self,
        socket: &Path,
        order: StateOrder,
        filter: StreamFilter<'_>,
    ) -> Result<MigrationReport, LoopbackError> {
        let mut dev = lock(&self.dev);
        let queues = [CONTROL_QUEUE as usize, EVENT_QUEUE as usize];
        let bases = dev.stop_queues(&queues)?;
        // The irq thread watches the source's socket; it restarts on whichever serves.
        lock(&self.irq).stop();
        self.ctrl.harvest();
        self.events.harvest();
        let moved = self.move_device(&mut dev, socket, &bases, order, filter);
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
        order: StateOrder,
        filter: StreamFilter<'_>,
    ) -> Result<(VhostUserDevice, MigrationReport), LoopbackError> {
        let mut dest = VhostUserDevice::connect(
            socket,
            &loopback_requirements(self.faults.request_timeout, self.forwarded),
            self.handler.clone(),
        )?;
        let mut started = false;
        let loaded = (|| {
            // The rings start only once the state is in (as on a KVM destination,
            // `boot::receive`): nothing is served from a half-loaded device.
            // The rings go on as they are: with EVENT_IDX exactly where they had it.
            let event_idx = lock(&self.ctrl.st).q.event_idx();
            let prepare = |dest: &mut VhostUserDevice| {
                dest.prepare(
                    super::driver_features(self.forwarded, event_idx),
                    &self.ram.vhost_regions(),
                )?;
                if super::uses_event_idx(dest, event_idx) != event_idx {
                    return Err(LoopbackError::Config(
                        "the destination does not offer EVENT_IDX, which the rings use",
                    ));
                }
                Ok(())
            };
            let mut report = match order {
                StateOrder::MemoryFirst => {
                    prepare(&mut dest)?;
                    stream_state(source, &mut dest, filter)?
                }
                StateOrder::StateFirst => {
                    let report = state_before_table(source, &mut dest, filter)?;
                    // The backend applies the state here, or refuses the table.
                    prepare(&mut dest)?;
                    report
                }
            };
            let mut tail = source.save_state()?;
            filter(&mut tail);
            dest.load_state(&tail)?;
            report.tail_bytes = tail.len();
            started = true;
            with_queues(&self.ctrl, &self.events, |q| dest.start_rings(q, bases))?;
            Ok::<MigrationReport, LoopbackError>(report)
        })();
        match loaded {
            Ok(report) => Ok((dest, report)),
            Err(e) => {
                // The destination shares the rings' kick eventfds: it must stop watching
                // them before the source's rings restart, or it could take the kick that
                // resumes the source (or serve the source's requests).
                let queues = [CONTROL_QUEUE as usize, EVENT_QUEUE as usize];
                if started {
                    if let Err(e2) = dest.stop_queues(&queues) {
                        warn!("stopping the refused destination's rings: {e2}");
                    }
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
            self.interrupts_only,
        )?;
        *lock(&self.irq) = irq;
        Ok(())
    }
}

/// Cloud Hypervisor's order: the source's whole save, then one load into the
/// destination, which has no features or memory table yet.
fn state_before_table(
    source: &mut VhostUserDevice,
    dest: &mut VhostUserDevice,
    filter: StreamFilter<'_>,
) -> Result<MigrationReport, LoopbackError> {
    let mut report = MigrationReport::default();
    let saved = source.save_state()?;
    let mut stream = Vec::with_capacity(saved.len());
    let mut rest = &saved[..];
    while !rest.is_empty() {
        // A bad header goes on whole: the destination refuses it.
        let n = stream_len(rest)
            .ok()
            .and_then(|n| usize::try_from(n).ok())
            .map_or(rest.len(), |n| n.clamp(1, rest.len()));
        let mut frame = rest[..n].to_vec();
        rest = &rest[n..];
        report.note(&frame);
        filter(&mut frame);
        stream.extend_from_slice(&frame);
    }
    dest.load_state(&stream)?;
    Ok(report)
}

/// Pipes the source's save into the destination's load frame by frame, while the
/// source's pre-copy runs beside the guest; both sides' verdicts are checked.
fn stream_state(
    source: &mut VhostUserDevice,
    dest: &mut VhostUserDevice,
    filter: StreamFilter<'_>,
) -> Result<MigrationReport, LoopbackError> {
    let mut report = MigrationReport::default();
    let mut rd = source.begin_save()?;
    let mut wr = match dest.begin_load() {
        Ok(w) => w,
        Err(e) => {
            // The source's save ends on the broken pipe; its verdict does not matter.
            drop(rd);
            let _ = source.check_state();
            return Err(e.into());
        }
    };
    let pumped = loop {
        let mut frame = match read_state_frame(&mut rd) {
            Ok(Some(f)) => f,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        };
        report.note(&frame);
        filter(&mut frame);
        if let Err(e) = wr.write_all(&frame) {
            // The destination stopped reading (it refused the stream): its verdict
            // comes from CHECK_DEVICE_STATE; stop the source too.
            debug!("device-state write to the destination: {e}");
            break Ok(());
        }
    };
    drop(wr);
    drop(rd);
    let src = source.check_state();
    let dst = dest.check_state();
    dst?;
    src?;
    pumped.map_err(vgpu_vmm::frontend::FrontendError::StateIo)?;
    Ok(report)
}
