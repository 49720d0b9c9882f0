//! Suite `api`: the operator control API on a live system — `vgpu-backend` with the fair
//! scheduler, two loopback VMs each running a saturating `throttle` guest, and the API
//! server on its unix socket.
//!
//! - **Weight-change delay**: VM `a` (1 ms kernels) runs at weight 10000 against `b`
//!   (100 µs kernels) at 100, so the scheduler holds `a` back only in rare single
//!   intervals. `PUT /api/v1/vms/a/weight {"weight": 1}` through the socket must make the
//!   scheduler hold `a` back persistently. The effect is the first observation (polled
//!   every 100 µs) of `a` shadowed that stays shadowed for the following
//!   [`PERSIST_INTERVALS`] intervals. The delay is measured from sending the request to
//!   that observation, in milliseconds, and in scheduler ticks: the latest tick, counted
//!   from the request's answer, that can have made the change (robust to a loaded host:
//!   it counts the scheduler's own ticks). After each flip `a` goes back to 10000 and the run waits
//!   until `a` runs unhindered again.
//! - **Request latency**: round trips of `GET /api/v1/info` and `PUT .../weight` (a new
//!   connection each, as `vgpuctl` does).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;
use vgpu_backend::api::client::{ApiClient, ClientError};
use vgpu_backend::api::{ApiOptions, ApiServer};
use vgpu_backend::{Policy, SchedConfig, VgpuBackend, VmLimits};
use vgpu_guest::workloads::throttle::{self, ThrottleConfig};
use vgpu_guest::Device;
use vgpu_host_shim::{HalError, SimConfig, SimGpu};
use vgpu_loopback::{LoopbackConfig, LoopbackVm};

use crate::report::{Better, Figure};
use crate::stats::percentile;
use crate::suites::measure::median;

const SUITE: &str = "api";

