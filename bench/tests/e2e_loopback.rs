//! End to end over the real path: `vgpu-backend` serving several VMs on vhost-user
//! sockets, loopback frontends connected as VMMs, guest "processes" using the runtime's
//! loopback transport (requests on the control virtqueue, control pages and apertures in
//! the BAR window, submissions by plain stores).

use std::time::{Duration, Instant};

use vgpu_backend::VmLimits;
use vgpu_guest::workloads::Workload;
use vgpu_guest::{Device, KernelArgs};
use vgpu_loopback::LoopbackVm;
use vgpu_protocol::request::{decode_reply, GuestRange, Op, ReplyBody, Request};
use vgpu_protocol::ErrorCode;
use vgpu_test_support::Host;

/// The backend on a 256 MiB sim GPU serving `vms`.
fn start_host(tag: &str, vms: &[&str]) -> Host {
    Host::new(&format!("e2e-{tag}"), 256 << 20, VmLimits::default(), vms)
}

/// Waits until the backend's view of `vm` satisfies `pred`.
fn wait_stats(
    host: &Host,
    vm: &str,
    pred: impl Fn(&vgpu_backend::VmStats) -> bool,
) -> vgpu_backend::VmStats {
    let t0 = Instant::now();
    loop {
        let s = host.backend.vm_stats(vm).unwrap();
        if pred(&s) || t0.elapsed() > Duration::from_secs(10) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn call(vm: &LoopbackVm, pid: u32, ctx: u32, op: Op) -> Result<ReplyBody, ErrorCode> {
    let req = Request { pid, ctx, op };
    let reply = vm.request(&req.encode()).unwrap();
    decode_reply(req.opcode(), &reply).unwrap()
}

#[test]
fn several_vms_run_workloads_at_once() {
    let host = start_host("multi", &["a", "b", "c"]);
    let vms: Vec<_> = ["a", "b", "c"].iter().map(|v| host.connect(v)).collect();
    let mut threads = Vec::new();
    for (i, vm) in vms.iter().enumerate() {
        for pid in [100, 200] {
            let vm = vm.clone();
            threads.push(std::thread::spawn(move || {
                let dev = Device::loopback(vm, pid).unwrap();
                let ctx = dev.create_context().unwrap();
                let names = [
                    "saxpy",
                    "sgemm",
                    "hotspot",
                    "reduction",
                    "copy_heavy",
                    "throttle",
                ];
                for (k, name) in names.iter().enumerate() {
                    if (k + i) % 2 == (pid as usize / 100) % 2 {
                        let r = Workload::by_name(name, true).unwrap().run(&ctx).unwrap();
                        assert!(r.verified || *name == "throttle", "{name}");
                    }
                }
            }));
        }
    }
    for t in threads {
        t.join().unwrap();
    }
    for v in ["a", "b", "c"] {
        let s = wait_stats(&host, v, |s| s.contexts == 0);
        assert_eq!(
            s.contexts, 0,
            "{v}: contexts freed when the runtime dropped them"
        );
        assert_eq!(s.channels, 0);
        assert_eq!(s.vram_bytes, 0);
    }
}

#[test]
fn hostile_requests_get_errors_and_touch_nothing() {
    let host = start_host("hostile", &["victim", "attacker"]);
    let victim = host.connect("victim");
    let attacker = host.connect("attacker");
    // The victim owns contexts, VRAM buffers and a channel. Ids are per VM, so it makes
    // a few of each: the ids it uses then exist in no other VM.
    let mut vctx = 0;
    for _ in 0..3 {
        vctx = match call(&victim, 7, 0, Op::CreateContext).unwrap() {
            ReplyBody::Context { ctx, .. } => ctx,
            r => panic!("{r:?}"),
        };
    }
    let mut vmem = 0;
    for _ in 0..3 {
        let op = Op::AllocVram {
            size: 1 << 16,
            align: 1 << 16,
        };
        vmem = match call(&victim, 7, vctx, op).unwrap() {
            ReplyBody::Mem { mem, .. } => mem,
            r => panic!("{r:?}"),
        };
    }
    call(
        &victim,
        7,
        vctx,
        Op::MapVram {
            mem: vmem,
            flags: 0,
            va: 0x40_0000_0000,
            page: 1,
        },
    )
    .unwrap();
    let ring = victim.alloc_guest(1 << 16, 1 << 16).unwrap();
    call(
        &victim,
        7,
        vctx,
        Op::MapGuest {
            va: 0x1_0000_0000,
            page: 0,
            flags: 0,
            ranges: vec![GuestRange {
                gpa: ring.gpa,
                len: 1 << 16,
            }],
        },
    )
    .unwrap();
    let vch = match call(
        &victim,
        7,
        vctx,
        Op::CreateChannel {
            gp_ring_va: 0x1_0000_0000,
            gp_entries: 64,
        },
    )
    .unwrap()
    {
        ReplyBody::Channel { channel, .. } => channel,
        r => panic!("{r:?}"),
    };
    let before_victim = host.backend.vm_stats("victim").unwrap();
    let before_gpu = host.gpu.stats();

    // The attacker's own context.
    let actx = match call(&attacker, 9, 0, Op::CreateContext).unwrap() {
        ReplyBody::Context { ctx, .. } => ctx,
        r => panic!("{r:?}"),
    };
    let mem_end = 128u64 << 20;
    let hostile: Vec<(&str, u32, u32, Op)> = vec![
        (
            "victim's ctx id from another VM",
            9,
            vctx,
            Op::AllocVram {
                size: 4096,
                align: 4096,
            },
        ),
        (
            "victim's mem id from another VM",
            9,
            actx,
            Op::FreeMem { mem: vmem },
        ),
        (
            "victim's channel id from another VM",
            9,
            actx,
            Op::DestroyChannel { channel: vch },
        ),
        (
            "forged channel id",
            9,
            actx,
            Op::DestroyChannel { channel: 0xdead },
        ),
        ("forged mem id", 9, actx, Op::MapAperture { mem: 12345 }),
        (
            "forged context",
            9,
            777,
            Op::CreateChannel {
                gp_ring_va: 0,
                gp_entries: 64,
            },
        ),
        (
            "wrong pid for own context",
            10,
            actx,
            Op::AllocVram {
                size: 4096,
                align: 4096,
            },
        ),
        (
            "zero-size VRAM",
            9,
            actx,
            Op::AllocVram {
                size: 0,
                align: 4096,
            },
        ),
        (
            "huge VRAM",
            9,
            actx,
            Op::AllocVram {
                size: u64::MAX,
                align: 4096,
            },
        ),
        (
            "bad alignment",
            9,
            actx,
            Op::AllocVram {
                size: 4096,
                align: 3,
            },
        ),
        (
            "GPA beyond guest RAM",
            9,
            actx,
            Op::MapGuest {
                va: 0x1_0000_0000,
                page: 0,
                flags: 0,
                ranges: vec![GuestRange {
                    gpa: mem_end,
                    len: 4096,
                }],
            },
        ),
        (
            "GPA range overflowing",
            9,
            actx,
            Op::MapGuest {
                va: 0x1_0000_0000,
                page: 0,
                flags: 0,
                ranges: vec![GuestRange {
                    gpa: u64::MAX - 4095,
                    len: 8192,
                }],
            },
        ),
        (
            "zero-length range",
            9,
            actx,
            Op::MapGuest {
                va: 0x1_0000_0000,
                page: 0,
                flags: 0,
                ranges: vec![GuestRange { gpa: 0, len: 0 }],
            },
        ),
        (
            "unaligned range",
            9,
            actx,
            Op::MapGuest {
                va: 0x1_0000_0000,
                page: 0,
                flags: 0,
                ranges: vec![GuestRange {
                    gpa: 100,
                    len: 4096,
                }],
            },
        ),
        (
            "overlapping ranges",
            9,
            actx,
            Op::MapGuest {
                va: 0x1_0000_0000,
                page: 0,
                flags: 0,
                ranges: vec![
                    GuestRange {
                        gpa: 0x10000,
                        len: 0x2000,
                    },
                    GuestRange {
                        gpa: 0x11000,
                        len: 0x1000,
                    },
                ],
            },
        ),
        (
            "unmap of nothing",
            9,
            actx,
            Op::Unmap { va: 0x40_0000_0000 },
        ),
        (
            "bad ring size",
            9,
            actx,
            Op::CreateChannel {
                gp_ring_va: 0x1_0000_0000,
                gp_entries: 3,
            },
        ),
    ];
    for (what, pid, ctx, op) in hostile {
        let r = call(&attacker, pid, ctx, op);
        assert!(r.is_err(), "{what}: {r:?}");
        assert_ne!(r, Err(ErrorCode::Internal), "{what}");
    }
    // Raw garbage on the control queue gets an error reply too.
    let reply = attacker.request(&[0xff; 40]).unwrap();
    assert!(decode_reply(0, &reply).unwrap().is_err());
    let reply = attacker.request(&[1, 2, 3]).unwrap();
    assert!(decode_reply(0, &reply).unwrap().is_err());

    // Nothing of the victim changed, and the attacker still gets served.
    assert_eq!(
        host.backend.vm_stats("victim").unwrap().channels,
        before_victim.channels
    );
    assert_eq!(
        host.backend.vm_stats("victim").unwrap().vram_bytes,
        before_victim.vram_bytes
    );
    assert_eq!(host.gpu.stats().channels, before_gpu.channels);
    assert!(matches!(
        call(&attacker, 9, actx, Op::GetStats),
        Ok(ReplyBody::Stats(_))
    ));
    let dev = Device::loopback(victim.clone(), 8).unwrap();
    let ctx = dev.create_context().unwrap();
    assert!(
        Workload::by_name("saxpy", true)
            .unwrap()
            .run(&ctx)
            .unwrap()
            .verified
    );
    assert!(host.backend.vm_stats("attacker").unwrap().errors >= 19);
}

#[test]
fn disconnect_mid_work_frees_everything_and_reconnect_works() {
    let host = start_host("disc", &["vm"]);
    let baseline = host.gpu.stats();
    let vm = host.connect("vm");
    let dev = Device::loopback(vm.clone(), 1).unwrap();
    let ctx = dev.create_context().unwrap();
    let buf = ctx.alloc_vram(1 << 20).unwrap();
    buf.write(0, &[1; 4096]).unwrap();
    let mut ch = ctx.create_channel().unwrap();
    ch.launch(&KernelArgs::Spin { ns: 200_000_000 }, [1, 1, 1])
        .unwrap();
    ch.submit().unwrap();
    let s = wait_stats(&host, "vm", |s| s.channels == 1);
    assert!(s.connected && s.vram_bytes >= 1 << 20 && s.aperture_bytes >= 1 << 20);
    // The VMM goes away while the kernel runs.
    vm.disconnect();
    let s = wait_stats(&host, "vm", |s| !s.connected && s.contexts == 0);
    assert_eq!(
        (
            s.contexts,
            s.channels,
            s.vram_bytes,
            s.mapped_guest_bytes,
            s.aperture_bytes
        ),
        (0, 0, 0, 0, 0)
    );
    let t0 = Instant::now();
    while host.gpu.stats() != baseline && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(host.gpu.stats(), baseline, "GPU objects of the VM are gone");
    // The old objects' teardown requests fail (the connection is gone) without harm.
    drop(ch);
    drop(buf);
    drop(ctx);
    // A new VMM connects to the same socket and works.
    let vm2 = host.connect("vm");
    let dev = Device::loopback(vm2, 1).unwrap();
    let ctx = dev.create_context().unwrap();
    assert!(
        Workload::by_name("reduction", true)
            .unwrap()
            .run(&ctx)
            .unwrap()
            .verified
    );
}

#[test]
fn api_remoting_submits_through_the_backend() {
    let host = start_host("remote", &["vm"]);
    let vm = host.connect("vm");
    let dev = Device::loopback(vm, 5).unwrap();
    let ctx = dev.create_context().unwrap();
    let mut ch = ctx.create_channel().unwrap();
    ch.set_api_remoting(true);
    let buf = ctx.alloc_host(4096).unwrap();
    for i in 1..=50u32 {
        ch.launch(
            &KernelArgs::Memset {
                dst: buf.gpu_va(),
                len: 4,
                pattern: i,
            },
            [1, 1, 1],
        )
        .unwrap();
        ch.finish().unwrap();
        assert_eq!(buf.read_u32_vec(0, 1).unwrap(), vec![i]);
    }
    let s = host.backend.vm_stats("vm").unwrap();
    assert!(
        s.requests >= 50,
        "every submission was a request: {}",
        s.requests
    );
}
