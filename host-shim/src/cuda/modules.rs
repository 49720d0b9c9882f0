//! Guests' own modules on the `cuda` GPU (issue 31, docs/design/guest-modules.md): loaded
//! into the device's context, their functions bound to ids the owner chose, launched by
//! `LAUNCH_FUNCTION` on the channel's stream (`plan::launch_function`).
//!
//! Only a GPU that serves one VM in a process of its own loads them
//! ([`super::CudaConfig::guest_modules`]): a module kernel can reach anything of the
//! context, and in the backend's process the context holds every VM's memory.

use std::collections::HashMap;
use std::ffi::CString;

use vgpu_protocol::module::{ParamInfo, MAX_MODULES_PER_CONTEXT};
use vgpu_protocol::ErrorCode;

use super::device::Device;
use super::error::DeviceError;
use super::plan::BoundFunction;
use super::CudaGpuOf;
use crate::hal::{ContextId, GlobalInfo, HalError, Result};

/// Bound functions by (context, function id): the module each came from and the handle.
pub(crate) type FunctionTable = HashMap<(ContextId, u32), (u32, BoundFunction)>;

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The HAL error for a driver failure of a module call: a lost context is the GPU lost,
/// a symbol the module lacks is `NotFound`, an image the driver refuses `BadModule`.
fn module_err(e: DeviceError, load: bool) -> HalError {
    if e.is_context_lost() {
        return HalError::DeviceLost(e.to_string());
    }
    log::debug!("cuda: module call failed: {e}");
    match &e {
        DeviceError::Driver { code, .. } if code.contains("NOT_FOUND") => {
            HalError::Refused(ErrorCode::NotFound)
        }
        _ if load => HalError::Refused(ErrorCode::BadModule),
        _ => HalError::Refused(ErrorCode::InvalidArgument),
    }
}

fn symbol(name: &str) -> Result<CString> {
    CString::new(name).map_err(|_| HalError::InvalidArgument("symbol name with a NUL"))
}

impl<D: Device> CudaGpuOf<D> {
    fn modules_allowed(&self, ctx: ContextId) -> Result<()> {
        if !self.shared.cfg.guest_modules {
            return Err(HalError::Refused(ErrorCode::ModulesNeedWorker));
        }
        self.space(ctx).map(|_| ())
    }

    pub(super) fn load_module(&self, ctx: ContextId, module: u32, image: &[u8]) -> Result<()> {
        self.modules_allowed(ctx)?;
        {
            let modules = lock(&self.shared.modules);
            if modules.contains_key(&(ctx, module)) {
                return Err(HalError::InvalidArgument("module id in use"));
            }
            if modules.keys().filter(|k| k.0 == ctx).count() >= MAX_MODULES_PER_CONTEXT {
                return Err(HalError::TooMany("modules in the context"));
            }
        }
        let m = self
            .shared
            .dev
            .module_load(image)
            .map_err(|e| module_err(e, true))?;
        lock(&self.shared.modules).insert((ctx, module), m);
        log::debug!(
            "cuda: context {ctx:?} loaded module {module} ({} bytes)",
            image.len()
        );
        Ok(())
    }

    pub(super) fn unload_module(&self, ctx: ContextId, module: u32) -> Result<()> {
        self.modules_allowed(ctx)?;
        if !lock(&self.shared.modules).contains_key(&(ctx, module)) {
            return Err(HalError::Refused(ErrorCode::NotFound));
        }
        // New entries stop finding the functions; what was issued with them finishes
        // before the module goes.
        lock(&self.shared.functions).retain(|k, (m, _)| !(k.0 == ctx && *m == module));
        self.drain(&self.context_channels(ctx))?;
        let m = lock(&self.shared.modules)
            .remove(&(ctx, module))
            .ok_or(HalError::Refused(ErrorCode::NotFound))?;
        self.shared
            .dev
            .module_unload(m)
            .map_err(|e| module_err(e, false))
    }

    /// Forgets the functions a context bound.
    pub(super) fn unbind_functions(&self, ctx: ContextId) {
        lock(&self.shared.functions).retain(|k, _| k.0 != ctx);
    }

