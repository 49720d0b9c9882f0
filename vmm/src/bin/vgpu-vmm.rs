//! `vgpu-vmm`: boots an x86_64 Linux bzImage (+ initramfs) under KVM with a serial console.
//!
//! Exit status: 0 when the guest resets or powers off (i8042 reset, triple fault, KVM
//! shutdown event), 1 on a setup error or a vCPU failure, 2 on bad command-line usage.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use vgpu_vmm::boot::{LinuxVm, VmConfig, DEFAULT_CMDLINE, MAX_VCPUS};

/// Boot a Linux guest under KVM (serial console on COM1).
#[derive(Debug, Parser)]
#[command(name = "vgpu-vmm", version, about)]
struct Cli {
    /// Guest kernel: an x86_64 bzImage (e.g. /boot/vmlinuz-*).
    #[arg(long, value_name = "PATH")]
    kernel: PathBuf,
    /// Initramfs (cpio, optionally compressed) to pass to the kernel.
    #[arg(long, value_name = "PATH")]
    initrd: Option<PathBuf>,
    /// Kernel command line.
    #[arg(long, default_value = DEFAULT_CMDLINE)]
    cmdline: String,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(32..=1048576))]
    mem_mib: u64,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=i64::from(MAX_VCPUS)))]
    vcpus: u8,
    /// Write the guest's serial output to this file instead of standard output.
    #[arg(long, value_name = "PATH")]
    serial: Option<PathBuf>,
    /// Stop the VM (exit status 1) if it still runs after this many seconds.
    #[arg(long, value_name = "SECS")]
    timeout: Option<u64>,
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp_millis()
        .init();
    let cli = Cli::parse();
    let cfg = VmConfig {
        kernel: cli.kernel,
        initrd: cli.initrd,
        cmdline: cli.cmdline,
        mem_mib: cli.mem_mib,
        vcpus: cli.vcpus,
        serial: cli.serial,
    };
    let mut vm = match LinuxVm::new(&cfg) {
        Ok(vm) => vm,
        Err(e) => {
            eprintln!("vgpu-vmm: {e}");
            return ExitCode::FAILURE;
        }
    };
    match vm.run(cli.timeout.map(Duration::from_secs)) {
        Ok(how) => {
            log::info!("guest ended: {how:?}");
            eprintln!("vgpu-vmm: guest ended ({how:?})");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("vgpu-vmm: {e}");
            ExitCode::FAILURE
        }
    }
}
