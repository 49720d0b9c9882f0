//! The sim GPU's PFIFO fed arbitrary GP rings and push buffers: the fuzzer's bytes become
//! a process's memory (GP ring at its start, push buffers, kernel arguments and data after
//! it) and GP_PUT; a channel of a fresh context runs them on the real `SimGpu` for at most
//! `DEADLINE`. It must never panic, only ever fault its own channel with a guest error
//! (`BadGpEntry`, `BadMethod`, `BadKernelArgs`, `MmuFault`; `ModulesNeedCudaGpu` for a
//! module function's launch, which the sim refuses), and never touch memory
//! outside the channel's address space: guard bytes around the process's memory, a
//! read-only mapping, and another context's system memory and VRAM (mapped at the same
//! VAs) must come out unchanged.
//!
//! Input: `[entries, ring_slot, put: u16, memory image..]`. The ring has
//! `2 << (entries % 6)` entries at `SYS_VA - 2 KiB + 16 * ring_slot` (below 128 partly
//! unmapped), and GP_PUT is stored once, before the PFIFO is woken; the image fills the
//! process's memory from `SYS_VA`. Mapped: `SYS_VA..+RW_LEN` read-write system memory,
//! `RO_VA..+64 KiB` read-only system memory, `VRAM_VA..+64 KiB` VRAM, all in small
//! numbers so that fuzzed addresses land in them.
#![no_main]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use vgpu_host_shim::{
    ChannelConfig, ContextId, EventSink, Gpu, GpuEvent, HostRange, MapFlags, MapTarget, PageSize,
    SimConfig, SimGpu, SysMemory,
};
use vgpu_protocol::{ControlPage, ErrorCode};

const BUS: u64 = 0x1000_0000;
const SYS_VA: u64 = 0x1_0000;
const RW_LEN: u64 = 0x3_0000;
const RO_VA: u64 = 0x5_0000;
const VRAM_VA: u64 = 0x8_0000;
const PIECE: u64 = 0x1_0000;
const GUARD: usize = 4096;
const MEM_LEN: usize = (RW_LEN + PIECE) as usize;
/// A channel gets this long; then it is destroyed (a spin, a semaphore that never comes).
const DEADLINE: Duration = Duration::from_millis(20);
const GUARD_BYTE: u8 = 0xa5;

/// A process's memory with guard bytes on both sides that the translation never exposes.
struct GuardedMem {
    buf: Box<[u8]>,
}

// SAFETY: the buffer lives as long as the struct; the GPU writes it through raw pointers
// from its threads (as it does guest RAM), and the harness reads it only after the
// context is destroyed.
unsafe impl Send for GuardedMem {}
// SAFETY: see Send.
unsafe impl Sync for GuardedMem {}

impl GuardedMem {
    fn new(image: &[u8]) -> Self {
        let mut buf = vec![GUARD_BYTE; GUARD + MEM_LEN + GUARD].into_boxed_slice();
        let n = image.len().min(MEM_LEN);
        buf[GUARD..GUARD + n].copy_from_slice(&image[..n]);
        buf[GUARD + n..GUARD + MEM_LEN].fill(0);
        GuardedMem { buf }
    }
    fn mem(&self) -> &[u8] {
        &self.buf[GUARD..GUARD + MEM_LEN]
    }
    fn guards_intact(&self) -> bool {
        let (lo, hi) = (&self.buf[..GUARD], &self.buf[GUARD + MEM_LEN..]);
        lo.iter().chain(hi).all(|&b| b == GUARD_BYTE)
    }
}

impl SysMemory for GuardedMem {
    fn translate(&self, addr: u64, len: u64) -> Option<HostRange> {
        let off = addr.checked_sub(BUS)?;
        if off >= MEM_LEN as u64 || len == 0 {
            return None;
        }
        let n = len.min(MEM_LEN as u64 - off) as usize;
        // SAFETY: `GUARD + off < GUARD + MEM_LEN <= buf.len()`.
        let ptr = unsafe { (self.buf.as_ptr() as *mut u8).add(GUARD + off as usize) };
        Some(HostRange { ptr, len: n })
    }
}

struct NoEvents;
impl EventSink for NoEvents {
    fn event(&self, _: GpuEvent) {}
}

/// Another VM's context with the same VAs mapped to its own memory and VRAM, filled with
/// a pattern nothing may change.
struct Bystander {
    mem: Arc<GuardedMem>,
    vram: u64,
    pattern: Vec<u8>,
}

struct Rig {
    gpu: Arc<SimGpu>,
    /// Every control page, mapped once (they share one memfd).
    pages: (usize, usize),
    bystander: Bystander,
}

fn map_sys(gpu: &SimGpu, ctx: ContextId) {
    let map = |va, len, addr, read_only| {
        gpu.map(
            ctx,
            va,
            len,
            MapTarget::Sysram { addr },
            PageSize::Big64K,
            MapFlags { read_only },
        )
        .expect("map system memory")
    };
    map(SYS_VA, RW_LEN, BUS, false);
    map(RO_VA, PIECE, BUS + RW_LEN, true);
}

fn map_vram(gpu: &SimGpu, ctx: ContextId, offset: u64) {
    gpu.map(
        ctx,
        VRAM_VA,
        PIECE,
        MapTarget::Vram { offset },
        PageSize::Big64K,
        MapFlags::default(),
    )
    .expect("map VRAM");
}

