//! The JSON bodies of the control API (`docs/api/openapi.yaml` describes the same), shared
//! by the server and the client.

use serde::{Deserialize, Serialize};

/// An error answer: `{"code": "...", "message": "..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiErrorBody {
    pub code: String,
    pub message: String,
}

/// `GET /api/v1/info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InfoBody {
    pub version: String,
    pub api_version: String,
    pub gpu: GpuBody,
    /// The scheduler's policy (`none` when it was never started).
    pub policy: String,
    pub vms: u32,
    pub uptime_s: f64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuBody {
    pub model: String,
    pub vram_bytes: u64,
    pub compute_engines: u32,
    pub max_channels: u32,
    pub max_contexts: u32,
    pub has_busy_counters: bool,
}

/// A VM in `GET /api/v1/vms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmSummary {
    pub name: String,
    pub connected: bool,
    pub paused: bool,
    pub weight: u32,
    pub vram_quota_bytes: u64,
    pub vram_bytes: u64,
    pub channels: u32,
    /// Share of the GPU time used in the last 10 s (0..=1), `null` before two samples.
    pub gpu_share_10s: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmListBody {
    pub vms: Vec<VmSummary>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitsBody {
    pub max_contexts: u32,
    pub max_channels: u32,
    /// The VRAM quota.
    pub vram_bytes: u64,
    pub mapped_guest_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageBody {
    pub contexts: u32,
    pub channels: u32,
    pub vram_bytes: u64,
    pub mapped_guest_bytes: u64,
    pub aperture_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CountersBody {
    pub requests: u64,
    pub errors: u64,
    pub disconnects: u64,
    pub events_delivered: u64,
    pub events_dropped: u64,
    pub events_pending: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShadowBody {
    pub shadowed_now: u32,
    pub shadows: u64,
    pub unshadows: u64,
    pub failures: u64,
    pub capped_releases: u64,
}

/// `GET /api/v1/vms/{name}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmDetail {
    pub name: String,
    pub socket: String,
    pub connected: bool,
    pub paused: bool,
    pub weight: u32,
    pub limits: LimitsBody,
    pub usage: UsageBody,
    pub counters: CountersBody,
    pub shadow: ShadowBody,
}

/// GPU time of an entity over one recent window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WindowShare {
    /// The window asked for (1, 10 or 60 s).
    pub window_s: u32,
    /// The span the samples actually cover (shorter just after start).
    pub covered_s: f64,
    /// Share of all GPU time used in the window (0..=1).
    pub share: f64,
    /// Fraction of the GPU's capacity (busy time / (span × engines)).
    pub utilization: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessStats {
    pub pid: u32,
    pub gpu_busy_ns: u64,
    pub windows: Vec<WindowShare>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelBody {
    pub channel: u32,
    pub pid: u32,
    pub shadowed: bool,
    pub backlog: u32,
    pub gpu_busy_ns: u64,
    /// The error the channel stopped on (`null` while it runs).
    pub error: Option<String>,
}

/// `GET /api/v1/vms/{name}/stats`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmStatsBody {
    pub name: String,
    pub weight: u32,
    pub paused: bool,
    pub gpu_busy_ns: u64,
    pub windows: Vec<WindowShare>,
    pub vram_resident_bytes: u64,
    /// VRAM swapped to system memory by the VRAM manager.
    pub vram_swapped_bytes: u64,
    pub vram_quota_bytes: u64,
    /// Live channels stopped by the watchdog.
    pub watchdog_kills: u32,
    pub processes: Vec<ProcessStats>,
    pub channels: Vec<ChannelBody>,
}

/// `PUT /api/v1/vms/{name}/weight` and its answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightBody {
    pub weight: u32,
}

/// `PUT /api/v1/vms/{name}/vram-quota` and its answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaBody {
    pub bytes: u64,
}

/// The answer to pause, resume and drain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PauseBody {
    pub name: String,
    pub paused: bool,
    pub channels: u32,
    pub switched: u32,
    /// Drain only: time spent waiting for the GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waited_ms: Option<f64>,
}

/// The scheduler: `GET /api/v1/scheduler`; `PUT` takes the `config` part, fields left out
/// keep their value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchedulerBody {
    /// Whether a scheduler thread runs (false for `none` and before any start).
    pub running: bool,
    pub config: SchedConfigBody,
    pub stats: SchedStatsBody,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedConfigBody {
    pub policy: String,
    pub interval_ms: u32,
    pub threshold_us: u64,
    pub unshadow_cap: Option<u32>,
    pub slice_ms: u32,
    pub sample_period_ms: u32,
    pub watchdog_ms: Option<u32>,
    /// Charge GPU idle time to those let run while another was held back.
    pub charge_idle: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedStatsBody {
    pub intervals: u64,
    pub shadows: u64,
    pub unshadows: u64,
    pub capped_releases: u64,
    pub failures: u64,
    pub shadowed_now: u32,
    pub tick_ns_last: u64,
    pub tick_ns_max: u64,
    /// Channels the kernel watchdog killed (all VMs).
    pub watchdog_kills: u64,
}
