//! vCPUs: their setup for the 64-bit boot protocol, the run loop of each vCPU thread
//! (MMIO and port exits to the PCI bus and the legacy devices, the vgpu BAR hooks) and
//! stopping the threads.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::Duration;

use kvm_bindings::{KVM_SYSTEM_EVENT_CRASH, KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN};
use kvm_ioctls::{VcpuExit, VcpuFd};

use super::*;
use crate::kvm::{Vcpu, VcpuKicker};
use crate::pci::PciBus;
use crate::vgpu_device::VhostUserVgpu;
use crate::virtio_pci::VirtioPciDevice;
use crate::write_protect::StoreFaultWait;
use bars::BarWiring;
use irq_routing::IrqRouting;
use serial::LegacyDevices;
use x86_64::BootLayout;

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
pub(super) struct VgpuHooks {
    pub(super) bars: BarWiring,
    pub(super) irqs: IrqRouting,
}

impl VgpuHooks {
    /// After a guest write to the bus (config space or a BAR), under the bus lock so that
    /// changes are applied in the order they happened.
    pub(super) fn after_guest_write(&self, bus: &mut PciBus) {
        let events = bus.take_bar_events();
        if !events.is_empty() {
            self.bars.apply(&events);
        }
        self.irqs.sync(bus);
    }
}

/// Runs `f` on the vhost-user vgpu function in `slot` of `bus`.
pub(super) fn with_vgpu<R>(
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
pub(super) fn lock(p: &Mutex<PciBus>) -> std::sync::MutexGuard<'_, PciBus> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

/// The run loop of one vCPU.
pub(super) fn vcpu_loop(
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
pub(super) struct VcpuThread {
    pub(super) cpu: u8,
    pub(super) handle: JoinHandle<()>,
    pub(super) kicker: VcpuKicker,
}

/// Kicks the vCPU threads out of KVM_RUN (the KVM layer's kick: `immediate_exit` and a
/// signal, so one landing just before KVM_RUN is not lost) until they have all seen the
/// stop flag, then joins them. Returns the first vCPU whose thread panicked.
pub(super) fn stop_threads(threads: Vec<VcpuThread>) -> Option<u8> {
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
