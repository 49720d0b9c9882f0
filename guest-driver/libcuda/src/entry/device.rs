//! Initialisation, versions and the device: one device, ordinal 0, the GPU the backend
//! gives this VM.

#![allow(non_snake_case)]

use std::ffi::{c_char, c_int, c_uint};

use vgpu_protocol::module::{MAX_BLOCK_THREADS, MAX_BLOCK_Z, MAX_GRID_X, MAX_GRID_YZ};

use super::out;
use crate::driver;
use crate::errors::{guard, unsupported, CuResult};
use crate::types::*;

/// The attributes the library can answer from what vgpu itself enforces (the launch
/// limits of the protocol) and from facts of every NVIDIA GPU it runs on. The others
/// (SM count, clocks, compute capability) need the host's answer, which the protocol
/// does not carry yet: `CUDA_ERROR_NOT_SUPPORTED`.
fn attribute(attr: c_int) -> Option<c_int> {
    let v = match attr {
        1 => MAX_BLOCK_THREADS as c_int,     // MAX_THREADS_PER_BLOCK
        2 | 3 => MAX_BLOCK_THREADS as c_int, // MAX_BLOCK_DIM_X/Y
        4 => MAX_BLOCK_Z as c_int,           // MAX_BLOCK_DIM_Z
        5 => MAX_GRID_X as c_int,            // MAX_GRID_DIM_X
        6 | 7 => MAX_GRID_YZ as c_int,       // MAX_GRID_DIM_Y/Z
        8 => 48 << 10,                       // MAX_SHARED_MEMORY_PER_BLOCK (static)
        10 => 32,                            // WARP_SIZE
        15 => 1,                             // GPU_OVERLAP
        17 => 0,                             // KERNEL_EXEC_TIMEOUT
        18 => 0,                             // INTEGRATED
        19 => 0,                             // CAN_MAP_HOST_MEMORY (no host pointers)
        20 => 0,                             // COMPUTE_MODE: default
        31 => 1,                             // CONCURRENT_KERNELS
        41 => 0,                             // UNIFIED_ADDRESSING
        _ => return None,
    };
    Some(v)
}

fn device_ok(dev: CUdevice) -> CuResult {
    if dev != 0 {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    driver::with(|_| Ok(()))
}

#[no_mangle]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    guard("cuInit", || {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        driver::init()
    })
}

#[no_mangle]
pub extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    guard("cuDriverGetVersion", || out(version, DRIVER_VERSION))
}

#[no_mangle]
pub extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    guard("cuDeviceGetCount", || {
        driver::with(|_| Ok(()))?;
        out(count, 1)
    })
}

#[no_mangle]
pub extern "C" fn cuDeviceGet(dev: *mut CUdevice, ordinal: c_int) -> CUresult {
    guard("cuDeviceGet", || {
        device_ok(ordinal)?;
        out(dev, 0)
    })
}

#[no_mangle]
pub extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    guard("cuDeviceGetName", || {
        device_ok(dev)?;
        let n = driver::with(|d| Ok(format!("vgpu ({})", d.info.name)))?;
        let len = usize::try_from(len).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        if name.is_null() || len == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let take = n.len().min(len - 1);
        // SAFETY: `name` is valid for `len` bytes (the API contract); `take + 1 <= len`.
        unsafe {
            std::ptr::copy_nonoverlapping(n.as_ptr(), name.cast::<u8>(), take);
            *name.add(take) = 0;
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    guard("cuDeviceTotalMem", || {
        device_ok(dev)?;
        let total = driver::with(|d| Ok(d.info.vram_bytes))?;
        out(bytes, total as usize)
    })
}

#[no_mangle]
pub extern "C" fn cuDeviceTotalMem(bytes: *mut usize, dev: CUdevice) -> CUresult {
    cuDeviceTotalMem_v2(bytes, dev)
}

#[no_mangle]
pub extern "C" fn cuDeviceGetAttribute(value: *mut c_int, attr: c_int, dev: CUdevice) -> CUresult {
    guard("cuDeviceGetAttribute", || {
        device_ok(dev)?;
        match attribute(attr) {
            Some(v) => out(value, v),
            None => Err(unsupported(&format!("cuDeviceGetAttribute({attr})"))),
        }
    })
}
