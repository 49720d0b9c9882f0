//! What a VM is built from: the user's configuration, its limits and placements, and the
//! errors of VM setup and of the vCPU loops.

use std::io;
use std::path::{Path, PathBuf};

use thiserror::Error;

use super::*;
use crate::guest_memory::GuestMemoryError;
use crate::kvm::KvmError;
use crate::shm_window::ShmWindowError;
use crate::vgpu_device::VgpuDeviceError;
use crate::virtio_pci::{shm_bar_size, BarPlacement, VirtioPciError, BAR0_SIZE};

/// Most vCPUs we boot (the MP table's LAPIC ids must stay below the IOAPIC id).
pub const MAX_VCPUS: u8 = 64;

impl From<KvmError> for BootError {
    /// The KVM layer's errors, with the messages `vgpu-vmm` has always printed for a
    /// missing or unusable `/dev/kvm`.
    fn from(e: KvmError) -> Self {
        match e {
            KvmError::Open(e) => BootError::KvmOpen(e),
            KvmError::ApiVersion(v) => BootError::KvmApi(v),
            KvmError::MissingCap(c) => BootError::KvmCap(c),
            e => BootError::KvmLayer(e),
        }
    }
}

/// Errors of VM setup and of the vCPU run loops.
#[derive(Debug, Error)]
pub enum BootError {
    #[error("cannot open /dev/kvm: {0} (is KVM loaded and is /dev/kvm accessible to this user?)")]
    KvmOpen(kvm_ioctls::Error),
    #[error("KVM API version {0} is not supported (expected 12)")]
    KvmApi(i32),
    #[error("KVM lacks a required capability: {0}")]
    KvmCap(&'static str),
    #[error("{what} failed: {source}")]
    Kvm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("vCPU {cpu}: {what} failed: {source}")]
    VcpuSetup {
        cpu: u8,
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error(
        "vCPU {cpu}: KVM accepted only {set} of {expected} boot MSRs (first rejected: {index:#x})"
    )]
    Msrs {
        cpu: u8,
        set: usize,
        expected: usize,
        index: u32,
    },
    #[error("cannot open kernel image {path}: {source}")]
    KernelOpen { path: PathBuf, source: io::Error },
    #[error(
        "cannot load kernel image {path} (an x86_64 bzImage or vmlinux ELF is required): {source}"
    )]
    KernelLoad {
        path: PathBuf,
        source: linux_loader::loader::Error,
    },
    #[error("cannot read initrd {path}: {source}")]
    InitrdOpen { path: PathBuf, source: io::Error },
    #[error("initrd {0} is empty")]
    InitrdEmpty(PathBuf),
    #[error("initrd {path} ({len} bytes) does not fit in guest RAM ({mem_bytes} bytes) above the kernel")]
    InitrdTooBig {
        path: PathBuf,
        len: u64,
        mem_bytes: u64,
    },
    #[error("bad kernel command line: {0}")]
    Cmdline(linux_loader::cmdline::Error),
    #[error("guest memory size {0} MiB is out of range (at least {min} MiB)", min = x86_64::MIN_MEM_MIB)]
    MemSize(u64),
    #[error("vCPU count {0} is out of range (1..={MAX_VCPUS})")]
    Vcpus(u8),
    #[error("guest RAM: {0}")]
    Memory(#[from] GuestMemoryError),
    #[error("guest RAM as vm-memory: {0}")]
    GuestMemory(String),
    #[error("writing the {0} into guest memory failed: {1}")]
    GuestWrite(&'static str, String),
    #[error("KVM structure too large: {0}")]
    Fam(String),
    #[error("cannot open serial output {path}: {source}")]
    SerialOut { path: PathBuf, source: io::Error },
    #[error("serial input: {0}")]
    SerialIn(String),
    #[error("{0} lock poisoned")]
    Poisoned(&'static str),
    #[error("creating the serial interrupt eventfd failed: {0}")]
    EventFd(io::Error),
    #[error("starting the vCPU {cpu} thread failed: {source}")]
    VcpuThread { cpu: u8, source: io::Error },
    #[error("KVM: {0}")]
    KvmLayer(#[source] KvmError),
    #[error("vCPU {cpu}: {source}")]
    Vcpu {
        cpu: u8,
        #[source]
        source: KvmError,
    },
    #[error("vCPU {cpu}: KVM_RUN failed: {source}")]
    Run { cpu: u8, source: kvm_ioctls::Error },
    #[error("vCPU {cpu}: KVM_EXIT_FAIL_ENTRY, hardware reason {reason:#x}")]
    FailEntry { cpu: u8, reason: u64 },
    #[error("vCPU {cpu}: KVM internal error (emulation failure?)")]
    InternalError { cpu: u8 },
    #[error("vCPU {cpu}: guest crashed (KVM system event {event})")]
    GuestCrash { cpu: u8, event: u32 },
    #[error("vCPU {cpu}: unexpected exit {exit}")]
    UnexpectedExit { cpu: u8, exit: String },
    #[error("vCPU {0} thread panicked")]
    VcpuPanic(u8),
    #[error("vgpu PCI device: {0}")]
    VirtioPci(#[from] VirtioPciError),
    #[error("PCI bus: {0}")]
    Pci(#[from] crate::pci::PciError),
    #[error("the PCI BARs do not fit in the 32-bit MMIO gap")]
    PciLayout,
    #[error("--vgpu-stub and --vgpu-socket exclude each other")]
    VgpuTwice,
    #[error("{0}")]
    Vgpu(#[from] VgpuDeviceError),
    #[error("vgpu shared-memory window: {0}")]
    ShmWindow(#[from] ShmWindowError),
    #[error("vgpu interrupt forwarding: {0}")]
    Intx(io::Error),
    #[error("live migration: {0}")]
    Migration(#[source] crate::migration::MigrationError),
}

/// What the user asks for.
#[derive(Debug, Clone)]
pub struct VmConfig {
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
    pub mem_mib: u64,
    pub vcpus: u8,
    /// Serial output file; `None` = standard output.
    pub serial: Option<PathBuf>,
    /// Put the vgpu virtio-pci function, backed by a stub, on a PCI bus.
    pub vgpu_stub: bool,
    /// Put the vgpu virtio-pci function on a PCI bus, backed by the `vgpu-backend`
    /// listening on this vhost-user socket.
    pub vgpu_socket: Option<PathBuf>,
    /// What the vgpu device does when its backend dies or stops answering.
    pub vgpu_faults: crate::reconnect::FaultPolicy,
}

/// IOAPIC pin (= GSI) of PCI slot `n`'s INTA#: `PCI_INTX_GSI_BASE + n % 8`, above the ISA
/// pins so that no legacy device shares it.
pub const PCI_INTX_GSI_BASE: u8 = 16;

/// The default kernel command line.
pub const DEFAULT_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=1 pci=off nomodule i8042.noaux i8042.nokbd i8042.nomux i8042.nopnp";

/// The default kernel command line with a PCI bus: configuration mechanism #1 (there is
/// no ACPI, hence no MMCONFIG), no probing for other mechanisms.
pub const DEFAULT_CMDLINE_PCI: &str =
    "console=ttyS0 reboot=k panic=1 pci=conf1 nomodule i8042.noaux i8042.nokbd i8042.nomux i8042.nopnp";

/// Where the vgpu function's BARs go: the shared-memory BAR (the largest, naturally
/// aligned) at the bottom of the 32-bit MMIO gap, BAR0 right after it. Both stay below
/// the IOAPIC.
pub fn pci_bar_placement(shm_len: u64) -> Result<BarPlacement, BootError> {
    let shm_size = shm_bar_size(shm_len).ok_or(BootError::PciLayout)?;
    let shm = x86_64::MMIO_GAP_START.next_multiple_of(shm_size);
    let bar0 = (shm + shm_size).next_multiple_of(BAR0_SIZE);
    if bar0 + BAR0_SIZE > u64::from(x86_64::IOAPIC_ADDR) {
        return Err(BootError::PciLayout);
    }
    Ok(BarPlacement { bar0, shm })
}

pub(super) fn check_file(
    path: &Path,
    err: impl Fn(PathBuf, io::Error) -> BootError,
) -> Result<(), BootError> {
    let md = std::fs::metadata(path).map_err(|e| err(path.to_owned(), e))?;
    if !md.is_file() {
        return Err(err(
            path.to_owned(),
            io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"),
        ));
    }
    Ok(())
}
