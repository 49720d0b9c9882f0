//! `vgpu-guest-bench`: the guest benchmark, `vgpu-bench guest` as a guest binary. The
//! shared workloads and submission round trips through `/dev/vgpu` (in a VM), or on an
//! in-process sim with `--native` (the baseline to run outside the VM); a table for
//! people by default, `--json` for one JSON object per figure per line.

use clap::Parser;
use vgpu_guest_tools::bench::{self, GuestOpts};
use vgpu_guest_tools::report::{print_json, print_table};

#[derive(Parser)]
#[command(
    version,
    about = "vgpu guest benchmark: workloads and round trips through /dev/vgpu"
)]
struct Cli {
    /// Print one JSON object per figure instead of a table.
    #[arg(long)]
    json: bool,
    /// Small sizes: a smoke run, not a measurement.
    #[arg(long)]
    quick: bool,
    /// The device node.
    #[arg(long, default_value = vgpu_guest::devvgpu::DEFAULT_PATH)]
    device: String,
    /// Use an in-process sim GPU instead of the device.
    #[arg(long)]
    native: bool,
    /// Timed runs of each workload (the best counts); default 1 with --quick, else 5.
    #[arg(long)]
    reps: Option<u32>,
    /// With --native: the sim's longest idle sleep between polls, µs (match the
    /// backend's --sim-idle-sleep-us for a fair comparison).
    #[arg(long)]
    sim_idle_sleep_us: Option<u64>,
}

fn main() {
    env_logger::init();
    let cli = Cli::parse();
    let device = (!cli.native).then_some(cli.device);
    let mut opts = if cli.quick {
        GuestOpts::quick(device)
    } else {
        GuestOpts::full(device)
    };
    opts.reps = cli.reps.unwrap_or(opts.reps);
    opts.sim_idle_sleep_us = cli.sim_idle_sleep_us;
    match bench::run(&opts) {
        Ok(figs) if cli.json => print_json(&figs),
        Ok(figs) => print_table(&figs),
        Err(e) => {
            eprintln!("vgpu-guest-bench: {e}");
            std::process::exit(1);
        }
    }
}
