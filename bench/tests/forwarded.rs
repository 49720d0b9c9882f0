//! Forwarded submission end to end: one `vgpu-backend` serves a loopback VM whose
//! frontend offers no shared-memory region (no vhost-user SHMEM, as QEMU 10) next to a
//! direct-mode VM, both over real vhost-user sockets. The forwarded VM's runtime submits
//! with SUBMIT requests and reads completions with CHANNEL_STATUS; applications (the shared
//! workloads) run unchanged and bit-exactly on both.

use std::time::{Duration, Instant};

use vgpu_backend::VmLimits;
use vgpu_guest::workloads::Workload;
use vgpu_guest::{Device, Error, KernelArgs};
use vgpu_loopback::LoopbackVm;
use vgpu_protocol::device::NO_SLOT;
use vgpu_protocol::request::{decode_reply, Op, ReplyBody, Request};
use vgpu_protocol::ErrorCode;
use vgpu_test_support::Host;

fn call(vm: &LoopbackVm, pid: u32, ctx: u32, op: Op) -> Result<ReplyBody, ErrorCode> {
    let req = Request { pid, ctx, op };
    let reply = vm.request(&req.encode()).unwrap();
    decode_reply(req.opcode(), &reply).unwrap()
}

fn wait_idle(host: &Host, vm: &str) -> vgpu_backend::VmStats {
    let t0 = Instant::now();
    loop {
        let s = host.backend.vm_stats(vm).unwrap();
        if s.contexts == 0 || t0.elapsed() > Duration::from_secs(10) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn forwarded_and_direct_vms_run_the_workloads_side_by_side() {
    let host = Host::new(
        "fwd-side",
        256 << 20,
        VmLimits::default(),
        &["direct", "fwd"],
    );
    let direct = host.connect("direct");
    let fwd = host.connect_forwarded("fwd");
    assert!(fwd.forwarded() && !direct.forwarded());
    assert!(host.backend.vm_stats("fwd").unwrap().forwarded);
    assert!(!host.backend.vm_stats("direct").unwrap().forwarded);

    let mut threads = Vec::new();
    for (vm, forwarded) in [(direct.clone(), false), (fwd.clone(), true)] {
        threads.push(std::thread::spawn(move || {
            let dev = Device::loopback(vm, 100).unwrap();
            let ctx = dev.create_context().unwrap();
            let ch = ctx.create_channel().unwrap();
            assert_eq!(ch.is_forwarded(), forwarded);
            drop(ch);
            for name in Workload::NAMES {
                let r = Workload::by_name(name, true).unwrap().run(&ctx).unwrap();
                assert!(
                    r.verified || name == "throttle",
                    "{name} (forwarded: {forwarded}) not verified"
                );
                assert!(r.iterations > 0, "{name}");
            }
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
    // The forwarded VM's frontend never saw a SHMEM_MAP; the direct one did.
    assert_eq!(fwd.shmem_maps(), 0, "forwarded VM got BAR mappings");
    assert!(direct.shmem_maps() > 0);
    for v in ["direct", "fwd"] {
        let s = wait_idle(&host, v);
        assert_eq!((s.contexts, s.channels, s.vram_bytes), (0, 0, 0), "{v}");
    }
}

#[test]
fn forwarded_requests_are_checked_like_any_other() {
    let host = Host::new("fwd-hostile", 64 << 20, VmLimits::default(), &["fwd"]);
    let vm = host.connect_forwarded("fwd");
    let ctx = match call(&vm, 7, 0, Op::CreateContext).unwrap() {
        ReplyBody::Context { ctx, .. } => ctx,
        r => panic!("{r:?}"),
    };
    let (channel, slot) = match call(
        &vm,
        7,
        ctx,
        Op::CreateChannel {
            gp_ring_va: 0x10_0000,
            gp_entries: 16,
        },
    )
    .unwrap()
    {
        ReplyBody::Channel { channel, slot } => (channel, slot),
        r => panic!("{r:?}"),
    };
    assert_eq!(slot, NO_SLOT, "a forwarded channel has no BAR slot");
    // Its status: fresh channel, nothing done, healthy.
    match call(&vm, 7, ctx, Op::ChannelStatus { channel }).unwrap() {
        ReplyBody::ChannelStatus(s) => {
            assert_eq!((s.gp_put, s.gp_get, s.reference, s.error), (0, 0, 0, 0))
        }
        r => panic!("{r:?}"),
    }
    // Another process, another context, an unknown channel.
    let other = call(&vm, 8, 0, Op::CreateContext).unwrap();
    let ReplyBody::Context { ctx: octx, .. } = other else {
        panic!("{other:?}")
    };
    assert_eq!(
        call(&vm, 8, ctx, Op::ChannelStatus { channel }),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        call(&vm, 8, octx, Op::ChannelStatus { channel }),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        call(&vm, 7, ctx, Op::ChannelStatus { channel: 9999 }),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        call(&vm, 8, octx, Op::Submit { channel, gp_put: 1 }),
        Err(ErrorCode::PermissionDenied)
    );
    // Its own context, but the channel lives in another one.
    let ctx2 = match call(&vm, 7, 0, Op::CreateContext).unwrap() {
        ReplyBody::Context { ctx, .. } => ctx,
        r => panic!("{r:?}"),
    };
    assert_eq!(
        call(&vm, 7, ctx2, Op::ChannelStatus { channel }),
        Err(ErrorCode::NotFound)
    );
    // No region, no aperture: the runtime stages VRAM through guest RAM instead.
    let mem = match call(
        &vm,
        7,
        ctx,
        Op::AllocVram {
            size: 1 << 16,
            align: 1 << 12,
        },
    )
    .unwrap()
    {
        ReplyBody::Mem { mem, .. } => mem,
        r => panic!("{r:?}"),
    };
    assert_eq!(
        call(&vm, 7, ctx, Op::MapAperture { mem }),
        Err(ErrorCode::Unsupported)
    );
    // A submission of an entry in an unmapped ring faults the channel, and the status
    // says so.
    call(&vm, 7, ctx, Op::Submit { channel, gp_put: 1 }).unwrap();
    let t0 = Instant::now();
    let st = loop {
        match call(&vm, 7, ctx, Op::ChannelStatus { channel }).unwrap() {
            ReplyBody::ChannelStatus(s) if s.error != 0 => break s,
            ReplyBody::ChannelStatus(_) if t0.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(5))
            }
            r => panic!("no fault: {r:?}"),
        }
    };
    assert_eq!(st.error, ErrorCode::MmuFault.as_u32());
    assert_eq!(st.error_info, 0x10_0000, "the faulting GP entry's address");
    assert_eq!(st.gp_put, 1);
    assert_eq!(vm.shmem_maps(), 0);
}

#[test]
fn forwarded_runtime_reports_faults_and_holds() {
    let host = Host::new("fwd-fault", 64 << 20, VmLimits::default(), &["fwd"]);
    let vm = host.connect_forwarded("fwd");
    let dev = Device::loopback(vm, 42).unwrap();
    let ctx = dev.create_context().unwrap();
    let mut ch = ctx.create_channel().unwrap();
    assert!(ch.is_forwarded());
    // A held channel (the scheduler's shadow) does not run its SUBMITs until released.
    let ids = host.backend.vm_channels("fwd");
    assert_eq!(ids.len(), 1);
    let id = ids[0].0;
    assert!(
        host.backend
            .shadow_channel("fwd", id, true)
            .unwrap()
            .changed
    );
    ch.launch(&KernelArgs::Spin { ns: 1000 }, [1, 1, 1])
        .unwrap();
    let f = ch.submit().unwrap();
    assert!(matches!(
        ch.wait_timeout(f, Duration::from_millis(200)),
        Err(Error::Timeout)
    ));
    assert!(
        host.backend
            .shadow_channel("fwd", id, false)
            .unwrap()
            .changed
    );
    ch.wait_timeout(f, Duration::from_secs(10)).unwrap();
    // A kernel that reads an unmapped address faults the channel; the runtime sees it.
    ch.launch(
        &KernelArgs::Memset {
            dst: 0x7f00_0000_0000,
            len: 4096,
            pattern: 1,
        },
        [1, 1, 1],
    )
    .unwrap();
    let f = ch.submit().unwrap();
    match ch.wait_timeout(f, Duration::from_secs(10)) {
        Err(Error::ChannelFault { code, .. }) => assert_eq!(code, ErrorCode::MmuFault),
        r => panic!("expected a channel fault, got {r:?}"),
    }
    assert_eq!(ch.error().map(|e| e.0), Some(ErrorCode::MmuFault));
}
