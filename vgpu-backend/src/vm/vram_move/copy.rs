//! A move's copy step (step 2 of the pause dance in the parent module), one group of
//! chunks at a time: write-protect the group's CPU views, copy the whole group in one HAL
//! call ([`Gpu::vram_read_many`]/[`Gpu::vram_write_many`]: a GPU with a copy engine
//! queues every chunk and waits once), then retarget chunk by chunk.
//!
//! With a CPU view of VRAM (an aperture) a group is one chunk, so a guest store into a
//! chunk waits for that chunk's copy only, as before batching. Without one (the `cuda`
//! GPU: guests reach VRAM only through the GPU) nothing waits on a chunk's view, and the
//! group is the whole move: the copy engine goes from chunk to chunk without a host
//! round trip between them.
//!
//! [`Gpu::vram_read_many`]: vgpu_host_shim::Gpu::vram_read_many
//! [`Gpu::vram_write_many`]: vgpu_host_shim::Gpu::vram_write_many

use std::time::{Duration, Instant};

use log::{info, warn};
use vgpu_host_shim::ContextId;

use crate::shmem::ShmMapper;
use crate::vm::session::Session;
use crate::vram::backing::{Chunk, Loc, ObjBacking, RunTarget};
use crate::vram::handle::Dir;
use crate::vram::store::SwapStore;
use crate::vram::MoveError;

/// What the copy step of one move works with (fixed for the move).
pub(super) struct CopyJob<'a> {
    pub(super) mem: u32,
    pub(super) ctx: u32,
    pub(super) hctx: ContextId,
    pub(super) dir: Dir,
    /// The object's backing as the move found it (chunks still on their old backing).
    pub(super) b: &'a ObjBacking,
    /// Chunk indices to move, and for a swap-in their new VRAM (`new_vram[k]` for
    /// `todo[k]`).
    pub(super) todo: &'a [usize],
    pub(super) new_vram: &'a [(usize, u64)],
    /// The object's region in the swap store.
    pub(super) region: u64,
    pub(super) store: &'a SwapStore,
    /// BAR offset of the object's CPU view, if it has one.
    pub(super) aperture: Option<u64>,
    /// GPU VAs at which the context maps the object.
    pub(super) vas: &'a [u64],
}

impl CopyJob<'_> {
    /// Chunks per group: one with a CPU view (see the module doc), else all of them.
    pub(super) fn group(&self) -> usize {
        if self.aperture.is_some() {
            1
        } else {
            self.todo.len().max(1)
        }
    }
}

/// Where a move's copy step spent its time (debug log), ns.
#[derive(Debug, Default)]
pub(super) struct StepTimes {
    /// Write-protecting views (and finding the swap pages).
    pub(super) protect: u64,
    /// The HAL copies.
    pub(super) copy: u64,
    /// Remapping PTEs and views.
    pub(super) retarget: u64,
}

