//! VRAM pre-copy, the session's part: which chunks changed since they were sent (source)
//! and where arriving chunks go (destination). The orchestration (rounds, pause, frames)
//! is [`super::vm_state`]'s.
//!
//! **Source.** A chunk (2 MiB of an object) is sent again when, since it was last sent:
//! - the engines wrote into it: the HAL's write record of the owner context at the
//!   chunk's current backing, VRAM or swap store ([`vgpu_host_shim::Gpu::take_written`],
//!   taken *before* the chunk is read, so a later write is noted for the next round);
//! - it moved (eviction or swap-in, [`OutBook::note_moved`]), or its backing differs from
//!   the one it was read from (a write that landed in the old copy is in the new one,
//!   and the new place's record may not show it);
//! - it is in an aperture window and this is the last round: guest CPU stores through
//!   the window are invisible to the GPU's tracking, so such objects are sent only once,
//!   while paused (a GPU that cannot track writes makes every chunk dirty in the same way).
//!
//! **Destination.** The objects frame creates the contexts and objects (through the
//! request handlers, as a full load does); chunk frames write into the objects' backing;
//! the final full state must describe the same objects, and every chunk must have arrived.

use std::collections::{BTreeSet, HashMap};

use vgpu_host_shim::MapTarget;
use vgpu_protocol::migration::precopy::{ChunkFrame, ChunkRecord, ObjectsState};
use vgpu_protocol::migration::{DeviceState, MemRecord};
use vgpu_protocol::ErrorCode;

use super::MigrationError;
use crate::guest_mem::GuestMemory;
use crate::vm::session::Session;
use crate::vram::backing::{Chunk, Loc, ObjBacking};
use crate::vram::store::SWAP_BASE;

/// A chunk: (VRAM object id, chunk index).
pub(crate) type ChunkKey = (u32, usize);

/// The source's books of a pre-copy.
#[derive(Debug, Default)]
pub(crate) struct OutBook {
    /// Where each chunk was read from when last sent.
    sent: HashMap<ChunkKey, Loc>,
    /// Chunks known to need sending (moved, or found dirty in a round not sent).
    pending: BTreeSet<ChunkKey>,
}

impl OutBook {
    /// The VRAM manager moved a chunk: its contents must be sent again.
    pub(crate) fn note_moved(&mut self, key: ChunkKey) {
        self.pending.insert(key);
    }

    /// Chunks found dirty but not sent in this round: they go in a later one.
    pub(crate) fn defer(&mut self, keys: &[(ChunkKey, u64)]) {
        self.pending.extend(keys.iter().map(|(k, _)| *k));
    }
}

/// The destination's books: the objects announced and which chunks arrived.
#[derive(Debug, Default)]
pub(crate) struct InBook {
    objects: ObjectsState,
    delivered: HashMap<u32, Vec<bool>>,
}

/// Both sides' books, on the session (so the VRAM manager can mark moves).
#[derive(Debug, Default)]
pub(crate) struct PrecopyBooks {
    pub(crate) out: Option<OutBook>,
    pub(crate) incoming: Option<InBook>,
}

fn read_err(id: u32, detail: &str) -> MigrationError {
    MigrationError::Read {
        what: "VRAM object",
        id: u64::from(id),
        detail: detail.to_string(),
    }
}

fn restore_err(id: u32) -> impl FnOnce(ErrorCode) -> MigrationError {
    move |code| MigrationError::Restore {
        what: "VRAM chunk of object",
        id: u64::from(id),
        code,
    }
}

/// The metadata of an object record (everything but contents and advisory residency).
fn same_object(a: &MemRecord, b: &MemRecord) -> bool {
    (a.id, a.pid, a.ctx, a.size, a.align, a.aperture)
        == (b.id, b.pid, b.ctx, b.size, b.align, b.aperture)
}

impl Session {
    /// Starts a pre-copy on the source: write tracking on every context of the VM, fresh
    /// books, and the objects frame. Returns whether the GPU tracks writes (if not, every
    /// chunk counts as written in every round).
    pub(crate) fn precopy_begin(&mut self) -> Result<(ObjectsState, bool), MigrationError> {
        let mut tracking = true;
        for (ctx, (h, _)) in &self.hal.contexts {
            match self.gpu.track_writes(*h, true) {
                Ok(t) => tracking &= t,
                Err(e) => return Err(read_err(*ctx, &format!("tracking writes: {e}"))),
            }
        }
        self.precopy.out = Some(OutBook::default());
        let contexts = self
            .state
            .contexts
            .iter()
            .map(|(id, c)| vgpu_protocol::migration::ContextRecord {
                id: *id,
                pid: c.pid,
            })
            .collect();
        let mut mems = Vec::with_capacity(self.state.mems.len());
        for (id, m) in &self.state.mems {
            let b = self
                .hal
                .vram
                .get(id)
                .ok_or_else(|| read_err(*id, "no backing"))?;
            mems.push(MemRecord {
                id: *id,
                pid: m.pid,
                ctx: m.ctx,
                size: m.size,
                align: m.align,
                aperture: m.aperture,
                resident: b
                    .chunks
                    .iter()
                    .map(|c| matches!(c.loc, Loc::Vram(_)))
                    .collect(),
                data: Vec::new(),
            });
        }
        Ok((ObjectsState { contexts, mems }, tracking))
    }

