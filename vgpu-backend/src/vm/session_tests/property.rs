//! Property tests: random requests and byte strings against a session, checked for
//! consistency after every step.

use super::*;

fn arb_op() -> impl Strategy<Value = (u32, u32, Op)> {
    // Small id spaces so that ops hit existing objects often.
    let pid = 1..4u32;
    let ctx = 0..5u32;
    let mem = 0..8u32;
    let page = prop_oneof![
        3 => Just(PAGE_4K),
        1 => Just(PAGE_64K),
        1 => Just(PAGE_2M),
        1 => Just(7u32),
    ];
    let va = prop_oneof![
        3 => (0..64u64).prop_map(|p| p * 4096),
        1 => (0..8u64).prop_map(|p| p * 2 * MIB),
        1 => any::<u64>(),
    ];
    let gpa = prop_oneof![
        3 => (0..600u64).prop_map(|p| p * 4096),
        3 => (0..1100u64).prop_map(|p| R1.0 + p * 4096),
        1 => (0..3u64).prop_map(|p| R2.0 + p * 32768),
        1 => any::<u64>(),
    ];
    let len = prop_oneof![
        6 => (0..16u64).prop_map(|p| p * 4096),
        1 => Just(64 << 10),
        1 => Just(2 * MIB),
        1 => any::<u64>(),
    ];
    let ranges = proptest::collection::vec((gpa, len).prop_map(|(gpa, len)| range(gpa, len)), 1..4);
    let size = prop_oneof![
        4 => 1..70_000u64,
        1 => Just(2 * MIB),
        1 => Just(9 * MIB),
        1 => any::<u64>(),
    ];
    let align = prop_oneof![
        3 => Just(4096u64),
        1 => Just(65536),
        1 => Just(2 * MIB),
        1 => any::<u64>(),
    ];
    let op = prop_oneof![
        1 => Just(Op::GetInfo),
        1 => Just(Op::GetStats),
        3 => Just(Op::CreateContext),
        1 => Just(Op::DestroyContext),
        5 => (size, align).prop_map(|(size, align)| Op::AllocVram { size, align }),
        1 => mem.clone().prop_map(|mem| Op::FreeMem { mem }),
        4 => (mem.clone(), 0..2u32, va.clone(), page.clone()).prop_map(|(mem, flags, va, page)| {
            Op::MapVram {
                mem,
                flags,
                va,
                page,
            }
        }),
        4 => (va.clone(), page, 0..2u32, ranges).prop_map(|(va, page, flags, ranges)| {
            Op::MapGuest {
                va,
                page,
                flags,
                ranges,
            }
        }),
        2 => va.clone().prop_map(|va| Op::Unmap { va }),
        2 => mem.clone().prop_map(|mem| Op::MapAperture { mem }),
        1 => mem.prop_map(|mem| Op::UnmapAperture { mem }),
        2 => (va, prop_oneof![Just(64u32), Just(2), any::<u32>()]).prop_map(
            |(gp_ring_va, gp_entries)| Op::CreateChannel {
                gp_ring_va: gp_ring_va & !15,
                gp_entries,
            }
        ),
        1 => (0..8u32).prop_map(|channel| Op::DestroyChannel { channel }),
    ];
    (pid, ctx, op)
}

/// A step: a valid-looking op, raw bytes, or a frontend failure toggle.
#[derive(Debug, Clone)]
enum Step {
    /// An op; with `smart`, ids are redirected to existing objects and their owner.
    Op(u32, u32, Op, bool),
    Bytes(Vec<u8>),
    Mutated(u32, u32, Op, usize, u8),
    FailMap(bool),
    FailUnmap(bool),
}

fn arb_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => (arb_op(), proptest::bool::weighted(0.8))
            .prop_map(|((p, c, o), smart)| Step::Op(p, c, o, smart)),
        1 => proptest::collection::vec(any::<u8>(), 0..80).prop_map(Step::Bytes),
        1 => (arb_op(), any::<usize>(), any::<u8>())
            .prop_map(|((p, c, o), at, b)| Step::Mutated(p, c, o, at, b)),
        1 => any::<bool>().prop_map(Step::FailMap),
        1 => any::<bool>().prop_map(Step::FailUnmap),
    ]
}

