//! The backend's side: [`WorkerGpu`], a [`Gpu`] whose work runs in a worker process.
//!
//! Every HAL call that changes or asks the GPU is one command and one reply on the
//! worker's socket (control-plane rate). What the scheduler reads every interval (busy
//! time, progress, errors) is a load from the shared counters page; guests reach the
//! channels' control pages directly, as with an in-process GPU (the pages are the
//! worker's memfd, which this side hands on as each channel's [`FdRange`]).
//!
//! A worker is untrusted: its replies, events and counters are checked as guest input is;
//! a reply that does not fit, a call that takes longer than the timeout, or the process's
//! end marks the GPU lost: the process is killed, every channel gets a `DeviceLost`
//! error event, and every later call fails with [`HalError::DeviceLost`]. Nothing of it
//! reaches another worker.

mod events;
pub mod spawn;

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::warn;
use vgpu_host_shim::hal::Result;
use vgpu_host_shim::{
    ChannelConfig, ChannelCounters, ChannelId, ChannelResume, ContextId, EventSink, FdRange,
    GlobalInfo, Gpu, GpuInfo, HalError, MapFlags, MapTarget, PageSize, ParamInfo, SysMemory,
    VramAlloc,
};
use vgpu_protocol::{ControlPage, ErrorCode, PAGE_SIZE};
use vgpu_worker_wire::counters;
use vgpu_worker_wire::{decode_reply, encode_command, Command, Reply, Resume, Target};

use self::spawn::{start, WorkerProcess, WorkerProgram};
use crate::mapping::{file_len, memfd, sealed_memfd, Mapping};
use crate::socket;

/// Context and channel ids, unique across every worker that draws from one (the
/// backend's books key channels by id, and a restarted worker must not reuse its
/// predecessor's).
#[derive(Debug, Default)]
pub struct Ids {
    ctx: AtomicU32,
    ch: AtomicU32,
}

impl Ids {
    fn next_ctx(&self) -> u32 {
        self.ctx.fetch_add(1, Ordering::Relaxed).wrapping_add(1)
    }
    fn next_ch(&self) -> u32 {
        self.ch.fetch_add(1, Ordering::Relaxed).wrapping_add(1)
    }
}

/// How the backend talks to a worker.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// The worker's number (logs).
    pub worker: u32,
    /// Where its ids come from.
    pub ids: Arc<Ids>,
    /// A call not answered in this long loses the GPU (longer than any drain the GPU
    /// does: the cuda GPU waits up to 10 s for a context's work).
    pub call_timeout: Duration,
    /// Bytes of the buffer host VRAM reads and writes pass through.
    pub copy_buffer: u64,
    /// The GPU turn the backend's workers share (`None`: the GPU time-slices them).
    pub turn: Option<Arc<crate::TurnSlots>>,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        WorkerOptions {
            worker: 0,
            ids: Arc::default(),
            call_timeout: Duration::from_secs(30),
            copy_buffer: 8 << 20,
            turn: None,
        }
    }
}

/// Why a worker was lost, for the API and `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossKind {
    /// Its GPU faulted for good (a kernel wrote a wild address, an uncorrectable memory
    /// error): the worker exited with [`crate::EXIT_GPU_LOST`].
    GpuFault,
    /// It died of a signal the backend did not send (a crash).
    Crashed,
    /// It exited otherwise.
    Exited,
    /// A command went unanswered past the call timeout (hung).
    TimedOut,
    /// It sent a frame or reply that does not fit the protocol.
    Protocol,
    /// The backend killed it (an operator's or a test's request).
    Killed,
}

impl LossKind {
    pub const ALL: [LossKind; 6] = [
        LossKind::GpuFault,
        LossKind::Crashed,
        LossKind::Exited,
        LossKind::TimedOut,
        LossKind::Protocol,
        LossKind::Killed,
    ];

    /// The name in the API and `/metrics`.
    pub fn name(self) -> &'static str {
        match self {
            LossKind::GpuFault => "gpu_fault",
            LossKind::Crashed => "crashed",
            LossKind::Exited => "exited",
            LossKind::TimedOut => "timed_out",
            LossKind::Protocol => "protocol",
            LossKind::Killed => "killed",
        }
    }
}

/// Why a worker could not be started.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("starting {0}: {1}")]
    Spawn(String, std::io::Error),
    #[error("the worker's greeting: {0}")]
    Hello(HalError),
    #[error("the worker's shared pages: {0}")]
    Pages(std::io::Error),
    #[error("the copy buffer: {0}")]
    CopyBuffer(std::io::Error),
    #[error("starting the event thread: {0}")]
    Thread(std::io::Error),
}

struct Channel {
    ctx: u32,
    slot: u32,
    sink: Arc<dyn EventSink>,
    /// The counters last returned: a worker cannot make them go backwards.
    last: ChannelCounters,
}

struct Calls {
    sock: OwnedFd,
    seq: u32,
}