    /// Ends a pre-copy on the source (success or not): tracking off, books dropped.
    pub(crate) fn precopy_end(&mut self) {
        for (h, _) in self.hal.contexts.values() {
            let _ = self.gpu.track_writes(*h, false);
        }
        self.precopy.out = None;
    }

    /// The chunks to send in a round, with their lengths: never sent, written, moved, or
    /// (in the `last` round) inside an aperture window. Outside the last round, objects
    /// with an aperture window are left for it.
    pub(crate) fn precopy_dirty(
        &mut self,
        last: bool,
    ) -> Result<Vec<(ChunkKey, u64)>, MigrationError> {
        let mut book = self.precopy.out.take().ok_or(MigrationError::NotPaused)?;
        let mut out = Vec::new();
        for (id, m) in &self.state.mems {
            let b = self
                .hal
                .vram
                .get(id)
                .ok_or_else(|| read_err(*id, "no backing"))?;
            let hctx = self.hal.contexts.get(&m.ctx).map(|(h, _)| *h);
            let windowed = m.aperture.is_some();
            for (i, c) in b.chunks.iter().enumerate() {
                if windowed && !last {
                    continue;
                }
                let key = (*id, i);
                let written = match (hctx, chunk_target(b, c)) {
                    (Some(h), Some(t)) => self.gpu.take_written(h, t, c.len).unwrap_or(true),
                    _ => true,
                };
                let moved = book.pending.remove(&key);
                let stale = book.sent.get(&key) != Some(&c.loc);
                if written || moved || stale || windowed {
                    out.push((key, c.len));
                }
            }
        }
        self.precopy.out = Some(book);
        Ok(out)
    }

    /// Reads `keys`' chunks from wherever each lives now and books them as sent.
    pub(crate) fn precopy_read(
        &mut self,
        keys: &[(ChunkKey, u64)],
    ) -> Result<Vec<ChunkRecord>, MigrationError> {
        let mut out = Vec::with_capacity(keys.len());
        let mut sent = Vec::with_capacity(keys.len());
        for &((id, i), _) in keys {
            let b = self.hal.vram.get(&id).ok_or_else(|| read_err(id, "gone"))?;
            let c = *b
                .chunks
                .get(i)
                .ok_or_else(|| read_err(id, "no such chunk"))?;
            let mut data = vec![0u8; c.len as usize];
            self.read_chunk(id, b, &c, &mut data)?;
            out.push(ChunkRecord {
                mem: id,
                index: i as u32,
                data,
            });
            sent.push(((id, i), c.loc));
        }
        if let Some(book) = self.precopy.out.as_mut() {
            book.sent.extend(sent);
        }
        Ok(out)
    }

    fn read_chunk(
        &self,
        id: u32,
        b: &ObjBacking,
        c: &Chunk,
        dst: &mut [u8],
    ) -> Result<(), MigrationError> {
        match c.loc {
            Loc::Vram(o) => self
                .gpu
                .vram_read(o, dst)
                .map_err(|e| read_err(id, &e.to_string())),
            Loc::Swap => {
                let region = b
                    .swap_region
                    .ok_or_else(|| read_err(id, "swapped without a region"))?;
                let src = self
                    .swap
                    .store
                    .as_ref()
                    .and_then(|s| s.ptr(region + c.off, c.len))
                    .ok_or_else(|| read_err(id, "swap range"))?;
                // SAFETY: `src` points at `c.len` (= `dst.len()`) bytes inside the VM's
                // swap store (checked by `ptr`), which lives as long as the session. An
                // engine may write them meanwhile (pre-copy runs beside the guest): the
                // write is noted after it lands, so a torn copy is sent again.
                unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
                Ok(())
            }
        }
    }

