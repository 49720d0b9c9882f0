//! Error texts and `cuGetProcAddress`, through which CUDA 12+ programs (and the CUDA
//! runtime) find every other entry point.

#![allow(non_snake_case)]

use std::ffi::{c_char, c_int, c_void};

use super::{c_str, context::*, device::*, memory::*, module::*, out, stream::*};
use crate::errors::{guard, texts};
use crate::types::*;

#[no_mangle]
pub extern "C" fn cuGetErrorName(code: CUresult, s: *mut *const c_char) -> CUresult {
    guard("cuGetErrorName", || {
        let (name, _) = texts(code).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        out(s, name.as_ptr().cast())
    })
}

#[no_mangle]
pub extern "C" fn cuGetErrorString(code: CUresult, s: *mut *const c_char) -> CUresult {
    guard("cuGetErrorString", || {
        let (_, text) = texts(code).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        out(s, text.as_ptr().cast())
    })
}

macro_rules! table {
    ($($name:literal => $f:expr),* $(,)?) => {
        &[$(($name, $f as *const c_void)),*]
    };
}

/// The covered entry points by the name `cuGetProcAddress` asks for (the base name;
/// the versioned function CUDA ≥ 3.2 programs get).
fn covered() -> &'static [(&'static str, *const c_void)] {
    // A function pointer table built once: raw pointers are not `Sync`, so it lives in
    // a function rather than a static.
    table![
        "cuInit" => cuInit,
        "cuDriverGetVersion" => cuDriverGetVersion,
        "cuDeviceGetCount" => cuDeviceGetCount,
        "cuDeviceGet" => cuDeviceGet,
        "cuDeviceGetName" => cuDeviceGetName,
        "cuDeviceTotalMem" => cuDeviceTotalMem_v2,
        "cuDeviceGetAttribute" => cuDeviceGetAttribute,
        "cuDeviceComputeCapability" => cuDeviceComputeCapability,
        "cuCtxCreate" => cuCtxCreate_v2,
        "cuCtxDestroy" => cuCtxDestroy_v2,
        "cuCtxSetCurrent" => cuCtxSetCurrent,
        "cuCtxGetCurrent" => cuCtxGetCurrent,
        "cuCtxPushCurrent" => cuCtxPushCurrent_v2,
        "cuCtxPopCurrent" => cuCtxPopCurrent_v2,
        "cuCtxGetDevice" => cuCtxGetDevice,
        "cuCtxGetApiVersion" => cuCtxGetApiVersion,
        "cuCtxSynchronize" => cuCtxSynchronize,
        "cuDevicePrimaryCtxRetain" => cuDevicePrimaryCtxRetain,
        "cuDevicePrimaryCtxRelease" => cuDevicePrimaryCtxRelease_v2,
        "cuDevicePrimaryCtxReset" => cuDevicePrimaryCtxReset_v2,
        "cuDevicePrimaryCtxGetState" => cuDevicePrimaryCtxGetState,
        "cuDevicePrimaryCtxSetFlags" => cuDevicePrimaryCtxSetFlags_v2,
        "cuMemAlloc" => cuMemAlloc_v2,
        "cuMemFree" => cuMemFree_v2,
        "cuMemGetInfo" => cuMemGetInfo_v2,
        "cuMemAllocHost" => cuMemAllocHost_v2,
        "cuMemHostAlloc" => cuMemHostAlloc,
        "cuMemFreeHost" => cuMemFreeHost,
        "cuMemHostGetDevicePointer" => cuMemHostGetDevicePointer_v2,
        "cuMemcpyHtoD" => cuMemcpyHtoD_v2,
        "cuMemcpyDtoH" => cuMemcpyDtoH_v2,
        "cuMemcpyDtoD" => cuMemcpyDtoD_v2,
        "cuMemcpyHtoDAsync" => cuMemcpyHtoDAsync_v2,
        "cuMemcpyDtoHAsync" => cuMemcpyDtoHAsync_v2,
        "cuMemcpyDtoDAsync" => cuMemcpyDtoDAsync_v2,
        "cuMemsetD8" => cuMemsetD8_v2,
        "cuMemsetD32" => cuMemsetD32_v2,
        "cuMemsetD8Async" => cuMemsetD8Async,
        "cuMemsetD32Async" => cuMemsetD32Async,
        "cuMemGetAddressRange" => cuMemGetAddressRange_v2,
        "cuPointerGetAttribute" => cuPointerGetAttribute,
        "cuModuleLoad" => cuModuleLoad,
        "cuModuleLoadData" => cuModuleLoadData,
        "cuModuleLoadDataEx" => cuModuleLoadDataEx,
        "cuModuleLoadFatBinary" => cuModuleLoadFatBinary,
        "cuModuleUnload" => cuModuleUnload,
        "cuModuleGetFunction" => cuModuleGetFunction,
        "cuModuleGetGlobal" => cuModuleGetGlobal_v2,
        "cuFuncSetCacheConfig" => cuFuncSetCacheConfig,
        "cuLaunchKernel" => cuLaunchKernel,
        "cuStreamCreate" => cuStreamCreate,
        "cuStreamCreateWithPriority" => cuStreamCreateWithPriority,
        "cuStreamDestroy" => cuStreamDestroy_v2,
        "cuStreamSynchronize" => cuStreamSynchronize,
        "cuStreamQuery" => cuStreamQuery,
        "cuStreamWaitEvent" => cuStreamWaitEvent,
        "cuEventCreate" => cuEventCreate,
        "cuEventDestroy" => cuEventDestroy_v2,
        "cuEventRecord" => cuEventRecord,
        "cuEventRecordWithFlags" => cuEventRecordWithFlags,
        "cuEventSynchronize" => cuEventSynchronize,
        "cuEventQuery" => cuEventQuery,
        "cuEventElapsedTime" => cuEventElapsedTime,
        "cuGetErrorName" => cuGetErrorName,
        "cuGetErrorString" => cuGetErrorString,
        "cuGetProcAddress" => cuGetProcAddress_v2,
    ]
}

