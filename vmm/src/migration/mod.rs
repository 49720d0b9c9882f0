//! Live migration of a KVM VM between two `vgpu-vmm`s (the booting VMM, [`crate::boot`]).
//!
//! - [`wire`]: the stream between them (unix socket or TCP) and its messages;
//! - [`codec`]: bounds-checked little-endian records;
//! - [`cpu`]: a vCPU's state (registers, XSAVE, MSRs, LAPIC, events, MP state);
//! - [`machine`]: the in-kernel PICs, IOAPIC, PIT and clock;
//! - [`records`]: what else travels — the machine's shape, the vgpu rings and transport,
//!   the serial port.
//!
//! The orchestration lives beside the VM it moves: `boot::send` (source) and
//! `boot::receive` (destination); the order of steps and why is documented there and in
//! `docs/architecture/migration.md` ("A KVM VM between two `vgpu-vmm`s").

pub mod codec;
pub mod cpu;
pub mod machine;
pub mod records;
pub mod wire;

use std::io;
use std::time::Duration;

use thiserror::Error;

use crate::frontend::FrontendError;
use crate::kvm::KvmError;

pub use wire::Address;

/// Errors of a migration, on either side.
#[derive(Debug, Error)]
pub enum MigrationError {
    #[error("{0}: {1}")]
    Io(&'static str, #[source] io::Error),
    #[error("{0} failed: {1}")]
    Kvm(&'static str, #[source] kvm_ioctls::Error),
    #[error("KVM: {0}")]
    KvmLayer(#[source] KvmError),
    #[error("{0}: truncated")]
    Truncated(&'static str),
    #[error("{0}: {1}")]
    Invalid(&'static str, &'static str),
    #[error("migration stream version {0} (this vgpu-vmm reads {v})", v = wire::VERSION)]
    Version(u32),
    #[error("unknown message {0}")]
    UnknownMessage(u8),
    #[error("{0} where {1} was expected")]
    OutOfOrder(&'static str, &'static str),
    #[error("bad migration address {0:?} (unix:PATH or tcp:HOST:PORT)")]
    Address(String),
    #[error("the destination refused the {step}: {why}")]
    Refused { step: &'static str, why: String },
    #[error("KVM read {got} of {want} MSRs")]
    Msrs { got: usize, want: usize },
    #[error("KVM refused to set MSR {0:#x}")]
    MsrRefused(u32),
    #[error("this host's XSAVE area is larger than the state format holds")]
    XsaveTooLarge,
    #[error("vCPU {cpu}: saving its state: {why}")]
    VcpuSave { cpu: u8, why: String },
    #[error("the vCPUs did not stop within {0:?}")]
    PauseTimeout(Duration),
    #[error("the VM is not running")]
    NotRunning,
    #[error("a migration is already under way")]
    Busy,
    #[error("vgpu device: {0}")]
    Frontend(#[from] FrontendError),
    #[error("vgpu device: {0}")]
    Device(String),
    #[error("the machines differ: {0}")]
    Mismatch(String),
}
