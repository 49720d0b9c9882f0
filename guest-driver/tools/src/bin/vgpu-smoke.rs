//! `vgpu-smoke`: runs every builtin kernel on VRAM and on host (guest-RAM) buffers
//! through `/dev/vgpu` and checks each result against the CPU reference; also the copy
//! engine, a channel fault, and blocking waits on notify events and fences. Prints one
//! line per check and `VGPU-SMOKE-RESULT pass=N fail=M skip=K`; exits non-zero on any
//! failure. `--native` runs the same checks on an in-process sim GPU (a baseline; in a
//! build with feature `native`).

use std::process::ExitCode;

use clap::Parser;
use vgpu_guest::Device;
use vgpu_guest_tools::smoke;

#[derive(Parser)]
#[command(version, about = "Check every builtin kernel through /dev/vgpu")]
struct Cli {
    /// The device node.
    #[arg(long, default_value = vgpu_guest::devvgpu::DEFAULT_PATH)]
    device: String,
    /// Use an in-process sim GPU instead of the device.
    #[arg(long)]
    native: bool,
    /// Instead of the device node: a loopback VM (a VMM in this process) connected to a
    /// running `vgpu-backend`'s vhost-user socket (a build with feature `loopback`), e.g.
    /// to check a backend on a real GPU under its seccomp filters.
    #[arg(long, value_name = "SOCKET", conflicts_with_all = ["native", "hostile", "stats"])]
    loopback: Option<std::path::PathBuf>,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Instead: what a hostile process gets (bad arguments, forged ids, mmap of slots it
    /// does not own, another process using this one's objects); needs the device node.
    #[arg(long, conflicts_with = "native")]
    hostile: bool,
    /// Instead: print the VM's GPU objects as the backend counts them (all processes).
    #[arg(long, conflicts_with_all = ["native", "hostile"])]
    stats: bool,
    /// Instead: for this many seconds, write and check a VRAM buffer through the CPU
    /// while VRAM beyond the VM's share comes and goes beside it, so the backend moves the
    /// buffer's chunks under the stores (needs the device node).
    #[arg(long, value_name = "SECS", conflicts_with_all = ["native", "hostile", "stats"])]
    swap: Option<u64>,
    /// `--swap`: the buffer written through the CPU, in MiB.
    #[arg(long, default_value_t = 32)]
    swap_buffer_mib: u64,
    /// `--swap`: the most VRAM allocated beside it at once, in MiB.
    #[arg(long, default_value_t = 192)]
    swap_pressure_mib: u64,
    /// Repeat the whole set this many times.
    #[arg(long, default_value_t = 1)]
    rounds: u32,
}

fn open(cli: &Cli) -> Result<Device, String> {
    if let Some(socket) = &cli.loopback {
        return open_loopback(socket);
    }
    if cli.native {
        vgpu_guest_tools::native::device(None).map_err(|e| e.to_string())
    } else {
        Device::devvgpu(&cli.device).map_err(|e| format!("{}: {e}", cli.device))
    }
}

#[cfg(feature = "loopback")]
fn open_loopback(socket: &std::path::Path) -> Result<Device, String> {
    Device::connect_loopback(socket, 512 << 20, std::process::id())
        .map_err(|e| format!("{}: {e}", socket.display()))
}

#[cfg(not(feature = "loopback"))]
fn open_loopback(_socket: &std::path::Path) -> Result<Device, String> {
    Err("--loopback needs a build with feature `loopback`".into())
}

/// Prints one line per check and the result line; the exit status.
fn report(checks: impl IntoIterator<Item = smoke::Check>) -> ExitCode {
    let (mut pass, mut fail, mut skip) = (0u32, 0u32, 0u32);
    for c in checks {
        match (&c.failure, c.skipped) {
            (_, true) => {
                skip += 1;
                println!("VGPU-SMOKE SKIP {}", c.name);
            }
            (None, false) => {
                pass += 1;
                println!("VGPU-SMOKE PASS {}", c.name);
            }
            (Some(why), false) => {
                fail += 1;
                println!("VGPU-SMOKE FAIL {}: {why}", c.name);
            }
        }
    }
    println!("VGPU-SMOKE-RESULT pass={pass} fail={fail} skip={skip}");
    if fail == 0 && pass > 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn main() -> ExitCode {
    env_logger::init();
    let cli = Cli::parse();
    if cli.stats {
        return match vgpu_guest::devvgpu::DevVgpuTransport::open(&cli.device)
            .and_then(|t| Ok((t.stats()?, t.is_forwarded()?)))
        {
            Ok((s, fwd)) => {
                println!(
                    "VGPU-STATS contexts={} channels={} vram_bytes={} mapped_guest_bytes={} aperture_bytes={} vram_limit={} submission={}",
                    s.contexts, s.channels, s.vram_bytes, s.mapped_guest_bytes, s.aperture_bytes, s.vram_limit,
                    if fwd { "forwarded" } else { "direct" }
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("vgpu-smoke: {}: {e}", cli.device);
                ExitCode::FAILURE
            }
        };
    }
    if cli.hostile {
        return report(vgpu_guest_tools::hostile::run(&cli.device));
    }
    let dev = match open(&cli) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("vgpu-smoke: {e}");
            println!("VGPU-SMOKE-RESULT pass=0 fail=1 skip=0");
            return ExitCode::FAILURE;
        }
    };
    if let Some(secs) = cli.swap {
        let r = vgpu_guest_tools::swap_check::run(
            &dev,
            std::time::Duration::from_secs(secs),
            cli.swap_buffer_mib,
            cli.swap_pressure_mib,
        );
        println!(
            "VGPU-SMOKE swap: {} passes over {} MiB, {} pressure rounds, peak {} MiB beside it",
            r.passes,
            cli.swap_buffer_mib,
            r.pressure_rounds,
            r.pressure_peak_bytes >> 20
        );
        return report([smoke::Check {
            name: "swap_cpu_stores".into(),
            failure: r.failure,
            skipped: false,
        }]);
    }
    let info = dev.info();
    println!(
        "VGPU-SMOKE device={} protocol={:#x} vram={}MiB engines={} pid={}",
        info.transport,
        info.protocol_version,
        info.vram_bytes >> 20,
        info.compute_engines,
        std::process::id()
    );
    let seed = cli.seed;
    report((0..cli.rounds).flat_map(|round| smoke::run(&dev, seed.wrapping_add(round as u64))))
}
