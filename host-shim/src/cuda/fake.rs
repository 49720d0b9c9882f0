//! A CPU stand-in for the CUDA device, for GPU-free tests of the whole `cuda` GPU: every
//! stream is a thread that runs its operations in order on host memory (device pointers
//! are host pointers, as with unified addressing), kernels are the sim's own kernels, and
//! semaphore waits block the stream, not the front end. A mark recorded on an idle stream
//! is reached at once, as a GPU's event there completes. Guest modules: a few test kernels
//! picked by name from a PTX text (`fake_modules`; a test device, not a GPU).

use std::collections::{HashMap, VecDeque};
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use vgpu_protocol::module::ParamInfo;

use super::device::Device;
use super::error::DeviceError;
use super::fake_modules::{self, FakeLaunch, TestKernel, TEST_GLOBAL};
use super::plan::{Op, RefWrite};

/// The fake device's attributes: an H100 SXM's figures for a few that programs size
/// their work by (compute capability, SMs, limits), so the guest path has values to carry.
pub const FAKE_ATTRIBUTES: &[(u32, i32)] = &[
    (1, 1024),      // MAX_THREADS_PER_BLOCK
    (8, 49152),     // MAX_SHARED_MEMORY_PER_BLOCK
    (10, 32),       // WARP_SIZE
    (12, 65536),    // MAX_REGISTERS_PER_BLOCK
    (16, 132),      // MULTIPROCESSOR_COUNT
    (38, 52428800), // L2_CACHE_SIZE
    (39, 2048),     // MAX_THREADS_PER_MULTIPROCESSOR
    (75, 9),        // COMPUTE_CAPABILITY_MAJOR
    (76, 0),        // COMPUTE_CAPABILITY_MINOR
    (97, 232448),   // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
];
use crate::clock::now_ns;
use crate::kernels::{run_kernel, KernelMemory, MemFault};

/// Host memory addressed by raw pointers. The planner checked every range against the
/// issuing context's mappings before it reached a stream.
struct RawMemory;