/// What the API, the event thread and `Drop` share.
pub(crate) struct Inner {
    worker: u32,
    calls: Mutex<Calls>,
    events: OwnedFd,
    child: Mutex<Option<WorkerProcess>>,
    lost: AtomicBool,
    lost_why: Mutex<String>,
    /// Why it was lost (refined by its exit status once reaped).
    lost_kind: Mutex<Option<LossKind>>,
    shutting_down: AtomicBool,
    channels: Mutex<HashMap<u32, Channel>>,
    timeout: Duration,
    /// The worker's slot in the GPU turn, cleared when it is lost.
    turn: Option<crate::turn::TurnLease>,
    /// The channels' control pages, mapped here too: when the worker is lost, this side
    /// writes each channel's `DeviceLost` into its page as the GPU would have (a guest
    /// polling its page sees the loss without an event).
    pages: std::sync::OnceLock<Mapping>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    fn sink(&self, ch: u32) -> Option<Arc<dyn EventSink>> {
        lock(&self.channels).get(&ch).map(|c| c.sink.clone())
    }

    fn take_sinks(&self) -> Vec<(u32, Arc<dyn EventSink>)> {
        lock(&self.channels)
            .iter()
            .map(|(ch, c)| (*ch, c.sink.clone()))
            .collect()
    }

    /// Writes `DeviceLost` into the control page of every channel that shows no error
    /// yet (the lost worker can no longer write its own).
    fn fail_pages(&self) {
        let Some(pages) = self.pages.get() else {
            return;
        };
        for c in lock(&self.channels).values() {
            let Some(page) = pages.ptr(u64::from(c.slot) * PAGE_SIZE, PAGE_SIZE) else {
                continue;
            };
            // SAFETY: `page` is a 4 KiB page of the mapping, which lives as long as
            // `self`; ERROR (u32) and ERROR_INFO (u64) are naturally aligned words of it,
            // which everyone else (the guest, the dead worker) accesses atomically too.
            let (error, info) = unsafe {
                (
                    &*page.add(ControlPage::ERROR).cast::<AtomicU32>(),
                    &*page.add(ControlPage::ERROR_INFO).cast::<AtomicU64>(),
                )
            };
            if error.load(Ordering::Acquire) == 0 {
                // As the GPU orders them: ERROR_INFO before ERROR.
                info.store(0, Ordering::Release);
                error.store(ErrorCode::DeviceLost as u32, Ordering::Release);
            }
        }
    }

    fn shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire)
    }

    fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    fn lost_error(&self) -> HalError {
        HalError::DeviceLost(format!(
            "GPU worker {}: {}",
            self.worker,
            lock(&self.lost_why)
        ))
    }

    /// Marks the GPU lost (once) and makes sure the process is gone.
    fn lose(&self, kind: LossKind, why: &str) {
        if !self.lost.swap(true, Ordering::AcqRel) {
            *lock(&self.lost_why) = why.to_string();
            *lock(&self.lost_kind) = Some(kind);
        }
        if let Some(c) = lock(&self.child).as_mut() {
            c.kill();
        }
        // Killed: it can no longer touch the turn page; a turn it held passes on now.
        if let Some(t) = &self.turn {
            t.clear();
        }
    }

    /// Sends `c` with `fds` and waits for its reply.
    fn call(&self, c: &Command, fds: &[RawFd]) -> Result<Reply> {
        if self.is_lost() {
            return Err(self.lost_error());
        }
        let mut calls = lock(&self.calls);
        calls.seq = calls.seq.wrapping_add(1);
        let seq = calls.seq;
        let sent = socket::send(calls.sock.as_fd(), &encode_command(seq, c), fds);
        let got = sent.and_then(|()| socket::recv(calls.sock.as_fd()));
        let (kind, why) = match got {
            Ok(Some(r)) => match decode_reply(&r.frame, r.fds.len() as u8) {
                Ok((s, rep)) if s == seq => return Ok(rep),
                Ok((s, _)) => (
                    LossKind::Protocol,
                    format!("a reply numbered {s} to command {seq}"),
                ),
                Err(e) => (LossKind::Protocol, format!("a bad reply frame: {e}")),
            },
            Ok(None) => (LossKind::Exited, "the worker exited".to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => (
                LossKind::TimedOut,
                format!("no reply to {c:?} in {:?}", self.timeout),
            ),
            Err(e) => (LossKind::Exited, format!("command socket: {e}")),
        };
        drop(calls);
        warn!("GPU worker {}: {why}", self.worker);
        self.lose(kind, &why);
        Err(self.lost_error())
    }

    /// A call whose only good answer is `Ok`.
    fn call_ok(&self, c: &Command) -> Result<()> {
        match self.call(c, &[])? {
            Reply::Ok => Ok(()),
            Reply::Error { code } => Err(refusal(code, c)),
            r => Err(self.unexpected(c, r)),
        }
    }

    /// A call answered with a byte count.
    fn call_bytes(&self, c: &Command) -> Result<u64> {
        match self.call(c, &[])? {
            Reply::Bytes { n } => Ok(n),
            Reply::Error { code } => Err(refusal(code, c)),
            r => Err(self.unexpected(c, r)),
        }
    }

    /// A reply of the wrong kind: the worker broke the protocol.
    fn unexpected(&self, c: &Command, r: Reply) -> HalError {
        let why = format!("answered {c:?} with {r:?}");
        warn!("GPU worker {}: {why}", self.worker);
        self.lose(LossKind::Protocol, &why);
        self.lost_error()
    }
}

