//! The driver API, as the runtime reaches it: `libcuda.so.1` opened at run time (vgpu's
//! in a guest), its entry points looked up once.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

pub type CUresult = c_uint;
pub type Ptr = *mut c_void;

/// The driver entry points the runtime calls (the `_v2` ABI of `cuda.h`).
#[allow(clippy::type_complexity)]
pub struct Driver {
    pub init: unsafe extern "C" fn(c_uint) -> CUresult,
    pub driver_version: unsafe extern "C" fn(*mut c_int) -> CUresult,
    pub device_count: unsafe extern "C" fn(*mut c_int) -> CUresult,
    pub device_attribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> CUresult,
    pub device_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> CUresult,
    pub device_total_mem: unsafe extern "C" fn(*mut usize, c_int) -> CUresult,
    pub primary_retain: unsafe extern "C" fn(*mut Ptr, c_int) -> CUresult,
    pub primary_reset: unsafe extern "C" fn(c_int) -> CUresult,
    pub ctx_set_current: unsafe extern "C" fn(Ptr) -> CUresult,
    pub ctx_synchronize: unsafe extern "C" fn() -> CUresult,
    pub mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> CUresult,
    pub mem_free: unsafe extern "C" fn(u64) -> CUresult,
    pub mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult,
    pub mem_alloc_host: unsafe extern "C" fn(*mut Ptr, usize) -> CUresult,
    pub mem_free_host: unsafe extern "C" fn(Ptr) -> CUresult,
    pub address_range: unsafe extern "C" fn(*mut u64, *mut usize, u64) -> CUresult,
    pub htod: unsafe extern "C" fn(u64, *const c_void, usize) -> CUresult,
    pub dtoh: unsafe extern "C" fn(Ptr, u64, usize) -> CUresult,
    pub dtod: unsafe extern "C" fn(u64, u64, usize) -> CUresult,
    pub htod_async: unsafe extern "C" fn(u64, *const c_void, usize, Ptr) -> CUresult,
    pub dtoh_async: unsafe extern "C" fn(Ptr, u64, usize, Ptr) -> CUresult,
    pub dtod_async: unsafe extern "C" fn(u64, u64, usize, Ptr) -> CUresult,
    pub memset_d8: unsafe extern "C" fn(u64, u8, usize) -> CUresult,
    pub memset_d8_async: unsafe extern "C" fn(u64, u8, usize, Ptr) -> CUresult,
    pub module_load_fatbin: unsafe extern "C" fn(*mut Ptr, *const c_void) -> CUresult,
    pub module_get_function: unsafe extern "C" fn(*mut Ptr, Ptr, *const c_char) -> CUresult,
    pub module_get_global:
        unsafe extern "C" fn(*mut u64, *mut usize, Ptr, *const c_char) -> CUresult,
    pub launch: unsafe extern "C" fn(
        Ptr,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        Ptr,
        *mut Ptr,
        *mut Ptr,
    ) -> CUresult,
    pub stream_create: unsafe extern "C" fn(*mut Ptr, c_uint) -> CUresult,
    pub stream_destroy: unsafe extern "C" fn(Ptr) -> CUresult,
    pub stream_synchronize: unsafe extern "C" fn(Ptr) -> CUresult,
    pub stream_query: unsafe extern "C" fn(Ptr) -> CUresult,
    pub stream_wait_event: unsafe extern "C" fn(Ptr, Ptr, c_uint) -> CUresult,
    pub event_create: unsafe extern "C" fn(*mut Ptr, c_uint) -> CUresult,
    pub event_destroy: unsafe extern "C" fn(Ptr) -> CUresult,
    pub event_record: unsafe extern "C" fn(Ptr, Ptr) -> CUresult,
    pub event_synchronize: unsafe extern "C" fn(Ptr) -> CUresult,
    pub event_query: unsafe extern "C" fn(Ptr) -> CUresult,
    pub event_elapsed: unsafe extern "C" fn(*mut f32, Ptr, Ptr) -> CUresult,
}

/// Why the driver library could not be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LoadError {
    #[error("cannot open libcuda.so.1: {0}")]
    Open(String),
    #[error("libcuda.so.1 has no {0}")]
    Symbol(&'static str),
}

