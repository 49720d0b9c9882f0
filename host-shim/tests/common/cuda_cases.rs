//! Cases every `cuda` GPU must pass, on the fake device (CI) and on a real GPU.

use std::sync::Arc;
use std::time::Duration;

use super::kernels::{data, f32s, from_f32s, run_all, Mem, T};
use super::{spin, CtrlMap, Proc, DATA_OFF, ENTRIES, RING_OFF, SYS_BASE, SYS_VA};
use vgpu_host_shim::kernels::reference;
use vgpu_host_shim::*;
use vgpu_protocol::{ControlPage, ErrorCode, KernelArgs, Method, SemaphoreMode};

pub const VRAM_VA: u64 = 0x30_0000_0000;

pub fn every_kernel_on_system_memory<G: Gpu + ?Sized + 'static>(gpu: &Arc<G>) {
    let p = Proc::new(gpu, SYS_BASE);
    let mut ch = p.channel(0);
    let mem = Mem {
        p: &p,
        vram: None,
        va: SYS_VA + DATA_OFF,
    };
    run_all(&mem, &mut ch);
}

pub fn every_kernel_on_vram<G: Gpu + ?Sized + 'static>(gpu: &Arc<G>) {
    let p = Proc::new(gpu, SYS_BASE);
    let buf = gpu.alloc_vram(2 << 20, 2 << 20).unwrap();
    gpu.map(
        p.ctx,
        VRAM_VA,
        2 << 20,
        MapTarget::Vram { offset: buf.offset },
        PageSize::Huge2M,
        MapFlags::default(),
    )
    .unwrap();
    let mut ch = p.channel(0);
    let mem = Mem {
        p: &p,
        vram: Some(buf.offset),
        va: VRAM_VA,
    };
    run_all(&mem, &mut ch);
}

/// VRAM is device memory the CPU cannot map: the GPU offers no aperture file, and the
/// host's copies (`vram_write`/`vram_read`, what swapping and the copy engine use) and the
/// kernels agree both ways. A fresh allocation reads as zero even where an earlier
/// owner left data.
pub fn host_copies_and_kernels_agree_on_vram<G: Gpu + ?Sized + 'static>(gpu: &Arc<G>) {
    assert!(
        gpu.vram_fd().is_none(),
        "cuda VRAM must not offer a CPU view"
    );
    let p = Proc::new(gpu, SYS_BASE);
    let buf = gpu.alloc_vram(2 << 20, 2 << 20).unwrap();
    gpu.map(
        p.ctx,
        VRAM_VA,
        2 << 20,
        MapTarget::Vram { offset: buf.offset },
        PageSize::Huge2M,
        MapFlags::default(),
    )
    .unwrap();
    let x = data(4096, 11);
    gpu.vram_write(buf.offset, &f32s(&x)).unwrap();
    let mut ch = p.channel(0);
    let m = ch.launch(&KernelArgs::ReduceSum {
        src: VRAM_VA,
        n: 4096,
        dst: VRAM_VA + 0x10_0000,
    });
    ch.submit(&[m]);
    ch.wait_idle(T).unwrap();
    let mut got = [0u8; 4];
    gpu.vram_read(buf.offset + 0x10_0000, &mut got).unwrap();
    assert_eq!(from_f32s(&got)[0], reference::reduce_sum(&x));

    gpu.unmap(p.ctx, VRAM_VA, 2 << 20).unwrap();
    gpu.invalidate_tlb(p.ctx).unwrap();
    gpu.free_vram(buf.offset).unwrap();
    let again = gpu.alloc_vram(2 << 20, 2 << 20).unwrap();
    let mut back = vec![0xffu8; 2 << 20];
    gpu.vram_read(again.offset, &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 0),
        "a fresh allocation shows old data"
    );
    gpu.free_vram(again.offset).unwrap();
}

