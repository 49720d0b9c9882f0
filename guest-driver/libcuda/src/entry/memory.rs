//! Memory: device allocations (VRAM of the VM), pinned host memory (guest RAM the GPU
//! reaches), copies and sets.
//!
//! A device pointer is the allocation's GPU virtual address in its context; copies
//! between host and device go through the runtime's `Buffer` (the aperture, or staged
//! DMA on a GPU whose VRAM the CPU cannot map). A host↔device copy, even an `Async` one,
//! returns when it is done: CUDA allows that, and the copy is ordered after the work the
//! stream already holds by waiting for it first.

#![allow(non_snake_case)]

use std::ffi::{c_uint, c_void};

use vgpu_guest::KernelArgs;

use super::out;
use crate::driver::{self, CtxState};
use crate::errors::{from_error, guard, CuResult};
use crate::types::*;

/// Where a copy or set runs: the stream (ordered after its work), or synchronously.
#[derive(Clone, Copy)]
enum On {
    Sync,
    Stream(CUstream),
}

/// Waits until `n` bytes copied through the CPU on behalf of `on` are ordered: after
/// the stream's work (an async copy), or after all of the context's (a synchronous one).
fn settle(st: &mut CtxState, on: On) -> CuResult {
    match on {
        On::Sync => st.sync_all(),
        On::Stream(s) => {
            st.order_before(s)?;
            st.stream(s)?.sync()
        }
    }
}

#[no_mangle]
pub extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    guard("cuMemAlloc", || {
        if dptr.is_null() || bytes == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let va = driver::with_current(|st| st.allocs.alloc_device(&st.ctx, bytes as u64))?;
        out(dptr, va)
    })
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    guard("cuMemFree", || {
        driver::with(|d| {
            let (_, st) = d.current()?;
            if !st.allocs.contains(dptr) || st.host.values().any(|&v| v == dptr) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            // Work still using the memory finishes first (cuMemFree synchronises).
            if st.sticky.is_none() {
                st.sync_all()?;
            }
            st.allocs.remove(dptr);
            Ok(())
        })
    })
}

#[no_mangle]
pub extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    guard("cuMemGetInfo", || {
        let (used, all) = driver::with(|d| {
            d.current()?;
            let used: u64 = d.contexts.values().map(|c| c.allocs.vram_bytes()).sum();
            Ok((used, d.info.vram_bytes))
        })?;
        out(free, all.saturating_sub(used) as usize)?;
        out(total, all as usize)
    })
}

#[no_mangle]
pub extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytes: usize) -> CUresult {
    guard("cuMemAllocHost", || {
        if pp.is_null() || bytes == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = driver::with_current(|st| {
            let b = st
                .ctx
                .alloc_host(bytes as u64)
                .map_err(|e| from_error(&e))?;
            let p = b
                .cpu_ptr()
                .map_err(|e| from_error(&e))?
                .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
            st.host.insert(p as usize, b.gpu_va());
            st.allocs.insert(b);
            Ok(p)
        })?;
        out(pp, p.cast::<c_void>())
    })
}

#[no_mangle]
pub extern "C" fn cuMemHostAlloc(pp: *mut *mut c_void, bytes: usize, _flags: c_uint) -> CUresult {
    // Portable, mapped and write-combined all get the same memory: guest RAM the GPU
    // reaches through its page tables.
    cuMemAllocHost_v2(pp, bytes)
}

#[no_mangle]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    guard("cuMemFreeHost", || {
        driver::with(|d| {
            let (_, st) = d.current()?;
            let va = st
                .host
                .get(&(p as usize))
                .copied()
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
            if st.sticky.is_none() {
                st.sync_all()?;
            }
            st.host.remove(&(p as usize));
            st.allocs.remove(va);
            Ok(())
        })
    })
}

#[no_mangle]
pub extern "C" fn cuMemHostGetDevicePointer_v2(
    dptr: *mut CUdeviceptr,
    p: *mut c_void,
    flags: c_uint,
) -> CUresult {
    guard("cuMemHostGetDevicePointer", || {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let va = driver::with_current(|st| {
            // A pointer inside an allocation maps to the same offset in its GPU view.
            let (&cpu, &va) = st
                .host
                .iter()
                .filter(|(&c, _)| c <= p as usize)
                .max_by_key(|(&c, _)| c)
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
            let off = (p as usize - cpu) as u64;
            if off >= st.find(va, 0)?.len {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            Ok(va + off)
        })?;
        out(dptr, va)
    })
}

fn htod(dst: CUdeviceptr, src: *const c_void, n: usize, on: On) -> CuResult {
    if n == 0 {
        return Ok(());
    }
    if src.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: `src` is valid for reads of `n` bytes (the API contract), and nothing
    // writes it while the copy runs (the call returns when the copy is done).
    let data = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), n) };
    driver::with_current(|st| {
        settle(st, on)?;
        // A module global (its address from cuModuleGetGlobal): the device copies.
        if let Some((g, off)) = st.global_at(dst, n as u64) {
            return st
                .ctx
                .global_write(g.device_module, &g.name, off, data)
                .map_err(|e| from_error(&e));
        }
        let f = st.find(dst, n as u64)?;
        f.buf.write(f.offset, data).map_err(|e| from_error(&e))
    })
}

