//! Booting a Linux guest under KVM: the `vgpu-vmm` binary's engine.
//!
//! [`LinuxVm::new`] creates the VM (memfd-backed RAM from [`GuestRam`], in-kernel irqchip
//! and PIT, COM1 with an irqfd on IRQ 4), loads a bzImage, an initrd and the command line
//! with linux-loader and sets up every vCPU for the 64-bit boot protocol
//! ([`x86_64`]). [`LinuxVm::run`] runs one thread per vCPU until the guest resets
//! (i8042 reset, triple fault), powers off (KVM system event) or fails.
//!
//! With [`VmConfig::vgpu_stub`], a PCI bus (configuration mechanism #1 on ports
//! `0xCF8..=0xCFF`) carries the vgpu virtio-pci function backed by a stub
//! ([`crate::virtio_pci::stub::StubBackend`]); its BARs sit in the 32-bit MMIO gap
//! ([`pci_bar_placement`]) and are served as MMIO exits in the vCPU loop.

pub mod bars;
pub mod intx;
pub mod irq_routing;
mod park;
mod receive;
mod send;
pub mod serial;
pub mod x86_64;

pub use send::MigrationSource;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{KVM_SYSTEM_EVENT_CRASH, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN};
use kvm_ioctls::{VcpuExit, VcpuFd};
use thiserror::Error;
use vm_memory::{GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use crate::guest_memory::{GuestMemoryError, GuestRam};
use crate::kvm::{Cap, KvmError, Vcpu, VcpuKicker, Vm};
use crate::pci::{PciBus, PciDevice};
use crate::shm_window::{HoleFill, ShmWindow, ShmWindowError};
use crate::vgpu_device::{VgpuDeviceError, VhostUserVgpu};
use crate::virtio_pci::stub::StubBackend;
use crate::virtio_pci::{shm_bar_size, BarPlacement, VirtioPciDevice, VirtioPciError, BAR0_SIZE};
use crate::write_protect::StoreFaultWait;
use bars::BarWiring;
use intx::IntxForwarder;
use irq_routing::IrqRouting;
use serial::{EventFdTrigger, LegacyDevices, SerialOut, SERIAL_IRQ};
use x86_64::BootLayout;

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

/// How the guest ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestExit {
    /// The guest reset the machine through the i8042 controller.
    I8042Reset,
    /// Triple fault (what `reboot=t`, or a failed reset, ends in).
    TripleFault,
    /// KVM system event: reset requested (e.g. PSCI / ACPI on other setups).
    SystemReset,
    /// KVM system event: power off.
    PowerOff,
    /// A vCPU exited on `hlt` (only without an in-kernel LAPIC; reported for completeness).
    Halted,
    /// The VM was migrated to another `vgpu-vmm`, which runs it now.
    MigratedOut,
}

/// A booted-to-be Linux VM.
pub struct LinuxVm {
    // Field order matters for drop: the interrupt thread stops first; vCPUs and the VM
    // (whose memslots the PCI wiring holds) go before the RAM they map.
    hooks: Option<Arc<VgpuHooks>>,
    vcpus: Vec<Vcpu>,
    /// Stops the vCPU threads for a save (live migration).
    park: Arc<park::VcpuPark>,
    /// The vgpu function's PCI slot, when it has one.
    vgpu_slot: Option<u8>,
    vcpu_count: u8,
    mem_mib: u64,
    /// Its memslots hold `ram` (and the shared-memory window) alive until it goes.
    vm: Arc<Vm>,
    devices: Arc<LegacyDevices>,
    pci: Option<Arc<Mutex<PciBus>>>,
    layout: BootLayout,
    mem: GuestMemoryMmap,
    ram: Arc<GuestRam>,
}