    /// Unloads every module of a context that is gone (its channels are drained).
    pub(super) fn forget_modules(&self, ctx: ContextId) {
        self.unbind_functions(ctx);
        let gone: Vec<D::Module> = {
            let mut modules = lock(&self.shared.modules);
            let keys: Vec<_> = modules.keys().filter(|k| k.0 == ctx).copied().collect();
            keys.iter().filter_map(|k| modules.remove(k)).collect()
        };
        for m in gone {
            if let Err(e) = self.shared.dev.module_unload(m) {
                log::warn!("cuda: unloading a module of destroyed context {ctx:?}: {e}");
            }
        }
    }

    pub(super) fn bind_function(
        &self,
        ctx: ContextId,
        module: u32,
        name: &str,
        function: u32,
    ) -> Result<Option<Vec<ParamInfo>>> {
        self.modules_allowed(ctx)?;
        let name = symbol(name)?;
        if lock(&self.shared.functions).contains_key(&(ctx, function)) {
            return Err(HalError::InvalidArgument("function id in use"));
        }
        let (handle, params) = {
            let modules = lock(&self.shared.modules);
            let m = modules
                .get(&(ctx, module))
                .ok_or(HalError::Refused(ErrorCode::NotFound))?;
            self.shared
                .dev
                .module_function(m, &name)
                .map_err(|e| module_err(e, false))?
        };
        let bound = BoundFunction {
            handle,
            params: params.clone(),
        };
        lock(&self.shared.functions).insert((ctx, function), (module, bound));
        Ok(params)
    }

    pub(super) fn module_global(
        &self,
        ctx: ContextId,
        module: u32,
        name: &str,
    ) -> Result<GlobalInfo> {
        self.modules_allowed(ctx)?;
        let name = symbol(name)?;
        let modules = lock(&self.shared.modules);
        let m = modules
            .get(&(ctx, module))
            .ok_or(HalError::Refused(ErrorCode::NotFound))?;
        let (addr, size) = self
            .shared
            .dev
            .module_global(m, &name)
            .map_err(|e| module_err(e, false))?;
        Ok(GlobalInfo { addr, size })
    }

    /// Copies `buf.len()` bytes at `offset` of `module`'s variable `name` out, or
    /// `data` in, in pieces as VRAM copies go.
    pub(super) fn module_variable(
        &self,
        ctx: ContextId,
        module: u32,
        name: &str,
        offset: u64,
        copy: VariableCopy<'_>,
    ) -> Result<()> {
        let g = self.module_global(ctx, module, name)?;
        let len = match &copy {
            VariableCopy::Out(b) => b.len(),
            VariableCopy::In(d) => d.len(),
        };
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > g.size)
        {
            return Err(HalError::InvalidArgument("range outside the variable"));
        }
        let dev = &self.shared.dev;
        let err = |e: DeviceError| module_err(e, false);
        const PIECE: usize = 64 << 20;
        let base = g.addr + offset;
        match copy {
            VariableCopy::Out(buf) => {
                for (i, piece) in buf.chunks_mut(PIECE).enumerate() {
                    let at = base + (i * PIECE) as u64;
                    // SAFETY: `piece` is a live mutable slice; `at..at+len` lies in the
                    // variable the driver reported (checked against `g.size` above).
                    unsafe { dev.copy_to_host(piece.as_mut_ptr(), at, piece.len()) }
                        .map_err(err)?;
                }
            }
            VariableCopy::In(data) => {
                for (i, piece) in data.chunks(PIECE).enumerate() {
                    let at = base + (i * PIECE) as u64;
                    // SAFETY: `piece` is a live slice; `at..at+len` lies in the variable.
                    unsafe { dev.copy_from_host(at, piece.as_ptr(), piece.len()) }.map_err(err)?;
                }
            }
        }
        Ok(())
    }
}

/// Which way [`CudaGpuOf::module_variable`] copies.
pub(super) enum VariableCopy<'a> {
    Out(&'a mut [u8]),
    In(&'a [u8]),
}
