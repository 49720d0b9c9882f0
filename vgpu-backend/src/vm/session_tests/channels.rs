//! Channels: creation, their events, and the bounds on mappings.

use super::*;

#[test]
fn channels() {
    let mut t = T::new();
    let c = t.ctx(1);
    let bad = |gp_ring_va, gp_entries| Op::CreateChannel {
        gp_ring_va,
        gp_entries,
    };
    for (va, n) in [
        (0x1000, 0),
        (0x1000, 3),
        (0x1000, 1 << 17),
        (0x1008, 64),
        ((1 << 48) - 16, 64),
    ] {
        assert_eq!(
            t.req(1, c, bad(va, n)),
            Err(ErrorCode::InvalidArgument),
            "{va:#x} {n}"
        );
    }
    let (ch, slot) = t.channel(1, c);
    assert_eq!(slot, 0);
    let page = t.gpu.control_page(t.s.hal.channels[&ch]).unwrap();
    assert_eq!(
        t.shm.calls(),
        vec![ShmCall::Map {
            off: 0,
            fd: page.fd,
            fd_off: page.offset,
            len: PAGE_SIZE,
            writable: true
        }]
    );
    let (ch2, slot2) = t.channel(1, c);
    assert_eq!(slot2, 1);
    assert_ne!(ch, ch2);
    // Ownership.
    let c2 = t.ctx(2);
    assert_eq!(
        t.req(2, c2, Op::DestroyChannel { channel: ch }),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        t.req(2, c, Op::DestroyChannel { channel: ch }),
        Err(ErrorCode::PermissionDenied)
    );
    let c3 = t.ctx(1);
    assert_eq!(
        t.req(1, c3, Op::DestroyChannel { channel: ch }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        t.req(1, c, Op::DestroyChannel { channel: 999 }),
        Err(ErrorCode::NotFound)
    );
    // Destroy frees the slot; the next channel takes it again.
    let mark = t.shm.mark();
    assert_eq!(
        t.req(1, c, Op::DestroyChannel { channel: ch }),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(
        t.shm.since(mark),
        vec![ShmCall::Unmap {
            off: 0,
            len: PAGE_SIZE
        }]
    );
    let (ch3, slot3) = t.channel(1, c);
    assert_eq!(slot3, 0);
    assert!(ch3 > ch2, "channel ids are not reused");
    // A failing SHMEM_MAP destroys the new channel again.
    let before = t.gpu.stats();
    t.shm.fail_map.store(true, Ordering::Relaxed);
    assert_eq!(t.req(1, c, bad(0x1000, 64)), Err(ErrorCode::Internal));
    t.shm.fail_map.store(false, Ordering::Relaxed);
    t.shm.no_channel.store(true, Ordering::Relaxed);
    assert_eq!(t.req(1, c, bad(0x1000, 64)), Err(ErrorCode::Unsupported));
    t.shm.no_channel.store(false, Ordering::Relaxed);
    assert_eq!(settled(&t.gpu, before), before);
    // A failing SHMEM_UNMAP keeps the channel.
    t.shm.fail_unmap.store(true, Ordering::Relaxed);
    assert_eq!(
        t.req(1, c, Op::DestroyChannel { channel: ch3 }),
        Err(ErrorCode::Internal)
    );
    assert_eq!(t.req(1, c, Op::DestroyContext), Err(ErrorCode::Internal));
    t.shm.fail_unmap.store(false, Ordering::Relaxed);
    t.check_consistent();
    // Limit: 4 channels per VM.
    t.channel(1, c);
    t.channel(1, c3);
    assert_eq!(t.req(1, c, bad(0x1000, 64)), Err(ErrorCode::LimitExceeded));
    t.check_consistent();
    // Busy time is reported per PID.
    let busy = t.s.shared().process_busy_ns(t.gpu.as_ref());
    assert_eq!(busy.iter().map(|(p, _)| *p).collect::<Vec<_>>(), vec![1]);
    assert_eq!(t.req(1, c, Op::DestroyContext), Ok(ReplyBody::Empty));
    assert_eq!(t.req(1, c3, Op::DestroyContext), Ok(ReplyBody::Empty));
    assert_eq!(t.req(2, c2, Op::DestroyContext), Ok(ReplyBody::Empty));
    assert!(t.shm.live().is_empty());
    t.assert_baseline();
    let busy = t.s.shared().process_busy_ns(t.gpu.as_ref());
    assert_eq!(busy.len(), 1, "destroyed channels stay in the books");
}

#[test]
fn channel_events_are_tagged_with_the_guest_id() {
    let mut t = T::new();
    let c = t.ctx(1);
    let (ch, _) = t.channel(1, c);
    let hch = t.s.hal.channels[&ch];
    t.gpu.kill_channel(hch, ErrorCode::WatchdogKilled).unwrap();
    let events = t.s.shared().events.clone();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while events.is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let e = events.pop().expect("an error event");
    assert_eq!(e.kind, event::CHANNEL_ERROR);
    assert_eq!(e.channel, ch);
    assert_eq!(e.value, ErrorCode::WatchdogKilled.as_u32());
    // After teardown, late events of old channels are dropped.
    t.s.teardown(&t.shm);
    assert!(events.is_empty());
    t.assert_baseline();
}

#[test]
fn mappings_are_bounded_in_number_and_in_page_table_memory() {
    let mut t = T::with(
        sim(),
        VmLimits {
            max_mappings: 3,
            // Two 2 MiB regions of 4 KiB pages and a little more.
            page_table_bytes: 80 << 10,
            ..limits()
        },
    );
    let c = t.ctx(1);
    let (m, _) = t.alloc(1, c, 2 * MIB, 2 * MIB);
    let map = |va| Op::MapVram {
        mem: m,
        flags: 0,
        va,
        page: PAGE_4K,
    };
    assert_eq!(t.req(1, c, map(0x1000_0000)), Ok(ReplyBody::Empty));
    assert_eq!(t.req(1, c, map(0x2000_0000)), Ok(ReplyBody::Empty));
    t.check_consistent();
    let held = t.s.state().usage.page_table_bytes;
    assert!(held > 2 * 512 * 64, "{held}");
    // A third alias needs a third page table: over the memory bound, nothing mapped.
    let pages = t.mapped_pages(c);
    assert_eq!(t.req(1, c, map(0x3000_0000)), Err(ErrorCode::LimitExceeded));
    assert_eq!(t.mapped_pages(c), pages);
    assert_eq!(t.s.state().usage.page_table_bytes, held);
    assert_eq!(
        t.req(1, c, Op::Unmap { va: 0x3000_0000 }),
        Err(ErrorCode::NotFound)
    );
    // 2 MiB pages cost little: the third mapping fits, the fourth is one too many.
    assert_eq!(
        t.req(
            1,
            c,
            Op::MapVram {
                mem: m,
                flags: 0,
                va: 0x4000_0000,
                page: PAGE_2M,
            }
        ),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(
        t.req(
            1,
            c,
            Op::MapGuest {
                va: 0x5000_0000,
                page: PAGE_2M,
                flags: 0,
                ranges: vec![range(R0.0, R0.1)],
            }
        ),
        Err(ErrorCode::LimitExceeded)
    );
    t.check_consistent();
    // Unmapping gives the memory back; destroying the context gives back the rest.
    assert_eq!(
        t.req(1, c, Op::Unmap { va: 0x1000_0000 }),
        Ok(ReplyBody::Empty)
    );
    assert!(t.s.state().usage.page_table_bytes < held);
    assert_eq!(t.req(1, c, map(0x3000_0000)), Ok(ReplyBody::Empty));
    t.check_consistent();
    assert_eq!(t.req(1, c, Op::DestroyContext), Ok(ReplyBody::Empty));
    assert_eq!(t.s.state().usage.page_table_bytes, 0);
    assert_eq!(t.s.shared().stats().mappings, 0);
    t.assert_baseline();
}
