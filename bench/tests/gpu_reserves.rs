//! The GPU's contexts and channels are shared with a reserve per VM (issue 28, item 3):
//! five VMs with the default limits on a GPU of 256 contexts and 256 channels, over real
//! vhost-user sockets. The first four take every context and channel they can get; the
//! fifth still creates a context and a channel and runs a kernel, because its reserve is
//! kept for it. The control API shows the GPU's headroom (total, used, reserved, free).

use std::sync::Arc;

use serde_json::Value;
use vgpu_backend::api::client::ApiClient;
use vgpu_backend::api::{ApiOptions, ApiServer};
use vgpu_backend::{Gpu, VmLimits};
use vgpu_bench::suites::flood::call;
use vgpu_guest::{Device, KernelArgs};
use vgpu_loopback::LoopbackVm;
use vgpu_protocol::request::{Op, ReplyBody};
use vgpu_protocol::ErrorCode;
use vgpu_test_support::Host;

const HOGS: [&str; 4] = ["hog0", "hog1", "hog2", "hog3"];
const LATE: &str = "late";

/// Creates contexts until refused; returns the ids and the refusal.
fn take_contexts(vm: &LoopbackVm, pid: u32) -> (Vec<u32>, ErrorCode) {
    let mut got = Vec::new();
    loop {
        match call(vm, pid, 0, Op::CreateContext).expect("request") {
            Ok(ReplyBody::Context { ctx, .. }) => got.push(ctx),
            Ok(other) => panic!("CREATE_CONTEXT: {other:?}"),
            Err(code) => return (got, code),
        }
        assert!(got.len() <= 1024, "no limit on contexts");
    }
}

/// Creates channels in `ctx` until refused; returns how many and the refusal.
fn take_channels(vm: &LoopbackVm, pid: u32, ctx: u32) -> (u32, ErrorCode) {
    let mut n = 0u32;
    loop {
        let op = Op::CreateChannel {
            gp_ring_va: 0x1000_0000 + u64::from(n) * 0x1_0000,
            gp_entries: 64,
        };
        match call(vm, pid, ctx, op).expect("request") {
            Ok(ReplyBody::Channel { .. }) => n += 1,
            Ok(other) => panic!("CREATE_CHANNEL: {other:?}"),
            Err(code) => return (n, code),
        }
        assert!(n <= 1024, "no limit on channels");
    }
}

fn info(c: &ApiClient) -> Value {
    let r = c
        .raw("GET", "/api/v1/info", None)
        .expect("GET /api/v1/info");
    assert_eq!(r.status, 200);
    serde_json::from_slice(&r.body).expect("JSON")
}

/// `capacity.<what>` of an `/api/v1/info` answer as (total, used, reserved, free).
fn headroom(v: &Value, what: &str) -> (u64, u64, u64, u64) {
    let f = &v["capacity"][what];
    let n = |k: &str| {
        f[k].as_u64()
            .unwrap_or_else(|| panic!("capacity.{what}.{k} in {v}"))
    };
    (n("total"), n("used"), n("reserved"), n("free"))
}

