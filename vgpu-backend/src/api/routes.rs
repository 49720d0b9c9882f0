//! The route table and the handlers of the control API. [`ROUTES`] is what the router
//! dispatches on (and what the OpenAPI test compares `docs/api/openapi.yaml` with).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Map, Number, Value};

use crate::api::http::{Request, Response};
use crate::api::metrics;
use crate::api::share::{with_entitlement, Entity, ShareBook};
use crate::api::types::*;
use crate::control::{ControlError, MAX_VRAM_QUOTA, MIN_VRAM_QUOTA};
use crate::sched::{Policy, SchedConfig, SchedError, MAX_WEIGHT, MIN_WEIGHT};
use crate::VgpuBackend;

/// Every route: path template and methods. `{name}` stands for a VM name.
pub const ROUTES: &[(&str, &[&str])] = &[
    ("/api/v1/info", &["GET"]),
    ("/api/v1/vms", &["GET"]),
    ("/api/v1/vms/{name}", &["GET"]),
    ("/api/v1/vms/{name}/stats", &["GET"]),
    ("/api/v1/vms/{name}/migration", &["GET"]),
    ("/api/v1/vms/{name}/weight", &["PUT"]),
    ("/api/v1/vms/{name}/vram-quota", &["PUT"]),
    ("/api/v1/vms/{name}/pause", &["PUT"]),
    ("/api/v1/vms/{name}/resume", &["PUT"]),
    ("/api/v1/vms/{name}/drain", &["PUT"]),
    ("/api/v1/scheduler", &["GET", "PUT"]),
    ("/metrics", &["GET"]),
];

/// Drain waits this long unless told otherwise, and at most [`MAX_DRAIN_TIMEOUT_MS`].
pub const DEFAULT_DRAIN_TIMEOUT_MS: u64 = 10_000;
pub const MAX_DRAIN_TIMEOUT_MS: u64 = 60_000;
/// Bounds of the scheduler's threshold.
pub const MAX_THRESHOLD_US: u64 = 10_000_000;
/// Bounds of the scheduler's unshadow cap.
pub const MAX_UNSHADOW_CAP: u64 = 1 << 20;

/// An error answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub status: u16,
    pub code: &'static str,
    pub message: String,
}

fn fail(status: u16, code: &'static str, message: impl Into<String>) -> Failure {
    Failure {
        status,
        code,
        message: message.into(),
    }
}

/// The JSON error response.
pub fn error_response(status: u16, code: &str, message: &str) -> Response {
    let body = ApiErrorBody {
        code: code.to_string(),
        message: message.to_string(),
    };
    Response::json(status, serde_json::to_vec(&body).unwrap_or_default())
}

fn ok<T: Serialize>(body: &T) -> Result<Response, Failure> {
    serde_json::to_vec(body)
        .map(|b| Response::json(200, b))
        .map_err(|e| fail(500, "internal", e.to_string()))
}

/// Matches `path` against a template; returns the `{name}` segment if there is one.
fn match_template<'a>(template: &str, path: &'a str) -> Option<Option<&'a str>> {
    let mut name = None;
    let mut t = template.split('/');
    let mut p = path.split('/');
    loop {
        match (t.next(), p.next()) {
            (None, None) => return Some(name),
            (Some("{name}"), Some(seg)) if !seg.is_empty() => name = Some(seg),
            (Some(a), Some(b)) if a == b => {}
            _ => return None,
        }
    }
}

/// Shared state of the handlers.
pub struct ApiState {
    backend: Weak<VgpuBackend>,
    pub(crate) shares: Arc<ShareBook>,
    started: Instant,
    /// Serializes scheduler reconfigurations (read-modify-write of the configuration).
    sched_lock: Mutex<()>,
    by_status: Mutex<BTreeMap<u16, u64>>,
}