/// Wraps the memfd mappings of `ram` as vm-memory regions (for linux-loader). The
/// mappings stay owned by `ram`.
pub fn guest_memory_of(ram: &GuestRam) -> Result<GuestMemoryMmap, BootError> {
    let mut regions = Vec::new();
    for r in ram.regions() {
        let len = usize::try_from(r.len()).map_err(|_| BootError::MemSize(r.len() >> 20))?;
        // SAFETY: `host_addr()..+len` is a live shared read/write mapping owned by `ram`;
        // the caller keeps `ram` alive for as long as the returned memory object is used
        // (`LinuxVm` drops `mem` before `ram`), and a raw-pointer region never unmaps it.
        let mmap = unsafe {
            MmapRegion::<()>::build_raw(
                r.host_addr(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
            )
        }
        .map_err(|e| BootError::GuestMemory(e.to_string()))?;
        let region = GuestRegionMmap::new(mmap, GuestAddress(r.gpa()))
            .ok_or_else(|| BootError::GuestMemory("region wraps".into()))?;
        regions.push(region);
    }
    GuestMemoryMmap::from_regions(regions).map_err(|e| BootError::GuestMemory(e.to_string()))
}

impl LinuxVm {
    /// Creates the VM and loads the guest; nothing runs yet.
    pub fn new(cfg: &VmConfig) -> Result<Self, BootError> {
        Self::with_serial(cfg, SerialOut::open(cfg.serial.as_deref())?)
    }

    /// As [`LinuxVm::new`], with the serial output given.
    pub fn with_serial(cfg: &VmConfig, out: SerialOut) -> Result<Self, BootError> {
        Self::build(cfg, out, true)
    }

    /// Creates the VM; with `boot`, loads the guest image and sets the vCPUs up to boot
    /// it, else leaves RAM empty and the vCPUs at reset (an incoming migration fills
    /// both).
    fn build(cfg: &VmConfig, out: SerialOut, boot: bool) -> Result<Self, BootError> {
        if cfg.vcpus == 0 || cfg.vcpus > MAX_VCPUS {
            return Err(BootError::Vcpus(cfg.vcpus));
        }
        if cfg.mem_mib < x86_64::MIN_MEM_MIB || cfg.mem_mib > (1 << 20) {
            return Err(BootError::MemSize(cfg.mem_mib));
        }
        // Check the files before anything heavy, so misconfigurations fail fast.
        if boot {
            check_file(&cfg.kernel, |path, source| BootError::KernelOpen {
                path,
                source,
            })?;
            if let Some(initrd) = &cfg.initrd {
                check_file(initrd, |path, source| BootError::InitrdOpen {
                    path,
                    source,
                })?;
            }
            x86_64::make_cmdline(&cfg.cmdline)?;
        }

        if cfg.vgpu_stub && cfg.vgpu_socket.is_some() {
            return Err(BootError::VgpuTwice);
        }
        // The VM (TSS placed), the in-kernel irqchip and PIT, guest RAM as memslots.
        let mut vm = Vm::new()?;
        vm.require(&[
            (Cap::Irqchip, "KVM_CAP_IRQCHIP"),
            (Cap::Irqfd, "KVM_CAP_IRQFD"),
            (Cap::Pit2, "KVM_CAP_PIT2"),
            (Cap::ExtCpuid, "KVM_CAP_EXT_CPUID"),
        ])?;
        vm.create_irqchip()?;
        vm.create_pit2()?;
        let vm = Arc::new(vm);
        let mem_bytes = cfg.mem_mib << 20;
        let ram = Arc::new(GuestRam::new(&x86_64::ram_layout(mem_bytes))?);
        vm.add_ram(&ram)?;
        let mem = guest_memory_of(&ram)?;

        // Devices.
        let irq = EventFdTrigger::new().map_err(BootError::EventFd)?;
        vm.register_irqfd(irq.eventfd(), SERIAL_IRQ)?;
        let devices = Arc::new(LegacyDevices::new(irq, out));
        let shm_len = vgpu_protocol::device::SHM_SIZE;
        let place = pci_bar_placement(shm_len)?;
        let (dev, vhost): (Option<Box<dyn PciDevice>>, _) = if cfg.vgpu_stub {
            let dev = VirtioPciDevice::new(StubBackend::new(0), place)?;
            (Some(Box::new(dev)), None)
        } else if let Some(socket) = &cfg.vgpu_socket {
            let window = Arc::new(ShmWindow::with_fill(
                vgpu_protocol::device::SHM_REGION_ID,
                shm_len,
                HoleFill::Scratch,
            )?);
            let backend = VhostUserVgpu::connect(socket, &ram, window.clone(), cfg.vgpu_faults)?;
            let kicks = (0..vgpu_protocol::device::NUM_QUEUES)
                .filter_map(|q| backend.kick(q).cloned())
                .collect::<Vec<_>>();
            let dev = VirtioPciDevice::new(backend, place)?;
            (Some(Box::new(dev)), Some((window, kicks)))
        } else {
            (None, None)
        };
        let mut pci = None;
        let mut hooks = None;
        let mut pci_intx = Vec::new();
        let mut vgpu_slot = None;
        if let Some(dev) = dev {
            let mut bus = PciBus::new();
            let slot = bus.add_device(dev)?;
            vgpu_slot = vhost.is_some().then_some(slot);
            let gsi = PCI_INTX_GSI_BASE + slot % 8;
            if let Some(d) = bus.device_mut(slot) {
                d.config_mut().set_interrupt(1, gsi);
            }
            pci_intx.push((slot, gsi));
            log::info!(
                "vgpu {} at PCI 00:{slot:02x}.0, BAR0 {:#x}, shm BAR {:#x}, INTA# GSI {gsi}",
                if vhost.is_some() { "device" } else { "stub" },
                place.bar0,
                place.shm
            );
            let bus = Arc::new(Mutex::new(bus));
            if let Some((window, kicks)) = vhost {
                let calls =
                    with_vgpu(&bus, slot, |d| d.backend().calls().to_vec()).unwrap_or_default();
                let bars = BarWiring::new(vm.clone(), slot, window, kicks);
                let irqfd = || {
                    let fd = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK)
                        .map_err(BootError::EventFd)?;
                    vm.register_irqfd(&fd, u32::from(gsi))?;
                    Ok::<_, BootError>(fd)
                };
                let irq = irqfd()?;
                let config_irq = Arc::new(irqfd()?);
                let intx = IntxForwarder::start(bus.clone(), slot, irq, config_irq.clone())
                    .map_err(BootError::Intx)?;
                let irqs = IrqRouting::new(
                    vm.clone(),
                    slot,
                    u32::from(gsi),
                    calls,
                    config_irq,
                    Arc::new(intx),
                );
                hooks = Some(Arc::new(VgpuHooks { bars, irqs }));
            }
            pci = Some(bus);
        }

        // Guest image (an incoming migration brings RAM and registers instead).
        let layout = if boot {
            let layout = x86_64::load_all(
                &mem,
                &cfg.kernel,
                cfg.initrd.as_deref(),
                &cfg.cmdline,
                mem_bytes,
                cfg.vcpus,
                &pci_intx,
            )?;
            log::info!(
                "kernel at {:#x}..{:#x}, entry {:#x}, initrd {:x?}, cmdline {} bytes, {} MiB, {} vCPU(s)",
                layout.kernel_load,
                layout.kernel_end,
                layout.entry,
                layout.initrd,
                layout.cmdline_len,
                cfg.mem_mib,
                cfg.vcpus
            );

            layout
        } else {
            BootLayout::default()
        };

        // vCPUs.
        let base_cpuid = vm.supported_cpuid()?;
        // Keep `base_cpuid` pristine; patch a copy per vCPU.
        let mut vcpus = Vec::with_capacity(usize::from(cfg.vcpus));
        for cpu in 0..cfg.vcpus {
            let vcpu = vm
                .create_vcpu(u64::from(cpu))
                .map_err(|source| BootError::Vcpu { cpu, source })?;
            let mut cpuid = base_cpuid.clone();
            x86_64::patch_cpuid(&mut cpuid, cpu, cfg.vcpus);
            if boot {
                setup_vcpu(vcpu.vcpu_fd(), cpu, &cpuid, &layout)?;
            } else {
                // The rest of the vCPU's state comes with the migration.
                vcpu.vcpu_fd()
                    .set_cpuid2(&cpuid)
                    .map_err(|source| BootError::VcpuSetup {
                        cpu,
                        what: "KVM_SET_CPUID2",
                        source,
                    })?;
            }
            vcpus.push(vcpu);
        }

        Ok(LinuxVm {
            hooks,
            vcpus,
            park: Arc::new(park::VcpuPark::new(vm.clone())),
            vgpu_slot,
            vcpu_count: cfg.vcpus,
            mem_mib: cfg.mem_mib,
            vm,
            devices,
            pci,
            layout,
            mem,
            ram,
        })
    }

    /// Where the guest image was placed.
    pub fn layout(&self) -> &BootLayout {
        &self.layout
    }

    /// Guest memory (vm-memory view).
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.mem
    }

    /// Guest RAM (memfds; for a vhost-user backend).
    pub fn ram(&self) -> &GuestRam {
        &self.ram
    }

    /// The legacy devices (serial input, reset state).
    pub fn devices(&self) -> &Arc<LegacyDevices> {
        &self.devices
    }

    /// The PCI bus, when there is one.
    pub fn pci_bus(&self) -> Option<&Arc<Mutex<PciBus>>> {
        self.pci.as_ref()
    }

    /// Where the vgpu shared-memory window is mapped in the guest, once the guest enabled
    /// its BAR (with `vgpu_socket`).
    pub fn vgpu_shm_gpa(&self) -> Option<u64> {
        self.hooks.as_ref().and_then(|h| h.bars.shm_gpa())
    }

    /// The VM (memslots, ioeventfds, irqfds; its raw fd through [`Vm::vm_fd`]).
    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    /// The vCPUs (before [`LinuxVm::run`]).
    pub fn vcpus(&self) -> &[Vcpu] {
        &self.vcpus
    }

    /// Runs every vCPU on its own thread until the guest ends; returns how it ended.
    /// `timeout`, if given, stops the VM with [`BootError::UnexpectedExit`] after that long.
    pub fn run(&mut self, timeout: Option<Duration>) -> Result<GuestExit, BootError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel::<(u8, Result<GuestExit, BootError>)>();
        let mut threads: Vec<VcpuThread> = Vec::new();
        let started = Instant::now();
        self.park
            .set_vcpus(self.vcpus.iter().map(Vcpu::kicker).collect());
        for (i, vcpu) in self.vcpus.drain(..).enumerate() {
            let cpu = i as u8;
            let kicker = vcpu.kicker();
            let park = self.park.clone();
            let vcpu_stop = stop.clone();
            let tx = tx.clone();
            let devices = self.devices.clone();
            let pci = self.pci.clone();
            let hooks = self.hooks.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("vcpu{cpu}"))
                .spawn(move || {
                    vgpu_sandbox::enter(vgpu_sandbox::Role::Vcpu);
                    let res = vcpu_loop(
                        vcpu,
                        cpu,
                        &devices,
                        pci.as_deref(),
                        hooks.as_deref(),
                        &vcpu_stop,
                        &park,
                    );
                    let _ = tx.send((cpu, res));
                });
            match spawned {
                Ok(handle) => threads.push(VcpuThread {
                    cpu,
                    handle,
                    kicker,
                }),
                Err(source) => {
                    stop.store(true, Ordering::SeqCst);
                    stop_threads(threads);
                    return Err(BootError::VcpuThread { cpu, source });
                }
            }
        }
        drop(tx);

        // The first vCPU to finish decides the outcome.
        let first = match timeout {
            Some(t) => rx.recv_timeout(t).map_err(|_| BootError::UnexpectedExit {
                cpu: 0,
                exit: format!("timeout after {t:?}"),
            }),
            None => rx.recv().map_err(|_| BootError::VcpuPanic(0)),
        };
        stop.store(true, Ordering::SeqCst);
        let panicked = stop_threads(threads);
        let (cpu, res) = first?;
        log::info!(
            "vCPU {cpu} ended the VM after {:.3}s: {res:?}",
            started.elapsed().as_secs_f64()
        );
        if let Some(h) = &self.hooks {
            let w = h.bars.window();
            log::info!(
                "vgpu window: guest stores hit pages the backend was moving {} times (each waited and was retried)",
                w.stores_waited()
            );
        }
        if let Some(p) = panicked {
            return Err(BootError::VcpuPanic(p));
        }
        res
    }
}

