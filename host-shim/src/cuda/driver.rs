//! The real device: the CUDA driver API through `cudarc`'s run-time loaded bindings, and
//! the builtin kernels compiled by NVRTC when the device is opened. Nothing here links
//! against CUDA, so every binary builds and starts on machines without it.

use std::ffi::{c_void, CStr, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use vgpu_protocol::{KernelArgs, SemaphoreMode};

use super::device::{Device, VM_GRANULE};
use super::error::DeviceError;
use super::plan::{Op, RefWrite, Signal};
use crate::clock::now_ns;

const KERNELS_CU: &str = include_str!("kernels.cu");
/// The most parameters of a builtin kernel before its fence signal's three and its prior
/// write's two (`kernels.cu`'s `VGPU_SIGNAL_PARAMS`).
const MAX_PARAMS: usize = 8;
/// Parameters every builtin kernel takes after its own.
const TAIL_PARAMS: usize = 5;

// The sgemm kernel indexes its matrices with 32-bit integers: every element index of an
// m×k, k×n or m×n matrix must fit (kernels.cu).
const _: () = assert!(
    vgpu_protocol::kernel::MAX_DIM as u64 * vgpu_protocol::kernel::MAX_DIM as u64 <= 1 << 32
);

/// What a builtin kernel carries besides its own parameters: its GP entry's fence signal
/// (written as it ends) and the REF write the work before it owes (written as it starts).
#[derive(Clone, Copy, Default)]
struct Tail<'a> {
    signal: Option<&'a Signal>,
    prior: Option<RefWrite>,
}

/// What a builtin launch did with its [`Tail`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Launched {
    /// No kernel ran (an empty matrix or grid): neither write was done.
    Nothing,
    /// The kernel does the prior write, but its grid is too large to signal.
    Unsignalled,
    /// The kernel does both.
    Signalled,
}

/// The names of the kernels in `kernels.cu`, in [`Kern`] order.
const KERNEL_NAMES: [&CStr; 9] = [
    c"vgpu_empty",
    c"vgpu_spin",
    c"vgpu_timestamp",
    c"vgpu_memset",
    c"vgpu_saxpy",
    c"vgpu_sgemm",
    c"vgpu_reduce_sum",
    c"vgpu_checksum",
    c"vgpu_stencil2d",
];

#[derive(Clone, Copy)]
enum Kern {
    Empty,
    Spin,
    Timestamp,
    Memset,
    Saxpy,
    Sgemm,
    Reduce,
    Checksum,
    Stencil,
}

fn check(call: &'static str, r: sys::CUresult) -> Result<(), DeviceError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DeviceError::Driver {
            call,
            code: format!("{r:?}"),
        })
    }
}

/// Numbers the devices a process opens.
static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// The context this thread made current last, and whose device (`CudaDevice::current`).
    static CURRENT: std::cell::Cell<Option<(usize, u64)>> = const { std::cell::Cell::new(None) };
}

/// One CUDA GPU: its primary context, the compiled kernels and the clock offset.
pub struct CudaDevice {
    ctx: sys::CUcontext,
    /// This device among those the process opened (see `current`).
    instance: u64,
    /// The device's ordinal: where physical allocations live and who may access them.
    ordinal: i32,
    name: String,
    /// The attributes guests are told ([`super::attributes::REPORTED`]).
    attrs: Vec<(u32, i32)>,
    total_mem: u64,
    funcs: [sys::CUfunction; 9],
    /// Blocks of 1024 threads that fill every SM (a spin kernel occupies the whole GPU,
    /// as the sim's spin occupies its engine).
    spin_blocks: u32,
    /// GPU clock (%globaltimer) minus host CLOCK_MONOTONIC, so timestamps compare with
    /// the guest's clock readings.
    clock_offset: AtomicU64,
    calibrated_at: AtomicU64,
    /// Grids up to this many blocks carry their entry's fence signal (`CudaConfig`).
    signal_max_blocks: AtomicU64,
    /// The calibration's stream and 8-byte device buffer.
    calib: Mutex<Option<(CudaStream, u64)>>,
    /// The stream of host↔VRAM copies (eviction, swap-in, zeroing), created on first use;
    /// non-blocking, so they wait for no channel's work.
    host_copies: Mutex<Option<CudaStream>>,
    events: EventPool,
    /// Idle streams of dropped channels, for the next channels ([`Device::create_stream`]).
    streams: StreamPool,
    /// The same, of events without timing ([`Device::mark_untimed`]).
    untimed_events: EventPool,
    /// The first sticky error seen: the context is unusable from then on.
    lost: std::sync::OnceLock<String>,
}

// SAFETY: CUDA contexts, functions, streams and events may be used from any thread once
// the context is made current there (every entry point below does so).
unsafe impl Send for CudaDevice {}
// SAFETY: as above; the driver API is thread-safe.
unsafe impl Sync for CudaDevice {}

/// A CUDA stream (non-blocking with respect to the legacy default stream). Dropped idle,
/// it goes back to its device's pool.
pub struct CudaStream(sys::CUstream, StreamPool);

/// A stream handle with nothing queued, not in use.
struct IdleStream(sys::CUstream);
// SAFETY: a stream handle may be used from any thread with its context current.
unsafe impl Send for IdleStream {}

/// Streams not in use, kept for reuse: a channel made per loop (each workload run makes
/// one) then issues its first kernels to a stream the driver has used before, not a new
/// one, and the driver destroys and creates no stream per channel.
type StreamPool = Arc<Mutex<Vec<IdleStream>>>;
// SAFETY: a stream handle may be used from any thread with its context current.
unsafe impl Send for CudaStream {}
// SAFETY: as above.
unsafe impl Sync for CudaStream {}

/// A guest's module, loaded into the device's context.
pub struct CudaModule(sys::CUmodule);
// SAFETY: a module handle may be used from any thread with its context current.
unsafe impl Send for CudaModule {}
// SAFETY: as above; the driver serialises what it must.
unsafe impl Sync for CudaModule {}

/// An event handle not in use.
struct IdleEvent(sys::CUevent);
// SAFETY: an event handle may be used from any thread with its context current.
unsafe impl Send for IdleEvent {}

