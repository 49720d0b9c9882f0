//! VRAM fragmentation and swap limits over the real path (issue 28, item 4): a backend on
//! a 64 MiB sim GPU serving loopback VMs on vhost-user sockets. One VM's tiny objects
//! asking for huge alignment must not make the rest of VRAM unusable for another VM, the
//! VRAM a VM's small objects pin is charged to it, and a VM without a swap limit is never
//! placed in (or moved to) system memory.

use vgpu_backend::{VgpuBackend, VmLimits};
use vgpu_guest::Device;
use vgpu_loopback::LoopbackVm;
use vgpu_protocol::request::{decode_reply, Op, ReplyBody, Request};
use vgpu_protocol::ErrorCode;
use vgpu_test_support::Host;

const MIB: u64 = 1 << 20;
const VRAM: u64 = 64 * MIB;

fn start_host(tag: &str, limits: VmLimits) -> Host {
    let _ = env_logger::builder().is_test(true).try_init();
    Host::new(
        &format!("islands-{tag}"),
        VRAM,
        limits,
        &["attacker", "victim"],
    )
}

/// One control request of guest process `pid`, as a hostile guest sends it (no runtime).
fn call(vm: &LoopbackVm, pid: u32, ctx: u32, op: Op) -> Result<ReplyBody, ErrorCode> {
    let req = Request { pid, ctx, op };
    let reply = vm.request(&req.encode()).expect("request");
    decode_reply(req.opcode(), &reply).expect("reply")
}

fn context(vm: &LoopbackVm, pid: u32) -> u32 {
    match call(vm, pid, 0, Op::CreateContext) {
        Ok(ReplyBody::Context { ctx, .. }) => ctx,
        other => panic!("context: {other:?}"),
    }
}

fn alloc(vm: &LoopbackVm, pid: u32, ctx: u32, size: u64, align: u64) -> Result<u32, ErrorCode> {
    match call(vm, pid, ctx, Op::AllocVram { size, align }) {
        Ok(ReplyBody::Mem { mem, .. }) => Ok(mem),
        Ok(other) => panic!("alloc: {other:?}"),
        Err(e) => Err(e),
    }
}

/// (resident, swapped, footprint) bytes of `vm`.
fn figures(be: &VgpuBackend, vm: &str) -> (u64, u64, u64) {
    let v = be.vram_stats(vm).expect("vm").vm;
    (v.resident_bytes, v.swapped_bytes, v.footprint_bytes)
}

fn mib(b: u64) -> f64 {
    b as f64 / MIB as f64
}

/// The attack: 32 objects of 4 KiB, each asking for 2 MiB alignment (128 KiB in
/// all), used to leave no 2 MiB of VRAM in one piece: the victim's 16 MiB then had 0 MiB
/// resident (all of it in system memory, although its swap limit is 0) while 63.9 MiB of
/// VRAM were free. The alignment is now bounded by what the object needs and small
/// objects share their own VM's 2 MiB frames, so the islands take one frame.
#[test]
fn aligned_islands_do_not_push_a_victim_out_of_vram() {
    let host = start_host("aligned", VmLimits::default());
    let be = &host.backend;
    let attacker = host.connect("attacker");
    let ctx = context(&attacker, 66);
    for i in 0..32 {
        alloc(&attacker, 66, ctx, 4096, 2 * MIB).unwrap_or_else(|e| panic!("island {i}: {e}"));
    }
    let (a_res, _, a_foot) = figures(be, "attacker");
    let free = be.vram_overview().free_bytes;
    let dev = Device::loopback(host.connect("victim"), 7).expect("device");
    let vctx = dev.create_context().expect("context");
    let buf = vctx.alloc_vram(16 * MIB);
    let (res, swp, _) = figures(be, "victim");
    println!(
        "attacker: 32 x 4 KiB at 2 MiB alignment: {:.3} MiB resident, footprint {:.1} MiB; \
         VRAM free before the victim {:.1} MiB; victim's 16 MiB: {} -> {:.1} MiB resident, \
         {:.1} MiB swapped",
        mib(a_res),
        mib(a_foot),
        mib(free),
        if buf.is_ok() { "allocated" } else { "refused" },
        mib(res),
        mib(swp)
    );
    let buf = buf.expect("the victim's 16 MiB");
    assert_eq!(
        (res, swp),
        (16 * MIB, 0),
        "the victim's 16 MiB must be resident, none of it swapped"
    );
    assert!(a_foot <= 2 * MIB, "the islands pin {a_foot} bytes");
    drop((buf, vctx, dev));
}

