//! What nvcc's generated host code calls at start and exit: fatbin, kernel and variable
//! registration.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use crate::registry;

/// The fatbin handle a program gets back (an index of ours, never dereferenced by nvcc's
/// code: it only hands it back).
fn handle_of(h: *mut *mut c_void) -> usize {
    h as usize
}

fn name(p: *const c_char) -> Option<CString> {
    if p.is_null() {
        return None;
    }
    // SAFETY: nvcc passes NUL-terminated names that live as long as the program.
    Some(unsafe { CStr::from_ptr(p) }.to_owned())
}

#[no_mangle]
pub extern "C" fn __cudaRegisterFatBinary(wrapper: *mut c_void) -> *mut *mut c_void {
    crate::init_logging();
    // SAFETY: nvcc passes its `__fatBinC_Wrapper_t`.
    let h = unsafe { registry::register_fatbin(wrapper) };
    h as *mut *mut c_void
}

#[no_mangle]
pub extern "C" fn __cudaRegisterFatBinaryEnd(_h: *mut *mut c_void) {}

#[no_mangle]
pub extern "C" fn __cudaUnregisterFatBinary(h: *mut *mut c_void) {
    registry::unregister_fatbin(handle_of(h));
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn __cudaRegisterFunction(
    h: *mut *mut c_void,
    host_fun: *const c_char,
    _device_fun: *mut c_char,
    device_name: *const c_char,
    _thread_limit: c_int,
    _tid: *mut c_void,
    _bid: *mut c_void,
    _block_dim: *mut c_void,
    _grid_dim: *mut c_void,
    _wsize: *mut c_int,
) {
    match name(device_name) {
        Some(n) => registry::register_function(handle_of(h), host_fun as usize, n),
        None => log::warn!("__cudaRegisterFunction without a device name"),
    }
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn __cudaRegisterVar(
    h: *mut *mut c_void,
    host_var: *mut c_char,
    _device_address: *mut c_char,
    device_name: *const c_char,
    _ext: c_int,
    _size: usize,
    _constant: c_int,
    _global: c_int,
) {
    match name(device_name) {
        Some(n) => registry::register_var(handle_of(h), host_var as usize, n),
        None => log::warn!("__cudaRegisterVar without a device name"),
    }
}

/// Managed variables need unified memory, which vgpu does not offer: registered, never
/// usable (a launch touching one faults).
#[no_mangle]
pub extern "C" fn __cudaRegisterManagedVar(
    _h: *mut *mut c_void,
    _host_var: *mut *mut c_void,
    _device_address: *mut c_char,
    device_name: *const c_char,
) {
    log::warn!(
        "__cudaRegisterManagedVar({:?}): managed memory is not supported",
        name(device_name)
    );
}

#[no_mangle]
pub extern "C" fn __cudaInitModule(_h: *mut *mut c_void) -> c_char {
    1
}