/// The HAL error for a worker's refusal of `c`.
fn refusal(code: ErrorCode, c: &Command) -> HalError {
    match (code, c) {
        (ErrorCode::NoMemory, Command::AllocVram { size, .. }) => HalError::OutOfVram(*size),
        (ErrorCode::NotFound, Command::FreeVram { offset }) => HalError::NoAllocation(*offset),
        (
            ErrorCode::NotFound,
            Command::DestroyChannel { ch }
            | Command::KillChannel { ch, .. }
            | Command::Doorbell { ch }
            | Command::HoldFetch { ch, .. }
            | Command::FetchedDone { ch },
        ) => HalError::NoChannel(ChannelId(*ch)),
        (
            ErrorCode::NotFound,
            Command::DestroyContext { ctx }
            | Command::Map { ctx, .. }
            | Command::Unmap { ctx, .. }
            | Command::Remap { ctx, .. }
            | Command::InvalidateTlb { ctx }
            | Command::PageTableBytes { ctx }
            | Command::MapCost { ctx, .. }
            | Command::SysramHint { ctx, .. }
            | Command::CreateChannel { ctx, .. },
        ) => HalError::NoContext(ContextId(*ctx)),
        (ErrorCode::DeviceLost, _) => HalError::DeviceLost("the worker's GPU".into()),
        (code, _) => HalError::Refused(code),
    }
}

fn wire_target(t: MapTarget) -> Target {
    match t {
        MapTarget::Vram { offset } => Target::Vram { offset },
        MapTarget::Sysram { addr } => Target::Sysram { addr },
    }
}

/// A guest RAM region as the worker has it: where, and which file range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RegionId {
    addr: u64,
    len: u64,
    fd_offset: u64,
    dev: u64,
    ino: u64,
}

