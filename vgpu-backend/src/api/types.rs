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
    /// The GPU's contexts and channels: what the VMs use, reserve, and what is free.
    pub capacity: CapacityBody,
    /// With a GPU worker process per VM (`--gpu-workers`): their counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_workers: Option<GpuWorkersBody>,
}

/// The GPU worker processes of a backend with `--gpu-workers`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuWorkersBody {
    pub running: u64,
    /// Started, restarts after a loss included.
    pub started: u64,
    /// Lost and replaced.
    pub lost: u64,
    /// The lost ones by why: `gpu_fault`, `crashed`, `exited`, `timed_out`, `protocol`,
    /// `killed`.
    pub lost_by_kind: std::collections::BTreeMap<String, u64>,
    /// `vm` (a worker per VM) or `process` (a worker per guest process).
    #[serde(default)]
    pub granularity: String,
    /// Per VM, by name: its workers (with a worker per process, one per guest process
    /// that has GPU objects) and their losses.
    #[serde(default)]
    pub vms: std::collections::BTreeMap<String, GpuWorkersVmBody>,
}

/// One VM's GPU workers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuWorkersVmBody {
    pub running: u64,
    pub started: u64,
    pub lost: u64,
    pub lost_by_kind: std::collections::BTreeMap<String, u64>,
}

/// One resource of the GPU shared by the VMs (`vgpu_backend::capacity::Headroom`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeadroomBody {
    /// What the GPU has.
    pub total: u32,
    /// What the VMs' objects use.
    pub used: u32,
    /// The VMs' reserves together, used or not.
    pub reserved: u32,
    /// What a VM may still take beyond its reserve: the total less, per VM, the larger
    /// of its use and its reserve.
    pub free: u32,
}

/// The GPU's contexts and channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapacityBody {
    pub contexts: HeadroomBody,
    pub channels: HeadroomBody,
}

impl From<crate::capacity::Headroom> for HeadroomBody {
    fn from(h: crate::capacity::Headroom) -> Self {
        HeadroomBody {
            total: h.total,
            used: h.used,
            reserved: h.reserved,
            free: h.free,
        }
    }
}

