//! Guests' modules in a live migration: each module's image, the contents of its
//! variables (`__device__` and `__constant__`, listed from the image: CUDA has no call
//! that lists them) and its function bindings are saved with the paused VM, and loaded,
//! written back and bound again on the destination under the same ids.

use log::debug;
use vgpu_host_shim::HalError;
use vgpu_protocol::migration::{FunctionRecord, ModuleRecord, ModulesRecord};
use vgpu_protocol::module::MAX_MODULE_BYTES;
use vgpu_protocol::module_image::module_variables;
use vgpu_protocol::request::ReplyBody;
use vgpu_protocol::ErrorCode;

use super::load::with_id;
use super::MigrationError;
use crate::vm::session::Session;

/// The largest module variable a migration carries (1 GiB): a bigger one refuses it.
pub const MAX_VARIABLE_BYTES: u64 = 1 << 30;

fn restore_err(what: &'static str, id: u32) -> impl FnOnce(ErrorCode) -> MigrationError {
    move |code| MigrationError::Restore {
        what,
        id: u64::from(id),
        code,
    }
}

impl Session {
    /// The modules record of the paused VM: images, variables' contents, bindings.
    pub(super) fn save_modules(&mut self) -> Result<ModulesRecord, MigrationError> {
        let mut modules = Vec::with_capacity(self.state.modules.len());
        for (&id, m) in &self.state.modules {
            let names = module_variables(&m.image)
                .map_err(|why| MigrationError::ModuleVariables { module: id, why })?;
            let (hctx, _) = self
                .owned_ctx(m.pid, m.ctx)
                .map_err(|code| MigrationError::Read {
                    what: "module",
                    id: u64::from(id),
                    detail: format!("its context: {code:?}"),
                })?;
            let read = |detail: String| MigrationError::Read {
                what: "module",
                id: u64::from(id),
                detail,
            };
            let mut variables = Vec::with_capacity(names.len());
            for name in names {
                let size = match self.gpu.global_get(hctx, id, &name) {
                    Ok(g) => g.size,
                    // Declared but not in the loaded module (compiled away): nothing to keep.
                    Err(HalError::Refused(ErrorCode::NotFound)) => {
                        debug!("module {id}: variable {name} is not in the loaded module");
                        continue;
                    }
                    Err(e) => return Err(read(format!("variable {name}: {e}"))),
                };
                if size > MAX_VARIABLE_BYTES {
                    return Err(read(format!("variable {name} has {size} bytes")));
                }
                let mut data = vec![0u8; size as usize];
                self.gpu
                    .global_read(hctx, id, &name, 0, &mut data)
                    .map_err(|e| read(format!("variable {name}: {e}")))?;
                variables.push((name, data));
            }
            modules.push(ModuleRecord {
                id,
                pid: m.pid,
                ctx: m.ctx,
                image: m.image.to_vec(),
                variables,
            });
        }
        let functions = self
            .state
            .functions
            .iter()
            .map(|(&id, f)| FunctionRecord {
                id,
                pid: f.pid,
                ctx: f.ctx,
                module: f.module,
                name: f.name.clone(),
            })
            .collect();
        Ok(ModulesRecord {
            last_module: self.state.last_module,
            last_function: self.state.last_function,
            modules,
            functions,
        })
    }

    /// Loads, writes back and binds `rec`'s modules at their ids (their contexts exist),
    /// through the checks a guest's requests get.
    pub(super) fn restore_modules(&mut self, rec: &ModulesRecord) -> Result<(), MigrationError> {
        for m in &rec.modules {
            let e = || restore_err("module", m.id);
            if m.image.is_empty() || m.image.len() as u64 > MAX_MODULE_BYTES {
                return Err(e()(ErrorCode::InvalidArgument));
            }
            let (hctx, _) = self.owned_ctx(m.pid, m.ctx).map_err(e())?;
            if self.state.modules.contains_key(&m.id) {
                return Err(e()(ErrorCode::InvalidArgument));
            }
            with_id(&mut self.state.last_module, m.id).map_err(e())?;
            match self.load_image(m.pid, m.ctx, hctx, m.image.as_slice().into()) {
                Ok(ReplyBody::Module { module }) if module == m.id => {}
                Ok(_) => return Err(e()(ErrorCode::InvalidArgument)),
                Err(code) => return Err(e()(code)),
            }
            for (name, data) in &m.variables {
                let g = self
                    .gpu
                    .global_get(hctx, m.id, name)
                    .map_err(|x| e()(x.code()))?;
                if g.size != data.len() as u64 {
                    return Err(e()(ErrorCode::InvalidArgument));
                }
                self.gpu
                    .global_write(hctx, m.id, name, 0, data)
                    .map_err(|x| e()(x.code()))?;
            }
        }
        for f in &rec.functions {
            let e = || restore_err("function", f.id);
            if self.state.functions.contains_key(&f.id) {
                return Err(e()(ErrorCode::InvalidArgument));
            }
            with_id(&mut self.state.last_function, f.id).map_err(e())?;
            match self.function_get(f.pid, f.ctx, f.module, f.name.as_bytes()) {
                Ok(ReplyBody::Function(r)) if r.function == f.id => {}
                Ok(_) => return Err(e()(ErrorCode::InvalidArgument)),
                Err(code) => return Err(e()(code)),
            }
        }
        self.state.last_module = self.state.last_module.max(rec.last_module);
        self.state.last_function = self.state.last_function.max(rec.last_function);
        Ok(())
    }
}