/// Islands without the alignment trick: small objects packed next to big ones that are
/// then freed. Each VM's pieces smaller than 2 MiB share that VM's own 2 MiB frames, and
/// the whole frames are charged to it (past one frame's slack): with a 32 MiB quota the
/// attacker is refused once its frames reach the quota, and the victim's 16 MiB fit.
#[test]
fn islands_left_by_freed_objects_are_charged_to_their_owner() {
    let host = start_host(
        "freed",
        VmLimits {
            vram_bytes: 32 * MIB,
            ..VmLimits::default()
        },
    );
    let be = &host.backend;
    let attacker = host.connect("attacker");
    let ctx = context(&attacker, 66);
    // Pairs of (4 KiB, 2 MiB - 4 KiB), then the big ones go: 4 KiB at every 2 MiB, for
    // as long as the backend lets the attacker go on.
    let mut islands = 0;
    let mut refused = None;
    'rounds: for _ in 0..4 {
        let mut bigs = Vec::new();
        for _ in 0..32 {
            let small = alloc(&attacker, 66, ctx, 4096, 4096);
            let big = small.and_then(|_| alloc(&attacker, 66, ctx, 2 * MIB - 4096, 4096));
            match (small, big) {
                (Ok(_), Ok(b)) => {
                    islands += 1;
                    bigs.push(b);
                }
                (Ok(_), Err(e)) | (Err(e), _) => {
                    refused = Some(e);
                    for b in bigs {
                        call(&attacker, 66, ctx, Op::FreeMem { mem: b }).expect("free");
                    }
                    break 'rounds;
                }
            }
        }
        for b in bigs {
            call(&attacker, 66, ctx, Op::FreeMem { mem: b }).expect("free");
        }
    }
    let (a_res, _, a_foot) = figures(be, "attacker");
    let dev = Device::loopback(host.connect("victim"), 7).expect("device");
    let vctx = dev.create_context().expect("context");
    let buf = vctx.alloc_vram(16 * MIB);
    let (res, swp, _) = figures(be, "victim");
    println!(
        "attacker: {islands} islands of 4 KiB ({:.3} MiB resident), footprint {:.1} MiB, \
         stopped by {refused:?}; victim's 16 MiB: {} -> {:.1} MiB resident, {:.1} MiB swapped",
        mib(a_res),
        mib(a_foot),
        if buf.is_ok() { "allocated" } else { "refused" },
        mib(res),
        mib(swp)
    );
    assert_eq!(refused, Some(ErrorCode::LimitExceeded));
    // The quota, plus the one frame's slack every VM with small objects is allowed.
    assert!(
        a_foot <= 34 * MIB,
        "the attacker holds {a_foot} bytes of VRAM, past its 32 MiB quota and a frame"
    );
    let buf = buf.expect("the victim's 16 MiB");
    assert_eq!((res, swp), (16 * MIB, 0));
    drop((buf, vctx, dev));
}

/// A VM whose swap limit is 0 is never given system memory: an allocation that does not
/// fit in free VRAM fails with `NoMemory` (it used to be placed in swap), and the VRAM
/// manager never evicts its chunks.
#[test]
fn a_vm_without_swap_limit_never_spills() {
    let host = start_host("noswap", VmLimits::default());
    let be = &host.backend;
    let attacker = host.connect("attacker");
    let ctx = context(&attacker, 66);
    let hog = alloc(&attacker, 66, ctx, 56 * MIB, 2 * MIB).expect("56 MiB");
    let dev = Device::loopback(host.connect("victim"), 7).expect("device");
    let vctx = dev.create_context().expect("context");
    let buf = vctx.alloc_vram(16 * MIB);
    be.vram_rebalance();
    let (res, swp, _) = figures(be, "victim");
    let (a_res, a_swp, _) = figures(be, "attacker");
    println!(
        "victim's 16 MiB with 8 MiB of VRAM free: {}; victim {:.1} MiB resident, {:.1} MiB \
         swapped; the other VM {:.1} MiB resident, {:.1} MiB swapped",
        match &buf {
            Ok(_) => "allocated".to_string(),
            Err(e) => format!("refused ({e})"),
        },
        mib(res),
        mib(swp),
        mib(a_res),
        mib(a_swp)
    );
    assert!(
        matches!(buf, Err(vgpu_guest::Error::Device(ErrorCode::NoMemory))),
        "the victim's 16 MiB: {}",
        if buf.is_ok() {
            "allocated"
        } else {
            "refused otherwise"
        }
    );
    assert_eq!(
        (swp, a_swp),
        (0, 0),
        "a VM without swap limit has swapped bytes"
    );
    // What fits is still given, and the manager moves none of it.
    let small = vctx.alloc_vram(8 * MIB).expect("8 MiB fit");
    be.vram_rebalance();
    assert_eq!(figures(be, "victim").1, 0);
    assert_eq!(figures(be, "attacker").1, 0);
    call(&attacker, 66, ctx, Op::FreeMem { mem: hog }).expect("free");
    drop((small, vctx, dev));
}
