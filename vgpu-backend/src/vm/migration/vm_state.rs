//! A served VM's side of a migration: save (pre-copy rounds while the channels run, then
//! pause, drain, the last round and the state), load (frame by frame), resume, and
//! forgetting a migration whose connection ended.

use std::io::Write;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use log::{info, warn};
use vgpu_protocol::migration::precopy::{ChunkFrame, PauseRecord};
use vgpu_protocol::migration::{DeviceState, Stream, VmRecord};

use super::chunks::ChunkKey;
use super::policy::StreamPolicy;
use super::progress::{unix_ns, MigrationPhase, RoundStat};
use super::MigrationError;
use crate::guest_mem::GuestMemory;
use crate::shmem::ShmMapper;
use crate::vm::VmState;

/// How long a save waits for the engines to finish what they fetched.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Chunks per chunk frame (one, 2 MiB): the frontend and the destination each hold at
/// most a frame or so when the source pauses, so the pause does not wait for a backlog.
const CHUNKS_PER_FRAME: usize = 1;

/// Where a load's frames come from: the next whole frame, or `None` at the end.
pub(crate) type FrameSource<'a> = &'a mut dyn FnMut() -> Result<Option<Vec<u8>>, MigrationError>;

impl VmState {
    /// Writes the VM's device state into `out`. The first save of a migration runs the
    /// pre-copy and leaves the VM paused and drained; a later one (the VM still paused
    /// for it) writes the tail: the guest's final GP_PUTs.
    pub(crate) fn migration_save(
        &self,
        shm: &dyn ShmMapper,
        out: &mut dyn Write,
    ) -> Result<(), MigrationError> {
        if self.control.migrating() {
            let tail = self.lock_session().save_tail()?;
            info!(
                "VM {}: saved the tail ({} channels)",
                self.name,
                tail.puts.len()
            );
            out.write_all(&tail.encode())?;
            return Ok(());
        }
        self.control.set_migrating(true);
        self.control.set_saved(true);
        self.progress.start(MigrationPhase::Precopy);
        let r = self.precopy_save(shm, out);
        self.lock_session().precopy_end();
        match &r {
            Ok(()) => self.progress.update(|p| p.phase = MigrationPhase::Sent),
            Err(e) => {
                // Nothing left this host: the VM resumes when its rings restart.
                info!(
                    "VM {}: migration save failed ({e}); the VM resumes when its rings restart",
                    self.name
                );
                let msg = e.to_string();
                self.progress.update(|p| {
                    p.phase = MigrationPhase::Failed;
                    p.error = Some(msg);
                });
            }
        }
        r
    }

    fn send(&self, out: &mut dyn Write, frame: &[u8]) -> Result<(), MigrationError> {
        out.write_all(frame)?;
        self.progress.update(|p| p.bytes += frame.len() as u64);
        Ok(())
    }

