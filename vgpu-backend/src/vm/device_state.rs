//! vhost-user device-state transfer (`VHOST_USER_PROTOCOL_F_DEVICE_STATE`) for one
//! connection: `SET_DEVICE_STATE_FD` starts a save or a load on a thread of its own (the
//! request must not block), `CHECK_DEVICE_STATE` waits for it and reports the outcome.
//! What is saved and how it is restored is [`crate::vm::migration`]'s business.
//!
//! - **Save**: the pre-copy rounds while the VM's channels run, then pause and drain, the
//!   last round and the state, frame by frame into the fd; close it (the frontend reads
//!   to EOF).
//! - **Load**: read frame by frame (each at most its header's declared length; an absurd
//!   length is refused before it is read), decode, apply, until the final frame and EOF. The frontend must have sent the
//!   memory table (`SET_MEM_TABLE`) and the backend-request fd before: guest mappings
//!   are checked against guest RAM and the BAR is mapped through SHMEM_MAP.

use std::fs::File;
use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use log::{error, info};
use vgpu_protocol::migration::{stream_len, StateError, HEADER_SIZE};
use vhost::vhost_user::message::VhostTransferStateDirection;

use crate::guest_mem::GuestMemory;
use crate::shmem::VhostShm;
use crate::vm::migration::MigrationError;
use crate::VmState;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};

type Job = JoinHandle<Result<(), MigrationError>>;

/// Bytes a device state may carry beyond the VM's VRAM contents (contexts, mappings,
/// channels, events).
const METADATA_ALLOWANCE: u64 = 64 << 20;

/// The transfer of one connection.
#[derive(Default)]
pub(crate) struct StateTransfer {
    job: Mutex<Option<Job>>,
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
        let name = format!("vgpu-state-{}", vm.name);
        let handle = std::thread::Builder::new().name(name).spawn(move || {
            let r = match direction {
                VhostTransferStateDirection::SAVE => save(&vm, &shm, file),
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

fn load(
    vm: &VmState,
    shm: &VhostShm,
    mem: &GuestMemoryAtomic<GuestMemory>,
    file: File,
) -> Result<(), MigrationError> {
    let most = vm
        .shared
        .vram_quota()
        .saturating_add(vm.limits.swap_bytes)
        .saturating_add(METADATA_ALLOWANCE);
    let mut reader = FrameReader { file, most };
    let m = mem.memory();
    vm.migration_load(&mut || reader.next(), &m, shm)
}
