//! The VM-wide state KVM emulates in the kernel: the two PICs and the IOAPIC, the PIT and
//! the kvmclock base.

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_state2, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::VmFd;

use super::codec::{Dec, Enc};
use super::MigrationError;

const CHIPS: [u32; 3] = [
    KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE,
    KVM_IRQCHIP_IOAPIC,
];

/// In-kernel irqchip, PIT and clock.
#[derive(Clone)]
pub struct ChipState {
    pub irqchips: Vec<kvm_irqchip>,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
}

impl std::fmt::Debug for ChipState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChipState")
            .field("clock_ns", &self.clock.clock)
            .finish()
    }
}

fn kvm_err(what: &'static str) -> impl Fn(kvm_ioctls::Error) -> MigrationError {
    move |e| MigrationError::Kvm(what, e)
}

impl ChipState {
    /// Reads the state of a VM whose vCPUs are stopped.
    pub fn save(vm: &VmFd) -> Result<Self, MigrationError> {
        let mut irqchips = Vec::with_capacity(CHIPS.len());
        for chip_id in CHIPS {
            let mut c = kvm_irqchip {
                chip_id,
                ..Default::default()
            };
            vm.get_irqchip(&mut c).map_err(kvm_err("KVM_GET_IRQCHIP"))?;
            irqchips.push(c);
        }
        let pit = vm.get_pit2().map_err(kvm_err("KVM_GET_PIT2"))?;
        let mut clock = vm.get_clock().map_err(kvm_err("KVM_GET_CLOCK"))?;
        // Only the clock value travels; KVM_SET_CLOCK refuses flags it does not take.
        clock.flags = 0;
        Ok(ChipState {
            irqchips,
            pit,
            clock,
        })
    }

    /// Puts the state into a VM with an irqchip and a PIT, before its vCPUs run.
    pub fn restore(&self, vm: &VmFd) -> Result<(), MigrationError> {
        for c in &self.irqchips {
            vm.set_irqchip(c).map_err(kvm_err("KVM_SET_IRQCHIP"))?;
        }
        vm.set_pit2(&self.pit).map_err(kvm_err("KVM_SET_PIT2"))?;
        vm.set_clock(&self.clock)
            .map_err(kvm_err("KVM_SET_CLOCK"))?;
        Ok(())
    }

    pub fn encode(&self, e: &mut Enc) {
        e.u32(self.irqchips.len() as u32);
        for c in &self.irqchips {
            e.pod(c);
        }
        e.pod(&self.pit).pod(&self.clock);
    }

    pub fn decode(d: &mut Dec<'_>) -> Result<Self, MigrationError> {
        let n = d.count(8)?;
        if n != CHIPS.len() {
            return Err(MigrationError::Invalid("chips", "irqchip count"));
        }
        let mut irqchips = Vec::with_capacity(n);
        for want in CHIPS {
            let c: kvm_irqchip = d.pod()?;
            if c.chip_id != want {
                return Err(MigrationError::Invalid("chips", "irqchip id"));
            }
            irqchips.push(c);
        }
        Ok(ChipState {
            irqchips,
            pit: d.pod()?,
            clock: d.pod()?,
        })
    }
}