/// Events not in use, kept for reuse (creating one per GP entry costs a driver call).
type EventPool = Arc<Mutex<Vec<IdleEvent>>>;

/// A recorded CUDA event; it goes back to the pool when dropped.
pub struct CudaMark {
    ev: sys::CUevent,
    pool: EventPool,
    /// Whether the event records a time (one without is cheaper on the GPU).
    timed: bool,
}
// SAFETY: an event handle may be queried from any thread with its context current.
unsafe impl Send for CudaMark {}
// SAFETY: as above.
unsafe impl Sync for CudaMark {}

impl Drop for CudaStream {
    fn drop(&mut self) {
        // Only a stream with nothing left queued is reused: work still on it (a
        // semaphore wait nobody releases) must not hold up its next owner.
        // SAFETY: a live stream handle; the query only reads its state.
        let idle = unsafe { sys::cuStreamQuery(self.0) } == sys::CUresult::CUDA_SUCCESS;
        if idle {
            let mut pool = self.1.lock().unwrap_or_else(|e| e.into_inner());
            if pool.len() < MAX_IDLE_STREAMS {
                pool.push(IdleStream(self.0));
                return;
            }
        }
        // SAFETY: the handle came from cuStreamCreate and is destroyed once (it is not
        // in the pool); work still queued completes before the driver frees it.
        unsafe { sys::cuStreamDestroy_v2(self.0) };
    }
}

/// Idle streams kept at most (more are destroyed).
const MAX_IDLE_STREAMS: usize = 64;

impl Drop for CudaMark {
    fn drop(&mut self) {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < 4096 {
            pool.push(IdleEvent(self.ev));
        } else {
            // SAFETY: the handle came from cuEventCreate and is destroyed once (it is not
            // in the pool).
            unsafe { sys::cuEventDestroy_v2(self.ev) };
        }
    }
}

