//! The scheduler's part of the backend: its configuration, counters, history and
//! process weight hints, and the thread it starts, restarts and stops.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use log::info;

use crate::sched::config::*;
use crate::sched::shares::History;
use crate::sched::stats::*;
use crate::sched::tick::*;
use crate::sched::*;
use crate::VgpuBackend;

/// A running scheduler thread.
pub(crate) struct Running {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<()>,
}

/// Per-VM guest process weight hints: VM name -> PID -> weight.
pub(in crate::sched) type Hints = BTreeMap<String, BTreeMap<u32, u32>>;

/// Most weight hints kept per VM.
pub const MAX_HINTS_PER_VM: usize = 4096;

/// The scheduler's part of the backend.
#[derive(Default)]
pub(crate) struct SchedSlot {
    running: Mutex<Option<Running>>,
    config: Mutex<Option<SchedConfig>>,
    stats: Arc<Mutex<SchedStats>>,
    pub(in crate::sched) history: Arc<Mutex<History>>,
    pub(in crate::sched) hints: Arc<Mutex<Hints>>,
    /// Interval numbers continue across restarts.
    pub(in crate::sched) seq: Arc<AtomicU64>,
}

impl SchedSlot {
    pub(crate) fn config(&self) -> Option<SchedConfig> {
        *lock(&self.config)
    }

    pub(crate) fn stats(&self) -> SchedStats {
        *lock(&self.stats)
    }

    /// Stops the thread (which unshadows what it shadowed) and waits for it, unless
    /// called from the thread itself.
    pub(crate) fn stop(&self) {
        let running = lock(&self.running).take();
        if let Some(r) = running {
            r.stop.store(true, Ordering::Release);
            r.handle.thread().unpark();
            if r.handle.thread().id() != std::thread::current().id() {
                let _ = r.handle.join();
            }
        }
    }
}

/// Starts (or restarts with a new configuration) the scheduler of `be`.
pub(crate) fn start(be: &Arc<VgpuBackend>, cfg: SchedConfig) -> Result<(), SchedError> {
    cfg.validate()?;
    let info = be.gpu().info();
    let (counters, engines) = (info.has_busy_counters, info.compute_engines);
    if !counters && (cfg.policy == Policy::Fair || cfg.watchdog_ms.is_some()) {
        return Err(SchedError::NoBusyCounters);
    }
    let slot = &be.sched;
    slot.stop();
    *lock(&slot.config) = Some(cfg);
    let mut running = lock(&slot.running);
    if be.stop.load(Ordering::Acquire) {
        return Err(SchedError::ShuttingDown);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let weak = Arc::downgrade(be);
    let shared = Shared {
        stats: slot.stats.clone(),
        history: slot.history.clone(),
        hints: slot.hints.clone(),
        seq: slot.seq.clone(),
    };
    let stop2 = stop.clone();
    let handle = std::thread::Builder::new()
        .name("vgpu-sched".into())
        .spawn(move || thread_main(weak, cfg, (counters, engines), stop2, shared))
        .map_err(SchedError::Thread)?;
    *running = Some(Running { stop, handle });
    info!(
        "scheduler: policy {}, interval {} ms, threshold {} us, unshadow cap {:?}, \
         slice {} ms, sample period {} ms, watchdog {:?} ms, charge idle {}",
        cfg.policy,
        cfg.interval_ms,
        cfg.threshold_us,
        cfg.unshadow_cap,
        cfg.slice_ms,
        cfg.sample_period_ms,
        cfg.watchdog_ms,
        cfg.charge_idle
    );
    Ok(())
}