fn since(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// One chunk of a group, write-protected and about to be copied.
struct Step {
    i: usize,
    c: Chunk,
    /// Its place in the swap store, and that place's host address.
    swap_off: u64,
    ptr: *mut u8,
    /// Its VRAM: the old for an eviction, the new for a swap-in.
    vram: u64,
    /// When its CPU view went read-only (None without a view).
    protected_at: Option<Instant>,
}

impl Step {
    /// Where the chunk lives after the copy.
    fn moved_to(&self, dir: Dir) -> (Loc, RunTarget) {
        match dir {
            Dir::Out => (Loc::Swap, RunTarget::Swap(self.swap_off)),
            Dir::In => (Loc::Vram(self.vram), RunTarget::Vram(self.vram)),
        }
    }
}

impl Session {
    /// Moves the chunks `todo[k]` for `k` in `ks`, appending each moved chunk and its new
    /// location to `moved`. On an error every chunk of the group not in `moved` is back
    /// on its old backing with a writable view.
    pub(super) fn copy_group(
        &mut self,
        job: &CopyJob<'_>,
        ks: &[usize],
        shm: &dyn ShmMapper,
        moved: &mut Vec<(usize, Loc)>,
        times: &mut StepTimes,
    ) -> Result<(), MoveError> {
        let t = Instant::now();
        let mut steps: Vec<Step> = Vec::with_capacity(ks.len());
        for &k in ks {
            let i = job.todo[k];
            let c = job.b.chunks[i];
            let vram = match (job.dir, c.loc) {
                (Dir::Out, Loc::Vram(o)) => o,
                (Dir::In, Loc::Swap) => job.new_vram[k].1,
                _ => continue,
            };
            let swap_off = job.region + c.off;
            let Some(ptr) = job.store.ptr(swap_off, c.len) else {
                self.unprotect_steps(job, &steps, shm);
                return Err(MoveError::NoSwap);
            };
            // From here the guest's CPU stores into this chunk wait (see the parent doc).
            let mut protected_at = None;
            if let Some(ap) = job.aperture {
                if let Err(e) = self.map_chunk_view(ap, job.b, i, false, shm) {
                    // A failed map may have left a hole where the old view was.
                    self.unprotect(ap, job.mem, job.b, i, shm);
                    self.unprotect_steps(job, &steps, shm);
                    return Err(MoveError::Aperture(e));
                }
                protected_at = Some(Instant::now());
                info!(
                    "VRAM manager: object {} chunk {i} ({:?}): CPU view read-only for the move",
                    job.mem, job.dir
                );
            }
            steps.push(Step {
                i,
                c,
                swap_off,
                ptr,
                vram,
                protected_at,
            });
        }
        let hold = super::test_read_only_hold();
        if !hold.is_zero() && steps.iter().any(|s| s.protected_at.is_some()) {
            std::thread::sleep(hold);
        }
        times.protect += since(t);
        let t = Instant::now();
        let copied = self.copy_steps(job, &steps);
        times.copy += since(t);
        if let Err(e) = copied {
            self.unprotect_steps(job, &steps, shm);
            return Err(MoveError::Hal(e.to_string()));
        }
        let t = Instant::now();
        for (n, s) in steps.iter().enumerate() {
            if let Err(e) = self.retarget(job, s, shm) {
                self.unprotect_steps(job, &steps[n + 1..], shm);
                return Err(e);
            }
            note_writable(job, s, "on its new copy");
            moved.push((s.i, s.moved_to(job.dir).0));
        }
        times.retarget += since(t);
        Ok(())
    }

    /// Copies every step's chunk in one HAL call.
    fn copy_steps(&self, job: &CopyJob<'_>, steps: &[Step]) -> vgpu_host_shim::hal::Result<()> {
        match job.dir {
            Dir::Out => {
                let mut reads = Vec::with_capacity(steps.len());
                for s in steps {
                    // (Its pages were faulted in before the pause: `hint_swap_ranges`.)
                    // SAFETY: `ptr..ptr+len` lies in the swap store's mapping (checked by
                    // `SwapStore::ptr`), and the steps' ranges are distinct chunks of the
                    // object's region, so no two slices overlap; no GPU mapping and no
                    // guest view leads there while the chunk is resident, and the session
                    // lock excludes other movers.
                    let dst = unsafe { std::slice::from_raw_parts_mut(s.ptr, s.c.len as usize) };
                    reads.push((s.vram, dst));
                }
                self.gpu.vram_read_many(&mut reads)
            }
            Dir::In => {
                let writes: Vec<(u64, &[u8])> = steps
                    .iter()
                    .map(|s| {
                        // SAFETY: as above; the channels that could write the swap copy are
                        // paused and the guest's view of it is read-only, so it does not
                        // change while we read it.
                        let src = unsafe { std::slice::from_raw_parts(s.ptr, s.c.len as usize) };
                        (s.vram, src)
                    })
                    .collect();
                self.gpu.vram_write_many(&writes)
            }
        }
    }

    /// Points every mapping of the object and its CPU view at the chunk's new copy. On a
    /// failure the chunk is put back on its old backing (still intact: the channels are
    /// paused and the guest's stores were held) with a writable view.
    fn retarget(
        &mut self,
        job: &CopyJob<'_>,
        s: &Step,
        shm: &dyn ShmMapper,
    ) -> Result<(), MoveError> {
        let (ctx, mem, c) = (job.ctx, job.mem, s.c);
        let (_, new_target) = s.moved_to(job.dir);
        let mut ok = true;
        for &va in job.vas {
            if let Err(e) = self
                .gpu
                .remap(job.hctx, va + c.off, c.len, new_target.map_target())
            {
                warn!("VRAM manager: remap ctx {ctx} va {:#x}: {e}", va + c.off);
                ok = false;
            }
        }
        // The guest's view follows to the new copy, where its waiting stores go on.
        let view = match (ok, job.aperture) {
            (false, _) => Err(MoveError::Hal("remap".into())),
            (true, Some(ap)) => self
                .cpu_range(new_target, c.len)
                .map_err(|e| e.to_string())
                .and_then(|(fd, off)| {
                    shm.map(ap + c.off, fd, off, c.len, true)
                        .map_err(|e| e.to_string())
                })
                .map_err(|e| {
                    warn!("VRAM manager: aperture remap of object {mem}: {e}");
                    MoveError::Aperture(e)
                }),
            (true, None) => Ok(()),
        };
        if let Err(e) = view {
            if let Some(old) = job.b.chunk_target(&c) {
                for &va in job.vas {
                    let _ = self
                        .gpu
                        .remap(job.hctx, va + c.off, c.len, old.map_target());
                }
            }
            if let Some(ap) = job.aperture {
                if self.unprotect(ap, mem, job.b, s.i, shm) {
                    note_writable(job, s, "on its old copy (the move failed)");
                }
            }
            // (New VRAM of a swap-in is freed by the caller: the chunk is not in `moved`.)
            return Err(e);
        }
        Ok(())
    }

    /// Gives the steps' chunks their writable views back on their old backing.
    fn unprotect_steps(&mut self, job: &CopyJob<'_>, steps: &[Step], shm: &dyn ShmMapper) {
        if let Some(ap) = job.aperture {
            for s in steps {
                if self.unprotect(ap, job.mem, job.b, s.i, shm) {
                    note_writable(job, s, "on its old copy (the move failed)");
                }
            }
        }
    }
}

/// A chunk's CPU view longer read-only than this is logged as a warning: guest stores into
/// it waited that long in their VMM (which gives up after 10 s).
const LONG_READ_ONLY: Duration = Duration::from_secs(1);

/// Logs the end of a chunk's read-only spell (a guest store into it waited at most that
/// long), pairing with the line logged when it began.
fn note_writable(job: &CopyJob<'_>, s: &Step, outcome: &str) {
    let Some(t) = s.protected_at else { return };
    let held = t.elapsed();
    if held > LONG_READ_ONLY {
        warn!(
            "VRAM manager: object {} chunk {} ({:?}): CPU view writable again {outcome} after {} ms read-only",
            job.mem,
            s.i,
            job.dir,
            held.as_millis()
        );
    } else {
        info!(
            "VRAM manager: object {} chunk {} ({:?}): CPU view writable again {outcome} after {} ms read-only",
            job.mem,
            s.i,
            job.dir,
            held.as_millis()
        );
    }
}