impl CudaDevice {
    /// Loads the driver and NVRTC, opens GPU `index` and compiles the builtin kernels.
    pub fn open(index: u32) -> Result<Self, DeviceError> {
        // SAFETY: probing whether a shared library loads has no side effects we rely on.
        if !unsafe { sys::is_culib_present() } {
            return Err(DeviceError::NoDriver);
        }
        // SAFETY: as above.
        if !unsafe { nvrtc_sys::is_culib_present() } {
            return Err(DeviceError::NoNvrtc);
        }
        // SAFETY: plain driver calls with valid out-pointers.
        unsafe {
            check("cuInit", sys::cuInit(0))?;
            let mut count = 0;
            check("cuDeviceGetCount", sys::cuDeviceGetCount(&mut count))?;
            if index as i32 >= count {
                return Err(DeviceError::NoDevice(index, count.max(0) as u32));
            }
            let mut dev = 0;
            check("cuDeviceGet", sys::cuDeviceGet(&mut dev, index as i32))?;
            let mut ctx = std::ptr::null_mut();
            check(
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            )?;
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))?;
            let mut buf = [0 as std::ffi::c_char; 128];
            check(
                "cuDeviceGetName",
                sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev),
            )?;
            let name = CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned();
            let mut total = 0usize;
            check(
                "cuDeviceTotalMem",
                sys::cuDeviceTotalMem_v2(&mut total, dev),
            )?;
            let attr = |a| {
                let mut v = 0;
                check(
                    "cuDeviceGetAttribute",
                    sys::cuDeviceGetAttribute(&mut v, a, dev),
                )
                .map(|_| v)
            };
            let major =
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
            let minor =
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
            let sms = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
            let threads =
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)?;
            let spin_blocks = (sms.max(1) * (threads / 1024).max(1)) as u32;
            // What this driver cannot answer is left out, not failed on.
            let attrs = super::attributes::REPORTED
                .iter()
                .filter_map(|a| attr(*a).ok().map(|v| (*a as u32, v)))
                .collect();
            let module = load_kernels(major, minor)?;
            let mut funcs = [std::ptr::null_mut(); 9];
            for (f, name) in funcs.iter_mut().zip(KERNEL_NAMES) {
                check(
                    "cuModuleGetFunction",
                    sys::cuModuleGetFunction(f, module, name.as_ptr()),
                )?;
            }
            let d = CudaDevice {
                ctx,
                instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
                ordinal: index as i32,
                name,
                attrs,
                total_mem: total as u64,
                funcs,
                spin_blocks,
                clock_offset: AtomicU64::new(0),
                calibrated_at: AtomicU64::new(0),
                signal_max_blocks: AtomicU64::new(0),
                calib: Mutex::new(None),
                host_copies: Mutex::new(None),
                events: Arc::new(Mutex::new(Vec::new())),
                streams: Arc::new(Mutex::new(Vec::new())),
                untimed_events: Arc::new(Mutex::new(Vec::new())),
                lost: std::sync::OnceLock::new(),
            };
            d.calibrate_clock()?;
            log::info!(
                "cuda: GPU {index} is {} (sm_{major}{minor}, {} MiB)",
                d.name,
                d.total_mem >> 20
            );
            Ok(d)
        }
    }

    /// Kernels of grids up to `n` blocks write their entry's REF themselves (0: none).
    pub fn set_signal_max_blocks(&self, n: u64) {
        self.signal_max_blocks.store(n, Ordering::Relaxed);
    }

    /// Bytes of device memory.
    pub fn total_mem(&self) -> u64 {
        self.total_mem
    }

    /// Pinned device memory on this GPU, for `cuMemCreate` and access descriptors.
    fn device_location_prop(&self) -> sys::CUmemAllocationProp {
        // SAFETY: a plain C struct for which all-zero bytes are valid (no flags set).
        let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        p.location.id = self.ordinal;
        p
    }

    /// Makes the device's context current on this thread, unless it already is: the
    /// front end asks before every launch and event query, and nothing in the process
    /// makes another context current behind this (one primary context per device, set
    /// only here).
    fn current(&self) -> Result<(), DeviceError> {
        let key = (self.ctx as usize, self.instance);
        if CURRENT.with(|c| c.get()) == Some(key) {
            return Ok(());
        }
        // SAFETY: `ctx` is the retained primary context, valid for the device's life.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })?;
        CURRENT.with(|c| c.set(Some(key)));
        Ok(())
    }

    /// Runs `f` on the host-copy stream and waits for it.
    fn on_copy_stream(
        &self,
        call: &'static str,
        mut f: impl FnMut(sys::CUstream) -> sys::CUresult,
    ) -> Result<(), DeviceError> {
        self.on_copy_stream_n(call, 1, |_, s| f(s))
    }

    /// Queues `f(0..n)` on the host-copy stream (stopping at the first failure) and waits
    /// once for all of it: the copy engine goes from one copy to the next without a round
    /// trip through the host. Everything queued has completed when this returns, error or
    /// not, so no copy is left writing into memory its caller may reuse.
    fn on_copy_stream_n(
        &self,
        call: &'static str,
        n: usize,
        mut f: impl FnMut(usize, sys::CUstream) -> sys::CUresult,
    ) -> Result<(), DeviceError> {
        self.current()?;
        let mut guard = self.host_copies.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            *guard = Some(self.create_stream()?);
        }
        let Some(s) = guard.as_ref() else {
            return Err(DeviceError::Driver {
                call,
                code: "no copy stream".into(),
            });
        };
        let queued = (0..n).try_for_each(|i| check(call, f(i, s.0)));
        // SAFETY: `s` is a live stream.
        let synced = check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(s.0)
        });
        queued.and(synced)
    }

    /// Measures %globaltimer − CLOCK_MONOTONIC from the tightest of several round trips.
    /// The two clocks drift apart by a few µs per second (measured on the H200: ~180 µs
    /// after 30 s), so timestamps re-measure it when it is older than a second.
    fn calibrate_clock(&self) -> Result<(), DeviceError> {
        let mut cal = self.calib.lock().unwrap_or_else(|e| e.into_inner());
        if cal.is_none() {
            *cal = Some((self.create_stream()?, self.alloc_device(8)?));
        }
        let Some((s, dev)) = cal.as_ref() else {
            return Ok(());
        };
        let mut best = (u64::MAX, 0u64);
        for _ in 0..8 {
            let (mut ptr, mut zero) = (*dev, 0u64);
            let mut params = [
                &mut ptr as *mut u64 as *mut c_void,
                &mut zero as *mut u64 as *mut c_void,
            ];
            self.launch(
                s,
                Kern::Timestamp,
                (1, 1),
                (1, 1),
                &mut params,
                Tail::default(),
            )?;
            // The kernel starts after the launch call (CUDA's launch → start exceeds the
            // call's own time: 4.7 against 4.2 µs p50 on the H100, 2026-12-07), so the
            // window is from its return to the synchronize's. Taking it from the call's
            // start put kernel starts up to ~5 µs early on the host's clock (launch
            // calls of 3–6 µs), more than submit → start itself in some runs.
            let t0 = now_ns();
            // SAFETY: `s` is a live stream.
            check("cuStreamSynchronize", unsafe {
                sys::cuStreamSynchronize(s.0)
            })?;
            let t1 = now_ns();
            let mut g = 0u64;
            // SAFETY: `dev` holds the 8 bytes just written; `g` is a valid target.
            check("cuMemcpyDtoH", unsafe {
                sys::cuMemcpyDtoH_v2(&mut g as *mut u64 as *mut c_void, *dev, 8)
            })?;
            if t1 - t0 < best.0 {
                best = (t1 - t0, g.wrapping_sub(t0 + (t1 - t0) / 2));
            }
        }
        self.calibrated_at.store(now_ns(), Ordering::Relaxed);
        // A GPU busy with other streams' kernels delays the probe: keep the old offset
        // rather than take a poor one.
        if best.0 < 100_000 || self.clock_offset.load(Ordering::Relaxed) == 0 {
            self.clock_offset.store(best.1, Ordering::Relaxed);
        }
        log::debug!("cuda: clock offset {:#x} (±{} ns)", best.1, best.0 / 2);
        Ok(())
    }

    /// Launches kernel `k` with `params` and, if given and the grid is small enough, its
    /// fence signal (`kernels.cu`); returns whether the kernel carries the signal.
    fn launch(
        &self,
        s: &CudaStream,
        k: Kern,
        grid: (u32, u32),
        block: (u32, u32),
        params: &mut [*mut c_void],
        tail: Tail<'_>,
    ) -> Result<Launched, DeviceError> {
        let blocks = u64::from(grid.0) * u64::from(grid.1);
        // Larger grids' blocks need not all count themselves done on one word (on the
        // H100 that slowed a 65,536-block stencil by ~50 %, 2026-11-28); their REF is
        // owed, for the next kernel's prior write or a stream write.
        let max = self.signal_max_blocks.load(Ordering::Relaxed);
        let signal = tail.signal.filter(|_| blocks <= max);
        // Every kernel ends with the signal's three parameters and the prior write's
        // two; null: none.
        let (mut ref_ptr, mut value, mut count) =
            signal.map_or((0u64, 0u32, 0u64), |g| (g.ptr, g.value, g.count));
        // Only kernels that do it as they start get a prior write (`issue_op`).
        let (mut prior_ptr, mut prior_value) =
            tail.prior.map_or((0u64, 0u32), |p| (p.ptr, p.value));
        let mut all = [std::ptr::null_mut::<c_void>(); MAX_PARAMS + TAIL_PARAMS];
        let n = params.len();
        if n > MAX_PARAMS {
            return Err(DeviceError::Driver {
                call: "launch",
                code: format!("{n} parameters (at most {MAX_PARAMS})"),
            });
        }
        all[..n].copy_from_slice(params);
        all[n] = &mut ref_ptr as *mut u64 as *mut c_void;
        all[n + 1] = &mut value as *mut u32 as *mut c_void;
        all[n + 2] = &mut count as *mut u64 as *mut c_void;
        all[n + 3] = &mut prior_ptr as *mut u64 as *mut c_void;
        all[n + 4] = &mut prior_value as *mut u32 as *mut c_void;
        // SAFETY: `all` holds one pointer per kernel parameter, each to a live value of
        // the parameter's type (built by the caller from the kernel's signature, then the
        // signal's u32*, u32, u32* and the prior write's u32*, u32), and every pointer
        // argument names memory the planner checked against the context's mappings (REF
        // and the prior REF: the channel's registered control page; the count: the
        // channel's own device word).
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.funcs[k as usize],
                grid.0,
                grid.1,
                1,
                block.0,
                block.1,
                1,
                0,
                s.0,
                all.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?;
        Ok(if signal.is_some() {
            Launched::Signalled
        } else {
            Launched::Unsignalled
        })
    }

    /// A stream write of `value` at `ptr`.
    fn write_value(&self, s: &CudaStream, ptr: u64, value: u32) -> Result<(), DeviceError> {
        // SAFETY: `ptr` names 4 writable bytes checked by the planner.
        check("cuStreamWriteValue32", unsafe {
            sys::cuStreamWriteValue32_v2(
                s.0,
                ptr,
                value,
                sys::CUstreamWriteValue_flags_enum::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        })
    }

    /// Launches a builtin kernel with its [`Tail`]; returns the REF write left owed: the
    /// signal, where the kernel cannot do it (or none ran).
    fn launch_builtin(
        &self,
        s: &CudaStream,
        args: &KernelArgs,
        tail: Tail<'_>,
    ) -> Result<Option<RefWrite>, DeviceError> {
        let owed = tail.signal.map(|g| RefWrite {
            ptr: g.ptr,
            value: g.value,
        });
        match self.launch_args(s, args, tail)? {
            Launched::Signalled => Ok(None),
            Launched::Unsignalled => Ok(owed),
            Launched::Nothing => {
                if let Some(p) = tail.prior {
                    self.write_value(s, p.ptr, p.value)?;
                }
                Ok(owed)
            }
        }
    }

    /// Launches a builtin kernel; says what it did with `tail`.
    fn launch_args(
        &self,
        s: &CudaStream,
        args: &KernelArgs,
        tail: Tail<'_>,
    ) -> Result<Launched, DeviceError> {
        macro_rules! p {
            ($($v:ident),*) => { [$(&mut $v as *mut _ as *mut c_void),*] };
        }
        let blocks = |n: u64| (n.div_ceil(256).clamp(1, 8192)) as u32;
        match *args {
            KernelArgs::Empty => self.launch(s, Kern::Empty, (1, 1), (1, 1), &mut [], tail),
            KernelArgs::Spin { mut ns } => self.launch(
                s,
                Kern::Spin,
                (self.spin_blocks, 1),
                (1024, 1),
                &mut p!(ns),
                tail,
            ),
            KernelArgs::Memset {
                mut dst,
                mut len,
                mut pattern,
            } => {
                let g = blocks(len.div_ceil(4));
                self.launch(
                    s,
                    Kern::Memset,
                    (g, 1),
                    (256, 1),
                    &mut p!(dst, len, pattern),
                    tail,
                )
            }
            KernelArgs::Saxpy {
                mut x,
                mut y,
                mut n,
                mut a,
            } => self.launch(
                s,
                Kern::Saxpy,
                (blocks(n), 1),
                (256, 1),
                &mut p!(x, y, n, a),
                tail,
            ),
            KernelArgs::Sgemm {
                mut a,
                mut b,
                mut c,
                mut m,
                mut n,
                mut k,
                mut alpha,
                mut beta,
            } => {
                if m == 0 || n == 0 {
                    return Ok(Launched::Nothing);
                }
                let grid = (n.div_ceil(64), m.div_ceil(64));
                self.launch(
                    s,
                    Kern::Sgemm,
                    grid,
                    (256, 1),
                    &mut p!(a, b, c, m, n, k, alpha, beta),
                    tail,
                )
            }
            KernelArgs::ReduceSum {
                mut src,
                mut n,
                mut dst,
            } => self.launch(
                s,
                Kern::Reduce,
                (1, 1),
                (1024, 1),
                &mut p!(src, n, dst),
                tail,
            ),
            KernelArgs::Checksum {
                mut src,
                mut len,
                mut dst,
            } => self.launch(
                s,
                Kern::Checksum,
                (1, 1),
                (1024, 1),
                &mut p!(src, len, dst),
                tail,
            ),
            KernelArgs::Stencil2d {
                mut src,
                mut dst,
                mut width,
                mut height,
                mut c_center,
                mut c_neighbor,
            } => {
                if width == 0 || height == 0 {
                    return Ok(Launched::Nothing);
                }
                let grid = (width.div_ceil(32), height.div_ceil(8));
                self.launch(
                    s,
                    Kern::Stencil,
                    grid,
                    (32, 8),
                    &mut p!(src, dst, width, height, c_center, c_neighbor),
                    tail,
                )
            }
            KernelArgs::Memcpy { .. } | KernelArgs::Timestamp { .. } => Err(DeviceError::Driver {
                call: "launch",
                code: "memcpy and timestamp are planned as copies and clock writes".into(),
            }),
        }
    }
}

