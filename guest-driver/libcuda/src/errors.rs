//! From the runtime's errors to `CUresult`, and the guard every entry point runs in: no
//! panic crosses the C boundary, and each unsupported entry point is logged once.

use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use vgpu_guest::{Error, ErrorCode};

use crate::types::*;

/// What an entry point's body returns: success, or the `CUresult` to hand back.
pub type CuResult<T = ()> = Result<T, CUresult>;

/// The `CUresult` a program sees for a runtime error.
pub fn from_error(e: &Error) -> CUresult {
    match e {
        Error::DeviceLost => CUDA_ERROR_LAUNCH_FAILED,
        Error::Timeout => CUDA_ERROR_LAUNCH_TIMEOUT,
        Error::OutOfVa(_) => CUDA_ERROR_OUT_OF_MEMORY,
        Error::InvalidArgument(_) | Error::OutOfBounds { .. } | Error::WrongChannel => {
            CUDA_ERROR_INVALID_VALUE
        }
        Error::SubmissionTooLarge(_) => CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
        Error::ChannelFault { code, .. } => from_fault(*code),
        Error::Device(code) => from_code(*code),
        _ => CUDA_ERROR_UNKNOWN,
    }
}

/// A channel's fault: what stopped the work, as CUDA names it. All of them are sticky
/// for the context (see `crate::driver::CtxState::sticky`).
pub fn from_fault(code: ErrorCode) -> CUresult {
    match code {
        ErrorCode::MmuFault => CUDA_ERROR_ILLEGAL_ADDRESS,
        ErrorCode::WatchdogKilled => CUDA_ERROR_LAUNCH_TIMEOUT,
        ErrorCode::BadKernelArgs | ErrorCode::BadKernel | ErrorCode::Unsupported => {
            CUDA_ERROR_LAUNCH_FAILED
        }
        _ => CUDA_ERROR_LAUNCH_FAILED,
    }
}

/// A request's error code.
pub fn from_code(code: ErrorCode) -> CUresult {
    match code {
        ErrorCode::Ok => CUDA_SUCCESS,
        ErrorCode::InvalidArgument | ErrorCode::BadMethod | ErrorCode::BadGpEntry => {
            CUDA_ERROR_INVALID_VALUE
        }
        ErrorCode::NotFound => CUDA_ERROR_NOT_FOUND,
        ErrorCode::NoMemory | ErrorCode::LimitExceeded => CUDA_ERROR_OUT_OF_MEMORY,
        ErrorCode::PermissionDenied => CUDA_ERROR_NOT_PERMITTED,
        ErrorCode::Busy => CUDA_ERROR_NOT_READY,
        ErrorCode::Unsupported | ErrorCode::ModulesNeedCudaGpu | ErrorCode::ModulesNeedWorker => {
            CUDA_ERROR_NOT_SUPPORTED
        }
        ErrorCode::BadModule => CUDA_ERROR_INVALID_IMAGE,
        ErrorCode::MmuFault => CUDA_ERROR_ILLEGAL_ADDRESS,
        ErrorCode::DeviceLost | ErrorCode::ChannelDestroyed => CUDA_ERROR_LAUNCH_FAILED,
        _ => CUDA_ERROR_UNKNOWN,
    }
}

/// Whether a code ends the context for good, as a fault does on a real GPU.
pub fn is_sticky(code: CUresult) -> bool {
    matches!(
        code,
        CUDA_ERROR_ILLEGAL_ADDRESS | CUDA_ERROR_LAUNCH_FAILED | CUDA_ERROR_LAUNCH_TIMEOUT
    )
}

/// Runs an entry point's body: its result as a `CUresult`, `CUDA_ERROR_UNKNOWN` (logged)
/// if it panicked.
pub fn guard(name: &str, body: impl FnOnce() -> CuResult) -> CUresult {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(code)) => {
            log::debug!("{name}: {code}");
            code
        }
        Err(_) => {
            log::error!("{name}: internal error (panic); returning CUDA_ERROR_UNKNOWN");
            CUDA_ERROR_UNKNOWN
        }
    }
}

/// What an entry point this library does not cover returns; its name is logged once.
pub fn unsupported(name: &str) -> CUresult {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    crate::driver::init_logging();
    let first = SEEN
        .lock()
        .map(|mut s| s.get_or_insert_with(HashSet::new).insert(name.to_owned()))
        .unwrap_or(false);
    if first {
        log::warn!("{name} is not supported by the vgpu guest libcuda: CUDA_ERROR_NOT_SUPPORTED");
    }
    CUDA_ERROR_NOT_SUPPORTED
}

/// `cuGetErrorName`/`cuGetErrorString`'s text for `code`, if it is one of ours.
pub fn texts(code: CUresult) -> Option<(&'static str, &'static str)> {
    ERROR_TEXTS
        .iter()
        .find(|(c, _, _)| *c == code)
        .map(|&(_, n, s)| (n, s))
}
