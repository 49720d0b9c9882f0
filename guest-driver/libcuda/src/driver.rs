//! The library's state: the device this process opened, its contexts and what lives in
//! them, and each thread's current context.
//!
//! One lock guards it all: CUDA programs call the driver from few threads, and the
//! runtime's objects (buffers, channels) are not meant to be shared between threads
//! anyway. A call that waits for the GPU holds the lock while it waits (documented in
//! docs/guest-cuda.md: a second thread's calls queue behind a synchronize).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, Once};
use std::time::Duration;

use vgpu_guest::{Buffer, Channel, Context, Device, DeviceInfo, Fence, Function, Module};

use crate::errors::{from_error, is_sticky, CuResult};
use crate::types::*;

/// How long a synchronize waits before it reports the GPU hung.
pub const SYNC_PATIENCE: Duration = Duration::from_secs(600);
/// Event slots per context: 16 bytes each (a semaphore and the GPU clock).
const EVENT_SLOTS: u32 = 4096;
const EVENT_SLOT_BYTES: u64 = 16;

static STATE: Mutex<Option<Driver>> = Mutex::new(None);
static NEXT_ID: AtomicU64 = AtomicU64::new(16);

thread_local! {
    /// The thread's context stack (`cuCtxPush/PopCurrent`); its top is current.
    static CURRENT: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// A fresh handle value. Starts above the values `cuda.h` gives meaning to
/// (`CU_STREAM_LEGACY` = 1, `CU_STREAM_PER_THREAD` = 2).
pub fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// Turns on `RUST_LOG`-style logging (to stderr) once, for the first entry point called.
pub fn init_logging() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let env = env_logger::Env::new()
            .filter_or("VGPU_CUDA_LOG", "warn")
            .write_style("VGPU_CUDA_LOG_STYLE");
        // A program that set up a logger of its own keeps it.
        let _ = env_logger::Builder::from_env(env).try_init();
    });
}

/// Launches a stream holds back while its GPU is still busy (one GP entry and one
/// completion mark for all of them: the host runs a module launch's completion mark as a
/// driver call of its own, so a mark per launch would halve a launch loop's rate).
pub const BATCH_MAX: u32 = 32;
/// How long launches may wait in a batch when no further driver call comes.
const FLUSH_AFTER: Duration = Duration::from_micros(200);

/// An in-order queue of GPU work: a channel, and the fence of the last work on it.
///
/// Launches are batched (see [`Stream::launched`]): a launch onto an idle stream goes to
/// the GPU at once; one onto a busy stream waits in the channel's pending push buffer
/// until the GPU catches up, `BATCH_MAX` have gathered, any other call on the stream
/// submits, or the flusher thread submits it after `FLUSH_AFTER` — so no launch waits
/// for the program's next call, and the GPU never idles behind a batch for longer.
pub struct Stream {
    pub ch: Channel,
    pub last: Option<Fence>,
    /// Launches recorded but not yet submitted.
    pub batched: u32,
    /// Synchronises with the default stream (a stream created without
    /// `CU_STREAM_NON_BLOCKING`, or the default stream itself).
    pub blocking: bool,
}

impl Stream {
    pub fn new(ctx: &Context, blocking: bool) -> CuResult<Self> {
        Ok(Stream {
            ch: ctx.create_channel().map_err(|e| from_error(&e))?,
            last: None,
            batched: 0,
            blocking,
        })
    }

    /// Submits what the channel has pending; the stream's last fence moves to it.
    pub fn submit(&mut self) -> CuResult<Fence> {
        let f = self.ch.submit().map_err(|e| from_error(&e))?;
        self.last = Some(f);
        self.batched = 0;
        Ok(f)
    }

    /// After a launch was recorded: submits now if the GPU has nothing of this stream
    /// left to run or the batch is full; else leaves it for the batch (and the flusher).
    pub fn launched(&mut self) -> CuResult {
        self.batched += 1;
        if self.batched >= BATCH_MAX || self.idle()? {
            self.submit().map(|_| ())
        } else {
            wake_flusher();
            Ok(())
        }
    }

    /// Waits for everything submitted so far.
    pub fn sync(&mut self) -> CuResult {
        if self.ch.has_pending() {
            self.submit()?;
        }
        match self.last {
            Some(f) => self
                .ch
                .wait_timeout(f, SYNC_PATIENCE)
                .map_err(|e| from_error(&e)),
            None => Ok(()),
        }
    }

