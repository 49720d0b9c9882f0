//! The host front end that plays PFIFO for the `cuda` GPU: it polls every channel's
//! control page for GP_PUT moves, fetches and decodes GP entries and push buffers from
//! guest memory, plans them (checking every address), issues them on the channel's
//! stream with a completion mark, and reports GP_GET/REF/NOTIFY and busy time back when
//! the marks are reached. Semaphore waits run on the GPU; the front end only stops
//! issuing behind one until it is satisfied.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use vgpu_protocol::{ControlPage, ErrorCode};

use super::channel::{CudaChannel, Inflight};
use super::device::Device;
use super::hostreg::HostRegistry;
use super::plan::{plan_entry_into, HostAction, Op, Translate};
use super::timeline::Timeline;
use super::vram::DeviceVram;
use super::Shared;
use crate::clock::{now_ns, thread_cpu_ns};
use crate::gpu_turn::TurnUse;
use crate::gpu_view::GpuView;
use crate::hal::MapTarget;
use crate::kernels::{FaultKind, KernelMemory, MemFault};
use crate::mmu::{AddressSpace, TranslateError};

/// The memories operands resolve to: VRAM and registered host memory.
#[derive(Clone, Copy)]
pub(crate) struct GpuMemory<'a> {
    pub(crate) vram: &'a DeviceVram,
    pub(crate) hostreg: &'a std::sync::Mutex<HostRegistry>,
    /// Whether kernels may carry their entry's fence signal.
    pub(crate) signals: bool,
    pub(crate) functions: &'a std::sync::Mutex<super::modules::FunctionTable>,
    /// Guest addresses that are device addresses (module launches pass them as they are).
    pub(crate) identity: &'a std::sync::Mutex<super::identity::Mirrors>,
}

/// How far the front end may issue ahead of the GPU on a channel.
#[derive(Debug, Clone, Copy)]
pub struct IssueLimits {
    /// Most GP entries sharing one completion mark.
    pub batch: u32,
    /// Most completion marks in flight.
    pub max_inflight: usize,
    /// About how much of the channel's work (estimated from its recent entries) may be
    /// queued on the GPU: what pausing it waits for (`CudaConfig::queue_ahead_ns`).
    pub queue_ahead_ns: u64,
    /// Whether completion marks record the GPU's time. Needed while another context is
    /// active: the timeline then splits the GPU's time between contexts entry by entry.
    /// A context alone on the GPU gets untimed marks for batches queued behind its own
    /// work ([`Device::mark_untimed`]: they cost the GPU nothing between kernels), which
    /// are charged up to when the front end sees them reached (it polls while work is
    /// in flight).
    pub timed_marks: bool,
    /// Entries this long on the GPU (the channel's mean), or of a length not yet known,
    /// leave an owed REF write to a mark (`CudaConfig::mark_owed_ref_over_ns`).
    pub mark_owed_ref_over_ns: u64,
}

impl IssueLimits {
    /// Whether a channel whose entries take `mean_entry_ns` on the GPU (0: not known
    /// yet) leaves an owed REF write to a mark rather than to the next kernel.
    pub fn owed_ref_to_mark(&self, mean_entry_ns: u64) -> bool {
        self.mark_owed_ref_over_ns != u64::MAX
            && (mean_entry_ns == 0 || mean_entry_ns >= self.mark_owed_ref_over_ns)
    }
}

/// GP entries issued since the last mark.
struct Batch {
    issued_ns: u64,
    entries: u32,
    runs: bool,
    host: Vec<HostAction>,
    waits: bool,
    copies: u64,
    kernels: u64,
    /// The last builtin kernel's name (for the long-batch log).
    last_kernel: &'static str,
}

