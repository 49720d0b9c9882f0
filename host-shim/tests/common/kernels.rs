//! Every builtin kernel on one GPU, checked against the CPU reference (shared by the sim
//! and cuda test targets).

use std::time::Duration;

use super::{Chan, Proc, DATA_OFF};
use vgpu_host_shim::kernels::reference;
use vgpu_host_shim::*;
use vgpu_protocol::kernel::{fnv1a64, FNV_OFFSET};
use vgpu_protocol::KernelArgs;

pub const T: Duration = Duration::from_secs(20);

pub fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn from_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn data(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// Memory the kernels work on: either the process's system memory or a VRAM buffer,
/// reached at `va` in both cases.
pub struct Mem<'a, G: Gpu + ?Sized> {
    pub p: &'a Proc<G>,
    pub vram: Option<u64>,
    pub va: u64,
}

impl<G: Gpu + ?Sized> Mem<'_, G> {
    fn put(&self, off: u64, b: &[u8]) {
        match self.vram {
            Some(base) => self.p.gpu.vram_write(base + off, b).unwrap(),
            None => self.p.poke(DATA_OFF + off, b),
        }
    }
    fn get(&self, off: u64, len: usize) -> Vec<u8> {
        match self.vram {
            Some(base) => {
                let mut v = vec![0; len];
                self.p.gpu.vram_read(base + off, &mut v).unwrap();
                v
            }
            None => self.p.peek(DATA_OFF + off, len),
        }
    }
    fn at(&self, off: u64) -> u64 {
        self.va + off
    }
}

pub fn run_all<G: Gpu + ?Sized + 'static>(mem: &Mem<G>, ch: &mut Chan) {
    let go = |ch: &mut Chan, a: KernelArgs| {
        let m = ch.launch(&a);
        ch.submit(&[m]);
        ch.wait_idle(T).unwrap();
    };
    // memset
    go(
        ch,
        KernelArgs::Memset {
            dst: mem.at(0),
            len: 4096 + 12,
            pattern: 0xdead_beef,
        },
    );
    let got = mem.get(0, 4096 + 16);
    assert!(got[..4108]
        .chunks(4)
        .all(|c| c == 0xdead_beefu32.to_le_bytes()));
    assert_eq!(&got[4108..], &[0; 4]);
    // memcpy
    let src: Vec<u8> = (0..70_000u32).map(|i| (i * 7 % 251) as u8).collect();
    mem.put(0x1_0000, &src);
    go(
        ch,
        KernelArgs::Memcpy {
            dst: mem.at(0x3_0000),
            src: mem.at(0x1_0000),
            len: src.len() as u64,
        },
    );
    assert_eq!(mem.get(0x3_0000, src.len()), src);
    // saxpy
    let (x, y) = (data(5000, 1), data(5000, 2));
    mem.put(0, &f32s(&x));
    mem.put(0x8000, &f32s(&y));
    go(
        ch,
        KernelArgs::Saxpy {
            x: mem.at(0),
            y: mem.at(0x8000),
            n: 5000,
            a: 1.5,
        },
    );
    let mut want = y.clone();
    reference::saxpy(1.5, &x, &mut want);
    assert_eq!(from_f32s(&mem.get(0x8000, 20_000)), want);
    // sgemm
    let (m, n, k) = (33usize, 17usize, 29usize);
    let (a, b, c) = (data(m * k, 3), data(k * n, 4), data(m * n, 5));
    mem.put(0, &f32s(&a));
    mem.put(0x2000, &f32s(&b));
    mem.put(0x4000, &f32s(&c));
    go(
        ch,
        KernelArgs::Sgemm {
            a: mem.at(0),
            b: mem.at(0x2000),
            c: mem.at(0x4000),
            m: m as u32,
            n: n as u32,
            k: k as u32,
            alpha: 0.5,
            beta: -1.0,
        },
    );
    let mut want = c.clone();
    reference::sgemm(m, n, k, 0.5, &a, &b, -1.0, &mut want);
    assert_eq!(from_f32s(&mem.get(0x4000, m * n * 4)), want);
    // reduction
    let x = data(10_001, 6);
    mem.put(0, &f32s(&x));
    go(
        ch,
        KernelArgs::ReduceSum {
            src: mem.at(0),
            n: 10_001,
            dst: mem.at(0xa000),
        },
    );
    assert_eq!(from_f32s(&mem.get(0xa000, 4))[0], reference::reduce_sum(&x));
    // checksum
    go(
        ch,
        KernelArgs::Checksum {
            src: mem.at(0x1_0000),
            len: src.len() as u64,
            dst: mem.at(0xb000),
        },
    );
    let sum = u64::from_le_bytes(mem.get(0xb000, 8).try_into().unwrap());
    assert_eq!(sum, reference::checksum(&src));
    assert_eq!(sum, fnv1a64(&src, FNV_OFFSET));
    // stencil
    let (w, h) = (37usize, 23usize);
    let g = data(w * h, 7);
    mem.put(0, &f32s(&g));
    go(
        ch,
        KernelArgs::Stencil2d {
            src: mem.at(0),
            dst: mem.at(0x4000),
            width: w as u32,
            height: h as u32,
            c_center: 0.6,
            c_neighbor: 0.1,
        },
    );
    let mut want = vec![0f32; w * h];
    reference::stencil2d(w, h, 0.6, 0.1, &g, &mut want);
    assert_eq!(from_f32s(&mem.get(0x4000, w * h * 4)), want);
    // timestamp
    let before = clock::now_ns();
    go(
        ch,
        KernelArgs::Timestamp {
            dst: mem.at(0xc000),
        },
    );
    let ts = u64::from_le_bytes(mem.get(0xc000, 8).try_into().unwrap());
    assert!(ts >= before && ts <= clock::now_ns());
    // spin: occupies the engine for at least its length
    let t0 = std::time::Instant::now();
    go(ch, KernelArgs::Spin { ns: 3_000_000 });
    assert!(t0.elapsed() >= Duration::from_millis(3));
    let counters = ch_counters(mem.p, ch);
    assert_eq!(counters.kernels, 9);
    assert!(counters.busy_ns >= 3_000_000);
}

pub fn ch_counters<G: Gpu + ?Sized + 'static>(p: &Proc<G>, ch: &Chan) -> ChannelCounters {
    super::counters_after(&*p.gpu, ch.id, u64::from(ch.put))
}
