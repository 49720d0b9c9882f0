//! Guest modules (issue 31): a module image loaded into a context, its functions with
//! their parameter layouts, its globals, and building a launch's parameter buffer the way
//! `cuLaunchKernel`'s `kernelParams` does (docs/design/guest-modules.md).
//!
//! A buffer passed as a parameter becomes a relocation: the GPU replaces its GPU VA with
//! the device address before the kernel runs, and the kernel may touch the whole buffer.

use std::sync::Arc;

use vgpu_protocol::module::{FunctionLaunch, ParamInfo, Reloc};
use vgpu_protocol::Method;

use crate::buffer::Buffer;
use crate::context::CtxInner;
use crate::error::{Error, Result};

/// A module loaded into a context; unloaded when dropped (or by [`Module::unload`]).
pub struct Module {
    ctx: Arc<CtxInner>,
    id: u32,
    loaded: bool,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module").field("id", &self.id).finish()
    }
}

/// A function of a module: the id a launch names and, when the GPU knows it, the layout
/// of its parameter buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Function {
    pub id: u32,
    pub params: Option<Vec<ParamInfo>>,
}

/// A module global: its device address (pass it as a [`Arg::U64`], it needs no
/// relocation) and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Global {
    pub addr: u64,
    pub size: u64,
}

/// One kernel argument.
#[derive(Debug, Clone, Copy)]
pub enum Arg<'a> {
    /// A buffer's address, relocated by the GPU; `write`: the kernel writes it.
    Buffer(&'a Buffer, bool),
    U32(u32),
    U64(u64),
    F32(f32),
}

impl Arg<'_> {
    fn bytes(&self) -> Vec<u8> {
        match *self {
            Arg::Buffer(b, _) => b.gpu_va().to_le_bytes().to_vec(),
            Arg::U32(v) => v.to_le_bytes().to_vec(),
            Arg::U64(v) => v.to_le_bytes().to_vec(),
            Arg::F32(v) => v.to_le_bytes().to_vec(),
        }
    }
}

