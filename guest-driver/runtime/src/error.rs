//! The runtime's error type: transport failures, caller mistakes and channel faults.

use thiserror::Error;
use vgpu_protocol::gp::GpEntryError;
use vgpu_protocol::ErrorCode;

/// Everything the runtime can report.
#[derive(Debug, Error)]
pub enum Error {
    /// The native transport's GPU refused a request.
    #[cfg(feature = "native")]
    #[error("GPU: {0}")]
    Hal(#[from] vgpu_host_shim::hal::HalError),
    /// A transport request was answered with a protocol error code.
    #[error("device request failed: {0}")]
    Device(ErrorCode),
    /// An OS call made by the runtime failed.
    #[error("{what}: {source}")]
    Os {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A handle the transport does not know (a runtime bug or a transport mix-up).
    #[error("transport does not know {0}")]
    UnknownHandle(&'static str),
    /// The caller passed something unusable.
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// A CPU access outside a buffer.
    #[error("access {offset:#x}+{len:#x} is outside a buffer of {size:#x} bytes")]
    OutOfBounds { offset: u64, len: u64, size: u64 },
    /// The context's GPU virtual address space is exhausted.
    #[error("out of GPU virtual address space ({0} bytes asked)")]
    OutOfVa(u64),
    /// The pending push buffer or the argument arena cannot hold a single submission.
    #[error("submission too large: {0}")]
    SubmissionTooLarge(&'static str),
    /// A GP entry the runtime was asked to build is malformed.
    #[error("GP entry: {0}")]
    GpEntry(#[from] GpEntryError),
    /// The channel stopped on an error (read from the control page's ERROR field).
    #[error("channel fault: {code} (info {info:#x})")]
    ChannelFault { code: ErrorCode, info: u64 },
    /// The device was reset under this process (its backend died, hung or restarted):
    /// every resource the process had is gone; a new device handle works again.
    #[error("the device was reset; this process's GPU resources are gone")]
    DeviceLost,
    /// A wait ran past its deadline.
    #[error("timed out waiting for the GPU")]
    Timeout,
    /// A fence was handed to a channel that did not issue it.
    #[error("fence belongs to another channel")]
    WrongChannel,
    /// A workload's GPU result differs from its CPU reference.
    #[error("{workload}: result mismatch: {detail}")]
    Mismatch {
        workload: &'static str,
        detail: String,
    },
}

impl Error {
    /// The protocol error code closest to this error (what a guest tool would print or a
    /// driver would return).
    pub fn code(&self) -> ErrorCode {
        match self {
            #[cfg(feature = "native")]
            Error::Hal(e) => e.code(),
            Error::Device(c) => *c,
            Error::ChannelFault { code, .. } => *code,
            Error::Os { .. } | Error::UnknownHandle(_) | Error::Mismatch { .. } => {
                ErrorCode::Internal
            }
            Error::InvalidArgument(_) | Error::OutOfBounds { .. } | Error::WrongChannel => {
                ErrorCode::InvalidArgument
            }
            Error::GpEntry(_) => ErrorCode::BadGpEntry,
            Error::OutOfVa(_) => ErrorCode::NoMemory,
            Error::SubmissionTooLarge(_) => ErrorCode::LimitExceeded,
            Error::Timeout => ErrorCode::Busy,
            Error::DeviceLost => ErrorCode::ChannelDestroyed,
        }
    }

    pub(crate) fn os(what: &'static str) -> Self {
        Error::Os {
            what,
            source: std::io::Error::last_os_error(),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
