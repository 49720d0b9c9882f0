//! The whole `cuda` GPU (front end, planner, host registration) on the CPU fake device:
//! runs in CI, where there is no GPU.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::cuda_cases::*;
use vgpu_host_shim::cuda::{CudaConfig, FakeCudaGpu, FakeDevice, FakeSignals};

fn gpu() -> Arc<FakeCudaGpu> {
    FakeCudaGpu::with_device(
        Arc::new(FakeDevice::default()),
        CudaConfig {
            vram_bytes: 64 << 20,
            ..Default::default()
        },
    )
    .unwrap()
}

#[test]
fn fake_every_kernel_on_system_memory() {
    every_kernel_on_system_memory(&gpu());
}

#[test]
fn fake_every_kernel_on_vram() {
    every_kernel_on_vram(&gpu());
}

#[test]
fn fake_host_copies_and_kernels_agree_on_vram() {
    host_copies_and_kernels_agree_on_vram(&gpu());
}

#[test]
fn fake_batched_host_copies_move_many_chunks_exactly() {
    batched_host_copies_move_many_chunks_exactly(&gpu());
}

#[test]
fn fake_hostile_pointers_fault_and_change_nothing() {
    hostile_pointers_fault_and_change_nothing(&gpu());
}

#[test]
fn fake_semaphores_order_channels() {
    semaphores_order_channels(&gpu());
}

#[test]
fn fake_fence_signals_before_its_batch_ends() {
    fence_signals_before_its_batch_ends(&gpu());
}

#[test]
fn fake_fence_wake_up_comes_when_ref_reaches_the_armed_value() {
    fence_wake_up_comes_when_ref_reaches_the_armed_value(&gpu());
}

#[test]
fn fake_counters_and_teardown_unregister_memory() {
    let g = gpu();
    counters_and_teardown(&g);
    // The context's system memory is gone (VRAM is device memory, never registered);
    // only the control pages stay registered, for the GPU's REF writes.
    assert_eq!(g.registered_pieces(), 0);
    assert_eq!(*g.device().registered.lock().unwrap(), control_pages(&g));
}

/// What stays registered for a GPU's whole life: its control pages.
fn control_pages(g: &FakeCudaGpu) -> Vec<(usize, usize)> {
    let pages = g.control_pages_registration();
    assert!(
        pages.is_some(),
        "the fake device registers the control pages"
    );
    pages.into_iter().collect()
}

#[test]
fn fake_dropping_the_gpu_unregisters_everything() {
    let dev = Arc::new(FakeDevice::default());
    let g = FakeCudaGpu::with_device(dev.clone(), CudaConfig::default()).unwrap();
    every_kernel_on_vram(&g);
    drop(g);
    assert!(dev.registered.lock().unwrap().is_empty());
}

/// Unmapped system memory stops being registered at the next TLB invalidation, so a
/// later allocation at the same address (other pages) gets a fresh registration.
#[test]
fn fake_unmapped_system_memory_is_unregistered_at_invalidate() {
    use vgpu_host_shim::*;
    let g = gpu();
    let p = common::Proc::new(&g, common::SYS_BASE);
    let before = g.registered_pieces();
    g.map(
        p.ctx,
        0x50_0000_0000,
        0x1_0000,
        MapTarget::Sysram {
            addr: common::SYS_BASE,
        },
        PageSize::Big64K,
        MapFlags::default(),
    )
    .unwrap();
    g.unmap(p.ctx, 0x50_0000_0000, 0x1_0000).unwrap();
    // Still registered: the GPU may use the old translation until the invalidation.
    let regs = g.device().registered.lock().unwrap().len();
    g.invalidate_tlb(p.ctx).unwrap();
    // The range is also under Proc's own mapping, so the piece survives; unmapping that
    // one too drops it.
    assert_eq!(g.device().registered.lock().unwrap().len(), regs);
    g.unmap(p.ctx, common::SYS_VA, common::SYS_LEN as u64)
        .unwrap();
    g.invalidate_tlb(p.ctx).unwrap();
    assert_eq!(g.registered_pieces(), before - 1);
    assert_eq!(
        *g.device().registered.lock().unwrap(),
        control_pages(&g),
        "nothing but the control pages is left registered"
    );
}

