//! The tools as a user runs them: `vgpu-bench --json` prints parseable figures with the
//! documented fields, and the demo runs its tenants to a summary with no failures.

use std::process::Command;

mod common;

#[test]
fn bench_sim_quick_json() {
    let text = common::run_bench(&["--json", "--quick", "sim"]);
    let (_, names) = common::figures(&text, "sim");
    for n in [
        "dispatch_empty_kernels",
        "submit_latency_p50",
        "submit_latency_p99",
        "copy_engine_vs_memcpy",
        "sgemm",
        "engine_threads_cpu",
    ] {
        assert!(names.iter().any(|x| x == n), "{n} missing: {names:?}");
    }
}

#[test]
fn bench_migrate_quick_json() {
    let text = common::run_bench(&["--json", "--quick", "migrate"]);
    let (_, names) = common::figures(&text, "migrate");
    for n in [
        "idle_16mib_channel_pause",
        "idle_16mib_control_freeze",
        "idle_16mib_precopy_rounds",
        "idle_16mib_stop_and_copy_channel_pause",
        "16mib_write_64mib_s_paused_bytes",
        "16mib_write_64mib_s_round_1_bytes",
    ] {
        assert!(names.iter().any(|x| x == n), "{n} missing: {names:?}");
    }
    // The first round copies the whole buffer while the channels run.
    let figs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let round1 = figs
        .iter()
        .find(|f| f["name"] == "16mib_write_64mib_s_round_1_bytes")
        .and_then(|f| f["value"].as_f64())
        .unwrap_or(0.0);
    assert!(round1 >= 16.0, "round 1 carried {round1} MiB");
}

#[test]
fn bench_api_quick_json() {
    let text = common::run_bench(&["--json", "--quick", "api"]);
    let figs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for name in [
        "weight_change_delay_p50",
        "weight_change_ticks_p50",
        "get_info_p50",
        "put_weight_p99",
    ] {
        let f = figs
            .iter()
            .find(|f| f["name"] == name)
            .unwrap_or_else(|| panic!("{name} missing:\n{text}"));
        assert_eq!(f["suite"], "api");
        assert!(f["value"].as_f64().unwrap() > 0.0, "{f}");
    }
}

#[test]
fn bench_sched_quick_json() {
    let dir = std::env::temp_dir().join(format!("vgpu-plots-{}", std::process::id()));
    let dir_arg = dir.to_str().unwrap();
    let text = common::run_bench(&["--json", "--quick", "sched", "--plots", dir_arg]);
    let (figs, names) = common::figures(&text, "sched");
    for v in &figs {
        if !v["target"].is_null() {
            assert!(v["met"].is_boolean(), "{v}");
        }
    }
    for n in [
        "fleig_none_k100us_runtime",
        "fleig_fair_k10000us_dev",
        "fleig_fair_k10000us_wall_vs_half_share",
        "fleig_fair_max_dev",
        "vm_a_max_dev_fair",
        "weights_124_max_dev",
        "two_level_max_dev",
        "two_level_idle_max_dev",
        "weight_change_effect_intervals",
        "overhead_fair_vs_none_throughput",
        "shadow_switch_p50",
        "shadow_switch_p99",
        "timeslice_vm_a_share",
        "sampling_vm_a_share",
    ] {
        assert!(names.iter().any(|x| x == n), "{n} missing: {names:?}");
    }
    for plot in [
        "sched_fleig_runtime.svg",
        "sched_vm_vs_throttles.svg",
        "sched_shares_over_time.svg",
    ] {
        let svg = std::fs::read_to_string(dir.join(plot)).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("<polyline"),
            "{plot}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn demo_runs_every_tenant() {
    let out = Command::new(env!("CARGO_BIN_EXE_vgpu-demo"))
        .args(["--duration", "1.5", "--interval", "0.5", "--quick"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Halfway, the demo changed vm2's weight through the control API's socket.
    assert!(text.contains("vm set-weight vm2 400 -> ok"), "{text}");
    let summary = text.split("summary").nth(1).expect("summary table");
    let vm2 = summary
        .lines()
        .find(|l| l.split_whitespace().count() == 5 && l.starts_with("vm2 "))
        .unwrap_or_else(|| panic!("no before/after row for vm2:\n{summary}"));
    let cols: Vec<&str> = vm2.split_whitespace().collect();
    assert_eq!((cols[1], cols[3]), ("100", "400"), "{vm2}");
    // Every guest process of every VM got GPU time through the backend.
    for (vm, pid, w) in [
        ("vm1", "101", "throttle-2ms"),
        ("vm2", "201", "throttle-200us"),
        ("vm3", "301", "saxpy"),
        ("vm3", "302", "hotspot"),
        ("vm4", "401", "sgemm"),
    ] {
        let row = summary
            .lines()
            .find(|l| l.split_whitespace().take(3).eq([vm, pid, w]))
            .unwrap_or_else(|| panic!("{vm}/{w} missing:\n{summary}"));
        let share: f64 = row
            .split_whitespace()
            .nth(3)
            .unwrap()
            .trim_end_matches('%')
            .parse()
            .unwrap();
        assert!(share > 0.0, "{vm}/{w} got no GPU time: {row}");
        let failures: u64 = row.split_whitespace().last().unwrap().parse().unwrap();
        assert_eq!(failures, 0, "{row}");
    }
}