/// What NVRTC's output is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Image {
    /// Machine code for one GPU (`sm_XY`): loaded as is.
    Cubin,
    /// PTX (`compute_XY`): the driver JIT-compiles it at load.
    Ptx,
}

/// The `--gpu-architecture` values to try, in order: machine code for the device's own
/// architecture, then PTX for it (an NVRTC too old for the GPU's `sm_XY` still JIT-compiles
/// through the driver). `VGPU_NVRTC_ARCH` (e.g. `compute_75`, `sm_90`) names one target
/// instead, for experiments; `sm_…` is machine code, anything else PTX.
fn targets(major: i32, minor: i32, over: Option<&str>) -> Vec<(String, Image)> {
    if let Some(arch) = over.map(str::trim).filter(|a| !a.is_empty()) {
        let kind = if arch.starts_with("sm_") {
            Image::Cubin
        } else {
            Image::Ptx
        };
        return vec![(arch.to_string(), kind)];
    }
    vec![
        (format!("sm_{major}{minor}"), Image::Cubin),
        (format!("compute_{major}{minor}"), Image::Ptx),
    ]
}

/// Compiles `kernels.cu` for the device's architecture and loads it into the current
/// context: a CUBIN where NVRTC can make one the driver takes, else PTX.
fn load_kernels(major: i32, minor: i32) -> Result<sys::CUmodule, DeviceError> {
    let (mut vmaj, mut vmin) = (0, 0);
    // SAFETY: valid out-pointers; NVRTC was found loadable by the caller.
    let r = unsafe { nvrtc_sys::nvrtcVersion(&mut vmaj, &mut vmin) };
    if r == nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        log::info!("cuda: NVRTC {vmaj}.{vmin}");
    }
    // `VGPU_KERNELS_IMAGE` loads a ready image instead (a CUBIN, PTX or fatbin of the same
    // kernels, e.g. nvcc's build of kernels.cu): to compare compilers on one GPU.
    if let Some(path) = experiment_path("VGPU_KERNELS_IMAGE") {
        let mut image =
            std::fs::read(&path).map_err(|e| DeviceError::Compile(format!("{path:?}: {e}")))?;
        image.push(0);
        let mut module = std::ptr::null_mut();
        // SAFETY: `image` is the file's bytes NUL-terminated (harmless after a binary
        // image, required after PTX), alive for the call; valid out-pointer.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void)
        })?;
        log::warn!("cuda: kernels loaded from {path:?}, not compiled");
        return Ok(module);
    }
    let over = std::env::var("VGPU_NVRTC_ARCH").ok();
    let mut last = DeviceError::Compile("no target".into());
    for (arch, kind) in targets(major, minor, over.as_deref()) {
        let loaded = compile_for(&arch, kind).and_then(|image| {
            if let Some(path) = std::env::var_os("VGPU_NVRTC_DUMP") {
                // For inspection (cuobjdump, nvdisasm): the image as loaded.
                if let Err(e) = std::fs::write(&path, &image) {
                    log::warn!("cuda: writing the kernel image to {path:?}: {e}");
                }
            }
            let mut module = std::ptr::null_mut();
            // SAFETY: `image` is a complete CUBIN or NUL-terminated PTX, alive for the call;
            // valid out-pointer; the caller made the context current.
            check("cuModuleLoadData", unsafe {
                sys::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void)
            })?;
            Ok((module, image.len()))
        });
        match loaded {
            Ok((module, len)) => {
                log::info!("cuda: kernels compiled for {arch} ({kind:?}, {len} bytes)");
                return Ok(module);
            }
            Err(e) => {
                log::warn!("cuda: kernels for {arch}: {e}");
                last = e;
            }
        }
    }
    Err(last)
}

