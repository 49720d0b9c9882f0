//! Kernel launches: `<<<>>>` (nvcc's call configuration stack and host stub) and
//! `cudaLaunchKernel`.

use std::cell::RefCell;
use std::ffi::{c_uint, c_void};

use super::{out, Dim3};
use crate::errors::{check, guard, CudaError, INVALID_DEVICE_FUNCTION, INVALID_VALUE};
use crate::registry::{function, ready, registered};

/// One `<<<grid, block, shared, stream>>>` between its push and the stub's pop.
#[derive(Clone, Copy)]
struct CallConfig {
    grid: Dim3,
    block: Dim3,
    shared: usize,
    stream: *mut c_void,
}

thread_local! {
    static CONFIGS: RefCell<Vec<CallConfig>> = const { RefCell::new(Vec::new()) };
}

#[no_mangle]
pub extern "C" fn __cudaPushCallConfiguration(
    grid: Dim3,
    block: Dim3,
    shared: usize,
    stream: *mut c_void,
) -> c_uint {
    CONFIGS.with(|c| {
        c.borrow_mut().push(CallConfig {
            grid,
            block,
            shared,
            stream,
        })
    });
    0
}

#[no_mangle]
pub extern "C" fn __cudaPopCallConfiguration(
    grid: *mut Dim3,
    block: *mut Dim3,
    shared: *mut usize,
    stream: *mut *mut c_void,
) -> CudaError {
    guard("__cudaPopCallConfiguration", || {
        let c = CONFIGS
            .with(|c| c.borrow_mut().pop())
            .ok_or(INVALID_VALUE)?;
        out(grid, c.grid)?;
        out(block, c.block)?;
        out(shared, c.shared)?;
        out(stream, c.stream)
    })
}

#[no_mangle]
pub extern "C" fn cudaLaunchKernel(
    func: *const c_void,
    grid: Dim3,
    block: Dim3,
    args: *mut *mut c_void,
    shared: usize,
    stream: *mut c_void,
) -> CudaError {
    guard("cudaLaunchKernel", || {
        let d = ready()?;
        let f = function(func as usize)?;
        let shared = c_uint::try_from(shared).map_err(|_| INVALID_VALUE)?;
        // SAFETY: the driver's cuLaunchKernel with the program's arguments, laid out as
        // the kernel's parameters (nvcc's stub passes one pointer per parameter).
        check(unsafe {
            (d.launch)(
                f,
                grid.x,
                grid.y,
                grid.z,
                block.x,
                block.y,
                block.z,
                shared,
                stream,
                args,
                std::ptr::null_mut(),
            )
        })
    })
}

/// The per-thread-default-stream form nvcc emits with `--default-stream per-thread`:
/// the library's default stream is one per context either way.
#[no_mangle]
pub extern "C" fn cudaLaunchKernel_ptsz(
    func: *const c_void,
    grid: Dim3,
    block: Dim3,
    args: *mut *mut c_void,
    shared: usize,
    stream: *mut c_void,
) -> CudaError {
    cudaLaunchKernel(func, grid, block, args, shared, stream)
}

/// CUDA 12.x+ host stubs look their kernel up once (`__cudaGetKernel`, into a static) and
/// launch it by that handle (`__cudaLaunchKernel`). The handle is the stub's address: the
/// module loads at the first launch, as with `cudaLaunchKernel`.
#[no_mangle]
pub extern "C" fn __cudaGetKernel(kernel: *mut *mut c_void, func: *const c_void) -> CudaError {
    guard("__cudaGetKernel", || {
        if !registered(func as usize) {
            return Err(INVALID_DEVICE_FUNCTION);
        }
        out(kernel, func.cast_mut())
    })
}

/// `cudaGetKernel`, the public form of the same lookup.
#[no_mangle]
pub extern "C" fn cudaGetKernel(kernel: *mut *mut c_void, func: *const c_void) -> CudaError {
    __cudaGetKernel(kernel, func)
}

#[no_mangle]
pub extern "C" fn __cudaLaunchKernel(
    kernel: *const c_void,
    grid: Dim3,
    block: Dim3,
    args: *mut *mut c_void,
    shared: usize,
    stream: *mut c_void,
) -> CudaError {
    cudaLaunchKernel(kernel, grid, block, args, shared, stream)
}

#[no_mangle]
pub extern "C" fn __cudaLaunchKernel_ptsz(
    kernel: *const c_void,
    grid: Dim3,
    block: Dim3,
    args: *mut *mut c_void,
    shared: usize,
    stream: *mut c_void,
) -> CudaError {
    cudaLaunchKernel(kernel, grid, block, args, shared, stream)
}
