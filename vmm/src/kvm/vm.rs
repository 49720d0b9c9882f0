//! The VM: memslots, ioeventfds, irqchip/irqfds, vCPU creation.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, CpuId, KvmIrqRouting, KVM_MAX_CPUID_ENTRIES,
    KVM_MEM_LOG_DIRTY_PAGES, KVM_MEM_READONLY, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Cap, IoEventAddress, Kvm, VmFd};
use log::debug;
use vmm_sys_util::eventfd::EventFd;

use super::vcpu::Vcpu;
use super::KvmError;
use crate::guest_memory::{GuestRam, PAGE_SIZE};
use crate::shm_window::ShmWindow;

/// A memslot number (KVM's `slot`, address space 0).
pub type SlotId = u32;

/// Where the TSS (three pages) and the identity map page go: just below the 4 GiB BIOS
/// area, as QEMU and Firecracker put them. Needed by Intel VMX to run real mode.
const TSS_ADDR: usize = 0xfffb_d000;

/// What a memslot maps (for listing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemslotInfo {
    pub slot: SlotId,
    pub gpa: u64,
    pub len: u64,
    pub host: u64,
    pub readonly: bool,
}

pub(super) struct Memslot {
    info: MemslotInfo,
    /// Keeps the host mapping alive while KVM may access it.
    _backing: Option<Arc<dyn Any + Send + Sync>>,
}

impl fmt::Debug for Memslot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.info.fmt(f)
    }
}

/// The memslot table. Shared with every [`Vcpu`], so that the backings outlive the VM's
/// vCPUs even if the [`Vm`] is dropped first (a vCPU fd keeps the kernel VM alive).
pub(super) type Slots = Arc<Mutex<BTreeMap<SlotId, Memslot>>>;

/// A KVM VM.
#[derive(Debug)]
pub struct Vm {
    kvm: Kvm,
    fd: VmFd,
    slots: Slots,
    max_slots: usize,
    irqchip: bool,
}

impl Vm {
    /// Opens `/dev/kvm` and creates a VM (no memory, no vCPU yet). Fails with
    /// [`KvmError::Open`] where `/dev/kvm` is missing or not accessible.
    pub fn new() -> Result<Self, KvmError> {
        let kvm = Kvm::new().map_err(KvmError::Open)?;
        let v = kvm.get_api_version();
        if v != 12 {
            return Err(KvmError::ApiVersion(v));
        }
        for (cap, name) in [
            (Cap::UserMemory, "KVM_CAP_USER_MEMORY"),
            (Cap::Ioeventfd, "KVM_CAP_IOEVENTFD"),
            (Cap::ImmediateExit, "KVM_CAP_IMMEDIATE_EXIT"),
        ] {
            if !kvm.check_extension(cap) {
                return Err(KvmError::MissingCap(name));
            }
        }
        let fd = kvm.create_vm().map_err(KvmError::CreateVm)?;
        fd.set_tss_address(TSS_ADDR).map_err(KvmError::TssAddr)?;
        let max_slots = kvm.get_nr_memslots();
        Ok(Vm {
            kvm,
            fd,
            slots: Arc::new(Mutex::new(BTreeMap::new())),
            max_slots,
            irqchip: false,
        })
    }

    /// The raw KVM system fd, for what this layer does not wrap yet.
    pub fn kvm(&self) -> &Kvm {
        &self.kvm
    }

    /// The raw VM fd, for what this layer does not wrap yet.
    pub fn vm_fd(&self) -> &VmFd {
        &self.fd
    }

    /// Creates vCPU `id`. Its state is KVM's reset state; see [`Vcpu::setup_real_mode`].
    pub fn create_vcpu(&self, id: u64) -> Result<Vcpu, KvmError> {
        let fd = self
            .fd
            .create_vcpu(id)
            .map_err(|source| KvmError::CreateVcpu { id, source })?;
        Vcpu::new(fd, self.slots.clone())
    }