    /// Destination: creates the announced contexts and objects in this (empty) session,
    /// which stays paused; their contents arrive in chunk frames. On failure the session
    /// is emptied again.
    pub(crate) fn precopy_load_objects(
        &mut self,
        o: &ObjectsState,
        mem: &GuestMemory,
        shm: &dyn crate::shmem::ShmMapper,
    ) -> Result<(), MigrationError> {
        if !self.is_empty() || self.precopy.incoming.is_some() {
            return Err(MigrationError::NotEmpty);
        }
        self.hold.paused = true;
        if let Err(e) = self.restore_objects(&o.contexts, &o.mems, mem) {
            self.teardown(shm);
            self.publish();
            return Err(e);
        }
        let mut delivered = HashMap::new();
        for m in &o.mems {
            let n = self.hal.vram.get(&m.id).map_or(0, |b| b.chunks.len());
            delivered.insert(m.id, vec![false; n]);
        }
        self.precopy.incoming = Some(InBook {
            objects: o.clone(),
            delivered,
        });
        self.publish();
        Ok(())
    }

    /// Destination: writes a chunk frame's chunks into the announced objects.
    pub(crate) fn precopy_apply(&mut self, f: &ChunkFrame) -> Result<(), MigrationError> {
        let mut book = self
            .precopy
            .incoming
            .take()
            .ok_or(MigrationError::Unexpected(
                "a chunk frame before the objects",
            ))?;
        let r = self.apply_chunks(&mut book, f);
        self.precopy.incoming = Some(book);
        r
    }

    fn apply_chunks(&mut self, book: &mut InBook, f: &ChunkFrame) -> Result<(), MigrationError> {
        for c in &f.chunks {
            let e = restore_err(c.mem);
            let got = book
                .delivered
                .get_mut(&c.mem)
                .ok_or(ErrorCode::InvalidArgument)
                .map_err(restore_err(c.mem))?;
            let slot = got
                .get_mut(c.index as usize)
                .ok_or(ErrorCode::InvalidArgument)
                .map_err(restore_err(c.mem))?;
            let b = self
                .hal
                .vram
                .get(&c.mem)
                .ok_or(ErrorCode::Internal)
                .map_err(restore_err(c.mem))?;
            let chunk = *b
                .chunks
                .get(c.index as usize)
                .ok_or(ErrorCode::InvalidArgument)
                .map_err(restore_err(c.mem))?;
            if chunk.len != c.data.len() as u64 {
                return Err(e(ErrorCode::InvalidArgument));
            }
            self.write_chunk(b, &chunk, &c.data).map_err(e)?;
            *slot = true;
        }
        Ok(())
    }

    /// Destination, at the full state: it must describe the objects announced, and every
    /// chunk of an object whose contents it leaves out must have arrived. Returns whether
    /// a pre-copy was in progress (then the objects exist already).
    pub(crate) fn precopy_check_full(&mut self, st: &DeviceState) -> Result<bool, MigrationError> {
        let Some(book) = self.precopy.incoming.take() else {
            return Ok(false);
        };
        let mismatch = MigrationError::Unexpected("the full state differs from the objects frame");
        if st.contexts != book.objects.contexts || st.mems.len() != book.objects.mems.len() {
            return Err(mismatch);
        }
        for (m, o) in st.mems.iter().zip(&book.objects.mems) {
            if !same_object(m, o) {
                return Err(mismatch);
            }
            if m.data.is_empty() {
                let complete = book
                    .delivered
                    .get(&m.id)
                    .is_some_and(|d| d.iter().all(|&x| x));
                if !complete && m.size > 0 {
                    return Err(MigrationError::Unexpected(
                        "a VRAM chunk never arrived in the pre-copy",
                    ));
                }
            }
        }
        Ok(true)
    }
}