impl RegionId {
    fn of(r: &vgpu_host_shim::SysRegion) -> Result<Self> {
        // SAFETY: stat is plain data, filled by fstat before it is read.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a valid out pointer; `r.fd` is open while the SysMemory lives.
        if unsafe { libc::fstat(r.fd, &mut st) } != 0 {
            return Err(HalError::Os(format!(
                "a guest RAM region's file: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(RegionId {
            addr: r.addr,
            len: r.len,
            fd_offset: r.fd_offset,
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }
}

#[derive(Default)]
struct Regions {
    sent: Vec<RegionId>,
    /// Contexts alive on the worker (it forgets regions only while there are none).
    contexts: usize,
}

/// A GPU served by a worker process.
pub struct WorkerGpu {
    inner: Arc<Inner>,
    info: GpuInfo,
    /// The GPU's device attributes, as the worker greeted with them.
    attributes: Vec<(u32, i32)>,
    pid: u32,
    control_pages: OwnedFd,
    counters: Mapping,
    /// The copy buffer (its fd stays open: the worker maps the same file).
    copy: Mutex<Mapping>,
    _copy_fd: OwnedFd,
    /// Guest RAM regions the worker has, and the contexts alive on it.
    regions: Mutex<Regions>,
    ids: Arc<Ids>,
    event_thread: Mutex<Option<JoinHandle<()>>>,
}

impl WorkerGpu {
    /// Starts `prog` and greets it; the GPU is ready when this returns.
    pub fn start(
        prog: &WorkerProgram,
        opts: &WorkerOptions,
    ) -> std::result::Result<Arc<Self>, StartError> {
        let turn = opts.turn.as_ref().and_then(|t| {
            let l = t.lease();
            if l.is_none() {
                warn!(
                    "GPU worker {}: no turn slot left; it runs time-sliced",
                    opts.worker
                );
            }
            l
        });
        let mut prog = prog.clone();
        if let Some(t) = &turn {
            prog.args.extend([
                "--turn-slot".to_string(),
                t.slot().to_string(),
                "--turn-quantum-us".to_string(),
                t.quantum_us().to_string(),
            ]);
        }
        let started = start(&prog, turn.as_ref().map(|t| t.fd()))
            .map_err(|e| StartError::Spawn(prog.program.display().to_string(), e))?;
        let pid = started.process.id();
        socket::set_recv_timeout(started.cmd.as_fd(), Some(opts.call_timeout))
            .map_err(StartError::Pages)?;
        let inner = Arc::new(Inner {
            worker: opts.worker,
            calls: Mutex::new(Calls {
                sock: started.cmd,
                seq: 0,
            }),
            events: started.events,
            child: Mutex::new(Some(started.process)),
            lost: AtomicBool::new(false),
            lost_why: Mutex::new(String::new()),
            lost_kind: Mutex::new(None),
            shutting_down: AtomicBool::new(false),
            channels: Mutex::new(HashMap::new()),
            timeout: opts.call_timeout,
            turn,
            pages: std::sync::OnceLock::new(),
        });
        // From here on a failure must not leave the process behind.
        let fail = |e: StartError| {
            inner.lose(LossKind::Exited, "its start failed");
            reap(&inner);
            e
        };
        let (gi, attributes, pages, counters) = hello(&inner, opts.worker).map_err(fail)?;
        let pages_len = u64::from(gi.max_channels) * PAGE_SIZE;
        let map = Mapping::new(pages.as_fd(), 0, pages_len, true).map_err(StartError::Pages);
        let _ = inner.pages.set(map.map_err(fail)?);
        let copy_fd = memfd("vgpu-worker-copy", opts.copy_buffer)
            .map_err(|e| fail(StartError::CopyBuffer(e)))?;
        let copy = Mapping::new(copy_fd.as_fd(), 0, opts.copy_buffer, true)
            .map_err(|e| fail(StartError::CopyBuffer(e)))?;
        inner
            .call(
                &Command::CopyBuffer {
                    len: opts.copy_buffer,
                },
                &[copy_fd.as_raw_fd()],
            )
            .and_then(|r| match r {
                Reply::Ok => Ok(()),
                r => Err(HalError::DeviceLost(format!("copy buffer refused: {r:?}"))),
            })
            .map_err(|e| fail(StartError::Hello(e)))?;
        let i = inner.clone();
        let event_thread = std::thread::Builder::new()
            .name(format!("gpu-worker-{}-events", opts.worker))
            .spawn(move || events::run(i))
            .map_err(|e| fail(StartError::Thread(e)))?;
        Ok(Arc::new(WorkerGpu {
            inner,
            info: gi,
            attributes,
            pid,
            control_pages: pages,
            counters,
            copy: Mutex::new(copy),
            _copy_fd: copy_fd,
            regions: Mutex::new(Regions::default()),
            ids: opts.ids.clone(),
            event_thread: Mutex::new(Some(event_thread)),
        }))
    }

    /// The worker's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the GPU is lost (the worker died, faulted or broke the protocol).
    pub fn is_lost(&self) -> bool {
        self.inner.is_lost()
    }

    /// Kills the worker (as a fault would end it): the GPU is lost.
    pub fn kill(&self) {
        self.inner.lose(LossKind::Killed, "killed");
    }

    /// Why the worker was lost, once it is.
    pub fn loss_kind(&self) -> Option<LossKind> {
        *lock(&self.inner.lost_kind)
    }

    fn channel_slot(&self, ch: ChannelId) -> Result<u32> {
        lock(&self.inner.channels)
            .get(&ch.0)
            .map(|c| c.slot)
            .ok_or(HalError::NoChannel(ch))
    }

    /// Makes the worker's guest RAM that of `sysmem`: regions it has (the same file
    /// range at the same address) stay, new ones are sent; a region that differs from
    /// one the worker has (the VM reconnected with new memory) replaces them all, which
    /// the worker allows only while no context lives.
    fn send_regions(&self, sysmem: &dyn SysMemory) -> Result<()> {
        let regions = sysmem.regions();
        if regions.is_empty() {
            return Err(HalError::Unsupported(
                "system memory a worker process cannot map (no file behind it)",
            ));
        }
        let mut have = lock(&self.regions);
        let mut want = Vec::with_capacity(regions.len());
        for r in &regions {
            want.push(RegionId::of(r)?);
        }
        let clash = want.iter().any(|w| {
            have.sent
                .iter()
                .any(|h| h != w && h.addr < w.addr + w.len && w.addr < h.addr + h.len)
        });
        if clash {
            if have.contexts > 0 {
                return Err(HalError::Unsupported(
                    "a new memory table while contexts use the old one",
                ));
            }
            self.inner.call_ok(&Command::ClearGuestRegions)?;
            have.sent.clear();
        }
        for (r, id) in regions.iter().zip(want) {
            if have.sent.contains(&id) {
                continue;
            }
            let c = Command::AddGuestRegion {
                gpa: r.addr,
                len: r.len,
                fd_offset: r.fd_offset,
            };
            match self.inner.call(&c, &[r.fd])? {
                Reply::Ok => have.sent.push(id),
                Reply::Error { code } => return Err(refusal(code, &c)),
                rep => return Err(self.inner.unexpected(&c, rep)),
            }
        }
        Ok(())
    }

    /// Moves `len` bytes between VRAM at `offset` and the copy buffer, piece by piece,
    /// with `each` copying between the buffer and the caller's memory.
    fn through_copy_buffer(
        &self,
        offset: u64,
        len: usize,
        to_vram: bool,
        each: impl FnMut(*mut u8, usize, usize),
    ) -> Result<()> {
        let copy = |vram_offset, len| Command::Copy {
            vram_offset,
            buf_offset: 0,
            len,
            to_vram,
        };
        self.in_pieces(offset, len, to_vram, copy, each)
    }

    /// Moves `len` bytes from `offset` on through the copy buffer's start, a piece at a
    /// time: `command(offset, n)` has the worker copy a piece, `each(buffer, done, n)`
    /// fills the buffer before it (`inbound`: towards the worker) or empties it after.
    fn in_pieces(
        &self,
        offset: u64,
        len: usize,
        inbound: bool,
        command: impl Fn(u64, u64) -> Command,
        mut each: impl FnMut(*mut u8, usize, usize),
    ) -> Result<()> {
        let buf = lock(&self.copy);
        let piece = buf.len() as usize;
        let mut done = 0usize;
        while done < len {
            let n = piece.min(len - done);
            let at = offset
                .checked_add(done as u64)
                .ok_or(HalError::InvalidArgument("copy range"))?;
            let p = buf
                .ptr(0, n as u64)
                .ok_or(HalError::InvalidArgument("copy piece"))?;
            if inbound {
                each(p, done, n);
            }
            self.inner.call_ok(&command(at, n as u64))?;
            if !inbound {
                each(p, done, n);
            }
            done += n;
        }
        Ok(())
    }

    fn new_channel(
        &self,
        ctx: ContextId,
        cfg: ChannelConfig,
        sink: Arc<dyn EventSink>,
        resume: Option<Resume>,
    ) -> Result<ChannelId> {
        cfg.check()?;
        let ch = self.ids.next_ch();
        let c = Command::CreateChannel {
            ctx: ctx.0,
            ch,
            gp_ring_va: cfg.gp_ring_va,
            gp_entries: cfg.gp_entries,
            resume,
        };
        // Registered before the worker can send its first event.
        lock(&self.inner.channels).insert(
            ch,
            Channel {
                ctx: ctx.0,
                slot: u32::MAX,
                sink,
                last: ChannelCounters::default(),
            },
        );
        let slot = match self.inner.call(&c, &[]) {
            Ok(Reply::Channel { slot }) if slot < self.info.max_channels => Ok(slot),
            Ok(Reply::Error { code }) => Err(refusal(code, &c)),
            Ok(r) => Err(self.inner.unexpected(&c, r)),
            Err(e) => Err(e),
        };
        let mut chans = lock(&self.inner.channels);
        match slot {
            Ok(slot) => {
                if let Some(e) = chans.get_mut(&ch) {
                    e.slot = slot;
                }
                Ok(ChannelId(ch))
            }
            Err(e) => {
                chans.remove(&ch);
                Err(e)
            }
        }
    }
}

/// The command copying a piece of `module`'s variable `name` through the copy buffer.
fn variable_copy(
    ctx: ContextId,
    module: u32,
    name: &str,
    to_variable: bool,
) -> impl Fn(u64, u64) -> Command + '_ {
    move |offset, len| Command::VariableCopy {
        ctx: ctx.0,
        module,
        name: name.as_bytes().to_vec(),
        offset,
        len,
        to_variable,
    }
}

/// A worker's greeting: its GPU's shape and attributes, the control pages' file and the
/// counters page.
type Greeting = (GpuInfo, Vec<(u32, i32)>, OwnedFd, Mapping);

/// Greets the worker: its GPU's shape and the two shared pages.
fn hello(inner: &Inner, worker: u32) -> std::result::Result<Greeting, StartError> {
    let calls = lock(&inner.calls);
    let c = Command::Hello { worker };
    socket::send(calls.sock.as_fd(), &encode_command(0, &c), &[])
        .map_err(|e| StartError::Hello(HalError::DeviceLost(e.to_string())))?;
    let got = socket::recv(calls.sock.as_fd())
        .map_err(|e| StartError::Hello(HalError::DeviceLost(e.to_string())))?
        .ok_or_else(|| StartError::Hello(HalError::DeviceLost("the worker exited".into())))?;
    let bad = |why: String| StartError::Hello(HalError::DeviceLost(why));
    let (seq, rep) =
        decode_reply(&got.frame, got.fds.len() as u8).map_err(|e| bad(e.to_string()))?;
    let Reply::Hello {
        vram_bytes,
        max_channels,
        max_contexts,
        compute_engines,
        control_pages_len,
        counters_len,
        attributes,
    } = rep
    else {
        return Err(bad(format!("greeted with {rep:?}")));
    };
    if seq != 0 {
        return Err(bad(format!("greeting numbered {seq}")));
    }
    let mut fds = got.fds.into_iter();
    let (Some(pages), Some(counters_fd)) = (fds.next(), fds.next()) else {
        return Err(bad("greeting without its pages".into()));
    };
    // Files shorter than they claim would fault the backend on access.
    for (fd, len) in [(&pages, control_pages_len), (&counters_fd, counters_len)] {
        if file_len(fd.as_fd()).map_err(StartError::Pages)? < len {
            return Err(bad("a shared page file shorter than said".into()));
        }
    }
    let counters =
        Mapping::new(counters_fd.as_fd(), 0, counters_len, false).map_err(StartError::Pages)?;
    let gi = GpuInfo {
        name: format!("worker {worker}"),
        vram_bytes,
        compute_engines,
        max_channels,
        max_contexts,
        has_busy_counters: true,
    };
    Ok((gi, attributes, pages, counters))
}

/// Waits for the process (killing it if it lingers).
fn reap(inner: &Inner) {
    let Some(mut child) = lock(&inner.child).take() else {
        return;
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                refine_loss(inner, status);
                return;
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            other => {
                warn!(
                    "GPU worker {}: no end seen ({other:?}); killed",
                    inner.worker
                );
                child.kill();
                let _ = child.wait();
                return;
            }
        }
    }
}

/// A worker that "exited" is told apart by its status: a GPU fault, or a crash.
fn refine_loss(inner: &Inner, status: std::process::ExitStatus) {
    use std::os::unix::process::ExitStatusExt;
    let mut kind = lock(&inner.lost_kind);
    if *kind != Some(LossKind::Exited) {
        return;
    }
    if status.code() == Some(crate::EXIT_GPU_LOST) {
        *kind = Some(LossKind::GpuFault);
    } else if status.signal().is_some() {
        *kind = Some(LossKind::Crashed);
    }
}

impl Drop for WorkerGpu {
    fn drop(&mut self) {
        self.inner.shutting_down.store(true, Ordering::Release);
        if !self.inner.is_lost() {
            if let Err(e) = self.inner.call_ok(&Command::Shutdown) {
                warn!("GPU worker {}: shutdown: {e}", self.inner.worker);
            }
        }
        reap(&self.inner);
        if let Some(t) = lock(&self.event_thread).take() {
            let _ = t.join();
        }
    }
}

impl Gpu for WorkerGpu {
    fn info(&self) -> GpuInfo {
        self.info.clone()
    }

    fn device_attributes(&self, _owner: u32) -> Result<Vec<(u32, i32)>> {
        Ok(self.attributes.clone())
    }

    fn create_context(&self, sysmem: Arc<dyn SysMemory>) -> Result<ContextId> {
        self.send_regions(sysmem.as_ref())?;
        let ctx = self.ids.next_ctx();
        self.inner.call_ok(&Command::CreateContext { ctx })?;
        lock(&self.regions).contexts += 1;
        Ok(ContextId(ctx))
    }

    fn destroy_context(&self, ctx: ContextId) -> Result<()> {
        self.inner
            .call_ok(&Command::DestroyContext { ctx: ctx.0 })?;
        // The worker destroyed the context's channels with it.
        lock(&self.inner.channels).retain(|_, c| c.ctx != ctx.0);
        let mut r = lock(&self.regions);
        r.contexts = r.contexts.saturating_sub(1);
        Ok(())
    }

    fn alloc_vram(&self, size: u64, align: u64) -> Result<VramAlloc> {
        if size == 0 || !align.is_power_of_two() {
            return Err(HalError::InvalidArgument("VRAM size or alignment"));
        }
        let size = size.div_ceil(PAGE_SIZE) * PAGE_SIZE;
        let c = Command::AllocVram {
            size,
            align: align.max(PAGE_SIZE),
        };
        match self.inner.call(&c, &[])? {
            Reply::Vram { offset, len } if len >= size && offset.is_multiple_of(align) => {
                Ok(VramAlloc { offset, size: len })
            }
            Reply::Error { code } => Err(refusal(code, &c)),
            r => Err(self.inner.unexpected(&c, r)),
        }
    }

    fn free_vram(&self, offset: u64) -> Result<()> {
        self.inner.call_ok(&Command::FreeVram { offset })
    }

    fn vram_free_bytes(&self) -> u64 {
        self.inner
            .call_bytes(&Command::VramFree)
            .map_or(0, |n| n.min(self.info.vram_bytes))
    }

    fn vram_fd(&self) -> Option<FdRange> {
        None
    }

    fn vram_read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let out = buf.as_mut_ptr();
        self.through_copy_buffer(offset, buf.len(), false, |p, at, n| {
            // SAFETY: `p` holds `n` bytes the worker just copied (the buffer is locked);
            // `out + at .. + n` lies inside the caller's slice.
            unsafe { std::ptr::copy_nonoverlapping(p, out.add(at), n) }
        })
    }

    fn vram_write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        let src = buf.as_ptr();
        self.through_copy_buffer(offset, buf.len(), true, |p, at, n| {
            // SAFETY: as in `vram_read`, the other way.
            unsafe { std::ptr::copy_nonoverlapping(src.add(at), p, n) }
        })
    }

