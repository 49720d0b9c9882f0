//! `vgpu-bench --json --quick swap` as a user runs it: every figure of the suite is
//! printed, parseable, finite, with the documented fields.

use std::process::Command;

#[test]
fn bench_swap_quick_json() {
    let out = Command::new(env!("CARGO_BIN_EXE_vgpu-bench"))
        .args(["--json", "--quick", "swap"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let mut names = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        for key in ["suite", "name", "value", "unit", "better", "target"] {
            assert!(v.get(key).is_some(), "{key} missing in {line}");
        }
        assert_eq!(v["suite"], "swap");
        assert!(v["value"].as_f64().unwrap().is_finite(), "{line}");
        names.push(v["name"].as_str().unwrap().to_string());
    }
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
        "two_vm_convergence",
    ] {
        assert!(names.iter().any(|x| x == n), "{n} missing: {names:?}");
    }
}