/// A run of swapped chunks mapped as one piece keeps its host memory registered while
/// its first chunk moves to VRAM, back to host memory elsewhere and to VRAM again, each
/// time at the run's own first address: registry keys are the mappings' own, so the
/// chunk's releases do not end the run's registration (which the GPU still reads the
/// other chunks through; on the H100 its loss was an illegal address in the VRAM stress).
#[test]
fn fake_a_runs_first_chunk_moving_keeps_the_runs_registration() {
    use vgpu_host_shim::*;
    const C: u64 = 0x1_0000;
    let g = gpu();
    let p = common::Proc::new(&g, common::SYS_BASE);
    // Only the run's own mappings register host memory.
    g.unmap(p.ctx, common::SYS_VA, common::SYS_LEN as u64)
        .unwrap();
    g.invalidate_tlb(p.ctx).unwrap();
    let va = 0x50_0000_0000;
    let run = MapTarget::Sysram {
        addr: common::SYS_BASE,
    };
    g.map(p.ctx, va, 3 * C, run, PageSize::Big64K, MapFlags::default())
        .unwrap();
    let chunk_elsewhere = MapTarget::Sysram {
        addr: common::SYS_BASE + 4 * C,
    };
    for target in [
        MapTarget::Vram { offset: 0 },
        chunk_elsewhere,
        MapTarget::Vram { offset: 0 },
    ] {
        g.remap(p.ctx, va, C, target).unwrap();
        g.invalidate_tlb(p.ctx).unwrap();
    }
    let (from, to) = (
        p.sys.ptr(common::SYS_BASE + C) as usize,
        p.sys.ptr(common::SYS_BASE + 3 * C) as usize,
    );
    let covered = g
        .device()
        .registered
        .lock()
        .unwrap()
        .iter()
        .any(|&(ptr, len)| ptr <= from && to <= ptr + len);
    assert!(
        covered,
        "the run's other chunks are still mapped to host memory: it stays registered"
    );
    g.unmap(p.ctx, va, 3 * C).unwrap();
    g.invalidate_tlb(p.ctx).unwrap();
    assert_eq!(
        *g.device().registered.lock().unwrap(),
        control_pages(&g),
        "the run's unmap ends its registration"
    );
}

#[test]
fn fake_resumed_channel_continues_at_its_saved_position() {
    resumed_channel_continues_at_its_saved_position(&gpu());
}

#[test]
fn fake_activity_counter_counts_the_group_work() {
    activity_counter_counts_the_group_work(&gpu());
}

fn module_gpu() -> Arc<FakeCudaGpu> {
    FakeCudaGpu::with_device(
        Arc::new(FakeDevice::default()),
        CudaConfig {
            vram_bytes: 64 << 20,
            guest_modules: true,
            ..Default::default()
        },
    )
    .unwrap()
}

#[test]
fn fake_module_vector_adds() {
    common::module_cases::module_vector_adds(&module_gpu());
}

#[test]
fn fake_module_global_round_trip() {
    common::module_cases::module_global_round_trip(&module_gpu());
}

#[test]
fn fake_module_hostile_inputs() {
    common::module_cases::module_hostile_inputs(&module_gpu());
}

#[test]
fn fake_module_wild_write_loses_the_context() {
    let g = module_gpu();
    let lost = || vgpu_host_shim::Gpu::lost(&*g).is_some();
    common::module_cases::module_wild_write_loses_the_context(&g, &lost);
}

#[test]
fn in_process_cuda_and_sim_refuse_modules_saying_which_gpu_runs_them() {
    use vgpu_host_shim::Gpu;
    let ptx = common::module_cases::TEST_PTX.as_bytes();
    let g = gpu();
    let p = common::Proc::new(&g, common::SYS_BASE);
    let err = g.module_load(p.ctx, 1, ptx).unwrap_err();
    assert_eq!(err.code(), vgpu_protocol::ErrorCode::ModulesNeedWorker);
    let sim = common::gpu();
    let q = common::Proc::new(&sim, common::SYS_BASE);
    let err = sim.module_load(q.ctx, 1, ptx).unwrap_err();
    assert_eq!(err.code(), vgpu_protocol::ErrorCode::ModulesNeedCudaGpu);
}

/// Identity addressing through the `Gpu` interface: a 2 MiB-page VRAM mapping is
/// mapped at the guest's own address (the fake's device addresses are host addresses,
/// so the test reads it there), counts as used for VRAM swapping though no translation
/// touched it, and is gone once unmapped.
#[test]
fn a_huge_vram_mapping_is_reachable_at_the_guests_own_address() {
    use vgpu_host_shim::hal::{MapFlags, MapTarget, PageSize};
    use vgpu_host_shim::Gpu;
    const G: u64 = 2 << 20;
    let g = module_gpu();
    let p = common::Proc::new(&g, common::SYS_BASE);
    let a = g.alloc_vram(2 * G, G).unwrap();
    g.vram_write(a.offset + 24, &0x5eed_u64.to_le_bytes())
        .unwrap();
    let va = 0x5100_0000_0000;
    let target = MapTarget::Vram { offset: a.offset };
    g.map(
        p.ctx,
        va,
        2 * G,
        target,
        PageSize::Huge2M,
        MapFlags::default(),
    )
    .unwrap();
    // SAFETY: on the fake, the mirror is host memory mapped at `va` (checked by the read).
    let seen = unsafe { std::ptr::read_volatile((va + 24) as *const u64) };
    assert_eq!(seen, 0x5eed);
    let counts = g.access_counts(p.ctx, va, 2 * G, true).unwrap();
    assert_eq!(
        counts,
        vec![(va, 1), (va + G, 1)],
        "mirrored pages count as used"
    );
    // A buffer outside VRAM's 2 MiB pages is not mirrored: no use is invented.
    let small = g.alloc_vram(64 << 10, 64 << 10).unwrap();
    let small_va = 0x5200_0000_0000;
    let t = MapTarget::Vram {
        offset: small.offset,
    };
    g.map(
        p.ctx,
        small_va,
        64 << 10,
        t,
        PageSize::Big64K,
        MapFlags::default(),
    )
    .unwrap();
    let counts = g.access_counts(p.ctx, small_va, 64 << 10, true).unwrap();
    assert!(counts.iter().all(|&(_, n)| n == 0), "{counts:?}");
    g.unmap(p.ctx, va, 2 * G).unwrap();
    let counts = g.access_counts(p.ctx, va, 2 * G, true).unwrap();
    assert!(counts.is_empty(), "{counts:?}");
}

