//! Destroying contexts and sessions, ids per VM, malformed requests.

use super::*;

#[test]
fn destroy_context_frees_everything() {
    let mut t = T::new();
    let c = t.ctx(1);
    let other = t.ctx(2);
    let (m, _) = t.alloc(1, c, 64 << 10, 64 << 10);
    let (m2, _) = t.alloc(1, c, 4096, 4096);
    t.req(
        1,
        c,
        Op::MapVram {
            mem: m,
            flags: 0,
            va: 0x100_0000,
            page: PAGE_64K,
        },
    )
    .unwrap();
    t.req(
        1,
        c,
        Op::MapGuest {
            va: 0x200_0000,
            page: PAGE_4K,
            flags: 0,
            ranges: vec![range(R0.0, 8192)],
        },
    )
    .unwrap();
    t.req(1, c, Op::MapAperture { mem: m2 }).unwrap();
    t.channel(1, c);
    t.channel(1, c);
    let (m_other, _) = t.alloc(2, other, 4096, 4096);
    t.check_consistent();
    assert_eq!(t.req(1, c, Op::DestroyContext), Ok(ReplyBody::Empty));
    t.check_consistent();
    let st = t.s.state();
    assert_eq!(st.contexts.len(), 1);
    assert_eq!(st.mems.keys().copied().collect::<Vec<_>>(), vec![m_other]);
    assert!(st.channels.is_empty() && st.mappings.is_empty());
    assert_eq!(t.stats().mapped_guest_bytes, 0);
    assert!(t.shm.live().is_empty());
    assert_eq!(t.req(2, other, Op::DestroyContext), Ok(ReplyBody::Empty));
    t.assert_baseline();
}

#[test]
fn teardown_frees_everything() {
    let mut t = T::new();
    for pid in 1..=3 {
        let c = t.ctx(pid);
        let (m, _) = t.alloc(pid, c, 4096, 4096);
        t.req(pid, c, Op::MapAperture { mem: m }).unwrap();
        t.req(
            pid,
            c,
            Op::MapVram {
                mem: m,
                flags: 0,
                va: 0x1000,
                page: PAGE_4K,
            },
        )
        .unwrap();
        t.channel(pid, c);
    }
    assert_ne!(t.gpu.stats(), t.baseline);
    t.s.teardown(&crate::shmem::NullShm);
    assert!(t.s.is_empty());
    t.assert_baseline();
    assert_eq!(
        t.stats(),
        StatsReply {
            vram_limit: 16 * MIB,
            ..StatsReply::default()
        }
    );
    // Dropping a non-empty session frees too.
    let c = t.ctx(9);
    t.alloc(9, c, 4096, 4096);
    let T {
        gpu, s, baseline, ..
    } = t;
    drop(s);
    assert_eq!(settled(&gpu, baseline), baseline);
}

#[test]
fn ids_are_per_vm() {
    let gpu = sim();
    let mut a = T::with(gpu.clone(), limits());
    let mut b = T::with(gpu, limits());
    let ca = a.ctx(1);
    let (ma, _) = a.alloc(1, ca, 4096, 4096);
    let (cha, _) = a.channel(1, ca);
    // VM b knows nothing of VM a's ids, even with the same PID.
    assert_eq!(b.req(1, ca, Op::DestroyContext), Err(ErrorCode::NotFound));
    assert_eq!(
        b.req(1, ca, Op::FreeMem { mem: ma }),
        Err(ErrorCode::NotFound)
    );
    let cb = b.ctx(1);
    assert_eq!(cb, ca, "same small id, different VM");
    assert_eq!(
        b.req(1, cb, Op::FreeMem { mem: ma }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        b.req(1, cb, Op::DestroyChannel { channel: cha }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        b.req(1, cb, Op::MapAperture { mem: ma }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(a.s.state().mems.len(), 1);
    assert_eq!(a.s.state().channels.len(), 1);
}

#[test]
fn malformed_requests_get_error_replies() {
    let mut t = T::new();
    let good = Request {
        pid: 1,
        ctx: 0,
        op: Op::CreateContext,
    }
    .encode();
    let cases: Vec<(Vec<u8>, ErrorCode)> = vec![
        (vec![], ErrorCode::InvalidArgument),
        (good[..15].to_vec(), ErrorCode::InvalidArgument),
        ([good.clone(), vec![0]].concat(), ErrorCode::InvalidArgument),
        (
            {
                let mut v = good.clone();
                v[0] = 99;
                v
            },
            ErrorCode::Unsupported,
        ),
        (
            {
                let mut v = good.clone();
                v[12] = 1;
                v
            },
            ErrorCode::InvalidArgument,
        ),
        (vec![0xff; 100_000], ErrorCode::InvalidArgument),
    ];
    for (bytes, code) in cases {
        let reply = t.raw(&bytes);
        assert_eq!(decode_reply(0, &reply), Ok(Err(code)));
    }
    assert_eq!(t.s.shared().stats().errors, 6);
    assert_eq!(t.s.reject(ErrorCode::InvalidArgument).len(), 8);
    assert!(t.s.is_empty());
}
