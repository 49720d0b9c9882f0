//! `GET /metrics`: the Prometheus text exposition format (version 0.0.4).

use std::fmt::Write;

use crate::api::share::{with_entitlement, Entity, ShareBook, WINDOWS_S};
use crate::sched::Policy;
use crate::vram::{ProcVramStats, VmVramStats, VramReport};
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

    if let Some(w) = be.worker_stats() {
        o.family(
            "vgpu_gpu_workers_running",
            "gauge",
            "GPU worker processes running (one per VM that has GPU objects).",
        );
        o.value("vgpu_gpu_workers_running", &[], w.running as f64);
        o.family(
            "vgpu_gpu_worker_starts_total",
            "counter",
            "GPU worker processes started, restarts after a loss included.",
        );
        o.value("vgpu_gpu_worker_starts_total", &[], w.started as f64);
        o.family(
            "vgpu_gpu_worker_losses_total",
            "counter",
            "GPU worker processes lost (died, faulted, hung past the call timeout or broke \
             the protocol) and replaced.",
        );
        o.value("vgpu_gpu_worker_losses_total", &[], w.lost as f64);
        o.family(
            "vgpu_gpu_worker_losses_by_kind_total",
            "counter",
            "GPU worker processes lost and replaced, by why: gpu_fault (its GPU faulted \
             for good), crashed, exited, timed_out, protocol, killed.",
        );
        for k in vgpu_gpu_worker::LossKind::ALL {
            o.value(
                "vgpu_gpu_worker_losses_by_kind_total",
                &[("kind", k.name())],
                w.lost_as(k) as f64,
            );
        }
        // Per VM: with a worker per guest process a VM has several, and a loss fails
        // one process's contexts only.
        o.family(
            "vgpu_vm_gpu_workers_running",
            "gauge",
            "GPU worker processes running for the VM (one, or one per guest process with \
             GPU objects with --gpu-workers=process).",
        );
        for v in &w.vms {
            o.value(
                "vgpu_vm_gpu_workers_running",
                &[("vm", &v.vm)],
                v.running as f64,
            );
        }
        o.family(
            "vgpu_vm_gpu_worker_starts_total",
            "counter",
            "GPU worker processes started for the VM, restarts included.",
        );
        for v in &w.vms {
            o.value(
                "vgpu_vm_gpu_worker_starts_total",
                &[("vm", &v.vm)],
                v.started as f64,
            );
        }
        o.family(
            "vgpu_vm_gpu_worker_losses_total",
            "counter",
            "GPU worker processes of the VM lost, by why (as \
             vgpu_gpu_worker_losses_by_kind_total).",
        );
        for v in &w.vms {
            for (k, n) in vgpu_gpu_worker::LossKind::ALL.iter().zip(v.lost_by_kind) {
                o.value(
                    "vgpu_vm_gpu_worker_losses_total",
                    &[("vm", &v.vm), ("kind", k.name())],
                    n as f64,
                );
            }
        }
    }

    let cap = be.capacity();
    for (name, what, h) in [
        ("vgpu_gpu_contexts", "Contexts", cap.contexts),
        ("vgpu_gpu_channels", "Channels", cap.channels),
    ] {
        o.family(
            name,
            "gauge",
            &format!(
                "{what} of the GPU: total, used by the VMs, reserved (the VMs' reserves \
                 together), free (what a VM may take beyond its reserve)."
            ),
        );
        for (state, v) in [
            ("total", h.total),
            ("used", h.used),
            ("reserved", h.reserved),
            ("free", h.free),
        ] {
            o.value(name, &[("state", state)], f64::from(v));
        }
    }

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
        "vgpu_vm_gpu_entitled_share",
        "gauge",
        "What the VM was owed of the GPU time used in the recent window (0..1): weighted \
         max-min over measured demands, from the scheduler's interval records.",
    );
    for n in &names {
        let ws = with_entitlement(
            be,
            Entity::Vm(n),
            shares.windows(Entity::Vm(n), gi.compute_engines),
        );
        for w in ws {
            if let Some(e) = w.entitled {
                o.value(
                    "vgpu_vm_gpu_entitled_share",
                    &[("vm", n), ("window", &format!("{}s", w.window_s))],
                    e,
                );
            }
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

    let gauges: [(&str, &str); 11] = [
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
        ("vgpu_vm_mappings", "GPU mappings of the VM."),
        (
            "vgpu_vm_page_table_bytes",
            "Host memory of the VM's GPU mappings (page tables and their records).",
        ),
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
                "vgpu_vm_mappings" => f64::from(st.mappings),
                "vgpu_vm_page_table_bytes" => st.page_table_bytes as f64,
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

    vram(&mut o, be, &names);

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

/// A per-VM figure of the VRAM manager: name, type, help, value.
type VmFigure = (
    &'static str,
    &'static str,
    &'static str,
    fn(&VmVramStats) -> f64,
);
/// A per-process one.
type ProcFigure = (
    &'static str,
    &'static str,
    &'static str,
    fn(&ProcVramStats) -> f64,
);

const VM_VRAM: [VmFigure; 13] = [
    (
        "vgpu_vm_vram_resident_bytes",
        "gauge",
        "VRAM of the VM's objects resident on the GPU.",
        |v| v.resident_bytes as f64,
    ),
    (
        "vgpu_vm_vram_swapped_bytes",
        "gauge",
        "VRAM of the VM's objects swapped out to system memory.",
        |v| v.swapped_bytes as f64,
    ),
    (
        "vgpu_vm_vram_share_bytes",
        "gauge",
        "The resident share the VRAM manager computed last for the VM.",
        |v| v.share_bytes as f64,
    ),
    (
        "vgpu_vm_vram_swap_limit_bytes",
        "gauge",
        "The VM's swap limit (allocations beyond its quota).",
        |v| v.swap_limit_bytes as f64,
    ),
    (
        "vgpu_vm_vram_evictions_total",
        "counter",
        "2 MiB chunks of the VM's VRAM moved out to its swap store.",
        |v| v.evictions as f64,
    ),
    (
        "vgpu_vm_vram_swap_ins_total",
        "counter",
        "2 MiB chunks of the VM's VRAM moved back in from its swap store.",
        |v| v.swap_ins as f64,
    ),
    (
        "vgpu_vm_vram_bytes_out_total",
        "counter",
        "Bytes of the VM's VRAM moved out to its swap store.",
        |v| v.bytes_out as f64,
    ),
    (
        "vgpu_vm_vram_bytes_in_total",
        "counter",
        "Bytes of the VM's VRAM moved back in from its swap store.",
        |v| v.bytes_in as f64,
    ),
    (
        "vgpu_vm_vram_spilled_chunks_total",
        "counter",
        "Chunks of new allocations placed straight into swap (VRAM was full).",
        |v| v.spilled_chunks as f64,
    ),
    (
        "vgpu_vm_vram_pauses_total",
        "counter",
        "Pauses of the VM's channels for VRAM moves.",
        |v| v.pauses as f64,
    ),
    (
        "vgpu_vm_vram_pause_seconds_total",
        "counter",
        "Time the VM's channels spent paused for VRAM moves (summed per move).",
        |v| v.pause_ns_total as f64 / 1e9,
    ),
    (
        "vgpu_vm_vram_move_failures_total",
        "counter",
        "VRAM moves abandoned on a GPU or frontend failure.",
        |v| v.move_failures as f64,
    ),
    (
        "vgpu_vm_vram_drain_timeouts_total",
        "counter",
        "VRAM moves abandoned because the VM's channels did not drain in time.",
        |v| v.drain_timeouts as f64,
    ),
];

const PROC_VRAM: [ProcFigure; 7] = [
    (
        "vgpu_process_vram_resident_bytes",
        "gauge",
        "VRAM of a guest process's objects resident on the GPU.",
        |p| p.resident_bytes as f64,
    ),
    (
        "vgpu_process_vram_swapped_bytes",
        "gauge",
        "VRAM of a guest process's objects swapped out to system memory.",
        |p| p.swapped_bytes as f64,
    ),
    (
        "vgpu_process_vram_evictions_total",
        "counter",
        "2 MiB chunks of a guest process's VRAM moved out.",
        |p| p.evictions as f64,
    ),
    (
        "vgpu_process_vram_swap_ins_total",
        "counter",
        "2 MiB chunks of a guest process's VRAM moved back in.",
        |p| p.swap_ins as f64,
    ),
    (
        "vgpu_process_vram_bytes_out_total",
        "counter",
        "Bytes of a guest process's VRAM moved out.",
        |p| p.bytes_out as f64,
    ),
    (
        "vgpu_process_vram_bytes_in_total",
        "counter",
        "Bytes of a guest process's VRAM moved back in.",
        |p| p.bytes_in as f64,
    ),
    (
        "vgpu_process_vram_pause_seconds_total",
        "counter",
        "Time a guest process's channels spent paused for VRAM moves.",
        |p| p.pause_ns as f64 / 1e9,
    ),
];

/// The VRAM manager's figures: backend-wide, per VM and per guest process.
fn vram(o: &mut Out, be: &VgpuBackend, names: &[String]) {
    let ov = be.vram_overview();
    o.family(
        "vgpu_gpu_vram_free_bytes",
        "gauge",
        "VRAM of the GPU not allocated.",
    );
    o.value("vgpu_gpu_vram_free_bytes", &[], ov.free_bytes as f64);
    o.family(
        "vgpu_vram_manager_passes_total",
        "counter",
        "Passes of the VRAM manager.",
    );
    o.value("vgpu_vram_manager_passes_total", &[], ov.passes as f64);
    o.family(
        "vgpu_vram_manager_batches_total",
        "counter",
        "Batches of chunks the VRAM manager moved (one pause each at most).",
    );
    o.value("vgpu_vram_manager_batches_total", &[], ov.batches as f64);

    // One report per VM (each takes the VM's session lock once).
    let reports: Vec<(&String, VramReport)> = names
        .iter()
        .filter_map(|n| Some((n, be.vram_stats(n)?)))
        .collect();
    for (name, kind, help, f) in VM_VRAM {
        o.family(name, kind, help);
        for (n, r) in &reports {
            o.value(name, &[("vm", n)], f(&r.vm));
        }
    }
    o.family(
        "vgpu_vm_vram_pause_seconds",
        "gauge",
        "Pause per VRAM move: median and 99th percentile of the last 4096, and the worst.",
    );
    for (n, r) in &reports {
        for (which, ns) in [
            ("p50", r.pause_p50_ns),
            ("p99", r.pause_p99_ns),
            ("max", r.vm.pause_ns_max),
        ] {
            o.value(
                "vgpu_vm_vram_pause_seconds",
                &[("vm", n), ("which", which)],
                ns as f64 / 1e9,
            );
        }
    }
    for (name, kind, help, f) in PROC_VRAM {
        o.family(name, kind, help);
        for (n, r) in &reports {
            for p in &r.procs {
                o.value(name, &[("vm", n), ("pid", &p.pid.to_string())], f(p));
            }
        }
    }
}
