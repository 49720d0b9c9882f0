//! Fair service of control requests (issue 16), end to end over the real vhost-user path:
//! one backend on a sim GPU, two loopback VMs. While VM `flooder` floods its control queue
//! (big VRAM objects mapped with 4 KiB pages, MAP_GUEST with the most scatter-gather
//! entries, context + channel churn whose SUBMITs fault, invalid requests) and then its
//! event queue (a NOTIFY storm it never drains), VM `victim`'s control requests each stay
//! within a bound, and the flooder is served too. The bound is wide (machines are noisy,
//! and the flood shares the host's cores): a backend lock held across another VM's work,
//! or a GPU thread stalled by a full event queue, breaks it by orders of magnitude.

use std::time::Duration;

use vgpu_backend::VmLimits;
use vgpu_bench::suites::flood::{Flood, FloodKind, Victim};
use vgpu_test_support::Host;

/// The longest single victim request while a flood runs.
const MAX_MS: f64 = 50.0;
/// The victim's p99 while a flood runs.
const P99_MS: f64 = 5.0;

#[test]
fn a_flooding_vm_does_not_delay_another_vms_requests() {
    let host = Host::new(
        "flood",
        1 << 30,
        VmLimits::default(),
        &["victim", "flooder"],
    );
    let victim = Victim::new(host.connect("victim")).expect("victim context");
    let flooder = host.connect("flooder");
    // First-touch costs are nobody's flood.
    victim
        .run(Duration::from_millis(200), Duration::from_micros(200))
        .expect("warm-up");
    for kind in [FloodKind::Control, FloodKind::Events] {
        let flood = Flood::start(&flooder, kind, 1, 32 << 20);
        std::thread::sleep(Duration::from_millis(100));
        let lat = victim
            .run(Duration::from_secs(1), Duration::from_micros(200))
            .expect("victim requests");
        let report = flood.finish().expect("flood");
        let (p99, max) = (lat.pct(99.0) / 1e3, lat.max() / 1e3);
        eprintln!(
            "{kind:?}: victim {} requests, p50 {:.3} ms, p99 {p99:.3} ms, max {max:.3} ms; \
             flooder {} requests ({:.0}/s, {} refused), {} notifies",
            lat.count(),
            lat.pct(50.0) / 1e3,
            report.requests,
            report.rate(),
            report.refused,
            report.notifies,
        );
        assert!(
            lat.count() > 100,
            "{kind:?}: the victim made too few requests"
        );
        assert!(
            p99 <= P99_MS,
            "{kind:?}: victim p99 {p99:.3} ms > {P99_MS} ms"
        );
        assert!(
            max <= MAX_MS,
            "{kind:?}: victim max {max:.3} ms > {MAX_MS} ms"
        );
        // The flooder was served too: fairness is not starving the busy VM.
        match kind {
            FloodKind::Control => assert!(
                report.requests - report.refused > 100,
                "the flooder's valid requests were not served: {report:?}"
            ),
            FloodKind::Events => assert!(
                report.notifies > 10_000,
                "the flooder's channel did not run: {report:?}"
            ),
        }
    }
    let stats = host.backend.vm_stats("flooder").expect("flooder stats");
    // The flooder never drained its events: its FIFO is full and counts what it dropped.
    assert!(stats.events_dropped > 0, "{stats:?}");
    assert_eq!(stats.events_pending, 4096, "{stats:?}");
    let v = host.backend.vm_stats("victim").expect("victim stats");
    assert_eq!(v.events_dropped, 0, "the victim lost events: {v:?}");
}
