//! The exported entry points. Pointer arguments follow the CUDA runtime's contract; the
//! entry points are safe `extern "C"` functions that dereference what a C caller passes,
//! so clippy's `not_unsafe_ptr_arg_deref` is allowed here (Rust cannot express the C
//! contract).
#![allow(clippy::not_unsafe_ptr_arg_deref)]
#![allow(non_snake_case)]

pub mod device;
pub mod launch;
pub mod memory;
pub mod properties;
pub mod register;
pub mod stream;
pub mod unsupported;

use crate::errors::{CudaResult, INVALID_VALUE};

/// Stores `v` where the program asked for a result.
pub(crate) fn out<T>(p: *mut T, v: T) -> CudaResult {
    if p.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: a non-NULL result pointer is valid for a write of `T` (the API contract).
    unsafe { p.write_unaligned(v) };
    Ok(())
}

/// `dim3`, passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Dim3 {
    pub x: u32,
    pub y: u32,
    pub z: u32,
}
