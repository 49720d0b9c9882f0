//! Raw test harness: drives the sim through the HAL and a mapped control page, exactly as
//! a guest would (GP entries and push buffers written to memory, GP_PUT stored).

#![allow(dead_code)]

pub mod cuda_cases;
pub mod kernels;
pub mod module_cases;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vgpu_host_shim::*;
use vgpu_protocol::method::encode_all;
use vgpu_protocol::{ControlPage, ErrorCode, GpEntry, KernelArgs, KernelId, Method};

/// System memory of a test "process": one zeroed memfd at a fixed bus address (a file, so
/// a GPU in a worker process can map it too, as it maps guest RAM).
pub struct TestSysMem {
    pub base: u64,
    mem: shared_mem::SharedMem,
}

impl TestSysMem {
    pub fn new(base: u64, len: usize) -> Self {
        TestSysMem {
            base,
            mem: shared_mem::SharedMem::new("test-sysmem", len as u64).unwrap(),
        }
    }
    pub fn ptr(&self, addr: u64) -> *mut u8 {
        assert!(addr >= self.base && addr < self.base + self.mem.len());
        self.mem.range_ptr(addr - self.base, 1).unwrap()
    }
    pub fn write(&self, addr: u64, b: &[u8]) {
        assert!(self.mem.write(addr - self.base, b), "write out of bounds");
    }
    pub fn read(&self, addr: u64, b: &mut [u8]) {
        assert!(self.mem.read(addr - self.base, b), "read out of bounds");
    }
}

impl SysMemory for TestSysMem {
    fn translate(&self, addr: u64, len: u64) -> Option<HostRange> {
        let end = self.base + self.mem.len();
        if addr < self.base || addr >= end {
            return None;
        }
        Some(HostRange {
            ptr: self.ptr(addr),
            len: (len.min(end - addr)) as usize,
        })
    }

    fn regions(&self) -> Vec<SysRegion> {
        vec![SysRegion {
            addr: self.base,
            len: self.mem.len(),
            fd: self.mem.fd(),
            fd_offset: 0,
        }]
    }
}

/// Collects events.
#[derive(Default)]
pub struct Events(pub Mutex<Vec<GpuEvent>>);

impl EventSink for Events {
    fn event(&self, ev: GpuEvent) {
        self.0.lock().unwrap().push(ev);
    }
}

/// A mapped control page.
pub struct CtrlMap {
    ptr: *mut u8,
}

// SAFETY: shared memory mapping, accessed through atomics only.
unsafe impl Send for CtrlMap {}
// SAFETY: see Send.
unsafe impl Sync for CtrlMap {}

impl CtrlMap {
    pub fn new(r: FdRange) -> Self {
        // SAFETY: mapping a page of a memfd the GPU owns; checked for failure.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                r.len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                r.fd,
                r.offset as libc::off_t,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        CtrlMap { ptr: p.cast() }
    }
    pub fn field(&self, off: usize) -> &AtomicU32 {
        // SAFETY: `off` is a control-page field offset inside the mapped page, 4-aligned.
        unsafe { &*(self.ptr.add(off) as *const AtomicU32) }
    }
    pub fn load(&self, off: usize) -> u32 {
        self.field(off).load(Ordering::Acquire)
    }
    pub fn store(&self, off: usize, v: u32) {
        self.field(off).store(v, Ordering::Release)
    }
}

impl Drop for CtrlMap {
    fn drop(&mut self) {
        // SAFETY: unmapping the page mapped in `new`.
        unsafe { libc::munmap(self.ptr.cast(), 4096) };
    }
}

/// Where the harness puts things in each context's address space.
pub const SYS_BASE: u64 = 0x4000_0000;
pub const SYS_VA: u64 = 0x10_0000_0000;
pub const SYS_LEN: usize = 8 << 20;
pub const RING_OFF: u64 = 0;
pub const PB_OFF: u64 = 0x10_0000;
pub const ARGS_OFF: u64 = 0x20_0000;
/// Free for test data (offset from SYS_VA).
pub const DATA_OFF: u64 = 0x40_0000;
pub const ENTRIES: u32 = 64;
/// Bytes of a channel's push-buffer area per ring slot: its 16 KiB piece holds one for
/// each of the `ENTRIES` slots.
const PB_SLOT: u64 = 0x100;
const _: () = assert!(ENTRIES as u64 * PB_SLOT <= 0x4000);