/// What the front end issued: how many GP entries share a completion mark is what a
/// small kernel's cost depends on (each mark is a driver call beside the launches).
/// With `timed` on, also where its thread's time goes (host clock, ns in total).
#[derive(Debug, Default)]
pub struct FrontendStats {
    /// GP entries issued.
    pub entries: AtomicU64,
    /// Completion marks recorded after batches of entries.
    pub end_marks: AtomicU64,
    /// Whether the front end times its parts (`CudaConfig::time_frontend`).
    pub timed: std::sync::atomic::AtomicBool,
    /// Fetching, decoding and planning GP entries.
    pub fetch_plan_ns: AtomicU64,
    /// Issuing the planned operations (the driver's launches, copies, stream writes).
    pub issue_ns: AtomicU64,
    /// Recording completion marks.
    pub mark_ns: AtomicU64,
    /// Retiring: asking whether marks were reached, reporting GP_GET, REF, busy time.
    pub retire_ns: AtomicU64,
}

/// A copy of the front end's counters (`FrontendStats`) at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FrontendCounts {
    pub entries: u64,
    pub end_marks: u64,
    pub fetch_plan_ns: u64,
    pub issue_ns: u64,
    pub mark_ns: u64,
    pub retire_ns: u64,
}

impl FrontendStats {
    pub fn snapshot(&self) -> FrontendCounts {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        FrontendCounts {
            entries: get(&self.entries),
            end_marks: get(&self.end_marks),
            fetch_plan_ns: get(&self.fetch_plan_ns),
            issue_ns: get(&self.issue_ns),
            mark_ns: get(&self.mark_ns),
            retire_ns: get(&self.retire_ns),
        }
    }

    /// The host clock now, if the parts are timed.
    fn start(&self) -> Option<u64> {
        self.timed.load(Ordering::Relaxed).then(now_ns)
    }

    /// Adds the time since `start` (from [`Self::start`]) to `counter`.
    fn add_since(counter: &AtomicU64, start: Option<u64>) {
        if let Some(t) = start {
            counter.fetch_add(now_ns().saturating_sub(t), Ordering::Relaxed);
        }
    }
}

/// Bytes allocated for a channel's signal counter (one u32 used; the allocator's alignment).
pub(crate) const SIGNAL_COUNT_BYTES: u64 = 256;

/// Resolves a context's ranges through its page tables to registered host memory.
pub(crate) struct CtxTranslate<'a, D: Device> {
    pub(crate) space: &'a AddressSpace,
    pub(crate) mem: GpuMemory<'a>,
    pub(crate) dev: &'a D,
    pub(crate) scratch: &'a mut Option<(u64, u64)>,
    /// The channel's fence-signal counter, made with it.
    pub(crate) signal_count: Option<u64>,
    /// Whether kernels may carry their entry's fence signal (`CudaConfig::signal_max_blocks`).
    pub(crate) signals: bool,
    /// The channel's REF as the device sees it (see `Translate::ref_ptr`).
    pub(crate) ref_ptr: Option<u64>,
    /// The issuing context (its bound functions).
    pub(crate) ctx: crate::hal::ContextId,
}

/// A channel's block counter for kernels' fence signals: a word of device memory of its
/// own, zeroed before any kernel counts on it; 0 if none can be had (REF is then written
/// by stream writes).
pub(crate) fn new_signal_count<D: Device>(dev: &D) -> u64 {
    let p = dev.alloc_device(SIGNAL_COUNT_BYTES).and_then(|p| {
        match dev.zero_device(p, SIGNAL_COUNT_BYTES as usize) {
            Ok(()) => Ok(p),
            Err(e) => {
                dev.free_device(p);
                Err(e)
            }
        }
    });
    p.unwrap_or_else(|e| {
        log::warn!("cuda: no signal counter ({e}): REF by stream writes");
        0
    })
}

fn mem_fault(va: u64, write: bool, kind: FaultKind) -> MemFault {
    MemFault { va, write, kind }
}

