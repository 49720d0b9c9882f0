//! `vgpu-guest-bench`: the guest benchmark, `vgpu-bench guest` as a guest binary. The
//! shared workloads and submission round trips through `/dev/vgpu` (in a VM), or on an
//! in-process sim with `--native` (the baseline to run outside the VM); a table for
//! people by default, `--json` for one JSON object per figure per line.

use clap::Parser;
use vgpu_guest_tools::bench::{self, GuestArgs};
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
    #[command(flatten)]
    guest: GuestArgs,
}

fn main() {
    env_logger::init();
    let cli = Cli::parse();
    let opts = cli.guest.opts(cli.quick);
    match bench::run(&opts) {
        Ok(figs) if cli.json => print_json(&figs),
        Ok(figs) => print_table(&figs),
        Err(e) => {
            eprintln!("vgpu-guest-bench: {e}");
            std::process::exit(1);
        }
    }
}