/// A context with its system memory mapped at SYS_VA, and channels on it.
pub struct Proc<G: Gpu + ?Sized = SimGpu> {
    pub gpu: Arc<G>,
    pub ctx: ContextId,
    pub sys: Arc<TestSysMem>,
}

impl<G: Gpu + ?Sized> Proc<G> {
    pub fn new(gpu: &Arc<G>, base: u64) -> Self {
        let sys = Arc::new(TestSysMem::new(base, SYS_LEN));
        let ctx = gpu.create_context(sys.clone()).unwrap();
        gpu.map(
            ctx,
            SYS_VA,
            SYS_LEN as u64,
            MapTarget::Sysram { addr: base },
            PageSize::Big64K,
            MapFlags::default(),
        )
        .unwrap();
        Proc {
            gpu: gpu.clone(),
            ctx,
            sys,
        }
    }

    /// Writes `bytes` at SYS_VA + off.
    pub fn poke(&self, off: u64, bytes: &[u8]) {
        self.sys.write(self.sys.base + off, bytes);
    }

    pub fn peek(&self, off: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.sys.read(self.sys.base + off, &mut v);
        v
    }

    /// A channel whose ring, push buffers and args live in this process's memory; each
    /// channel gets its own 256 KiB piece of the ring/pb/args areas.
    pub fn channel(&self, index: u64) -> Chan
    where
        G: 'static,
    {
        let events = Arc::new(Events::default());
        let ring_off = RING_OFF + index * 0x4000;
        let id = self
            .gpu
            .create_channel(
                self.ctx,
                ChannelConfig {
                    gp_ring_va: SYS_VA + ring_off,
                    gp_entries: ENTRIES,
                },
                events.clone(),
            )
            .unwrap();
        let ctrl = CtrlMap::new(self.gpu.control_page(id).unwrap());
        let gpu = self.gpu.clone();
        Chan {
            id,
            ctrl,
            bell: Arc::new(move || gpu.doorbell(id)),
            events,
            sys: self.sys.clone(),
            ring_off,
            pb_off: PB_OFF + index * 0x4000,
            args_off: ARGS_OFF + index * 0x4000,
            put: 0,
            args_cursor: 0,
        }
    }
}

pub struct Chan {
    pub id: ChannelId,
    pub ctrl: CtrlMap,
    /// Rings the GPU's doorbell for this channel.
    bell: Arc<dyn Fn() + Send + Sync>,
    pub events: Arc<Events>,
    sys: Arc<TestSysMem>,
    ring_off: u64,
    pb_off: u64,
    args_off: u64,
    pub put: u32,
    args_cursor: u64,
}

impl Chan {
    /// Stores kernel args in the args area; returns their VA.
    pub fn args(&mut self, a: &KernelArgs) -> u64 {
        let bytes = a.encode();
        let off = self.args_off + (self.args_cursor % 0x3f00);
        self.args_cursor += 64;
        self.sys.write(self.sys.base + off, &bytes);
        SYS_VA + off
    }

    pub fn launch(&mut self, a: &KernelArgs) -> Method {
        let va = self.args(a);
        Method::Launch {
            kernel: a.kernel(),
            grid: [1, 1, 1],
            args_va: va,
            args_len: KernelArgs::encoded_len(a.kernel()) as u32,
        }
    }

    /// Where the push buffer of the next entry goes: the slot of its ring slot, so a
    /// push buffer is reused only when its ring slot is (the space checks of `submit_words`
    /// and `stage` cover both).
    fn pb_slot(&self) -> u64 {
        self.pb_off + u64::from(self.put % ENTRIES) * PB_SLOT
    }

