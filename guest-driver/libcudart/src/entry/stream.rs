//! Streams and events: the driver's, handle for handle (`cudaStream_t` is `CUstream`,
//! `cudaEvent_t` is `CUevent`).

use std::ffi::c_uint;

use crate::cu::Ptr;
use crate::errors::{check, guard, CudaError};
use crate::registry::ready;

#[no_mangle]
pub extern "C" fn cudaStreamCreate(s: *mut Ptr) -> CudaError {
    cudaStreamCreateWithFlags(s, 0)
}

#[no_mangle]
pub extern "C" fn cudaStreamCreateWithFlags(s: *mut Ptr, flags: c_uint) -> CudaError {
    guard("cudaStreamCreate", || {
        let d = ready()?;
        // SAFETY: a driver entry point; `s` is the caller's result pointer.
        check(unsafe { (d.stream_create)(s, flags) })
    })
}

#[no_mangle]
pub extern "C" fn cudaStreamCreateWithPriority(s: *mut Ptr, flags: c_uint, _p: i32) -> CudaError {
    cudaStreamCreateWithFlags(s, flags)
}

macro_rules! pass {
    ($name:ident, $field:ident, $($arg:ident: $ty:ty),*) => {
        #[no_mangle]
        pub extern "C" fn $name($($arg: $ty),*) -> CudaError {
            guard(stringify!($name), || {
                let d = ready()?;
                // SAFETY: the driver entry point of the same meaning, given the
                // program's arguments (the driver checks its handles).
                check(unsafe { (d.$field)($($arg),*) })
            })
        }
    };
}

pass!(cudaStreamDestroy, stream_destroy, s: Ptr);
pass!(cudaStreamSynchronize, stream_synchronize, s: Ptr);
pass!(cudaStreamQuery, stream_query, s: Ptr);
pass!(cudaStreamWaitEvent, stream_wait_event, s: Ptr, e: Ptr, flags: c_uint);
pass!(cudaEventCreateWithFlags, event_create, e: *mut Ptr, flags: c_uint);
pass!(cudaEventDestroy, event_destroy, e: Ptr);
pass!(cudaEventRecord, event_record, e: Ptr, s: Ptr);
pass!(cudaEventSynchronize, event_synchronize, e: Ptr);
pass!(cudaEventQuery, event_query, e: Ptr);
pass!(cudaEventElapsedTime, event_elapsed, ms: *mut f32, start: Ptr, end: Ptr);

#[no_mangle]
pub extern "C" fn cudaEventCreate(e: *mut Ptr) -> CudaError {
    cudaEventCreateWithFlags(e, 0)
}