/// Where the engines reach a chunk now (its VRAM, or its place in the swap store as the
/// context's system memory); `None` if it cannot be told (then it counts as written).
fn chunk_target(b: &ObjBacking, c: &Chunk) -> Option<MapTarget> {
    match c.loc {
        Loc::Vram(offset) => Some(MapTarget::Vram { offset }),
        Loc::Swap => b.swap_region.map(|r| MapTarget::Sysram {
            addr: SWAP_BASE + r + c.off,
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use vgpu_host_shim::{SimConfig, SimGpu};
    use vgpu_protocol::request::{Op, ReplyBody, Request};
    use vm_memory::GuestAddress;

    use super::*;
    use crate::error::ShmError;
    use crate::shmem::ShmMapper;
    use crate::vm::session::VmLimits;
    use crate::vram::handle::Dir;

    const MIB: u64 = 1 << 20;

    /// A frontend that maps whatever it is asked to.
    struct Accept;

    impl ShmMapper for Accept {
        fn map(
            &self,
            _: u64,
            _: std::os::fd::RawFd,
            _: u64,
            _: u64,
            _: bool,
        ) -> Result<(), ShmError> {
            Ok(())
        }
        fn unmap(&self, _: u64, _: u64) -> Result<(), ShmError> {
            Ok(())
        }
    }

    /// A session with two 4 MiB objects (two chunks each), the second with an aperture.
    fn session() -> (Session, u32, u32, Arc<SimGpu>) {
        let gpu = SimGpu::new(SimConfig {
            vram_bytes: 32 * MIB,
            ..SimConfig::default()
        })
        .unwrap();
        let limits = VmLimits {
            swap_bytes: 32 * MIB,
            ..VmLimits::default()
        };
        let mut s = Session::new(gpu.clone(), limits);
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0x10000), 0x10000)]).unwrap();
        let req = |s: &mut Session, ctx: u32, op: Op| {
            s.execute(&Request { pid: 7, ctx, op }, &mem, &Accept)
                .unwrap()
        };
        let ReplyBody::Context { ctx, .. } = req(&mut s, 0, Op::CreateContext) else {
            panic!("context");
        };
        let alloc = Op::AllocVram {
            size: 4 * MIB,
            align: 2 * MIB,
        };
        let ReplyBody::Mem { mem: plain, .. } = req(&mut s, ctx, alloc.clone()) else {
            panic!("alloc");
        };
        let ReplyBody::Mem { mem: windowed, .. } = req(&mut s, ctx, alloc) else {
            panic!("alloc");
        };
        req(&mut s, ctx, Op::MapAperture { mem: windowed });
        (s, plain, windowed, gpu)
    }

    fn keys(d: &[(ChunkKey, u64)]) -> Vec<ChunkKey> {
        d.iter().map(|(k, _)| *k).collect()
    }

    #[test]
    fn a_round_sends_what_is_new_moved_or_windowed_and_nothing_else() {
        let (mut s, plain, windowed, _gpu) = session();
        let (_, tracking) = s.precopy_begin().unwrap();
        assert!(tracking, "the sim tracks writes");
        // Round 1: every chunk, except the windowed object's (left for the last round).
        let d = s.precopy_dirty(false).unwrap();
        assert_eq!(keys(&d), [(plain, 0), (plain, 1)]);
        s.precopy_read(&d).unwrap();
        // Nothing written, nothing moved: nothing to send.
        assert!(s.precopy_dirty(false).unwrap().is_empty());
        // A chunk evicted to swap (and one brought back in) is sent again.
        s.move_chunks(plain, &[1], Dir::Out, &Accept, Duration::from_millis(100))
            .unwrap();
        let d = s.precopy_dirty(false).unwrap();
        assert_eq!(keys(&d), [(plain, 1)]);
        s.precopy_read(&d).unwrap();
        assert!(s.precopy_dirty(false).unwrap().is_empty());
        // Found dirty but not sent: carried into the last round, with the window.
        s.move_chunks(plain, &[1], Dir::In, &Accept, Duration::from_millis(100))
            .unwrap();
        let d = s.precopy_dirty(false).unwrap();
        assert_eq!(keys(&d), [(plain, 1)]);
        s.precopy.out.as_mut().unwrap().defer(&d);
        let last = s.precopy_dirty(true).unwrap();
        assert_eq!(
            keys(&last),
            [(plain, 1), (windowed, 0), (windowed, 1)],
            "the deferred chunk and every windowed chunk"
        );
        s.precopy_end();
        assert!(s.precopy.out.is_none());
    }

    #[test]
    fn a_full_state_must_match_the_announced_objects_and_every_chunk() {
        let (mut src, plain, _, _g) = session();
        let (objects, _) = src.precopy_begin().unwrap();
        let gpu = SimGpu::new(SimConfig {
            vram_bytes: 32 * MIB,
            ..SimConfig::default()
        })
        .unwrap();
        let mut dst = Session::new(gpu.clone(), src.limits());
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0x10000), 0x10000)]).unwrap();
        dst.precopy_load_objects(&objects, &mem, &Accept).unwrap();
        let chunk = |index, len: u64| ChunkRecord {
            mem: plain,
            index,
            data: vec![7; len as usize],
        };
        let frame = |chunks| ChunkFrame {
            round: 1,
            last: false,
            chunks,
        };
        // Wrong length, unknown index, unknown object: refused.
        assert!(dst.precopy_apply(&frame(vec![chunk(0, MIB)])).is_err());
        assert!(dst.precopy_apply(&frame(vec![chunk(9, 2 * MIB)])).is_err());
        let mut stray = chunk(0, 2 * MIB);
        stray.mem = 999;
        assert!(dst.precopy_apply(&frame(vec![stray])).is_err());
        dst.precopy_apply(&frame(vec![chunk(0, 2 * MIB)])).unwrap();
        // The full state: one chunk never arrived.
        let st = DeviceState {
            contexts: objects.contexts.clone(),
            mems: objects.mems.clone(),
            ..DeviceState::default()
        };
        assert!(matches!(
            dst.precopy_check_full(&st),
            Err(MigrationError::Unexpected(_))
        ));
    }
}