/// The front end queues about `queue_ahead_ns` of a channel's work on the GPU, not all it
/// could: pausing the channel (a VRAM move) waits for what is queued (issue 34).
#[test]
fn fake_front_end_queues_about_its_queue_ahead_of_a_channels_work() {
    use std::time::{Duration, Instant};
    use vgpu_protocol::{ControlPage, KernelArgs, Method};
    const T: Duration = Duration::from_secs(20);
    let g = FakeCudaGpu::with_device(
        Arc::new(FakeDevice::default()),
        CudaConfig {
            vram_bytes: 64 << 20,
            queue_ahead_ns: 2_000_000,
            ..Default::default()
        },
    )
    .unwrap();
    let p = common::Proc::new(&g, common::SYS_BASE);
    let mut ch = p.channel(0);
    let spin = |ch: &mut common::Chan| ch.launch(&KernelArgs::Spin { ns: 20_000_000 });
    // One entry first: the front end learns how long the channel's entries run.
    let m = spin(&mut ch);
    ch.stage(&[m, Method::SetRef { value: 1 }]);
    ch.publish();
    ch.wait_idle(T).unwrap();
    let entries = 16u32;
    for i in 0..entries {
        let m = spin(&mut ch);
        ch.stage(&[m, Method::SetRef { value: 2 + i }]);
    }
    let before = g.frontend_counts().entries;
    ch.publish();
    let t0 = Instant::now();
    let mut most_ahead = 0;
    while ch.ctrl.load(ControlPage::REF) != 1 + entries && t0.elapsed() < T {
        let issued = g.frontend_counts().entries - before;
        let done = u64::from(ch.ctrl.load(ControlPage::REF) - 1);
        most_ahead = most_ahead.max(issued.saturating_sub(done));
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(ch.ctrl.load(ControlPage::REF), 1 + entries, "all ran");
    // 20 ms entries against 2 ms ahead: two at a time (one runs, one waits); REF lags
    // the front end's count by the poll, so allow one more.
    assert!(
        (2..=3).contains(&most_ahead),
        "{most_ahead} entries ahead of the GPU"
    );
}

/// After a channel appears the front end polls for its first submission instead of
/// sleeping with the doorbell armed (`new_channel_poll_ns`, issue 34); without the poll
/// it goes back to sleep at once, and the page asks for the doorbell.
#[test]
fn fake_front_end_polls_for_a_new_channels_first_submission() {
    use std::time::{Duration, Instant};
    use vgpu_protocol::{ControlPage, KernelArgs, Method};
    let doorbell_wanted_after_creation = |poll_ns: u64| {
        let g = FakeCudaGpu::with_device(
            Arc::new(FakeDevice::default()),
            CudaConfig {
                vram_bytes: 64 << 20,
                new_channel_poll_ns: poll_ns,
                ..Default::default()
            },
        )
        .unwrap();
        let p = common::Proc::new(&g, common::SYS_BASE);
        let mut ch = p.channel(0);
        // Long enough for a front end that sleeps to have armed the doorbell; far inside
        // a poll of 10 s.
        // (A sleeping front end clears the flag for a moment at each of its 10 ms
        // wake-ups: look 20 times.)
        std::thread::sleep(Duration::from_millis(100));
        let wanted = (0..20)
            .filter(|_| {
                std::thread::sleep(Duration::from_millis(1));
                ch.ctrl.load(ControlPage::WANT_DOORBELL) != 0
            })
            .count();
        // Either way the first submission runs (rung or seen by the poll).
        let m = ch.launch(&KernelArgs::Spin { ns: 1_000 });
        ch.submit(&[m, Method::SetRef { value: 1 }]);
        let t0 = Instant::now();
        while ch.ctrl.load(ControlPage::REF) != 1 {
            assert!(t0.elapsed() < Duration::from_secs(20), "the submission ran");
            std::thread::sleep(Duration::from_millis(1));
        }
        wanted
    };
    assert_eq!(
        doorbell_wanted_after_creation(10_000_000_000),
        0,
        "polling: no doorbell asked for"
    );
    assert!(
        doorbell_wanted_after_creation(0) > 0,
        "no poll: asleep with the doorbell armed"
    );
}

/// The REF values seen on `ch` (each change once) until it reads `last` or 20 s pass,
/// looking again after `pause` (spinning without one).
fn watch_ref(ch: &common::Chan, last: u32, pause: Option<std::time::Duration>) -> Vec<u32> {
    use vgpu_protocol::ControlPage;
    let t0 = std::time::Instant::now();
    let mut seen = vec![];
    while ch.ctrl.load(ControlPage::REF) != last && t0.elapsed().as_secs() < 20 {
        let r = ch.ctrl.load(ControlPage::REF);
        if seen.last() != Some(&r) {
            seen.push(r);
        }
        match pause {
            Some(p) => std::thread::sleep(p),
            None => std::hint::spin_loop(),
        }
    }
    seen
}

/// The fake with kernels that never write their fence signal themselves, as a real GPU's
/// large grids: every entry's REF write is left owed, for the next op of its batch or
/// the front end's store once the batch's mark is reached (`DueRef`).
fn owing_gpu() -> Arc<FakeCudaGpu> {
    owing_gpu_with(CudaConfig {
        vram_bytes: 64 << 20,
        ..Default::default()
    })
}

fn owing_gpu_with(cfg: CudaConfig) -> Arc<FakeCudaGpu> {
    let dev = Arc::new(FakeDevice::default());
    dev.set_kernel_signals(FakeSignals::None);
    FakeCudaGpu::with_device(dev, cfg).unwrap()
}

#[test]
fn owed_ref_every_kernel_on_vram() {
    every_kernel_on_vram(&owing_gpu());
}

#[test]
fn owed_ref_semaphores_order_channels() {
    semaphores_order_channels(&owing_gpu());
}

#[test]
fn owed_ref_fence_signals_before_its_batch_ends() {
    fence_signals_before_its_batch_ends(&owing_gpu());
}

#[test]
fn owed_ref_fence_wake_up_comes_when_ref_reaches_the_armed_value() {
    fence_wake_up_comes_when_ref_reaches_the_armed_value(&owing_gpu());
}

#[test]
fn owed_ref_resumed_channel_continues_at_its_saved_position() {
    resumed_channel_continues_at_its_saved_position(&owing_gpu());
}

/// Stages one GP entry: a kernel spinning `ns` on the GPU, then `SET_REF value`.
fn stage_spin(ch: &mut common::Chan, ns: u64, value: u32) {
    let m = ch.launch(&vgpu_protocol::KernelArgs::Spin { ns });
    ch.stage(&[m, vgpu_protocol::Method::SetRef { value }]);
}

/// Kernels that cannot signal themselves (issue 34): of a loop of entries published at
/// once, each entry's REF write rides on the next kernel of its batch, which does it as
/// it starts, and the front end stores the batch's last once its mark is reached: no
/// stream write between kernels. REF never runs ahead of the work (it moves in order, to
/// each entry's value) and ends at the last. (Entries of any length, the default: see
/// `owed_ref_of_long_entries_is_left_to_marks` for the option.)
#[test]
fn owed_ref_writes_ride_on_the_next_kernel() {
    use std::time::Duration;
    use vgpu_host_shim::cuda::plan::Op;
    use vgpu_protocol::ControlPage;
    const T: Duration = Duration::from_secs(20);
    let g = owing_gpu_with(CudaConfig {
        vram_bytes: 64 << 20,
        mark_owed_ref_over_ns: u64::MAX,
        ..Default::default()
    });
    let p = common::Proc::new(&g, common::SYS_BASE);
    let mut ch = p.channel(0);
    let entries = 64u32;
    for i in 0..entries {
        stage_spin(&mut ch, 200_000, 1 + i);
    }
    let log_before = g.device().log.ops.lock().unwrap().len();
    ch.publish();
    let seen = watch_ref(&ch, entries, Some(Duration::from_micros(50)));
    ch.wait_idle(T).unwrap();
    assert_eq!(
        ch.ctrl.load(ControlPage::REF),
        entries,
        "every fence reached"
    );
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "REF moved in order: {seen:?}"
    );
    assert!(seen.len() > 8, "REF moved entry by entry: {seen:?}");
    let ops = g.device().log.ops.lock().unwrap()[log_before..].to_vec();
    let launches = ops
        .iter()
        .filter(|o| matches!(o, Op::LaunchSignal(..)))
        .count();
    let stream_writes = ops
        .iter()
        .filter(|o| matches!(o, Op::WriteValue { .. }))
        .count();
    assert_eq!(launches, entries as usize);
    assert_eq!(stream_writes, 0, "no stream REF writes");
    assert!(
        g.device().log.kernel_prior_writes.load(Ordering::Relaxed) > 0,
        "kernels did the prior writes"
    );
}