impl ApiState {
    pub fn new(backend: Weak<VgpuBackend>, shares: Arc<ShareBook>) -> Self {
        ApiState {
            backend,
            shares,
            started: Instant::now(),
            sched_lock: Mutex::new(()),
            by_status: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn count(&self, status: u16) {
        *self
            .by_status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(status)
            .or_default() += 1;
    }

    pub fn requests_by_status(&self) -> Vec<(u16, u64)> {
        self.by_status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(s, n)| (*s, *n))
            .collect()
    }

    /// Answers one request.
    pub fn handle(&self, req: &Request) -> Response {
        match self.route(req) {
            Ok(r) => r,
            Err(f) => {
                log::debug!(
                    "control API: {} {}: {} {}",
                    req.method,
                    req.path,
                    f.status,
                    f.message
                );
                error_response(f.status, f.code, &f.message)
            }
        }
    }

    fn route(&self, req: &Request) -> Result<Response, Failure> {
        let Some((template, methods, name)) = ROUTES
            .iter()
            .find_map(|(t, m)| match_template(t, &req.path).map(|n| (*t, *m, n)))
        else {
            return Err(fail(404, "not_found", format!("no route {}", req.path)));
        };
        if !methods.contains(&req.method.as_str()) {
            let mut r = error_response(
                405,
                "method_not_allowed",
                &format!("{} {template}: allowed {}", req.method, methods.join(", ")),
            );
            r.headers.push(("Allow", methods.join(", ")));
            return Ok(r);
        }
        let be = self
            .backend
            .upgrade()
            .ok_or_else(|| fail(503, "shutting_down", "the backend is shutting down"))?;
        let name = name.unwrap_or_default();
        let vm = || -> Result<&str, Failure> {
            if be.vm_weight(name).is_none() {
                return Err(fail(404, "vm_not_found", format!("no VM named {name:?}")));
            }
            Ok(name)
        };
        match (template, req.method.as_str()) {
            ("/api/v1/info", _) => ok(&self.info(&be)),
            ("/api/v1/vms", _) => ok(&self.vm_list(&be)),
            ("/api/v1/vms/{name}", _) => ok(&vm_detail(&be, vm()?)?),
            ("/api/v1/vms/{name}/stats", _) => ok(&self.vm_stats(&be, vm()?)?),
            ("/api/v1/vms/{name}/migration", _) => {
                let p = be
                    .vm_migration(vm()?)
                    .ok_or_else(|| fail(404, "vm_not_found", format!("no VM named {name:?}")))?;
                ok(&MigrationBody::from(&p))
            }
            ("/api/v1/vms/{name}/weight", _) => set_weight(&be, vm()?, req),
            ("/api/v1/vms/{name}/vram-quota", _) => set_quota(&be, vm()?, req),
            ("/api/v1/vms/{name}/pause", _) => pause(&be, vm()?, req, Pause::Hold),
            ("/api/v1/vms/{name}/resume", _) => pause(&be, vm()?, req, Pause::Resume),
            ("/api/v1/vms/{name}/drain", _) => pause(&be, vm()?, req, Pause::Drain),
            ("/api/v1/scheduler", "GET") => ok(&scheduler(&be)),
            ("/api/v1/scheduler", _) => self.set_scheduler(&be, req),
            ("/metrics", _) => Ok(Response::text(
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                metrics::render(&be, &self.shares, &self.requests_by_status()),
            )),
            _ => Err(fail(500, "internal", "unrouted")),
        }
    }

    fn info(&self, be: &VgpuBackend) -> InfoBody {
        let gi = be.gpu().info();
        InfoBody {
            version: env!("CARGO_PKG_VERSION").to_string(),
            api_version: "v1".to_string(),
            gpu: GpuBody {
                model: gi.name.clone(),
                vram_bytes: gi.vram_bytes,
                compute_engines: gi.compute_engines,
                max_channels: gi.max_channels,
                max_contexts: gi.max_contexts,
                has_busy_counters: gi.has_busy_counters,
            },
            policy: be
                .scheduler_config()
                .map_or(Policy::None, |c| c.policy)
                .to_string(),
            vms: be.vm_names().len() as u32,
            uptime_s: self.started.elapsed().as_secs_f64(),
            capacity: be.capacity().into(),
            gpu_workers: be.worker_stats().map(|w| GpuWorkersBody {
                running: w.running,
                started: w.started,
                lost: w.lost,
                lost_by_kind: by_kind(&w.lost_by_kind),
                granularity: w.granularity.name().to_string(),
                vms: w
                    .vms
                    .iter()
                    .map(|v| {
                        let body = GpuWorkersVmBody {
                            running: v.running,
                            started: v.started,
                            lost: v.lost,
                            lost_by_kind: by_kind(&v.lost_by_kind),
                        };
                        (v.vm.clone(), body)
                    })
                    .collect(),
            }),
        }
    }

    fn vm_list(&self, be: &VgpuBackend) -> VmListBody {
        let engines = be.gpu().info().compute_engines;
        let vms = be
            .vm_names()
            .into_iter()
            .filter_map(|name| {
                let st = be.vm_stats(&name)?;
                let share = self
                    .shares
                    .windows(Entity::Vm(&name), engines)
                    .into_iter()
                    .find(|w| w.window_s == 10)
                    .map(|w| w.share);
                Some(VmSummary {
                    connected: st.connected,
                    submission: submission_mode(st.forwarded).into(),
                    paused: be.vm_paused(&name)?,
                    weight: be.vm_weight(&name)?,
                    vram_quota_bytes: be.vm_limits(&name)?.vram_bytes,
                    vram_bytes: st.vram_bytes,
                    channels: st.channels,
                    gpu_share_10s: share,
                    name,
                })
            })
            .collect();
        VmListBody { vms }
    }

    fn vm_stats(&self, be: &VgpuBackend, name: &str) -> Result<VmStatsBody, Failure> {
        let gone = || fail(404, "vm_not_found", format!("no VM named {name:?}"));
        let engines = be.gpu().info().compute_engines;
        let procs = be.process_busy_ns(name);
        let channels = be.vm_channel_info(name).ok_or_else(gone)?;
        let vram = VmVramBody::from(&be.vram_stats(name).ok_or_else(gone)?);
        Ok(VmStatsBody {
            name: name.to_string(),
            weight: be.vm_weight(name).ok_or_else(gone)?,
            paused: be.vm_paused(name).ok_or_else(gone)?,
            gpu_busy_ns: procs.iter().map(|(_, b)| *b).sum(),
            windows: with_entitlement(
                be,
                Entity::Vm(name),
                self.shares.windows(Entity::Vm(name), engines),
            ),
            vram_resident_bytes: vram.resident_bytes,
            vram_swapped_bytes: vram.swapped_bytes,
            vram_quota_bytes: be.vm_limits(name).ok_or_else(gone)?.vram_bytes,
            watchdog_kills: channels
                .iter()
                .filter(|c| c.error == Some(vgpu_protocol::ErrorCode::WatchdogKilled))
                .count() as u32,
            processes: procs
                .iter()
                .map(|(pid, busy)| ProcessStats {
                    pid: *pid,
                    gpu_busy_ns: *busy,
                    windows: with_entitlement(
                        be,
                        Entity::Process(name, *pid),
                        self.shares.windows(Entity::Process(name, *pid), engines),
                    ),
                })
                .collect(),
            channels: channels
                .iter()
                .map(|c| ChannelBody {
                    channel: c.channel,
                    pid: c.pid,
                    shadowed: c.shadowed,
                    backlog: c.backlog,
                    gpu_busy_ns: c.busy_ns,
                    error: c.error.map(|e| format!("{e:?}")),
                })
                .collect(),
            vram,
        })
    }

    fn set_scheduler(&self, be: &Arc<VgpuBackend>, req: &Request) -> Result<Response, Failure> {
        let obj = json_object(req, false)?;
        let _serial = self.sched_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut cfg = be.scheduler_config().unwrap_or(SchedConfig {
            policy: Policy::None,
            ..SchedConfig::default()
        });
        for (k, v) in &obj {
            match k.as_str() {
                "policy" => {
                    let s = v
                        .as_str()
                        .ok_or_else(|| fail(400, "invalid_config", "policy must be a string"))?;
                    cfg.policy = s
                        .parse()
                        .map_err(|e: SchedError| fail(400, "invalid_config", e.to_string()))?;
                }
                "interval_ms" => {
                    cfg.interval_ms = int_in(v, k, 1, 1000)? as u32;
                }
                "threshold_us" => {
                    cfg.threshold_us = int_in(v, k, 0, MAX_THRESHOLD_US)?;
                }
                "charge_idle" => {
                    cfg.charge_idle = v.as_bool().ok_or_else(|| {
                        fail(400, "invalid_body", "charge_idle must be a boolean")
                    })?;
                }
                "slice_ms" => {
                    cfg.slice_ms = int_in(v, k, 1, 10_000)? as u32;
                }
                "sample_period_ms" => {
                    cfg.sample_period_ms = int_in(v, k, 10, 600_000)? as u32;
                }
                "watchdog_ms" => {
                    cfg.watchdog_ms = if v.is_null() {
                        None
                    } else {
                        Some(int_in(v, k, 1, 3_600_000)? as u32)
                    };
                }
                "unshadow_cap" => {
                    cfg.unshadow_cap = if v.is_null() {
                        None
                    } else {
                        Some(int_in(v, k, 1, MAX_UNSHADOW_CAP)? as u32)
                    };
                }
                _ => return Err(fail(400, "invalid_body", format!("unknown field {k:?}"))),
            }
        }
        be.start_scheduler(cfg).map_err(sched_failure)?;
        ok(&scheduler(be))
    }
}

fn sched_failure(e: SchedError) -> Failure {
    let (status, code) = match &e {
        SchedError::NotImplemented(_) => (400, "policy_not_implemented"),
        SchedError::InvalidConfig(_) => (400, "invalid_config"),
        SchedError::NoBusyCounters => (409, "no_busy_counters"),
        SchedError::InvalidWeight(_) => (400, "invalid_weight"),
        SchedError::NoVm(_) => (404, "vm_not_found"),
        SchedError::ShuttingDown => (503, "shutting_down"),
        _ => (500, "internal"),
    };
    fail(status, code, e.to_string())
}

fn control_failure(e: ControlError) -> Failure {
    let (status, code) = match &e {
        ControlError::NoVm(_) => (404, "vm_not_found"),
        ControlError::InvalidQuota(_) => (400, "invalid_quota"),
        ControlError::Shadow { .. } => (500, "shadow_failed"),
        ControlError::DrainTimeout { .. } => (504, "drain_timeout"),
        ControlError::Vram(_) => (500, "vram_failed"),
        ControlError::Migrating(_) => (409, "migrating"),
    };
    fail(status, code, e.to_string())
}

/// The body as a JSON object; an empty body is `{}` when `empty_ok`.
fn json_object(req: &Request, empty_ok: bool) -> Result<Map<String, Value>, Failure> {
    if let Some(ct) = req.header("content-type") {
        if !ct.to_ascii_lowercase().starts_with("application/json") {
            return Err(fail(
                415,
                "unsupported_media_type",
                format!("Content-Type {ct:?}: expected application/json"),
            ));
        }
    }
    if req.body.iter().all(|b| b.is_ascii_whitespace()) {
        if empty_ok {
            return Ok(Map::new());
        }
        return Err(fail(400, "invalid_json", "a JSON body is required"));
    }
    let v: Value = serde_json::from_slice(&req.body)
        .map_err(|e| fail(400, "invalid_json", format!("malformed JSON: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        _ => Err(fail(400, "invalid_body", "the body must be a JSON object")),
    }
}

/// Takes the only field `field` out of `obj`, refusing any other field.
fn only_field(mut obj: Map<String, Value>, field: &str) -> Result<Option<Value>, Failure> {
    let v = obj.remove(field);
    if let Some(k) = obj.keys().next() {
        return Err(fail(400, "invalid_body", format!("unknown field {k:?}")));
    }
    Ok(v)
}

/// Refuses any field.
fn no_fields(obj: &Map<String, Value>) -> Result<(), Failure> {
    match obj.keys().next() {
        Some(k) => Err(fail(400, "invalid_body", format!("unknown field {k:?}"))),
        None => Ok(()),
    }
}

/// An integer in `lo..=hi` (JSON numbers that are negative, fractional or too large fail).
fn int_in(v: &Value, field: &str, lo: u64, hi: u64) -> Result<u64, Failure> {
    let n = match v {
        Value::Number(n) => n,
        _ => {
            return Err(fail(
                400,
                "invalid_body",
                format!("{field} must be an integer"),
            ))
        }
    };
    match Number::as_u64(n) {
        Some(x) if (lo..=hi).contains(&x) => Ok(x),
        _ => Err(fail(
            400,
            "out_of_range",
            format!("{field} must be an integer in {lo}..={hi}, got {n}"),
        )),
    }
}

fn vm_detail(be: &VgpuBackend, name: &str) -> Result<VmDetail, Failure> {
    let gone = || fail(404, "vm_not_found", format!("no VM named {name:?}"));
    let st = be.vm_stats(name).ok_or_else(gone)?;
    let lim = be.vm_limits(name).ok_or_else(gone)?;
    let sh = be.shadow_stats(name).ok_or_else(gone)?;
    Ok(VmDetail {
        name: name.to_string(),
        socket: be
            .vm_socket(name)
            .ok_or_else(gone)?
            .to_string_lossy()
            .into_owned(),
        connected: st.connected,
        submission: submission_mode(st.forwarded).into(),
        paused: be.vm_paused(name).ok_or_else(gone)?,
        weight: be.vm_weight(name).ok_or_else(gone)?,
        limits: LimitsBody {
            max_contexts: lim.max_contexts,
            max_channels: lim.max_channels,
            reserved_contexts: lim.reserve().contexts,
            reserved_channels: lim.reserve().channels,
            vram_bytes: lim.vram_bytes,
            mapped_guest_bytes: lim.mapped_guest_bytes,
            max_mappings: lim.max_mappings,
            page_table_bytes: lim.page_table_bytes,
        },
        usage: UsageBody {
            contexts: st.contexts,
            channels: st.channels,
            vram_bytes: st.vram_bytes,
            mapped_guest_bytes: st.mapped_guest_bytes,
            aperture_bytes: st.aperture_bytes,
            mappings: st.mappings,
            page_table_bytes: st.page_table_bytes,
        },
        counters: CountersBody {
            requests: st.requests,
            errors: st.errors,
            disconnects: st.disconnects,
            events_delivered: st.events_delivered,
            events_dropped: st.events_dropped,
            events_pending: st.events_pending,
            ring_errors: st.ring_errors,
        },
        shadow: ShadowBody {
            shadowed_now: sh.shadowed_now,
            shadows: sh.shadows,
            unshadows: sh.unshadows,
            failures: sh.failures,
            capped_releases: sh.capped_releases,
        },
    })
}

/// Renames an `out_of_range` failure to a more specific code.
fn range_code(f: Failure, code: &'static str) -> Failure {
    if f.code == "out_of_range" {
        Failure { code, ..f }
    } else {
        f
    }
}

fn set_weight(be: &VgpuBackend, name: &str, req: &Request) -> Result<Response, Failure> {
    let v = only_field(json_object(req, false)?, "weight")?
        .ok_or_else(|| fail(400, "invalid_body", "missing field \"weight\""))?;
    let w = int_in(&v, "weight", u64::from(MIN_WEIGHT), u64::from(MAX_WEIGHT))
        .map_err(|f| range_code(f, "invalid_weight"))? as u32;
    be.set_vm_weight(name, w).map_err(sched_failure)?;
    ok(&WeightBody { weight: w })
}

fn set_quota(be: &VgpuBackend, name: &str, req: &Request) -> Result<Response, Failure> {
    let v = only_field(json_object(req, false)?, "bytes")?
        .ok_or_else(|| fail(400, "invalid_body", "missing field \"bytes\""))?;
    let bytes = int_in(&v, "bytes", MIN_VRAM_QUOTA, MAX_VRAM_QUOTA)
        .map_err(|f| range_code(f, "invalid_quota"))?;
    be.set_vm_vram_quota(name, bytes).map_err(control_failure)?;
    ok(&QuotaBody { bytes })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Pause {
    Hold,
    Resume,
    Drain,
}

fn pause(be: &VgpuBackend, name: &str, req: &Request, what: Pause) -> Result<Response, Failure> {
    let obj = json_object(req, true)?;
    let (outcome, waited_ms) = match what {
        Pause::Hold => {
            no_fields(&obj)?;
            (be.pause_vm(name).map_err(control_failure)?, None)
        }
        Pause::Resume => {
            no_fields(&obj)?;
            (be.resume_vm(name).map_err(control_failure)?, None)
        }
        Pause::Drain => {
            let timeout = match only_field(obj, "timeout_ms")? {
                Some(v) => int_in(&v, "timeout_ms", 1, MAX_DRAIN_TIMEOUT_MS)?,
                None => DEFAULT_DRAIN_TIMEOUT_MS,
            };
            let d = be
                .drain_vm(name, Duration::from_millis(timeout))
                .map_err(control_failure)?;
            (d.pause, Some(d.waited_ns as f64 / 1e6))
        }
    };
    ok(&PauseBody {
        name: name.to_string(),
        paused: be.vm_paused(name).unwrap_or(what != Pause::Resume),
        channels: outcome.channels,
        switched: outcome.switched,
        waited_ms,
    })
}

/// The scheduler's state (policy `none` with default tunables before any start).
pub fn scheduler(be: &VgpuBackend) -> SchedulerBody {
    let cfg = be.scheduler_config();
    let running = cfg.is_some_and(|c| c.policy != Policy::None);
    let cfg = cfg.unwrap_or(SchedConfig {
        policy: Policy::None,
        ..SchedConfig::default()
    });
    let st = be.sched_stats();
    SchedulerBody {
        running,
        config: SchedConfigBody {
            policy: cfg.policy.to_string(),
            interval_ms: cfg.interval_ms,
            threshold_us: cfg.threshold_us,
            unshadow_cap: cfg.unshadow_cap,
            slice_ms: cfg.slice_ms,
            sample_period_ms: cfg.sample_period_ms,
            watchdog_ms: cfg.watchdog_ms,
            charge_idle: cfg.charge_idle,
        },
        stats: SchedStatsBody {
            intervals: st.intervals,
            shadows: st.shadows,
            unshadows: st.unshadows,
            capped_releases: st.capped_releases,
            failures: st.failures,
            shadowed_now: st.shadowed_now,
            tick_ns_last: st.tick_ns_last,
            tick_ns_max: st.tick_ns_max,
            busy_skips: st.busy_skips,
            watchdog_kills: st.watchdog_kills,
        },
    }
}

/// The API's name for a VM's submission mode.
fn submission_mode(forwarded: bool) -> &'static str {
    if forwarded {
        "forwarded"
    } else {
        "direct"
    }
}

/// Losses by why, named as in `/metrics` (`counts` in [`vgpu_gpu_worker::LossKind::ALL`]'s
/// order).
fn by_kind(counts: &[u64; 6]) -> std::collections::BTreeMap<String, u64> {
    vgpu_gpu_worker::LossKind::ALL
        .iter()
        .zip(counts)
        .map(|(k, n)| (k.name().to_string(), *n))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_match_whole_segments() {
        assert_eq!(match_template("/api/v1/vms", "/api/v1/vms"), Some(None));
        assert_eq!(
            match_template("/api/v1/vms/{name}/stats", "/api/v1/vms/a.b/stats"),
            Some(Some("a.b"))
        );
        assert_eq!(match_template("/api/v1/vms/{name}", "/api/v1/vms/"), None);
        assert_eq!(match_template("/api/v1/vms", "/api/v1/vms/"), None);
        assert_eq!(
            match_template("/api/v1/vms/{name}", "/api/v1/vms/a/b"),
            None
        );
    }
}