    /// Objects, rounds while the channels run, pause, the last round, the full state.
    fn precopy_save(&self, shm: &dyn ShmMapper, out: &mut dyn Write) -> Result<(), MigrationError> {
        let cfg = *self.precopy_cfg.lock().unwrap_or_else(|e| e.into_inner());
        let (objects, tracking) = self.lock_session().precopy_begin()?;
        self.progress.update(|p| p.write_tracking = tracking);
        self.send(out, &objects.encode())?;
        // Without write tracking every chunk is dirty in every round: copy once, paused.
        let max_rounds = if tracking { cfg.max_rounds } else { 0 };
        let mut round = 0;
        let mut copy_rate = 0.0f64; // bytes per second of the rounds so far
        let mut since = Instant::now();
        while round < max_rounds {
            let dirty = self.lock_session().precopy_dirty(false)?;
            let bytes: u64 = dirty.iter().map(|(_, n)| n).sum();
            let window = since.elapsed();
            if round > 0 {
                let rate = bytes as f64 / window.as_secs_f64().max(1e-6);
                let expect = Duration::from_secs_f64(bytes as f64 / copy_rate.max(1.0));
                self.progress.update(|p| {
                    p.dirty_rate = rate as u64;
                    p.expected_downtime = expect;
                });
                if bytes <= cfg.stop_below_bytes {
                    if let Some(b) = self.lock_session().precopy.out.as_mut() {
                        b.defer(&dirty);
                    }
                    break;
                }
            }
            round += 1;
            since = Instant::now();
            let st = self.send_round(round, false, &dirty, out)?;
            copy_rate = st.bytes as f64 / st.duration.as_secs_f64().max(1e-6);
        }
        // The pause: from here the guest's GPU work waits.
        self.progress.update(|p| p.phase = MigrationPhase::Paused);
        let paused_unix_ns = unix_ns();
        let drained = self.drain(Some(shm), DRAIN_TIMEOUT)?;
        self.progress.update(|p| {
            p.paused_unix_ns = paused_unix_ns;
            p.drain = Duration::from_nanos(drained.waited_ns);
        });
        let mark = PauseRecord {
            paused_unix_ns,
            drain_ns: drained.waited_ns,
        };
        self.send(out, &mark.encode())?;
        let dirty = self.lock_session().precopy_dirty(true)?;
        self.send_round(round + 1, true, &dirty, out)?;
        let rec = VmRecord {
            weight: self.weight.load(Ordering::Relaxed),
            vram_quota: self.shared.vram_quota(),
            ..VmRecord::default()
        };
        let st = {
            let mut session = self.lock_session();
            session.mirror_shadows();
            session.save_device_state_precopied(rec)?
        };
        self.send(out, &st.encode())?;
        info!(
            "VM {}: saved for migration: {round} pre-copy round(s), last round {} chunk(s), \
             {} µs drain ({} channels, {} VRAM objects)",
            self.name,
            dirty.len(),
            drained.waited_ns / 1000,
            st.channels.len(),
            st.mems.len()
        );
        Ok(())
    }

    /// Sends `dirty` as round `round`'s chunk frames.
    fn send_round(
        &self,
        round: u32,
        last: bool,
        dirty: &[(ChunkKey, u64)],
        out: &mut dyn Write,
    ) -> Result<RoundStat, MigrationError> {
        let t0 = Instant::now();
        let mut stat = RoundStat {
            round,
            last,
            ..RoundStat::default()
        };
        // An empty last round still says so (the destination counts rounds).
        let batches: Vec<&[(ChunkKey, u64)]> = if dirty.is_empty() {
            vec![&[]]
        } else {
            dirty.chunks(CHUNKS_PER_FRAME).collect()
        };
        for batch in batches {
            // The session lock is held per batch only: the VM's scheduler and VRAM
            // manager go on between them.
            let chunks = self.lock_session().precopy_read(batch)?;
            let frame = ChunkFrame {
                round,
                last,
                chunks,
            };
            stat.chunks += frame.chunks.len() as u64;
            stat.bytes += frame.data_bytes();
            self.send(out, &frame.encode())?;
        }
        stat.duration = t0.elapsed();
        self.progress.update(|p| p.rounds.push(stat));
        Ok(stat)
    }

    /// Loads a transfer frame by frame: a pre-copy (objects, chunk rounds, the pause mark,
    /// the full state), a single full state (version 1), or a tail. A failure leaves the
    /// session empty (a tail's leaves the loaded state alone).
    pub(crate) fn migration_load(
        &self,
        frames: FrameSource<'_>,
        mem: &GuestMemory,
        shm: &dyn ShmMapper,
    ) -> Result<(), MigrationError> {
        let mut precopy = false;
        let r = self.load_frames(frames, mem, shm, &mut precopy);
        if let Err(e) = &r {
            if precopy {
                warn!("VM {}: pre-copy load refused: {e}", self.name);
                let mut session = self.lock_session();
                session.teardown(shm);
                session.hold.paused = false;
                session.publish();
            }
            let msg = e.to_string();
            self.progress.update(|p| {
                p.phase = MigrationPhase::Failed;
                p.error = Some(msg);
            });
        }
        r
    }

