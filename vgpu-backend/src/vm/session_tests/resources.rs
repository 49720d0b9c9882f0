//! Contexts, VRAM, guest mappings and the aperture: validation, ownership, limits.

use super::*;

#[test]
fn info_and_stats() {
    let mut t = T::new();
    match t.req(9, 0, Op::GetInfo).unwrap() {
        ReplyBody::Info(i) => {
            assert_eq!(i.version, PROTOCOL_VERSION);
            assert_eq!(i.vram_bytes, 16 * MIB);
            assert_eq!(i.max_contexts, 4);
            assert_eq!(i.channel_slots, CHANNEL_SLOTS.min(limits().max_channels));
            assert_eq!(i.compute_engines, 1);
        }
        other => panic!("{other:?}"),
    }
    let s = t.stats();
    assert_eq!(
        s,
        StatsReply {
            vram_limit: 16 * MIB,
            ..StatsReply::default()
        }
    );
    let c = t.ctx(1);
    t.alloc(1, c, 8192, 4096);
    let s = t.stats();
    assert_eq!((s.contexts, s.vram_bytes), (1, 8192));
    let shared = t.s.shared().stats();
    assert_eq!(shared.requests, 5);
    assert_eq!(shared.errors, 0);
}

#[test]
fn contexts_are_owned_and_limited() {
    let mut t = T::new();
    let a = t.ctx(100);
    let b = t.ctx(200);
    assert_ne!(a, b);
    assert!(a < 16 && b < 16, "small ids");
    assert_eq!(
        t.req(200, a, Op::DestroyContext),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(t.req(100, 77, Op::DestroyContext), Err(ErrorCode::NotFound));
    assert_eq!(t.req(100, 0, Op::DestroyContext), Err(ErrorCode::NotFound));
    t.ctx(1);
    t.ctx(1);
    assert_eq!(
        t.req(1, 0, Op::CreateContext),
        Err(ErrorCode::LimitExceeded)
    );
    assert_eq!(t.req(100, a, Op::DestroyContext), Ok(ReplyBody::Empty));
    assert_eq!(t.req(100, a, Op::DestroyContext), Err(ErrorCode::NotFound));
    let again = t.ctx(5);
    assert_ne!(
        again, a,
        "a freed context id is not handed out again at once"
    );
    t.check_consistent();
    assert!(t.s.shared().stats().errors >= 5);
}

#[test]
fn alloc_vram_validation_and_limits() {
    let mut t = T::new();
    let c = t.ctx(1);
    let bad = |size, align| Op::AllocVram { size, align };
    for (size, align) in [
        (0, 4096),
        (4096, 0),
        (4096, 3000),
        (4096, 2048),
        (4096, 1 << 31),
        (16 * MIB + 1, 4096),
        (u64::MAX, 4096),
    ] {
        assert_eq!(
            t.req(1, c, bad(size, align)),
            Err(ErrorCode::InvalidArgument),
            "size {size} align {align}"
        );
    }
    let (m, size) = t.alloc(1, c, 100, 4096);
    assert_eq!(size, 4096, "rounded to a page");
    t.alloc(1, c, 8 * MIB, 2 * MIB);
    t.alloc(1, c, 7 * MIB, 4096);
    // 4 KiB + 8 MiB + 7 MiB used: 1 MiB - 4 KiB left.
    assert_eq!(t.req(1, c, bad(MIB, 4096)), Err(ErrorCode::LimitExceeded));
    t.alloc(1, c, MIB - 4096, 4096);
    assert_eq!(t.req(1, c, bad(1, 4096)), Err(ErrorCode::LimitExceeded));
    // Ownership of FREE_MEM.
    let c2 = t.ctx(1);
    let c3 = t.ctx(2);
    assert_eq!(
        t.req(2, c3, Op::FreeMem { mem: m }),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        t.req(1, c2, Op::FreeMem { mem: m }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        t.req(2, c, Op::FreeMem { mem: m }),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        t.req(1, c, Op::FreeMem { mem: 9999 }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(t.req(1, c, Op::FreeMem { mem: m }), Ok(ReplyBody::Empty));
    assert_eq!(
        t.req(1, c, Op::FreeMem { mem: m }),
        Err(ErrorCode::NotFound)
    );
    t.check_consistent();
    // Alloc in someone else's context.
    assert_eq!(
        t.req(2, c, bad(4096, 4096)),
        Err(ErrorCode::PermissionDenied)
    );
    t.s.teardown(&t.shm);
    t.assert_baseline();
}

#[test]
fn map_vram_and_unmap() {
    let mut t = T::new();
    let c = t.ctx(1);
    let (m, _) = t.alloc(1, c, 64 << 10, 64 << 10);
    let (big, _) = t.alloc(1, c, 2 * MIB, 2 * MIB);
    let map = |mem, va, page, flags| Op::MapVram {
        mem,
        flags,
        va,
        page,
    };
    assert_eq!(
        t.req(1, c, map(m, 0x1000, PAGE_64K, 0)),
        Err(ErrorCode::InvalidArgument)
    );
    assert_eq!(
        t.req(1, c, map(m, 1 << 48, PAGE_4K, 0)),
        Err(ErrorCode::InvalidArgument)
    );
    assert_eq!(
        t.req(1, c, map(m, (1 << 48) - 4096, PAGE_4K, 0)),
        Err(ErrorCode::InvalidArgument)
    );
    assert_eq!(
        t.req(1, c, map(m, 0x20_0000, PAGE_2M, 0)),
        Err(ErrorCode::InvalidArgument),
        "object smaller than one 2 MiB page"
    );
    assert_eq!(
        t.req(1, c, map(777, 0x20_0000, PAGE_4K, 0)),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        t.req(1, c, map(m, 0x40_0000, PAGE_64K, MAP_READ_ONLY)),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(t.mapped_pages(c), 1);
    // Overlap with itself and with another object.
    assert_eq!(
        t.req(1, c, map(m, 0x40_0000, PAGE_4K, 0)),
        Err(ErrorCode::InvalidArgument)
    );
    assert_eq!(
        t.req(1, c, map(m, 0x40_f000, PAGE_4K, 0)),
        Err(ErrorCode::InvalidArgument)
    );
    assert_eq!(
        t.req(1, c, map(m, 0x3f_1000, PAGE_4K, 0)),
        Err(ErrorCode::InvalidArgument)
    );
    // Adjacent is fine; a second mapping of the same object too.
    assert_eq!(
        t.req(1, c, map(m, 0x41_0000, PAGE_64K, 0)),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(
        t.req(1, c, map(big, 0x60_0000, PAGE_2M, 0)),
        Ok(ReplyBody::Empty)
    );
    // Another process cannot map or unmap in this context.
    let c2 = t.ctx(2);
    assert_eq!(
        t.req(2, c, map(m, 0x80_0000, PAGE_4K, 0)),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        t.req(2, c2, map(m, 0x80_0000, PAGE_4K, 0)),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        t.req(2, c, Op::Unmap { va: 0x40_0000 }),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        t.req(2, c2, Op::Unmap { va: 0x40_0000 }),
        Err(ErrorCode::NotFound)
    );
    // UNMAP needs the exact start.
    assert_eq!(
        t.req(1, c, Op::Unmap { va: 0x40_1000 }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        t.req(1, c, Op::Unmap { va: 0x40_0000 }),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(
        t.req(1, c, Op::Unmap { va: 0x40_0000 }),
        Err(ErrorCode::NotFound)
    );
    t.check_consistent();
    // FREE_MEM while mapped: every mapping goes first.
    assert_eq!(t.req(1, c, Op::FreeMem { mem: m }), Ok(ReplyBody::Empty));
    assert_eq!(t.s.state().mappings.len(), 1);
    assert_eq!(t.mapped_pages(c), 1, "only the 2 MiB mapping is left");
    t.check_consistent();
    assert_eq!(t.req(1, c, Op::DestroyContext), Ok(ReplyBody::Empty));
    assert_eq!(t.req(2, c2, Op::DestroyContext), Ok(ReplyBody::Empty));
    t.assert_baseline();
}

#[test]
fn map_guest_validation() {
    let mut t = T::new();
    let c = t.ctx(1);
    let mg = |va, page, ranges: Vec<GuestRange>| Op::MapGuest {
        va,
        page,
        flags: 0,
        ranges,
    };
    let inval = Err(ErrorCode::InvalidArgument);
    let cases: Vec<(&str, Op)> = vec![
        ("zero length", mg(0x10_0000, PAGE_4K, vec![range(0, 0)])),
        (
            "unaligned gpa",
            mg(0x10_0000, PAGE_4K, vec![range(0x800, 4096)]),
        ),
        (
            "unaligned len",
            mg(0x10_0000, PAGE_4K, vec![range(0, 4000)]),
        ),
        ("unaligned va", mg(0x10_0800, PAGE_4K, vec![range(0, 4096)])),
        (
            "outside the table",
            mg(0x10_0000, PAGE_4K, vec![range(R0.1, 4096)]),
        ),
        (
            "past a region's end",
            mg(0x10_0000, PAGE_4K, vec![range(R0.1 - 4096, 8192)]),
        ),
        ("huge", mg(0x10_0000, PAGE_4K, vec![range(0, !0xfffu64)])),
        (
            "gpa overflow",
            mg(0x10_0000, PAGE_4K, vec![range(!0xfffu64, 4096)]),
        ),
        (
            "overlapping ranges",
            mg(0x10_0000, PAGE_4K, vec![range(0, 8192), range(4096, 4096)]),
        ),
        (
            "duplicate ranges",
            mg(
                0x10_0000,
                PAGE_4K,
                vec![range(R1.0, 4096), range(R1.0, 4096)],
            ),
        ),
        (
            "va overflow",
            mg((1 << 48) - 4096, PAGE_4K, vec![range(0, 8192)]),
        ),
        (
            "2 MiB page, 4 KiB range",
            mg(0x20_0000, PAGE_2M, vec![range(0, 4096)]),
        ),
        (
            "2 MiB page, region too small",
            mg(0x20_0000, PAGE_2M, vec![range(R2.0, 2 * MIB)]),
        ),
    ];
    for (what, op) in cases {
        assert_eq!(t.req(1, c, op), inval, "{what}");
    }
    assert_eq!(t.s.state().mappings.len(), 0);
    assert_eq!(t.mapped_pages(c), 0);
    // Piecewise mapping of ranges in three regions.
    let ranges = vec![range(R1.0 + 2 * MIB, 2 * MIB), range(R0.0, 2 * MIB)];
    assert_eq!(
        t.req(1, c, mg(0x4000_0000, PAGE_2M, ranges)),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(t.mapped_pages(c), 2);
    assert_eq!(t.stats().mapped_guest_bytes, 4 * MIB);
    // The limit (4 MiB) is reached.
    assert_eq!(
        t.req(1, c, mg(0x1000_0000, PAGE_4K, vec![range(R2.0, 4096)])),
        Err(ErrorCode::LimitExceeded)
    );
    // Overlap with the existing mapping.
    assert_eq!(
        t.req(1, c, Op::Unmap { va: 0x4000_0000 }),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(t.mapped_pages(c), 0);
    let ranges = vec![range(R2.0, 64 << 10), range(R0.0 + 64 * 1024, 128 << 10)];
    assert_eq!(
        t.req(1, c, mg(0x10_0000, PAGE_64K, ranges)),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(t.mapped_pages(c), 3);
    assert_eq!(
        t.req(1, c, mg(0x12_0000, PAGE_64K, vec![range(R1.0, 64 << 10)])),
        Err(ErrorCode::InvalidArgument),
        "overlaps the second piece"
    );
    assert_eq!(
        t.req(1, c, mg(0x13_0000, PAGE_64K, vec![range(R1.0, 64 << 10)])),
        Ok(ReplyBody::Empty),
        "adjacent"
    );
    t.check_consistent();
    // A guest mapping is not a VRAM object.
    assert_eq!(
        t.req(1, c, Op::FreeMem { mem: 1 }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(t.req(1, c, Op::DestroyContext), Ok(ReplyBody::Empty));
    t.check_consistent();
    t.assert_baseline();
}

#[test]
fn map_guest_the_gpu_sees_guest_memory() {
    use vgpu_host_shim::SysMemory;
    let mut t = T::new();
    let c = t.ctx(1);
    let sys = t.s.hal.contexts[&c].1.clone();
    let ranges = vec![range(R1.0, 4096)];
    let op = Op::MapGuest {
        va: 0x1000,
        page: PAGE_4K,
        flags: 0,
        ranges,
    };
    assert_eq!(t.req(1, c, op), Ok(ReplyBody::Empty));
    // The context's SysMemory is this VM's memory, byte for byte.
    use vm_memory::Bytes;
    t.mem.write_slice(b"hello", GuestAddress(R1.0)).unwrap();
    let hr = sys.translate(R1.0, 5).unwrap();
    // SAFETY: `hr` points into the test guest memory, which outlives this read.
    let got = unsafe { std::slice::from_raw_parts(hr.ptr, hr.len) };
    assert_eq!(got, b"hello");
    assert!(sys.translate(R1.0 + R1.1, 1).is_none());
}

#[test]
fn aperture_windows() {
    let mut t = T::new();
    let c = t.ctx(1);
    let (a, a_size) = t.alloc(1, c, 8192, 4096);
    let (b, _) = t.alloc(1, c, 4096, 4096);
    let vram_fd = t.gpu.vram_fd().expect("the sim has a CPU view of VRAM");
    let off_a = match t.req(1, c, Op::MapAperture { mem: a }) {
        Ok(ReplyBody::Aperture { offset }) => offset,
        other => panic!("{other:?}"),
    };
    assert_eq!(off_a, APERTURE_OFFSET);
    let alloc_a = match t.s.hal.vram[&a].chunks[0].loc {
        crate::vram::backing::Loc::Vram(offset) => vgpu_host_shim::VramAlloc {
            offset,
            size: a_size,
        },
        other => panic!("{other:?}"),
    };
    assert_eq!(
        t.shm.calls(),
        vec![ShmCall::Map {
            off: APERTURE_OFFSET,
            fd: vram_fd.fd,
            fd_off: vram_fd.offset + alloc_a.offset,
            len: a_size,
            writable: true,
        }]
    );
    assert_eq!(
        t.req(1, c, Op::MapAperture { mem: a }),
        Err(ErrorCode::InvalidArgument)
    );
    let off_b = match t.req(1, c, Op::MapAperture { mem: b }) {
        Ok(ReplyBody::Aperture { offset }) => offset,
        other => panic!("{other:?}"),
    };
    assert_eq!(off_b, APERTURE_OFFSET + 8192, "first fit after a");
    assert_eq!(t.stats().aperture_bytes, 12288);
    // Ownership.
    let c2 = t.ctx(2);
    assert_eq!(
        t.req(2, c2, Op::UnmapAperture { mem: a }),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        t.req(2, c2, Op::MapAperture { mem: 4242 }),
        Err(ErrorCode::NotFound)
    );
    // A failing frontend leaves everything as it was.
    t.shm.fail_unmap.store(true, Ordering::Relaxed);
    assert_eq!(
        t.req(1, c, Op::UnmapAperture { mem: a }),
        Err(ErrorCode::Internal)
    );
    assert_eq!(
        t.req(1, c, Op::FreeMem { mem: a }),
        Err(ErrorCode::Internal)
    );
    t.check_consistent();
    t.shm.fail_unmap.store(false, Ordering::Relaxed);
    assert_eq!(
        t.req(1, c, Op::UnmapAperture { mem: a }),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(
        t.req(1, c, Op::UnmapAperture { mem: a }),
        Err(ErrorCode::NotFound)
    );
    // The hole is reused first.
    let (d, _) = t.alloc(1, c, 4096, 4096);
    assert_eq!(
        t.req(1, c, Op::MapAperture { mem: d }),
        Ok(ReplyBody::Aperture {
            offset: APERTURE_OFFSET
        })
    );
    t.shm.no_channel.store(true, Ordering::Relaxed);
    assert_eq!(
        t.req(1, c, Op::MapAperture { mem: a }),
        Err(ErrorCode::Unsupported)
    );
    t.shm.no_channel.store(false, Ordering::Relaxed);
    t.check_consistent();
    // FREE_MEM of a mapped object unmaps it from the BAR first.
    let mark = t.shm.mark();
    assert_eq!(t.req(1, c, Op::FreeMem { mem: b }), Ok(ReplyBody::Empty));
    assert_eq!(
        t.shm.since(mark),
        vec![ShmCall::Unmap {
            off: off_b,
            len: 4096
        }]
    );
    let mark = t.shm.mark();
    assert_eq!(t.req(1, c, Op::DestroyContext), Ok(ReplyBody::Empty));
    assert_eq!(
        t.shm.since(mark),
        vec![ShmCall::Unmap {
            off: APERTURE_OFFSET,
            len: 4096
        }]
    );
    assert_eq!(t.stats().aperture_bytes, 0);
    assert_eq!(t.req(2, c2, Op::DestroyContext), Ok(ReplyBody::Empty));
    t.assert_baseline();
}

#[test]
fn aperture_full() {
    let gpu = SimGpu::new(SimConfig {
        vram_bytes: 512 * MIB,
        ..SimConfig::default()
    })
    .unwrap();
    let mut t = T::with(
        gpu,
        VmLimits {
            vram_bytes: 512 * MIB,
            ..limits()
        },
    );
    let c = t.ctx(1);
    let (a, _) = t.alloc(1, c, APERTURE_SIZE - 4096, 4096);
    let (b, _) = t.alloc(1, c, 8192, 4096);
    assert!(t.req(1, c, Op::MapAperture { mem: a }).is_ok());
    assert_eq!(
        t.req(1, c, Op::MapAperture { mem: b }),
        Err(ErrorCode::LimitExceeded)
    );
    t.check_consistent();
    drop(t.s);
}