/// Batched host copies (a VRAM move's chunks, queued together on the copy stream and
/// waited for once) land exactly where single ones would: chunks written with
/// `vram_write_many` read back bit-exactly with `vram_read_many` and with `vram_read`, a
/// kernel sees them, and a batch naming a range outside VRAM fails.
pub fn batched_host_copies_move_many_chunks_exactly<G: Gpu + ?Sized + 'static>(gpu: &Arc<G>) {
    const CH: usize = 2 << 20;
    let p = Proc::new(gpu, SYS_BASE);
    // Chunks apart from each other, the last one short.
    let bufs: Vec<VramAlloc> = (0..4)
        .map(|_| gpu.alloc_vram(CH as u64, CH as u64).unwrap())
        .collect();
    let gap = gpu.alloc_vram(CH as u64, CH as u64).unwrap();
    let lens = [CH, CH, CH, CH - 4096];
    let src: Vec<Vec<u8>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| f32s(&data(n / 4, 100 + i as u32)))
        .collect();
    let writes: Vec<(u64, &[u8])> = bufs
        .iter()
        .zip(&src)
        .map(|(b, s)| (b.offset, s.as_slice()))
        .collect();
    gpu.vram_write_many(&writes).unwrap();
    let mut dst: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0xa5u8; n]).collect();
    let mut reads: Vec<(u64, &mut [u8])> = bufs
        .iter()
        .zip(dst.iter_mut())
        .map(|(b, d)| (b.offset, d.as_mut_slice()))
        .collect();
    gpu.vram_read_many(&mut reads).unwrap();
    for (i, (d, s)) in dst.iter().zip(&src).enumerate() {
        assert!(d == s, "chunk {i} differs after a batched round trip");
        let mut one = vec![0u8; s.len()];
        gpu.vram_read(bufs[i].offset, &mut one).unwrap();
        assert!(&one == s, "chunk {i} differs read alone");
    }
    // The bytes between chunks were not touched.
    let mut g = vec![0xffu8; CH];
    gpu.vram_read(gap.offset, &mut g).unwrap();
    assert!(
        g.iter().all(|&b| b == 0),
        "a batch wrote outside its chunks"
    );
    // A kernel sees what the batch wrote.
    gpu.map(
        p.ctx,
        VRAM_VA,
        CH as u64,
        MapTarget::Vram {
            offset: bufs[2].offset,
        },
        PageSize::Huge2M,
        MapFlags::default(),
    )
    .unwrap();
    let n = 4096;
    let mut ch = p.channel(0);
    let m = ch.launch(&KernelArgs::ReduceSum {
        src: VRAM_VA,
        n,
        dst: VRAM_VA + 0x10_0000,
    });
    ch.submit(&[m]);
    ch.wait_idle(T).unwrap();
    let mut got = [0u8; 4];
    gpu.vram_read(bufs[2].offset + 0x10_0000, &mut got).unwrap();
    let want = reference::reduce_sum(&from_f32s(&src[2][..n as usize * 4]));
    assert_eq!(from_f32s(&got)[0], want);
    // Out of bounds anywhere in the batch: an error.
    let vram = gpu.info().vram_bytes;
    let mut small = [0u8; 16];
    let mut also = [0u8; 16];
    let mut bad: Vec<(u64, &mut [u8])> = vec![(bufs[0].offset, &mut small), (vram - 8, &mut also)];
    assert!(gpu.vram_read_many(&mut bad).is_err());
    assert!(gpu.vram_write_many(&[(vram - 8, &[1u8; 16])]).is_err());
    gpu.unmap(p.ctx, VRAM_VA, CH as u64).unwrap();
    gpu.invalidate_tlb(p.ctx).unwrap();
    for b in bufs.iter().chain([&gap]) {
        gpu.free_vram(b.offset).unwrap();
    }
}

/// A launch or copy naming another tenant's address faults the channel with an MMU
/// error and changes nothing in the other tenant's memory.
pub fn hostile_pointers_fault_and_change_nothing<G: Gpu + ?Sized + 'static>(gpu: &Arc<G>) {
    let victim = Proc::new(gpu, SYS_BASE);
    let attacker = Proc::new(gpu, SYS_BASE + (64 << 20));
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
    let secret = vec![0x5au8; 4096];
    gpu.vram_write(vbuf.offset, &secret).unwrap();
    victim.poke(DATA_OFF, &secret);
    // The attacker names the victim's VRAM VA (unmapped in its own context)...
    let mut ch = attacker.channel(0);
    let m = ch.launch(&KernelArgs::Memset {
        dst: VRAM_VA,
        len: 4096,
        pattern: 0,
    });
    ch.submit(&[m]);
    assert_eq!(ch.wait_idle(T), Err(ErrorCode::MmuFault));
    assert_eq!(
        super::error_after(&**gpu, ch.id),
        Some((ErrorCode::MmuFault, VRAM_VA))
    );
    // ...and a copy out of its own memory into an address past its mapping.
    let mut ch2 = attacker.channel(1);
    ch2.submit(&[Method::Copy {
        src: SYS_VA + DATA_OFF,
        dst: SYS_VA + (8 << 20) - 8,
        len: 4096,
    }]);
    assert_eq!(ch2.wait_idle(T), Err(ErrorCode::MmuFault));
    // Nothing changed on the victim's side, and the victim still works.
    let mut back = vec![0u8; 4096];
    gpu.vram_read(vbuf.offset, &mut back).unwrap();
    assert_eq!(back, secret);
    assert_eq!(victim.peek(DATA_OFF, 4096), secret);
    let mut vch = victim.channel(0);
    let m = vch.launch(&KernelArgs::Checksum {
        src: VRAM_VA,
        len: 4096,
        dst: SYS_VA + DATA_OFF + 8192,
    });
    vch.submit(&[m]);
    vch.wait_idle(T).unwrap();
    let sum = u64::from_le_bytes(victim.peek(DATA_OFF + 8192, 8).try_into().unwrap());
    assert_eq!(sum, reference::checksum(&secret));
}