impl Function {
    /// The parameter buffer and relocations for `args`: at the layout's offsets when the
    /// GPU gave one (each argument's size must match its parameter's), else packed with
    /// natural alignment.
    pub fn params(&self, args: &[Arg<'_>]) -> Result<(Vec<u8>, Vec<Reloc>)> {
        let mut buf = Vec::new();
        let mut relocs = Vec::new();
        if let Some(layout) = &self.params {
            if layout.len() != args.len() {
                return Err(Error::InvalidArgument(
                    "argument count differs from the function's",
                ));
            }
        }
        for (i, a) in args.iter().enumerate() {
            let b = a.bytes();
            let at = match &self.params {
                Some(layout) => {
                    let p = layout[i];
                    if p.size as usize != b.len() {
                        return Err(Error::InvalidArgument(
                            "argument size differs from the parameter's",
                        ));
                    }
                    p.offset as usize
                }
                None => buf.len().next_multiple_of(b.len()),
            };
            if buf.len() < at + b.len() {
                buf.resize(at + b.len(), 0);
            }
            buf[at..at + b.len()].copy_from_slice(&b);
            if let Arg::Buffer(buffer, write) = *a {
                relocs.push(Reloc {
                    offset: at as u32,
                    write,
                    extent: buffer.len(),
                });
            }
        }
        if let Some(layout) = &self.params {
            let end = vgpu_protocol::module::param_bytes(layout) as usize;
            buf.resize(end.max(buf.len()), 0);
        }
        relocs.sort_by_key(|r| r.offset);
        Ok((buf, relocs))
    }

    /// The `LAUNCH_FUNCTION` method for `args`.
    pub fn launch(
        &self,
        grid: [u32; 3],
        block: [u32; 3],
        shared_mem: u32,
        args: &[Arg<'_>],
    ) -> Result<Method> {
        let (params, relocs) = self.params(args)?;
        let l = FunctionLaunch {
            function: self.id,
            grid,
            block,
            shared_mem,
            params,
            relocs,
        };
        vgpu_protocol::module::check_launch(&l).map_err(Error::InvalidArgument)?;
        Ok(Method::LaunchFunction(Box::new(l)))
    }
}

impl Module {
    pub(crate) fn load(ctx: &Arc<CtxInner>, image: &[u8]) -> Result<Self> {
        let id = ctx.transport.module_load(ctx.handle, image)?;
        Ok(Module {
            ctx: ctx.clone(),
            id,
            loaded: true,
        })
    }

    /// The device's id of the module.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Function `name` of the module.
    pub fn function(&self, name: &str) -> Result<Function> {
        let (id, params) = self
            .ctx
            .transport
            .function_get(self.ctx.handle, self.id, name)?;
        Ok(Function { id, params })
    }

    /// Global `name` of the module.
    pub fn global(&self, name: &str) -> Result<Global> {
        let (addr, size) = self
            .ctx
            .transport
            .global_get(self.ctx.handle, self.id, name)?;
        Ok(Global { addr, size })
    }

    /// Copies `data` to `offset` of the module's global `name`. Ordered after nothing:
    /// the caller waits for the context's GPU work that reads or writes the global.
    pub fn global_write(&self, name: &str, offset: u64, data: &[u8]) -> Result<()> {
        self.ctx
            .transport
            .global_write(self.ctx.handle, self.id, name, offset, data)
    }

    /// Reads `buf.len()` bytes from `offset` of the module's global `name` (after the
    /// caller waited for the work that writes it).
    pub fn global_read(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.ctx
            .transport
            .global_read(self.ctx.handle, self.id, name, offset, buf)
    }

    /// Unloads the module (after the context's channels finished what they were given).
    pub fn unload(mut self) -> Result<()> {
        self.loaded = false;
        self.ctx.transport.module_unload(self.ctx.handle, self.id)
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if self.loaded {
            if let Err(e) = self.ctx.transport.module_unload(self.ctx.handle, self.id) {
                log::debug!("unloading module {}: {e}", self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(params: Option<Vec<(u32, u32)>>) -> Function {
        Function {
            id: 3,
            params: params.map(|p| {
                p.into_iter()
                    .map(|(offset, size)| ParamInfo { offset, size })
                    .collect()
            }),
        }
    }

    #[test]
    fn packed_with_natural_alignment_without_a_layout() {
        let (buf, relocs) = f(None)
            .params(&[Arg::U32(1), Arg::U64(2), Arg::F32(1.5)])
            .unwrap();
        let mut want = vec![1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0];
        want.extend(1.5f32.to_le_bytes());
        assert_eq!(buf, want);
        assert!(relocs.is_empty());
    }

    #[test]
    fn placed_at_the_layouts_offsets_and_padded_to_its_end() {
        // A layout with a gap (an aligned struct after a u32) and trailing padding.
        let g = f(Some(vec![(0, 4), (16, 8)]));
        let (buf, _) = g.params(&[Arg::U32(7), Arg::U64(9)]).unwrap();
        assert_eq!(buf.len(), 24);
        assert_eq!(&buf[..4], &7u32.to_le_bytes());
        assert_eq!(&buf[16..], &9u64.to_le_bytes());
        assert!(buf[4..16].iter().all(|&b| b == 0));
    }

    #[test]
    fn arguments_that_do_not_fit_the_layout_are_refused() {
        let g = f(Some(vec![(0, 8), (8, 4)]));
        assert!(matches!(
            g.params(&[Arg::U32(1), Arg::U32(2)]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            g.params(&[Arg::U64(1)]),
            Err(Error::InvalidArgument(_))
        ));
        let launch = g.launch([1, 1, 1], [2048, 1, 1], 0, &[Arg::U64(1), Arg::U32(2)]);
        assert!(matches!(launch, Err(Error::InvalidArgument("block"))));
        let Ok(Method::LaunchFunction(l)) =
            g.launch([2, 1, 1], [32, 1, 1], 0, &[Arg::U64(1), Arg::U32(2)])
        else {
            panic!("a launch");
        };
        assert_eq!((l.function, l.params.len()), (3, 12));
    }
}
