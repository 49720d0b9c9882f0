//! Modules, their functions and globals, and `cuLaunchKernel`.
//!
//! A launch's parameters are laid out by the function's parameter list (the host reads
//! it from the module); an 8-byte parameter that points into one of the context's
//! allocations is sent as a relocation, so the GPU hands the kernel the device address
//! behind it (docs/design/guest-modules.md, "Who chooses addresses").

#![allow(non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_void};

use vgpu_guest::Method;
use vgpu_protocol::module::{check_launch, FunctionLaunch, Reloc, MAX_PARAM_BYTES, MAX_RELOCS};

use super::{c_str, handle, id_of, out};
use crate::driver::{self, CtxState};
use crate::errors::{from_error, guard, CuResult};
use crate::image::{self, ImageError};
use crate::types::*;

fn load(image: &[u8]) -> CuResult<u64> {
    driver::with(|d| {
        let (ctx, st) = d.current()?;
        st.alive()?;
        let m = st.ctx.load_module(image).map_err(|e| {
            // The device's reason (say, a GPU that runs no guest modules) is worth more
            // than the CUresult it maps to.
            log::warn!("loading a module: {e}");
            from_error(&e)
        })?;
        let id = driver::next_id();
        d.modules.insert(id, (ctx, m));
        Ok(id)
    })
}

