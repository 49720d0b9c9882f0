//! The guest tools as a user runs them, on an in-process sim (`--native`, feature
//! `native`: `cargo test --workspace` has it): in a VM they run over /dev/vgpu
//! (`ci/rig/l2-driver.sh`). Output formats are what rig scripts parse.

use std::process::Command;

#[cfg(feature = "native")]
fn run(bin: &str, args: &[&str]) -> String {
    let out = Command::new(bin).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{bin} {args:?}: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[cfg(feature = "native")]
#[test]
fn smoke_native_passes_and_reports() {
    let text = run(env!("CARGO_BIN_EXE_vgpu-smoke"), &["--native"]);
    let last = text.lines().last().unwrap();
    assert!(last.starts_with("VGPU-SMOKE-RESULT pass="), "{text}");
    assert!(last.contains(" fail=0 "), "{text}");
}

#[test]
fn smoke_without_a_device_fails() {
    let out = Command::new(env!("CARGO_BIN_EXE_vgpu-smoke"))
        .args(["--device", "/dev/null"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("VGPU-SMOKE-RESULT pass=0 fail=1"), "{text}");
}

#[cfg(feature = "native")]
#[test]
fn throttle_runs_its_kernels() {
    let text = run(
        env!("CARGO_BIN_EXE_vgpu-throttle"),
        &["--native", "--kernels", "20", "--kernel-us", "200"],
    );
    assert!(text.contains("kernels=20 "), "{text}");
}

#[cfg(feature = "native")]
#[test]
fn bench_guest_native_json() {
    let text = run(
        env!("CARGO_BIN_EXE_vgpu-guest-bench"),
        &["--json", "--quick", "--native"],
    );
    let names: Vec<String> = text
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            assert_eq!(v["suite"], "guest");
            assert!(v["value"].as_f64().unwrap() > 0.0, "{l}");
            v["name"].as_str().unwrap().to_string()
        })
        .collect();
    for n in ["saxpy_native", "round_trip_p50_native"] {
        assert!(names.iter().any(|x| x == n), "{n} missing: {names:?}");
    }
}