/// Points a random op at existing objects: a live context and its owner, and that
/// context's VRAM objects, channels and mappings (ids picked by the random values).
fn aim(t: &T, pid: u32, ctx: u32, op: Op) -> (u32, u32, Op) {
    let st = t.s.state();
    let ctxs: Vec<(u32, u32)> = st.contexts.iter().map(|(c, s)| (*c, s.pid)).collect();
    if ctxs.is_empty() {
        return (pid, ctx, op);
    }
    let (ctx, pid) = ctxs[ctx as usize % ctxs.len()];
    let mems: Vec<u32> = st
        .mems
        .iter()
        .filter(|(_, m)| m.ctx == ctx)
        .map(|(id, _)| *id)
        .collect();
    let pick = |i: u32| {
        if mems.is_empty() {
            i
        } else {
            mems[i as usize % mems.len()]
        }
    };
    let op = match op {
        Op::FreeMem { mem } => Op::FreeMem { mem: pick(mem) },
        Op::MapAperture { mem } => Op::MapAperture { mem: pick(mem) },
        Op::UnmapAperture { mem } => Op::UnmapAperture { mem: pick(mem) },
        Op::MapVram {
            mem,
            flags,
            va,
            page,
        } => Op::MapVram {
            mem: pick(mem),
            flags,
            va,
            page,
        },
        Op::DestroyChannel { channel } => {
            let chans: Vec<u32> = st
                .channels
                .iter()
                .filter(|(_, c)| c.ctx == ctx)
                .map(|(id, _)| *id)
                .collect();
            Op::DestroyChannel {
                channel: if chans.is_empty() {
                    channel
                } else {
                    chans[channel as usize % chans.len()]
                },
            }
        }
        Op::Unmap { va } => {
            let vas: Vec<u64> = st
                .mappings
                .range((ctx, 0)..=(ctx, u64::MAX))
                .map(|((_, va), _)| *va)
                .collect();
            Op::Unmap {
                va: if vas.is_empty() {
                    va
                } else {
                    vas[(va % vas.len() as u64) as usize]
                },
            }
        }
        other => other,
    };
    (pid, ctx, op)
}

fn shared_sim() -> Arc<SimGpu> {
    // One GPU for all cases: engine threads are not free.
    static GPU: std::sync::OnceLock<Arc<SimGpu>> = std::sync::OnceLock::new();
    GPU.get_or_init(sim).clone()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200)) {
        let mut t = T::with(shared_sim(), limits());
        let reply = t.raw(&b);
        prop_assert!(decode_reply(0, &reply).is_ok());
    }

    #[test]
    fn random_ops_keep_the_books_consistent(steps in proptest::collection::vec(arb_step(), 1..120)) {
        static SERIAL: Mutex<()> = Mutex::new(());
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let mut t = T::with(shared_sim(), limits());
        for step in steps {
            match step {
                Step::Op(pid, ctx, op, smart) => {
                    let (pid, ctx, op) = if smart { aim(&t, pid, ctx, op) } else { (pid, ctx, op) };
                    let opcode = Request { pid, ctx, op: op.clone() }.opcode();
                    let reply = t.raw(&Request { pid, ctx, op }.encode());
                    prop_assert!(decode_reply(opcode, &reply).is_ok());
                }
                Step::Bytes(b) => {
                    let reply = t.raw(&b);
                    prop_assert!(decode_reply(0, &reply).is_ok());
                }
                Step::Mutated(pid, ctx, op, at, byte) => {
                    let mut b = Request { pid, ctx, op }.encode();
                    let i = at % b.len();
                    b[i] = byte;
                    let reply = t.raw(&b);
                    prop_assert!(decode_reply(0, &reply).is_ok());
                }
                Step::FailMap(on) => t.shm.fail_map.store(on, Ordering::Relaxed),
                Step::FailUnmap(on) => t.shm.fail_unmap.store(on, Ordering::Relaxed),
            }
            t.check_consistent();
        }
        t.shm.fail_unmap.store(false, Ordering::Relaxed);
        t.s.teardown(&t.shm);
        prop_assert!(t.shm.live().is_empty());
        t.assert_baseline();
    }
}
