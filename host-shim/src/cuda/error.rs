//! Errors of the `cuda` GPU.

use thiserror::Error;

/// A driver, compiler or device failure.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DeviceError {
    #[error("the CUDA driver library (libcuda.so.1) cannot be loaded")]
    NoDriver,
    #[error("NVRTC (libnvrtc.so) cannot be loaded")]
    NoNvrtc,
    #[error("no CUDA GPU with index {0} (found {1})")]
    NoDevice(u32, u32),
    #[error("{call}: {code}")]
    Driver { call: &'static str, code: String },
    #[error("compiling the builtin kernels: {0}")]
    Compile(String),
    #[error("fake device: {0}")]
    Fake(&'static str),
    /// Something this device does not do (the fake's launch of an entry it does not
    /// implement); the channel faults with `Unsupported`.
    #[error("not supported: {0}")]
    Unsupported(&'static str),
}

/// Driver results after which the context is unusable for good ("sticky" errors: every
/// later call in the process fails the same way).
const CONTEXT_LOST: &[&str] = &[
    "ILLEGAL_ADDRESS",
    "LAUNCH_FAILED",
    "HARDWARE_STACK_ERROR",
    "ILLEGAL_INSTRUCTION",
    "MISALIGNED_ADDRESS",
    "INVALID_ADDRESS_SPACE",
    "INVALID_PC",
    "ECC_UNCORRECTABLE",
    "CONTEXT_IS_DESTROYED",
    "ASSERT",
];

impl DeviceError {
    /// Whether the failure left the CUDA context unusable (a kernel faulted the GPU, an
    /// uncorrectable memory error): only a new process gets a working context again.
    pub fn is_context_lost(&self) -> bool {
        matches!(self, DeviceError::Driver { code, .. }
            if CONTEXT_LOST.iter().any(|k| code.contains(k)))
    }

    /// The code a channel faults with when its stream failed so: `DeviceLost` when the
    /// context is gone for good (a kernel faulted the GPU: in a worker, a guest module's
    /// wild pointer; the process exits and the VM's GPU with it), else `Internal`.
    pub fn fault_code(&self) -> vgpu_protocol::ErrorCode {
        if self.is_context_lost() {
            vgpu_protocol::ErrorCode::DeviceLost
        } else {
            vgpu_protocol::ErrorCode::Internal
        }
    }

    /// The code a channel faults with when issuing its work failed so: the driver
    /// refusing a launch is the guest's bad argument.
    pub fn issue_code(&self) -> vgpu_protocol::ErrorCode {
        match self {
            DeviceError::Unsupported(_) => vgpu_protocol::ErrorCode::Unsupported,
            _ => vgpu_protocol::ErrorCode::BadKernelArgs,
        }
    }

    /// Whether the failure only says that there is no usable GPU here (tests skip then).
    pub fn is_absent(&self) -> bool {
        matches!(
            self,
            DeviceError::NoDriver | DeviceError::NoNvrtc | DeviceError::NoDevice(..)
        ) || matches!(self, DeviceError::Driver { code, .. } if code.contains("NO_DEVICE"))
    }
}