/// SEM_ACQUIRE blocks its channel until another channel's SEM_RELEASE; REF, NOTIFY and
/// GP_GET follow completion. The waiter's `sem_wait_ns` counts the wait and stops when it
/// is satisfied; the releaser never waited.
pub fn semaphores_order_channels<G: Gpu + ?Sized + 'static>(gpu: &Arc<G>) {
    let p = Proc::new(gpu, SYS_BASE);
    let sem = SYS_VA + DATA_OFF;
    let out = SYS_VA + DATA_OFF + 0x1000;
    p.poke(DATA_OFF, &0u32.to_le_bytes());
    let mut waiter = p.channel(0);
    let mut releaser = p.channel(1);
    let m = waiter.launch(&KernelArgs::Memset {
        dst: out,
        len: 4,
        pattern: 0x1234_5678,
    });
    waiter.submit(&[
        Method::SemAcquire {
            va: sem,
            value: 7,
            mode: SemaphoreMode::AtLeast,
        },
        m,
        Method::SetRef { value: 42 },
        Method::Notify { token: 9 },
    ]);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(waiter.ctrl.load(vgpu_protocol::ControlPage::GP_GET), 0);
    assert_eq!(p.peek(DATA_OFF + 0x1000, 4), vec![0; 4]);
    // Counters may lag (a worker publishes them every millisecond, later on a loaded
    // machine): wait for the figure rather than read it once.
    let t = std::time::Instant::now();
    let waited = loop {
        let w = gpu.channel_counters(waiter.id).unwrap().sem_wait_ns;
        if w >= 20_000_000 || t.elapsed() > Duration::from_secs(2) {
            break w;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    assert!(
        waited >= 20_000_000,
        "waited {waited} ns of 50 ms on the semaphore"
    );
    let spin = releaser.launch(&KernelArgs::Spin { ns: 2_000_000 });
    releaser.submit(&[
        spin,
        Method::SemRelease {
            va: sem,
            value: 7,
            timestamp: true,
        },
    ]);
    waiter.wait_idle(T).unwrap();
    releaser.wait_idle(T).unwrap();
    let after = super::counters_after(&**gpu, waiter.id, u64::from(waiter.put)).sem_wait_ns;
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        gpu.channel_counters(waiter.id).unwrap().sem_wait_ns,
        after,
        "the wait ended with its release"
    );
    assert!(after >= waited);
    assert_eq!(gpu.channel_counters(releaser.id).unwrap().sem_wait_ns, 0);
    assert_eq!(p.peek(DATA_OFF + 0x1000, 4), 0x1234_5678u32.to_le_bytes());
    assert_eq!(waiter.ctrl.load(vgpu_protocol::ControlPage::REF), 42);
    assert_eq!(waiter.ctrl.load(vgpu_protocol::ControlPage::NOTIFY_SEQ), 1);
    let ts = u64::from_le_bytes(p.peek(DATA_OFF + 8, 8).try_into().unwrap());
    assert!(ts > 0 && ts <= vgpu_host_shim::clock::now_ns());
    let ev = waiter.events.0.lock().unwrap().clone();
    assert!(ev.contains(&GpuEvent::Notify {
        channel: waiter.id,
        token: 9
    }));
}