    fn map(
        &self,
        ctx: ContextId,
        va: u64,
        size: u64,
        target: MapTarget,
        page: PageSize,
        flags: MapFlags,
    ) -> Result<()> {
        let bytes = page.bytes();
        if size == 0 || !va.is_multiple_of(bytes) || !size.is_multiple_of(bytes) {
            return Err(HalError::InvalidArgument(
                "mapping not aligned to its pages",
            ));
        }
        self.inner.call_ok(&Command::Map {
            ctx: ctx.0,
            va,
            size,
            target: wire_target(target),
            page,
            read_only: flags.read_only,
        })
    }

    fn unmap(&self, ctx: ContextId, va: u64, size: u64) -> Result<()> {
        self.inner.call_ok(&Command::Unmap {
            ctx: ctx.0,
            va,
            size,
        })
    }

    fn page_table_bytes(&self, ctx: ContextId) -> Result<u64> {
        self.inner
            .call_bytes(&Command::PageTableBytes { ctx: ctx.0 })
    }

    fn map_cost(&self, ctx: ContextId, va: u64, size: u64, page: PageSize) -> Result<u64> {
        self.inner.call_bytes(&Command::MapCost {
            ctx: ctx.0,
            va,
            size,
            page,
        })
    }

    fn remap(&self, ctx: ContextId, va: u64, size: u64, target: MapTarget) -> Result<()> {
        self.inner.call_ok(&Command::Remap {
            ctx: ctx.0,
            va,
            size,
            target: wire_target(target),
        })
    }

