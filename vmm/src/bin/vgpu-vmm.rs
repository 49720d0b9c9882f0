//! `vgpu-vmm`: boots an x86_64 Linux bzImage (+ initramfs) under KVM with a serial console
//! and, with `--vgpu-socket`, the vgpu virtio-pci function on a PCI bus, backed by the
//! `vgpu-backend` listening on that vhost-user socket (`--vgpu-stub`: a stand-in device
//! without a backend, for bring-up).
//!
//! Live migration: `--api-socket PATH` opens a control socket on which `vgpu-migrate`
//! sends the running VM to a `vgpu-vmm --incoming ADDR` (`unix:PATH` or
//! `tcp:HOST:PORT`), which builds the same machine, takes the VM over and runs it.
//!
//! Exit status: 0 when the guest resets or powers off (i8042 reset, triple fault, KVM
//! shutdown event) or was migrated away, 1 on a setup error, a vCPU failure or a failed
//! incoming migration, 2 on bad command-line usage.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use vgpu_sandbox::{privileges, Mode, Role};
use vgpu_vmm::boot::{
    LinuxVm, MigrationSource, VmConfig, DEFAULT_CMDLINE, DEFAULT_CMDLINE_PCI, MAX_VCPUS,
};
use vgpu_vmm::migration::wire::Listener;
use vgpu_vmm::migration::Address;
use vgpu_vmm::reconnect::{FaultPolicy, ReconnectPolicy};

/// Boot a Linux guest under KVM (serial console on COM1).
#[derive(Debug, Parser)]
#[command(name = "vgpu-vmm", version, about)]
struct Cli {
    /// Guest kernel: an x86_64 bzImage (e.g. /boot/vmlinuz-*).
    #[arg(long, value_name = "PATH", required_unless_present = "incoming")]
    kernel: Option<PathBuf>,
    /// Initramfs (cpio, optionally compressed) to pass to the kernel.
    #[arg(long, value_name = "PATH")]
    initrd: Option<PathBuf>,
    /// Kernel command line [default: DEFAULT_CMDLINE of vgpu_vmm::boot, with `pci=conf1`
    /// instead of `pci=off` with a vgpu device].
    #[arg(long)]
    cmdline: Option<String>,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(32..=1048576))]
    mem_mib: u64,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=i64::from(MAX_VCPUS)))]
    vcpus: u8,
    /// Write the guest's serial output to this file instead of standard output.
    #[arg(long, value_name = "PATH")]
    serial: Option<PathBuf>,
    /// Add the vgpu virtio-pci device (PCI 0x1af4:0x107c) backed by a stub: PCI bus on
    /// ports 0xCF8/0xCFC, BARs in the 32-bit MMIO gap.
    #[arg(long, conflicts_with = "vgpu_socket")]
    vgpu_stub: bool,
    /// Add the vgpu virtio-pci device backed by the vgpu-backend listening on this
    /// vhost-user socket (the backend must be running: the VMM connects before booting).
    #[arg(long, value_name = "PATH")]
    vgpu_socket: Option<PathBuf>,
    /// When the vgpu backend dies or is closed for not answering, keep the device broken
    /// (`DEVICE_NEEDS_RESET`) instead of reconnecting.
    #[arg(long)]
    vgpu_no_reconnect: bool,
    /// Give up reconnecting to the vgpu backend after this many failed attempts
    /// [default: retry forever].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    vgpu_retry_limit: Option<u32>,
    /// Longest wait between reconnect attempts (the first waits 100 ms, each next one
    /// twice as long).
    #[arg(long, value_name = "MS", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(100..))]
    vgpu_retry_max_backoff_ms: u64,
    /// How long a vhost-user request that waits for the backend's reply may take before
    /// the backend counts as hung and the connection is closed (0: wait forever).
    #[arg(long, value_name = "MS", default_value_t = 10000)]
    vgpu_request_timeout_ms: u64,
    /// Receive a VM migrated from another vgpu-vmm on this address (`unix:PATH` or
    /// `tcp:HOST:PORT`) instead of booting one: the machine's size comes from the source;
    /// give the same vgpu options (`--vgpu-socket` to this host's backend).
    #[arg(long, value_name = "ADDR", conflicts_with_all = ["kernel", "initrd", "vgpu_stub"])]
    incoming: Option<Address>,
    /// A control socket for live migration: `vgpu-migrate --api PATH --to ADDR` sends the
    /// running VM to a `vgpu-vmm --incoming ADDR`.
    #[arg(long, value_name = "PATH")]
    api_socket: Option<PathBuf>,
    /// Stop the VM (exit status 1) if it still runs after this many seconds.
    #[arg(long, value_name = "SECS")]
    timeout: Option<u64>,
    /// What a syscall outside a thread's seccomp filter does: `kill` the process, `log`
    /// it and let it run, or `off` (no filters; capabilities kept).
    #[arg(long, value_name = "kill|log|off", default_value = "kill")]
    seccomp: Mode,
}