/// A channel whose entries are long (`CudaConfig::mark_owed_ref_over_ns`, by their
/// recent mean) leaves each owed REF write to a completion mark instead of the next
/// kernel: once the front end knows the entries' length, a mark per entry, no kernel's
/// prior write and no stream write, and REF still moves in order to the last value.
#[test]
fn owed_ref_of_long_entries_is_left_to_marks() {
    use std::time::Duration;
    use vgpu_host_shim::cuda::plan::Op;
    use vgpu_protocol::ControlPage;
    const T: Duration = Duration::from_secs(20);
    let g = owing_gpu_with(CudaConfig {
        vram_bytes: 64 << 20,
        mark_owed_ref_over_ns: 50_000,
        ..Default::default()
    });
    let p = common::Proc::new(&g, common::SYS_BASE);
    let mut ch = p.channel(0);
    // A few entries first: the front end learns how long they take (eight: each one's
    // time is good to within a stream thread's wake-up, up to a millisecond on a loaded
    // machine, where four once left the mean under the threshold).
    for i in 0..8 {
        stage_spin(&mut ch, 500_000, 1 + i);
        ch.publish();
        ch.wait_idle(T).unwrap();
    }
    let entries = 24u32;
    for i in 0..entries {
        stage_spin(&mut ch, 500_000, 9 + i);
    }
    let log_before = g.device().log.ops.lock().unwrap().len();
    let marks_before = g.frontend_counts().end_marks;
    let priors_before = g.device().log.kernel_prior_writes.load(Ordering::Relaxed);
    ch.publish();
    let seen = watch_ref(&ch, 8 + entries, Some(Duration::from_micros(50)));
    ch.wait_idle(T).unwrap();
    assert_eq!(ch.ctrl.load(ControlPage::REF), 8 + entries);
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "REF moved in order: {seen:?}"
    );
    assert!(seen.len() > 8, "REF moved entry by entry: {seen:?}");
    assert_eq!(
        g.device().log.kernel_prior_writes.load(Ordering::Relaxed) - priors_before,
        0,
        "no kernel did a prior write"
    );
    let ops = g.device().log.ops.lock().unwrap()[log_before..].to_vec();
    assert!(
        !ops.iter().any(|o| matches!(o, Op::WriteValue { .. })),
        "no stream REF writes: {ops:?}"
    );
    assert_eq!(
        g.frontend_counts().end_marks - marks_before,
        u64::from(entries),
        "a mark after every entry"
    );
}