/// The driver, opened on first use; the same answer every time after.
pub fn driver() -> Result<&'static Driver, LoadError> {
    static D: OnceLock<Result<Driver, LoadError>> = OnceLock::new();
    D.get_or_init(open).as_ref().map_err(Clone::clone)
}

// Each symbol's type is the `Driver` field it fills (named there, not at the transmute).
#[allow(clippy::missing_transmute_annotations)]
fn open() -> Result<Driver, LoadError> {
    // SAFETY: dlopen with a NUL-terminated name; the handle is never closed (the
    // entry points must stay valid for the process's life).
    let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        // SAFETY: dlerror returns NULL or a NUL-terminated message.
        let why = unsafe { libc::dlerror() };
        let why = if why.is_null() {
            "unknown".to_string()
        } else {
            // SAFETY: non-NULL, NUL-terminated (above).
            unsafe { CStr::from_ptr(why) }
                .to_string_lossy()
                .into_owned()
        };
        return Err(LoadError::Open(why));
    }
    macro_rules! sym {
        ($name:literal) => {{
            // SAFETY: `h` is a live handle and the name NUL-terminated.
            let p = unsafe { libc::dlsym(h, concat!($name, "\0").as_ptr().cast()) };
            if p.is_null() {
                return Err(LoadError::Symbol($name));
            }
            // SAFETY: the symbol is the driver API entry point of that name, whose C
            // signature is the field's type (cuda.h).
            unsafe { std::mem::transmute::<*mut c_void, _>(p) }
        }};
    }
    Ok(Driver {
        init: sym!("cuInit"),
        driver_version: sym!("cuDriverGetVersion"),
        device_count: sym!("cuDeviceGetCount"),
        device_attribute: sym!("cuDeviceGetAttribute"),
        device_name: sym!("cuDeviceGetName"),
        device_total_mem: sym!("cuDeviceTotalMem_v2"),
        primary_retain: sym!("cuDevicePrimaryCtxRetain"),
        primary_reset: sym!("cuDevicePrimaryCtxReset_v2"),
        ctx_set_current: sym!("cuCtxSetCurrent"),
        ctx_synchronize: sym!("cuCtxSynchronize"),
        mem_alloc: sym!("cuMemAlloc_v2"),
        mem_free: sym!("cuMemFree_v2"),
        mem_get_info: sym!("cuMemGetInfo_v2"),
        mem_alloc_host: sym!("cuMemAllocHost_v2"),
        mem_free_host: sym!("cuMemFreeHost"),
        address_range: sym!("cuMemGetAddressRange_v2"),
        htod: sym!("cuMemcpyHtoD_v2"),
        dtoh: sym!("cuMemcpyDtoH_v2"),
        dtod: sym!("cuMemcpyDtoD_v2"),
        htod_async: sym!("cuMemcpyHtoDAsync_v2"),
        dtoh_async: sym!("cuMemcpyDtoHAsync_v2"),
        dtod_async: sym!("cuMemcpyDtoDAsync_v2"),
        memset_d8: sym!("cuMemsetD8_v2"),
        memset_d8_async: sym!("cuMemsetD8Async"),
        module_load_fatbin: sym!("cuModuleLoadFatBinary"),
        module_get_function: sym!("cuModuleGetFunction"),
        module_get_global: sym!("cuModuleGetGlobal_v2"),
        launch: sym!("cuLaunchKernel"),
        stream_create: sym!("cuStreamCreate"),
        stream_destroy: sym!("cuStreamDestroy_v2"),
        stream_synchronize: sym!("cuStreamSynchronize"),
        stream_query: sym!("cuStreamQuery"),
        stream_wait_event: sym!("cuStreamWaitEvent"),
        event_create: sym!("cuEventCreate"),
        event_destroy: sym!("cuEventDestroy_v2"),
        event_record: sym!("cuEventRecord"),
        event_synchronize: sym!("cuEventSynchronize"),
        event_query: sym!("cuEventQuery"),
        event_elapsed: sym!("cuEventElapsedTime"),
    })
}
