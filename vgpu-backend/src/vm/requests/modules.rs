//! Requests on guests' modules (issue 31, docs/design/guest-modules.md): MODULE_LOAD,
//! MODULE_UNLOAD, FUNCTION_GET, GLOBAL_GET, and copies to and from a module's globals
//! (GLOBAL_WRITE, GLOBAL_READ: `cuMemcpyHtoD`/`DtoH` at a global's address,
//! `cudaMemcpyToSymbol`).
//!
//! The image is read from guest RAM once, into the backend's own buffer, before anything
//! looks at it; the GPU (its worker) gets that copy. Whether this GPU may run a guest's
//! code at all is the GPU's answer (`ModulesNeedCudaGpu` from the sim,
//! `ModulesNeedWorker` from the in-process `cuda` GPU).

use vgpu_protocol::module::{MAX_FUNCTION_PARAMS, MAX_MODULES_PER_CONTEXT};

/// The most bytes of module images one VM may hold loaded at once: the backend keeps
/// each image (a live migration loads it again on the destination).
pub const MAX_MODULE_BYTES_PER_VM: u64 = 256 << 20;
use vgpu_protocol::module::valid_symbol;
use vgpu_protocol::request::{global_copy_len, module_len, FunctionReply, GlobalCopy};
use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::vm::session::{FunctionState, ModuleState};

/// Reads `ranges` of guest RAM, in order, into `buf` (exactly their total length): the
/// one read of a module image or a global copy's bytes.
fn read_guest(mem: &GuestMemory, ranges: &[GuestRange], buf: &mut [u8]) -> Result<(), ErrorCode> {
    let mut at = 0usize;
    for r in ranges {
        let end = at + r.len as usize;
        mem.read_slice(&mut buf[at..end], GuestAddress(r.gpa))
            .map_err(|_| ErrorCode::InvalidArgument)?;
        at = end;
    }
    Ok(())
}

/// Writes `data` (exactly the ranges' total length) into `ranges` of guest RAM, in order.
fn write_guest(mem: &GuestMemory, ranges: &[GuestRange], data: &[u8]) -> Result<(), ErrorCode> {
    let mut at = 0usize;
    for r in ranges {
        let end = at + r.len as usize;
        mem.write_slice(&data[at..end], GuestAddress(r.gpa))
            .map_err(|_| ErrorCode::InvalidArgument)?;
        at = end;
    }
    Ok(())
}

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
        read_guest(mem, ranges, &mut image)?;
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

    /// A global copy's target, checked: its arguments (ranges inside guest RAM, a valid
    /// name), then ownership of the module and context, then that the copy lies inside
    /// the global. The context, the name and the bytes to copy.
    fn global_copy_target<'c>(
        &self,
        pid: u32,
        ctx: u32,
        c: &'c GlobalCopy,
        mem: &GuestMemory,
    ) -> Result<(vgpu_host_shim::ContextId, &'c str, u64), ErrorCode> {
        let len = global_copy_len(&c.ranges).map_err(|e| e.code())?;
        if !c.ranges.iter().all(|r| contains_range(mem, r.gpa, r.len)) || !valid_symbol(&c.name) {
            return Err(ErrorCode::InvalidArgument);
        }
        let name = std::str::from_utf8(&c.name).map_err(|_| ErrorCode::InvalidArgument)?;
        self.owned_module(pid, ctx, c.module)?;
        let (hctx, _) = self.owned_ctx(pid, ctx)?;
        let g = self
            .gpu
            .global_get(hctx, c.module, name)
            .map_err(|e| e.code())?;
        if c.offset.checked_add(len).is_none_or(|end| end > g.size) {
            return Err(ErrorCode::InvalidArgument);
        }
        Ok((hctx, name, len))
    }

    /// GLOBAL_WRITE: the guest's bytes, read from its RAM once, into the global. The
    /// guest orders it against its own GPU work (its library waits for the context's
    /// work first, as a synchronous `cuMemcpyHtoD` does).
    pub(super) fn global_write(
        &mut self,
        pid: u32,
        ctx: u32,
        c: &GlobalCopy,
        mem: &GuestMemory,
    ) -> Reply {
        let (hctx, name, len) = self.global_copy_target(pid, ctx, c, mem)?;
        let mut data = vec![0u8; len as usize];
        read_guest(mem, &c.ranges, &mut data)?;
        self.gpu
            .global_write(hctx, c.module, name, c.offset, &data)
            .map_err(|e| e.code())?;
        Ok(ReplyBody::Empty)
    }

    /// GLOBAL_READ: the global's bytes into the guest's RAM.
    pub(super) fn global_read(
        &mut self,
        pid: u32,
        ctx: u32,
        c: &GlobalCopy,
        mem: &GuestMemory,
    ) -> Reply {
        let (hctx, name, len) = self.global_copy_target(pid, ctx, c, mem)?;
        let mut data = vec![0u8; len as usize];
        self.gpu
            .global_read(hctx, c.module, name, c.offset, &mut data)
            .map_err(|e| e.code())?;
        write_guest(mem, &c.ranges, &data)?;
        Ok(ReplyBody::Empty)
    }
}