impl From<crate::capacity::CapacityStats> for CapacityBody {
    fn from(c: crate::capacity::CapacityStats) -> Self {
        CapacityBody {
            contexts: c.contexts.into(),
            channels: c.channels.into(),
        }
    }
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
    /// How the guest submits work: `direct` (stores to its control pages in the device's
    /// shared-memory region) or `forwarded` (`SUBMIT` requests; the frontend offered no
    /// region). See protocol.md §9.
    pub submission: String,
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
    /// Contexts and channels of the GPU kept for the VM whatever other VMs take.
    pub reserved_contexts: u32,
    pub reserved_channels: u32,
    /// The VRAM quota.
    pub vram_bytes: u64,
    pub mapped_guest_bytes: u64,
    /// GPU mappings at once, and the host memory (page tables) they may take.
    pub max_mappings: u32,
    pub page_table_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageBody {
    pub contexts: u32,
    pub channels: u32,
    pub vram_bytes: u64,
    pub mapped_guest_bytes: u64,
    pub aperture_bytes: u64,
    /// GPU mappings, and the host memory they take: the GPU's page tables and the
    /// backend's records of them.
    pub mappings: u32,
    pub page_table_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CountersBody {
    pub requests: u64,
    pub errors: u64,
    pub disconnects: u64,
    pub events_delivered: u64,
    pub events_dropped: u64,
    pub events_pending: u64,
    /// Connections ended because the driver broke a virtqueue.
    pub ring_errors: u64,
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
    /// `direct` or `forwarded` (as in [`VmSummary::submission`]).
    pub submission: String,
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
    /// What it was owed of the GPU time used in the window (0..=1): weighted max-min over
    /// measured demands, from the scheduler's interval records (`null` before the
    /// scheduler recorded an interval).
    #[serde(default)]
    pub entitled: Option<f64>,
    /// Its share minus its entitlement in the same records, percentage points.
    #[serde(default)]
    pub deviation_pp: Option<f64>,
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

/// One pre-copy round of a migration (`GET /api/v1/vms/{name}/migration`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationRoundBody {
    pub round: u32,
    /// Sent (or received) after the source paused the channels.
    pub last: bool,
    pub chunks: u64,
    pub bytes: u64,
    /// How long the source took to send it (0 on the destination).
    pub duration_us: u64,
}

/// `GET /api/v1/vms/{name}/migration`: the VM's last migration as this backend saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationBody {
    /// `none`, `precopy`, `paused`, `sent`, `incoming`, `loaded`, `resumed`, `failed`.
    pub phase: String,
    pub rounds: Vec<MigrationRoundBody>,
    /// Device-state bytes written (source) or read (destination).
    pub bytes: u64,
    /// Bytes the guest's GPU work dirtied per second in the last pre-copy round.
    pub dirty_rate_bytes_per_s: u64,
    /// The channel pause the last pre-copy round predicts.
    pub expected_downtime_us: u64,
    /// Whether the GPU tracks writes (without: stop-and-copy).
    pub write_tracking: bool,
    pub drain_us: u64,
    /// Why the last transfer failed (`null` if it did not).
    pub error: Option<String>,
    /// Destination, once the state is loaded: the operator policy this backend applies
    /// and what the stream claimed (ignored); `null` otherwise.
    pub policy: Option<MigrationPolicyBody>,
}

/// A loaded migration's operator policy (`GET /api/v1/vms/{name}/migration`): always this
/// backend's; the stream's values are reported, never applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationPolicyBody {
    /// The weight and VRAM quota this backend applies to the VM.
    pub weight: u32,
    pub vram_quota_bytes: u64,
    /// What the stream's VM record carried.
    pub stream_weight: u32,
    pub stream_vram_quota_bytes: u64,
    /// The fields where the stream differed (`weight`, `vram_quota`), each ignored.
    pub ignored: Vec<String>,
    /// The same in words, e.g. "policy from the destination (weight 100, VRAM quota
    /// 536870912 bytes); stream claimed weight 10000, ignored".
    pub note: String,
}

impl From<&crate::StreamPolicy> for MigrationPolicyBody {
    fn from(p: &crate::StreamPolicy) -> Self {
        MigrationPolicyBody {
            weight: p.weight,
            vram_quota_bytes: p.vram_quota,
            stream_weight: p.stream_weight,
            stream_vram_quota_bytes: p.stream_vram_quota,
            ignored: p.ignored().into_iter().map(String::from).collect(),
            note: p.note(),
        }
    }
}

impl From<&crate::MigrationProgress> for MigrationBody {
    fn from(p: &crate::MigrationProgress) -> Self {
        MigrationBody {
            phase: p.phase.as_str().to_string(),
            rounds: p
                .rounds
                .iter()
                .map(|r| MigrationRoundBody {
                    round: r.round,
                    last: r.last,
                    chunks: r.chunks,
                    bytes: r.bytes,
                    duration_us: r.duration.as_micros() as u64,
                })
                .collect(),
            bytes: p.bytes,
            dirty_rate_bytes_per_s: p.dirty_rate,
            expected_downtime_us: p.expected_downtime.as_micros() as u64,
            write_tracking: p.write_tracking,
            drain_us: p.drain.as_micros() as u64,
            error: p.error.clone(),
            policy: p.policy.as_ref().map(MigrationPolicyBody::from),
        }
    }
}

/// `GET /api/v1/vms/{name}/stats`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmStatsBody {
    pub name: String,
    pub weight: u32,
    pub paused: bool,
    pub gpu_busy_ns: u64,
    pub windows: Vec<WindowShare>,
    /// VRAM of the VM's objects resident on the GPU (as `vram.resident_bytes`).
    pub vram_resident_bytes: u64,
    /// VRAM swapped to system memory by the VRAM manager (as `vram.swapped_bytes`).
    pub vram_swapped_bytes: u64,
    pub vram_quota_bytes: u64,
    /// Live channels stopped by the watchdog.
    pub watchdog_kills: u32,
    pub processes: Vec<ProcessStats>,
    pub channels: Vec<ChannelBody>,
    /// The VRAM manager's figures and swap counters.
    pub vram: VmVramBody,
}

