//! The device, versions, errors and synchronisation.

use std::ffi::{c_char, c_int, c_uint};

use super::out;
use crate::errors::{self, check, guard, CudaError, INVALID_DEVICE};
use crate::registry::{ready, reset};

/// The runtime API version this library implements (`cudaRuntimeGetVersion`).
const RUNTIME_VERSION: c_int = 12040;

#[no_mangle]
pub extern "C" fn cudaGetDeviceCount(count: *mut c_int) -> CudaError {
    guard("cudaGetDeviceCount", || {
        let d = ready()?;
        let mut n = 0;
        // SAFETY: a driver entry point with a result pointer.
        check(unsafe { (d.device_count)(&mut n) })?;
        out(count, n)
    })
}

#[no_mangle]
pub extern "C" fn cudaSetDevice(dev: c_int) -> CudaError {
    guard("cudaSetDevice", || {
        if dev != 0 {
            return Err(INVALID_DEVICE);
        }
        ready().map(|_| ())
    })
}

#[no_mangle]
pub extern "C" fn cudaGetDevice(dev: *mut c_int) -> CudaError {
    guard("cudaGetDevice", || out(dev, 0))
}

#[no_mangle]
pub extern "C" fn cudaSetDeviceFlags(_flags: c_uint) -> CudaError {
    // How host threads wait (spin, yield, block): the library's waits are its own.
    guard("cudaSetDeviceFlags", || Ok(()))
}

#[no_mangle]
pub extern "C" fn cudaDeviceGetAttribute(value: *mut c_int, attr: c_int, dev: c_int) -> CudaError {
    guard("cudaDeviceGetAttribute", || {
        if dev != 0 {
            return Err(INVALID_DEVICE);
        }
        let d = ready()?;
        // The runtime's attribute numbers are the driver's.
        // SAFETY: a driver entry point; `value` is the caller's result pointer.
        check(unsafe { (d.device_attribute)(value, attr, dev) })
    })
}

#[no_mangle]
pub extern "C" fn cudaDeviceSynchronize() -> CudaError {
    guard("cudaDeviceSynchronize", || {
        let d = ready()?;
        // SAFETY: a driver entry point without arguments.
        check(unsafe { (d.ctx_synchronize)() })
    })
}

#[no_mangle]
pub extern "C" fn cudaThreadSynchronize() -> CudaError {
    cudaDeviceSynchronize()
}

#[no_mangle]
pub extern "C" fn cudaDeviceReset() -> CudaError {
    guard("cudaDeviceReset", reset)
}

#[no_mangle]
pub extern "C" fn cudaRuntimeGetVersion(v: *mut c_int) -> CudaError {
    guard("cudaRuntimeGetVersion", || out(v, RUNTIME_VERSION))
}

#[no_mangle]
pub extern "C" fn cudaDriverGetVersion(v: *mut c_int) -> CudaError {
    guard("cudaDriverGetVersion", || {
        let d = crate::cu::driver().map_err(|_| errors::INITIALIZATION_ERROR)?;
        let mut n = 0;
        // SAFETY: a driver entry point with a result pointer.
        check(unsafe { (d.driver_version)(&mut n) })?;
        out(v, n)
    })
}

#[no_mangle]
pub extern "C" fn cudaGetLastError() -> CudaError {
    errors::take_last()
}

#[no_mangle]
pub extern "C" fn cudaPeekAtLastError() -> CudaError {
    errors::peek_last()
}

#[no_mangle]
pub extern "C" fn cudaGetErrorName(e: CudaError) -> *const c_char {
    errors::texts(e).0.as_ptr().cast()
}

#[no_mangle]
pub extern "C" fn cudaGetErrorString(e: CudaError) -> *const c_char {
    errors::texts(e).1.as_ptr().cast()
}
