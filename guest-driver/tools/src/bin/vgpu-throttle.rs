//! `vgpu-throttle`: the seeds' load generator as a guest tool. Keeps the GPU busy with
//! spin kernels of a fixed length through `/dev/vgpu` (or an in-process sim with
//! `--native`) for a while, then prints what it got: kernels completed and the share of
//! wall time its kernels covered. Several of them in one or several VMs show how the GPU
//! (and later the scheduler) shares time.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use vgpu_guest::workloads::{ThrottleConfig, Workload};
use vgpu_guest::Device;

#[derive(Parser)]
#[command(version, about = "Keep the GPU busy with fixed-length spin kernels")]
struct Cli {
    /// The device node.
    #[arg(long, default_value = vgpu_guest::devvgpu::DEFAULT_PATH)]
    device: String,
    /// Use an in-process sim GPU instead of the device.
    #[arg(long)]
    native: bool,
    /// Instead of the device node: a loopback VM (direct submission, or forwarded with
    /// --forwarded) connected to a running backend's VM socket (host side; needs a build
    /// with feature `loopback`).
    #[arg(long, value_name = "SOCKET", conflicts_with = "native")]
    loopback: Option<std::path::PathBuf>,
    /// `--loopback`: a frontend without a shared-memory region (forwarded submission).
    #[arg(long, requires = "loopback")]
    forwarded: bool,
    /// Length of each kernel, in microseconds.
    #[arg(long, default_value_t = 1000)]
    kernel_us: u64,
    /// Submissions kept in flight.
    #[arg(long, default_value_t = 2)]
    depth: usize,
    /// Run this many seconds (unless --kernels is given).
    #[arg(long, default_value_t = 5.0)]
    duration: f64,
    /// Run exactly this many kernels.
    #[arg(long)]
    kernels: Option<u64>,
}

fn run(cli: &Cli) -> Result<(), String> {
    let dev = if let Some(socket) = &cli.loopback {
        open_loopback(socket, cli.forwarded)?
    } else if cli.native {
        vgpu_guest_tools::native::device(None).map_err(|e| e.to_string())?
    } else {
        Device::devvgpu(&cli.device).map_err(|e| format!("{}: {e}", cli.device))?
    };
    let ctx = dev.create_context().map_err(|e| e.to_string())?;
    let stop = Arc::new(AtomicBool::new(false));
    if cli.kernels.is_none() {
        if !(cli.duration.is_finite() && cli.duration > 0.0) {
            return Err("--duration must be positive".into());
        }
        let s = stop.clone();
        let d = Duration::from_secs_f64(cli.duration);
        std::thread::spawn(move || {
            std::thread::sleep(d);
            s.store(true, Ordering::Relaxed);
        });
    }
    let w = Workload::Throttle(ThrottleConfig {
        kernel_ns: cli.kernel_us.saturating_mul(1000),
        iterations: cli.kernels,
        depth: cli.depth,
        stop: Some(stop),
    });
    let r = w.run(&ctx).map_err(|e| e.to_string())?;
    let wall = r.elapsed.as_secs_f64();
    let busy = r.iterations as f64 * cli.kernel_us as f64 * 1e-6;
    println!(
        "VGPU-THROTTLE pid={} transport={} kernel_us={} kernels={} wall_s={:.3} kernels_per_s={:.1} gpu_share={:.3}",
        std::process::id(),
        dev.info().transport,
        cli.kernel_us,
        r.iterations,
        wall,
        r.items_per_sec(),
        if wall > 0.0 { busy / wall } else { 0.0 }
    );
    Ok(())
}

#[cfg(feature = "loopback")]
fn open_loopback(socket: &std::path::Path, forwarded: bool) -> Result<Device, String> {
    Device::connect_loopback_with(socket, 256 << 20, forwarded, std::process::id())
        .map_err(|e| format!("{}: {e}", socket.display()))
}

#[cfg(not(feature = "loopback"))]
fn open_loopback(_socket: &std::path::Path, _forwarded: bool) -> Result<Device, String> {
    Err("--loopback needs a build with feature `loopback`".into())
}

fn main() -> ExitCode {
    env_logger::init();
    match run(&Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vgpu-throttle: {e}");
            ExitCode::FAILURE
        }
    }
}
