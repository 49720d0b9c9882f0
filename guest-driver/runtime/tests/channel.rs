//! Channel behaviour on the sim GPU: faults, ring and arena wrap-around, raw entries,
//! timeouts and semaphores.

mod common;

use std::time::Duration;

use vgpu_guest::{
    ChannelOptions, Error, ErrorCode, KernelArgs, KernelId, SemaphoreMode, SMALL_BASE,
};

fn is_fault(e: &Error, code: ErrorCode) -> bool {
    matches!(e, Error::ChannelFault { code: c, .. } if *c == code)
}

#[test]
fn mmu_fault_is_reported_and_other_channels_keep_working() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    let y = ctx.alloc_vram(4096).unwrap();
    let mut bad = ctx.create_channel().unwrap();
    let mut good = ctx.create_channel().unwrap();

    // Below the runtime's first buffer: never mapped.
    let unmapped = SMALL_BASE - 0x10_0000;
    bad.launch(
        &KernelArgs::Saxpy {
            x: unmapped,
            y: y.gpu_va(),
            n: 16,
            a: 1.0,
        },
        [1, 1, 1],
    )
    .unwrap();
    let f = bad.submit().unwrap();
    let e = bad.wait_timeout(f, Duration::from_secs(10)).unwrap_err();
    assert!(is_fault(&e, ErrorCode::MmuFault), "{e}");
    assert_eq!(e.code(), ErrorCode::MmuFault);
    let (code, info) = bad.error().unwrap();
    assert_eq!(code, ErrorCode::MmuFault);
    assert!(
        (unmapped..unmapped + 64).contains(&info),
        "fault address {info:#x}"
    );
    // Further submissions on the dead channel fail instead of hanging.
    assert!(bad.submit().is_err() || bad.wait_timeout(f, Duration::from_secs(1)).is_err());

    good.launch(
        &KernelArgs::Memset {
            dst: y.gpu_va(),
            len: 4096,
            pattern: 0xdead_beef,
        },
        [1, 1, 1],
    )
    .unwrap();
    good.finish().unwrap();
    assert!(y
        .read_u32_vec(0, 1024)
        .unwrap()
        .iter()
        .all(|&v| v == 0xdead_beef));
    assert!(good.error().is_none());

    // A fresh context is unaffected too.
    let ctx2 = dev.create_context().unwrap();
    let mut ch2 = ctx2.create_channel().unwrap();
    ch2.finish().unwrap();
}

#[test]
fn guard_gap_after_a_buffer_faults() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    let a = ctx.alloc_vram(4096).unwrap();
    let _b = ctx.alloc_vram(4096).unwrap();
    let mut ch = ctx.create_channel().unwrap();
    // One byte too many runs into the guard page.
    ch.launch(
        &KernelArgs::Memset {
            dst: a.gpu_va(),
            len: 4096 + 4,
            pattern: 1,
        },
        [1, 1, 1],
    )
    .unwrap();
    let f = ch.submit().unwrap();
    let e = ch.wait_timeout(f, Duration::from_secs(10)).unwrap_err();
    assert!(is_fault(&e, ErrorCode::MmuFault), "{e}");
}

/// 1000 submissions, each a memset of its own slot whose argument block must survive
/// until the GPU reads it; a short spin now and then keeps entries in flight.
fn wrap_test(opts: ChannelOptions) {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    let out = ctx.alloc_host(4 * 1000).unwrap();
    let mut ch = ctx.create_channel_with(opts).unwrap();
    let mut fences = Vec::new();
    for i in 0..1000u32 {
        if i % 50 == 0 {
            ch.launch(&KernelArgs::Spin { ns: 50_000 }, [1, 1, 1])
                .unwrap();
        }
        ch.launch(
            &KernelArgs::Memset {
                dst: out.gpu_va() + 4 * i as u64,
                len: 4,
                pattern: i ^ 0x5a5a_0000,
            },
            [1, 1, 1],
        )
        .unwrap();
        fences.push(ch.submit().unwrap());
    }
    ch.wait(*fences.last().unwrap()).unwrap();
    for f in &fences {
        assert!(ch.is_complete(*f).unwrap());
    }
    assert_eq!(ch.submitted(), 1000);
    assert_eq!(ch.gp_get(), ch.gp_put());
    let v = out.read_u32_vec(0, 1000).unwrap();
    for (i, &x) in v.iter().enumerate() {
        assert_eq!(x, i as u32 ^ 0x5a5a_0000, "slot {i}");
    }
}

#[test]
fn ring_wraps_without_corrupting_work_in_flight() {
    // The 4-entry ring is the limit: submissions wait for GP_GET to free a slot.
    wrap_test(ChannelOptions {
        gp_entries: 4,
        pushbuf_bytes: 64 << 10,
        arg_bytes: 64 << 10,
    });
}

#[test]
fn arenas_wrap_without_corrupting_work_in_flight() {
    // The 4 KiB arenas are the limit: push buffers and argument blocks are reused only
    // once the submissions that used them completed.
    wrap_test(ChannelOptions {
        gp_entries: 1024,
        pushbuf_bytes: 4096,
        arg_bytes: 4096,
    });
}

