//! Memory: device and pinned host allocations, copies (with the kind inferred for
//! `cudaMemcpyDefault`), sets, and module variables by their host shadows.

use std::ffi::{c_int, c_uint, c_void};

use super::out;
use crate::cu::{Driver, Ptr};
use crate::errors::{check, guard, CudaError, CudaResult, INVALID_SYMBOL, INVALID_VALUE};
use crate::registry::{ready, symbol};

const HOST_TO_HOST: c_int = 0;
const HOST_TO_DEVICE: c_int = 1;
const DEVICE_TO_HOST: c_int = 2;
const DEVICE_TO_DEVICE: c_int = 3;
const DEFAULT: c_int = 4;

#[no_mangle]
pub extern "C" fn cudaMalloc(p: *mut *mut c_void, bytes: usize) -> CudaError {
    guard("cudaMalloc", || {
        let d = ready()?;
        let mut dptr = 0u64;
        // SAFETY: a driver entry point with a result pointer.
        check(unsafe { (d.mem_alloc)(&mut dptr, bytes) })?;
        out(p, dptr as usize as *mut c_void)
    })
}

#[no_mangle]
pub extern "C" fn cudaFree(p: *mut c_void) -> CudaError {
    guard("cudaFree", || {
        let d = ready()?;
        if p.is_null() {
            return Ok(());
        }
        // SAFETY: a driver entry point; the driver checks the pointer.
        check(unsafe { (d.mem_free)(p as u64) })
    })
}

#[no_mangle]
pub extern "C" fn cudaMallocHost(p: *mut *mut c_void, bytes: usize) -> CudaError {
    guard("cudaMallocHost", || {
        let d = ready()?;
        // SAFETY: a driver entry point; `p` is the caller's result pointer.
        check(unsafe { (d.mem_alloc_host)(p, bytes) })
    })
}

#[no_mangle]
pub extern "C" fn cudaHostAlloc(p: *mut *mut c_void, bytes: usize, _flags: c_uint) -> CudaError {
    cudaMallocHost(p, bytes)
}

#[no_mangle]
pub extern "C" fn cudaFreeHost(p: *mut c_void) -> CudaError {
    guard("cudaFreeHost", || {
        let d = ready()?;
        // SAFETY: a driver entry point; the driver checks the pointer.
        check(unsafe { (d.mem_free_host)(p) })
    })
}

#[no_mangle]
pub extern "C" fn cudaMemGetInfo(free: *mut usize, total: *mut usize) -> CudaError {
    guard("cudaMemGetInfo", || {
        let d = ready()?;
        // SAFETY: a driver entry point with the caller's result pointers.
        check(unsafe { (d.mem_get_info)(free, total) })
    })
}

/// Whether `p` is device memory (for `cudaMemcpyDefault`).
fn is_device(d: &Driver, p: *const c_void) -> bool {
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: a driver entry point with result pointers; an unknown address is an error.
    unsafe { (d.address_range)(&mut base, &mut size, p as u64) == 0 }
}

/// A copy of `n` bytes; `stream` for the async forms.
fn copy(
    dst: *mut c_void,
    src: *const c_void,
    n: usize,
    kind: c_int,
    stream: Option<Ptr>,
) -> CudaResult {
    let d = ready()?;
    if n == 0 {
        return Ok(());
    }
    let kind = match kind {
        DEFAULT => match (is_device(d, dst), is_device(d, src)) {
            (true, true) => DEVICE_TO_DEVICE,
            (true, false) => HOST_TO_DEVICE,
            (false, true) => DEVICE_TO_HOST,
            (false, false) => HOST_TO_HOST,
        },
        k => k,
    };
    // SAFETY: every arm calls a driver entry point (or copies host memory) with the
    // program's pointers, which the runtime's contract makes valid for `n` bytes; the
    // driver checks device ranges.
    let r = unsafe {
        match (kind, stream) {
            (HOST_TO_HOST, _) => {
                if dst.is_null() || src.is_null() {
                    return Err(INVALID_VALUE);
                }
                std::ptr::copy(src.cast::<u8>(), dst.cast::<u8>(), n);
                0
            }
            (HOST_TO_DEVICE, None) => (d.htod)(dst as u64, src, n),
            (HOST_TO_DEVICE, Some(s)) => (d.htod_async)(dst as u64, src, n, s),
            (DEVICE_TO_HOST, None) => (d.dtoh)(dst, src as u64, n),
            (DEVICE_TO_HOST, Some(s)) => (d.dtoh_async)(dst, src as u64, n, s),
            (DEVICE_TO_DEVICE, None) => (d.dtod)(dst as u64, src as u64, n),
            (DEVICE_TO_DEVICE, Some(s)) => (d.dtod_async)(dst as u64, src as u64, n, s),
            _ => return Err(INVALID_VALUE),
        }
    };
    check(r)
}