/// Destroying a context with channels leaves no channel, and a busy channel's counters
/// show its kernels.
pub fn counters_and_teardown<G: Gpu + ?Sized + 'static>(gpu: &Arc<G>) {
    let p = Proc::new(gpu, SYS_BASE);
    let mut ch = p.channel(0);
    let x = data(1 << 16, 3);
    p.poke(DATA_OFF, &f32s(&x));
    // A kernel long against the busy time's precision (a launch latency; on the fake a
    // thread's wake-up, which on a loaded machine outlasted all 20 short saxpys).
    let m = ch.launch(&KernelArgs::Spin { ns: 3_000_000 });
    ch.submit(&[m]);
    for _ in 0..20 {
        let m = ch.launch(&KernelArgs::Saxpy {
            x: SYS_VA + DATA_OFF,
            y: SYS_VA + DATA_OFF,
            n: 1 << 16,
            a: 0.5,
        });
        ch.submit(&[m]);
    }
    ch.wait_idle(T).unwrap();
    let c = gpu.channel_counters(ch.id).unwrap();
    assert_eq!(c.kernels, 21);
    assert_eq!(c.gp_completed, 21);
    assert!(c.busy_ns >= 2_900_000, "busy {} ns", c.busy_ns);
    let mut want = x.clone();
    for _ in 0..20 {
        let snapshot = want.clone();
        reference::saxpy(0.5, &snapshot, &mut want);
    }
    assert_eq!(from_f32s(&p.peek(DATA_OFF, 1 << 18)), want);
    gpu.destroy_context(p.ctx).unwrap();
    assert!(gpu.channel_counters(ch.id).is_err());
}

/// A channel created at a saved position (live migration) continues there: control page
/// fields as saved, the next entry fetched is the saved GP_GET, a saved error comes back
/// without a new event.
pub fn resumed_channel_continues_at_its_saved_position<G: Gpu + ?Sized + 'static>(gpu: &Arc<G>) {
    let p = Proc::new(gpu, SYS_BASE);
    let mut ch = p.channel(0);
    for r in 0..3u32 {
        ch.submit(&[Method::SetRef { value: 100 + r }]);
    }
    ch.wait_idle(T).unwrap();
    assert_eq!(ch.ctrl.load(ControlPage::REF), 102);
    let saved = ChannelResume {
        gp_get: ch.ctrl.load(ControlPage::GP_GET),
        reference: ch.ctrl.load(ControlPage::REF),
        notify_seq: 5,
        error: None,
    };
    gpu.destroy_channel(ch.id).unwrap();
    let cfg = ChannelConfig {
        gp_ring_va: SYS_VA + RING_OFF,
        gp_entries: ENTRIES,
    };
    let id = gpu
        .create_channel_resumed(p.ctx, cfg, ch.events.clone(), saved)
        .unwrap();
    ch.id = id;
    ch.ctrl = CtrlMap::new(gpu.control_page(id).unwrap());
    for f in [ControlPage::GP_GET, ControlPage::GP_PUT] {
        assert_eq!(ch.ctrl.load(f), 3);
    }
    assert_eq!(ch.ctrl.load(ControlPage::REF), 102);
    assert_eq!(ch.ctrl.load(ControlPage::NOTIFY_SEQ), 5);
    ch.submit(&[Method::SetRef { value: 200 }]);
    ch.wait_idle(T).unwrap();
    assert_eq!(ch.ctrl.load(ControlPage::REF), 200);
    assert_eq!(ch.ctrl.load(ControlPage::GP_GET), 4);
    assert_eq!(super::counters_after(&**gpu, id, 1).gp_completed, 1);

    let stopped = ChannelResume {
        gp_get: 4,
        reference: 200,
        notify_seq: 0,
        error: Some((ErrorCode::MmuFault, 0x1234)),
    };
    let events = ch.events.clone();
    let before = events.0.lock().unwrap().len();
    let id2 = gpu
        .create_channel_resumed(p.ctx, cfg, events.clone(), stopped)
        .unwrap();
    assert_eq!(
        gpu.channel_error(id2).unwrap(),
        Some((ErrorCode::MmuFault, 0x1234))
    );
    let page = CtrlMap::new(gpu.control_page(id2).unwrap());
    assert_eq!(page.load(ControlPage::ERROR), ErrorCode::MmuFault.as_u32());
    assert_eq!(events.0.lock().unwrap().len(), before);
}

