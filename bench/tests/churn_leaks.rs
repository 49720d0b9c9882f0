//! Churn leaves nothing behind: after 1,000 connect/disconnect cycles of a VM over the
//! real vhost-user socket, and 10,000 create/destroy cycles of contexts and channels in
//! one connection, the process has the same open fds and threads as before and its RSS
//! has not grown beyond allocator noise (issue 15), and the backend's books show no
//! object of the VM.

use std::time::{Duration, Instant};

use vgpu_backend::VmLimits;
use vgpu_bench::churn::one_connection;
use vgpu_bench::proc_stats::{open_fds, rss, steady_fds_threads, threads};
use vgpu_guest::Device;
use vgpu_test_support::Host;

/// Cycles run before the RSS baseline is taken (10× that for object churn).
const WARM_CYCLES: u32 = 100;

/// RSS growth tolerated after the warm-up: the allocator's caches, not a leak (a leak of
/// one page per cycle would be 3.5 MiB over the connection cycles, and a VM's guest
/// RAM kept per connection far more).
const RSS_SLACK: u64 = 2 << 20;

/// Waits (up to 10 s) until the fd and thread counts come back to `want`; returns them.
fn settle(want: (u64, u64)) -> (u64, u64) {
    let t0 = Instant::now();
    loop {
        let now = (open_fds(), threads());
        if now == want || t0.elapsed() > Duration::from_secs(10) {
            return now;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Both churns in one test: fd and thread counts are per process, so nothing else may
/// run beside them.
#[test]
fn churn_leaks_no_fd_no_thread_and_no_object() {
    connect_disconnect_cycles();
    context_and_channel_churn_in_one_connection();
}

fn connect_disconnect_cycles() {
    let host = Host::new("churn-conn", 256 << 20, VmLimits::default(), &["vm"]);
    // The first connection starts what lives as long as the backend (thread pools).
    one_connection(&host, "vm", 1, || ());
    let before = steady_fds_threads();
    const CYCLES: u32 = 1_000;
    // The allocator settles over the first cycles; RSS is compared from there.
    for i in 0..WARM_CYCLES {
        one_connection(&host, "vm", 2 + i, || ());
    }
    let rss0 = rss();
    for i in WARM_CYCLES..CYCLES {
        one_connection(&host, "vm", 2 + i, || ());
    }
    let after = settle(before);
    let grown = rss().saturating_sub(rss0);
    println!(
        "{CYCLES} connect/disconnect cycles: (fds, threads) {before:?} -> {after:?}, RSS +{} KiB",
        grown >> 10
    );
    assert_eq!(
        after, before,
        "(fds, threads) before and after {CYCLES} connect/disconnect cycles"
    );
    assert!(
        grown < RSS_SLACK,
        "RSS grew {grown} bytes over {CYCLES} cycles"
    );
    let s = host.backend.vm_stats("vm").unwrap();
    assert_eq!((s.contexts, s.channels, s.vram_bytes), (0, 0, 0), "{s:?}");
}

fn context_and_channel_churn_in_one_connection() {
    let host = Host::new("churn-objs", 256 << 20, VmLimits::default(), &["vm"]);
    let lvm = host.connect("vm");
    let dev = Device::loopback(lvm.clone(), 7).unwrap();
    {
        let ctx = dev.create_context().unwrap();
        let _ch = ctx.create_channel().unwrap();
    }
    let before = steady_fds_threads();
    const CYCLES: u32 = 10_000;
    let cycle = || {
        let ctx = dev.create_context().unwrap();
        let ch = ctx.create_channel().unwrap();
        drop(ch);
        drop(ctx);
    };
    for _ in 0..WARM_CYCLES * 10 {
        cycle();
    }
    let rss0 = rss();
    for _ in WARM_CYCLES * 10..CYCLES {
        cycle();
    }
    let after = settle(before);
    let grown = rss().saturating_sub(rss0);
    println!(
        "{CYCLES} context+channel cycles: (fds, threads) {before:?} -> {after:?}, RSS +{} KiB",
        grown >> 10
    );
    assert_eq!(
        after, before,
        "(fds, threads) after {CYCLES} context+channel cycles"
    );
    assert!(
        grown < RSS_SLACK,
        "RSS grew {grown} bytes over {CYCLES} cycles"
    );
    let s = host.backend.vm_stats("vm").unwrap();
    assert_eq!((s.contexts, s.channels), (0, 0), "{s:?}");
    lvm.disconnect();
}