#[test]
fn many_launches_in_one_submission_fill_the_arg_arena() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    let out = ctx.alloc_host(4096).unwrap();
    let opts = ChannelOptions {
        gp_entries: 2,
        pushbuf_bytes: 4096,
        arg_bytes: 4096,
    };
    let mut ch = ctx.create_channel_with(opts).unwrap();
    // 4096 / 32 bytes per memset argument block: the 129th does not fit.
    let mut n = 0;
    let err = loop {
        let args = KernelArgs::Memset {
            dst: out.gpu_va(),
            len: 4,
            pattern: n,
        };
        match ch.launch(&args, [1, 1, 1]) {
            Ok(()) => n += 1,
            Err(e) => break e,
        }
    };
    assert!(matches!(err, Error::SubmissionTooLarge(_)), "{err}");
    assert_eq!(n, 128);
    // Everything recorded so far is still valid; but 128 launches need 1024 push-buffer
    // words + SET_REF, more than the 4 KiB arena: submit fails without losing them.
    assert!(matches!(ch.submit(), Err(Error::SubmissionTooLarge(_))));
    assert!(ch.has_pending());
}

#[test]
fn malformed_push_buffer_and_gp_entry_fault_the_channel() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();

    let mut ch = ctx.create_channel().unwrap();
    ch.push_raw_words(&[0xff]).unwrap();
    let f = ch.submit().unwrap();
    let e = ch.wait_timeout(f, Duration::from_secs(10)).unwrap_err();
    assert!(is_fault(&e, ErrorCode::BadMethod), "{e}");

    let mut ch = ctx.create_channel().unwrap();
    let mut entry = [0u8; 16];
    entry[0] = 2; // misaligned push-buffer address
    entry[8] = 1;
    let seq = ch.submit_raw_gp(entry).unwrap();
    let e = ch
        .wait_gp_get(seq, Some(Duration::from_secs(10)))
        .unwrap_err();
    assert!(is_fault(&e, ErrorCode::BadGpEntry), "{e}");

    let mut ch = ctx.create_channel().unwrap();
    ch.launch_bytes(KernelId::Spin, [1, 1, 1], &[0; 7]).unwrap();
    let f = ch.submit().unwrap();
    let e = ch.wait_timeout(f, Duration::from_secs(10)).unwrap_err();
    assert!(is_fault(&e, ErrorCode::BadKernelArgs), "{e}");
}

#[test]
fn semaphores_timeouts_and_notify() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    let sem = ctx.alloc_host(4096).unwrap();
    let mut waiter = ctx.create_channel().unwrap();
    let mut signaller = ctx.create_channel().unwrap();

    waiter
        .sem_acquire(sem.gpu_va(), 7, SemaphoreMode::AtLeast)
        .unwrap();
    waiter.notify(0x1234).unwrap();
    let f = waiter.submit().unwrap();
    assert!(matches!(
        waiter.wait_timeout(f, Duration::from_millis(50)),
        Err(Error::Timeout)
    ));
    assert!(!waiter.is_complete(f).unwrap());

    signaller.sem_release_timestamp(sem.gpu_va(), 7).unwrap();
    signaller.finish().unwrap();
    waiter.wait_timeout(f, Duration::from_secs(10)).unwrap();
    assert_eq!(sem.read_u32_vec(0, 1).unwrap()[0], 7);
    assert_ne!(sem.read_u64(8).unwrap(), 0, "timestamp written");
    assert_eq!(waiter.notify_seq(), 1);

    // A fence of one channel means nothing to another.
    assert!(matches!(signaller.wait(f), Err(Error::WrongChannel)));
}

#[test]
fn copies_between_vram_and_host() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    let h = ctx.alloc_host(100_000).unwrap();
    let v = ctx.alloc_vram(100_000).unwrap();
    let back = ctx.alloc_host(100_000).unwrap();
    let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + 3) as u8).collect();
    h.write(0, &data).unwrap();
    let mut ch = ctx.create_channel().unwrap();
    ch.copy(v.gpu_va(), h.gpu_va(), 100_000).unwrap();
    ch.copy(back.gpu_va(), v.gpu_va(), 100_000).unwrap();
    ch.finish().unwrap();
    let mut got = vec![0u8; 100_000];
    back.read(0, &mut got).unwrap();
    assert_eq!(got, data);
    let mut got = vec![0u8; 100_000];
    v.read(0, &mut got).unwrap();
    assert_eq!(got, data);
}

/// A new channel starts with what its context's last application channel learnt of its
/// fence waits, so a program that makes a channel per loop does not start each loop
/// knowing nothing (and nap past its end); the stager's copies teach it nothing.
#[test]
fn a_new_channel_expects_its_contexts_recent_waits() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    let mut first = ctx.create_channel().unwrap();
    assert_eq!(first.expected_wait(), Duration::ZERO, "nothing learnt yet");
    for _ in 0..4 {
        first
            .launch(&KernelArgs::Spin { ns: 2_000_000 }, [1, 1, 1])
            .unwrap();
        let f = first.submit().unwrap();
        first.wait(f).unwrap();
    }
    let learnt = first.expected_wait();
    assert!(learnt >= Duration::from_micros(500), "{learnt:?}");
    // A copy through the stager waits too, on a channel of its own.
    let buf = ctx.alloc_vram(1 << 20).unwrap();
    buf.write_f32(0, &[1.0; 1024]).unwrap();
    let second = ctx.create_channel().unwrap();
    assert_eq!(second.expected_wait(), learnt);
}