    /// Whether everything recorded has completed (a batch not yet submitted has not).
    pub fn idle(&self) -> CuResult<bool> {
        if self.ch.has_pending() {
            return Ok(false);
        }
        match self.last {
            Some(f) => self.ch.is_complete(f).map_err(|e| from_error(&e)),
            None => Ok(true),
        }
    }
}

/// A function handle: the module it came from and the device's function.
pub struct Func {
    pub module: u64,
    pub f: Function,
}

/// An event: a semaphore slot in its context's event buffer, and where it was recorded.
pub struct Event {
    pub ctx: u64,
    pub slot: u32,
    /// The value the last record releases (waits compare against it).
    pub seq: u32,
    /// The stream it was last recorded on and that record's fence.
    pub recorded: Option<(u64, Fence)>,
    pub timing: bool,
}

/// A context: the runtime's address space and everything a program made in it.
pub struct CtxState {
    pub ctx: Context,
    /// Allocations by GPU address.
    pub allocs: crate::allocs::Allocs,
    /// `cuMemAllocHost` memory: CPU address → GPU address.
    pub host: HashMap<usize, u64>,
    pub default_stream: Stream,
    pub streams: HashMap<u64, Stream>,
    /// Event semaphores (allocated at the first event).
    pub event_buf: Option<Buffer>,
    pub free_slots: Vec<u32>,
    /// The fault that ended this context (a real GPU's sticky error): every later call
    /// on it returns this.
    pub sticky: Option<CUresult>,
    pub primary: bool,
    /// Module globals whose addresses this context handed out (`cuModuleGetGlobal`), by
    /// address: copies there go to the device as global copies.
    pub globals: std::collections::BTreeMap<u64, GlobalRef>,
}

/// A module global the program knows the address of.
#[derive(Debug, Clone)]
pub struct GlobalRef {
    pub size: u64,
    /// The module's handle (`CUmodule`) and its device id.
    pub module: u64,
    pub device_module: u32,
    pub name: String,
}

impl CtxState {
    pub fn new(device: &Device, primary: bool) -> CuResult<Self> {
        let ctx = device.create_context().map_err(|e| from_error(&e))?;
        let default_stream = Stream::new(&ctx, true)?;
        Ok(CtxState {
            ctx,
            allocs: Default::default(),
            host: HashMap::new(),
            default_stream,
            streams: HashMap::new(),
            event_buf: None,
            free_slots: Vec::new(),
            sticky: None,
            primary,
            globals: Default::default(),
        })
    }

    /// Fails with the context's sticky error, if it has one.
    pub fn alive(&self) -> CuResult {
        match self.sticky {
            Some(c) => Err(c),
            None => Ok(()),
        }
    }

    /// Records a failure: a fault makes the context unusable from now on.
    pub fn note(&mut self, code: CUresult) -> CUresult {
        if is_sticky(code) && self.sticky.is_none() {
            log::warn!("context lost: {code}");
            self.sticky = Some(code);
        }
        code
    }

    /// The stream a `CUstream` names in this context (NULL, legacy and per-thread: the
    /// default stream).
    pub fn stream(&mut self, s: CUstream) -> CuResult<&mut Stream> {
        let id = s as usize;
        if id == 0 || id == CU_STREAM_LEGACY || id == CU_STREAM_PER_THREAD {
            return Ok(&mut self.default_stream);
        }
        self.streams
            .get_mut(&(id as u64))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    /// Before work goes on stream `s`: the legacy default stream's implicit ordering.
    /// Work on the default stream waits for every blocking stream, and work on a blocking
    /// stream waits for the default stream (here on the CPU, before the work is queued).
    pub fn order_before(&mut self, s: CUstream) -> CuResult {
        let id = s as usize;
        if id == 0 || id == CU_STREAM_LEGACY || id == CU_STREAM_PER_THREAD {
            for st in self.streams.values_mut().filter(|st| st.blocking) {
                if !st.idle()? {
                    st.sync()?;
                }
            }
            Ok(())
        } else if self.stream(s)?.blocking && !self.default_stream.idle()? {
            self.default_stream.sync()
        } else {
            Ok(())
        }
    }

    /// Waits for every stream of the context.
    pub fn sync_all(&mut self) -> CuResult {
        let r = self.default_stream.sync();
        r.map_err(|c| self.note(c))?;
        let mut first = Ok(());
        for st in self.streams.values_mut() {
            if let Err(c) = st.sync() {
                first = first.and(Err(c));
            }
        }
        first.map_err(|c| self.note(c))
    }

    /// The allocation holding `len` bytes at `ptr`, and where `ptr` lies in it.
    pub fn find(&self, ptr: u64, len: u64) -> CuResult<crate::allocs::Found<'_>> {
        self.allocs.find(ptr, len)
    }