fn check_file(path: &Path, err: impl Fn(PathBuf, io::Error) -> BootError) -> Result<(), BootError> {
    let md = std::fs::metadata(path).map_err(|e| err(path.to_owned(), e))?;
    if !md.is_file() {
        return Err(err(
            path.to_owned(),
            io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"),
        ));
    }
    Ok(())
}

/// Sets up vCPU `cpu`: CPUID, MSRs, registers for the 64-bit boot protocol, FPU, LAPIC.
/// KVM keeps application processors in wait-for-SIPI regardless of their registers.
pub fn setup_vcpu(
    fd: &VcpuFd,
    cpu: u8,
    cpuid: &kvm_bindings::CpuId,
    layout: &BootLayout,
) -> Result<(), BootError> {
    let e = |what: &'static str| move |source| BootError::VcpuSetup { cpu, what, source };
    fd.set_cpuid2(cpuid).map_err(e("KVM_SET_CPUID2"))?;
    let msrs = x86_64::boot_msrs_fam()?;
    let set = fd.set_msrs(&msrs).map_err(e("KVM_SET_MSRS"))?;
    let expected = msrs.as_slice().len();
    if set != expected {
        return Err(BootError::Msrs {
            cpu,
            set,
            expected,
            index: msrs.as_slice().get(set).map(|m| m.index).unwrap_or(0),
        });
    }
    fd.set_regs(&x86_64::boot_regs(layout.entry))
        .map_err(e("KVM_SET_REGS"))?;
    let mut sregs = fd.get_sregs().map_err(e("KVM_GET_SREGS"))?;
    x86_64::boot_sregs(&mut sregs);
    fd.set_sregs(&sregs).map_err(e("KVM_SET_SREGS"))?;
    fd.set_fpu(&x86_64::boot_fpu()).map_err(e("KVM_SET_FPU"))?;
    // XCR0 = every XSAVE feature the CPUID offers, as the kernel sets it at once anyway;
    // KVM then reports the matching XSAVE area size in CPUID 0xd. (Under the nested TCG
    // rig the guest's own XSETBV apparently does not reach L1's KVM, and the kernel warns
    // "XSAVE consistency problem" without this.) Best effort: not every KVM has XCRs.
    if let Some(xcr0) = x86_64::xcr0_of(cpuid) {
        let mut xcrs = kvm_bindings::kvm_xcrs {
            nr_xcrs: 1,
            ..Default::default()
        };
        xcrs.xcrs[0].xcr = 0;
        xcrs.xcrs[0].value = xcr0;
        if let Err(err) = fd.set_xcrs(&xcrs) {
            log::debug!("vCPU {cpu}: KVM_SET_XCRS(xcr0={xcr0:#x}) failed: {err}");
        }
    }
    let mut lapic = fd.get_lapic().map_err(e("KVM_GET_LAPIC"))?;
    x86_64::set_lint(&mut lapic);
    fd.set_lapic(&lapic).map_err(e("KVM_SET_LAPIC"))?;
    Ok(())
}