/// The path an experiment variable names, in builds with the `kernel-experiments`
/// feature only: a shipped backend runs nothing but the built-in kernels, whose
/// footprints the isolation checks assume.
fn experiment_path(var: &str) -> Option<std::ffi::OsString> {
    if cfg!(feature = "kernel-experiments") {
        std::env::var_os(var)
    } else {
        if std::env::var_os(var).is_some() {
            log::warn!("cuda: {var} ignored (a build without the kernel-experiments feature)");
        }
        None
    }
}

fn compile_for(arch: &str, kind: Image) -> Result<Vec<u8>, DeviceError> {
    // `VGPU_KERNELS_CU` names another source to compile (kernel experiments on a machine
    // without a Rust toolchain); it must define the same kernels with the same signatures.
    let text = match experiment_path("VGPU_KERNELS_CU") {
        Some(path) => {
            log::warn!("cuda: kernels from {path:?} instead of the built-in source");
            std::fs::read_to_string(&path)
                .map_err(|e| DeviceError::Compile(format!("{path:?}: {e}")))?
        }
        None => KERNELS_CU.to_string(),
    };
    let src = CString::new(text).map_err(|e| DeviceError::Compile(e.to_string()))?;
    let prog = nvrtc::create_program(&src, Some(c"vgpu_kernels.cu"))
        .map_err(|e| DeviceError::Compile(format!("{e:?}")))?;
    let arch = format!("--gpu-architecture={arch}");
    // --fmad=false: the results must match the CPU references bit for bit.
    let opts = [arch.as_str(), "--fmad=false", "--std=c++17"];
    // SAFETY: `prog` was just created and is destroyed exactly once below.
    let res = unsafe { nvrtc::compile_program(prog, &opts) };
    // SAFETY: as above.
    let out = unsafe {
        match res {
            Ok(()) => match kind {
                Image::Ptx => nvrtc::get_ptx(prog)
                    .map(|p| p.iter().map(|&c| c as u8).collect::<Vec<u8>>())
                    .map_err(|e| DeviceError::Compile(format!("{e:?}"))),
                Image::Cubin => get_cubin(prog),
            },
            Err(e) => {
                let log = nvrtc::get_program_log(prog)
                    .map(|l| {
                        let bytes: Vec<u8> = l.iter().map(|&c| c as u8).collect();
                        String::from_utf8_lossy(&bytes).into_owned()
                    })
                    .unwrap_or_default();
                Err(DeviceError::Compile(format!("{e:?}: {log}")))
            }
        }
    };
    // SAFETY: `prog` is live and not used afterwards.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    let mut bytes = out?;
    if kind == Image::Ptx && bytes.last() != Some(&0) {
        bytes.push(0);
    }
    if bytes.is_empty() {
        return Err(DeviceError::Compile(format!("{arch}: empty image")));
    }
    Ok(bytes)
}

/// The CUBIN of a compiled program (empty when it was compiled to PTX only).
///
/// # Safety
/// `prog` is a live, successfully compiled program.
unsafe fn get_cubin(prog: nvrtc_sys::nvrtcProgram) -> Result<Vec<u8>, DeviceError> {
    let err =
        |call: &str, r: nvrtc_sys::nvrtcResult| DeviceError::Compile(format!("{call}: {r:?}"));
    let mut size = 0usize;
    // SAFETY: `prog` is live (the caller's promise); valid out-pointer.
    let r = unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(err("nvrtcGetCUBINSize", r));
    }
    let mut buf = vec![0u8; size];
    if size == 0 {
        return Ok(buf);
    }
    // SAFETY: `buf` holds the `size` bytes NVRTC said the CUBIN takes.
    let r = unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(err("nvrtcGetCUBIN", r));
    }
    Ok(buf)
}