fn rig() -> &'static Rig {
    static RIG: OnceLock<Rig> = OnceLock::new();
    RIG.get_or_init(|| {
        let gpu = SimGpu::new(SimConfig {
            vram_bytes: 8 << 20,
            max_channels: 8,
            max_contexts: 8,
            busy_poll_ns: 20_000,
            min_idle_sleep_ns: 1_000,
            max_idle_sleep_ns: 20_000,
            ..SimConfig::default()
        })
        .expect("sim GPU");
        let pattern: Vec<u8> = (0..MEM_LEN).map(|i| (i * 7 % 251) as u8).collect();
        let mem = Arc::new(GuardedMem::new(&pattern));
        let ctx = gpu.create_context(mem.clone()).expect("bystander context");
        map_sys(&gpu, ctx);
        let vram = gpu.alloc_vram(PIECE, PIECE).expect("bystander VRAM").offset;
        gpu.vram_write(vram, &pattern[..PIECE as usize])
            .expect("bystander VRAM write");
        map_vram(&gpu, ctx, vram);
        let fd = control_pages_fd(&gpu);
        // SAFETY: fstat on a valid fd the GPU owns, into a zeroed stat buffer.
        let size = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            assert_eq!(libc::fstat(fd, &mut st), 0);
            st.st_size as usize
        };
        // SAFETY: a fresh shared mapping of the whole control-page memfd, checked below;
        // it lives as long as the process (the rig is never dropped).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        Rig {
            gpu,
            pages: (ptr as usize, size),
            bystander: Bystander { mem, vram, pattern },
        }
    })
}

/// The control pages' memfd (the same for every channel), learnt from a channel made and
/// destroyed for the purpose.
fn control_pages_fd(gpu: &Arc<SimGpu>) -> std::os::fd::RawFd {
    let ctx = gpu
        .create_context(Arc::new(GuardedMem::new(&[])))
        .expect("context");
    let ch = gpu
        .create_channel(
            ctx,
            ChannelConfig {
                gp_ring_va: SYS_VA,
                gp_entries: 2,
            },
            Arc::new(NoEvents),
        )
        .expect("channel");
    let fd = gpu.control_page(ch).expect("control page").fd;
    gpu.destroy_context(ctx).expect("destroy context");
    fd
}

/// A field of the control page at byte offset `at` of the memfd.
fn field(rig: &Rig, at: u64) -> &AtomicU32 {
    let (base, size) = rig.pages;
    assert!(at as usize + 4 <= size && at % 4 == 0);
    // SAFETY: inside the mapping (checked), 4-byte aligned, mapped for the process's life.
    unsafe { &*((base + at as usize) as *const AtomicU32) }
}

fuzz_target!(|data: &[u8]| {
    let [entries, slot, p0, p1, image @ ..] = data else {
        return;
    };
    let rig = rig();
    let gpu = &rig.gpu;
    let mem = Arc::new(GuardedMem::new(image));
    let read_only_before = mem.mem()[RW_LEN as usize..].to_vec();
    let ctx = gpu.create_context(mem.clone()).expect("context");
    map_sys(gpu, ctx);
    let vram = gpu.alloc_vram(PIECE, PIECE).expect("VRAM").offset;
    gpu.vram_write(vram, &vec![0u8; PIECE as usize])
        .expect("zero VRAM");
    map_vram(gpu, ctx, vram);
    let ch = gpu
        .create_channel(
            ctx,
            ChannelConfig {
                gp_ring_va: SYS_VA - 0x800 + 16 * u64::from(*slot),
                gp_entries: 2 << (entries % 6),
            },
            Arc::new(NoEvents),
        )
        .expect("channel");
    let page = gpu.control_page(ch).expect("control page").offset;
    let put = u32::from(u16::from_le_bytes([*p0, *p1]));
    field(rig, page + ControlPage::GP_PUT as u64).store(put, Ordering::Release);
    gpu.doorbell(ch);
    let t0 = Instant::now();
    while t0.elapsed() < DEADLINE
        && field(rig, page + ControlPage::ERROR as u64).load(Ordering::Acquire) == 0
        && field(rig, page + ControlPage::GP_GET as u64).load(Ordering::Acquire) != put
    {
        std::thread::yield_now();
    }
    let error = gpu.channel_error(ch).expect("channel error");
    gpu.destroy_channel(ch).expect("destroy channel");
    // After this no engine touches the context's memory.
    gpu.destroy_context(ctx).expect("destroy context");
    gpu.free_vram(vram).expect("free VRAM");
    if let Some((code, _)) = error {
        assert!(
            matches!(
                code,
                ErrorCode::BadGpEntry
                    | ErrorCode::BadMethod
                    | ErrorCode::BadKernelArgs
                    | ErrorCode::MmuFault
                    // A module function's launch: the sim runs builtin kernels only.
                    | ErrorCode::ModulesNeedCudaGpu
            ),
            "channel fault {code:?} is not a guest error"
        );
    }
    assert!(mem.guards_intact(), "a write outside the context's memory");
    assert!(
        mem.mem()[RW_LEN as usize..] == read_only_before[..],
        "a write through a read-only mapping"
    );
    let b = &rig.bystander;
    assert!(
        b.mem.guards_intact() && b.mem.mem() == &b.pattern[..],
        "another context's memory changed"
    );
    let mut back = vec![0u8; PIECE as usize];
    gpu.vram_read(b.vram, &mut back)
        .expect("bystander VRAM read");
    assert!(
        back == b.pattern[..PIECE as usize],
        "another context's VRAM changed"
    );
});