/// A VM's VRAM figures and swap counters (`vgpu_backend::VmVramStats`, the pause
/// percentiles of its report, and its processes). Chunks are 2 MiB; counters count from
/// when the backend started serving the VM (they carry over VMM reconnects).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmVramBody {
    pub quota_bytes: u64,
    /// The resident share the manager's policy computed last.
    pub share_bytes: u64,
    pub swap_limit_bytes: u64,
    pub resident_bytes: u64,
    pub swapped_bytes: u64,
    /// VRAM its resident objects take from others: resident bytes plus the unused parts
    /// of its 2 MiB frames for small pieces (charged to it).
    pub footprint_bytes: u64,
    /// Chunks moved out to the swap store, and back in.
    pub evictions: u64,
    pub swap_ins: u64,
    pub bytes_out: u64,
    pub bytes_in: u64,
    /// Chunks of new allocations placed straight into swap (VRAM was full).
    pub spilled_chunks: u64,
    /// Channel pauses for moves: count, total and worst time.
    pub pauses: u64,
    pub pause_ns_total: u64,
    pub pause_ns_max: u64,
    /// Pause time per move, median and 99th percentile over the last 4096 pauses.
    pub pause_p50_ns: u64,
    pub pause_p99_ns: u64,
    /// Moves abandoned because the channels did not drain in time.
    pub drain_timeouts: u64,
    /// Moves abandoned on a GPU or frontend failure (the chunk stayed where it was).
    pub move_failures: u64,
    /// Per guest process, by PID.
    pub processes: Vec<ProcVramBody>,
}

/// One guest process's share of its VM's VRAM figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcVramBody {
    pub pid: u32,
    pub resident_bytes: u64,
    pub swapped_bytes: u64,
    pub evictions: u64,
    pub swap_ins: u64,
    pub bytes_out: u64,
    pub bytes_in: u64,
    /// Time this process's channels spent paused for moves.
    pub pause_ns: u64,
}

impl From<&crate::vram::VramReport> for VmVramBody {
    fn from(r: &crate::vram::VramReport) -> Self {
        let v = &r.vm;
        VmVramBody {
            quota_bytes: v.quota_bytes,
            share_bytes: v.share_bytes,
            swap_limit_bytes: v.swap_limit_bytes,
            resident_bytes: v.resident_bytes,
            swapped_bytes: v.swapped_bytes,
            footprint_bytes: v.footprint_bytes,
            evictions: v.evictions,
            swap_ins: v.swap_ins,
            bytes_out: v.bytes_out,
            bytes_in: v.bytes_in,
            spilled_chunks: v.spilled_chunks,
            pauses: v.pauses,
            pause_ns_total: v.pause_ns_total,
            pause_ns_max: v.pause_ns_max,
            pause_p50_ns: r.pause_p50_ns,
            pause_p99_ns: r.pause_p99_ns,
            drain_timeouts: v.drain_timeouts,
            move_failures: v.move_failures,
            processes: r
                .procs
                .iter()
                .map(|p| ProcVramBody {
                    pid: p.pid,
                    resident_bytes: p.resident_bytes,
                    swapped_bytes: p.swapped_bytes,
                    evictions: p.evictions,
                    swap_ins: p.swap_ins,
                    bytes_out: p.bytes_out,
                    bytes_in: p.bytes_in,
                    pause_ns: p.pause_ns,
                })
                .collect(),
        }
    }
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
    /// Times a VM was left alone for an interval because its session stayed locked.
    pub busy_skips: u64,
    /// Channels the kernel watchdog killed (all VMs).
    pub watchdog_kills: u64,
}
