//! MAP_VRAM aliasing is bounded (issue 28, item 5): a guest maps one 16 MiB VRAM object
//! again and again with 4 KiB pages, over the real vhost-user socket. Each alias costs the
//! backend host memory for page tables; the VM's mappings are bounded in count and in
//! that memory, so the guest gets `LimitExceeded` at the bound, a refused map leaves
//! nothing mapped, the backend's RSS grows by about the bound only, and the VM's stats
//! show the page-table bytes it holds.

use serde_json::Value;
use vgpu_backend::api::client::ApiClient;
use vgpu_backend::api::{ApiOptions, ApiServer};
use vgpu_backend::VmLimits;
use vgpu_bench::proc_stats::rss;
use vgpu_bench::suites::flood::call;
use vgpu_protocol::request::{Op, ReplyBody, PAGE_4K};
use vgpu_protocol::ErrorCode;
use vgpu_test_support::Host;

const MIB: u64 = 1 << 20;
/// The object mapped over and over.
const OBJECT: u64 = 16 * MIB;
/// Aliases tried (the hostile suite's 512: 8 GiB of aliased VRAM).
const ALIASES: u64 = 512;
/// Where alias `i` goes: apart, so no two share a page directory entry.
const VA_BASE: u64 = 1 << 36;
const VA_STEP: u64 = 32 * MIB;
/// RSS growth tolerated: the default page-table budget of a VM (32 MiB) plus allocator
/// slack. Unbounded, 512 aliases cost about 124 MiB.
const RSS_BOUND: u64 = 48 * MIB;

fn usage(c: &ApiClient) -> Value {
    let r = c.raw("GET", "/api/v1/vms/vm", None).expect("GET vm");
    assert_eq!(r.status, 200);
    let v: Value = serde_json::from_slice(&r.body).expect("JSON");
    v["usage"].clone()
}

#[test]
fn aliasing_one_object_stops_at_the_page_table_bound() {
    let _ = env_logger::builder().is_test(true).try_init();
    let host = Host::new("alias", 64 * MIB, VmLimits::default(), &["vm"]).with_vm_mem(16 * MIB);
    let api = ApiServer::start(
        &host.backend,
        &host.dir.join("api.sock"),
        ApiOptions::default(),
    )
    .expect("API");
    let client = ApiClient::new(api.path());
    let vm = host.connect("vm");
    let pid = 9;
    let ctx = match call(&vm, pid, 0, Op::CreateContext).expect("request") {
        Ok(ReplyBody::Context { ctx, .. }) => ctx,
        other => panic!("CREATE_CONTEXT: {other:?}"),
    };
    let alloc = |size: u64| match call(&vm, pid, ctx, Op::AllocVram { size, align: 4096 })
        .expect("request")
    {
        Ok(ReplyBody::Mem { mem, .. }) => mem,
        other => panic!("ALLOC_VRAM: {other:?}"),
    };
    let mem = alloc(OBJECT);
    let map = |mem: u32, va: u64| {
        let op = Op::MapVram {
            mem,
            flags: 0,
            va,
            page: PAGE_4K,
        };
        call(&vm, pid, ctx, op).expect("request")
    };
    let unmap = |va: u64| call(&vm, pid, ctx, Op::Unmap { va }).expect("request");
    // One alias made and dropped first, so the baseline has the allocator warm.
    map(mem, VA_BASE).expect("first map");
    unmap(VA_BASE).expect("unmap");
    let rss0 = rss();

    let mut mapped = Vec::new();
    let mut refused = Vec::new();
    let t0 = std::time::Instant::now();
    for i in 0..ALIASES {
        let va = VA_BASE + i * VA_STEP;
        match map(mem, va) {
            Ok(_) => {
                assert!(refused.is_empty(), "alias {i} accepted after a refusal");
                mapped.push(va);
            }
            Err(code) => refused.push((va, code)),
        }
    }
    let took = t0.elapsed();
    let grown = rss().saturating_sub(rss0);
    let u = usage(&client);
    println!(
        "{} of {ALIASES} aliases of a 16 MiB object accepted in {:.2} s, RSS +{} MiB; usage {u}",
        mapped.len(),
        took.as_secs_f64(),
        grown / MIB
    );
    assert!(
        !refused.is_empty(),
        "every alias accepted: RSS +{} MiB",
        grown / MIB
    );
    assert!(
        refused.iter().all(|(_, c)| *c == ErrorCode::LimitExceeded),
        "{refused:?}"
    );
    assert!(grown < RSS_BOUND, "RSS grew {} MiB", grown / MIB);

    // The VM's stats count the mappings and their page-table memory.
    let pt = u["page_table_bytes"]
        .as_u64()
        .expect("usage.page_table_bytes");
    assert_eq!(u["mappings"].as_u64(), Some(mapped.len() as u64), "{u}");
    let per_alias = pt / mapped.len() as u64;
    println!("page-table bytes: {pt} ({} KiB per alias)", per_alias >> 10);
    // 4096 pages and 8 page tables of 512 entries per alias: at least 4096 × 32 bytes.
    assert!(per_alias >= 4096 * 32, "{per_alias} bytes per alias");
    let d = client.raw("GET", "/api/v1/vms/vm", None).expect("GET vm");
    let v: Value = serde_json::from_slice(&d.body).expect("JSON");
    let limit = v["limits"]["page_table_bytes"]
        .as_u64()
        .expect("limits.page_table_bytes");
    assert!(
        pt <= limit && pt + per_alias > limit,
        "stopped at {pt} of {limit}"
    );

    // A refused map left nothing behind: its VA is free for a small object.
    let (va, _) = refused[0];
    assert_eq!(unmap(va), Err(ErrorCode::NotFound));
    for va in &mapped {
        unmap(*va).expect("unmap");
    }
    let u = usage(&client);
    assert_eq!(u["page_table_bytes"].as_u64(), Some(0), "{u}");
    assert_eq!(u["mappings"].as_u64(), Some(0), "{u}");
    let small = alloc(4096);
    map(small, va).expect("the refused VA is free");
    vm.disconnect();
}
