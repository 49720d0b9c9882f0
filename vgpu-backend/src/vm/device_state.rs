//! vhost-user device-state transfer (`VHOST_USER_PROTOCOL_F_DEVICE_STATE`) for one
//! connection: `SET_DEVICE_STATE_FD` starts a save or a load on a thread of its own (the
//! request must not block), `CHECK_DEVICE_STATE` waits for it and reports the outcome.
//! What is saved and how it is restored is [`crate::vm::migration`]'s business.
//!
//! - **Save**: the pre-copy rounds while the VM's channels run, then pause and drain, the
//!   last round and the state, frame by frame into the fd; close it (the frontend reads
//!   to EOF).
//! - **Load**: read frame by frame (each at most its header's declared length; an absurd
//!   length is refused before it is read), decode, apply, until the final frame and EOF.
//!   Applying needs the memory table: a context's GPU view of guest RAM is the table
//!   of its creation (`crate::guest_mem`) and guest mappings are checked against it, as
//!   a guest's `MAP_GUEST` is; the BAR is mapped through SHMEM_MAP.
//! - **Load before the memory table** (Cloud Hypervisor: `SET_DEVICE_STATE_FD` from the
//!   device's constructor, `SET_MEM_TABLE` at its activation): the stream is read and
//!   every frame decoded (a malformed one fails `CHECK_DEVICE_STATE` as before), then
//!   kept as it came — guest mappings as guest-physical ranges — and applied when the
//!   first memory table arrives ([`StateTransfer::apply_deferred`], before any ring can
//!   start). If it does not fit that table the `SET_MEM_TABLE` is refused with the
//!   reason and the session is left empty.

use std::fs::File;
use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use log::{error, info};
use vgpu_protocol::migration::{stream_len, StateError, Stream, HEADER_SIZE};
use vhost::vhost_user::message::VhostTransferStateDirection;

use crate::guest_mem::GuestMemory;
use crate::shmem::VhostShm;
use crate::vm::migration::MigrationError;
use crate::VmState;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend};

type Job = JoinHandle<Result<(), MigrationError>>;

/// Bytes a device state may carry beyond the VM's VRAM contents (contexts, mappings,
/// channels, events).
const METADATA_ALLOWANCE: u64 = 64 << 20;

/// Streams held for the memory table carry at most this many times what the VM may
/// hold: the objects, pre-copy rounds that may each resend everything (8 by default,
/// `PrecopyConfig`), the last round and the state.
const DEFERRED_COPIES: u64 = 10;

/// How long a memory table waits for a load still being read.
const DEFERRED_READ_WAIT: Duration = Duration::from_secs(120);

/// A loaded stream waiting for the memory table: its frames, in order.
type Deferred = VecDeque<Vec<u8>>;

/// The transfer of one connection.
#[derive(Default)]
pub(crate) struct StateTransfer {
    job: Mutex<Option<Job>>,
    /// A load received before the memory table, applied when the table arrives.
    deferred: Arc<Mutex<Option<Deferred>>>,
}

impl StateTransfer {
    /// Starts a save or a load of `vm`'s state through `file`.
    pub(crate) fn start(
        &self,
        vm: Arc<VmState>,
        shm: Arc<VhostShm>,
        mem: GuestMemoryAtomic<GuestMemory>,
        direction: VhostTransferStateDirection,
        file: File,
    ) -> std::io::Result<()> {
        let mut job = self.job.lock().unwrap_or_else(|e| e.into_inner());
        if job.as_ref().is_some_and(|j| !j.is_finished()) {
            return Err(std::io::Error::other("a device-state transfer is running"));
        }
        let no_table = mem.memory().num_regions() == 0;
        let is_load = direction == VhostTransferStateDirection::LOAD;
        if is_load && no_table && lock(&self.deferred).is_some() {
            return Err(std::io::Error::other(
                "a device state is already waiting for the memory table",
            ));
        }
        let deferred = self.deferred.clone();
        let name = format!("vgpu-state-{}", vm.name);
        let handle = std::thread::Builder::new().name(name).spawn(move || {
            let r = match direction {
                VhostTransferStateDirection::SAVE => save(&vm, &shm, file),
                VhostTransferStateDirection::LOAD if no_table => {
                    receive(&vm, file).map(|frames| *lock(&deferred) = Some(frames))
                }
                VhostTransferStateDirection::LOAD => load(&vm, &shm, &mem, file),
            };
            if let Err(e) = &r {
                error!("VM {}: device-state {direction:?}: {e}", vm.name);
            }
            r
        })?;
        *job = Some(handle);
        Ok(())
    }

    /// Waits for the transfer started last and returns its outcome (once).
    pub(crate) fn check(&self) -> Result<(), MigrationError> {
        let job = self.job.lock().unwrap_or_else(|e| e.into_inner()).take();
        match job {
            None => Err(MigrationError::NoTransfer),
            Some(j) => j.join().map_err(|_| MigrationError::Panicked)?,
        }
    }