/// What follows the guest's programming of the vhost-user vgpu function outside the
/// MMIO-exit path: the BARs' memslot and ioeventfds, and the interrupt routing.
struct VgpuHooks {
    bars: BarWiring,
    irqs: IrqRouting,
}

impl VgpuHooks {
    /// After a guest write to the bus (config space or a BAR), under the bus lock so that
    /// changes are applied in the order they happened.
    fn after_guest_write(&self, bus: &mut PciBus) {
        let events = bus.take_bar_events();
        if !events.is_empty() {
            self.bars.apply(&events);
        }
        self.irqs.sync(bus);
    }
}

/// Runs `f` on the vhost-user vgpu function in `slot` of `bus`.
fn with_vgpu<R>(
    bus: &Mutex<PciBus>,
    slot: u8,
    f: impl FnOnce(&mut VirtioPciDevice<VhostUserVgpu>) -> R,
) -> Option<R> {
    let mut bus = lock(bus);
    bus.device_mut(slot)?
        .as_any_mut()
        .downcast_mut::<VirtioPciDevice<VhostUserVgpu>>()
        .map(f)
}

/// Locks the PCI bus. A poisoned bus is still consistent (every access leaves it so):
/// keep serving.
fn lock(p: &Mutex<PciBus>) -> std::sync::MutexGuard<'_, PciBus> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