/// A channel whose entries have not been timed yet leaves each owed REF write to a
/// mark (`CudaConfig::mark_owed_ref_over_ns`: a loop of long kernels published at once
/// would otherwise pay the kernel's store before the front end learns their length);
/// once its entries are known to be short, the writes ride on the next kernel.
#[test]
fn owed_ref_of_an_untimed_channel_is_left_to_marks_until_its_entries_are_known() {
    use std::time::Duration;
    use vgpu_host_shim::cuda::plan::Op;
    use vgpu_protocol::ControlPage;
    const T: Duration = Duration::from_secs(20);
    let g = owing_gpu_with(CudaConfig {
        vram_bytes: 64 << 20,
        mark_owed_ref_over_ns: 200_000_000,
        ..Default::default()
    });
    let p = common::Proc::new(&g, common::SYS_BASE);
    let mut ch = p.channel(0);
    let priors = || g.device().log.kernel_prior_writes.load(Ordering::Relaxed);
    // The first entry spins 30 ms: the three behind it are planned long before the
    // front end has timed any.
    let first = 4u32;
    for i in 0..first {
        stage_spin(&mut ch, if i == 0 { 30_000_000 } else { 100_000 }, 1 + i);
    }
    let marks_before = g.frontend_counts().end_marks;
    ch.publish();
    ch.wait_idle(T).unwrap();
    assert_eq!(ch.ctrl.load(ControlPage::REF), first);
    assert_eq!(
        priors(),
        0,
        "no kernel did a prior write before the entries were timed"
    );
    assert!(
        g.frontend_counts().end_marks - marks_before >= u64::from(first),
        "a mark after every entry"
    );
    // Timed now, and far under the threshold: a loop's writes ride on its kernels.
    let entries = 32u32;
    for i in 0..entries {
        stage_spin(&mut ch, 100_000, first + 1 + i);
    }
    let log_before = g.device().log.ops.lock().unwrap().len();
    ch.publish();
    ch.wait_idle(T).unwrap();
    assert_eq!(ch.ctrl.load(ControlPage::REF), first + entries);
    assert!(priors() > 0, "kernels did the prior writes once timed");
    let ops = g.device().log.ops.lock().unwrap()[log_before..].to_vec();
    assert!(
        !ops.iter().any(|o| matches!(o, Op::WriteValue { .. })),
        "no stream REF writes: {ops:?}"
    );
}