    fn load_frames(
        &self,
        frames: FrameSource<'_>,
        mem: &GuestMemory,
        shm: &dyn ShmMapper,
        precopy: &mut bool,
    ) -> Result<(), MigrationError> {
        loop {
            let Some(frame) = frames()? else {
                return Err(MigrationError::Unexpected(
                    "the stream ended before the full state",
                ));
            };
            self.progress.update(|p| p.bytes += frame.len() as u64);
            match Stream::decode(&frame)? {
                Stream::Objects(o) => {
                    if *precopy || self.control.migrating() {
                        return Err(MigrationError::Unexpected("objects frame out of order"));
                    }
                    self.progress.start(MigrationPhase::Incoming);
                    self.progress.update(|p| p.bytes = frame.len() as u64);
                    *precopy = true;
                    self.lock_session().precopy_load_objects(&o, mem, shm)?;
                }
                Stream::Chunks(c) => {
                    if !*precopy {
                        return Err(MigrationError::Unexpected("chunk frame out of order"));
                    }
                    self.lock_session().precopy_apply(&c)?;
                    self.progress.update(|p| match p.rounds.last_mut() {
                        Some(r) if r.round == c.round => {
                            r.chunks += c.chunks.len() as u64;
                            r.bytes += c.data_bytes();
                        }
                        _ => p.rounds.push(RoundStat {
                            round: c.round,
                            last: c.last,
                            chunks: c.chunks.len() as u64,
                            bytes: c.data_bytes(),
                            duration: Duration::ZERO,
                        }),
                    });
                }
                Stream::Paused(m) => {
                    if !*precopy {
                        return Err(MigrationError::Unexpected("pause mark out of order"));
                    }
                    self.progress.update(|p| {
                        p.paused_unix_ns = m.paused_unix_ns;
                        p.drain = Duration::from_nanos(m.drain_ns);
                    });
                }
                Stream::Full(st) => {
                    if !*precopy {
                        self.progress.start(MigrationPhase::Incoming);
                    }
                    // From here a failure must empty the session too.
                    *precopy = true;
                    self.load_full(&st, mem, shm, frame.len())?;
                    return expect_end(frames);
                }
                Stream::Tail(t) => {
                    if *precopy || !self.control.migrating() {
                        return Err(MigrationError::NotPaused);
                    }
                    self.lock_session().apply_tail(&t)?;
                    return expect_end(frames);
                }
            }
        }
    }

    fn load_full(
        &self,
        st: &DeviceState,
        mem: &GuestMemory,
        shm: &dyn ShmMapper,
        len: usize,
    ) -> Result<(), MigrationError> {
        self.lock_session().load_device_state(st, mem, shm)?;
        self.control.set_paused(true);
        self.control.set_migrating(true);
        // Operator policy stays this host's: the stream's weight and quota are reported
        // (a forged stream must not give its VM the GPU), every field alike.
        let policy = StreamPolicy::new(
            self.weight.load(Ordering::Relaxed),
            self.shared.vram_quota(),
            &st.vm,
        );
        info!("VM {}: {}", self.name, policy.note());
        self.progress.update(|p| {
            p.phase = MigrationPhase::Loaded;
            p.policy = Some(policy);
        });
        info!("VM {}: device state loaded ({len} bytes)", self.name);
        Ok(())
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
        self.progress.update(|p| {
            p.phase = MigrationPhase::Resumed;
            p.resumed_unix_ns = unix_ns();
        });
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

/// After the last frame of a transfer, the stream must end.
fn expect_end(frames: FrameSource<'_>) -> Result<(), MigrationError> {
    match frames()? {
        None => Ok(()),
        Some(f) => Err(MigrationError::Format(
            vgpu_protocol::migration::StateError::Trailing(f.len()),
        )),
    }
}
