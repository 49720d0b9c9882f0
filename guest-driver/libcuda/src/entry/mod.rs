//! The exported entry points, grouped as `cuda.h` groups them. Each is a thin C shim:
//! check the pointers a program passed, then run the body in `errors::guard`.
//!
//! Pointer arguments follow the CUDA contract (valid for the sizes the call names, or
//! NULL where the API allows it); NULL where a result must go is `CUDA_ERROR_INVALID_VALUE`.
//!
//! The entry points are safe `extern "C"` functions that dereference the pointers a C
//! caller passes: their soundness rests on the C API's contract, which Rust cannot
//! express, so clippy's `not_unsafe_ptr_arg_deref` is allowed here.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

pub mod context;
pub mod device;
pub mod memory;
pub mod module;
pub mod proc;
pub mod stream;
pub mod unsupported;

use crate::errors::CuResult;
use crate::types::CUDA_ERROR_INVALID_VALUE;

/// Stores `v` where the program asked for a result.
pub(crate) fn out<T>(p: *mut T, v: T) -> CuResult {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: a non-NULL result pointer is valid for a write of `T` (the API contract);
    // `write_unaligned` makes no alignment assumption about a C caller's pointer.
    unsafe { p.write_unaligned(v) };
    Ok(())
}

/// A handle value (an id of ours, see `crate::driver::next_id`).
pub(crate) fn id_of(p: *mut std::ffi::c_void) -> u64 {
    p as usize as u64
}

/// The handle a program sees for id `id`.
pub(crate) fn handle(id: u64) -> *mut std::ffi::c_void {
    id as usize as *mut std::ffi::c_void
}

/// A NUL-terminated C string as UTF-8 (names of functions and globals are ASCII).
pub(crate) fn c_str<'a>(p: *const std::ffi::c_char) -> CuResult<&'a str> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: a non-NULL name is a NUL-terminated string that outlives the call (the API
    // contract); the borrow does not escape the entry point.
    let s = unsafe { std::ffi::CStr::from_ptr(p) };
    s.to_str().map_err(|_| CUDA_ERROR_INVALID_VALUE)
}