fn dtoh(dst: *mut c_void, src: CUdeviceptr, n: usize, on: On) -> CuResult {
    if n == 0 {
        return Ok(());
    }
    if dst.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: `dst` is valid for writes of `n` bytes and not otherwise accessed during
    // the call (the API contract).
    let data = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), n) };
    driver::with_current(|st| {
        settle(st, on)?;
        if let Some((g, off)) = st.global_at(src, n as u64) {
            return st
                .ctx
                .global_read(g.device_module, &g.name, off, data)
                .map_err(|e| from_error(&e));
        }
        let f = st.find(src, n as u64)?;
        f.buf.read(f.offset, data).map_err(|e| from_error(&e))
    })
}

/// Device-to-device copies run on the GPU's copy engine, in the stream's order.
fn dtod(dst: CUdeviceptr, src: CUdeviceptr, n: usize, on: On) -> CuResult {
    if n == 0 {
        return Ok(());
    }
    driver::with_current(|st| {
        st.find(dst, n as u64)?;
        st.find(src, n as u64)?;
        let s = match on {
            On::Sync => std::ptr::null_mut(),
            On::Stream(s) => s,
        };
        st.order_before(s)?;
        let stream = st.stream(s)?;
        stream
            .ch
            .copy(dst, src, n as u64)
            .map_err(|e| from_error(&e))?;
        stream.submit()?;
        match on {
            On::Sync => stream.sync(),
            On::Stream(_) => Ok(()),
        }
    })
}

/// Sets `bytes` bytes at `dst` to the 32-bit `pattern` (a byte pattern repeated four
/// times for the 8-bit set), on the GPU in the stream's order.
fn set(dst: CUdeviceptr, bytes: u64, pattern: u32, on: On) -> CuResult {
    if bytes == 0 {
        return Ok(());
    }
    driver::with_current(|st| {
        st.find(dst, bytes)?;
        let s = match on {
            On::Sync => std::ptr::null_mut(),
            On::Stream(s) => s,
        };
        st.order_before(s)?;
        let stream = st.stream(s)?;
        let args = KernelArgs::Memset {
            dst,
            len: bytes,
            pattern,
        };
        stream
            .ch
            .launch(&args, [1, 1, 1])
            .map_err(|e| from_error(&e))?;
        stream.submit()?;
        match on {
            On::Sync => stream.sync(),
            On::Stream(_) => Ok(()),
        }
    })
}

#[no_mangle]
pub extern "C" fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) -> CUresult {
    guard("cuMemcpyHtoD", || htod(dst, src, n, On::Sync))
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    guard("cuMemcpyDtoH", || dtoh(dst, src, n, On::Sync))
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    guard("cuMemcpyDtoD", || dtod(dst, src, n, On::Sync))
}

#[no_mangle]
pub extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
    s: CUstream,
) -> CUresult {
    guard("cuMemcpyHtoDAsync", || htod(dst, src, n, On::Stream(s)))
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: usize,
    s: CUstream,
) -> CUresult {
    guard("cuMemcpyDtoHAsync", || dtoh(dst, src, n, On::Stream(s)))
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    s: CUstream,
) -> CUresult {
    guard("cuMemcpyDtoDAsync", || dtod(dst, src, n, On::Stream(s)))
}

#[no_mangle]
pub extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, v: u8, n: usize) -> CUresult {
    guard("cuMemsetD8", || {
        set(dst, n as u64, u32::from_ne_bytes([v; 4]), On::Sync)
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD32_v2(dst: CUdeviceptr, v: c_uint, n: usize) -> CUresult {
    guard("cuMemsetD32", || {
        let bytes = (n as u64).checked_mul(4).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        set(dst, bytes, v, On::Sync)
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD8Async(dst: CUdeviceptr, v: u8, n: usize, s: CUstream) -> CUresult {
    guard("cuMemsetD8Async", || {
        set(dst, n as u64, u32::from_ne_bytes([v; 4]), On::Stream(s))
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD32Async(dst: CUdeviceptr, v: c_uint, n: usize, s: CUstream) -> CUresult {
    guard("cuMemsetD32Async", || {
        let bytes = (n as u64).checked_mul(4).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        set(dst, bytes, v, On::Stream(s))
    })
}

#[no_mangle]
pub extern "C" fn cuMemGetAddressRange_v2(
    base: *mut CUdeviceptr,
    size: *mut usize,
    dptr: CUdeviceptr,
) -> CUresult {
    guard("cuMemGetAddressRange", || {
        let (va, len) = driver::with_current(|st| {
            let f = st.find(dptr, 0)?;
            Ok((f.base, f.len))
        })?;
        if !base.is_null() {
            out(base, va)?;
        }
        if !size.is_null() {
            out(size, len as usize)?;
        }
        Ok(())
    })
}

/// The context a pointer belongs to is not tracked per pointer: attributes need
/// unified addressing, which the library does not offer.
#[no_mangle]
pub extern "C" fn cuPointerGetAttribute(_d: *mut c_void, _a: c_uint, _p: CUdeviceptr) -> CUresult {
    crate::errors::unsupported("cuPointerGetAttribute")
}