fn load_ptr(pmod: *mut CUmodule, p: *const c_void) -> CuResult {
    if pmod.is_null() || p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: `p` is a module image the program owns (cuModuleLoadData's contract).
    let img = unsafe { image::image(p.cast()) }.map_err(|e| match e {
        ImageError::TooLarge => CUDA_ERROR_OUT_OF_MEMORY,
        ImageError::Malformed => CUDA_ERROR_INVALID_IMAGE,
    })?;
    let id = load(img)?;
    out(pmod, handle(id))
}

#[no_mangle]
pub extern "C" fn cuModuleLoadData(pmod: *mut CUmodule, p: *const c_void) -> CUresult {
    guard("cuModuleLoadData", || load_ptr(pmod, p))
}

#[no_mangle]
pub extern "C" fn cuModuleLoadDataEx(
    pmod: *mut CUmodule,
    p: *const c_void,
    _n: c_uint,
    _options: *mut c_int,
    _values: *mut *mut c_void,
) -> CUresult {
    // JIT options (log buffers, optimisation level) are the host driver's business: the
    // guest gets the module or the error, never the host's JIT log.
    guard("cuModuleLoadDataEx", || load_ptr(pmod, p))
}

#[no_mangle]
pub extern "C" fn cuModuleLoadFatBinary(pmod: *mut CUmodule, p: *const c_void) -> CUresult {
    guard("cuModuleLoadFatBinary", || load_ptr(pmod, p))
}

#[no_mangle]
pub extern "C" fn cuModuleLoad(pmod: *mut CUmodule, path: *const c_char) -> CUresult {
    guard("cuModuleLoad", || {
        let path = c_str(path)?;
        if pmod.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let img = std::fs::read(path).map_err(|_| CUDA_ERROR_FILE_NOT_FOUND)?;
        let id = load(&img)?;
        out(pmod, handle(id))
    })
}

#[no_mangle]
pub extern "C" fn cuModuleUnload(m: CUmodule) -> CUresult {
    guard("cuModuleUnload", || {
        driver::with(|d| {
            let id = id_of(m);
            let (ctx, _) = d.modules.get(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            let ctx = *ctx;
            // Work that may still run the module's kernels finishes first.
            if let Ok(st) = d.ctx(ctx) {
                if st.sticky.is_none() {
                    st.sync_all()?;
                }
            }
            d.functions.retain(|_, (_, f)| f.module != id);
            if let Ok(st) = d.ctx(ctx) {
                st.globals.retain(|_, g| g.module != id);
            }
            let (_, module) = d.modules.remove(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            module.unload().map_err(|e| from_error(&e))
        })
    })
}

#[no_mangle]
pub extern "C" fn cuModuleGetFunction(
    pf: *mut CUfunction,
    m: CUmodule,
    name: *const c_char,
) -> CUresult {
    guard("cuModuleGetFunction", || {
        let name = c_str(name)?;
        if pf.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = driver::with(|d| {
            let mid = id_of(m);
            let (ctx, module) = d.modules.get(&mid).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            let f = module.function(name).map_err(|e| from_error(&e))?;
            let id = driver::next_id();
            let ctx = *ctx;
            d.functions
                .insert(id, (ctx, driver::Func { module: mid, f }));
            Ok(id)
        })?;
        out(pf, handle(id))
    })
}

#[no_mangle]
pub extern "C" fn cuModuleGetGlobal_v2(
    dptr: *mut CUdeviceptr,
    bytes: *mut usize,
    m: CUmodule,
    name: *const c_char,
) -> CUresult {
    guard("cuModuleGetGlobal", || {
        let name = c_str(name)?;
        let g = driver::with(|d| {
            let (ctx, module) = d.modules.get(&id_of(m)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            let (ctx, device_module) = (*ctx, module.id());
            let g = module.global(name).map_err(|e| from_error(&e))?;
            // Copies at its address go to the device as global copies.
            if g.size > 0 {
                d.ctx(ctx)?.globals.insert(
                    g.addr,
                    driver::GlobalRef {
                        size: g.size,
                        module: id_of(m),
                        device_module,
                        name: name.to_string(),
                    },
                );
            }
            Ok(g)
        })?;
        if !dptr.is_null() {
            out(dptr, g.addr)?;
        }
        if !bytes.is_null() {
            out(bytes, g.size as usize)?;
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuFuncSetCacheConfig(f: CUfunction, _config: c_int) -> CUresult {
    // A preference the GPU may ignore (so does CUDA on GPUs without the choice).
    guard("cuFuncSetCacheConfig", || {
        driver::with(|d| {
            d.functions
                .get(&id_of(f))
                .map(|_| ())
                .ok_or(CUDA_ERROR_INVALID_HANDLE)
        })
    })
}

/// Relocations for the 8-byte parameters at `offsets` that point into an allocation.
fn relocs(st: &CtxState, params: &[u8], offsets: &[usize]) -> CuResult<Vec<Reloc>> {
    let mut out = Vec::new();
    for &at in offsets {
        let Some(field) = params.get(at..at + 8) else {
            continue;
        };
        let mut b = [0u8; 8];
        b.copy_from_slice(field);
        let ptr = u64::from_le_bytes(b);
        if let Ok(f) = st.find(ptr, 1) {
            out.push(Reloc {
                offset: at as u32,
                write: true,
                extent: f.len - (ptr - f.base),
            });
        }
    }
    if out.len() > MAX_RELOCS as usize {
        return Err(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES);
    }
    Ok(out)
}

/// The parameter buffer of a launch, from `kernelParams` (one pointer per parameter,
/// laid out by the function's parameter list) or from `extra`'s packed buffer.
///
/// # Safety
/// `kernel_params` and `extra` follow `cuLaunchKernel`'s contract.
unsafe fn param_buffer(
    layout: Option<&[vgpu_protocol::module::ParamInfo]>,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CuResult<(Vec<u8>, Vec<usize>)> {
    if !kernel_params.is_null() {
        let Some(layout) = layout else {
            // Without the host's parameter list the sizes behind the pointers are
            // unknown (a host driver older than CUDA 12.4).
            return Err(crate::errors::unsupported(
                "cuLaunchKernel(kernelParams) of a function without a parameter list",
            ));
        };
        let mut buf = vec![0u8; vgpu_protocol::module::param_bytes(layout) as usize];
        let mut ptrs = Vec::new();
        for (i, p) in layout.iter().enumerate() {
            // SAFETY: kernelParams holds one pointer per parameter of the function.
            let src = unsafe { *kernel_params.add(i) };
            if src.is_null() {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let (at, n) = (p.offset as usize, p.size as usize);
            let dst = buf.get_mut(at..at + n).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            // SAFETY: each parameter pointer is valid for the parameter's size.
            unsafe { std::ptr::copy_nonoverlapping(src.cast::<u8>(), dst.as_mut_ptr(), n) };
            if n == 8 {
                ptrs.push(at);
            }
        }
        return Ok((buf, ptrs));
    }
    if extra.is_null() {
        return match layout {
            Some([]) | None => Ok((Vec::new(), Vec::new())),
            Some(_) => Err(CUDA_ERROR_INVALID_VALUE),
        };
    }
    let (mut data, mut size) = (std::ptr::null::<u8>(), None::<usize>);
    let mut i = 0;
    loop {
        // SAFETY: `extra` is a key/value list ended by CU_LAUNCH_PARAM_END.
        let key = unsafe { *extra.add(i) } as usize;
        match key {
            CU_LAUNCH_PARAM_END => break,
            CU_LAUNCH_PARAM_BUFFER_POINTER => {
                // SAFETY: as above: the key's value follows it.
                data = unsafe { *extra.add(i + 1) }.cast();
            }
            CU_LAUNCH_PARAM_BUFFER_SIZE => {
                // SAFETY: the value is a pointer to a size_t.
                let p = unsafe { *extra.add(i + 1) }.cast::<usize>();
                if p.is_null() {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
                // SAFETY: non-NULL, points at the buffer's size.
                size = Some(unsafe { p.read_unaligned() });
            }
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        i += 2;
        if i > 64 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
    }
    let size = size.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if data.is_null() || size > MAX_PARAM_BYTES as usize {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the buffer pointer is valid for the size given with it.
    let buf = unsafe { std::slice::from_raw_parts(data, size) }.to_vec();
    if let Some(l) = layout {
        // A buffer of another size than the kernel's parameters: refused here, as CUDA
        // does, rather than faulting the channel on the host.
        if size as u64 != vgpu_protocol::module::param_bytes(l) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
    }
    let ptrs = match layout {
        Some(l) => l
            .iter()
            .filter(|p| p.size == 8)
            .map(|p| p.offset as usize)
            .collect(),
        None => (0..size / 8).map(|w| w * 8).collect(),
    };
    Ok((buf, ptrs))
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn cuLaunchKernel(
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    s: CUstream,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    guard("cuLaunchKernel", || {
        driver::with(|d| {
            let (ctx, func) = d
                .functions
                .get(&id_of(f))
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            let (ctx, func) = (*ctx, func.f.clone());
            if driver::current_id() != Some(ctx) {
                return Err(CUDA_ERROR_INVALID_CONTEXT);
            }
            let st = d.ctx(ctx)?;
            st.alive()?;
            // SAFETY: the program passes cuLaunchKernel's arguments as documented.
            let (params, ptrs) =
                unsafe { param_buffer(func.params.as_deref(), kernel_params, extra) }?;
            let l = FunctionLaunch {
                function: func.id,
                grid: [gx, gy, gz],
                block: [bx, by, bz],
                shared_mem: shared,
                relocs: relocs(st, &params, &ptrs)?,
                params,
            };
            check_launch(&l).map_err(|why| {
                log::debug!("cuLaunchKernel: {why} out of range");
                CUDA_ERROR_INVALID_VALUE
            })?;
            let r = (|| {
                st.order_before(s)?;
                let stream = st.stream(s)?;
                stream
                    .ch
                    .push_method(&Method::LaunchFunction(Box::new(l)))
                    .map_err(|e| from_error(&e))?;
                stream.launched()
            })();
            r.map_err(|c| st.note(c))
        })
    })
}
