//! Initialisation, versions and the device: one device, ordinal 0, the GPU the backend
//! gives this VM.

#![allow(non_snake_case)]

use std::ffi::{c_char, c_int, c_uint};

use vgpu_protocol::module::{MAX_BLOCK_THREADS, MAX_BLOCK_Z, MAX_GRID_X, MAX_GRID_YZ};

use super::out;
use crate::driver;
use crate::errors::{guard, unsupported, CuResult};
use crate::types::*;

/// What the virtual device is, whatever the GPU behind it: the features this library
/// does not offer (host-pointer mapping, managed and pageable memory, unified
/// addressing, cooperative and cluster launches, memory pools, IPC, the VMM API) are 0,
/// and so is the GPU's PCI address (the host's topology is not the guest's).
fn virtual_device(attr: c_int) -> Option<c_int> {
    let v = match attr {
        15 => 1,                          // GPU_OVERLAP
        17 => 0,                          // KERNEL_EXEC_TIMEOUT
        18 => 0,                          // INTEGRATED
        19 => 0,                          // CAN_MAP_HOST_MEMORY
        20 => 0,                          // COMPUTE_MODE: default
        31 => 1,                          // CONCURRENT_KERNELS
        33 | 34 | 50 => 0,                // PCI_BUS_ID, PCI_DEVICE_ID, PCI_DOMAIN_ID
        41 => 0,                          // UNIFIED_ADDRESSING
        83 | 88 | 89 | 100 | 101 => 0,    // managed / pageable memory
        91 => 0,                          // CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
        92..=94 | 122 | 123 => 0,         // stream memory operations
        95 | 96 | 120 => 0,               // cooperative and cluster launches
        98 => 0,                          // CAN_FLUSH_REMOTE_WRITES
        99 => 0,                          // HOST_REGISTER_SUPPORTED (cuMemHostRegister)
        102..=105 | 110 | 128 => 0,       // the VMM API and its handle types
        112..=119 | 121 | 124 | 125 => 0, // arrays, interop, pools, RDMA, IPC
        132 | 133 => 0,                   // MULTICAST_SUPPORTED, MPS_ENABLED
        130 => 0,                         // NUMA_CONFIG: none
        131 | 134 => -1,                  // NUMA_ID, HOST_NUMA_ID: no NUMA node
        135 | 138 => 0,                   // D3D12 / Vulkan CIG
        136 | 137 => 0,                   // memory decompression
        139 | 140 => 0,                   // GPU_PCI_DEVICE_ID, GPU_PCI_SUBSYSTEM_ID
        141..=147 => 0,                   // host NUMA / host memory pools, VMM, dma_buf, atomics
        _ => return None,
    };
    Some(v)
}

/// The launch limits vgpu's protocol enforces: at most these, whatever the GPU allows.
fn protocol_limit(attr: c_int) -> Option<c_int> {
    let v = match attr {
        1..=3 => MAX_BLOCK_THREADS as c_int, // MAX_THREADS_PER_BLOCK, MAX_BLOCK_DIM_X/Y
        4 => MAX_BLOCK_Z as c_int,           // MAX_BLOCK_DIM_Z
        5 => MAX_GRID_X as c_int,            // MAX_GRID_DIM_X
        6 | 7 => MAX_GRID_YZ as c_int,       // MAX_GRID_DIM_Y/Z
        _ => return None,
    };
    Some(v)
}

/// Where the GPU tells nothing (the sim): facts of every NVIDIA GPU vgpu runs on.
fn without_a_gpu(attr: c_int) -> Option<c_int> {
    match attr {
        8 => Some(48 << 10), // MAX_SHARED_MEMORY_PER_BLOCK (static)
        10 => Some(32),      // WARP_SIZE
        _ => None,
    }
}

/// Attribute `attr` of the virtual device: its own features first, then the GPU's value
/// (capped by the protocol's limits), then what holds without a GPU.
fn attribute(d: &mut driver::Driver, attr: c_int) -> Option<c_int> {
    if let Some(v) = virtual_device(attr) {
        return Some(v);
    }
    let host = u32::try_from(attr).ok().and_then(|a| d.host_attribute(a));
    match (host, protocol_limit(attr)) {
        (Some(h), Some(limit)) => Some(h.min(limit)),
        (Some(h), None) => Some(h),
        (None, Some(limit)) => Some(limit),
        (None, None) => without_a_gpu(attr),
    }
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
        match driver::with(|d| Ok(attribute(d, attr)))? {
            Some(v) => out(value, v),
            // An attribute this device cannot tell (the sim has no GPU's clocks or
            // caches): the entry point is covered, so no warning — the runtime's
            // cudaGetDeviceProperties asks every attribute it fills.
            None => {
                log::debug!("cuDeviceGetAttribute({attr}): not known for this device");
                Err(CUDA_ERROR_NOT_SUPPORTED)
            }
        }
    })
}

#[no_mangle]
pub extern "C" fn cuDeviceComputeCapability(
    major: *mut c_int,
    minor: *mut c_int,
    dev: CUdevice,
) -> CUresult {
    guard("cuDeviceComputeCapability", || {
        device_ok(dev)?;
        let (ma, mi) = driver::with(|d| Ok((attribute(d, 75), attribute(d, 76))))?;
        match (ma, mi) {
            (Some(ma), Some(mi)) => {
                out(major, ma)?;
                out(minor, mi)
            }
            _ => Err(unsupported("cuDeviceComputeCapability")),
        }
    })
}