impl<D: Device> CtxTranslate<'_, D> {
    /// The device pointer and length of the contiguous piece at `va` (at most `len`),
    /// and whether it is VRAM (else registered host memory).
    fn run(&self, va: u64, len: u64, write: bool) -> Result<(u64, u64, bool), MemFault> {
        let t = self.space.translate(va, write).map_err(|e| match e {
            TranslateError::NotMapped => mem_fault(va, write, FaultKind::NotMapped),
            TranslateError::ReadOnly => mem_fault(va, write, FaultKind::ReadOnly),
        })?;
        let n = len.min(t.contiguous);
        let bad = || mem_fault(va, write, FaultKind::BadTarget);
        match t.target {
            MapTarget::Vram { offset } => self
                .mem
                .vram
                .ptr(offset, n)
                .map(|p| (p, n, true))
                .ok_or_else(bad),
            MapTarget::Sysram { addr } => match self.space.sysmem().translate(addr, n) {
                Some(r) if r.len > 0 && !r.ptr.is_null() => {
                    // Stop at the end of the registration: a copy or kernel operand
                    // spanning two registered pieces is refused by the driver.
                    let p = r.ptr as usize;
                    let in_piece = self
                        .mem
                        .hostreg
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .piece_end(p)
                        .map_or(r.len, |end| end - p);
                    Ok((p as u64, (r.len.min(in_piece) as u64).min(n), false))
                }
                _ => Err(bad()),
            },
        }
    }
}

impl<D: Device> Translate for std::cell::RefCell<CtxTranslate<'_, D>> {
    fn runs(&self, va: u64, len: u64, write: bool) -> Result<Vec<(u64, u64)>, MemFault> {
        let me = self.borrow();
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut got = 0;
        // Adjacent VRAM pieces merge; host pieces never do (each ends at the end of its
        // registration, and one driver call must not span two).
        let mut vram_tail = false;
        while got < len {
            let (p, n, vram) = me.run(va + got, len - got, write)?;
            match out.last_mut() {
                Some(last) if vram && vram_tail && last.0 + last.1 == p => last.1 += n,
                _ => out.push((p, n)),
            }
            vram_tail = vram;
            got += n;
        }
        Ok(out)
    }

    fn ref_ptr(&self) -> Option<u64> {
        self.borrow().ref_ptr
    }

    fn signal_count(&self) -> Option<u64> {
        let me = self.borrow();
        // Made with the channel (0: the device had none to give).
        me.signal_count.filter(|&p| me.signals && p != 0)
    }

    fn identity(&self, va: u64, len: u64, write: bool) -> bool {
        let me = self.borrow();
        let mirrors = me.mem.identity.lock().unwrap_or_else(|e| e.into_inner());
        mirrors.covers(me.ctx, va, len, write)
    }

    fn function(&self, id: u32) -> Option<super::plan::BoundFunction> {
        let me = self.borrow();
        let table = me.mem.functions.lock().unwrap_or_else(|e| e.into_inner());
        table.get(&(me.ctx, id)).map(|(_, f)| f.clone())
    }

    fn scratch(&self, len: u64) -> Option<u64> {
        let mut me = self.borrow_mut();
        if let Some((p, l)) = *me.scratch {
            if l >= len {
                return Some(p);
            }
        }
        const MAX_SCRATCH: u64 = 1 << 30;
        if len > MAX_SCRATCH {
            return None;
        }
        // The old buffer may still be used by queued work: keep it (freed with the
        // channel) rather than free it under the GPU. Growth is rare and bounded.
        let size = len.next_power_of_two().max(1 << 20);
        let p = me.dev.alloc_device(size).ok()?;
        if let Some((old, _)) = me.scratch.replace((p, size)) {
            log::debug!("cuda: channel scratch grows to {size} bytes (old {old:#x} kept)");
        }
        Some(p)
    }
}

