//! Every shared workload runs and verifies against its CPU reference on the sim GPU.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use vgpu_guest::workloads::{self, *};

#[test]
fn throttle_runs_n_kernels() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    let r = workloads::throttle::run(&ctx, &ThrottleConfig::small()).unwrap();
    assert_eq!(r.iterations, 32);
    assert_eq!(r.gpu_items, 32);
    assert!(r.verified);
    // 32 spins of 20 µs, two in flight on one engine: at least the sum of the spins.
    assert!(
        r.elapsed >= Duration::from_micros(32 * 20),
        "{:?}",
        r.elapsed
    );
}

#[test]
fn throttle_stops_on_flag() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let cfg = ThrottleConfig {
        kernel_ns: 200_000,
        iterations: None,
        depth: 3,
        stop: Some(stop.clone()),
    };
    let h = std::thread::spawn(move || workloads::throttle::run(&ctx, &cfg));
    std::thread::sleep(Duration::from_millis(30));
    stop.store(true, Ordering::Relaxed);
    let r = h.join().unwrap().unwrap();
    assert!(r.iterations > 0);
    assert!(r.verified);
}

#[test]
fn throttle_needs_an_end() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    let cfg = ThrottleConfig {
        iterations: None,
        ..Default::default()
    };
    assert!(workloads::throttle::run(&ctx, &cfg).is_err());
}

#[test]
fn saxpy_verifies() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    let r = workloads::saxpy::run(&ctx, &SaxpyConfig::small()).unwrap();
    assert!(r.verified);
    assert_eq!(r.gpu_items, 8);
}

#[test]
fn sgemm_verifies() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    assert!(
        workloads::sgemm::run(&ctx, &SgemmConfig::small())
            .unwrap()
            .verified
    );
}

#[test]
fn hotspot_verifies() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    assert!(
        workloads::hotspot::run(&ctx, &HotspotConfig::small())
            .unwrap()
            .verified
    );
    // Odd and even step counts end in different buffers.
    let cfg = HotspotConfig {
        iterations: 4,
        steps_per_submit: 1,
        ..HotspotConfig::small()
    };
    assert!(workloads::hotspot::run(&ctx, &cfg).unwrap().verified);
}

#[test]
fn reduction_verifies() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    let r = workloads::reduction::run(&ctx, &ReductionConfig::small()).unwrap();
    assert!(r.verified);
    assert_eq!(r.gpu_items, 12);
}

#[test]
fn copy_heavy_verifies() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    let r = workloads::copy_heavy::run(&ctx, &CopyHeavyConfig::small()).unwrap();
    assert!(r.verified);
    // 200 KiB + 12 in 64 KiB chunks: 4 copies per leg, 3 legs, plus a checksum: 13 each.
    assert_eq!(r.gpu_items, 4 * 13);
}

#[test]
fn workloads_share_a_context_from_several_threads() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    let handles: Vec<_> = (0..3)
        .map(|i| {
            let ctx = ctx.clone();
            std::thread::spawn(move || match i {
                0 => workloads::saxpy::run(&ctx, &SaxpyConfig::small()),
                1 => workloads::hotspot::run(&ctx, &HotspotConfig::small()),
                _ => workloads::throttle::run(&ctx, &ThrottleConfig::small()),
            })
        })
        .collect();
    for h in handles {
        assert!(h.join().unwrap().unwrap().verified);
    }
}

#[test]
fn every_workload_by_name_verifies() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    for name in Workload::NAMES {
        let w = Workload::by_name(name, true).unwrap();
        let r = w.run(&ctx).unwrap();
        assert_eq!(r.name, name);
        assert!(r.verified && r.iterations > 0 && r.gpu_items > 0, "{r:?}");
    }
}

#[test]
fn api_types_cross_threads() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send_sync::<vgpu_guest::Device>();
    send_sync::<vgpu_guest::Context>();
    send::<vgpu_guest::Buffer>();
    send::<vgpu_guest::Channel>();
    send_sync::<vgpu_guest::Fence>();
}

/// Benchmark sizes; slow, run with `--ignored`.
#[test]
#[ignore]
fn every_workload_at_benchmark_size_verifies() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    for name in Workload::NAMES {
        let r = Workload::by_name(name, false).unwrap().run(&ctx).unwrap();
        eprintln!("{name}: {:?} {:.0} items/s", r.elapsed, r.items_per_sec());
        assert!(r.verified);
    }
}

/// A caller that keeps a workload's `Expected` between runs computes the CPU reference
/// once, and every run is still checked against it: one kept from another configuration
/// (other inputs) makes the run fail with a mismatch rather than pass unchecked.
#[test]
fn kept_expected_results_still_check_every_run() {
    let (_gpu, dev) = common::device();
    let ctx = dev.create_context().unwrap();
    for name in ["saxpy", "sgemm", "hotspot"] {
        let w = Workload::by_name(name, true).unwrap();
        let mut expected = Expected::default();
        for _ in 0..3 {
            let r = w.run_expecting(&ctx, &mut expected).unwrap();
            assert!(r.verified, "{name}: {r:?}");
        }
        let other = match w.clone() {
            Workload::Saxpy(c) => Workload::Saxpy(SaxpyConfig {
                seed: c.seed + 1,
                ..c
            }),
            Workload::Sgemm(c) => Workload::Sgemm(SgemmConfig {
                seed: c.seed + 1,
                ..c
            }),
            Workload::Hotspot(c) => Workload::Hotspot(HotspotConfig {
                seed: c.seed + 1,
                ..c
            }),
            _ => unreachable!(),
        };
        match other.run_expecting(&ctx, &mut expected) {
            Err(vgpu_guest::Error::Mismatch { .. }) => {}
            r => panic!("{name}: another input checked against the kept result: {r:?}"),
        }
    }
}