    fn lock_slots(&self) -> MutexGuard<'_, BTreeMap<SlotId, Memslot>> {
        // The table is consistent after every statement, so a poisoned lock is fine to use.
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `[gpa, gpa+len)` backed by the host mapping at `host`.
    ///
    /// # Safety
    ///
    /// `[host, host+len)` must be a mapping of this process (or a reservation of address
    /// space, see [`ShmWindow`]) that stays mapped — and that nothing else reuses — until
    /// the slot is removed and every vCPU of this VM is gone: the guest reads and writes it.
    pub unsafe fn add_memslot_raw(
        &self,
        gpa: u64,
        len: u64,
        host: *mut u8,
        readonly: bool,
    ) -> Result<SlotId, KvmError> {
        self.add_memslot(gpa, len, host as u64, readonly, None)
    }

    /// Registers every region of `ram` as a memslot (one per region); the slots keep `ram`
    /// alive. On failure no slot is left behind.
    pub fn add_ram(&self, ram: &Arc<GuestRam>) -> Result<Vec<SlotId>, KvmError> {
        let mut added = Vec::with_capacity(ram.regions().len());
        for r in ram.regions() {
            let backing: Arc<dyn Any + Send + Sync> = ram.clone();
            match self.add_memslot(r.gpa(), r.len(), r.host_addr() as u64, false, Some(backing)) {
                Ok(s) => added.push(s),
                Err(e) => {
                    for s in added {
                        // Best effort: the slot was just added, removing it cannot fail
                        // short of a kernel bug, which the original error outranks.
                        let _ = self.remove_memslot(s);
                    }
                    return Err(e);
                }
            }
        }
        Ok(added)
    }

    /// Registers the shared-memory window at `gpa` (the BAR's address); the slot keeps the
    /// window alive. Pages mapped into or out of the window later (SHMEM_MAP/UNMAP) are
    /// seen by the guest without touching the slot. A guest access to a part of the window
    /// where nothing is mapped (PROT_NONE) makes [`Vcpu::run`] fail (EFAULT).
    pub fn add_shm_window(&self, gpa: u64, window: &Arc<ShmWindow>) -> Result<SlotId, KvmError> {
        let backing: Arc<dyn Any + Send + Sync> = window.clone();
        self.add_memslot(
            gpa,
            window.len(),
            window.base() as u64,
            false,
            Some(backing),
        )
    }