    /// Writes raw push-buffer words and one GP entry for them, then stores GP_PUT.
    pub fn submit_words(&mut self, words: &[u32]) {
        // Wait for ring space (never overwrite unexecuted entries).
        while self.put.wrapping_sub(self.ctrl.load(ControlPage::GP_GET)) >= ENTRIES - 1 {
            std::thread::yield_now();
        }
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let off = self.pb_slot();
        assert!(bytes.len() <= PB_SLOT as usize);
        self.sys.write(self.sys.base + off, &bytes);
        let e = GpEntry::new(SYS_VA + off, words.len() as u32).unwrap();
        self.write_entry(&e.encode());
    }

    /// Writes a raw 16-byte entry into the next ring slot and publishes it.
    pub fn write_entry(&mut self, raw: &[u8; 16]) {
        self.stage_entry(raw);
        self.publish();
    }

    /// Stores GP_PUT and rings the doorbell if the front end sleeps, as a guest does.
    pub fn publish(&self) {
        self.ctrl.store(ControlPage::GP_PUT, self.put);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if self.ctrl.load(ControlPage::WANT_DOORBELL) != 0 {
            (self.bell)();
        }
    }

    /// Writes a raw entry into the next ring slot without storing GP_PUT.
    pub fn stage_entry(&mut self, raw: &[u8; 16]) {
        let slot = (self.put % ENTRIES) as u64;
        self.sys
            .write(self.sys.base + self.ring_off + slot * 16, raw);
        self.put = self.put.wrapping_add(1);
    }

    /// Writes a push buffer and its entry without storing GP_PUT.
    pub fn stage(&mut self, methods: &[Method]) {
        let words = encode_all(methods);
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        assert!(
            self.put.wrapping_sub(self.ctrl.load(ControlPage::GP_GET)) < ENTRIES,
            "staging over an entry not yet executed"
        );
        let off = self.pb_slot();
        assert!(bytes.len() <= PB_SLOT as usize);
        self.sys.write(self.sys.base + off, &bytes);
        let e = GpEntry::new(SYS_VA + off, words.len() as u32).unwrap();
        self.stage_entry(&e.encode());
    }

    pub fn submit(&mut self, methods: &[Method]) {
        self.submit_words(&encode_all(methods));
    }

    /// Waits until every submitted entry completed; Err on channel error or timeout.
    pub fn wait_idle(&self, timeout: Duration) -> Result<(), ErrorCode> {
        let t0 = Instant::now();
        loop {
            let err = self.ctrl.load(ControlPage::ERROR);
            if err != 0 {
                return Err(ErrorCode::from_u32(err).unwrap_or(ErrorCode::Internal));
            }
            if self.ctrl.load(ControlPage::GP_GET) == self.put {
                return Ok(());
            }
            if t0.elapsed() > timeout {
                return Err(ErrorCode::Busy);
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// The channel's counters once they show `completed` GP entries (at once on an
/// in-process GPU; a GPU in a worker process publishes them within a millisecond or so,
/// longer on a loaded machine: up to 10 s).
pub fn counters_after<G: Gpu + ?Sized + 'static>(
    gpu: &G,
    ch: ChannelId,
    completed: u64,
) -> ChannelCounters {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let c = gpu.channel_counters(ch).unwrap();
        if c.gp_completed >= completed || Instant::now() > deadline {
            return c;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The channel's error once it has one (at once on an in-process GPU; a GPU in a worker
/// process publishes it within a millisecond or so), or `None` after 10 s.
pub fn error_after<G: Gpu + ?Sized + 'static>(gpu: &G, ch: ChannelId) -> Option<(ErrorCode, u64)> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let e = gpu.channel_error(ch).unwrap();
        if e.is_some() || Instant::now() > deadline {
            return e;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub fn spin(ns: u64) -> KernelArgs {
    KernelArgs::Spin { ns }
}

pub fn gpu() -> Arc<SimGpu> {
    SimGpu::new(SimConfig {
        vram_bytes: 64 << 20,
        ..Default::default()
    })
    .unwrap()
}

pub const _K: KernelId = KernelId::Empty;