/// The entry point `name` stands for: a covered one, or an unsupported one's stub.
/// Names come with or without their version suffix (`cuMemAlloc`, `cuMemAlloc_v2`).
pub fn lookup(name: &str) -> Option<*const c_void> {
    let base = name
        .strip_suffix("_v2")
        .or_else(|| name.strip_suffix("_v3"))
        .unwrap_or(name);
    // Per-thread-default-stream variants (`_ptsz`, `_ptds`) behave as the plain ones:
    // the library's default stream is one per context.
    let base = base
        .strip_suffix("_ptsz")
        .or_else(|| base.strip_suffix("_ptds"))
        .unwrap_or(base);
    let base = base.strip_suffix("_v2").unwrap_or(base);
    if let Some(&(_, f)) = covered().iter().find(|(n, _)| *n == base) {
        return Some(f);
    }
    super::unsupported::UNSUPPORTED
        .iter()
        .find(|(n, _)| *n == name || n.strip_suffix("_v2") == Some(base) || *n == base)
        .map(|&(_, f)| f as *const c_void)
}

fn proc_address(symbol: *const c_char, pfn: *mut *mut c_void, status: *mut c_int) -> CUresult {
    guard("cuGetProcAddress", || {
        let name = c_str(symbol)?;
        if pfn.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match lookup(name) {
            Some(f) => {
                out(pfn, f.cast_mut())?;
                if !status.is_null() {
                    out(status, CU_GET_PROC_ADDRESS_SUCCESS)?;
                }
                Ok(())
            }
            None => {
                log::info!("cuGetProcAddress({name}): not found");
                out(pfn, std::ptr::null_mut())?;
                if !status.is_null() {
                    out(status, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)?;
                }
                Err(CUDA_ERROR_NOT_FOUND)
            }
        }
    })
}

#[no_mangle]
pub extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    _cuda_version: c_int,
    _flags: u64,
    status: *mut c_int,
) -> CUresult {
    proc_address(symbol, pfn, status)
}

#[no_mangle]
pub extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    _cuda_version: c_int,
    _flags: u64,
) -> CUresult {
    proc_address(symbol, pfn, std::ptr::null_mut())
}