    fn add_memslot(
        &self,
        gpa: u64,
        len: u64,
        host: u64,
        readonly: bool,
        backing: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Result<SlotId, KvmError> {
        let bad = |reason| KvmError::BadRegion {
            gpa,
            len,
            host,
            reason,
        };
        if len == 0 || !len.is_multiple_of(PAGE_SIZE) {
            return Err(bad("length is not a non-zero multiple of the page size"));
        }
        if !gpa.is_multiple_of(PAGE_SIZE) || !host.is_multiple_of(PAGE_SIZE) {
            return Err(bad("address not page aligned"));
        }
        let end = gpa
            .checked_add(len)
            .ok_or(bad("wraps the guest address space"))?;
        host.checked_add(len)
            .ok_or(bad("wraps the host address space"))?;
        let mut slots = self.lock_slots();
        if let Some(s) = slots
            .values()
            .find(|s| gpa < s.info.gpa + s.info.len && s.info.gpa < end)
        {
            return Err(KvmError::Overlap {
                gpa,
                len,
                slot: s.info.slot,
            });
        }
        // The lowest free slot number.
        let mut slot: SlotId = 0;
        for &k in slots.keys() {
            if k != slot {
                break;
            }
            slot += 1;
        }
        if usize::try_from(slot).map_or(true, |s| s >= self.max_slots) {
            return Err(KvmError::NoFreeSlot(self.max_slots));
        }
        let region = kvm_userspace_memory_region {
            slot,
            flags: if readonly { KVM_MEM_READONLY } else { 0 },
            guest_phys_addr: gpa,
            memory_size: len,
            userspace_addr: host,
        };
        // SAFETY: the range was checked for alignment and overlap; that the host range stays
        // mapped while KVM can use it is guaranteed by `backing` (held until the slot is
        // deleted, and by every vCPU through `slots`) or by the caller of `add_memslot_raw`.
        unsafe { self.fd.set_user_memory_region(region) }
            .map_err(|source| KvmError::SetMemslot { slot, source })?;
        debug!("memslot {slot}: GPA [{gpa:#x}+{len:#x}] -> host {host:#x} ro={readonly}");
        let info = MemslotInfo {
            slot,
            gpa,
            len,
            host,
            readonly,
        };
        slots.insert(
            slot,
            Memslot {
                info,
                _backing: backing,
            },
        );
        Ok(slot)
    }

    /// Deletes memslot `slot`. When this returns, no vCPU accesses its memory any more
    /// (KVM waits for them), and its backing is released.
    pub fn remove_memslot(&self, slot: SlotId) -> Result<MemslotInfo, KvmError> {
        let mut slots = self.lock_slots();
        let info = slots.get(&slot).ok_or(KvmError::NoSuchSlot(slot))?.info;
        let region = kvm_userspace_memory_region {
            slot,
            flags: 0,
            guest_phys_addr: info.gpa,
            memory_size: 0,
            userspace_addr: info.host,
        };
        // SAFETY: a size of 0 deletes the slot; no host memory is handed to KVM.
        unsafe { self.fd.set_user_memory_region(region) }
            .map_err(|source| KvmError::SetMemslot { slot, source })?;
        slots.remove(&slot);
        debug!("memslot {slot} removed");
        Ok(info)
    }

    /// Turns KVM's dirty-page logging of memslot `slot` on or off (live migration: what
    /// the vCPUs wrote since the last [`Self::take_dirty`]). Turning it on starts with a
    /// clean log.
    pub fn set_dirty_logging(&self, slot: SlotId, on: bool) -> Result<(), KvmError> {
        let slots = self.lock_slots();
        let info = slots.get(&slot).ok_or(KvmError::NoSuchSlot(slot))?.info;
        let mut flags = if on { KVM_MEM_LOG_DIRTY_PAGES } else { 0 };
        if info.readonly {
            flags |= KVM_MEM_READONLY;
        }
        let region = kvm_userspace_memory_region {
            slot,
            flags,
            guest_phys_addr: info.gpa,
            memory_size: info.len,
            userspace_addr: info.host,
        };
        // SAFETY: the same slot over the same live host range (its backing is held in the
        // table); only the flags change.
        unsafe { self.fd.set_user_memory_region(region) }
            .map_err(|source| KvmError::SetMemslot { slot, source })
    }

    /// The pages of memslot `slot` written since the last call (or since logging was
    /// turned on), as a bitmap of 64 pages per word; reading it clears it.
    pub fn take_dirty(&self, slot: SlotId) -> Result<Vec<u64>, KvmError> {
        let len = self
            .lock_slots()
            .get(&slot)
            .ok_or(KvmError::NoSuchSlot(slot))?
            .info
            .len;
        let size = usize::try_from(len).map_err(|_| KvmError::NoSuchSlot(slot))?;
        self.fd
            .get_dirty_log(slot, size)
            .map_err(|source| KvmError::DirtyLog { slot, source })
    }

    /// The memslots, by slot number.
    pub fn memslots(&self) -> Vec<MemslotInfo> {
        self.lock_slots().values().map(|s| s.info).collect()
    }

    /// Makes guest writes to `addr` signal `fd` in the kernel, without a userspace exit.
    /// `datamatch` is [`NoDatamatch`](super::NoDatamatch) (any write, any length) or a
    /// `u8`/`u16`/`u32`/`u64` value (writes of that size and value only).
    pub fn register_ioevent<T: Into<u64>>(
        &self,
        fd: &EventFd,
        addr: IoEventAddress,
        datamatch: T,
    ) -> Result<(), KvmError> {
        self.fd
            .register_ioevent(fd, &addr, datamatch)
            .map_err(|source| KvmError::IoEvent { addr, source })
    }

    /// Undoes [`register_ioevent`](Self::register_ioevent) (same arguments).
    pub fn unregister_ioevent<T: Into<u64>>(
        &self,
        fd: &EventFd,
        addr: IoEventAddress,
        datamatch: T,
    ) -> Result<(), KvmError> {
        self.fd
            .unregister_ioevent(fd, &addr, datamatch)
            .map_err(|source| KvmError::IoEvent { addr, source })
    }

    /// Creates the in-kernel irqchip (PIC, IOAPIC, per-vCPU LAPIC). Call it before
    /// creating vCPUs. With it, HLT is handled in the kernel (no [`VmExit::Hlt`]).
    ///
    /// [`VmExit::Hlt`]: super::VmExit::Hlt
    pub fn create_irqchip(&mut self) -> Result<(), KvmError> {
        if !self.kvm.check_extension(Cap::Irqchip) {
            return Err(KvmError::MissingCap("KVM_CAP_IRQCHIP"));
        }
        self.fd.create_irq_chip().map_err(KvmError::IrqChip)?;
        self.irqchip = true;
        Ok(())
    }

    /// Whether [`create_irqchip`](Self::create_irqchip) was done.
    pub fn has_irqchip(&self) -> bool {
        self.irqchip
    }

    /// Makes a write to `fd` raise GSI `gsi` (edge) in the kernel.
    pub fn register_irqfd(&self, fd: &EventFd, gsi: u32) -> Result<(), KvmError> {
        if !self.irqchip {
            return Err(KvmError::NoIrqChip);
        }
        self.fd
            .register_irqfd(fd, gsi)
            .map_err(|source| KvmError::Irqfd { gsi, source })
    }

    /// Undoes [`register_irqfd`](Self::register_irqfd).
    pub fn unregister_irqfd(&self, fd: &EventFd, gsi: u32) -> Result<(), KvmError> {
        self.fd
            .unregister_irqfd(fd, gsi)
            .map_err(|source| KvmError::Irqfd { gsi, source })
    }

    /// Fails with [`KvmError::MissingCap`] naming the first of `caps` KVM lacks.
    pub fn require(&self, caps: &[(Cap, &'static str)]) -> Result<(), KvmError> {
        match caps.iter().find(|(c, _)| !self.kvm.check_extension(*c)) {
            Some((_, name)) => Err(KvmError::MissingCap(name)),
            None => Ok(()),
        }
    }

    /// Creates the in-kernel PIT (i8254), with a dummy speaker port.
    pub fn create_pit2(&self) -> Result<(), KvmError> {
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        self.fd.create_pit2(pit).map_err(KvmError::Pit)
    }

    /// Replaces the GSI routing table (irqchip pins and MSI routes).
    pub fn set_gsi_routing(&self, table: &KvmIrqRouting) -> Result<(), KvmError> {
        self.fd.set_gsi_routing(table).map_err(KvmError::GsiRouting)
    }

    /// The CPUID entries KVM supports (the base each vCPU's CPUID is patched from).
    pub fn supported_cpuid(&self) -> Result<CpuId, KvmError> {
        self.kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(KvmError::Cpuid)
    }

    /// Sets the level of interrupt line `irq` of the in-kernel irqchip.
    pub fn set_irq_line(&self, irq: u32, active: bool) -> Result<(), KvmError> {
        if !self.irqchip {
            return Err(KvmError::NoIrqChip);
        }
        self.fd
            .set_irq_line(irq, active)
            .map_err(|source| KvmError::IrqLine { irq, source })
    }
}
