//! A small KVM layer: the first brick of the KVM VMM.
//!
//! - [`Vm`]: a KVM VM with memory slots (memslots) over host mappings — guest RAM
//!   ([`GuestRam`](crate::guest_memory::GuestRam)), the device's shared-memory window
//!   ([`ShmWindow`](crate::shm_window::ShmWindow)) or any caller-owned mapping —, ioeventfds,
//!   and an optional in-kernel irqchip with irqfds.
//! - [`Vcpu`]: one vCPU, set up in real mode for tiny guests, whose [`Vcpu::run`] returns
//!   the exits a device model handles ([`VmExit`]); [`Vcpu::run_bounded`] runs a handler loop
//!   under an exit cap; a [`VcpuKicker`] makes a running vCPU return to userspace from any
//!   thread (a watchdog, a stop request).
//!
//! A memslot over the shared-memory window needs no care on a remap: SHMEM_MAP replaces
//! pages of the window with `mmap(MAP_FIXED)`, KVM's MMU notifier drops the stale
//! translation, and the guest's next access faults the new page in. Only the window's
//! address range is registered, never the pages.

mod vcpu;
mod vm;

use std::io;

use thiserror::Error;

pub use kvm_ioctls::{Cap, IoEventAddress, NoDatamatch};
pub use vcpu::{Vcpu, VcpuKicker, VmExit};
pub use vm::{MemslotInfo, SlotId, Vm};

/// Errors of the KVM layer. `kvm_ioctls::Error` is an errno.
#[derive(Debug, Error)]
pub enum KvmError {
    #[error("cannot open /dev/kvm: {0}")]
    Open(kvm_ioctls::Error),
    #[error("unsupported KVM API version {0} (expected 12)")]
    ApiVersion(i32),
    #[error("KVM lacks a required capability: {0}")]
    MissingCap(&'static str),
    #[error("KVM_CREATE_VM failed: {0}")]
    CreateVm(kvm_ioctls::Error),
    #[error("KVM_SET_TSS_ADDR failed: {0}")]
    TssAddr(kvm_ioctls::Error),
    #[error("KVM_CREATE_VCPU {id} failed: {source}")]
    CreateVcpu { id: u64, source: kvm_ioctls::Error },
    #[error("bad memslot [{gpa:#x}+{len:#x}] at host {host:#x}: {reason}")]
    BadRegion {
        gpa: u64,
        len: u64,
        host: u64,
        reason: &'static str,
    },
    #[error("memslot [{gpa:#x}+{len:#x}] overlaps slot {slot}")]
    Overlap { gpa: u64, len: u64, slot: SlotId },
    #[error("no free memslot (KVM allows {0})")]
    NoFreeSlot(usize),
    #[error("no memslot {0}")]
    NoSuchSlot(SlotId),
    #[error("KVM_SET_USER_MEMORY_REGION slot {slot} failed: {source}")]
    SetMemslot {
        slot: SlotId,
        source: kvm_ioctls::Error,
    },
    #[error("KVM_GET_DIRTY_LOG of slot {slot} failed: {source}")]
    DirtyLog {
        slot: SlotId,
        source: kvm_ioctls::Error,
    },
    #[error("KVM_IOEVENTFD on {addr:?} failed: {source}")]
    IoEvent {
        addr: IoEventAddress,
        source: kvm_ioctls::Error,
    },
    #[error("creating the in-kernel irqchip failed: {0}")]
    IrqChip(kvm_ioctls::Error),
    #[error("the VM has no in-kernel irqchip")]
    NoIrqChip,
    #[error("KVM_IRQFD on GSI {gsi} failed: {source}")]
    Irqfd { gsi: u32, source: kvm_ioctls::Error },
    #[error("KVM_IRQ_LINE {irq} failed: {source}")]
    IrqLine { irq: u32, source: kvm_ioctls::Error },
    #[error("KVM_CREATE_PIT2 failed: {0}")]
    Pit(kvm_ioctls::Error),
    #[error("KVM_SET_GSI_ROUTING failed: {0}")]
    GsiRouting(kvm_ioctls::Error),
    #[error("KVM_GET_SUPPORTED_CPUID failed: {0}")]
    Cpuid(kvm_ioctls::Error),
    #[error("vCPU register access failed: {0}")]
    Regs(kvm_ioctls::Error),
    #[error("installing the vCPU kick signal handler failed: {0}")]
    Signal(kvm_ioctls::Error),
    #[error("KVM_RUN failed: {0}")]
    Run(kvm_ioctls::Error),
    #[error("KVM_EXIT_FAIL_ENTRY: hardware reason {reason:#x} on cpu {cpu}")]
    FailEntry { reason: u64, cpu: u32 },
    #[error("guest memory fault at GPA {gpa:#x}+{size:#x} (flags {flags:#x})")]
    MemoryFault { gpa: u64, size: u64, flags: u64 },
    #[error("unhandled vCPU exit: {0}")]
    UnhandledExit(String),
    #[error("vCPU stopped after {0} exits without finishing")]
    ExitCap(u64),
    #[error("vCPU run loop interrupted (kicked)")]
    Interrupted,
    #[error("{0}")]
    Device(io::Error),
}
