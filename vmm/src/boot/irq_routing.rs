//! Interrupt routing of the vgpu function: MSI-X where the guest enabled it, INTx
//! otherwise.
//!
//! With MSI-X, each queue's call eventfd is an irqfd on a GSI whose KVM route is the
//! guest-programmed MSI message: the backend's signal becomes an interrupt in the guest
//! without any userspace hop. Queues without a deliverable vector (MSI-X off, no vector,
//! vector masked) stay with the INTx forwarder ([`super::intx`]). Configuration interrupts
//! go through one eventfd registered either on the configuration vector's GSI or on the
//! INTx line.
//!
//! KVM replaces the whole routing table on every update, so the table always carries
//! the default routes (GSI 0–15 to the PICs, 0–23 to the IOAPIC) plus one MSI route per
//! table entry at `MSI_GSI_BASE + vector`. A masked vector's irqfd is unregistered; KVM
//! delivers a signal that arrived meanwhile when it is registered again (the PBA thus
//! never reads pending).

use std::sync::{Arc, Mutex};

use crate::kvm::Vm;
use kvm_bindings::{
    kvm_irq_routing_entry, KvmIrqRouting, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE, KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI,
};
use log::{debug, error, info};
use vmm_sys_util::eventfd::EventFd;

use super::intx::IntxForwarder;
use crate::pci::PciBus;
use crate::vgpu_device::VhostUserVgpu;
use crate::virtio_pci::msix::MsixState;
use crate::virtio_pci::VirtioPciDevice;

/// First GSI used for MSI routes (after the IOAPIC's 24 pins).
pub const MSI_GSI_BASE: u32 = 24;
const IOAPIC_PINS: u32 = 24;
const PIC_PINS: u32 = 16;

#[derive(Debug)]
struct Current {
    /// GSI each queue's call is an irqfd on (None: forwarded as INTx).
    queue_gsi: Vec<Option<u32>>,
    config_gsi: u32,
    /// MSI routes in the table: (gsi, address, data).
    routes: Vec<(u32, u64, u32)>,
}

/// See the module documentation.
pub struct IrqRouting {
    vm: Arc<Vm>,
    pci_slot: u8,
    intx_gsi: u32,
    calls: Vec<Arc<EventFd>>,
    config_irq: Arc<EventFd>,
    intx: Arc<IntxForwarder>,
    current: Mutex<Current>,
}

fn irqchip_route(gsi: u32, chip: u32, pin: u32) -> kvm_irq_routing_entry {
    let mut e = kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_IRQCHIP,
        ..Default::default()
    };
    e.u.irqchip.irqchip = chip;
    e.u.irqchip.pin = pin;
    e
}

fn msi_route(gsi: u32, addr: u64, data: u32) -> kvm_irq_routing_entry {
    let mut e = kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_MSI,
        ..Default::default()
    };
    e.u.msi.address_lo = addr as u32;
    e.u.msi.address_hi = (addr >> 32) as u32;
    e.u.msi.data = data;
    e
}

impl IrqRouting {
    /// Routing for the vgpu function in `pci_slot`: `config_irq` must already be an irqfd
    /// on `intx_gsi` (the state before the guest enables MSI-X).
    pub fn new(
        vm: Arc<Vm>,
        pci_slot: u8,
        intx_gsi: u32,
        calls: Vec<Arc<EventFd>>,
        config_irq: Arc<EventFd>,
        intx: Arc<IntxForwarder>,
    ) -> Self {
        let n = calls.len();
        IrqRouting {
            vm,
            pci_slot,
            intx_gsi,
            calls,
            config_irq,
            intx,
            current: Mutex::new(Current {
                queue_gsi: vec![None; n],
                config_gsi: intx_gsi,
                routes: Vec::new(),
            }),
        }
    }

    /// Picks up an MSI-X change of the function (call with the bus locked, after a guest
    /// write to its configuration space or BAR0).
    pub fn sync(&self, bus: &mut PciBus) {
        let update = bus
            .device_mut(self.pci_slot)
            .and_then(|d| {
                d.as_any_mut()
                    .downcast_mut::<VirtioPciDevice<VhostUserVgpu>>()
            })
            .and_then(|d| d.take_msix_update());
        if let Some(st) = update {
            self.apply(&st);
        }
    }

    fn set_table(&self, routes: &[(u32, u64, u32)]) -> Result<(), String> {
        let mut entries = Vec::new();
        for gsi in 0..PIC_PINS {
            let chip = if gsi < 8 {
                KVM_IRQCHIP_PIC_MASTER
            } else {
                KVM_IRQCHIP_PIC_SLAVE
            };
            entries.push(irqchip_route(gsi, chip, gsi % 8));
        }
        for gsi in 0..IOAPIC_PINS {
            entries.push(irqchip_route(gsi, KVM_IRQCHIP_IOAPIC, gsi));
        }
        for &(gsi, addr, data) in routes {
            entries.push(msi_route(gsi, addr, data));
        }
        let table = KvmIrqRouting::from_entries(&entries).map_err(|e| format!("{e:?}"))?;
        self.vm.set_gsi_routing(&table).map_err(|e| e.to_string())
    }

    fn move_irqfd(&self, fd: &EventFd, from: Option<u32>, to: Option<u32>) {
        if from == to {
            return;
        }
        if let Some(g) = from {
            if let Err(e) = self.vm.unregister_irqfd(fd, g) {
                error!("vgpu: unregistering an irqfd from GSI {g}: {e}");
            }
        }
        if let Some(g) = to {
            if let Err(e) = self.vm.register_irqfd(fd, g) {
                error!("vgpu: registering an irqfd on GSI {g}: {e}");
            }
        }
    }

    fn apply(&self, st: &MsixState) {
        let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let routes: Vec<(u32, u64, u32)> = if st.enabled {
            st.entries
                .iter()
                .enumerate()
                .map(|(v, e)| (MSI_GSI_BASE + v as u32, e.addr, e.data))
                .collect()
        } else {
            Vec::new()
        };
        if routes != cur.routes {
            match self.set_table(&routes) {
                Ok(()) => cur.routes = routes,
                Err(e) => {
                    // Keep INTx: unroute everything from MSI.
                    error!("vgpu: MSI routing failed ({e}); staying on INTx");
                    for q in 0..self.calls.len() {
                        self.move_irqfd(&self.calls[q], cur.queue_gsi[q], None);
                        cur.queue_gsi[q] = None;
                        let _ = self.intx.forward_queue(q, true);
                    }
                    return;
                }
            }
        }
        for (q, call) in self.calls.iter().enumerate() {
            let want = st
                .deliverable(Some(q))
                .map(|(v, _)| MSI_GSI_BASE + u32::from(v));
            if want == cur.queue_gsi[q] {
                continue;
            }
            if want.is_some() {
                // Stop the forwarder reading the eventfd before KVM consumes it.
                let _ = self.intx.forward_queue(q, false);
            }
            self.move_irqfd(call, cur.queue_gsi[q], want);
            if want.is_none() {
                let _ = self.intx.forward_queue(q, true);
            }
            cur.queue_gsi[q] = want;
        }
        let want = st
            .deliverable(None)
            .map_or(self.intx_gsi, |(v, _)| MSI_GSI_BASE + u32::from(v));
        self.move_irqfd(&self.config_irq, Some(cur.config_gsi), Some(want));
        cur.config_gsi = want;
        debug!("vgpu: interrupt routing {cur:?}");
        if st.enabled {
            info!(
                "vgpu: MSI-X on: queues on GSIs {:?}, configuration on GSI {}",
                cur.queue_gsi, cur.config_gsi
            );
        }
    }
}