    fn prepare_sysram_hint(&self, ctx: ContextId, addr: u64, len: u64) -> Result<()> {
        self.inner.call_ok(&Command::SysramHint {
            ctx: ctx.0,
            addr,
            len,
            prepare: true,
        })
    }

    fn release_sysram_hint(&self, ctx: ContextId, addr: u64, len: u64) {
        if let Err(e) = self.inner.call_ok(&Command::SysramHint {
            ctx: ctx.0,
            addr,
            len,
            prepare: false,
        }) {
            log::debug!("releasing a sysram hint: {e}");
        }
    }

    fn invalidate_tlb(&self, ctx: ContextId) -> Result<()> {
        self.inner.call_ok(&Command::InvalidateTlb { ctx: ctx.0 })
    }

    fn access_counts(
        &self,
        _ctx: ContextId,
        _va: u64,
        _size: u64,
        _reset: bool,
    ) -> Result<Vec<(u64, u32)>> {
        Err(HalError::Unsupported(
            "access counts of a GPU in a worker process",
        ))
    }

    fn create_channel(
        &self,
        ctx: ContextId,
        cfg: ChannelConfig,
        sink: Arc<dyn EventSink>,
    ) -> Result<ChannelId> {
        self.new_channel(ctx, cfg, sink, None)
    }