impl CudaDevice {
    /// Notes a sticky error (the context is gone) and passes the result on.
    fn note<T>(&self, r: Result<T, DeviceError>) -> Result<T, DeviceError> {
        if let Err(e) = &r {
            if e.is_context_lost() && self.lost.set(e.to_string()).is_ok() {
                log::error!("cuda: the context is lost: {e}");
            }
        }
        r
    }

    fn issue_op(
        &self,
        s: &CudaStream,
        op: &Op,
        prior: Option<RefWrite>,
    ) -> Result<Option<RefWrite>, DeviceError> {
        self.current()?;
        // A builtin kernel does the prior write itself as it starts; before anything
        // else (the stencil among them), a stream write does.
        let prior = match prior {
            Some(p) if !super::device::prior_in_kernel(op) => {
                self.write_value(s, p.ptr, p.value)?;
                None
            }
            p => p,
        };
        match *op {
            Op::Launch(ref args) => {
                log::trace!("cuda: launch {args:?}");
                self.launch_builtin(
                    s,
                    args,
                    Tail {
                        signal: None,
                        prior,
                    },
                )
            }
            Op::LaunchSignal(ref args, ref signal) => {
                log::trace!("cuda: launch {args:?}, then REF {}", signal.value);
                self.launch_builtin(
                    s,
                    args,
                    Tail {
                        signal: Some(signal),
                        prior,
                    },
                )
            }
            // SAFETY: both ranges were checked by the planner (registered host memory or
            // device memory, `len` bytes each).
            Op::Copy { dst, src, len } => check("cuMemcpyAsync", unsafe {
                sys::cuMemcpyAsync(dst, src, len as usize, s.0)
            })
            .map(|()| None),
            Op::Timestamp { ptr } => {
                if now_ns().saturating_sub(self.calibrated_at.load(Ordering::Relaxed))
                    > 1_000_000_000
                {
                    if let Err(e) = self.calibrate_clock() {
                        log::warn!("cuda: clock calibration: {e}");
                    }
                }
                let (mut dst, mut off) = (ptr, self.clock_offset.load(Ordering::Relaxed));
                let mut params = [
                    &mut dst as *mut u64 as *mut c_void,
                    &mut off as *mut u64 as *mut c_void,
                ];
                let tail = Tail {
                    signal: None,
                    prior,
                };
                self.launch(s, Kern::Timestamp, (1, 1), (1, 1), &mut params, tail)
                    .map(|_| None)
            }
            Op::WriteValue { ptr, value } => self.write_value(s, ptr, value).map(|()| None),
            Op::LaunchFunction {
                func,
                grid,
                block,
                shared_mem,
                ref params,
            } => {
                log::trace!("cuda: launch function {func:#x} grid {grid:?} block {block:?}");
                let mut size = params.len();
                let mut extra = [
                    sys::CU_LAUNCH_PARAM_BUFFER_POINTER_AS_INT as usize as *mut c_void,
                    params.as_ptr() as *mut c_void,
                    sys::CU_LAUNCH_PARAM_BUFFER_SIZE_AS_INT as usize as *mut c_void,
                    &mut size as *mut usize as *mut c_void,
                    sys::CU_LAUNCH_PARAM_END_AS_INT as usize as *mut c_void,
                ];
                let extra = if params.is_empty() {
                    std::ptr::null_mut()
                } else {
                    extra.as_mut_ptr()
                };
                // SAFETY: `func` is a function handle of a module loaded in this context
                // (the GPU unloads a module only after its context's channels drained);
                // the parameter buffer lives until the call returns (the driver copies
                // it); a module kernel may touch anything of this context, which holds
                // one VM's memory only (guest modules load only in a VM's worker).
                check("cuLaunchKernel", unsafe {
                    sys::cuLaunchKernel(
                        func as sys::CUfunction,
                        grid[0],
                        grid[1],
                        grid[2],
                        block[0],
                        block[1],
                        block[2],
                        shared_mem,
                        s.0,
                        std::ptr::null_mut(),
                        extra,
                    )
                })
                .map(|()| None)
            }
            Op::WaitValue { ptr, value, mode } => {
                let flags = match mode {
                    SemaphoreMode::Equal => {
                        sys::CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_EQ
                    }
                    // GEQ is the cyclic compare (int32)(*ptr - value) >= 0, as the protocol's.
                    SemaphoreMode::AtLeast => {
                        sys::CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_GEQ
                    }
                };
                // SAFETY: `ptr` names 4 readable bytes checked by the planner.
                check("cuStreamWaitValue32", unsafe {
                    sys::cuStreamWaitValue32_v2(s.0, ptr, value, flags as u32)
                })
                .map(|()| None)
            }
        }
    }

    /// Records an event on `s`, with timing or without (a completion mark).
    fn record(&self, s: &CudaStream, timed: bool) -> Result<CudaMark, DeviceError> {
        self.current()?;
        let pool = if timed {
            &self.events
        } else {
            &self.untimed_events
        };
        let pooled = pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let e = match pooled {
            Some(IdleEvent(e)) => e,
            None => {
                let flags = if timed {
                    sys::CUevent_flags_enum::CU_EVENT_DEFAULT
                } else {
                    sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING
                };
                let mut e = std::ptr::null_mut();
                // SAFETY: valid out-pointer.
                check("cuEventCreate", unsafe {
                    sys::cuEventCreate(&mut e, flags as u32)
                })?;
                e
            }
        };
        let m = CudaMark {
            ev: e,
            pool: pool.clone(),
            timed,
        };
        // SAFETY: `e` is a live event no other mark holds (it came from the pool or was
        // just created); `s` is a live stream. Re-recording a reused event is allowed.
        check("cuEventRecord", unsafe { sys::cuEventRecord(e, s.0) })?;
        Ok(m)
    }