/// The run loop of one vCPU.
fn vcpu_loop(
    mut vcpu: Vcpu,
    cpu: u8,
    devices: &LegacyDevices,
    pci: Option<&Mutex<PciBus>>,
    hooks: Option<&VgpuHooks>,
    stop: &AtomicBool,
    park: &park::VcpuPark,
) -> Result<GuestExit, BootError> {
    let mut store_wait = StoreFaultWait::default();
    loop {
        if stop.load(Ordering::SeqCst) {
            return Err(BootError::UnexpectedExit {
                cpu,
                exit: "stopped".into(),
            });
        }
        if park.requested() && park.park(cpu, &mut vcpu) == park::Parked::Leave {
            return Ok(GuestExit::MigratedOut);
        }
        let r = vcpu.run_raw();
        // A store into a window page the backend holds read-only while it moves it: wait
        // and re-run the store (see `write_protect`).
        let store_fault = match &r {
            Err(e) => e.errno() == libc::EFAULT,
            Ok(exit) => matches!(exit, VcpuExit::MemoryFault { .. }),
        };
        if store_fault {
            let window = hooks.map(|h| h.bars.window());
            let generation = window.map_or(0, |w| w.protection_generation());
            if store_wait.on_fault(generation, || window.is_some_and(|w| w.wait_after_fault())) {
                if let Some(w) = window {
                    w.note_store_wait();
                }
                continue;
            }
            if let Some(w) = window {
                log::error!(
                    "vCPU {cpu}: a memory fault not retried: window read-only bytes {}, protection generation {generation}, {} retries so far",
                    w.read_only_bytes(),
                    store_wait.waits()
                );
            }
        } else {
            store_wait.on_progress();
        }
        match r {
            Ok(VcpuExit::IoOut(port, data)) => {
                let handled = pci.is_some_and(|p| {
                    let mut bus = lock(p);
                    let handled = bus.pio_write(port, data);
                    // Only the bus's own ports (config space) can move BARs or program
                    // MSI-X; serial output and the like skip this.
                    if let Some(h) = hooks.filter(|_| handled) {
                        h.after_guest_write(&mut bus);
                    }
                    handled
                });
                if !handled {
                    devices.pio_write(port, data);
                }
                if devices.reset_requested() {
                    return Ok(GuestExit::I8042Reset);
                }
            }
            Ok(VcpuExit::IoIn(port, data)) => {
                if !pci.is_some_and(|p| lock(p).pio_read(port, data)) {
                    devices.pio_read(port, data);
                }
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                if !pci.is_some_and(|p| lock(p).mmio_read(addr, data)) {
                    log::trace!("vCPU {cpu}: unhandled MMIO read at {addr:#x}");
                    data.fill(0xff);
                }
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                if hooks.is_some_and(|h| h.bars.store_to_window(addr, data)) {
                    continue;
                }
                let handled = pci.is_some_and(|p| {
                    let mut bus = lock(p);
                    let handled = bus.mmio_write(addr, data);
                    if let Some(h) = hooks.filter(|_| handled) {
                        h.after_guest_write(&mut bus);
                    }
                    handled
                });
                if !handled {
                    log::trace!("vCPU {cpu}: unhandled MMIO write {data:x?} at {addr:#x}");
                }
            }
            Ok(VcpuExit::Shutdown) => return Ok(GuestExit::TripleFault),
            Ok(VcpuExit::Hlt) => return Ok(GuestExit::Halted),
            Ok(VcpuExit::SystemEvent(event, _)) => {
                return match event {
                    KVM_SYSTEM_EVENT_SHUTDOWN => Ok(GuestExit::PowerOff),
                    KVM_SYSTEM_EVENT_RESET => Ok(GuestExit::SystemReset),
                    KVM_SYSTEM_EVENT_CRASH => Err(BootError::GuestCrash { cpu, event }),
                    _ => Err(BootError::UnexpectedExit {
                        cpu,
                        exit: format!("system event {event}"),
                    }),
                };
            }
            Ok(VcpuExit::FailEntry(reason, _)) => return Err(BootError::FailEntry { cpu, reason }),
            Ok(VcpuExit::InternalError) => return Err(BootError::InternalError { cpu }),
            Ok(VcpuExit::Intr) => {}
            Ok(other) => {
                return Err(BootError::UnexpectedExit {
                    cpu,
                    exit: format!("{other:?}"),
                })
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {}
            Err(source) => return Err(BootError::Run { cpu, source }),
        }
    }
}

/// A running vCPU thread and the kicker of its vCPU.
struct VcpuThread {
    cpu: u8,
    handle: JoinHandle<()>,
    kicker: VcpuKicker,
}

/// Kicks the vCPU threads out of KVM_RUN (the KVM layer's kick: `immediate_exit` and a
/// signal, so one landing just before KVM_RUN is not lost) until they have all seen the
/// stop flag, then joins them. Returns the first vCPU whose thread panicked.
fn stop_threads(threads: Vec<VcpuThread>) -> Option<u8> {
    let mut panicked = None;
    for t in threads {
        while !t.handle.is_finished() {
            t.kicker.kick();
            std::thread::sleep(Duration::from_millis(5));
        }
        if t.handle.join().is_err() && panicked.is_none() {
            panicked = Some(t.cpu);
        }
    }
    panicked
}
