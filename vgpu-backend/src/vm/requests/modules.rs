//! Requests on guests' modules (issue 31, docs/design/guest-modules.md): MODULE_LOAD,
//! MODULE_UNLOAD, FUNCTION_GET, GLOBAL_GET.
//!
//! The image is read from guest RAM once, into the backend's own buffer, before anything
//! looks at it; the GPU (its worker) gets that copy. Whether this GPU may run a guest's
//! code at all is the GPU's answer (`ModulesNeedCudaGpu` from the sim,
//! `ModulesNeedWorker` from the in-process `cuda` GPU).

use vgpu_protocol::module::{MAX_FUNCTION_PARAMS, MAX_MODULES_PER_CONTEXT};

/// The most bytes of module images one VM may hold loaded at once: the backend keeps
/// each image (a live migration loads it again on the destination).
pub const MAX_MODULE_BYTES_PER_VM: u64 = 256 << 20;
use vgpu_protocol::request::{module_len, FunctionReply};
use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::vm::session::{FunctionState, ModuleState};

impl Session {
    /// The module `module`, if (pid, ctx) owns it.
    fn owned_module(&self, pid: u32, ctx: u32, module: u32) -> Result<ModuleState, ErrorCode> {
        let m = self.state.modules.get(&module).ok_or(ErrorCode::NotFound)?;
        if m.pid != pid {
            return Err(ErrorCode::PermissionDenied);
        }
        if m.ctx != ctx {
            return Err(ErrorCode::NotFound);
        }
        Ok(m.clone())
    }

    pub(super) fn module_load(
        &mut self,
        pid: u32,
        ctx: u32,
        ranges: &[GuestRange],
        mem: &GuestMemory,
    ) -> Reply {
        // Arguments (the decoder checked them; a request built in process did not pass it).
        let len = module_len(ranges).map_err(|e| e.code())?;
        if !ranges.iter().all(|r| contains_range(mem, r.gpa, r.len)) {
            return Err(ErrorCode::InvalidArgument);
        }
        // Ownership, then limits.
        let (hctx, _) = self.owned_ctx(pid, ctx)?;
        let have = self.state.modules.values().filter(|m| m.ctx == ctx).count();
        if have >= MAX_MODULES_PER_CONTEXT {
            return Err(ErrorCode::LimitExceeded);
        }
        // The one read of the image: whatever the guest writes there afterwards, the GPU
        // compiles this copy.
        let held: u64 = self
            .state
            .modules
            .values()
            .map(|m| m.image.len() as u64)
            .sum();
        if held + len > MAX_MODULE_BYTES_PER_VM {
            return Err(ErrorCode::LimitExceeded);
        }
        let mut image = vec![0u8; len as usize];
        let mut at = 0usize;
        for r in ranges {
            let end = at + r.len as usize;
            mem.read_slice(&mut image[at..end], GuestAddress(r.gpa))
                .map_err(|_| ErrorCode::InvalidArgument)?;
            at = end;
        }
        self.load_image(pid, ctx, hctx, image.into())
    }

    /// Loads `image` for (pid, ctx) under a fresh module id (checked by the caller).
    pub(in crate::vm) fn load_image(
        &mut self,
        pid: u32,
        ctx: u32,
        hctx: vgpu_host_shim::ContextId,
        image: std::sync::Arc<[u8]>,
    ) -> Reply {
        let modules = &self.state.modules;
        let id = fresh_id(&mut self.state.last_module, |i| modules.contains_key(&i));
        self.gpu
            .module_load(hctx, id, &image)
            .map_err(|e| e.code())?;
        let len = image.len();
        self.state
            .modules
            .insert(id, ModuleState { pid, ctx, image });
        debug!("pid {pid}: context {ctx} loaded module {id} ({len} bytes)");
        Ok(ReplyBody::Module { module: id })
    }

    pub(super) fn module_unload(&mut self, pid: u32, ctx: u32, module: u32) -> Reply {
        self.owned_module(pid, ctx, module)?;
        let (hctx, _) = self.owned_ctx(pid, ctx)?;
        self.gpu.module_unload(hctx, module).map_err(|e| e.code())?;
        self.state.modules.remove(&module);
        self.state.functions.retain(|_, f| f.module != module);
        Ok(ReplyBody::Empty)
    }

    pub(in crate::vm) fn function_get(
        &mut self,
        pid: u32,
        ctx: u32,
        module: u32,
        name: &[u8],
    ) -> Reply {
        let name = std::str::from_utf8(name).map_err(|_| ErrorCode::InvalidArgument)?;
        self.owned_module(pid, ctx, module)?;
        let (hctx, _) = self.owned_ctx(pid, ctx)?;
        let functions = &self.state.functions;
        let id = fresh_id(&mut self.state.last_function, |i| {
            functions.contains_key(&i)
        });
        let params = self
            .gpu
            .function_get(hctx, module, name, id)
            .map_err(|e| e.code())?;
        if params
            .as_ref()
            .is_some_and(|p| p.len() > MAX_FUNCTION_PARAMS)
        {
            // The reply cannot describe it. The binding stays unused: it goes with the
            // module.
            return Err(ErrorCode::LimitExceeded);
        }
        self.state.functions.insert(
            id,
            FunctionState {
                pid,
                ctx,
                module,
                name: name.to_string(),
            },
        );
        Ok(ReplyBody::Function(FunctionReply {
            function: id,
            params,
        }))
    }

    pub(super) fn global_get(&mut self, pid: u32, ctx: u32, module: u32, name: &[u8]) -> Reply {
        let name = std::str::from_utf8(name).map_err(|_| ErrorCode::InvalidArgument)?;
        self.owned_module(pid, ctx, module)?;
        let (hctx, _) = self.owned_ctx(pid, ctx)?;
        let g = self
            .gpu
            .global_get(hctx, module, name)
            .map_err(|e| e.code())?;
        Ok(ReplyBody::Global {
            addr: g.addr,
            size: g.size,
        })
    }
}
