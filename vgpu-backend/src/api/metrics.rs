//! `GET /metrics`: the Prometheus text exposition format (version 0.0.4).

use std::fmt::Write;

use crate::api::share::{Entity, ShareBook, WINDOWS_S};
use crate::sched::Policy;
use crate::VgpuBackend;

/// Escapes a label value.
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

struct Out(String);

impl Out {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    fn value(&mut self, name: &str, labels: &[(&str, &str)], v: f64) {
        self.0.push_str(name);
        if !labels.is_empty() {
            self.0.push('{');
            for (i, (k, val)) in labels.iter().enumerate() {
                if i > 0 {
                    self.0.push(',');
                }
                let _ = write!(self.0, "{k}=\"{}\"", esc(val));
            }
            self.0.push('}');
        }
        let _ = writeln!(self.0, " {v}");
    }
}

/// Renders every metric; `api_requests` are the API's answers so far by HTTP status.
pub fn render(be: &VgpuBackend, shares: &ShareBook, api_requests: &[(u16, u64)]) -> String {
    let mut o = Out(String::new());
    let gi = be.gpu().info();
    let version = env!("CARGO_PKG_VERSION");
    o.family("vgpu_build_info", "gauge", "Backend version and GPU model.");
    o.value(
        "vgpu_build_info",
        &[("version", version), ("gpu", &gi.name)],
        1.0,
    );
    o.family("vgpu_gpu_vram_bytes", "gauge", "VRAM of the GPU.");
    o.value("vgpu_gpu_vram_bytes", &[], gi.vram_bytes as f64);
    o.family(
        "vgpu_gpu_compute_engines",
        "gauge",
        "Compute engines of the GPU.",
    );
    o.value(
        "vgpu_gpu_compute_engines",
        &[],
        f64::from(gi.compute_engines),
    );

    let names = be.vm_names();
    let mut procs = Vec::new();
    o.family(
        "vgpu_vm_gpu_busy_seconds_total",
        "counter",
        "GPU time used by the VM's channels (live and destroyed).",
    );
    for n in &names {
        let p = be.process_busy_ns(n);
        let total: u64 = p.iter().map(|(_, b)| *b).sum();
        o.value(
            "vgpu_vm_gpu_busy_seconds_total",
            &[("vm", n)],
            total as f64 / 1e9,
        );
        procs.push((n, p));
    }
    o.family(
        "vgpu_process_gpu_busy_seconds_total",
        "counter",
        "GPU time used per guest process (PID inside its VM).",
    );
    for (n, p) in &procs {
        for (pid, busy) in p {
            o.value(
                "vgpu_process_gpu_busy_seconds_total",
                &[("vm", n), ("pid", &pid.to_string())],
                *busy as f64 / 1e9,
            );
        }
    }
    o.family(
        "vgpu_vm_gpu_share",
        "gauge",
        "Share of all GPU time used in the recent window (0..1).",
    );
    for n in &names {
        for w in shares.windows(Entity::Vm(n), gi.compute_engines) {
            o.value(
                "vgpu_vm_gpu_share",
                &[("vm", n), ("window", &format!("{}s", w.window_s))],
                w.share,
            );
        }
    }
    o.family(
        "vgpu_process_gpu_share",
        "gauge",
        "Share of all GPU time used by a guest process in the recent window (0..1).",
    );
    for (n, p) in &procs {
        for (pid, _) in p {
            for w in shares.windows(Entity::Process(n, *pid), gi.compute_engines) {
                o.value(
                    "vgpu_process_gpu_share",
                    &[
                        ("vm", n),
                        ("pid", &pid.to_string()),
                        ("window", &format!("{}s", w.window_s)),
                    ],
                    w.share,
                );
            }
        }
    }
    debug_assert!(WINDOWS_S.contains(&10));

    let gauges: [(&str, &str); 9] = [
        ("vgpu_vm_connected", "Whether a VMM is connected (0/1)."),
        (
            "vgpu_vm_paused",
            "Whether the operator paused the VM (0/1).",
        ),
        ("vgpu_vm_weight", "The VM's scheduling weight."),
        ("vgpu_vm_vram_bytes", "VRAM held by the VM's objects."),
        ("vgpu_vm_vram_quota_bytes", "The VM's VRAM quota."),
        ("vgpu_vm_channels", "Live channels of the VM."),
        (
            "vgpu_vm_shadowed_channels",
            "Channels of the VM shadowed now.",
        ),
        ("vgpu_vm_contexts", "Live GPU contexts of the VM."),
        (
            "vgpu_vm_aperture_bytes",
            "VRAM mapped into the VM's BAR aperture.",
        ),
    ];
    for (name, help) in gauges {
        o.family(name, "gauge", help);
        for n in &names {
            let (Some(st), Some(lim), Some(sh), Some(w), Some(p)) = (
                be.vm_stats(n),
                be.vm_limits(n),
                be.shadow_stats(n),
                be.vm_weight(n),
                be.vm_paused(n),
            ) else {
                continue;
            };
            let v = match name {
                "vgpu_vm_connected" => f64::from(u8::from(st.connected)),
                "vgpu_vm_paused" => f64::from(u8::from(p)),
                "vgpu_vm_weight" => f64::from(w),
                "vgpu_vm_vram_bytes" => st.vram_bytes as f64,
                "vgpu_vm_vram_quota_bytes" => lim.vram_bytes as f64,
                "vgpu_vm_channels" => f64::from(st.channels),
                "vgpu_vm_shadowed_channels" => f64::from(sh.shadowed_now),
                "vgpu_vm_contexts" => f64::from(st.contexts),
                _ => st.aperture_bytes as f64,
            };
            o.value(name, &[("vm", n)], v);
        }
    }
    let counters: [(&str, &str); 3] = [
        (
            "vgpu_vm_requests_total",
            "Control-queue requests of the VM's guest driver.",
        ),
        (
            "vgpu_vm_request_errors_total",
            "Guest control-queue requests answered with an error.",
        ),
        ("vgpu_vm_disconnects_total", "VMM disconnects."),
    ];
    for (name, help) in counters {
        o.family(name, "counter", help);
        for n in &names {
            let Some(st) = be.vm_stats(n) else { continue };
            let v = match name {
                "vgpu_vm_requests_total" => st.requests,
                "vgpu_vm_request_errors_total" => st.errors,
                _ => st.disconnects,
            };
            o.value(name, &[("vm", n)], v as f64);
        }
    }

    let cfg = be.scheduler_config();
    let st = be.sched_stats();
    o.family(
        "vgpu_sched_policy",
        "gauge",
        "The scheduling policy in force (1 for the named policy).",
    );
    let policy = cfg.map_or(Policy::None, |c| c.policy);
    o.value("vgpu_sched_policy", &[("policy", policy.name())], 1.0);
    o.family(
        "vgpu_sched_interval_seconds",
        "gauge",
        "Configured scheduling interval.",
    );
    o.value(
        "vgpu_sched_interval_seconds",
        &[],
        cfg.map_or(0.0, |c| f64::from(c.interval_ms) / 1e3),
    );
    for (name, help, v) in [
        (
            "vgpu_sched_intervals_total",
            "Scheduling intervals run.",
            st.intervals,
        ),
        (
            "vgpu_sched_shadows_total",
            "Channels shadowed by the scheduler.",
            st.shadows,
        ),
        (
            "vgpu_sched_unshadows_total",
            "Channels unshadowed by the scheduler.",
            st.unshadows,
        ),
        (
            "vgpu_sched_capped_releases_total",
            "Capped releases by the scheduler.",
            st.capped_releases,
        ),
        (
            "vgpu_sched_failures_total",
            "Scheduler remaps that failed.",
            st.failures,
        ),
    ] {
        o.family(name, "counter", help);
        o.value(name, &[], v as f64);
    }
    o.family(
        "vgpu_sched_tick_seconds",
        "gauge",
        "Work time of the last scheduling interval, and the worst.",
    );
    o.value(
        "vgpu_sched_tick_seconds",
        &[("which", "last")],
        st.tick_ns_last as f64 / 1e9,
    );
    o.value(
        "vgpu_sched_tick_seconds",
        &[("which", "max")],
        st.tick_ns_max as f64 / 1e9,
    );

    o.family(
        "vgpu_api_requests_total",
        "counter",
        "Control API requests answered, by HTTP status.",
    );
    let mut errors = 0;
    for (status, n) in api_requests {
        o.value(
            "vgpu_api_requests_total",
            &[("status", &status.to_string())],
            *n as f64,
        );
        if *status >= 400 {
            errors += n;
        }
    }
    o.family(
        "vgpu_api_request_errors_total",
        "counter",
        "Control API requests answered with a 4xx or 5xx status.",
    );
    o.value("vgpu_api_request_errors_total", &[], errors as f64);
    o.0
}