    /// The module global holding `ptr..ptr+len`, and `ptr`'s offset in it.
    pub fn global_at(&self, ptr: u64, len: u64) -> Option<(GlobalRef, u64)> {
        let (&base, g) = self.globals.range(..=ptr).next_back()?;
        let off = ptr - base;
        let end = off.checked_add(len)?;
        (end <= g.size).then(|| (g.clone(), off))
    }

    /// A free event slot: its index (its GPU address is `event_va(slot)`).
    pub fn take_slot(&mut self) -> CuResult<u32> {
        if self.event_buf.is_none() {
            let b = self
                .ctx
                .alloc_host(u64::from(EVENT_SLOTS) * EVENT_SLOT_BYTES)
                .map_err(|e| from_error(&e))?;
            self.event_buf = Some(b);
            self.free_slots = (0..EVENT_SLOTS).rev().collect();
        }
        self.free_slots.pop().ok_or(CUDA_ERROR_OUT_OF_MEMORY)
    }

    pub fn event_va(&self, slot: u32) -> CuResult<u64> {
        let b = self.event_buf.as_ref().ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        Ok(b.gpu_va() + u64::from(slot) * EVENT_SLOT_BYTES)
    }

    /// The GPU clock (ns) the slot's last release wrote.
    pub fn event_time(&self, slot: u32) -> CuResult<u64> {
        let b = self.event_buf.as_ref().ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        b.read_u64(u64::from(slot) * EVENT_SLOT_BYTES + 8)
            .map_err(|e| from_error(&e))
    }
}

/// The opened device and every object of this process.
pub struct Driver {
    pub device: Device,
    pub info: DeviceInfo,
    pub contexts: HashMap<u64, CtxState>,
    /// The primary context and its retain count.
    pub primary: Option<(u64, u32)>,
    pub modules: HashMap<u64, (u64, Module)>,
    pub functions: HashMap<u64, (u64, Func)>,
    pub events: HashMap<u64, Event>,
    /// The real GPU's device attributes, asked once (empty where the GPU has none).
    pub host_attributes: Option<HashMap<u32, i32>>,
}

impl Driver {
    /// The host GPU's value of attribute `attr`, asking the device the first time.
    pub fn host_attribute(&mut self, attr: u32) -> Option<i32> {
        let device = &self.device;
        self.host_attributes
            .get_or_insert_with(|| match device.transport().device_attributes() {
                Ok(pairs) => pairs.into_iter().collect(),
                Err(e) => {
                    log::info!("the device tells no attributes: {e}");
                    HashMap::new()
                }
            })
            .get(&attr)
            .copied()
    }

    fn open() -> CuResult<Self> {
        let device = open_device()?;
        let info = device.info().clone();
        log::info!(
            "vgpu libcuda: {} device {:?}, {} MiB",
            info.transport,
            info.name,
            info.vram_bytes >> 20
        );
        Ok(Driver {
            device,
            info,
            contexts: HashMap::new(),
            primary: None,
            modules: HashMap::new(),
            functions: HashMap::new(),
            events: HashMap::new(),
            host_attributes: None,
        })
    }

    pub fn ctx(&mut self, id: u64) -> CuResult<&mut CtxState> {
        self.contexts.get_mut(&id).ok_or(CUDA_ERROR_INVALID_CONTEXT)
    }

    /// The calling thread's current context.
    pub fn current(&mut self) -> CuResult<(u64, &mut CtxState)> {
        let id = current_id().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        Ok((id, self.ctx(id)?))
    }

    /// The current context and the event table, borrowed together.
    pub fn current_and_events(
        &mut self,
    ) -> CuResult<(u64, &mut CtxState, &mut HashMap<u64, Event>)> {
        let id = current_id().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        let st = self
            .contexts
            .get_mut(&id)
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        Ok((id, st, &mut self.events))
    }

    /// Ends a context: what lives in it first, then its memory, then the address space.
    pub fn destroy_ctx(&mut self, id: u64) -> CuResult {
        let mut st = self
            .contexts
            .remove(&id)
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        let dead = st.sticky.is_some();
        if !dead {
            if let Err(c) = st.sync_all() {
                log::debug!("destroying a context whose work failed: {c}");
            }
        }
        self.functions.retain(|_, (c, _)| *c != id);
        self.modules.retain(|_, (c, _)| *c != id);
        self.events.retain(|_, e| e.ctx != id);
        drop(st);
        forget_current(id);
        Ok(())
    }
}