    fn create_channel_resumed(
        &self,
        ctx: ContextId,
        cfg: ChannelConfig,
        sink: Arc<dyn EventSink>,
        at: ChannelResume,
    ) -> Result<ChannelId> {
        let r = Resume {
            gp_get: at.gp_get,
            reference: at.reference,
            notify_seq: at.notify_seq,
            error: at.error,
        };
        self.new_channel(ctx, cfg, sink, Some(r))
    }

    fn destroy_channel(&self, ch: ChannelId) -> Result<()> {
        self.channel_slot(ch)?;
        let r = self.inner.call_ok(&Command::DestroyChannel { ch: ch.0 });
        // Gone whatever the worker said: a lost worker has no channels left.
        lock(&self.inner.channels).remove(&ch.0);
        match r {
            Err(HalError::DeviceLost(_)) => Ok(()),
            r => r,
        }
    }

    fn control_page(&self, ch: ChannelId) -> Result<FdRange> {
        let slot = self.channel_slot(ch)?;
        Ok(FdRange {
            fd: self.control_pages.as_raw_fd(),
            offset: u64::from(slot) * PAGE_SIZE,
            len: PAGE_SIZE,
        })
    }

    fn control_pages(&self) -> Option<FdRange> {
        Some(FdRange {
            fd: self.control_pages.as_raw_fd(),
            offset: 0,
            len: u64::from(self.info.max_channels) * PAGE_SIZE,
        })
    }

    fn doorbell(&self, ch: ChannelId) {
        if let Err(e) = self.inner.call_ok(&Command::Doorbell { ch: ch.0 }) {
            log::debug!("doorbell {ch:?}: {e}");
        }
    }