/// A kernel that cannot do the REF write the batch owes as it starts (the stencil) starts
/// a batch of its own instead of taking a stream write before it: the mark between takes
/// the write, and the stream holds the kernels and marks alone. REF still ends at the
/// last entry's value, moving only forward.
#[test]
fn owed_ref_before_a_stencil_ends_the_batch_instead_of_a_stream_write() {
    use std::time::Duration;
    use vgpu_host_shim::cuda::plan::Op;
    use vgpu_protocol::{ControlPage, KernelArgs, Method};
    const T: Duration = Duration::from_secs(20);
    let g = owing_gpu();
    let p = common::Proc::new(&g, common::SYS_BASE);
    let mut ch = p.channel(0);
    let (a, b) = (
        common::SYS_VA + common::DATA_OFF,
        common::SYS_VA + common::DATA_OFF + 0x1_0000,
    );
    let entries = 32u32;
    for i in 0..entries {
        let (src, dst) = if i % 2 == 0 { (a, b) } else { (b, a) };
        let m = ch.launch(&KernelArgs::Stencil2d {
            src,
            dst,
            width: 64,
            height: 64,
            c_center: 0.5,
            c_neighbor: 0.125,
        });
        ch.stage(&[m, Method::SetRef { value: 1 + i }]);
    }
    let log_before = g.device().log.ops.lock().unwrap().len();
    let marks_before = g.frontend_counts().end_marks;
    ch.publish();
    let seen = watch_ref(&ch, entries, None);
    ch.wait_idle(T).unwrap();
    assert_eq!(ch.ctrl.load(ControlPage::REF), entries);
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "REF moved forward only: {seen:?}"
    );
    let ops = g.device().log.ops.lock().unwrap()[log_before..].to_vec();
    let writes = ops
        .iter()
        .filter(|o| matches!(o, Op::WriteValue { .. }))
        .count();
    assert_eq!(writes, 0, "no stream REF writes: {ops:?}");
    assert_eq!(
        g.frontend_counts().end_marks - marks_before,
        u64::from(entries),
        "a mark between every two stencils"
    );
}

/// A REF write left owed is never lost: a channel whose fetch is held right after its
/// last kernel was issued (a VRAM move, a migration's pause) drains only once the REF
/// write is done, and REF then names the last entry.
#[test]
fn owed_ref_is_written_before_a_held_channel_counts_as_drained() {
    use std::time::{Duration, Instant};
    use vgpu_host_shim::hal::Gpu;
    use vgpu_protocol::{ControlPage, KernelArgs, Method};
    const T: Duration = Duration::from_secs(20);
    // A mark per entry: every sweep issues one entry and may leave its REF owed.
    let g = owing_gpu_with(CudaConfig {
        vram_bytes: 64 << 20,
        batch: 1,
        ..Default::default()
    });
    let p = common::Proc::new(&g, common::SYS_BASE);
    let mut ch = p.channel(0);
    for i in 0..8u32 {
        let m = ch.launch(&KernelArgs::Spin { ns: 2_000_000 });
        ch.stage(&[m, Method::SetRef { value: 1 + i }]);
    }
    let before = g.frontend_counts().entries;
    ch.publish();
    // Hold the fetch while the front end is still issuing (its first entry is out, the
    // rest take 2 ms each): whatever it issued last may have left its REF write owed.
    let t0 = Instant::now();
    while g.frontend_counts().entries == before {
        assert!(t0.elapsed() < T, "the front end issues the first entry");
        std::thread::sleep(Duration::from_micros(50));
    }
    assert!(g.hold_fetch(ch.id, true).unwrap());
    let t0 = Instant::now();
    while g.fetched_done(ch.id).unwrap() != Some(true) {
        assert!(t0.elapsed() < T, "the held channel drains");
        std::thread::sleep(Duration::from_micros(200));
    }
    let get = ch.ctrl.load(ControlPage::GP_GET);
    let reference = ch.ctrl.load(ControlPage::REF);
    let issued = g.frontend_counts().entries - before;
    assert!(issued > 0, "some entries were issued before the hold");
    // GP_GET follows at the front end's next retire; REF was stored by the drain.
    assert_eq!(
        u64::from(reference),
        issued,
        "drained: REF names the last entry issued (GP_GET {get})"
    );
    assert!(g.hold_fetch(ch.id, false).unwrap());
    ch.wait_idle(T).unwrap();
    assert_eq!(ch.ctrl.load(ControlPage::REF), 8);
}

/// With a mark per entry, each entry's owed REF write is the front end's store once its
/// mark is reached, not a stream write: the stream holds the kernels alone, and REF shows
/// the entries' values in turn, each soon after its kernel ends.
#[test]
fn owed_ref_of_each_batch_is_stored_by_the_front_end_at_its_mark() {
    use std::time::Duration;
    use vgpu_host_shim::cuda::plan::Op;
    use vgpu_protocol::{ControlPage, KernelArgs, Method};
    const T: Duration = Duration::from_secs(20);
    let g = owing_gpu_with(CudaConfig {
        vram_bytes: 64 << 20,
        batch: 1,
        ..Default::default()
    });
    let p = common::Proc::new(&g, common::SYS_BASE);
    let mut ch = p.channel(0);
    let entries = 4u32;
    for i in 0..entries {
        let m = ch.launch(&KernelArgs::Spin { ns: 20_000_000 });
        ch.stage(&[m, Method::SetRef { value: 1 + i }]);
    }
    let before = g.device().log.ops.lock().unwrap().len();
    ch.publish();
    let mut seen = watch_ref(&ch, entries, Some(Duration::from_micros(200)));
    seen.insert(0, 0);
    ch.wait_idle(T).unwrap();
    seen.push(ch.ctrl.load(ControlPage::REF));
    seen.dedup();
    // Each value stands ~20 ms; a front end stalled that long on a loaded machine could
    // store two in one sweep, so the watcher may miss one, never see one out of order.
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]) && seen.last() == Some(&4) && seen.len() >= 4,
        "REF took the entries' values in turn: {seen:?}"
    );
    let kinds: Vec<&str> = g.device().log.ops.lock().unwrap()[before..]
        .iter()
        .map(|o| match o {
            Op::LaunchSignal(..) => "kernel",
            Op::WriteValue { .. } => "write",
            _ => "other",
        })
        .collect();
    assert_eq!(kinds, ["kernel"; 4]);
}

