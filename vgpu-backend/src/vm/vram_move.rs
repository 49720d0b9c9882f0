//! Moving chunks between VRAM and the swap store behind a running guest: the pause dance.
//!
//! For a batch of chunks of one context (a VRAM object is mapped only in its owner's
//! context, so only that context's channels can reach it):
//! 1. **pause** the context's channels — shadow them (a VRAM hold, so neither the scheduler
//!    nor the operator can unshadow them meanwhile) — and wait until each one's real
//!    `GP_GET` equals its real `GP_PUT` (the sim advances `GP_GET` only when an entry has
//!    finished, so the GPU is done with everything released) or it stopped on an error;
//!    skipped when the object has no GPU mapping (then no channel can reach it);
//! 2. chunk by chunk:
//!    - **write-protect** the guest's CPU view of the chunk (SHMEM_MAP of its current
//!      backing, read-only): a guest store meanwhile faults and waits in its VMM
//!      (KVM_RUN's EFAULT in `vgpu-vmm`, SIGSEGV in the loopback VM) instead of landing
//!      in the copy's source after it was read, where it would be lost; reads go on;
//!    - **copy** the chunk (`vram_read` into the swap memfd, or `vram_write` from it);
//!    - **remap** the PTEs of every mapping of the object to the new target at the
//!      same GPU VA;
//!    - **remap the aperture** (SHMEM_MAP of the new backing, writable) so the guest's
//!      CPU view follows and its waiting stores go on, into the new copy;
//! 3. `invalidate_tlb` (which waits for accesses in flight), **free** the old backings
//!    (VRAM chunks; swap pages stay committed), **resume** (release the holds).
//!
//! The session lock is **not** held while the GPU drains (step 1's wait, up to the drain
//! timeout): the scheduler, the operator API and the VM's own requests go on meanwhile
//! (`move_chunks_unlocked`). The context stays held for the VRAM manager — a channel the
//! guest creates in it meanwhile is born held ([`crate::shadow::OwnerHolds`]) — and the
//! move re-reads the object once drained, under the lock: an object freed meanwhile ends
//! the move (`Gone`) and everything it held is released. The copy itself (step 2, bounded
//! by the batch size) runs under the lock, so no request of this VM (FREE_MEM, UNMAP,
//! DESTROY_*) interleaves with it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use log::{debug, error, warn};

use crate::shadow::Holder;
use crate::shmem::ShmMapper;
use crate::vm::session::{MappingTarget, Session};
use crate::vram::backing::{Loc, ObjBacking};
use crate::vram::handle::Dir;
use crate::vram::stats::MoveReport;
use crate::vram::store::SWAP_BASE;
use crate::vram::MoveError;
use crate::VmState;

#[cfg(test)]
mod batch_tests;
mod copy;

use copy::{CopyJob, StepTimes};

/// Test-only: how long each group of chunks stays read-only before its copy, beyond the
/// copy itself (`vgpu-backend --test-hold-read-only-ms`), microseconds; 0 in service.
static TEST_READ_ONLY_HOLD_US: AtomicU64 = AtomicU64::new(0);

/// Test-only: holds every moving chunk's CPU view read-only `hold` longer before its copy,
/// so that guest stores through the aperture reliably hit moving chunks and wait in their
/// VMM (the rig's way to exercise that wait; a hold is a stall of the move, not a fault).
pub fn set_test_read_only_hold(hold: Duration) {
    let us = u64::try_from(hold.as_micros()).unwrap_or(u64::MAX);
    TEST_READ_ONLY_HOLD_US.store(us, Ordering::Relaxed);
}

fn test_read_only_hold() -> Duration {
    Duration::from_micros(TEST_READ_ONLY_HOLD_US.load(Ordering::Relaxed))
}