impl<D: Device> CudaChannel<D> {
    /// Retires reached entries, then issues new ones (unless `issue` is false: another
    /// worker has the GPU turn). Returns whether anything happened.
    pub fn step(
        &self,
        dev: &D,
        mem: GpuMemory<'_>,
        old_scratch: &mut Vec<u64>,
        tl: &mut Option<Timeline<D>>,
        limits: IssueLimits,
        issue: bool,
    ) -> bool {
        if self.core.is_stopped() {
            return false;
        }
        let t = self.stats.start();
        let mut progress = self.retire(dev, tl);
        FrontendStats::add_since(&self.stats.retire_ns, t);
        // The GPU writes REF itself, at any time: look on every sweep.
        self.core.wake_fence_waiter();
        if !issue {
            return progress;
        }
        match self.issue_new(dev, mem, old_scratch, limits) {
            Ok(p) => {
                if p {
                    self.last_issue_ns.store(now_ns(), Ordering::Relaxed);
                }
                progress |= p
            }
            Err((code, info)) => {
                self.core.fault(code, info);
                progress = true;
            }
        }
        progress
    }

    fn retire(&self, dev: &D, tl: &mut Option<Timeline<D>>) -> bool {
        let mut st = self.lock();
        let mut progress = false;
        while let Some(head) = st.inflight.front() {
            match dev.reached(&head.end) {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    log::warn!("cuda channel {:?}: {e}", self.core.id);
                    drop(st);
                    self.core.fault(e.fault_code(), 0);
                    return true;
                }
            }
            let Some(done) = st.inflight.pop_front() else {
                break;
            };
            let mut charged = 0;
            if let Some(tl) = tl.as_mut() {
                // An untimed mark (a context alone on the GPU) ended by now.
                let end = tl.at(dev, &done.end).or_else(|| tl.from_host(now_ns()));
                if let Some(end) = end {
                    // From its host issue time; queued behind its own stream's previous
                    // entry, no earlier than that one's end.
                    let start = tl
                        .from_host(done.issued_ns)
                        .map_or(st.last_end, |t| t.max(st.last_end));
                    if done.runs {
                        let ran = end.saturating_sub(start);
                        st.note_entry_time(ran, done.entries);
                        let ns = tl.charge(start.min(end), end, done.entries);
                        self.busy_ns.fetch_add(ns, Ordering::Relaxed);
                        charged = ns;
                        if ran > LONG_BATCH_NS {
                            log::debug!(
                                "cuda channel {:?}: {} entries ({} kernels, last {}, {} copies) ran {} us",
                                self.core.id,
                                done.entries,
                                done.kernels,
                                done.last_kernel,
                                done.copies,
                                ran / 1000
                            );
                        }
                        log::trace!(
                            "cuda channel {:?}: entry ran {ran} ns, charged {ns} ns",
                            self.core.id,
                        );
                    }
                    st.last_end = end;
                }
            }
            if let Some(due) = done.due_ref {
                self.store_due(due, st.gpu_ref_writes);
            }
            if done.waits {
                // Its semaphore wait was satisfied (less the time its kernels ran).
                self.core.sem_wait.end(now_ns(), charged);
            }
            for a in &done.host {
                match *a {
                    HostAction::SetRef(v) => self.core.set_ref(v),
                    HostAction::Notify(t) => self.core.notify(t),
                }
            }
            self.core.copies.fetch_add(done.copies, Ordering::Relaxed);
            self.core
                .gp_completed
                .fetch_add(u64::from(done.entries), Ordering::Relaxed);
            // Counted before GP_GET moves: whoever sees the entry done sees the activity.
            self.core.note_activity();
            self.core.store(ControlPage::GP_GET, done.next_get);
            progress = true;
        }
        progress
    }

    /// Issues new GP entries. Entries issued in one sweep share one completion mark (up
    /// to `batch_limit`): GP_GET then moves by the batch, as a GPU's may, and the front end
    /// spends one event per batch instead of one per entry.
    fn issue_new(
        &self,
        dev: &D,
        mem: GpuMemory<'_>,
        old_scratch: &mut Vec<u64>,
        limits: IssueLimits,
    ) -> Result<bool, (ErrorCode, u64)> {
        let mut st = self.lock();
        // Read under the lock: see `ChannelCore::set_fetch_held`.
        if self.core.fetch_held()
            || st.inflight.len() >= limits.max_inflight
            || st.inflight.iter().any(|i| i.waits)
        {
            return Ok(false);
        }
        let mut batch: Option<Batch> = None;
        let res = self.issue_batch(dev, mem, old_scratch, &mut st, &mut batch, limits);
        if let Some(b) = batch {
            // Whatever was issued is tracked, even when a later entry faulted.
            self.close_batch(dev, &mut st, b, limits.timed_marks)?;
            return res.map(|_| true);
        }
        res
    }

    /// Records the batch's completion mark and tracks it in flight; the mark takes the
    /// REF write the batch's last kernel could not do, which the front end stores once the
    /// mark is reached ([`DueRef`](super::channel::DueRef)).
    fn close_batch(
        &self,
        dev: &D,
        st: &mut super::channel::ChanState<D>,
        b: Batch,
        timed: bool,
    ) -> Result<(), (ErrorCode, u64)> {
        let due_ref = st.take_due();
        let next_get = st.fetched;
        if b.waits {
            // Nothing is issued behind it until its wait is satisfied.
            self.core.sem_wait.begin(now_ns());
        }
        self.stats
            .entries
            .fetch_add(u64::from(b.entries), Ordering::Relaxed);
        self.stats.end_marks.fetch_add(1, Ordering::Relaxed);
        let t = self.stats.start();
        // A batch to an idle stream has no kernel before it to delay: its mark is timed,
        // so the batch is charged exactly, at no cost between kernels.
        let mark = if timed || st.inflight.is_empty() {
            dev.mark(&self.stream)
        } else {
            dev.mark_untimed(&self.stream)
        };
        FrontendStats::add_since(&self.stats.mark_ns, t);
        match mark {
            Ok(end) => {
                st.inflight.push_back(Inflight {
                    next_get,
                    issued_ns: b.issued_ns,
                    end,
                    entries: b.entries,
                    runs: b.runs,
                    host: b.host,
                    waits: b.waits,
                    copies: b.copies,
                    kernels: b.kernels,
                    last_kernel: b.last_kernel,
                    due_ref,
                });
                Ok(())
            }
            Err(e) => {
                log::warn!("cuda channel {:?}: {e}", self.core.id);
                Err((e.fault_code(), 0))
            }
        }
    }

    fn issue_batch(
        &self,
        dev: &D,
        mem: GpuMemory<'_>,
        old_scratch: &mut Vec<u64>,
        st: &mut super::channel::ChanState<D>,
        batch: &mut Option<Batch>,
        limits: IssueLimits,
    ) -> Result<bool, (ErrorCode, u64)> {
        let cap = st.entry_cap(limits.queue_ahead_ns);
        loop {
            if batch
                .as_ref()
                .is_some_and(|b| b.waits || b.entries >= limits.batch)
            {
                return Ok(true);
            }
            let in_flight = st.entries_in_flight() + batch.as_ref().map_or(0, |b| b.entries);
            if in_flight >= cap {
                // Enough of its work is queued: a pause waits for no more than that.
                return Ok(batch.is_some());
            }
            let completed = st.fetched.wrapping_sub(in_flight);
            let t_fetch = self.stats.start();
            // Rings and push buffers must be in system memory: the front end cannot read
            // VRAM (device memory) without a copy, so an entry there faults the channel.
            if !self
                .core
                .fetch_next_into(st.fetched, completed, None, &mut st.methods)?
            {
                return Ok(batch.is_some());
            }
            let scratch_before = st.scratch;
            let mut plan = std::mem::take(&mut st.plan);
            let planned = {
                let tr = std::cell::RefCell::new(CtxTranslate {
                    space: &self.core.space,
                    mem,
                    dev,
                    scratch: &mut st.scratch,
                    signal_count: st.signal_count,
                    signals: mem.signals,
                    ref_ptr: self.ref_ptr,
                    ctx: self.core.ctx,
                });
                let mut view = GpuView::new(&self.core.space, None);
                let mut read = |va, buf: &mut [u8]| view.read(va, buf);
                plan_entry_into(&st.methods, &tr, &mut read, &mut plan)
            };
            if let Err(e) = planned {
                st.plan = plan;
                return Err(e);
            }
            if let (Some((old, _)), Some((new, _))) = (scratch_before, st.scratch) {
                if old != new {
                    old_scratch.push(old);
                }
            }
            FrontendStats::add_since(&self.stats.fetch_plan_ns, t_fetch);
            // An entry that cannot do the REF write the batch owes as it starts (the
            // stencil, copies, semaphores) starts a batch of its own: the mark between
            // takes the write (the front end's store), where a stream write between the
            // two kernels would cost the GPU ~2.5 µs (H200, 2026-11-28). So does one of a
            // channel whose entries are long or not yet timed
            // (`CudaConfig::mark_owed_ref_over_ns`): there the kernel's store would cost
            // the GPU more than the mark costs the front end.
            let long_entries = limits.owed_ref_to_mark(st.mean_entry_ns);
            if st.owed_ref.is_some()
                && plan
                    .ops
                    .first()
                    .is_some_and(|op| long_entries || !dev.does_prior(op))
            {
                if let Some(b) = batch.take() {
                    self.close_batch(dev, st, b, limits.timed_marks)?;
                }
            }
            let t_issue = self.stats.start();
            if batch.is_none() {
                // No start event in front of the launch: the host clock, which the
                // timeline maps (timeline.rs), says when the batch could start.
                *batch = Some(Batch {
                    issued_ns: now_ns(),
                    entries: 0,
                    runs: false,
                    host: Vec::new(),
                    waits: false,
                    copies: 0,
                    kernels: 0,
                    last_kernel: "",
                });
            }
            for op in &plan.ops {
                if let (Some(b), Op::Launch(a) | Op::LaunchSignal(a, _)) = (batch.as_mut(), op) {
                    b.last_kernel = a.kernel().name();
                }
                // A launch the driver refuses (e.g. a grid beyond its limits) is the
                // guest's bad argument, not a GPU failure. What the work before owes
                // is done by this op, or stays owed if it failed.
                self.issue_op(dev, st, op).map_err(|e| {
                    log::debug!("cuda channel {:?}: issue {op:?}: {e}", self.core.id);
                    (e.issue_code(), 0)
                })?;
            }
            FrontendStats::add_since(&self.stats.issue_ns, t_issue);
            self.core.kernels.fetch_add(plan.kernels, Ordering::Relaxed);
            st.fetched = st.fetched.wrapping_add(1);
            if let Some(b) = batch.as_mut() {
                b.entries += 1;
                b.runs |= plan.ops.len() > plan.ref_writes;
                b.host.append(&mut plan.host);
                b.waits |= plan.waits;
                b.copies += plan.copies;
                b.kernels += plan.kernels;
            }
            st.plan = plan;
        }
    }

    /// Whether the channel has work on the GPU or had an entry issued in the last
    /// `window_ns` (a stager or an idle application's channel that merely exists is not).
    pub fn recently_active(&self, now: u64, window_ns: u64) -> bool {
        now.saturating_sub(self.last_issue_ns.load(Ordering::Relaxed)) < window_ns
            || !self.lock().inflight.is_empty()
    }

    /// Whether GP_PUT is past what the front end fetched (work it could issue).
    pub fn has_pending(&self) -> bool {
        self.fetchable(&self.lock())
    }

    /// [`CudaChannel::has_pending`] with the state already locked.
    fn fetchable(&self, st: &super::channel::ChanState<D>) -> bool {
        !self.core.is_stopped()
            && !self.core.fetch_held()
            && vgpu_protocol::counter_after(self.core.load(ControlPage::GP_PUT), st.fetched)
    }

    /// Whether every entry issued so far has completed on the GPU; the REF values due
    /// at the reached marks are stored first (GP_GET follows at the next retire).
    pub fn drained(&self, dev: &D) -> bool {
        let mut st = self.lock();
        let gpu_ref_writes = st.gpu_ref_writes;
        for b in st.inflight.iter_mut() {
            // A failed query (a lost context) has nothing left to wait for.
            if !dev.reached(&b.end).unwrap_or(true) {
                return false;
            }
            if let Some(due) = b.due_ref.take() {
                self.store_due(due, gpu_ref_writes);
            }
        }
        true
    }
}

