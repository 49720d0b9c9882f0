//! `vgpu-migrate`: asks a running `vgpu-vmm --api-socket PATH` to send its VM to a
//! `vgpu-vmm --incoming ADDR`, prints the progress, and exits 0 once the destination runs
//! the VM (1 if the migration failed: the VM then runs on at the source).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Live-migrate the VM of a running vgpu-vmm.
#[derive(Debug, Parser)]
#[command(name = "vgpu-migrate", version, about)]
struct Cli {
    /// The source vgpu-vmm's control socket (its `--api-socket`).
    #[arg(long, value_name = "PATH")]
    api: PathBuf,
    /// Where the destination vgpu-vmm listens (its `--incoming`): unix:PATH or
    /// tcp:HOST:PORT.
    #[arg(long, value_name = "ADDR")]
    to: String,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut conn = match UnixStream::connect(&cli.api) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vgpu-migrate: cannot connect to {}: {e}", cli.api.display());
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = writeln!(conn, "migrate {}", cli.to) {
        eprintln!("vgpu-migrate: {e}");
        return ExitCode::FAILURE;
    }
    for line in BufReader::new(conn).lines() {
        let Ok(line) = line else { break };
        println!("{line}");
        if line.starts_with("ok ") {
            return ExitCode::SUCCESS;
        }
        if line.starts_with("error ") {
            return ExitCode::FAILURE;
        }
    }
    eprintln!("vgpu-migrate: the source closed the control socket without a verdict");
    ExitCode::FAILURE
}