    fn channel_counters(&self, ch: ChannelId) -> Result<ChannelCounters> {
        let mut chans = lock(&self.inner.channels);
        let c = chans.get_mut(&ch.0).ok_or(HalError::NoChannel(ch))?;
        if self.inner.is_lost() {
            return Ok(c.last);
        }
        let rec = counters::record(self.counters.words(), c.slot)
            .and_then(counters::read)
            .map_err(|e| HalError::DeviceLost(format!("counters of {ch:?}: {e}")))?;
        let l = &mut c.last;
        l.busy_ns = l.busy_ns.max(rec.busy_ns);
        l.gp_completed = l.gp_completed.max(rec.gp_completed);
        l.kernels = l.kernels.max(rec.kernels);
        l.copies = l.copies.max(rec.copies);
        l.sem_wait_ns = l.sem_wait_ns.max(rec.sem_wait_ns);
        Ok(*l)
    }

    fn channel_error(&self, ch: ChannelId) -> Result<Option<(ErrorCode, u64)>> {
        let slot = self.channel_slot(ch)?;
        if self.inner.is_lost() {
            return Ok(Some((ErrorCode::DeviceLost, 0)));
        }
        let rec = counters::record(self.counters.words(), slot)
            .and_then(counters::read)
            .map_err(|e| HalError::DeviceLost(format!("counters of {ch:?}: {e}")))?;
        Ok(rec.error)
    }

    fn kill_channel(&self, ch: ChannelId, code: ErrorCode) -> Result<()> {
        self.channel_slot(ch)?;
        self.inner.call_ok(&Command::KillChannel { ch: ch.0, code })
    }

    fn hold_fetch(&self, ch: ChannelId, hold: bool) -> Result<bool> {
        self.channel_slot(ch)?;
        let n = self
            .inner
            .call_bytes(&Command::HoldFetch { ch: ch.0, hold })?;
        Ok(n == 1)
    }

    fn fetched_done(&self, ch: ChannelId) -> Result<Option<bool>> {
        self.channel_slot(ch)?;
        if self.inner.is_lost() {
            return Ok(None);
        }
        let c = Command::FetchedDone { ch: ch.0 };
        match self.inner.call_bytes(&c)? {
            0 => Ok(None),
            1 => Ok(Some(false)),
            2 => Ok(Some(true)),
            n => Err(self.inner.unexpected(&c, Reply::Bytes { n })),
        }
    }

    fn module_load(&self, ctx: ContextId, module: u32, image: &[u8]) -> Result<()> {
        let fd = sealed_memfd("vgpu-module", image).map_err(|e| HalError::Os(e.to_string()))?;
        let c = Command::ModuleLoad {
            ctx: ctx.0,
            module,
            len: image.len() as u64,
        };
        match self.inner.call(&c, &[fd.as_raw_fd()])? {
            Reply::Ok => Ok(()),
            Reply::Error { code } => Err(refusal(code, &c)),
            r => Err(self.inner.unexpected(&c, r)),
        }
    }

    fn module_unload(&self, ctx: ContextId, module: u32) -> Result<()> {
        self.inner
            .call_ok(&Command::ModuleUnload { ctx: ctx.0, module })
    }

    fn function_get(
        &self,
        ctx: ContextId,
        module: u32,
        name: &str,
        function: u32,
    ) -> Result<Option<Vec<ParamInfo>>> {
        let c = Command::FunctionGet {
            ctx: ctx.0,
            module,
            function,
            name: name.as_bytes().to_vec(),
        };
        match self.inner.call(&c, &[])? {
            Reply::Function { params } => Ok(params),
            Reply::Error { code } => Err(refusal(code, &c)),
            r => Err(self.inner.unexpected(&c, r)),
        }
    }

    fn global_read(
        &self,
        ctx: ContextId,
        module: u32,
        name: &str,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        let out = buf.as_mut_ptr();
        let copy = variable_copy(ctx, module, name, false);
        self.in_pieces(offset, buf.len(), false, copy, |p, at, n| {
            // SAFETY: `p` holds `n` bytes the worker just copied (the buffer is locked);
            // `out + at .. + n` lies inside the caller's slice.
            unsafe { std::ptr::copy_nonoverlapping(p, out.add(at), n) }
        })
    }

    fn global_write(
        &self,
        ctx: ContextId,
        module: u32,
        name: &str,
        offset: u64,
        data: &[u8],
    ) -> Result<()> {
        let src = data.as_ptr();
        let copy = variable_copy(ctx, module, name, true);
        self.in_pieces(offset, data.len(), true, copy, |p, at, n| {
            // SAFETY: as in `global_read`, the other way.
            unsafe { std::ptr::copy_nonoverlapping(src.add(at), p, n) }
        })
    }

    fn global_get(&self, ctx: ContextId, module: u32, name: &str) -> Result<GlobalInfo> {
        let c = Command::GlobalGet {
            ctx: ctx.0,
            module,
            name: name.as_bytes().to_vec(),
        };
        match self.inner.call(&c, &[])? {
            Reply::Global { addr, size } => Ok(GlobalInfo { addr, size }),
            Reply::Error { code } => Err(refusal(code, &c)),
            r => Err(self.inner.unexpected(&c, r)),
        }
    }
}
