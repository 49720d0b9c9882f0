//! What nvcc's generated code registers at program start (fatbins, kernels by their
//! host stubs, device variables by their host shadows), the modules loaded from them on
//! first use, and the primary context every thread uses.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Mutex, MutexGuard};

use crate::cu::{driver, Driver, Ptr};
use crate::errors::{
    check, CudaResult, INITIALIZATION_ERROR, INVALID_DEVICE_FUNCTION, INVALID_SYMBOL, NO_DEVICE,
};

/// `__fatBinC_Wrapper_t`'s magic.
const WRAPPER_MAGIC: u32 = 0x466243b1;

struct Fatbin {
    /// The fatbin itself (the wrapper's data pointer).
    data: usize,
    /// Its module in the primary context, once loaded.
    module: Option<usize>,
}

#[derive(Default)]
struct Registry {
    fatbins: Vec<Option<Fatbin>>,
    /// Kernels by host stub address: (fatbin, device name).
    functions: HashMap<usize, (usize, CString)>,
    /// Device variables by host shadow address: (fatbin, device name).
    vars: HashMap<usize, (usize, CString)>,
    /// Loaded functions by host stub address.
    loaded: HashMap<usize, usize>,
    /// The primary context, once retained.
    ctx: Option<usize>,
    /// Bumped by `cudaDeviceReset`: threads make the new context current again.
    generation: u64,
}

static REG: Mutex<Option<Registry>> = Mutex::new(None);

thread_local! {
    /// The context generation this thread last made current.
    static CURRENT: Cell<u64> = const { Cell::new(0) };
}

fn reg() -> MutexGuard<'static, Option<Registry>> {
    REG.lock().unwrap_or_else(|p| p.into_inner())
}

/// `__cudaRegisterFatBinary`: records the fatbin; the handle is its index + 1.
///
/// # Safety
/// `wrapper` is nvcc's `__fatBinC_Wrapper_t` (or NULL).
pub unsafe fn register_fatbin(wrapper: *const c_void) -> usize {
    let mut g = reg();
    let r = g.get_or_insert_with(Registry::default);
    let data = if wrapper.is_null() {
        0
    } else {
        // SAFETY: a wrapper is { u32 magic, u32 version, const void *data, … }.
        let (magic, data) = unsafe {
            (
                wrapper.cast::<u32>().read_unaligned(),
                wrapper.cast::<u8>().add(8).cast::<usize>().read_unaligned(),
            )
        };
        if magic == WRAPPER_MAGIC {
            data
        } else {
            // A bare fatbin (or image) registered directly.
            wrapper as usize
        }
    };
    r.fatbins.push(Some(Fatbin { data, module: None }));
    r.fatbins.len()
}

pub fn unregister_fatbin(handle: usize) {
    if let Some(r) = reg().as_mut() {
        if let Some(slot) = handle.checked_sub(1).and_then(|i| r.fatbins.get_mut(i)) {
            *slot = None;
        }
        r.functions.retain(|_, (f, _)| *f != handle);
        r.vars.retain(|_, (f, _)| *f != handle);
    }
}

pub fn register_function(handle: usize, stub: usize, name: CString) {
    let mut g = reg();
    let r = g.get_or_insert_with(Registry::default);
    r.functions.insert(stub, (handle, name));
}

pub fn register_var(handle: usize, shadow: usize, name: CString) {
    let mut g = reg();
    let r = g.get_or_insert_with(Registry::default);
    r.vars.insert(shadow, (handle, name));
}

/// Whether a kernel's host stub was registered.
pub fn registered(stub: usize) -> bool {
    reg()
        .as_ref()
        .is_some_and(|r| r.functions.contains_key(&stub))
}

/// The driver, initialised, with the primary context current on this thread.
pub fn ready() -> CudaResult<&'static Driver> {
    let d = driver().map_err(|e| {
        log::error!("the CUDA driver library: {e}");
        INITIALIZATION_ERROR
    })?;
    let mut g = reg();
    let r = g.get_or_insert_with(Registry::default);
    if r.ctx.is_none() {
        // SAFETY: driver entry points called with valid arguments.
        check(unsafe { (d.init)(0) }).map_err(|_| NO_DEVICE)?;
        let mut ctx: Ptr = std::ptr::null_mut();
        // SAFETY: as above; `ctx` receives the handle.
        check(unsafe { (d.primary_retain)(&mut ctx, 0) })?;
        r.ctx = Some(ctx as usize);
        r.generation += 1;
    }
    let generation = r.generation;
    if CURRENT.with(Cell::get) != generation {
        let ctx = r.ctx.unwrap_or(0) as Ptr;
        // SAFETY: a context handle the driver gave.
        check(unsafe { (d.ctx_set_current)(ctx) })?;
        CURRENT.with(|c| c.set(generation));
    }
    Ok(d)
}

/// `cudaDeviceReset`: the primary context goes (and every module with it); the next
/// call makes a new one.
pub fn reset() -> CudaResult {
    let d = ready()?;
    let mut g = reg();
    if let Some(r) = g.as_mut() {
        if r.ctx.take().is_some() {
            // SAFETY: a driver entry point with a device ordinal.
            check(unsafe { (d.primary_reset)(0) })?;
        }
        r.loaded.clear();
        for f in r.fatbins.iter_mut().flatten() {
            f.module = None;
        }
    }
    Ok(())
}

/// The fatbin's module, loaded into the primary context on first use.
fn module(d: &Driver, r: &mut Registry, handle: usize) -> CudaResult<usize> {
    let f = handle
        .checked_sub(1)
        .and_then(|i| r.fatbins.get_mut(i))
        .and_then(Option::as_mut)
        .ok_or(INVALID_DEVICE_FUNCTION)?;
    if let Some(m) = f.module {
        return Ok(m);
    }
    let mut m: Ptr = std::ptr::null_mut();
    // SAFETY: `data` is the fatbin nvcc embedded (registered above).
    check(unsafe { (d.module_load_fatbin)(&mut m, f.data as *const c_void) })?;
    f.module = Some(m as usize);
    Ok(m as usize)
}

/// The driver function behind a kernel's host stub.
pub fn function(stub: usize) -> CudaResult<Ptr> {
    let d = ready()?;
    let mut g = reg();
    let r = g.as_mut().ok_or(INVALID_DEVICE_FUNCTION)?;
    if let Some(&f) = r.loaded.get(&stub) {
        return Ok(f as Ptr);
    }
    let (handle, name) = r
        .functions
        .get(&stub)
        .cloned()
        .ok_or(INVALID_DEVICE_FUNCTION)?;
    let m = module(d, r, handle)?;
    let mut f: Ptr = std::ptr::null_mut();
    // SAFETY: a loaded module and a NUL-terminated name.
    check(unsafe { (d.module_get_function)(&mut f, m as Ptr, name.as_ptr()) })?;
    r.loaded.insert(stub, f as usize);
    Ok(f)
}

/// The device address and size of the variable behind a host shadow.
pub fn symbol(shadow: usize) -> CudaResult<(u64, usize)> {
    let d = ready()?;
    let mut g = reg();
    let r = g.as_mut().ok_or(INVALID_SYMBOL)?;
    let (handle, name) = r.vars.get(&shadow).cloned().ok_or(INVALID_SYMBOL)?;
    let m = module(d, r, handle)?;
    let (mut addr, mut size) = (0u64, 0usize);
    // SAFETY: a loaded module and a NUL-terminated name.
    check(unsafe { (d.module_get_global)(&mut addr, &mut size, m as Ptr, name.as_ptr()) })?;
    Ok((addr, size))
}