#[no_mangle]
pub extern "C" fn cudaMemcpy(
    dst: *mut c_void,
    src: *const c_void,
    n: usize,
    kind: c_int,
) -> CudaError {
    guard("cudaMemcpy", || copy(dst, src, n, kind, None))
}

#[no_mangle]
pub extern "C" fn cudaMemcpyAsync(
    dst: *mut c_void,
    src: *const c_void,
    n: usize,
    kind: c_int,
    stream: Ptr,
) -> CudaError {
    guard("cudaMemcpyAsync", || copy(dst, src, n, kind, Some(stream)))
}

#[no_mangle]
pub extern "C" fn cudaMemset(p: *mut c_void, value: c_int, n: usize) -> CudaError {
    guard("cudaMemset", || {
        let d = ready()?;
        // SAFETY: a driver entry point; the driver checks the range.
        check(unsafe { (d.memset_d8)(p as u64, value as u8, n) })
    })
}

#[no_mangle]
pub extern "C" fn cudaMemsetAsync(p: *mut c_void, value: c_int, n: usize, s: Ptr) -> CudaError {
    guard("cudaMemsetAsync", || {
        let d = ready()?;
        // SAFETY: a driver entry point; the driver checks the range.
        check(unsafe { (d.memset_d8_async)(p as u64, value as u8, n, s) })
    })
}

#[no_mangle]
pub extern "C" fn cudaGetSymbolAddress(p: *mut *mut c_void, sym: *const c_void) -> CudaError {
    guard("cudaGetSymbolAddress", || {
        let (addr, _) = symbol(sym as usize)?;
        out(p, addr as usize as *mut c_void)
    })
}

#[no_mangle]
pub extern "C" fn cudaGetSymbolSize(size: *mut usize, sym: *const c_void) -> CudaError {
    guard("cudaGetSymbolSize", || {
        let (_, n) = symbol(sym as usize)?;
        out(size, n)
    })
}

/// A module variable's address `offset` bytes in, with `n` bytes inside it.
fn symbol_at(sym: *const c_void, n: usize, offset: usize) -> CudaResult<u64> {
    let (addr, size) = symbol(sym as usize)?;
    match offset.checked_add(n) {
        Some(end) if end <= size => Ok(addr + offset as u64),
        _ => Err(INVALID_SYMBOL),
    }
}

/// A copy to (`to`) or from module variable `sym`, `offset` bytes in: through the driver
/// at the variable's address (vgpu's guest `libcuda` hands it to the device as a global
/// copy); `cudaMemcpyDefault` means host to device, or device to host.
fn symbol_copy(
    to: bool,
    sym: *const c_void,
    host: *mut c_void,
    n: usize,
    offset: usize,
    kind: c_int,
    stream: Option<Ptr>,
) -> CudaResult {
    let at = symbol_at(sym, n, offset)? as usize as *mut c_void;
    let kind = match kind {
        DEFAULT if to => HOST_TO_DEVICE,
        DEFAULT => DEVICE_TO_HOST,
        k => k,
    };
    if to {
        copy(at, host, n, kind, stream)
    } else {
        copy(host, at, n, kind, stream)
    }
}

#[no_mangle]
pub extern "C" fn cudaMemcpyToSymbol(
    sym: *const c_void,
    src: *const c_void,
    n: usize,
    offset: usize,
    kind: c_int,
) -> CudaError {
    guard("cudaMemcpyToSymbol", || {
        symbol_copy(true, sym, src as *mut c_void, n, offset, kind, None)
    })
}

#[no_mangle]
pub extern "C" fn cudaMemcpyFromSymbol(
    dst: *mut c_void,
    sym: *const c_void,
    n: usize,
    offset: usize,
    kind: c_int,
) -> CudaError {
    guard("cudaMemcpyFromSymbol", || {
        symbol_copy(false, sym, dst, n, offset, kind, None)
    })
}

#[no_mangle]
pub extern "C" fn cudaMemcpyToSymbolAsync(
    sym: *const c_void,
    src: *const c_void,
    n: usize,
    offset: usize,
    kind: c_int,
    stream: Ptr,
) -> CudaError {
    guard("cudaMemcpyToSymbolAsync", || {
        symbol_copy(true, sym, src as *mut c_void, n, offset, kind, Some(stream))
    })
}

#[no_mangle]
pub extern "C" fn cudaMemcpyFromSymbolAsync(
    dst: *mut c_void,
    sym: *const c_void,
    n: usize,
    offset: usize,
    kind: c_int,
    stream: Ptr,
) -> CudaError {
    guard("cudaMemcpyFromSymbolAsync", || {
        symbol_copy(false, sym, dst, n, offset, kind, Some(stream))
    })
}