/// A batch running longer than this is logged (debug): what holds a pause of its channel.
const LONG_BATCH_NS: u64 = 5_000_000;

/// Busy-poll sweeps between two yields of the core (a sweep takes about a microsecond).
const YIELD_EVERY_SPINS: u32 = 32;

/// The front-end thread.
pub fn run<D: Device>(shared: Arc<Shared<D>>) {
    crate::clock::tight_timer_slack();
    let mut chans: Vec<Arc<CudaChannel<D>>> = Vec::new();
    let mut seen_gen = u64::MAX;
    let mut last_active = now_ns();
    let mut sleep_ns = shared.cfg.min_idle_sleep_ns;
    let mut cpu_mark = thread_cpu_ns();
    let mut old_scratch = Vec::new();
    let mut tl = Timeline::new(&*shared.dev);
    if tl.is_none() {
        log::warn!("cuda: no timeline stream: channels report no busy time");
    }
    let mut turn = shared.cfg.turn.clone().map(TurnUse::new);
    let mut spins = 0u32;
    // Poll (do not sleep) until this time: a channel appeared.
    let mut poll_until = 0u64;
    while !shared.shutdown.load(Ordering::Acquire) {
        let gen = shared.fifo.gen();
        if gen != seen_gen {
            let fresh = shared.fifo.channels();
            // A new channel gets its first submission soon: poll for it rather than
            // sleep and be woken (`CudaConfig::new_channel_poll_ns`).
            if fresh
                .iter()
                .any(|c| !chans.iter().any(|o| Arc::ptr_eq(o, c)))
            {
                poll_until = now_ns().saturating_add(shared.cfg.new_channel_poll_ns);
            }
            chans = fresh;
            seen_gen = gen;
        }
        let mut progress = false;
        // Batch completion marks only while the active channels (work on the GPU, or an
        // entry issued within `batch_quiet_ns`) all belong to one context: with several
        // contexts, a batch's span includes other contexts' kernels interleaved with it
        // and blurs the busy time the scheduler charges between them (measured on the
        // H200: the fair policy's 10 ms vs 1 ms split went from 50/50 to 85/15 with
        // batches of 32, even when limited to sweeps with one busy channel;
        // docs/bench-logs/cuda-fairness-batching-*.txt). The scheduler shares the GPU
        // between VMs and their processes, never between one context's channels, so a
        // context's own stager and kernel channels may blur each other. Channels that
        // merely exist (an idle application's) do not stop it; one that wakes up blurs
        // at most the batches already in flight (about `queue_ahead_ns` of work).
        let now = now_ns();
        let quiet = shared.cfg.batch_quiet_ns;
        // A channel about to issue counts as active itself: one that was quiet must not
        // issue its first batch on one mark beside another context's work.
        let mut active = chans
            .iter()
            .filter(|c| c.recently_active(now, quiet))
            .map(|c| c.core.ctx);
        let first_ctx = active.next();
        let several = active.any(|x| Some(x) != first_ctx);
        let alone = |c: &CudaChannel<D>| !several && first_ctx.is_none_or(|x| x == c.core.ctx);
        let mut batch_limit = shared.cfg.batch.max(1);
        let mut max_inflight = shared.cfg.max_inflight.max(1);
        let mut waiting_for_turn = false;
        let issue = match turn.as_mut() {
            None => true,
            Some(t) => {
                // With a turn, keep about a quantum of work on the GPU per channel, so
                // the turn passes on soon after the quantum ends (64 marks of 32 entries
                // of 10 ms kernels would hold the others off for 20 s): two marks of
                // half a quantum each, so one runs while the next is issued.
                let mean = tl.as_ref().map_or(0, |tl| tl.mean_entry_ns()).max(1);
                let ahead = u32::try_from(t.quantum_ns() / mean).unwrap_or(u32::MAX);
                let cap = (ahead / 2).max(1);
                if cap < batch_limit {
                    batch_limit = cap;
                    max_inflight = max_inflight.min(2);
                }
                let pending = chans.iter().any(|c| c.has_pending());
                let issue = t.may_issue(now, pending, || {
                    chans.iter().all(|c| c.drained(&*shared.dev))
                });
                waiting_for_turn = pending && !issue;
                issue
            }
        };
        for ch in &chans {
            progress |= ch.step(
                &*shared.dev,
                GpuMemory {
                    vram: &shared.vram,
                    hostreg: &shared.hostreg,
                    signals: shared.cfg.signal_max_blocks > 0,
                    functions: &shared.functions,
                    identity: &shared.identity,
                },
                &mut old_scratch,
                &mut tl,
                IssueLimits {
                    batch: if alone(ch) { batch_limit } else { 1 },
                    max_inflight,
                    queue_ahead_ns: shared.cfg.queue_ahead_ns,
                    timed_marks: !alone(ch),
                    mark_owed_ref_over_ns: shared.cfg.mark_owed_ref_over_ns,
                },
                issue,
            );
        }
        if !old_scratch.is_empty() {
            shared.retire_scratch(std::mem::take(&mut old_scratch));
        }
        // Waiting for the turn counts as busy: the turn should not sit idle while we sleep.
        let on_gpu = chans.iter().any(|c| !c.lock().inflight.is_empty());
        let busy = waiting_for_turn || on_gpu;
        let now = now_ns();
        if progress {
            last_active = now;
            sleep_ns = shared.cfg.min_idle_sleep_ns;
            continue;
        }
        let spin_for = if on_gpu {
            shared
                .cfg
                .busy_poll_inflight_ns
                .max(shared.cfg.busy_poll_ns)
        } else {
            shared.cfg.busy_poll_ns
        };
        if now - last_active < spin_for || now < poll_until {
            // Spin; yield the core only now and then: a yield is a system call on every
            // sweep, and the submission it delays is what the busy poll is for (measured
            // on the H100, 2026-11-27: about 1 µs of submit → start).
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(YIELD_EVERY_SPINS) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        let t = thread_cpu_ns();
        shared
            .frontend_cpu_ns
            .fetch_add(t - cpu_mark, Ordering::Relaxed);
        cpu_mark = t;
        // Work on the GPU: poll at the short interval so completions are seen promptly.
        // Idle: sleep until a doorbell (or, without one, back off up to the longest nap).
        if !busy && shared.cfg.doorbell_sleep_ns > 0 {
            crate::fifo::doze::sleep_with_doorbell(
                &chans,
                |c| &c.core,
                |c| c.has_pending(),
                Duration::from_nanos(shared.cfg.doorbell_sleep_ns),
            );
            continue;
        }
        let wait = if busy {
            shared.cfg.min_idle_sleep_ns
        } else {
            let w = sleep_ns.min(shared.cfg.max_idle_sleep_ns);
            sleep_ns = (sleep_ns * 2).min(
                shared
                    .cfg
                    .max_idle_sleep_ns
                    .max(shared.cfg.min_idle_sleep_ns),
            );
            w
        };
        std::thread::park_timeout(Duration::from_nanos(wait));
    }
}