#[derive(Debug, Error)]
pub enum ApiSuiteError {
    #[error("GPU: {0}")]
    Hal(#[from] HalError),
    #[error("backend: {0}")]
    Backend(String),
    #[error("API: {0}")]
    Api(#[from] ClientError),
    #[error("loopback VM: {0}")]
    Loopback(String),
    #[error("{0}")]
    Timeout(String),
}

#[derive(Debug, Clone)]
pub struct ApiOpts {
    /// Weight flips measured.
    pub flips: u32,
    /// Scheduling interval.
    pub interval_ms: u32,
    /// API round trips measured per kind.
    pub requests: u32,
}

impl ApiOpts {
    pub fn full() -> Self {
        ApiOpts {
            flips: 15,
            interval_ms: 10,
            requests: 300,
        }
    }

    pub fn quick() -> Self {
        ApiOpts {
            flips: 2,
            interval_ms: 10,
            requests: 20,
        }
    }
}

/// A backend with the fair scheduler, the API, and VMs each running a saturating guest.
pub struct LiveRig {
    pub backend: Arc<VgpuBackend>,
    pub api: ApiServer,
    pub vms: Vec<(String, Arc<LoopbackVm>)>,
    stop: Arc<AtomicBool>,
    guests: Vec<JoinHandle<()>>,
    dir: PathBuf,
}

impl LiveRig {
    /// Serves `vms` (name, kernel length), starts the fair scheduler with `interval_ms`
    /// and the API, connects a loopback VM to each and starts one `throttle` guest (depth
    /// 2, PID 100 + index) in each.
    pub fn new(tag: &str, vms: &[(&str, u64)], interval_ms: u32) -> Result<Self, ApiSuiteError> {
        let gpu = SimGpu::new(SimConfig {
            vram_bytes: 256 << 20,
            ..SimConfig::default()
        })?;
        let backend = VgpuBackend::new(gpu, VmLimits::default());
        let dir = std::env::temp_dir().join(format!("vgpu-api-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| ApiSuiteError::Backend(e.to_string()))?;
        let mut rig = LiveRig {
            api: ApiServer::start(&backend, &dir.join("api.sock"), ApiOptions::default())
                .map_err(|e| ApiSuiteError::Backend(e.to_string()))?,
            backend,
            vms: Vec::new(),
            stop: Arc::new(AtomicBool::new(false)),
            guests: Vec::new(),
            dir,
        };
        for (name, _) in vms {
            let sock = rig.dir.join(format!("{name}.sock"));
            rig.backend
                .serve_vm(name, &sock)
                .map_err(|e| ApiSuiteError::Backend(e.to_string()))?;
            let vm = LoopbackVm::connect(&sock, LoopbackConfig::with_mem(64 << 20))
                .map_err(|e| ApiSuiteError::Loopback(e.to_string()))?;
            rig.vms.push((name.to_string(), vm));
        }
        rig.backend
            .start_scheduler(SchedConfig {
                policy: Policy::Fair,
                interval_ms,
                ..SchedConfig::default()
            })
            .map_err(|e| ApiSuiteError::Backend(e.to_string()))?;
        for (i, (_, kernel_ns)) in vms.iter().enumerate() {
            let g = rig.spawn_throttle(i, 100 + i as u32, *kernel_ns)?;
            rig.guests.push(g);
        }
        Ok(rig)
    }

    pub fn client(&self) -> ApiClient {
        ApiClient::new(self.api.path()).with_timeout(Duration::from_secs(30))
    }

    /// The loopback VM named `name`.
    pub fn vm(&self, name: &str) -> Option<Arc<LoopbackVm>> {
        self.vms
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }

    /// A guest process in VM number `vm` running `throttle` with `kernel_ns` kernels until
    /// the rig stops.
    pub fn spawn_throttle(
        &self,
        vm: usize,
        pid: u32,
        kernel_ns: u64,
    ) -> Result<JoinHandle<()>, ApiSuiteError> {
        let lb = self.vms[vm].1.clone();
        let stop = self.stop.clone();
        std::thread::Builder::new()
            .name(format!("guest-{pid}"))
            .spawn(move || {
                let run = || -> Result<(), vgpu_guest::Error> {
                    let dev = Device::loopback(lb, pid)?;
                    let ctx = dev.create_context()?;
                    throttle::run(
                        &ctx,
                        &ThrottleConfig {
                            kernel_ns,
                            iterations: None,
                            depth: 2,
                            stop: Some(stop),
                        },
                    )?;
                    Ok(())
                };
                if let Err(e) = run() {
                    log::error!("guest {pid}: {e}");
                }
            })
            .map_err(|e| ApiSuiteError::Backend(e.to_string()))
    }

    /// GPU busy time of VM `name`.
    pub fn busy_ns(&self, name: &str) -> u64 {
        self.backend
            .process_busy_ns(name)
            .iter()
            .map(|(_, b)| b)
            .sum()
    }

    /// Stops the guests (after resuming every VM, so that stalled guests can finish).
    pub fn stop_guests(&mut self) {
        self.stop.store(true, Ordering::Release);
        for (name, _) in &self.vms {
            let _ = self.backend.resume_vm(name);
        }
        let _ = self.backend.start_scheduler(SchedConfig {
            policy: Policy::None,
            ..SchedConfig::default()
        });
        for g in self.guests.drain(..) {
            let _ = g.join();
        }
    }
}

impl Drop for LiveRig {
    fn drop(&mut self) {
        self.stop_guests();
        for (_, vm) in &self.vms {
            vm.disconnect();
        }
        self.api.shutdown();
        self.backend.shutdown();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One measured weight change.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlipDelay {
    /// From sending the PUT to observing the effect.
    pub wall_ns: u64,
    /// The scheduler tick, counted from the PUT's answer, that made the change, at the
    /// latest (1: the tick in progress at the answer or the next one).
    pub intervals: u64,
}

fn shadowed(be: &VgpuBackend, vm: &str) -> bool {
    be.shadow_stats(vm).is_some_and(|s| s.shadowed_now > 0)
}

/// Waits until `cond` holds, polling every 100 µs; `None` after `timeout`.
fn wait_for(timeout: Duration, mut cond: impl FnMut() -> bool) -> Option<Instant> {
    let t0 = Instant::now();
    loop {
        if cond() {
            return Some(Instant::now());
        }
        if t0.elapsed() > timeout {
            return None;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Intervals `a` must stay shadowed for a weight change to count as effective.
pub const PERSIST_INTERVALS: u64 = 3;

/// The kernels of VMs `a` and `b` for [`weight_flips`].
pub const FLIP_VMS: [(&str, u64); 2] = [("a", 1_000_000), ("b", 100_000)];

/// Measures `flips` weight changes of VM `a` (10000 → 1) against `b` (100) through the
/// API (see the module docs). `rig` must run [`FLIP_VMS`].
pub fn weight_flips(rig: &LiveRig, flips: u32) -> Result<Vec<FlipDelay>, ApiSuiteError> {
    let c = rig.client();
    let be = &rig.backend;
    c.set_weight("b", 100)?;
    let mut out = Vec::new();
    for i in 0..flips {
        c.set_weight("a", 10_000)?;
        // `a` runs unhindered: not shadowed for 5 intervals in a row.
        let quiet = Duration::from_millis(5 * u64::from(interval_ms(be)));
        let settled = wait_for(Duration::from_secs(10), || {
            !shadowed(be, "a") && wait_for(quiet, || shadowed(be, "a")).is_none()
        });
        if settled.is_none() {
            return Err(ApiSuiteError::Timeout(format!(
                "flip {i}: VM a keeps being shadowed at weight 10000"
            )));
        }
        // The settling ends right after a tick; spread the request over the interval's
        // phases so the delay is not phase-locked.
        let phase = Duration::from_millis(u64::from(interval_ms(be))) * i / flips.max(1);
        std::thread::sleep(phase);
        let t0 = Instant::now();
        c.set_weight("a", 1)?;
        let n0 = be.sched_stats().intervals;
        // The first observation of `a` shadowed that persists.
        let mut start: Option<(Instant, u64)> = None;
        let effect = wait_for(Duration::from_secs(10), || {
            let now = be.sched_stats().intervals;
            if !shadowed(be, "a") {
                start = None;
                return false;
            }
            let (_, n) = *start.get_or_insert((Instant::now(), now));
            now >= n + PERSIST_INTERVALS
        });
        let (Some(_), Some((t1, n1))) = (effect, start) else {
            return Err(ApiSuiteError::Timeout(format!(
                "flip {i}: VM a not held back 10 s after its weight dropped to 1"
            )));
        };
        out.push(FlipDelay {
            wall_ns: u64::try_from((t1 - t0).as_nanos()).unwrap_or(u64::MAX),
            // Ticks completed before the observation, plus the one that may have been in
            // progress: the tick that made the change is at most this far past the answer.
            intervals: (n1 + 1).saturating_sub(n0),
        });
    }
    c.set_weight("a", 100)?;
    Ok(out)
}

fn interval_ms(be: &VgpuBackend) -> u32 {
    be.scheduler_config().map_or(10, |c| c.interval_ms)
}

/// Round trips of `f`, in µs.
fn round_trips(
    n: u32,
    mut f: impl FnMut() -> Result<(), ClientError>,
) -> Result<Vec<u64>, ClientError> {
    let mut v = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let t = Instant::now();
        f()?;
        v.push(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
    }
    Ok(v)
}

fn fig(name: &str, value: f64, unit: &str, better: Better) -> Figure {
    Figure::new(SUITE, name, value, unit, better)
}

pub fn run(opts: &ApiOpts) -> Result<Vec<Figure>, ApiSuiteError> {
    let rig = LiveRig::new("bench", &FLIP_VMS, opts.interval_ms)?;
    // Let the guests and the scheduler reach a steady state.
    std::thread::sleep(Duration::from_millis(300));
    let flips = weight_flips(&rig, opts.flips)?;
    let interval_ns = f64::from(opts.interval_ms) * 1e6;
    let mut wall: Vec<f64> = flips.iter().map(|f| f.wall_ns as f64 / 1e6).collect();
    let mut ticks: Vec<f64> = flips.iter().map(|f| f.intervals as f64).collect();
    let worst_wall = wall.iter().copied().fold(0.0, f64::max);
    let worst_ticks = ticks.iter().copied().fold(0.0, f64::max);
    let p50_wall = median(&mut wall);
    let mut figs = vec![
        fig(
            "sched_interval",
            f64::from(opts.interval_ms),
            "ms",
            Better::Lower,
        ),
        fig("weight_change_delay_p50", p50_wall, "ms", Better::Lower),
        fig(
            "weight_change_delay_p50_vs_interval",
            p50_wall * 1e6 / interval_ns,
            "intervals",
            Better::Lower,
        )
        .target(2.0),
        fig("weight_change_delay_max", worst_wall, "ms", Better::Lower),
        fig(
            "weight_change_ticks_p50",
            median(&mut ticks),
            "intervals",
            Better::Lower,
        )
        .target(2.0),
        // Not a target: on a loaded host a guest thread that gets no CPU submits nothing,
        // and an idle VM cannot be seen held back (see BENCHMARKS.md).
        fig(
            "weight_change_ticks_max",
            worst_ticks,
            "intervals",
            Better::Lower,
        ),
        fig("weight_flips", flips.len() as f64, "count", Better::Higher),
    ];
    let c = rig.client();
    let mut info = round_trips(opts.requests, || c.info().map(|_| ()))?;
    let mut put = round_trips(opts.requests, || c.set_weight("b", 100).map(|_| ()))?;
    let us = |v: &mut Vec<u64>, p| percentile(v, p).unwrap_or(0) as f64 / 1e3;
    figs.push(fig(
        "get_info_p50",
        us(&mut info, 50.0),
        "us",
        Better::Lower,
    ));
    figs.push(fig(
        "get_info_p99",
        us(&mut info, 99.0),
        "us",
        Better::Lower,
    ));
    figs.push(fig(
        "put_weight_p50",
        us(&mut put, 50.0),
        "us",
        Better::Lower,
    ));
    figs.push(fig(
        "put_weight_p99",
        us(&mut put, 99.0),
        "us",
        Better::Lower,
    ));
    Ok(figs)
}