impl KernelMemory for RawMemory {
    fn read(&mut self, va: u64, buf: &mut [u8]) -> Result<(), MemFault> {
        // SAFETY: `va..va+len` lies in memory the planner translated for this operand.
        unsafe { std::ptr::copy(va as *const u8, buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }
    fn write(&mut self, va: u64, buf: &[u8]) -> Result<(), MemFault> {
        // SAFETY: as in `read`, for a writable operand.
        unsafe { std::ptr::copy(buf.as_ptr(), va as *mut u8, buf.len()) };
        Ok(())
    }
}

/// Operations a fake stream has been asked to do, for tests that check issue order.
#[derive(Default)]
pub struct FakeLog {
    pub ops: Mutex<Vec<Op>>,
    /// Marks recorded without timing ([`Device::mark_untimed`]).
    pub untimed_marks: AtomicU64,
    /// Prior REF writes done by the op issued behind them (a builtin kernel as it
    /// starts), not by a stream write of their own.
    pub kernel_prior_writes: AtomicU64,
}

/// What a stream runs: an op, or a module function resolved when it was issued, with the
/// device memory (start, length) it may touch.
#[derive(Clone)]
enum Work {
    Op(Op),
    Function(FakeLaunch, Arc<[(u64, u64)]>),
}

/// Queued items: sequence number, the work (None for a mark) and, for a mark, where to
/// record the time it was reached.
type Item = (u64, Option<Work>, Option<Arc<AtomicU64>>);

struct Queue {
    ops: VecDeque<Item>,
}

struct StreamShared {
    q: Mutex<Queue>,
    cv: Condvar,
    issued: AtomicU64,
    done: AtomicU64,
    stop: AtomicBool,
    /// The device's poison flag: a module kernel's wild pointer sets it.
    poison: Arc<AtomicBool>,
}

/// A fake stream: a worker thread and its queue.
pub struct FakeStream {
    sh: Arc<StreamShared>,
    worker: Option<JoinHandle<()>>,
}

impl Drop for FakeStream {
    fn drop(&mut self) {
        // Set under the queue's lock: the worker checks `stop` under it just before it
        // waits, so a wake-up sent between its check and its wait cannot be lost.
        let q = self.sh.q.lock().unwrap_or_else(|e| e.into_inner());
        self.sh.stop.store(true, Ordering::Release);
        drop(q);
        self.sh.cv.notify_all();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// A point in a fake stream, with the clock reading the stream took when it got there.
pub struct FakeMark {
    sh: Arc<StreamShared>,
    seq: u64,
    at: Arc<AtomicU64>,
    /// Whether it records a time ([`Device::mark_untimed`]: none).
    timed: bool,
}

/// The fake device.
#[derive(Default)]
pub struct FakeDevice {
    pub log: FakeLog,
    /// Device memory handed out (VRAM and staging), freed by `free_device`.
    scratch: Mutex<Vec<Vec<u8>>>,
    pub registered: Mutex<Vec<(usize, usize)>>,
    /// Set by [`FakeDevice::poison`]: every later stream call fails as after a GPU fault.
    poisoned: Arc<AtomicBool>,
    /// Loaded modules: their globals (name, address, size) and function handles.
    modules: Mutex<HashMap<u64, FakeModule>>,
    /// Function handles: the test kernel behind each (None: not one the fake runs) and
    /// its module's test global.
    functions: Mutex<HashMap<u64, FakeFunction>>,
    next_handle: AtomicU64,
    /// Physical allocations, reservations and mappings (the VMM API).
    vmm: super::fake_vmm::FakeVmm,
    /// Which kernels write their fence signal themselves ([`FakeSignals`], as u8).
    kernel_signals: std::sync::atomic::AtomicU8,
}

/// Which of the fake's kernels write their fence signal themselves; the others leave
/// their REF write owed ([`Device::issue`]), as a real GPU's grids over the signal's
/// block limit do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FakeSignals {
    /// Every kernel (the default).
    All = 0,
    /// None.
    None = 1,
    /// The empty kernel only: the real GPU's default, where only one-block grids signal.
    OneBlock = 2,
}

struct FakeModule {
    ptx: fake_modules::PtxModule,
    globals: Vec<(String, u64, u64)>,
    functions: Vec<u64>,
}

#[derive(Clone, Copy)]
struct FakeFunction {
    kernel: Option<TestKernel>,
    global: Option<(u64, u64)>,
}

impl FakeDevice {
    /// Where the device memory handed out and not yet freed starts (VRAM chunks are
    /// physical allocations, not in here).
    pub fn device_allocations(&self) -> Vec<u64> {
        let bufs = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        bufs.iter().map(|b| b.as_ptr() as u64).collect()
    }

    /// Which kernels write their fence signal themselves from now on.
    pub fn set_kernel_signals(&self, which: FakeSignals) {
        self.kernel_signals.store(which as u8, Ordering::Relaxed);
    }

    /// Whether the kernel `args` writes its fence signal itself.
    fn signals(&self, args: &vgpu_protocol::KernelArgs) -> bool {
        match self.kernel_signals.load(Ordering::Relaxed) {
            x if x == FakeSignals::None as u8 => false,
            x if x == FakeSignals::OneBlock as u8 => {
                matches!(args, vgpu_protocol::KernelArgs::Empty)
            }
            _ => true,
        }
    }

    /// A mark at the stream's tail, with a time or without.
    fn record(&self, s: &FakeStream, timed: bool) -> Result<FakeMark, DeviceError> {
        self.check_poison()?;
        let at = Arc::new(AtomicU64::new(0));
        let mut q = s.sh.q.lock().unwrap_or_else(|e| e.into_inner());
        let seq = s.sh.issued.fetch_add(1, Ordering::AcqRel) + 1;
        if q.ops.is_empty() {
            // An idle stream: everything issued before has run (the worker takes an op
            // off the queue only once it ran). A GPU's event there completes at once,
            // where the worker would reach the mark only after a thread wake-up, which
            // on a loaded machine is milliseconds late: the timeline's calibrations and
            // an idle stream's batch would be mapped that late.
            at.store(now_ns(), Ordering::Release);
            s.sh.done.fetch_max(seq, Ordering::AcqRel);
        } else {
            q.ops.push_back((seq, None, Some(at.clone())));
            drop(q);
            s.sh.cv.notify_all();
        }
        Ok(FakeMark {
            sh: s.sh.clone(),
            seq,
            at,
            timed,
        })
    }

    /// Acts out a kernel that faulted the GPU (a wild write): the context is lost, and
    /// every later issue, mark and query fails with the driver's sticky error.
    pub fn poison(&self) {
        self.poisoned.store(true, Ordering::Release);
    }

    fn check_poison(&self) -> Result<(), DeviceError> {
        if self.poisoned.load(Ordering::Acquire) {
            return Err(DeviceError::Driver {
                call: "fake",
                code: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
            });
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The driver's answer for a symbol a module lacks.
fn not_found() -> DeviceError {
    DeviceError::Driver {
        call: "fake cuModuleGetFunction",
        code: "CUDA_ERROR_NOT_FOUND".into(),
    }
}

impl FakeDevice {
    /// A launch of function handle `func`, ready for a stream; an entry the fake does
    /// not implement is refused here, as a driver refuses a launch it cannot do.
    fn resolve(
        &self,
        func: u64,
        grid: [u32; 3],
        block: [u32; 3],
        params: &Arc<[u8]>,
    ) -> Result<FakeLaunch, DeviceError> {
        let f = *lock(&self.functions).get(&func).ok_or(DeviceError::Fake(
            "launch of a function handle never handed out",
        ))?;
        if f.kernel.is_none() {
            return Err(fake_modules::unsupported());
        }
        let threads = grid
            .iter()
            .chain(&block)
            .fold(1u64, |n, &d| n.saturating_mul(d.into()));
        Ok(FakeLaunch {
            kernel: f.kernel,
            params: params.clone(),
            threads,
            global: f.global,
        })
    }

    /// Every piece of memory a kernel of the fake may touch: device allocations (VRAM,
    /// staging, globals) and registered host memory.
    fn memory(&self) -> Arc<[(u64, u64)]> {
        let mut m: Vec<(u64, u64)> = lock(&self.scratch)
            .iter()
            .map(|b| (b.as_ptr() as u64, b.len() as u64))
            .collect();
        m.extend(self.vmm.mapped());
        m.extend(
            lock(&self.registered)
                .iter()
                .map(|&(p, l)| (p as u64, l as u64)),
        );
        m.into()
    }
}

fn run_op(op: &Op) {
    match *op {
        // Resolved into `Work::Function` at issue.
        Op::LaunchFunction { .. } => {}
        Op::Launch(args) => run_launch(args),
        Op::LaunchSignal(args, signal) => {
            run_launch(args);
            // The kernel's last block writes REF once every block is done.
            write_value(signal.ptr, signal.value);
        }
        // SAFETY: both ranges were checked by the planner and do not overlap.
        Op::Copy { dst, src, len } => unsafe {
            std::ptr::copy(src as *const u8, dst as *mut u8, len as usize)
        },
        Op::Timestamp { ptr } => {
            // SAFETY: `ptr` names 8 writable bytes checked by the planner.
            unsafe { std::ptr::write_unaligned(ptr as *mut u64, now_ns()) }
        }
        Op::WriteValue { ptr, value } => write_value(ptr, value),
        Op::WaitValue { .. } => {}
    }
}

/// A stream write of a 32-bit value.
fn write_value(ptr: u64, value: u32) {
    // SAFETY: 4 writable bytes, checked by the planner; semaphores are 4-byte aligned in
    // practice and an atomic keeps a concurrent waiter from tearing.
    let a = unsafe { &*(ptr as *const std::sync::atomic::AtomicU32) };
    a.store(value, Ordering::Release);
}

fn run_launch(args: vgpu_protocol::KernelArgs) {
    if let vgpu_protocol::KernelArgs::Spin { ns } = args {
        let end = now_ns() + ns;
        while now_ns() < end {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
        return;
    }
    let abort = AtomicBool::new(false);
    if let Err(e) = run_kernel(&args, &mut RawMemory, &abort, &now_ns) {
        log::warn!("fake device: kernel failed: {e}");
    }
}

fn worker(sh: Arc<StreamShared>) {
    loop {
        let next = {
            let mut q = sh.q.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if sh.stop.load(Ordering::Acquire) {
                    return;
                }
                if let Some(front) = q.ops.front().cloned() {
                    break front;
                }
                q = sh.cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        let (seq, op, at) = next;
        if sh.poison.load(Ordering::Acquire) {
            // A faulted context runs nothing more, as a real stream stops at the fault:
            // nothing after the faulting kernel (a REF write, say) lands.
            sh.q.lock()
                .unwrap_or_else(|e| e.into_inner())
                .ops
                .pop_front();
            continue;
        }
        if let Some(at) = at {
            at.store(now_ns(), Ordering::Release);
        }
        if let Some(Work::Op(Op::WaitValue { ptr, value, mode })) = op {
            // SAFETY: 4 readable bytes, checked by the planner.
            let a = unsafe { &*(ptr as *const std::sync::atomic::AtomicU32) };
            while !mode.satisfied(a.load(Ordering::Acquire), value) {
                if sh.stop.load(Ordering::Acquire) {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        } else if let Some(Work::Op(op)) = op {
            run_op(&op);
        } else if let Some(Work::Function(l, mem)) = op {
            let reachable = |p: u64, n: u64| {
                mem.iter()
                    .any(|&(s, len)| p >= s && p.saturating_add(n) <= s + len)
            };
            if let Err(at) = fake_modules::run(&l, &reachable) {
                log::warn!("fake device: a module kernel touched {at:#x}: illegal address");
                sh.poison.store(true, Ordering::Release);
            }
        }
        sh.q.lock()
            .unwrap_or_else(|e| e.into_inner())
            .ops
            .pop_front();
        // A mark recorded on the emptied queue may already have moved `done` past `seq`.
        sh.done.fetch_max(seq, Ordering::AcqRel);
    }
}

impl Device for FakeDevice {
    type Stream = FakeStream;
    type Mark = FakeMark;

    fn name(&self) -> String {
        "fake".into()
    }

    fn attributes(&self) -> Vec<(u32, i32)> {
        FAKE_ATTRIBUTES.to_vec()
    }

    fn register_host(&self, ptr: *mut u8, len: usize) -> Result<(), DeviceError> {
        self.registered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((ptr as usize, len));
        Ok(())
    }

    fn unregister_host(&self, ptr: *mut u8) -> Result<(), DeviceError> {
        let mut r = self.registered.lock().unwrap_or_else(|e| e.into_inner());
        let before = r.len();
        r.retain(|&(p, _)| p != ptr as usize);
        if r.len() == before {
            return Err(DeviceError::Fake("unregistering memory never registered"));
        }
        Ok(())
    }

    fn alloc_device(&self, len: u64) -> Result<u64, DeviceError> {
        let buf = vec![0u8; len.max(1) as usize];
        let p = buf.as_ptr() as u64;
        self.scratch
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(buf);
        Ok(p)
    }

    fn free_device(&self, ptr: u64) {
        self.scratch
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|b| b.as_ptr() as u64 != ptr);
    }

    fn create_physical(&self, len: u64) -> Result<u64, DeviceError> {
        self.vmm.create_physical(len)
    }

    fn release_physical(&self, handle: u64) {
        self.vmm.release_physical(handle)
    }

    fn reserve_va(&self, hint: u64, len: u64) -> Result<u64, DeviceError> {
        self.vmm.reserve_va(hint, len)
    }

    fn free_va(&self, ptr: u64, len: u64) {
        self.vmm.free_va(ptr, len)
    }

    fn map_physical(
        &self,
        ptr: u64,
        len: u64,
        handle: u64,
        writable: bool,
    ) -> Result<(), DeviceError> {
        self.vmm.map_physical(ptr, len, handle, writable)
    }

    fn unmap_va(&self, ptr: u64, len: u64) -> Result<(), DeviceError> {
        self.vmm.unmap_va(ptr, len)
    }

    unsafe fn copy_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<(), DeviceError> {
        // SAFETY: the caller names `len` bytes of device memory (host memory here) at `src`
        // and `len` writable host bytes at `dst`.
        unsafe { std::ptr::copy(src as *const u8, dst, len) };
        Ok(())
    }

    unsafe fn copy_from_host(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), DeviceError> {
        // SAFETY: as in `copy_to_host`, the other way round.
        unsafe { std::ptr::copy(src, dst as *mut u8, len) };
        Ok(())
    }

    fn zero_device(&self, dst: u64, len: usize) -> Result<(), DeviceError> {
        // SAFETY: the caller names `len` bytes of device memory at `dst`.
        unsafe { std::ptr::write_bytes(dst as *mut u8, 0, len) };
        Ok(())
    }

    fn create_stream(&self) -> Result<FakeStream, DeviceError> {
        let sh = Arc::new(StreamShared {
            q: Mutex::new(Queue {
                ops: VecDeque::new(),
            }),
            cv: Condvar::new(),
            issued: AtomicU64::new(0),
            done: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            poison: self.poisoned.clone(),
        });
        let s = sh.clone();
        let worker = std::thread::Builder::new()
            .name("fake-stream".into())
            .spawn(move || worker(s))
            .map_err(|_| DeviceError::Fake("cannot start a stream thread"))?;
        Ok(FakeStream {
            sh,
            worker: Some(worker),
        })
    }

    fn issue(
        &self,
        s: &FakeStream,
        op: &Op,
        prior: Option<RefWrite>,
    ) -> Result<Option<RefWrite>, DeviceError> {
        self.check_poison()?;
        // The stream runs one item after another, so the prior write as an item of its
        // own before `op` is what a kernel doing it as it starts amounts to.
        let mut owed = None;
        let work = match op {
            Op::LaunchFunction {
                func,
                grid,
                block,
                params,
                ..
            } => Work::Function(self.resolve(*func, *grid, *block, params)?, self.memory()),
            Op::LaunchSignal(args, signal) if !self.signals(args) => {
                owed = Some(RefWrite {
                    ptr: signal.ptr,
                    value: signal.value,
                });
                Work::Op(Op::Launch(*args))
            }
            op => Work::Op(op.clone()),
        };
        {
            let mut log = self.log.ops.lock().unwrap_or_else(|e| e.into_inner());
            // What the real device puts in the stream for a prior write the op cannot do.
            match prior {
                Some(p) if !self.does_prior(op) => log.push(Op::WriteValue {
                    ptr: p.ptr,
                    value: p.value,
                }),
                Some(_) => {
                    self.log.kernel_prior_writes.fetch_add(1, Ordering::Relaxed);
                }
                None => {}
            }
            log.push(op.clone());
        }
        let mut q = s.sh.q.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = prior {
            let seq = s.sh.issued.fetch_add(1, Ordering::AcqRel) + 1;
            let write = Op::WriteValue {
                ptr: p.ptr,
                value: p.value,
            };
            q.ops.push_back((seq, Some(Work::Op(write)), None));
        }
        let seq = s.sh.issued.fetch_add(1, Ordering::AcqRel) + 1;
        q.ops.push_back((seq, Some(work), None));
        drop(q);
        s.sh.cv.notify_all();
        Ok(owed)
    }

    fn mark(&self, s: &FakeStream) -> Result<FakeMark, DeviceError> {
        self.record(s, true)
    }

    fn mark_untimed(&self, s: &FakeStream) -> Result<FakeMark, DeviceError> {
        self.log.untimed_marks.fetch_add(1, Ordering::Relaxed);
        self.record(s, false)
    }

    fn reached(&self, m: &FakeMark) -> Result<bool, DeviceError> {
        self.check_poison()?;
        Ok(m.sh.done.load(Ordering::Acquire) >= m.seq)
    }

    fn lost(&self) -> Option<String> {
        self.check_poison().err().map(|e| e.to_string())
    }

    type Module = u64;

    fn module_load(&self, image: &[u8]) -> Result<u64, DeviceError> {
        self.check_poison()?;
        let ptx = fake_modules::parse_ptx(image).ok_or(DeviceError::Driver {
            call: "fake cuModuleLoadData",
            code: "CUDA_ERROR_INVALID_IMAGE".into(),
        })?;
        let mut globals = Vec::new();
        for g in &ptx.globals {
            let addr = self.alloc_device(g.size)?;
            globals.push((g.name.clone(), addr, g.size));
        }
        let id = self.next_handle.fetch_add(1, Ordering::Relaxed) + 1;
        lock(&self.modules).insert(
            id,
            FakeModule {
                ptx,
                globals,
                functions: Vec::new(),
            },
        );
        Ok(id)
    }

    fn module_unload(&self, m: u64) -> Result<(), DeviceError> {
        let module = lock(&self.modules)
            .remove(&m)
            .ok_or(DeviceError::Fake("unloading a module never loaded"))?;
        let mut f = lock(&self.functions);
        for h in module.functions {
            f.remove(&h);
        }
        drop(f);
        for (_, addr, _) in module.globals {
            self.free_device(addr);
        }
        Ok(())
    }

    fn module_function(
        &self,
        m: &u64,
        name: &CStr,
    ) -> Result<(u64, Option<Vec<ParamInfo>>), DeviceError> {
        let mut modules = lock(&self.modules);
        let module = modules
            .get_mut(m)
            .ok_or(DeviceError::Fake("no such module"))?;
        let name = name.to_str().map_err(|_| not_found())?;
        let entry = module
            .ptx
            .entries
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(not_found)?;
        let function = FakeFunction {
            kernel: fake_modules::test_kernel(entry),
            global: module
                .globals
                .iter()
                .find(|g| g.0 == TEST_GLOBAL)
                .map(|g| (g.1, g.2)),
        };
        let params = entry.params.clone();
        let h = self.next_handle.fetch_add(1, Ordering::Relaxed) + 1;
        module.functions.push(h);
        lock(&self.functions).insert(h, function);
        Ok((h, Some(params)))
    }

    fn module_global(&self, m: &u64, name: &CStr) -> Result<(u64, u64), DeviceError> {
        let modules = lock(&self.modules);
        let module = modules.get(m).ok_or(DeviceError::Fake("no such module"))?;
        let name = name.to_str().map_err(|_| not_found())?;
        module
            .globals
            .iter()
            .find(|g| g.0 == name)
            .map(|g| (g.1, g.2))
            .ok_or_else(not_found)
    }

    fn elapsed_ns(&self, from: &FakeMark, to: &FakeMark) -> Option<u64> {
        if !(from.timed && to.timed) {
            return None;
        }
        let (a, b) = (
            from.at.load(Ordering::Acquire),
            to.at.load(Ordering::Acquire),
        );
        (a != 0 && b != 0).then(|| b.saturating_sub(a))
    }
}
