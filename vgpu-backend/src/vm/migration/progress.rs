//! What a VM's migration is doing, for the operator ([`crate::VgpuBackend::vm_migration`],
//! `GET /v1/vms/{name}/migration`) and the `migrate` bench: phase, pre-copy rounds,
//! bytes, the dirty rate and the downtime the last round predicts.

use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Tuning of the pre-copy (per backend; [`crate::VgpuBackend::set_precopy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrecopyConfig {
    /// Pre-copy rounds at most (the first copies everything); 0: stop-and-copy.
    pub max_rounds: u32,
    /// Pre-copy stops once a round finds at most this many dirty bytes.
    pub stop_below_bytes: u64,
}

impl Default for PrecopyConfig {
    fn default() -> Self {
        // Like QEMU's defaults in spirit: a few rounds, stop when what is left would be
        // copied within a few tens of milliseconds.
        PrecopyConfig {
            max_rounds: 8,
            stop_below_bytes: 32 << 20,
        }
    }
}

/// Where a migration stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MigrationPhase {
    /// No migration since the VM's connection began.
    #[default]
    None,
    /// Source: copying VRAM while the channels run.
    Precopy,
    /// Source: channels paused, the last round and the state are being sent.
    Paused,
    /// Source: everything sent; the VM waits for the destination (or a rollback).
    Sent,
    /// Destination: receiving.
    Incoming,
    /// Destination: the state is loaded, waiting for the resume.
    Loaded,
    /// Either side: the channels run again here after a migration.
    Resumed,
    /// Either side: the last transfer failed.
    Failed,
}

impl MigrationPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            MigrationPhase::None => "none",
            MigrationPhase::Precopy => "precopy",
            MigrationPhase::Paused => "paused",
            MigrationPhase::Sent => "sent",
            MigrationPhase::Incoming => "incoming",
            MigrationPhase::Loaded => "loaded",
            MigrationPhase::Resumed => "resumed",
            MigrationPhase::Failed => "failed",
        }
    }
}

/// One pre-copy round as the source sent it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoundStat {
    pub round: u32,
    /// Sent after the pause.
    pub last: bool,
    pub chunks: u64,
    pub bytes: u64,
    pub duration: Duration,
}

/// A VM's migration as the operator sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigrationProgress {
    pub phase: MigrationPhase,
    pub rounds: Vec<RoundStat>,
    /// Device-state bytes written (source) or read (destination).
    pub bytes: u64,
    /// Bytes the engines dirtied per second during the last pre-copy round.
    pub dirty_rate: u64,
    /// The pause the last round predicts: its dirty bytes at the copy rate seen so far.
    pub expected_downtime: Duration,
    /// Whether the GPU tracks writes (without, everything is copied while paused).
    pub write_tracking: bool,
    /// When the channels paused (source) / ran again (destination), ns since the epoch.
    pub paused_unix_ns: u64,
    pub resumed_unix_ns: u64,
    /// How long the drain took.
    pub drain: Duration,
    /// Why the last transfer failed.
    pub error: Option<String>,
    /// Destination, once the full state is loaded: the operator policy this host applies
    /// and what the stream claimed (ignored).
    pub policy: Option<super::policy::StreamPolicy>,
}

/// Wall-clock now, ns since the Unix epoch (0 if the clock is before it).
pub fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// The progress of a VM, updated by its transfers.
#[derive(Debug, Default)]
pub(crate) struct ProgressCell(Mutex<MigrationProgress>);

impl ProgressCell {
    pub(crate) fn get(&self) -> MigrationProgress {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn update(&self, f: impl FnOnce(&mut MigrationProgress)) {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// A new migration begins (either side).
    pub(crate) fn start(&self, phase: MigrationPhase) {
        self.update(|p| {
            *p = MigrationProgress {
                phase,
                ..MigrationProgress::default()
            }
        });
    }
}
