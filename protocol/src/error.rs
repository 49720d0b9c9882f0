//! Error codes shared by channel error state, request replies and events.

use thiserror::Error;

/// A protocol error code. `0` is success; every other value names one failure.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Error)]
pub enum ErrorCode {
    #[error("success")]
    Ok = 0,
    #[error("invalid argument")]
    InvalidArgument = 1,
    #[error("no such object")]
    NotFound = 2,
    #[error("out of memory")]
    NoMemory = 3,
    #[error("permission denied")]
    PermissionDenied = 4,
    #[error("limit exceeded")]
    LimitExceeded = 5,
    #[error("busy")]
    Busy = 6,
    #[error("unsupported")]
    Unsupported = 7,
    #[error("GPU MMU fault")]
    MmuFault = 8,
    #[error("malformed push-buffer method")]
    BadMethod = 9,
    #[error("unknown kernel")]
    BadKernel = 10,
    #[error("bad kernel arguments")]
    BadKernelArgs = 11,
    #[error("malformed GP entry")]
    BadGpEntry = 12,
    #[error("killed by the watchdog")]
    WatchdogKilled = 13,
    #[error("channel destroyed")]
    ChannelDestroyed = 14,
    #[error("protocol version mismatch")]
    VersionMismatch = 15,
    #[error("internal error")]
    Internal = 16,
    /// The GPU behind the channel or request is gone (its worker process died or
    /// faulted); the VM's other work is lost with it, other VMs are untouched, and a
    /// device reset gives the VM a new one.
    #[error("GPU lost")]
    DeviceLost = 17,
    /// MODULE_LOAD on a GPU that runs builtin kernels only (`sim`): guest modules run on
    /// the `cuda` GPU with a worker process per VM (`--gpu cuda --gpu-workers`).
    #[error("guest modules need the cuda GPU (--gpu cuda --gpu-workers)")]
    ModulesNeedCudaGpu = 18,
    /// MODULE_LOAD on the `cuda` GPU in the backend's own process, where every VM shares
    /// one CUDA context: a guest's kernel could reach other VMs' memory. Guest modules
    /// need a worker process per VM (`--gpu-workers`).
    #[error("guest modules need a GPU worker per VM (--gpu-workers)")]
    ModulesNeedWorker = 19,
    /// The driver refused the module image (not PTX, cubin or fatbin it can load, or
    /// PTX that does not compile for this GPU).
    #[error("module image refused by the driver")]
    BadModule = 20,
}

impl ErrorCode {
    /// Every code, in numeric order.
    pub const ALL: [ErrorCode; 21] = [
        ErrorCode::Ok,
        ErrorCode::InvalidArgument,
        ErrorCode::NotFound,
        ErrorCode::NoMemory,
        ErrorCode::PermissionDenied,
        ErrorCode::LimitExceeded,
        ErrorCode::Busy,
        ErrorCode::Unsupported,
        ErrorCode::MmuFault,
        ErrorCode::BadMethod,
        ErrorCode::BadKernel,
        ErrorCode::BadKernelArgs,
        ErrorCode::BadGpEntry,
        ErrorCode::WatchdogKilled,
        ErrorCode::ChannelDestroyed,
        ErrorCode::VersionMismatch,
        ErrorCode::Internal,
        ErrorCode::DeviceLost,
        ErrorCode::ModulesNeedCudaGpu,
        ErrorCode::ModulesNeedWorker,
        ErrorCode::BadModule,
    ];

    /// Decodes a code received from a peer; unknown values are an error.
    pub fn from_u32(v: u32) -> Result<Self, UnknownErrorCode> {
        Self::ALL
            .get(v as usize)
            .copied()
            .ok_or(UnknownErrorCode(v))
    }

    pub fn as_u32(self) -> u32 {
        self as u32
    }
}

/// A value that is not a known [`ErrorCode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("unknown error code {0}")]
pub struct UnknownErrorCode(pub u32);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_match_their_index() {
        for (i, c) in ErrorCode::ALL.iter().enumerate() {
            assert_eq!(c.as_u32() as usize, i);
            assert_eq!(ErrorCode::from_u32(c.as_u32()), Ok(*c));
        }
        assert_eq!(ErrorCode::from_u32(21), Err(UnknownErrorCode(21)));
    }
}