/// Where some kernels write their REF themselves (one-block grids, on the GPU) and others
/// leave it to the front end's store at their mark, REF still moves only forward, in
/// order, through the entries' values: a store at a mark never undoes a later value the
/// GPU wrote meanwhile (`DueRef`).
#[test]
fn owed_ref_stores_and_kernel_signals_keep_ref_in_order() {
    use std::time::Duration;
    use vgpu_protocol::{ControlPage, KernelArgs, Method};
    const T: Duration = Duration::from_secs(20);
    for batch in [1, 4] {
        let dev = Arc::new(FakeDevice::default());
        dev.set_kernel_signals(FakeSignals::OneBlock);
        let g = FakeCudaGpu::with_device(
            dev,
            CudaConfig {
                vram_bytes: 64 << 20,
                batch,
                ..Default::default()
            },
        )
        .unwrap();
        let p = common::Proc::new(&g, common::SYS_BASE);
        let mut ch = p.channel(0);
        let entries = 48u32;
        for i in 0..entries {
            let kernel = if i % 3 == 0 {
                KernelArgs::Spin { ns: 300_000 }
            } else {
                KernelArgs::Empty
            };
            let m = ch.launch(&kernel);
            ch.stage(&[m, Method::SetRef { value: 1 + i }]);
        }
        ch.publish();
        let seen = watch_ref(&ch, entries, None);
        ch.wait_idle(T).unwrap();
        assert_eq!(ch.ctrl.load(ControlPage::REF), entries, "batch {batch}");
        assert!(
            seen.windows(2).all(|w| w[0] < w[1]),
            "batch {batch}: REF moved forward only: {seen:?}"
        );
    }
}

/// Completion marks are shared by a batch of entries while the active channels belong to
/// one context (its second channel, active, does not stop it), and not while a channel of
/// another context is active (the scheduler charges contexts apart: a shared mark would
/// blur their busy time), not even by the first batch of a channel that was quiet.
#[test]
fn fake_marks_are_shared_within_one_context_not_across_two() {
    use std::time::Duration;
    use vgpu_protocol::{KernelArgs, Method};
    const T: Duration = Duration::from_secs(20);
    let entries_per_mark = |other_context: bool| {
        let g = gpu();
        let a = common::Proc::new(&g, common::SYS_BASE);
        let b = common::Proc::new(&g, common::SYS_BASE + (64 << 20));
        // The other channel has an entry in flight for the whole run below (its stream
        // runs beside this one's): active throughout, however slow the machine. (An
        // entry run just before, active for `batch_quiet_ns`, once went quiet midway on
        // a loaded machine.)
        let mut other = if other_context {
            b.channel(0)
        } else {
            a.channel(1)
        };
        let issued = g.frontend_counts().entries;
        let m = other.launch(&KernelArgs::Spin { ns: 300_000_000 });
        other.submit(&[m, Method::SetRef { value: 1 }]);
        let t0 = std::time::Instant::now();
        while g.frontend_counts().entries == issued {
            assert!(t0.elapsed() < T, "the other channel's entry is issued");
            std::thread::sleep(Duration::from_micros(50));
        }
        let mut ch = a.channel(0);
        let entries = 48u32;
        for i in 0..entries {
            let m = ch.launch(&KernelArgs::Spin { ns: 100_000 });
            ch.stage(&[m, Method::SetRef { value: 1 + i }]);
        }
        let before = g.frontend_counts();
        ch.publish();
        ch.wait_idle(T).unwrap();
        let after = g.frontend_counts();
        other.wait_idle(T).unwrap();
        (after.entries - before.entries) as f64 / (after.end_marks - before.end_marks) as f64
    };
    let one_context = entries_per_mark(false);
    let two_contexts = entries_per_mark(true);
    assert!(
        one_context >= 4.0,
        "one context's channels share marks: {one_context} entries per mark"
    );
    assert_eq!(two_contexts, 1.0, "two contexts: a mark per entry");
}

