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
mod config;
pub mod intx;
pub mod irq_routing;
mod park;
mod receive;
mod send;
pub mod serial;
mod vcpu;
pub mod x86_64;

pub use config::*;
pub use send::MigrationSource;
pub use vcpu::setup_vcpu;
use vcpu::*;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use vm_memory::{GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use crate::guest_memory::GuestRam;
use crate::kvm::{Cap, Vcpu, Vm};
use crate::pci::{PciBus, PciDevice};
use crate::shm_window::{HoleFill, ShmWindow};
use crate::vgpu_device::VhostUserVgpu;
use crate::virtio_pci::stub::StubBackend;
use crate::virtio_pci::{BarPlacement, VirtioPciDevice};
use bars::BarWiring;
use intx::IntxForwarder;
use irq_routing::IrqRouting;
use serial::{EventFdTrigger, LegacyDevices, SerialOut, SERIAL_IRQ};
use x86_64::BootLayout;

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

/// Checks the configuration and the guest's files before anything heavy, so
/// misconfigurations fail fast.
fn check_config(cfg: &VmConfig, boot: bool) -> Result<(), BootError> {
    if cfg.vcpus == 0 || cfg.vcpus > MAX_VCPUS {
        return Err(BootError::Vcpus(cfg.vcpus));
    }
    if cfg.mem_mib < x86_64::MIN_MEM_MIB || cfg.mem_mib > (1 << 20) {
        return Err(BootError::MemSize(cfg.mem_mib));
    }
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
    Ok(())
}

/// The VM (TSS placed), the in-kernel irqchip and PIT, guest RAM as memslots.
fn create_vm(cfg: &VmConfig) -> Result<(Arc<Vm>, Arc<GuestRam>, GuestMemoryMmap), BootError> {
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
    let ram = Arc::new(GuestRam::new(&x86_64::ram_layout(cfg.mem_mib << 20))?);
    vm.add_ram(&ram)?;
    let mem = guest_memory_of(&ram)?;
    Ok((vm, ram, mem))
}

/// The vhost-user side of a vgpu function: its shared-memory window and its queues'
/// kick eventfds (ioeventfds on the doorbell).
type VhostParts = (Arc<ShmWindow>, Vec<Arc<vmm_sys_util::eventfd::EventFd>>);

/// The vgpu function (if any) and, for a real device, its vhost-user parts.
type VgpuFunction = (Option<Box<dyn PciDevice>>, Option<VhostParts>);

/// The vgpu virtio-pci function the configuration asks for, if any: a stub, or a
/// device connected to `vgpu-backend` (with its window and kicks).
fn vgpu_function(
    cfg: &VmConfig,
    ram: &Arc<GuestRam>,
    place: BarPlacement,
) -> Result<VgpuFunction, BootError> {
    if cfg.vgpu_stub {
        let dev = VirtioPciDevice::new(StubBackend::new(0), place)?;
        return Ok((Some(Box::new(dev)), None));
    }
    let Some(socket) = &cfg.vgpu_socket else {
        return Ok((None, None));
    };
    let shm_len = vgpu_protocol::device::SHM_SIZE;
    let window = Arc::new(ShmWindow::with_fill(
        vgpu_protocol::device::SHM_REGION_ID,
        shm_len,
        HoleFill::Scratch,
    )?);
    let backend = VhostUserVgpu::connect(socket, ram, window.clone(), cfg.vgpu_faults)?;
    let kicks = (0..vgpu_protocol::device::NUM_QUEUES)
        .filter_map(|q| backend.kick(q).cloned())
        .collect::<Vec<_>>();
    let dev = VirtioPciDevice::new(backend, place)?;
    Ok((Some(Box::new(dev)), Some((window, kicks))))
}

/// A PCI bus with the vgpu function, and for a real device its BAR and interrupt
/// wiring.
#[derive(Default)]
struct PciWiring {
    bus: Option<Arc<Mutex<PciBus>>>,
    hooks: Option<Arc<VgpuHooks>>,
    /// (slot, GSI) of each function's INTA#, for the MP table.
    intx: Vec<(u8, u8)>,
    vgpu_slot: Option<u8>,
}

/// Puts `dev` on a new PCI bus; a vhost-user device also gets its BAR wiring (the
/// window's memslots, ioeventfds) and its interrupts (irqfds, INTx forwarding).
fn wire_pci(
    vm: &Arc<Vm>,
    dev: Box<dyn PciDevice>,
    vhost: Option<VhostParts>,
    place: BarPlacement,
) -> Result<PciWiring, BootError> {
    let mut bus = PciBus::new();
    let slot = bus.add_device(dev)?;
    let gsi = PCI_INTX_GSI_BASE + slot % 8;
    if let Some(d) = bus.device_mut(slot) {
        d.config_mut().set_interrupt(1, gsi);
    }
    log::info!(
        "vgpu {} at PCI 00:{slot:02x}.0, BAR0 {:#x}, shm BAR {:#x}, INTA# GSI {gsi}",
        if vhost.is_some() { "device" } else { "stub" },
        place.bar0,
        place.shm
    );
    let bus = Arc::new(Mutex::new(bus));
    let mut wiring = PciWiring {
        bus: Some(bus.clone()),
        hooks: None,
        intx: vec![(slot, gsi)],
        vgpu_slot: vhost.is_some().then_some(slot),
    };
    let Some((window, kicks)) = vhost else {
        return Ok(wiring);
    };
    let calls = with_vgpu(&bus, slot, |d| d.backend().calls().to_vec()).unwrap_or_default();
    let bars = BarWiring::new(vm.clone(), slot, window, kicks);
    let irqfd = || {
        let fd =
            vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK).map_err(BootError::EventFd)?;
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
    wiring.hooks = Some(Arc::new(VgpuHooks { bars, irqs }));
    Ok(wiring)
}

/// Loads the kernel, the initrd and the command line, and the boot tables.
fn load_image(
    cfg: &VmConfig,
    mem: &GuestMemoryMmap,
    pci_intx: &[(u8, u8)],
) -> Result<BootLayout, BootError> {
    let layout = x86_64::load_all(
        mem,
        &cfg.kernel,
        cfg.initrd.as_deref(),
        &cfg.cmdline,
        cfg.mem_mib << 20,
        cfg.vcpus,
        pci_intx,
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
    Ok(layout)
}

/// Creates the vCPUs with their CPUID; with a `boot` layout, set up to boot it, else
/// left at reset for an incoming migration to fill.
fn create_vcpus(
    vm: &Vm,
    cfg: &VmConfig,
    boot: Option<&BootLayout>,
) -> Result<Vec<Vcpu>, BootError> {
    // Keep `base_cpuid` pristine; patch a copy per vCPU.
    let base_cpuid = vm.supported_cpuid()?;
    let mut vcpus = Vec::with_capacity(usize::from(cfg.vcpus));
    for cpu in 0..cfg.vcpus {
        let vcpu = vm
            .create_vcpu(u64::from(cpu))
            .map_err(|source| BootError::Vcpu { cpu, source })?;
        let mut cpuid = base_cpuid.clone();
        x86_64::patch_cpuid(&mut cpuid, cpu, cfg.vcpus);
        match boot {
            Some(layout) => setup_vcpu(vcpu.vcpu_fd(), cpu, &cpuid, layout)?,
            // The rest of the vCPU's state comes with the migration.
            None => vcpu
                .vcpu_fd()
                .set_cpuid2(&cpuid)
                .map_err(|source| BootError::VcpuSetup {
                    cpu,
                    what: "KVM_SET_CPUID2",
                    source,
                })?,
        }
        vcpus.push(vcpu);
    }
    Ok(vcpus)
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
        check_config(cfg, boot)?;
        let (vm, ram, mem) = create_vm(cfg)?;
        let irq = EventFdTrigger::new().map_err(BootError::EventFd)?;
        vm.register_irqfd(irq.eventfd(), SERIAL_IRQ)?;
        let devices = Arc::new(LegacyDevices::new(irq, out));
        let place = pci_bar_placement(vgpu_protocol::device::SHM_SIZE)?;
        let (dev, vhost) = vgpu_function(cfg, &ram, place)?;
        let wiring = match dev {
            Some(dev) => wire_pci(&vm, dev, vhost, place)?,
            None => PciWiring::default(),
        };
        // Guest image (an incoming migration brings RAM and registers instead).
        let layout = if boot {
            load_image(cfg, &mem, &wiring.intx)?
        } else {
            BootLayout::default()
        };
        let vcpus = create_vcpus(&vm, cfg, boot.then_some(&layout))?;
        Ok(LinuxVm {
            hooks: wiring.hooks,
            vcpus,
            park: Arc::new(park::VcpuPark::new(vm.clone())),
            vgpu_slot: wiring.vgpu_slot,
            vcpu_count: cfg.vcpus,
            mem_mib: cfg.mem_mib,
            vm,
            devices,
            pci: wiring.bus,
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
