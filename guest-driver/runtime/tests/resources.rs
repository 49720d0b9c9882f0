//! Resource lifetime: buffers, channels and contexts give back what they took.

mod common;

use vgpu_guest::{Error, MemKind, PageSize, BIG_BASE};
use vgpu_host_shim::hal::Gpu;

#[test]
fn dropping_everything_frees_vram() {
    let (gpu, dev) = common::device();
    let before = gpu.vram_free_bytes();
    {
        let ctx = dev.create_context().unwrap();
        let a = ctx.alloc_vram(1 << 20).unwrap();
        let b = ctx.alloc_vram(5000).unwrap();
        let _h = ctx.alloc_host(1 << 20).unwrap();
        let _ch = ctx.create_channel().unwrap();
        assert!(gpu.vram_free_bytes() <= before - (1 << 20) - 8192);
        drop(a);
        assert!(gpu.vram_free_bytes() <= before - 8192);
        drop(b);
    }
    assert_eq!(gpu.vram_free_bytes(), before);
}

#[test]
fn buffers_keep_their_context_alive() {
    let (gpu, dev) = common::device();
    let before = gpu.vram_free_bytes();
    let ctx = dev.create_context().unwrap();
    let buf = ctx.alloc_vram(64 << 10).unwrap();
    let mut ch = ctx.create_channel().unwrap();
    drop(ctx);
    // The address space is still usable through the survivors.
    buf.write_u32(0, &[1, 2, 3]).unwrap();
    ch.launch(
        &vgpu_guest::KernelArgs::Memset {
            dst: buf.gpu_va(),
            len: 8,
            pattern: 9,
        },
        [1, 1, 1],
    )
    .unwrap();
    ch.finish().unwrap();
    assert_eq!(buf.read_u32_vec(0, 3).unwrap(), vec![9, 9, 3]);
    drop(ch);
    drop(buf);
    assert_eq!(gpu.vram_free_bytes(), before);
}

#[test]
fn page_sizes_guard_gaps_and_address_reuse() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    let small = ctx.alloc_vram(4096).unwrap();
    let big = ctx.alloc(MemKind::Vram, 64 << 10).unwrap();
    assert_eq!(small.page_size(), PageSize::Small4K);
    assert_eq!(big.page_size(), PageSize::Big64K);
    assert_eq!(big.gpu_va() % (64 << 10), 0);
    assert!(big.gpu_va() >= BIG_BASE);
    let next = ctx.alloc_vram(64 << 10).unwrap();
    assert!(next.gpu_va() >= big.gpu_va() + (128 << 10), "guard gap");
    let va = next.gpu_va();
    drop(next);
    assert_eq!(ctx.alloc_vram(64 << 10).unwrap().gpu_va(), va, "VA reused");
}

#[test]
fn cpu_access_is_bounds_checked() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    for buf in [ctx.alloc_vram(100).unwrap(), ctx.alloc_host(100).unwrap()] {
        assert_eq!(buf.len(), 100);
        buf.write(96, &[1, 2, 3, 4]).unwrap();
        assert!(matches!(
            buf.write(97, &[0; 4]),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            buf.write(u64::MAX, &[0; 1]),
            Err(Error::OutOfBounds { .. })
        ));
        let mut out = [0u8; 4];
        assert!(buf.read(100, &mut [0u8; 1]).is_err());
        buf.read(96, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3, 4]);
        // Unaligned typed access works; past the end it fails.
        buf.write_f32(1, &[1.5, -2.0]).unwrap();
        assert_eq!(buf.read_f32_vec(1, 2).unwrap(), vec![1.5, -2.0]);
        assert!(buf.read_f32_vec(0, 26).is_err());
        assert!(buf.write_u32(98, &[0]).is_err());
        buf.fill(0, 100, 0xab).unwrap();
        assert!(buf.fill(1, 100, 0).is_err());
    }
    assert!(matches!(ctx.alloc_vram(0), Err(Error::InvalidArgument(_))));
    assert!(ctx.alloc_vram(1 << 40).is_err());
}

#[test]
fn contexts_and_channels_run_out_cleanly() {
    let (_gpu, dev) = common::device();
    // The sim allows 16 contexts: the 17th fails with an error, not a panic.
    let ctxs: Vec<_> = (0..16).map(|_| dev.create_context().unwrap()).collect();
    let e = dev.create_context().unwrap_err();
    assert_eq!(e.code(), vgpu_guest::ErrorCode::LimitExceeded);
    drop(ctxs);
    dev.create_context().unwrap();
    assert_eq!(dev.info().transport, "native");
    assert_eq!(dev.info().max_contexts, 16);
}

/// Memsets `len` bytes of `buf` to `pattern` through `ch` and checks them.
fn memset_through(ch: &mut vgpu_guest::Channel, buf: &vgpu_guest::Buffer, pattern: u32) {
    for _ in 0..3 {
        ch.launch(
            &vgpu_guest::KernelArgs::Memset {
                dst: buf.gpu_va(),
                len: 64,
                pattern,
            },
            [1, 1, 1],
        )
        .unwrap();
        ch.submit().unwrap();
    }
    ch.finish().unwrap();
    assert_eq!(buf.read_u32_vec(0, 16).unwrap(), vec![pattern; 16]);
}

#[test]
fn channels_on_a_destroyed_channels_memory_run_and_never_share_it() {
    // (That the memory is reused is checked inside the crate: `channel.rs`'s tests.)
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    let buf = ctx.alloc_vram(4096).unwrap();
    let mut first = ctx.create_channel().unwrap();
    memset_through(&mut first, &buf, 7);
    drop(first);
    let mut second = ctx.create_channel().unwrap();
    memset_through(&mut second, &buf, 9);
    // Two live channels never share memory.
    let mut third = ctx.create_channel().unwrap();
    assert_ne!(third.ring_va(), second.ring_va());
    memset_through(&mut third, &buf, 11);
    drop(second);
    // A channel of another size gets memory of its own.
    let bigger = vgpu_guest::ChannelOptions {
        gp_entries: 4096,
        ..Default::default()
    };
    let mut other = ctx.create_channel_with(bigger).unwrap();
    assert_ne!(other.ring_va(), third.ring_va());
    memset_through(&mut other, &buf, 13);
}

#[test]
fn contexts_keeping_a_spare_channel_memory_are_still_freed() {
    // The sim allows 16 contexts: a spare channel memory that kept its context alive
    // would run them out.
    let (gpu, dev) = common::device();
    let before = gpu.vram_free_bytes();
    for i in 0..40 {
        let ctx = dev
            .create_context()
            .unwrap_or_else(|e| panic!("context {i}: {e}"));
        let buf = ctx.alloc_vram(4096).unwrap();
        let mut ch = ctx.create_channel().unwrap();
        memset_through(&mut ch, &buf, i);
        drop(ch);
        let _second = ctx.create_channel().unwrap();
        drop(ctx.create_channel().unwrap());
    }
    assert_eq!(gpu.vram_free_bytes(), before);
}