/// A move between its preparation and its copy ([`Session::prepare_move`]).
pub(crate) struct MovePlan {
    mem: u32,
    ctx: u32,
    dir: Dir,
    /// Chunk indices to move.
    todo: Vec<usize>,
    /// New VRAM of a swap-in: (chunk index, offset).
    new_vram: Vec<(usize, u64)>,
    /// Whether the context's channels are held (the object has GPU mappings).
    held: bool,
    /// Swap ranges (system-memory addresses, lengths) announced to the GPU before the
    /// pause ([`vgpu_host_shim::Gpu::prepare_sysram_hint`]), released when the move ends.
    hints: Vec<(u64, u64)>,
    t0: Instant,
}

/// Waiting for a drain: a few yields, then sleeps growing to 1 ms.
#[derive(Default)]
struct Backoff {
    rounds: u32,
}

impl Backoff {
    fn wait(&mut self) {
        self.rounds = self.rounds.saturating_add(1);
        if self.rounds < 64 {
            std::thread::yield_now();
        } else {
            let us = 50u64 << ((self.rounds - 64) / 16).min(4);
            std::thread::sleep(Duration::from_micros(us));
        }
    }
}

/// Moves chunks `idx` of object `mem` of `vm` in direction `dir` without holding the
/// session lock while the GPU drains (see the module doc): the lock is taken to prepare,
/// for each look at the channels, and for the copy.
pub(crate) fn move_chunks_unlocked(
    vm: &VmState,
    mem: u32,
    idx: &[usize],
    dir: Dir,
    shm: &dyn ShmMapper,
    timeout: Duration,
) -> Result<MoveReport, MoveError> {
    let plan = {
        let mut s = vm.lock_session();
        match s.prepare_move(mem, idx, dir, shm)? {
            Some(plan) if !plan.held => return s.finish_move(plan, shm),
            Some(plan) => plan,
            None => return Ok(MoveReport::default()),
        }
    };
    let mut backoff = Backoff::default();
    loop {
        {
            let mut s = vm.lock_session();
            if s.move_ready(&plan, shm) {
                return s.finish_move(plan, shm);
            }
            if plan.t0.elapsed() > timeout {
                return Err(s.abort_move(plan, shm, MoveError::DrainTimeout));
            }
        }
        backoff.wait();
    }
}

