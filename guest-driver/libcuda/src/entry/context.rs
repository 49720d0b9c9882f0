//! Contexts: created ones (a stack per thread, as CUDA keeps) and the device's primary
//! context (shared, reference counted: what the runtime API uses).

#![allow(non_snake_case)]

use std::ffi::{c_int, c_uint};

use super::{handle, id_of, out};
use crate::driver::{self, CtxState};
use crate::errors::{guard, CuResult};
use crate::types::*;

fn create(primary: bool) -> CuResult<u64> {
    driver::with(|d| {
        let st = CtxState::new(&d.device, primary)?;
        let id = driver::next_id();
        d.contexts.insert(id, st);
        Ok(id)
    })
}

#[no_mangle]
pub extern "C" fn cuCtxCreate_v2(pctx: *mut CUcontext, _flags: c_uint, dev: CUdevice) -> CUresult {
    guard("cuCtxCreate", || {
        if dev != 0 {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = create(false)?;
        driver::push_current(id);
        out(pctx, handle(id))
    })
}

#[no_mangle]
pub extern "C" fn cuCtxCreate(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> CUresult {
    cuCtxCreate_v2(pctx, flags, dev)
}

#[no_mangle]
pub extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    guard("cuCtxDestroy", || {
        let id = id_of(ctx);
        driver::with(|d| {
            if d.ctx(id)?.primary {
                return Err(CUDA_ERROR_INVALID_CONTEXT);
            }
            d.destroy_ctx(id)
        })
    })
}

#[no_mangle]
pub extern "C" fn cuCtxDestroy(ctx: CUcontext) -> CUresult {
    cuCtxDestroy_v2(ctx)
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    guard("cuCtxSetCurrent", || {
        let id = id_of(ctx);
        if id == 0 {
            driver::set_current(None);
            return Ok(());
        }
        driver::with(|d| d.ctx(id).map(|_| ()))?;
        driver::set_current(Some(id));
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    guard("cuCtxGetCurrent", || {
        driver::with(|_| Ok(()))?;
        out(pctx, handle(driver::current_id().unwrap_or(0)))
    })
}

#[no_mangle]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    guard("cuCtxPushCurrent", || {
        let id = id_of(ctx);
        driver::with(|d| d.ctx(id).map(|_| ()))?;
        driver::push_current(id);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) -> CUresult {
    guard("cuCtxPopCurrent", || {
        let id = driver::pop_current().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if !pctx.is_null() {
            out(pctx, handle(id))?;
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuCtxGetDevice(dev: *mut CUdevice) -> CUresult {
    guard("cuCtxGetDevice", || {
        driver::with(|d| d.current().map(|_| ()))?;
        out(dev, 0)
    })
}

#[no_mangle]
pub extern "C" fn cuCtxGetApiVersion(ctx: CUcontext, version: *mut c_uint) -> CUresult {
    guard("cuCtxGetApiVersion", || {
        let id = match id_of(ctx) {
            0 => driver::current_id().ok_or(CUDA_ERROR_INVALID_CONTEXT)?,
            id => id,
        };
        driver::with(|d| d.ctx(id).map(|_| ()))?;
        out(version, 3020)
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    guard("cuCtxSynchronize", || {
        driver::with_current(|st| st.sync_all())
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    guard("cuDevicePrimaryCtxRetain", || {
        if dev != 0 {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = driver::with(|d| {
            if let Some((id, n)) = d.primary.as_mut() {
                *n += 1;
                return Ok(*id);
            }
            let st = CtxState::new(&d.device, true)?;
            let id = driver::next_id();
            d.contexts.insert(id, st);
            d.primary = Some((id, 1));
            Ok(id)
        })?;
        out(pctx, handle(id))
    })
}

/// Drops one reference to the primary context; the last one destroys it.
fn primary_release(reset: bool) -> CuResult {
    driver::with(|d| {
        let (id, n) = d.primary.ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if reset || n <= 1 {
            d.primary = None;
            d.destroy_ctx(id)
        } else {
            d.primary = Some((id, n - 1));
            Ok(())
        }
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    guard("cuDevicePrimaryCtxRelease", || {
        if dev != 0 {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        primary_release(false)
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease(dev: CUdevice) -> CUresult {
    cuDevicePrimaryCtxRelease_v2(dev)
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    guard("cuDevicePrimaryCtxReset", || {
        if dev != 0 {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        match primary_release(true) {
            Err(CUDA_ERROR_INVALID_CONTEXT) => Ok(()),
            r => r,
        }
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxReset(dev: CUdevice) -> CUresult {
    cuDevicePrimaryCtxReset_v2(dev)
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxGetState(
    dev: CUdevice,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CUresult {
    guard("cuDevicePrimaryCtxGetState", || {
        if dev != 0 {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        let on = driver::with(|d| Ok(d.primary.is_some()))?;
        out(flags, 0)?;
        out(active, c_int::from(on))
    })
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, _flags: c_uint) -> CUresult {
    guard("cuDevicePrimaryCtxSetFlags", || {
        if dev != 0 {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        // Scheduling flags (spin, yield, block) change how a host thread waits; the
        // library's waits are its own (the fence wait), so they are accepted and ignored.
        Ok(())
    })
}