#[test]
fn a_fifth_vm_keeps_its_reserve_when_four_take_everything() {
    let _ = env_logger::builder().is_test(true).try_init();
    let mut names: Vec<&str> = HOGS.to_vec();
    names.push(LATE);
    let host = Host::new("reserves", 64 << 20, VmLimits::default(), &names).with_vm_mem(16 << 20);
    let gpu = host.gpu.info();
    assert_eq!((gpu.max_contexts, gpu.max_channels), (256, 256));
    let api = ApiServer::start(
        &host.backend,
        &host.dir.join("api.sock"),
        ApiOptions::default(),
    )
    .expect("API");
    let client = ApiClient::new(api.path());

    // The hogs, one after the other, each as greedy as its own limits allow.
    let mut hogs: Vec<Arc<LoopbackVm>> = Vec::new();
    for (i, name) in HOGS.iter().enumerate() {
        let vm = host.connect(name);
        let pid = 100 + i as u32;
        let (ctxs, why) = take_contexts(&vm, pid);
        assert_eq!(why, ErrorCode::LimitExceeded, "{name}: contexts refused");
        let (chans, why) = match ctxs.first() {
            Some(&ctx) => take_channels(&vm, pid, ctx),
            None => (0, ErrorCode::LimitExceeded),
        };
        assert_eq!(why, ErrorCode::LimitExceeded, "{name}: channels refused");
        println!("{name}: {} contexts, {chans} channels", ctxs.len());
        hogs.push(vm);
    }

    // What the operator sees now (checked once the late VM has had its turn).
    let after_hogs = info(&client);
    let hog_usage: Vec<(u64, u64)> = HOGS
        .iter()
        .map(|n| {
            let s = host.backend.vm_stats(n).expect("stats");
            (u64::from(s.contexts), u64::from(s.channels))
        })
        .collect();

    // The late VM: a guest process creates a context and a channel and runs a kernel.
    let late = host.connect(LATE);
    let dev = Device::loopback(late.clone(), 7).expect("device");
    let ctx = match dev.create_context() {
        Ok(c) => c,
        Err(e) => panic!("the fifth VM cannot create a context: {e}"),
    };
    let buf = ctx.alloc_vram(4096).expect("VRAM");
    let mut ch = match ctx.create_channel() {
        Ok(c) => c,
        Err(e) => panic!("the fifth VM cannot create a channel: {e}"),
    };
    ch.launch(
        &KernelArgs::Memset {
            dst: buf.gpu_va(),
            len: 4096,
            pattern: 0x5eed_5eed,
        },
        [1, 1, 1],
    )
    .expect("launch");
    ch.finish().expect("the kernel runs");
    assert_eq!(buf.read_u32_vec(0, 4).expect("read"), vec![0x5eed_5eed; 4]);

    // The headroom after the hogs: nothing free beyond the late VM's reserve.
    let limits: Value = {
        let d = client.raw("GET", "/api/v1/vms/late", None).expect("GET vm");
        serde_json::from_slice(&d.body).expect("JSON")
    };
    let reserve = |k: &str| {
        limits["limits"][k]
            .as_u64()
            .unwrap_or_else(|| panic!("limits.{k} in {limits}"))
    };
    let (ctx_total, ctx_used, ctx_reserved, ctx_free) = headroom(&after_hogs, "contexts");
    let (ch_total, ch_used, ch_reserved, ch_free) = headroom(&after_hogs, "channels");
    println!(
        "after the hogs: contexts total {ctx_total} used {ctx_used} reserved {ctx_reserved} free {ctx_free}; \
         channels total {ch_total} used {ch_used} reserved {ch_reserved} free {ch_free}"
    );
    assert_eq!((ctx_total, ch_total), (256, 256));
    assert_eq!(ctx_used, hog_usage.iter().map(|u| u.0).sum::<u64>());
    assert_eq!(ch_used, hog_usage.iter().map(|u| u.1).sum::<u64>());
    assert_eq!(
        (ctx_free, ch_free),
        (0, 0),
        "the hogs took all that is free"
    );
    assert_eq!(
        ctx_total - ctx_used,
        reserve("reserved_contexts"),
        "all that is left is the late VM's reserve of contexts"
    );
    assert_eq!(ch_total - ch_used, reserve("reserved_channels"));
    assert_eq!(ctx_reserved, 5 * reserve("reserved_contexts"));
    assert_eq!(ch_reserved, 5 * reserve("reserved_channels"));

    let (_, ctx_used2, _, ctx_free2) = headroom(&info(&client), "contexts");
    let (_, ch_used2, _, _) = headroom(&info(&client), "channels");
    println!("after the late VM's workload: contexts used {ctx_used2} free {ctx_free2}, channels used {ch_used2}");
    assert_eq!(ctx_used2, ctx_used + 1);
    assert_eq!(ch_used2, ch_used + 1);
    drop(ch);
    drop(buf);
    drop(ctx);
    drop(dev);
    late.disconnect();
    for vm in hogs {
        vm.disconnect();
    }
}