fn ns(t0: Instant) -> u64 {
    u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

impl Session {
    /// GPU VAs at which `ctx` maps VRAM object `mem`.
    fn object_vas(&self, ctx: u32, mem: u32) -> Vec<u64> {
        self.state
            .mappings
            .range((ctx, 0)..=(ctx, u64::MAX))
            .filter(|(_, m)| m.target == MappingTarget::Vram { mem })
            .map(|((_, va), _)| *va)
            .collect()
    }

    /// Holds every channel of `ctx` for the VRAM manager (and channels born in it until
    /// [`Session::release_context`]).
    fn hold_context(&mut self, ctx: u32, shm: &dyn ShmMapper) -> Result<(), MoveError> {
        self.hold.vram_ctxs.insert(ctx);
        for ch in self.context_channels(ctx) {
            if self.channel_holders(ch).contains(Holder::Vram) {
                continue;
            }
            if let Err(e) = self.hold_channel(ch, Holder::Vram, true, shm) {
                self.release_context(ctx, shm);
                return Err(MoveError::Pause(e.to_string()));
            }
        }
        Ok(())
    }

    /// Channels of `ctx` whose slot is mapped (the ones that can be held).
    fn context_channels(&self, ctx: u32) -> Vec<u32> {
        self.state
            .channels
            .iter()
            .filter(|(_, c)| c.ctx == ctx && c.holdable())
            .map(|(id, _)| *id)
            .collect()
    }

    /// Whether the GPU finished everything the held channels of `ctx` released (a
    /// channel stopped on an error is done). Where the GPU holds the channel's fetch
    /// (`Gpu::hold_fetch`), what it fetched: the entries behind wait in the ring and are
    /// planned after the move, on its translations, so a pause waits for about the GPU's
    /// queue-ahead, not for every entry the guest published.
    fn context_drained(&mut self, ctx: u32) -> bool {
        for ch in self.context_channels(ctx) {
            let Some(hch) = self.hal.channels.get(&ch).copied() else {
                continue;
            };
            if matches!(self.gpu.channel_error(hch), Ok(Some(_))) {
                continue;
            }
            match self.gpu.fetched_done(hch) {
                Ok(Some(true)) => continue,
                Ok(Some(false)) => return false,
                _ => {}
            }
            // `_any`: an operator-paused VM's released work must be waited for too.
            if matches!(self.peek_channel_any(ch), Ok(p) if p.gp_get != p.real_put) {
                return false;
            }
        }
        true
    }

    /// Ends the VRAM manager's hold of `ctx` and its channels.
    fn release_context(&mut self, ctx: u32, shm: &dyn ShmMapper) {
        self.hold.vram_ctxs.remove(&ctx);
        for ch in self.context_channels(ctx) {
            if !self.channel_holders(ch).contains(Holder::Vram) {
                continue;
            }
            if let Err(e) = self.hold_channel(ch, Holder::Vram, false, shm) {
                // The slot may still show the shadow page; nobody holds it now, so the
                // scheduler's next tick retries the unshadow.
                warn!("VRAM manager: resume channel {ch}: {e}");
            }
        }
    }

    /// Maps the aperture of chunk `i` of `b` (at BAR offset `ap`) on its current
    /// backing, `writable` or read-only.
    fn map_chunk_view(
        &mut self,
        ap: u64,
        b: &ObjBacking,
        i: usize,
        writable: bool,
        shm: &dyn ShmMapper,
    ) -> Result<(), String> {
        let c = b.chunks[i];
        let t = b.chunk_target(&c).ok_or("chunk without backing")?;
        let (fd, off) = self.cpu_range(t, c.len).map_err(|e| e.to_string())?;
        shm.map(ap + c.off, fd, off, c.len, writable)
            .map_err(|e| e.to_string())
    }

    /// Gives chunk `i` its writable view back on its current backing; whether it did. A
    /// failure leaves the guest's stores to it waiting until its VMM gives up; nothing
    /// better can be done with a frontend that refuses maps, so it is logged loudly.
    fn unprotect(
        &mut self,
        ap: u64,
        mem: u32,
        b: &ObjBacking,
        i: usize,
        shm: &dyn ShmMapper,
    ) -> bool {
        match self.map_chunk_view(ap, b, i, true, shm) {
            Ok(()) => true,
            Err(e) => {
                error!("VRAM manager: object {mem}: the aperture stays read-only: {e}");
                false
            }
        }
    }

    /// Validates a move of chunks `idx` of object `mem` in direction `dir` (chunks already
    /// there are skipped) and prepares it: new VRAM for a swap-in (before anyone is
    /// paused), then, if the object has GPU mappings, the VRAM manager's hold of its
    /// context. `None`: nothing to move.
    fn prepare_move(
        &mut self,
        mem: u32,
        idx: &[usize],
        dir: Dir,
        shm: &dyn ShmMapper,
    ) -> Result<Option<MovePlan>, MoveError> {
        let ctx = self.state.mems.get(&mem).ok_or(MoveError::Gone)?.ctx;
        if !self.hal.contexts.contains_key(&ctx) {
            return Err(MoveError::Gone);
        }
        // A swap-in's VRAM is the object's process's (its worker's, per process).
        let pid = self.state.contexts.get(&ctx).ok_or(MoveError::Gone)?.pid;
        let mut b: ObjBacking = self.hal.vram.get(&mem).cloned().ok_or(MoveError::Gone)?;
        let mut todo: Vec<usize> = idx
            .iter()
            .copied()
            .filter(|&i| {
                b.chunks.get(i).is_some_and(|c| match dir {
                    Dir::Out => matches!(c.loc, Loc::Vram(_)),
                    Dir::In => c.loc == Loc::Swap,
                })
            })
            .collect();
        if todo.is_empty() {
            return Ok(None);
        }
        self.ensure_swap_region(&mut b)
            .map_err(|_| MoveError::NoSwap)?;
        self.swap_store().map_err(|_| MoveError::NoSwap)?;
        let align = b.align;
        let lens: Vec<u64> = todo.iter().map(|&i| b.chunks[i].len).collect();
        self.hal.vram.insert(mem, b);
        let mut new_vram: Vec<(usize, u64)> = Vec::new();
        if dir == Dir::In {
            for (&i, &len) in todo.iter().zip(&lens) {
                match self.alloc_chunk_vram(pid, len, align) {
                    Ok(offset) => new_vram.push((i, offset)),
                    Err(_) => break,
                }
            }
            todo.truncate(new_vram.len());
            if todo.is_empty() {
                return Err(MoveError::NoVram);
            }
        }
        let held = !self.object_vas(ctx, mem).is_empty();
        let hints = if dir == Dir::Out {
            self.hint_swap_ranges(ctx, mem, &todo)
        } else {
            Vec::new()
        };
        let plan = MovePlan {
            mem,
            ctx,
            dir,
            todo,
            new_vram,
            held,
            hints,
            t0: Instant::now(),
        };
        if held {
            if let Err(e) = self.hold_context(ctx, shm) {
                return Err(self.abort_move(plan, shm, e));
            }
        }
        Ok(Some(plan))
    }

    /// Gets the swap pages of chunks `todo` of object `mem` ready before any channel is
    /// paused: faults them in (an eviction's copy would otherwise fault inside the pause)
    /// and tells the GPU where the chunks will go (a GPU may pin that memory now rather
    /// than in the pause), one hint per run of adjacent chunks.
    fn hint_swap_ranges(&self, ctx: u32, mem: u32, todo: &[usize]) -> Vec<(u64, u64)> {
        let (Some(hctx), Some(b)) = (
            self.hal.contexts.get(&ctx).map(|(h, _)| *h),
            self.hal.vram.get(&mem),
        ) else {
            return Vec::new();
        };
        let Some(region) = b.swap_region else {
            return Vec::new();
        };
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for &i in todo {
            let Some(c) = b.chunks.get(i) else { continue };
            if let Some(store) = &self.swap.store {
                store.populate(region + c.off, c.len);
            }
            let addr = SWAP_BASE + region + c.off;
            match runs.last_mut() {
                Some((a, len)) if *a + *len == addr => *len += c.len,
                _ => runs.push((addr, c.len)),
            }
        }
        let mut hints = Vec::new();
        for (addr, len) in runs {
            match self.gpu.prepare_sysram_hint(hctx, addr, len) {
                Ok(()) => hints.push((addr, len)),
                // Only a hint: the remap registers what it needs anyway.
                Err(e) => debug!("VRAM manager: swap hint for object {mem}: {e}"),
            }
        }
        hints
    }

    fn release_hints(&self, ctx: u32, hints: &[(u64, u64)]) {
        if let Some(hctx) = self.hal.contexts.get(&ctx).map(|(h, _)| *h) {
            for &(addr, len) in hints {
                self.gpu.release_sysram_hint(hctx, addr, len);
            }
        }
    }

    /// Gives a prepared move up: releases its context and its new VRAM; returns `e`.
    fn abort_move(&mut self, plan: MovePlan, shm: &dyn ShmMapper, e: MoveError) -> MoveError {
        self.release_hints(plan.ctx, &plan.hints);
        if plan.held {
            self.release_context(plan.ctx, shm);
        }
        for (_, o) in &plan.new_vram {
            let _ = self.free_chunk_vram(*o);
        }
        if e == MoveError::DrainTimeout {
            self.swap.counters.vm.drain_timeouts += 1;
        }
        e
    }

    /// Whether a prepared move may copy now: every channel of its context is held (one
    /// whose hold at birth failed is held now, or the move waits) and drained.
    fn move_ready(&mut self, plan: &MovePlan, shm: &dyn ShmMapper) -> bool {
        if !plan.held {
            return true;
        }
        let mut all_held = true;
        for ch in self.context_channels(plan.ctx) {
            if !self.channel_holders(ch).contains(Holder::Vram)
                && self.hold_channel(ch, Holder::Vram, true, shm).is_err()
            {
                all_held = false;
            }
        }
        all_held && self.context_drained(plan.ctx)
    }

    /// Moves chunks `idx` of object `mem` in direction `dir` with this session held
    /// throughout, the drain wait included (tests, and callers that hold the session
    /// anyway); the VRAM manager uses [`move_chunks_unlocked`]. For `In`, stops early
    /// when VRAM runs out.
    #[cfg(test)]
    pub(crate) fn move_chunks(
        &mut self,
        mem: u32,
        idx: &[usize],
        dir: Dir,
        shm: &dyn ShmMapper,
        timeout: Duration,
    ) -> Result<MoveReport, MoveError> {
        let Some(plan) = self.prepare_move(mem, idx, dir, shm)? else {
            return Ok(MoveReport::default());
        };
        let mut backoff = Backoff::default();
        while !self.move_ready(&plan, shm) {
            if plan.t0.elapsed() > timeout {
                return Err(self.abort_move(plan, shm, MoveError::DrainTimeout));
            }
            backoff.wait();
        }
        self.finish_move(plan, shm)
    }

    /// Copies and remaps a prepared move once [`Session::move_ready`], then releases its
    /// context. The object is read anew: it may have changed (or gone) while the GPU
    /// drained without the session lock.
    fn finish_move(
        &mut self,
        plan: MovePlan,
        shm: &dyn ShmMapper,
    ) -> Result<MoveReport, MoveError> {
        let current = self.state.mems.get(&plan.mem).and_then(|m| {
            let hctx = self.hal.contexts.get(&plan.ctx).map(|(h, _)| *h)?;
            let b = self.hal.vram.get(&plan.mem).cloned()?;
            (m.ctx == plan.ctx).then_some((m.pid, m.aperture, hctx, b))
        });
        let Some((pid, aperture, hctx, mut b)) = current else {
            return Err(self.abort_move(plan, shm, MoveError::Gone));
        };
        let (region, store) = match (self.ensure_swap_region(&mut b), self.swap_store()) {
            (Ok(r), Ok(s)) => (r, s),
            _ => return Err(self.abort_move(plan, shm, MoveError::NoSwap)),
        };
        let MovePlan {
            mem,
            ctx,
            dir,
            todo,
            new_vram,
            held,
            hints,
            t0,
        } = plan;
        let drain_ns = if held { ns(t0) } else { 0 };
        let vas = self.object_vas(ctx, mem);
        let held_channels = if held {
            self.context_channels(ctx).len() as u32
        } else {
            0
        };
        let mut report = MoveReport {
            channels_paused: held_channels,
            drain_ns,
            ..MoveReport::default()
        };
        let tc = Instant::now();
        let mut moved: Vec<(usize, Loc)> = Vec::new();
        let mut failed = None;
        let job = CopyJob {
            mem,
            ctx,
            hctx,
            dir,
            b: &b,
            todo: &todo,
            new_vram: &new_vram,
            region,
            store: &store,
            aperture,
            vas: &vas,
        };
        let ks: Vec<usize> = (0..todo.len()).collect();
        let mut times = StepTimes::default();
        for group in ks.chunks(job.group()) {
            if let Err(e) = self.copy_group(&job, group, shm, &mut moved, &mut times) {
                failed = Some(e);
                break;
            }
        }
        // New translations become visible; no engine uses the old ones after this.
        let ti = Instant::now();
        if !vas.is_empty() {
            if let Err(e) = self.gpu.invalidate_tlb(hctx) {
                warn!("VRAM manager: invalidate ctx {ctx}: {e}");
            }
        }
        let invalidate_ns = ns(ti);
        // Then the old backing goes.
        let tf = Instant::now();
        let mut done = Vec::new();
        for (i, new_loc) in moved {
            let c = b.chunks[i];
            match c.loc {
                Loc::Vram(o) => {
                    if let Err(e) = self.free_chunk_vram(o) {
                        warn!("VRAM manager: free chunk {o:#x}: {e}");
                    }
                }
                // The swap copy's pages stay committed for the object's next eviction
                // (faulting them in again would dominate the copy); they go back to the
                // host when the object is freed.
                Loc::Swap => {}
            }
            b.chunks[i].loc = new_loc;
            // A pre-copy sends a moved chunk again.
            if let Some(book) = self.precopy.out.as_mut() {
                book.note_moved((mem, i));
            }
            if dir == Dir::In {
                // Just brought in: not the next victim. An evicted chunk keeps its age, so
                // it does not look hotter than the resident ones.
                b.chunks[i].last_used = self.swap.epoch;
            }
            report.chunks += 1;
            report.bytes += c.len;
            done.push(i);
        }
        // Unused new VRAM (a failure cut the batch short).
        for (i, o) in &new_vram {
            if !done.contains(i) && b.chunks[*i].loc != Loc::Vram(*o) {
                let _ = self.free_chunk_vram(*o);
            }
        }
        report.copy_ns = ns(tc);
        debug!(
            "VRAM manager: moved {} chunks ({dir:?}, {} bytes) of object {mem}: drain {} us, protect {} us, copy {} us, retarget {} us, invalidate {} us, free {} us",
            report.chunks,
            report.bytes,
            drain_ns / 1000,
            times.protect / 1000,
            times.copy / 1000,
            times.retarget / 1000,
            invalidate_ns / 1000,
            ns(tf) / 1000,
        );
        if held {
            self.release_context(ctx, shm);
        }
        self.release_hints(ctx, &hints);
        report.pause_ns = if held { ns(t0) } else { 0 };
        self.hal.vram.insert(mem, b);
        self.swap
            .counters
            .record_move(pid, &report, dir == Dir::Out);
        if let Some(e) = failed {
            self.swap.counters.vm.move_failures += 1;
            debug!("VRAM manager: move of object {mem} cut short: {e}");
            if report.chunks == 0 {
                return Err(e);
            }
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::RawFd;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    use vgpu_host_shim::{SimConfig, SimGpu};
    use vgpu_protocol::request::{Op, ReplyBody, Request};
    use vm_memory::GuestAddress;

    use super::*;
    use crate::error::ShmError;
    use crate::guest_mem::GuestMemory;
    use crate::vm::session::VmLimits;

    const MIB: u64 = 1 << 20;

    /// Records maps `(offset, len, writable)`; refuses read-only ones when told to.
    #[derive(Default)]
    struct Recorder {
        maps: Mutex<Vec<(u64, u64, bool)>>,
        refuse_read_only: AtomicBool,
    }

    impl ShmMapper for Recorder {
        fn map(
            &self,
            off: u64,
            _: RawFd,
            _: u64,
            len: u64,
            writable: bool,
        ) -> Result<(), ShmError> {
            if !writable && self.refuse_read_only.load(Ordering::Relaxed) {
                return Err(ShmError::Frontend("no read-only maps here".into()));
            }
            self.maps.lock().unwrap().push((off, len, writable));
            Ok(())
        }
        fn unmap(&self, _: u64, _: u64) -> Result<(), ShmError> {
            Ok(())
        }
    }

    /// A session with one 4 MiB VRAM object (two chunks) whose aperture is mapped.
    fn object_with_aperture(shm: &Recorder) -> (Session, u32, u64) {
        let gpu = SimGpu::new(SimConfig {
            vram_bytes: 16 * MIB,
            ..SimConfig::default()
        })
        .unwrap();
        let limits = VmLimits {
            swap_bytes: 16 * MIB,
            ..VmLimits::default()
        };
        let mut s = Session::new(gpu, limits);
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0x10000), 0x10000)]).unwrap();
        let req = |s: &mut Session, ctx: u32, op: Op| {
            s.execute(&Request { pid: 7, ctx, op }, &mem, shm).unwrap()
        };
        let ReplyBody::Context { ctx, .. } = req(&mut s, 0, Op::CreateContext) else {
            panic!("context");
        };
        let ReplyBody::Mem { mem: obj, .. } = req(
            &mut s,
            ctx,
            Op::AllocVram {
                size: 4 * MIB,
                align: 2 * MIB,
            },
        ) else {
            panic!("alloc");
        };
        let ReplyBody::Aperture { offset } = req(&mut s, ctx, Op::MapAperture { mem: obj }) else {
            panic!("aperture");
        };
        (s, obj, offset)
    }

    #[test]
    fn a_move_write_protects_each_chunk_before_its_copy_and_unprotects_it_on_the_new_copy() {
        let shm = Recorder::default();
        let (mut s, obj, ap) = object_with_aperture(&shm);
        shm.maps.lock().unwrap().clear();
        let r = s
            .move_chunks(obj, &[0, 1], Dir::Out, &shm, Duration::from_millis(100))
            .unwrap();
        assert_eq!(r.chunks, 2);
        // Chunk by chunk: read-only on the old copy before its copy, writable on the new
        // copy after it (a guest store waits for one chunk's copy).
        let maps = shm.maps.lock().unwrap().clone();
        let chunk = 2 * MIB;
        assert_eq!(
            maps,
            [
                (ap, chunk, false),
                (ap, chunk, true),
                (ap + chunk, chunk, false),
                (ap + chunk, chunk, true)
            ]
        );
        assert_eq!(s.vram_report().vm.swapped_bytes, 4 * MIB);
    }

    #[test]
    fn the_test_hold_keeps_each_moving_chunk_read_only_longer() {
        let shm = Recorder::default();
        let (mut s, obj, _) = object_with_aperture(&shm);
        let hold = Duration::from_millis(40);
        set_test_read_only_hold(hold);
        let t0 = Instant::now();
        let r = s.move_chunks(obj, &[0, 1], Dir::Out, &shm, Duration::from_millis(100));
        let took = t0.elapsed();
        set_test_read_only_hold(Duration::ZERO);
        assert_eq!(r.unwrap().chunks, 2);
        // One hold per chunk: each is protected, held, copied and unprotected in turn.
        assert!(took >= hold * 2, "{took:?}");
    }

    #[test]
    fn a_frontend_refusing_read_only_maps_keeps_the_chunks_where_they_are() {
        let shm = Recorder::default();
        let (mut s, obj, ap) = object_with_aperture(&shm);
        shm.maps.lock().unwrap().clear();
        shm.refuse_read_only.store(true, Ordering::Relaxed);
        let r = s.move_chunks(obj, &[0, 1], Dir::Out, &shm, Duration::from_millis(100));
        assert!(matches!(r, Err(MoveError::Aperture(_))), "{r:?}");
        let rep = s.vram_report();
        assert_eq!((rep.vm.resident_bytes, rep.vm.swapped_bytes), (4 * MIB, 0));
        assert_eq!(rep.vm.move_failures, 1);
        // The refused chunk's view was mapped writable again, on the old backing; the
        // second chunk was never touched.
        let maps = shm.maps.lock().unwrap().clone();
        assert_eq!(maps, [(ap, 2 * MIB, true)]);
    }
}
