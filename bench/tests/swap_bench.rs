//! `vgpu-bench --json --quick swap` as a user runs it: every figure of the suite is
//! printed, parseable, finite, with the documented fields.

mod common;

#[test]
fn bench_swap_quick_json() {
    let text = common::run_bench(&["--json", "--quick", "swap"]);
    let (_, names) = common::figures(&text, "swap");
    for f in ["1.5", "2", "4"] {
        for n in [
            format!("cold_set_{f}x_slowdown"),
            format!("cold_set_{f}x_hot_bytes_in_swap"),
            format!("hot_set_evicted_{f}x_slowdown"),
        ] {
            assert!(names.contains(&n), "{n} missing: {names:?}");
        }
    }
    for n in [
        "swap_over_memcpy",
        "pause_64mib_p50",
        "pause_64mib_p99",
        "cpu_store_wait_64mib_p50",
        "cpu_store_wait_64mib_p99",
        "cpu_store_gap_idle_p50",
        "two_vm_convergence",
    ] {
        assert!(names.iter().any(|x| x == n), "{n} missing: {names:?}");
    }
}