/// Before setup starts any thread: drops capabilities and makes the filters of every role
/// ready for the threads to enter (`vgpu_vmm::sandbox`).
fn prepare_sandbox(mode: Mode) -> Result<(), String> {
    if mode == Mode::Off {
        log::warn!("seccomp: off (no filters; capabilities kept)");
        return Ok(());
    }
    let plan = vgpu_vmm::sandbox::plan(mode).map_err(|e| format!("seccomp: {e}"))?;
    privileges::drop_all().map_err(|e| format!("capabilities: {e}"))?;
    vgpu_sandbox::install_plan(plan).map_err(|e| format!("seccomp: {e}"))?;
    log::info!("seccomp: {mode} (filters per thread role)");
    Ok(())
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp_millis()
        .init();
    let cli = Cli::parse();
    let pci = cli.vgpu_stub || cli.vgpu_socket.is_some();
    let cmdline = cli.cmdline.unwrap_or_else(|| {
        if pci {
            DEFAULT_CMDLINE_PCI
        } else {
            DEFAULT_CMDLINE
        }
        .to_owned()
    });
    if pci && cmdline.split_whitespace().any(|a| a == "pci=off") {
        eprintln!("vgpu-vmm: warning: a vgpu device with pci=off: the guest will not see it");
    }
    let cfg = VmConfig {
        kernel: cli.kernel.unwrap_or_default(),
        initrd: cli.initrd,
        cmdline,
        mem_mib: cli.mem_mib,
        vcpus: cli.vcpus,
        serial: cli.serial,
        vgpu_stub: cli.vgpu_stub,
        vgpu_socket: cli.vgpu_socket,
        vgpu_faults: FaultPolicy {
            reconnect: (!cli.vgpu_no_reconnect).then(|| ReconnectPolicy {
                max_backoff: Duration::from_millis(cli.vgpu_retry_max_backoff_ms),
                max_attempts: cli.vgpu_retry_limit,
                ..ReconnectPolicy::default()
            }),
            request_timeout: (cli.vgpu_request_timeout_ms > 0)
                .then(|| Duration::from_millis(cli.vgpu_request_timeout_ms)),
        },
    };
    // Sockets are bound before the sandbox closes bind/listen.
    let incoming = match cli.incoming.as_ref().map(Listener::bind).transpose() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("vgpu-vmm: {e}");
            return ExitCode::FAILURE;
        }
    };
    let api = match cli.api_socket.as_ref().map(bind_api).transpose() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("vgpu-vmm: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = prepare_sandbox(cli.seccomp) {
        eprintln!("vgpu-vmm: {e}");
        return ExitCode::FAILURE;
    }
    let vm = match &incoming {
        Some(listener) => {
            eprintln!(
                "vgpu-vmm: waiting for a migration on {}",
                cli.incoming
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default()
            );
            LinuxVm::receive(&cfg, listener).map(|(vm, rep)| {
                eprintln!(
                    "vgpu-vmm: migration received: {} bytes of RAM in {} rounds, {} bytes of device state, {:.1} ms",
                    rep.ram_bytes,
                    rep.rounds,
                    rep.device_bytes,
                    rep.total.as_secs_f64() * 1e3
                );
                vm
            })
        }
        None => LinuxVm::new(&cfg),
    };
    let mut vm = match vm {
        Ok(vm) => vm,
        Err(e) => {
            eprintln!("vgpu-vmm: {e}");
            return ExitCode::FAILURE;
        }
    };
    drop(incoming);
    if let Some(api) = api {
        let source = vm.migration_source();
        let spawned = std::thread::Builder::new()
            .name("vmm-api".into())
            .spawn(move || {
                vgpu_sandbox::enter(Role::VmmMigration);
                serve_api(&api, &source);
            });
        if let Err(e) = spawned {
            eprintln!("vgpu-vmm: starting the control socket's thread: {e}");
            return ExitCode::FAILURE;
        }
    }
    // Set up: the main thread narrows to running the vCPUs.
    vgpu_sandbox::enter(Role::VmmMain);
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

/// The control socket (see `serve_api`).
fn bind_api(path: &PathBuf) -> Result<(UnixListener, PathBuf), String> {
    if std::fs::symlink_metadata(path)
        .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
    {
        let _ = std::fs::remove_file(path);
    }
    UnixListener::bind(path)
        .map(|l| (l, path.clone()))
        .map_err(|e| format!("cannot bind the control socket {}: {e}", path.display()))
}

/// Serves the control socket: each connection sends one line, `migrate ADDR`, and
/// reads progress lines (`progress ...`) and a verdict (`ok ...` or `error ...`).
fn serve_api((listener, _path): &(UnixListener, PathBuf), source: &MigrationSource) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let Ok(mut out) = conn.try_clone() else {
            continue;
        };
        let mut line = String::new();
        if BufReader::new(std::io::Read::take(&conn, 4096))
            .read_line(&mut line)
            .is_err()
        {
            continue;
        }
        let mut say = |s: String| {
            let _ = writeln!(out, "{s}");
        };
        let line = line.trim();
        let Some(addr) = line.strip_prefix("migrate ") else {
            say(format!("error unknown command {line:?} (migrate ADDR)"));
            continue;
        };
        let addr = match addr.trim().parse::<Address>() {
            Ok(a) => a,
            Err(e) => {
                say(format!("error {e}"));
                continue;
            }
        };
        log::info!("control socket: migrate to {addr}");
        let r = source.send(&addr, &mut |p| {
            eprintln!("vgpu-vmm: migration: {p}");
            say(format!("progress {p}"));
        });
        match r {
            Ok(rep) => {
                let rounds: Vec<String> = rep.ram_rounds.iter().map(u64::to_string).collect();
                say(format!(
                    "ok downtime_ms={:.1} total_ms={:.1} ram_rounds={} device_bytes={} tail_bytes={} gpu_pages={}",
                    rep.downtime.as_secs_f64() * 1e3,
                    rep.total.as_secs_f64() * 1e3,
                    rounds.join(","),
                    rep.device_bytes,
                    rep.tail_bytes,
                    rep.gpu_pages
                ));
                drop(out);
                // The vCPU threads leave: the process ends with them.
                source.hand_over();
                return;
            }
            Err(e) => say(format!("error {e}")),
        }
    }
}