    /// Applies a load that arrived before the memory table to `mem` (the first table
    /// with RAM in it); nothing to do without one. A load still being read is waited
    /// for (the frontend need not have asked `CHECK_DEVICE_STATE`). On failure the
    /// session is left empty (`VmState::migration_load`) and the error says why.
    pub(crate) fn apply_deferred(
        &self,
        vm: &VmState,
        shm: &VhostShm,
        mem: &GuestMemoryAtomic<GuestMemory>,
    ) -> Result<(), MigrationError> {
        let m = mem.memory();
        if m.num_regions() == 0 {
            return Ok(());
        }
        let t0 = Instant::now();
        while lock(&self.job).as_ref().is_some_and(|j| !j.is_finished()) {
            if t0.elapsed() > DEFERRED_READ_WAIT {
                return Err(MigrationError::Unexpected(
                    "the device state before the memory table is still being read",
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let Some(mut frames) = lock(&self.deferred).take() else {
            return Ok(());
        };
        let n = frames.len();
        info!(
            "VM {}: applying the device state received before the memory table ({n} frame(s))",
            vm.name
        );
        vm.migration_load(&mut || Ok(frames.pop_front()), &m, shm)
    }

    /// Drops a load waiting for the memory table (the driver reset the device).
    pub(crate) fn forget_deferred(&self) {
        if lock(&self.deferred).take().is_some() {
            info!("a device state waiting for the memory table was dropped");
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn save(vm: &VmState, shm: &VhostShm, file: File) -> Result<(), MigrationError> {
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    vm.migration_save(shm, &mut out)?;
    out.flush()?;
    info!("VM {}: device state written", vm.name);
    Ok(())
}

/// Reads whole frames (each a header and its declared body) from a transfer's fd.
struct FrameReader {
    file: File,
    /// The longest frame this VM could be sent (see `load`).
    most: u64,
}

impl FrameReader {
    /// The next frame, or `None` at the end of the stream (EOF between frames).
    fn next(&mut self) -> Result<Option<Vec<u8>>, MigrationError> {
        let mut bytes = vec![0u8; HEADER_SIZE];
        let mut got = 0;
        while got < HEADER_SIZE {
            let n = self.file.read(&mut bytes[got..])?;
            if n == 0 {
                break;
            }
            got += n;
        }
        if got == 0 {
            return Ok(None);
        }
        bytes.truncate(got);
        // A short or bad header is reported by the decoder.
        let Ok(total) = stream_len(&bytes) else {
            return Ok(Some(bytes));
        };
        // What this VM may hold, plus room for its books: a longer frame cannot be one
        // this host would accept, so it is refused before it is read.
        if total > self.most {
            return Err(MigrationError::Format(StateError::TooLarge(total)));
        }
        let want = total.saturating_sub(got as u64);
        (&mut self.file).take(want).read_to_end(&mut bytes)?;
        Ok(Some(bytes))
    }
}

/// The longest frame a stream for `vm` may carry (see `FrameReader::next`).
fn frame_limit(vm: &VmState) -> u64 {
    vm.shared
        .vram_quota()
        .saturating_add(vm.limits.swap_bytes)
        .saturating_add(METADATA_ALLOWANCE)
}

/// Reads a whole stream that came before the memory table and checks that every frame
/// decodes; the frames are applied later (`StateTransfer::apply_deferred`).
fn receive(vm: &VmState, file: File) -> Result<Deferred, MigrationError> {
    let most = frame_limit(vm);
    let budget = most.saturating_mul(DEFERRED_COPIES);
    let mut reader = FrameReader { file, most };
    let mut frames = Deferred::new();
    let mut total: u64 = 0;
    while let Some(frame) = reader.next()? {
        total = total.saturating_add(frame.len() as u64);
        if total > budget {
            return Err(MigrationError::Format(StateError::TooLarge(total)));
        }
        Stream::decode(&frame)?;
        frames.push_back(frame);
    }
    if frames.is_empty() {
        return Err(MigrationError::Unexpected(
            "the stream ended before the full state",
        ));
    }
    info!(
        "VM {}: device state received before the memory table ({total} bytes, {} frame(s)): \
         applied when the table arrives",
        vm.name,
        frames.len()
    );
    Ok(frames)
}

fn load(
    vm: &VmState,
    shm: &VhostShm,
    mem: &GuestMemoryAtomic<GuestMemory>,
    file: File,
) -> Result<(), MigrationError> {
    let mut reader = FrameReader {
        file,
        most: frame_limit(vm),
    };
    let m = mem.memory();
    vm.migration_load(&mut || reader.next(), &m, shm)
}