    /// Test-only fault injection: a kernel that writes a wild address, as a faulty or
    /// hostile kernel would (the context is lost once the GPU runs it; every later call
    /// of this process fails).
    pub fn inject_wild_write(&self) -> Result<(), DeviceError> {
        let s = self.create_stream()?;
        let op = Op::Launch(vgpu_protocol::KernelArgs::Memset {
            dst: 0x10,
            pattern: 0,
            len: 1 << 20,
        });
        self.issue(&s, &op, None)?;
        // The fault shows at the next query of the stream: wait for it, so the context
        // is known lost even when no channel has work to notice it.
        let m = self.mark(&s)?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            match self.reached(&m) {
                Ok(false) => std::thread::sleep(std::time::Duration::from_millis(1)),
                // The fault it was meant to cause.
                Err(e) if e.is_context_lost() => return Ok(()),
                Ok(true) => {
                    return Err(DeviceError::Driver {
                        call: "inject_wild_write",
                        code: "the wild write did not fault".into(),
                    })
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl Device for CudaDevice {
    type Stream = CudaStream;
    type Mark = CudaMark;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn attributes(&self) -> Vec<(u32, i32)> {
        self.attrs.clone()
    }

    fn register_host(&self, ptr: *mut u8, len: usize) -> Result<(), DeviceError> {
        self.current()?;
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: the caller guarantees `ptr..ptr+len` is mapped host memory that stays
        // mapped until it unregisters it.
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(ptr as *mut c_void, len, flags)
        })
    }

    fn unregister_host(&self, ptr: *mut u8) -> Result<(), DeviceError> {
        self.current()?;
        // SAFETY: `ptr` is the start of a range this device registered.
        check("cuMemHostUnregister", unsafe {
            sys::cuMemHostUnregister(ptr as *mut c_void)
        })
    }

    fn alloc_device(&self, len: u64) -> Result<u64, DeviceError> {
        self.current()?;
        let mut p = 0;
        // SAFETY: valid out-pointer.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut p, len.max(1) as usize)
        })?;
        Ok(p)
    }

    fn free_device(&self, ptr: u64) {
        if self.current().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc and no queued work uses it any more
            // (callers free scratch only after draining the stream that used it).
            unsafe { sys::cuMemFree_v2(ptr) };
        }
    }

    fn create_physical(&self, len: u64) -> Result<u64, DeviceError> {
        self.current()?;
        let mut h = 0;
        // SAFETY: a valid out-pointer and a fully initialised property block.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut h, len as usize, &self.device_location_prop(), 0)
        })?;
        Ok(h)
    }

    fn release_physical(&self, handle: u64) {
        if self.current().is_ok() {
            // SAFETY: `handle` came from cuMemCreate; mappings keep the memory alive.
            unsafe { sys::cuMemRelease(handle) };
        }
    }

    fn reserve_va(&self, hint: u64, len: u64) -> Result<u64, DeviceError> {
        self.current()?;
        let mut p = 0;
        // SAFETY: a valid out-pointer; the hint is only a wish.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut p, len as usize, VM_GRANULE as usize, hint, 0)
        })?;
        Ok(p)
    }

    fn free_va(&self, ptr: u64, len: u64) {
        if self.current().is_ok() {
            // SAFETY: a whole reservation of `reserve_va` with nothing mapped in it.
            unsafe { sys::cuMemAddressFree(ptr, len as usize) };
        }
    }

    fn map_physical(
        &self,
        ptr: u64,
        len: u64,
        handle: u64,
        writable: bool,
    ) -> Result<(), DeviceError> {
        self.current()?;
        // SAFETY: `ptr..ptr+len` lies in a reservation and maps nothing yet; `handle` is
        // `len` bytes of physical memory.
        check("cuMemMap", unsafe {
            sys::cuMemMap(ptr, len as usize, 0, handle, 0)
        })?;
        let access = sys::CUmemAccessDesc {
            location: self.device_location_prop().location,
            flags: if writable {
                sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            } else {
                sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ
            },
        };
        // SAFETY: the range was just mapped; one valid descriptor.
        let r = check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, len as usize, &access, 1)
        });
        if r.is_err() {
            // SAFETY: the mapping made above, with nothing using it yet.
            unsafe { sys::cuMemUnmap(ptr, len as usize) };
        }
        r
    }

    fn unmap_va(&self, ptr: u64, len: u64) -> Result<(), DeviceError> {
        self.current()?;
        // SAFETY: whole mappings of `map_physical`; the caller drained work using them.
        check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, len as usize) })
    }

    unsafe fn copy_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<(), DeviceError> {
        // SAFETY: the caller names `len` bytes of device memory at `src` and `len` writable
        // host bytes at `dst`; the copy is complete when `on_copy_stream` returns.
        self.on_copy_stream("cuMemcpyDtoHAsync", |s| unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, len, s)
        })
    }

    unsafe fn copy_from_host(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), DeviceError> {
        // SAFETY: as in `copy_to_host`, the other way round.
        self.on_copy_stream("cuMemcpyHtoDAsync", |s| unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, s)
        })
    }

    unsafe fn copy_to_host_many(
        &self,
        copies: &[(*mut u8, u64, usize)],
    ) -> Result<(), DeviceError> {
        self.on_copy_stream_n("cuMemcpyDtoHAsync", copies.len(), |i, s| {
            let (dst, src, len) = copies[i];
            // SAFETY: as in `copy_to_host`, for each copy; all are complete when
            // `on_copy_stream_n` returns.
            unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, len, s) }
        })
    }

    unsafe fn copy_from_host_many(
        &self,
        copies: &[(u64, *const u8, usize)],
    ) -> Result<(), DeviceError> {
        self.on_copy_stream_n("cuMemcpyHtoDAsync", copies.len(), |i, s| {
            let (dst, src, len) = copies[i];
            // SAFETY: as in `copy_from_host`, for each copy; all are complete when
            // `on_copy_stream_n` returns.
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, s) }
        })
    }

    fn zero_device(&self, dst: u64, len: usize) -> Result<(), DeviceError> {
        // SAFETY: the caller names `len` bytes of device memory at `dst`.
        self.on_copy_stream("cuMemsetD8Async", |s| unsafe {
            sys::cuMemsetD8Async(dst, 0, len, s)
        })
    }

    fn create_stream(&self) -> Result<CudaStream, DeviceError> {
        self.current()?;
        let idle = self.streams.lock().unwrap_or_else(|e| e.into_inner()).pop();
        if let Some(IdleStream(s)) = idle {
            return Ok(CudaStream(s, self.streams.clone()));
        }
        let mut s = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(
                &mut s,
                sys::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as u32,
            )
        })?;
        Ok(CudaStream(s, self.streams.clone()))
    }

    fn issue(
        &self,
        s: &CudaStream,
        op: &Op,
        prior: Option<RefWrite>,
    ) -> Result<Option<RefWrite>, DeviceError> {
        let r = self.issue_op(s, op, prior);
        self.note(r)
    }

    fn lost(&self) -> Option<String> {
        self.lost.get().cloned()
    }

    fn mark(&self, s: &CudaStream) -> Result<CudaMark, DeviceError> {
        self.record(s, true)
    }

    fn mark_untimed(&self, s: &CudaStream) -> Result<CudaMark, DeviceError> {
        self.record(s, false)
    }

    fn reached(&self, m: &CudaMark) -> Result<bool, DeviceError> {
        self.current()?;
        // SAFETY: `m` is a live, recorded event.
        match unsafe { sys::cuEventQuery(m.ev) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => self.note(check("cuEventQuery", r).map(|_| false)),
        }
    }

    type Module = CudaModule;

    fn module_load(&self, image: &[u8]) -> Result<CudaModule, DeviceError> {
        self.current()?;
        // PTX must end in a NUL; a cubin or fatbin does not mind one after its end.
        let mut owned = Vec::with_capacity(image.len() + 1);
        owned.extend_from_slice(image);
        owned.push(0);
        let mut m = std::ptr::null_mut();
        // SAFETY: `owned` is a complete image buffer the driver reads during the call
        // only; the driver validates its contents (a bad image is an error, not UB, for
        // PTX, cubin and fatbin alike).
        let r = check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut m, owned.as_ptr() as *const c_void)
        });
        self.note(r).map(|()| CudaModule(m))
    }

    fn module_unload(&self, m: CudaModule) -> Result<(), DeviceError> {
        self.current()?;
        // SAFETY: a loaded module, unloaded once (it is moved in).
        self.note(check("cuModuleUnload", unsafe { sys::cuModuleUnload(m.0) }))
    }

    fn module_function(
        &self,
        m: &CudaModule,
        name: &CStr,
    ) -> Result<(u64, Option<Vec<vgpu_protocol::module::ParamInfo>>), DeviceError> {
        self.current()?;
        let mut f = std::ptr::null_mut();
        // SAFETY: a loaded module and a NUL-terminated name; `f` is an out-pointer.
        check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut f, m.0, name.as_ptr())
        })?;
        Ok((f as u64, param_info(f)))
    }

    fn module_global(&self, m: &CudaModule, name: &CStr) -> Result<(u64, u64), DeviceError> {
        self.current()?;
        let (mut addr, mut size) = (0, 0usize);
        // SAFETY: a loaded module, a NUL-terminated name, two out-pointers.
        check("cuModuleGetGlobal", unsafe {
            sys::cuModuleGetGlobal_v2(&mut addr, &mut size, m.0, name.as_ptr())
        })?;
        Ok((addr, size as u64))
    }

    fn elapsed_ns(&self, from: &CudaMark, to: &CudaMark) -> Option<u64> {
        if !(from.timed && to.timed) {
            return None;
        }
        self.current().ok()?;
        let mut ms = 0f32;
        // SAFETY: both events are live and recorded with timing enabled.
        let r = unsafe { sys::cuEventElapsedTime_v2(&mut ms, from.ev, to.ev) };
        (r == sys::CUresult::CUDA_SUCCESS).then(|| (f64::from(ms.max(0.0)) * 1e6) as u64)
    }
}

