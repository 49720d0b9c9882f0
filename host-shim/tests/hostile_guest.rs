//! Guest-writable memory is read once: a hostile guest rewrites its GP ring, push buffers,
//! kernel arguments and GP_PUT from another thread while the PFIFO decodes and runs them.
//! Nothing but that channel's own fault may result: no panic, no hang, no write outside
//! its address space, and a well-behaved channel of another VM beside it computes
//! bit-exact results the whole time.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::kernels::{data, f32s, from_f32s};
use common::*;
use vgpu_host_shim::kernels::reference;
use vgpu_host_shim::*;
use vgpu_protocol::method::encode_all;
use vgpu_protocol::{ControlPage, ErrorCode, GpEntry, KernelArgs, Method, SemaphoreMode};

/// How long the hostile guest keeps mutating (`VGPU_HOSTILE_SECS` overrides).
fn mutation_time() -> Duration {
    let secs = std::env::var("VGPU_HOSTILE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    Duration::from_secs_f64(secs)
}

/// A hostile channel stuck this long (a semaphore that never comes, a long spin) is
/// destroyed and created again.
const STUCK: Duration = Duration::from_millis(50);
/// The well-behaved channel's work must finish within this (no hang).
const VICTIM_WAIT: Duration = Duration::from_secs(20);
const VRAM_VA: u64 = 0x30_0000_0000;

/// The hostile channel's areas in its process's memory (offsets from SYS_VA): the ring of
/// `Proc::channel(0)`, push buffers, kernel arguments, and data its valid work touches.
const RING: (u64, u64) = (RING_OFF, ENTRIES as u64 * 16);
const PB: (u64, u64) = (PB_OFF, 0x4000);
const ARGS: (u64, u64) = (ARGS_OFF, 0x4000);
const HDATA: u64 = DATA_OFF;
/// Push-buffer slots of the hostile submitter (each at most 1 KiB = 256 words).
const PB_SLOT: u64 = 0x400;

/// xorshift64*: deterministic per seed, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Valid work of the hostile guest (before the mutator gets at it): kernels, copies and
/// semaphores inside its own data area, padded with NOPs so push buffers take a while to
/// fetch.
fn hostile_methods(rng: &mut Rng, args: &mut dyn FnMut(&KernelArgs) -> u64) -> Vec<Method> {
    let mut out = Vec::new();
    let va = |rng: &mut Rng| SYS_VA + HDATA + rng.below(0x1_0000) * 4;
    for _ in 0..1 + rng.below(5) {
        let m = match rng.below(8) {
            0 => {
                let a = KernelArgs::Memset {
                    dst: va(rng),
                    len: rng.below(4096),
                    pattern: rng.next() as u32,
                };
                launch(&a, args(&a))
            }
            1 => {
                let a = KernelArgs::Memcpy {
                    dst: va(rng),
                    src: va(rng),
                    len: rng.below(8192),
                };
                launch(&a, args(&a))
            }
            2 => {
                let a = KernelArgs::Checksum {
                    src: va(rng),
                    len: rng.below(8192),
                    dst: va(rng),
                };
                launch(&a, args(&a))
            }
            3 => Method::Copy {
                src: va(rng),
                dst: va(rng),
                len: rng.below(8192),
            },
            4 => Method::SemRelease {
                va: va(rng),
                value: rng.next() as u32,
                timestamp: rng.below(2) == 0,
            },
            5 => Method::SemAcquire {
                // Zero at first: satisfied unless something wrote there.
                va: SYS_VA + HDATA + 0x8_0000,
                value: 0,
                mode: SemaphoreMode::AtLeast,
            },
            6 => Method::SetRef {
                value: rng.next() as u32,
            },
            _ => Method::Notify {
                token: rng.next() as u32,
            },
        };
        out.push(m);
    }
    let pad = rng.below(200) as usize;
    out.extend(std::iter::repeat_n(Method::Nop, pad));
    out
}

fn launch(a: &KernelArgs, args_va: u64) -> Method {
    Method::Launch {
        kernel: a.kernel(),
        grid: [1, 1, 1],
        args_va,
        args_len: KernelArgs::encoded_len(a.kernel()) as u32,
    }
}

/// Words the mutator writes: anything, or values that look like lengths, counts,
/// headers and addresses (its own, the other VM's, none at all).
fn evil_word(rng: &mut Rng, old: u32) -> u32 {
    match rng.below(7) {
        0 => rng.next() as u32,
        1 => old ^ (1 << rng.below(32)),
        2 => rng.below(70) as u32,
        3 => old.wrapping_add(rng.below(9) as u32).wrapping_sub(4),
        4 => (SYS_VA >> 32) as u32,
        5 => (VRAM_VA >> 32) as u32,
        _ => (SYS_VA + HDATA + rng.below(SYS_LEN as u64 - HDATA)) as u32,
    }
}

/// Rewrites words of the hostile channel's ring, push buffers and arguments until told to
/// stop; returns how many words it wrote. Two kinds of mutation alternate: lasting ones
/// (a word replaced for good) and flickers (a word of a GP entry or a push buffer set to
/// an evil value and straight back, over and over), which only a decoder that reads the
/// same word twice can see as two different values.
fn mutate(sys: Arc<TestSysMem>, stop: Arc<AtomicBool>, seed: u64) -> u64 {
    let mut rng = Rng(seed);
    let mut writes = 0u64;
    let word_at = |at: u64| {
        let mut b = [0u8; 4];
        sys.read(at, &mut b);
        u32::from_le_bytes(b)
    };
    while !stop.load(Ordering::Relaxed) {
        // Lasting mutations.
        for _ in 0..8 {
            let (off, len) = match rng.below(4) {
                0 => RING,
                1 | 2 => PB,
                _ => ARGS,
            };
            let at = sys.base + off + rng.below(len / 4) * 4;
            let w = evil_word(&mut rng, word_at(at));
            sys.write(at, &w.to_le_bytes());
            writes += 1;
        }
        // Flickers: every ring entry's length, address or flags word, or push-buffer
        // words near the start of the slots, for about 100 µs.
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_micros(100) {
            for _ in 0..64 {
                let at = if rng.below(2) == 0 {
                    let slot = rng.below(ENTRIES as u64);
                    sys.base + RING.0 + slot * 16 + [0, 4, 8, 12][rng.below(4) as usize]
                } else {
                    let slot = rng.below(PB.1 / PB_SLOT);
                    sys.base + PB.0 + slot * PB_SLOT + rng.below(16) * 4
                };
                let old = word_at(at);
                let evil = evil_word(&mut rng, old);
                sys.write(at, &evil.to_le_bytes());
                sys.write(at, &old.to_le_bytes());
                writes += 2;
            }
        }
        // Pauses: channels live long enough to run some of what they get.
        std::thread::sleep(Duration::from_micros(100));
    }
    writes
}

/// What the hostile guest saw: faults by code, entries completed, channels used.
#[derive(Default, Debug)]
struct HostileReport {
    faults: std::collections::BTreeMap<String, u64>,
    completed: u64,
    channels: u64,
    stuck: u64,
}

/// Submits valid work on a channel of `p` whose memory the mutator scribbles on, and
/// stores random GP_PUT values now and then; a faulted or stuck channel is replaced.
fn hostile_submitter(gpu: &Arc<SimGpu>, p: &Proc, until: Instant, seed: u64) -> HostileReport {
    let mut rng = Rng(seed);
    let mut report = HostileReport::default();
    let mut args_cursor = 0u64;
    while Instant::now() < until {
        let ch = p.channel(0);
        report.channels += 1;
        let mut put = 0u32;
        let mut pb_slot = 0u64;
        let mut last_move = Instant::now();
        let mut last_get = 0u32;
        loop {
            let err = ch.ctrl.load(ControlPage::ERROR);
            if err != 0 {
                let code = ErrorCode::from_u32(err).unwrap_or(ErrorCode::Internal);
                *report.faults.entry(format!("{code:?}")).or_default() += 1;
                break;
            }
            let get = ch.ctrl.load(ControlPage::GP_GET);
            if get != last_get {
                last_get = get;
                last_move = Instant::now();
            }
            if Instant::now() >= until {
                break;
            }
            if put.wrapping_sub(get) >= ENTRIES - 1 {
                if last_move.elapsed() > STUCK {
                    report.stuck += 1;
                    break;
                }
                std::thread::yield_now();
                continue;
            }
            let mut args = |a: &KernelArgs| {
                let off = ARGS.0 + (args_cursor % (ARGS.1 / 64)) * 64;
                args_cursor += 1;
                p.poke(off, &a.encode());
                SYS_VA + off
            };
            let words = encode_all(&hostile_methods(&mut rng, &mut args));
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            let off = PB.0 + (pb_slot % (PB.1 / PB_SLOT)) * PB_SLOT;
            pb_slot += 1;
            p.poke(off, &bytes[..bytes.len().min(PB_SLOT as usize)]);
            let len = (words.len() as u32).min(PB_SLOT as u32 / 4);
            let entry = GpEntry::new(SYS_VA + off, len).expect("valid entry");
            p.poke(RING.0 + (put % ENTRIES) as u64 * 16, &entry.encode());
            put = put.wrapping_add(1);
            // Now and then a GP_PUT of the guest's choosing instead of the right one.
            let shown = match rng.below(40) {
                0 => rng.next() as u32,
                1 => put.wrapping_add(rng.below(3 * ENTRIES as u64) as u32),
                2 => put.wrapping_sub(rng.below(8) as u32),
                _ => put,
            };
            ch.ctrl.store(ControlPage::GP_PUT, shown);
            // Now and then a fence wake-up armed for any value (at most one wake-up
            // event per REF move of its own channel).
            if rng.below(8) == 0 {
                ch.ctrl.store(ControlPage::REF_WAKE, rng.next() as u32);
                ch.ctrl
                    .store(ControlPage::REF_WAKE_ARMED, rng.next() as u32);
            }
        }
        report.completed += gpu.channel_counters(ch.id).map_or(0, |c| c.gp_completed);
        // Only this channel's events, and errors only of the guest's making.
        for ev in ch.events.0.lock().unwrap().iter() {
            match ev {
                GpuEvent::Error { channel, code, .. } => {
                    assert_eq!(*channel, ch.id, "an error event for another channel");
                    assert!(
                        matches!(
                            code,
                            ErrorCode::BadGpEntry
                                | ErrorCode::BadMethod
                                | ErrorCode::BadKernelArgs
                                | ErrorCode::MmuFault
                        ),
                        "hostile channel fault {code:?} is not a guest error"
                    );
                }
                GpuEvent::Notify { channel, .. } | GpuEvent::Fence { channel, .. } => {
                    assert_eq!(*channel, ch.id)
                }
            }
        }
        gpu.destroy_channel(ch.id).unwrap();
    }
    report
}

/// One round of the well-behaved VM: data through VRAM and back with the copy engine and
/// kernels, checked bit-exact against the CPU reference.
fn victim_round(p: &Proc, ch: &mut Chan, round: u32) {
    let n = 4096usize;
    let (x, y) = (data(n, round * 2 + 1), data(n, round * 2 + 2));
    p.poke(DATA_OFF, &f32s(&x));
    p.poke(DATA_OFF + 0x4000, &f32s(&y));
    let bytes = (n * 4) as u64;
    let saxpy = ch.launch(&KernelArgs::Saxpy {
        x: VRAM_VA,
        y: VRAM_VA + 0x4000,
        n: n as u64,
        a: 0.75,
    });
    let sum = ch.launch(&KernelArgs::Checksum {
        src: VRAM_VA + 0x4000,
        len: bytes,
        dst: SYS_VA + DATA_OFF + 0x8000,
    });
    ch.submit(&[
        Method::Copy {
            src: SYS_VA + DATA_OFF,
            dst: VRAM_VA,
            len: 2 * 0x4000,
        },
        saxpy,
        sum,
        Method::Copy {
            src: VRAM_VA + 0x4000,
            dst: SYS_VA + DATA_OFF + 0xc000,
            len: bytes,
        },
        Method::SetRef { value: round },
    ]);
    assert_eq!(ch.wait_idle(VICTIM_WAIT), Ok(()), "victim round {round}");
    let mut want = y.clone();
    reference::saxpy(0.75, &x, &mut want);
    assert_eq!(from_f32s(&p.peek(DATA_OFF + 0xc000, n * 4)), want);
    let got = u64::from_le_bytes(p.peek(DATA_OFF + 0x8000, 8).try_into().unwrap());
    assert_eq!(got, reference::checksum(&f32s(&want)));
    assert_eq!(ch.ctrl.load(ControlPage::REF), round);
}

#[test]
fn ring_and_push_buffers_mutated_while_decoded() {
    let gpu = SimGpu::new(SimConfig {
        vram_bytes: 64 << 20,
        compute_engines: 2,
        ..Default::default()
    })
    .unwrap();
    let hostile = Proc::new(&gpu, SYS_BASE);
    // The other VM: its own system memory and a VRAM buffer, neither mapped in the
    // hostile context. A canary in each must come out unchanged.
    let victim = Proc::new(&gpu, SYS_BASE + (64 << 20));
    let vbuf = gpu.alloc_vram(2 << 20, 2 << 20).unwrap();
    gpu.map(
        victim.ctx,
        VRAM_VA,
        2 << 20,
        MapTarget::Vram {
            offset: vbuf.offset,
        },
        PageSize::Huge2M,
        MapFlags::default(),
    )
    .unwrap();
    let canary: Vec<u8> = (0..0x1_0000u32).map(|i| (i * 31 % 253) as u8).collect();
    victim.poke(DATA_OFF + 0x10_0000, &canary);
    gpu.vram_write(vbuf.offset + (1 << 20), &canary).unwrap();

    let until = Instant::now() + mutation_time();
    let stop = Arc::new(AtomicBool::new(false));
    let mutator = {
        let (sys, stop) = (hostile.sys.clone(), stop.clone());
        std::thread::spawn(move || mutate(sys, stop, 0x9e37_79b9_7f4a_7c15))
    };
    let rounds = Arc::new(AtomicU64::new(0));
    let report = std::thread::scope(|s| {
        let h = s.spawn(|| hostile_submitter(&gpu, &hostile, until, 0x1234_5678_9abc_def1));
        let mut vch = victim.channel(0);
        let mut round = 0u32;
        while Instant::now() < until {
            victim_round(&victim, &mut vch, round);
            round += 1;
            rounds.store(round as u64, Ordering::Relaxed);
        }
        assert_eq!(gpu.channel_error(vch.id).unwrap(), None);
        assert!(
            vch.events.0.lock().unwrap().is_empty(),
            "the victim got events"
        );
        h.join().expect("hostile submitter")
    });
    stop.store(true, Ordering::Relaxed);
    let writes = mutator.join().expect("mutator");
    let rounds = rounds.load(Ordering::Relaxed);
    println!(
        "hostile guest: {writes} words mutated, {} channels, {} entries completed, {} stuck, faults {:?}; victim: {rounds} rounds bit-exact",
        report.channels, report.completed, report.stuck, report.faults
    );
    assert!(
        rounds >= 10,
        "the victim made too little progress: {rounds}"
    );
    assert!(
        report.faults.values().sum::<u64>() > 0,
        "the mutations never faulted the hostile channel: {report:?}"
    );
    assert!(report.completed > 0, "no hostile work ever ran");
    assert_eq!(victim.peek(DATA_OFF + 0x10_0000, canary.len()), canary);
    let mut back = vec![0u8; canary.len()];
    gpu.vram_read(vbuf.offset + (1 << 20), &mut back).unwrap();
    assert_eq!(back, canary);
    // Everything the hostile guest made goes away with its context.
    gpu.destroy_context(hostile.ctx).unwrap();
    gpu.destroy_context(victim.ctx).unwrap();
    let st = gpu.stats();
    assert_eq!((st.contexts, st.channels), (0, 0));
}

/// The overrun check (GP_PUT more than a ring ahead of what ran) uses the GPU's own count
/// of completed entries, not the page's GP_GET, which the guest can write too.
fn forged_gp_get_does_not_hide_a_ring_overrun<G: Gpu + ?Sized + 'static>(gpu: &Arc<G>) {
    let p = Proc::new(gpu, SYS_BASE);
    let mut ch = p.channel(0);
    // A full ring of valid entries that have not run (GP_PUT still 0).
    for i in 0..ENTRIES {
        ch.stage(&[Method::SetRef { value: i }]);
    }
    // The guest claims the GPU is at 200 and submits up to 201: three rings ahead.
    ch.ctrl.store(ControlPage::GP_GET, 200);
    ch.ctrl.store(ControlPage::GP_PUT, 201);
    let t0 = Instant::now();
    while gpu.channel_error(ch.id).unwrap().is_none() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        gpu.channel_error(ch.id).unwrap(),
        Some((ErrorCode::BadGpEntry, 201))
    );
    assert_eq!(gpu.channel_counters(ch.id).unwrap().gp_completed, 0);
}

#[test]
fn sim_forged_gp_get_does_not_hide_a_ring_overrun() {
    forged_gp_get_does_not_hide_a_ring_overrun(&gpu());
}

#[test]
fn cuda_fake_forged_gp_get_does_not_hide_a_ring_overrun() {
    use vgpu_host_shim::cuda::{CudaConfig, FakeCudaGpu, FakeDevice};
    let gpu = FakeCudaGpu::with_device(
        Arc::new(FakeDevice::default()),
        CudaConfig {
            vram_bytes: 64 << 20,
            ..Default::default()
        },
    )
    .unwrap();
    forged_gp_get_does_not_hide_a_ring_overrun(&gpu);
}
