//! Error types of the backend.

use std::io;
use std::path::PathBuf;

use thiserror::Error;
use vgpu_host_shim::HalError;
use vgpu_protocol::ErrorCode;

/// Errors of [`crate::VgpuBackend`]'s own API (not of guest requests: those become
/// error replies and never leave the session).
#[derive(Debug, Error)]
pub enum BackendError {
    #[error("a VM named {0:?} is already served")]
    DuplicateVm(String),
    #[error("invalid VM name {0:?}")]
    InvalidName(String),
    #[error("socket {path}: {source}")]
    Socket {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} exists and is not a socket")]
    NotASocket { path: PathBuf },
    #[error("vhost-user: {0}")]
    // The crate's error implements Display but not `std::error::Error`: kept as it is.
    VhostUser(vhost_user_backend::Error),
    #[error("event notifier: {0}")]
    EventFd(#[source] io::Error),
    #[error("cannot start a thread: {0}")]
    Thread(#[source] io::Error),
    #[error("GPU: {0}")]
    Gpu(#[from] HalError),
    #[error("the backend is shutting down")]
    ShuttingDown,
    #[error("the GPU cannot keep this VM's reserve: {0}")]
    Capacity(#[from] crate::capacity::CapacityError),
}

/// Failure of a SHMEM_MAP / SHMEM_UNMAP request to the frontend.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ShmError {
    /// The frontend never sent SET_BACKEND_REQ_FD (or did not negotiate SHMEM).
    #[error("no backend request channel to the frontend (SET_BACKEND_REQ_FD/SHMEM missing)")]
    NoChannel,
    /// The frontend answered with an error, or the channel broke.
    #[error("frontend: {0}")]
    Frontend(String),
}

impl ShmError {
    /// The protocol error code a guest sees for this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            ShmError::NoChannel => ErrorCode::Unsupported,
            ShmError::Frontend(_) => ErrorCode::Internal,
        }
    }
}
