//! `cudaError_t`: the codes, their names and texts, each thread's last error, and the
//! guard every entry point runs in (no panic crosses the C boundary).

use std::cell::Cell;
use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

/// `cudaError_t`. The runtime's numbers equal the driver's for every code this library
/// returns (CUDA ≥ 10 keeps them aligned), so a driver result passes through as it is.
pub type CudaError = u32;

pub const SUCCESS: CudaError = 0;
pub const INVALID_VALUE: CudaError = 1;
pub const MEMORY_ALLOCATION: CudaError = 2;
pub const INITIALIZATION_ERROR: CudaError = 3;
pub const INVALID_DEVICE_FUNCTION: CudaError = 98;
pub const NO_DEVICE: CudaError = 100;
pub const INVALID_DEVICE: CudaError = 101;
pub const INVALID_SYMBOL: CudaError = 13;
pub const NOT_SUPPORTED: CudaError = 801;
pub const UNKNOWN: CudaError = 999;

/// Names and texts of the codes (NUL-terminated: handed out as C strings).
const TEXTS: &[(CudaError, &str, &str)] = &[
    (SUCCESS, "cudaSuccess\0", "no error\0"),
    (
        INVALID_VALUE,
        "cudaErrorInvalidValue\0",
        "invalid argument\0",
    ),
    (
        MEMORY_ALLOCATION,
        "cudaErrorMemoryAllocation\0",
        "out of memory\0",
    ),
    (
        INITIALIZATION_ERROR,
        "cudaErrorInitializationError\0",
        "initialization error\0",
    ),
    (
        INVALID_SYMBOL,
        "cudaErrorInvalidSymbol\0",
        "invalid device symbol\0",
    ),
    (
        INVALID_DEVICE_FUNCTION,
        "cudaErrorInvalidDeviceFunction\0",
        "invalid device function\0",
    ),
    (
        NO_DEVICE,
        "cudaErrorNoDevice\0",
        "no CUDA-capable device is detected\0",
    ),
    (
        INVALID_DEVICE,
        "cudaErrorInvalidDevice\0",
        "invalid device ordinal\0",
    ),
    (
        200,
        "cudaErrorInvalidKernelImage\0",
        "device kernel image is invalid\0",
    ),
    (
        201,
        "cudaErrorDeviceUninitialized\0",
        "invalid device context\0",
    ),
    (
        209,
        "cudaErrorNoKernelImageForDevice\0",
        "no kernel image is available for execution on the device\0",
    ),
    (
        218,
        "cudaErrorInvalidPtx\0",
        "a PTX JIT compilation failed\0",
    ),
    (
        400,
        "cudaErrorInvalidResourceHandle\0",
        "invalid resource handle\0",
    ),
    (500, "cudaErrorSymbolNotFound\0", "named symbol not found\0"),
    (600, "cudaErrorNotReady\0", "device not ready\0"),
    (
        700,
        "cudaErrorIllegalAddress\0",
        "an illegal memory access was encountered\0",
    ),
    (
        701,
        "cudaErrorLaunchOutOfResources\0",
        "too many resources requested for launch\0",
    ),
    (
        702,
        "cudaErrorLaunchTimeout\0",
        "the launch timed out and was terminated\0",
    ),
    (
        709,
        "cudaErrorContextIsDestroyed\0",
        "context is destroyed\0",
    ),
    (
        719,
        "cudaErrorLaunchFailure\0",
        "unspecified launch failure\0",
    ),
    (800, "cudaErrorNotPermitted\0", "operation not permitted\0"),
    (
        NOT_SUPPORTED,
        "cudaErrorNotSupported\0",
        "operation not supported\0",
    ),
    (UNKNOWN, "cudaErrorUnknown\0", "unknown error\0"),
];

/// The name and text of `code` (`cudaErrorUnknown`'s for a code not listed).
pub fn texts(code: CudaError) -> (&'static str, &'static str) {
    TEXTS
        .iter()
        .find(|(c, _, _)| *c == code)
        .or_else(|| TEXTS.iter().find(|(c, _, _)| *c == UNKNOWN))
        .map_or(("cudaErrorUnknown\0", "unknown error\0"), |&(_, n, t)| {
            (n, t)
        })
}

thread_local! {
    static LAST: Cell<CudaError> = const { Cell::new(SUCCESS) };
}

/// `cudaGetLastError`: the thread's last error, reset.
pub fn take_last() -> CudaError {
    LAST.with(|l| l.replace(SUCCESS))
}

/// `cudaPeekAtLastError`.
pub fn peek_last() -> CudaError {
    LAST.with(Cell::get)
}

/// What an entry point's body returns.
pub type CudaResult<T = ()> = Result<T, CudaError>;

/// A driver call's result as the runtime's.
pub fn check(r: u32) -> CudaResult {
    match r {
        0 => Ok(()),
        e => Err(e),
    }
}

/// Runs an entry point's body; an error becomes the thread's last error too.
pub fn guard(name: &str, body: impl FnOnce() -> CudaResult) -> CudaError {
    crate::init_logging();
    let code = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(c)) => {
            log::debug!("{name}: {c}");
            c
        }
        Err(_) => {
            log::error!("{name}: internal error (panic)");
            UNKNOWN
        }
    };
    if code != SUCCESS {
        LAST.with(|l| l.set(code));
    }
    code
}

/// What an entry point the library does not cover returns; its name is logged once.
pub fn unsupported(name: &str) -> CudaError {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    crate::init_logging();
    let first = SEEN
        .lock()
        .map(|mut s| s.get_or_insert_with(HashSet::new).insert(name.to_owned()))
        .unwrap_or(false);
    if first {
        log::warn!("{name} is not supported by the vgpu guest libcudart: cudaErrorNotSupported");
    }
    LAST.with(|l| l.set(NOT_SUPPORTED));
    NOT_SUPPORTED
}