/// A context alone on the GPU gets completion marks without timing for batches queued
/// behind its own work (an event with timing costs the GPU ~1.4 µs between kernels) and
/// is still charged its busy time, up to when the front end saw each mark reached; a
/// batch to an idle stream, and every batch while another context is active, gets a
/// timed mark, so the timeline splits the GPU between contexts.
#[test]
fn fake_marks_are_untimed_only_while_a_context_is_alone() {
    use std::time::Duration;
    use vgpu_host_shim::hal::Gpu;
    use vgpu_protocol::{KernelArgs, Method};
    const T: Duration = Duration::from_secs(20);
    let g = gpu();
    let a = common::Proc::new(&g, common::SYS_BASE);
    let b = common::Proc::new(&g, common::SYS_BASE + (64 << 20));
    let untimed = || g.device().log.untimed_marks.load(Ordering::Relaxed);
    let mut ch = a.channel(0);
    // The first entry (`first_ns`) is issued to an idle stream; the others queue behind it.
    let run = |ch: &mut common::Chan, first: u32, first_ns: u64| {
        let issued = g.frontend_counts().entries;
        for i in 0..8 {
            let ns = if i == 0 { first_ns } else { 1_000_000 };
            let m = ch.launch(&KernelArgs::Spin { ns });
            ch.submit(&[m, Method::SetRef { value: first + i }]);
            let t0 = std::time::Instant::now();
            while i == 0 && g.frontend_counts().entries == issued {
                assert!(t0.elapsed() < T, "the first entry is issued");
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        ch.wait_idle(T).unwrap();
    };
    // One entry to an idle stream: nothing before it to delay, a timed mark.
    let before = untimed();
    let m = ch.launch(&KernelArgs::Spin { ns: 1_000 });
    ch.submit(&[m, Method::SetRef { value: 0 }]);
    ch.wait_idle(T).unwrap();
    assert_eq!(untimed(), before, "alone, an idle stream: a timed mark");
    // 100 ms: 20 ms was once too short on a loaded machine, where the front end did not
    // issue the next entries before the first had run, so they too went to an idle stream.
    run(&mut ch, 1, 100_000_000);
    assert!(
        untimed() > before,
        "alone, queued behind its own work: untimed marks"
    );
    let busy = g.channel_counters(ch.id).unwrap().busy_ns;
    assert!(
        busy >= 107_000_000,
        "alone: charged {busy} ns for 107 ms of kernels"
    );
    // The other context has run an entry just now: active for `batch_quiet_ns`.
    let mut other = b.channel(0);
    let m = other.launch(&KernelArgs::Spin { ns: 1_000 });
    other.submit(&[m, Method::SetRef { value: 1 }]);
    other.wait_idle(T).unwrap();
    let before = untimed();
    // 20 ms: every entry is issued within `batch_quiet_ns` (100 ms) of the other's.
    run(&mut ch, 9, 20_000_000);
    assert_eq!(untimed(), before, "two contexts: every mark timed");
}

/// A destroyed channel's fence-signal counter serves the next channel: no driver
/// allocation for it, and zeroed first even if a kernel left it counting.
#[test]
fn fake_a_destroyed_channels_signal_counter_is_zeroed_for_the_next_channel() {
    use std::collections::HashSet;
    use std::time::{Duration, Instant};
    use vgpu_host_shim::hal::Gpu;
    use vgpu_protocol::{ControlPage, KernelArgs, Method};
    let g = gpu();
    let p = common::Proc::new(&g, common::SYS_BASE);
    let allocations = || -> HashSet<u64> { g.device().device_allocations().into_iter().collect() };
    let run_fenced = |ch: &mut common::Chan, values: std::ops::RangeInclusive<u32>| {
        for v in values {
            let m = ch.launch(&KernelArgs::Empty);
            ch.submit(&[m, Method::SetRef { value: v }]);
            let t0 = Instant::now();
            while ch.ctrl.load(ControlPage::REF) != v {
                assert!(t0.elapsed() < Duration::from_secs(20), "REF {v}");
                std::thread::yield_now();
            }
        }
    };
    let before = allocations();
    let mut first = p.channel(0);
    let made: Vec<u64> = allocations().difference(&before).copied().collect();
    assert_eq!(made.len(), 1, "the channel's counter: {made:x?}");
    let counter = made[0];
    run_fenced(&mut first, 1..=3);
    g.destroy_channel(first.id).unwrap();
    assert!(
        allocations().contains(&counter),
        "kept for the next channel"
    );
    // As a kernel that faulted halfway would leave it.
    // SAFETY: the fake's device memory is host memory; the counter's 256 bytes are live
    // (kept) and no channel uses them now.
    unsafe { std::ptr::write_bytes(counter as *mut u8, 0xff, 4) };
    let held = allocations();
    let mut second = p.channel(1);
    assert_eq!(
        allocations(),
        held,
        "no new allocation for the second channel"
    );
    // SAFETY: as above; the second channel's kernels have not run yet.
    let count = unsafe { std::ptr::read(counter as *const u32) };
    assert_eq!(count, 0, "zeroed");
    run_fenced(&mut second, 1..=3);
}
