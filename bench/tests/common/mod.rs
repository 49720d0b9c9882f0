//! Helpers shared by the tests that run `vgpu-bench` as a user would.

use std::process::Command;

/// Runs `vgpu-bench ARGS`, requires exit status 0, returns its standard output.
pub fn run_bench(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_vgpu-bench"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Parses `--json` output: every line one figure with the documented fields, of `suite`,
/// with a finite value. Returns the figures and their names.
pub fn figures(text: &str, suite: &str) -> (Vec<serde_json::Value>, Vec<String>) {
    let mut figs = Vec::new();
    let mut names = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        for key in ["suite", "name", "value", "unit", "better", "target"] {
            assert!(v.get(key).is_some(), "{key} missing in {line}");
        }
        assert_eq!(v["suite"], suite);
        assert!(v["value"].as_f64().unwrap().is_finite(), "{line}");
        names.push(v["name"].as_str().unwrap().to_string());
        figs.push(v);
    }
    (figs, names)
}
