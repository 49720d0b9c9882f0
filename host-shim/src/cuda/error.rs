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
}

impl DeviceError {
    /// Whether the failure only says that there is no usable GPU here (tests skip then).
    pub fn is_absent(&self) -> bool {
        matches!(
            self,
            DeviceError::NoDriver | DeviceError::NoNvrtc | DeviceError::NoDevice(..)
        ) || matches!(self, DeviceError::Driver { code, .. } if code.contains("NO_DEVICE"))
    }
}