/// A fence signals when its own entry is done, not when the last entry sharing its
/// completion mark is: two entries published together (one batch on the front end), a
/// short spin with REF 1 and a long one with REF 2; REF shows 1 while the long spin still
/// runs (GP_GET, which moves by the batch, has not moved yet).
pub fn fence_signals_before_its_batch_ends<G: Gpu + ?Sized + 'static>(gpu: &Arc<G>) {
    let p = Proc::new(gpu, SYS_BASE);
    let mut ch = p.channel(0);
    let short = ch.launch(&KernelArgs::Spin { ns: 1_000_000 });
    ch.stage(&[short, Method::SetRef { value: 1 }]);
    let long = ch.launch(&KernelArgs::Spin { ns: 1_500_000_000 });
    ch.stage(&[long, Method::SetRef { value: 2 }]);
    ch.publish();
    let t0 = std::time::Instant::now();
    let seen = loop {
        let r = ch.ctrl.load(vgpu_protocol::ControlPage::REF);
        if r != 0 || t0.elapsed() > T {
            break r;
        }
        std::thread::sleep(Duration::from_micros(100));
    };
    let get = ch.ctrl.load(vgpu_protocol::ControlPage::GP_GET);
    assert_eq!(seen, 1, "REF 1 before the long spin ends (GP_GET {get})");
    ch.wait_idle(T).unwrap();
    assert_eq!(ch.ctrl.load(vgpu_protocol::ControlPage::REF), 2);
}

/// A sleeping fence waiter's wake-up (issue 34): armed for REF 2, an entry that sets REF
/// 1 sends nothing; the entry that sets REF 2 sends one `Fence` event and disarms the
/// page; with nothing armed, REF moving sends nothing.
pub fn fence_wake_up_comes_when_ref_reaches_the_armed_value<G: Gpu + ?Sized + 'static>(
    gpu: &Arc<G>,
) {
    use vgpu_protocol::ControlPage;
    let fences = |ch: &super::Chan| {
        let ev = ch.events.0.lock().unwrap().clone();
        ev.into_iter()
            .filter_map(|e| match e {
                GpuEvent::Fence { channel, reference } if channel == ch.id => Some(reference),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let p = Proc::new(gpu, SYS_BASE);
    let mut ch = p.channel(0);
    ch.ctrl.store(ControlPage::REF_WAKE, 2);
    ch.ctrl.store(ControlPage::REF_WAKE_ARMED, 1);
    let short = ch.launch(&KernelArgs::Spin { ns: 100_000 });
    ch.submit(&[short, Method::SetRef { value: 1 }]);
    ch.wait_idle(T).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        fences(&ch),
        Vec::<u32>::new(),
        "REF 1 is short of the armed 2"
    );
    assert_eq!(ch.ctrl.load(ControlPage::REF_WAKE_ARMED), 1);

    let long = ch.launch(&KernelArgs::Spin { ns: 20_000_000 });
    ch.submit(&[long, Method::SetRef { value: 2 }]);
    let t0 = std::time::Instant::now();
    while fences(&ch).is_empty() && t0.elapsed() < T {
        std::thread::sleep(Duration::from_micros(200));
    }
    assert_eq!(fences(&ch), vec![2], "one wake-up, with the REF reached");
    assert_eq!(ch.ctrl.load(ControlPage::REF_WAKE_ARMED), 0, "disarmed");
    assert_eq!(ch.ctrl.load(ControlPage::REF), 2);

    let more = ch.launch(&KernelArgs::Spin { ns: 100_000 });
    ch.submit(&[more, Method::SetRef { value: 3 }]);
    ch.wait_idle(T).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(fences(&ch), vec![2], "nobody armed: no wake-up");
}

/// The activity count of a group of channels (issue 15): it moves when one of them
/// fetches and completes work, stays put while they are idle, and a channel counts into
/// one group only.
pub fn activity_counter_counts_the_group_work<G: Gpu + ?Sized + 'static>(gpu: &Arc<G>) {
    let p = Proc::new(gpu, SYS_BASE);
    let mut a = p.channel(0);
    let b = p.channel(1);
    let group = Arc::new(ActivityCounter::new());
    assert!(gpu.count_activity(a.id, group.clone()).unwrap());
    assert!(gpu.count_activity(b.id, group.clone()).unwrap());
    assert!(
        !gpu.count_activity(a.id, Arc::new(ActivityCounter::new()))
            .unwrap(),
        "a channel counts into one group"
    );
    assert_eq!(group.get(), 0, "nothing ran yet");
    let m = a.launch(&spin(100_000));
    a.submit(&[m]);
    a.wait_idle(T).unwrap();
    let after = group.get();
    assert!(after >= 2, "a fetch and a completion: {after}");
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(group.get(), after, "idle channels leave it alone");
    // A channel's own count rolls up to its parent's.
    let c = p.channel(2);
    let own = Arc::new(ActivityCounter::with_parent(group.clone()));
    assert!(gpu.count_activity(c.id, own.clone()).unwrap());
    let mut c = c;
    let m = c.launch(&spin(100_000));
    c.submit(&[m]);
    c.wait_idle(T).unwrap();
    assert!(own.get() >= 2 && group.get() >= after + 2);
}