/// A function's parameter layout from `cuFuncGetParamInfo` (CUDA 12.4+), or `None` when
/// the driver lacks the call or cannot say (the guest then sizes the buffer itself).
fn param_info(f: sys::CUfunction) -> Option<Vec<vgpu_protocol::module::ParamInfo>> {
    use vgpu_protocol::module::{ParamInfo, MAX_FUNCTION_PARAMS};
    // SAFETY: looking a symbol up in the loaded driver library has no side effects; the
    // binding below panics on a missing symbol, so it is called only when present.
    let present = unsafe { sys::culib().get::<*const c_void>(b"cuFuncGetParamInfo\0") }.is_ok();
    if !present {
        return None;
    }
    let mut params = Vec::new();
    // One more than the reply can carry, so a longer list is seen as such.
    for i in 0..=MAX_FUNCTION_PARAMS {
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: a valid function handle and two out-pointers; an index past the last
        // parameter is answered with CUDA_ERROR_INVALID_VALUE.
        let r = unsafe { sys::cuFuncGetParamInfo(f, i, &mut offset, &mut size) };
        match r {
            sys::CUresult::CUDA_SUCCESS => params.push(ParamInfo {
                offset: u32::try_from(offset).ok()?,
                size: u32::try_from(size).ok()?,
            }),
            sys::CUresult::CUDA_ERROR_INVALID_VALUE => return Some(params),
            _ => return None,
        }
    }
    Some(params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn machine_code_first_then_ptx() {
        assert_eq!(
            targets(9, 0, None),
            vec![
                ("sm_90".to_string(), Image::Cubin),
                ("compute_90".to_string(), Image::Ptx)
            ]
        );
        assert_eq!(targets(8, 6, Some(" ")), targets(8, 6, None));
    }

    #[test]
    fn an_override_names_one_target() {
        assert_eq!(
            targets(9, 0, Some("compute_75")),
            vec![("compute_75".to_string(), Image::Ptx)]
        );
        assert_eq!(
            targets(9, 0, Some("sm_90a")),
            vec![("sm_90a".to_string(), Image::Cubin)]
        );
    }
}