/// Opens the device: a loopback VM of our own when `VGPU_LOOPBACK_SOCKET` names a
/// backend's socket (host-side tests), else the guest driver's node (`VGPU_DEVICE`, by
/// default `/dev/vgpu`).
fn open_device() -> CuResult<Device> {
    #[cfg(feature = "loopback")]
    if let Some(sock) = std::env::var_os("VGPU_LOOPBACK_SOCKET") {
        let mib: u64 = std::env::var("VGPU_LOOPBACK_MEM_MIB")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(256);
        return Device::connect_loopback(&sock, mib << 20, std::process::id()).map_err(|e| {
            log::error!("connecting to the backend at {sock:?}: {e}");
            CUDA_ERROR_NO_DEVICE
        });
    }
    let path = std::env::var_os("VGPU_DEVICE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| vgpu_guest::devvgpu::DEFAULT_PATH.into());
    Device::devvgpu(&path).map_err(|e| {
        log::error!("opening {}: {e}", path.display());
        CUDA_ERROR_NO_DEVICE
    })
}

/// Submits every batch still waiting (the flusher's round).
fn flush_batches(d: &mut Driver) {
    for st in d.contexts.values_mut() {
        if st.sticky.is_some() {
            continue;
        }
        for s in std::iter::once(&mut st.default_stream).chain(st.streams.values_mut()) {
            if s.batched > 0 {
                if let Err(c) = s.submit() {
                    log::debug!("flushing a batch: {c}");
                }
            }
        }
    }
}

static FLUSH: (Mutex<bool>, std::sync::Condvar) = (Mutex::new(false), std::sync::Condvar::new());

/// Asks the flusher thread (started on first use) to submit batches in `FLUSH_AFTER`.
fn wake_flusher() {
    static START: Once = Once::new();
    START.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("vgpu-cuda-flush".into())
            .spawn(flusher);
        if let Err(e) = spawned {
            log::warn!("no flusher thread ({e}): batches wait for the next call");
        }
    });
    let (flag, cv) = &FLUSH;
    let mut f = flag.lock().unwrap_or_else(|p| p.into_inner());
    if !*f {
        *f = true;
        cv.notify_one();
    }
}

fn flusher() {
    let (flag, cv) = &FLUSH;
    loop {
        {
            let mut f = flag.lock().unwrap_or_else(|p| p.into_inner());
            while !*f {
                f = cv.wait(f).unwrap_or_else(|p| p.into_inner());
            }
            *f = false;
        }
        std::thread::sleep(FLUSH_AFTER);
        if let Some(d) = lock().as_mut() {
            flush_batches(d);
        }
    }
}

/// The lock, whatever a panicking holder left (each entry point leaves the state whole
/// or returns an error before it changes anything).
fn lock() -> MutexGuard<'static, Option<Driver>> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// `cuInit`: opens the device once.
pub fn init() -> CuResult {
    init_logging();
    let mut g = lock();
    if g.is_none() {
        *g = Some(Driver::open()?);
    }
    Ok(())
}

/// Runs `f` on the initialised driver.
pub fn with<T>(f: impl FnOnce(&mut Driver) -> CuResult<T>) -> CuResult<T> {
    let mut g = lock();
    let d = g.as_mut().ok_or(CUDA_ERROR_NOT_INITIALIZED)?;
    f(d)
}

/// Runs `f` on the current context; a failure that ends the context is remembered.
pub fn with_current<T>(f: impl FnOnce(&mut CtxState) -> CuResult<T>) -> CuResult<T> {
    with(|d| {
        let (_, st) = d.current()?;
        st.alive()?;
        f(st).map_err(|c| st.note(c))
    })
}

pub fn current_id() -> Option<u64> {
    CURRENT.with(|c| c.borrow().last().copied())
}

pub fn set_current(id: Option<u64>) {
    CURRENT.with(|c| {
        let mut c = c.borrow_mut();
        c.pop();
        if let Some(id) = id {
            c.push(id);
        }
    });
}

pub fn push_current(id: u64) {
    CURRENT.with(|c| c.borrow_mut().push(id));
}

pub fn pop_current() -> Option<u64> {
    CURRENT.with(|c| c.borrow_mut().pop())
}

/// Takes a destroyed context off this thread's stack (other threads find it gone).
fn forget_current(id: u64) {
    CURRENT.with(|c| c.borrow_mut().retain(|&x| x != id));
}
