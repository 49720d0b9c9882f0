//! The native transport: the runtime drives a `Gpu` from host-shim in this process.
//!
//! It is the baseline the virtualized transports are measured against. VRAM CPU views
//! and control pages are `mmap`s of the GPU's memfds; host memory is anonymous memory
//! registered in a per-context region table that the GPU's MMU resolves SYSRAM
//! addresses through (identity map: the GPU address of host memory is its host address).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use vgpu_host_shim::hal::{
    ChannelConfig, ChannelId, ContextId, EventSink, Gpu, GpuEvent, HostRange, MapFlags, MapTarget,
    PageSize, SysMemory, VramAlloc,
};
use vgpu_protocol::{ErrorCode, PAGE_SIZE};

use crate::error::{Error, Result};
use crate::mmap::Mmap;
use crate::transport::{
    ChanHandle, ChannelDesc, CpuPtr, CtxHandle, DeviceInfo, MemHandle, NewContext, Transport,
};
use crate::wait::EventCount;

/// The host memory a context's GPU mappings may reach: start address → length.
///
/// Only ranges the runtime allocated and registered translate; everything else is
/// rejected, so a stray SYSRAM address faults the channel instead of reading the process.
#[derive(Debug, Default)]
pub struct HostRegions {
    regions: RwLock<BTreeMap<u64, u64>>,
}

impl HostRegions {
    fn insert(&self, start: u64, len: u64) {
        self.write().insert(start, len);
    }

    fn remove(&self, start: u64) {
        self.write().remove(&start);
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<u64, u64>> {
        self.regions.write().unwrap_or_else(|p| p.into_inner())
    }
}

impl SysMemory for HostRegions {
    fn translate(&self, addr: u64, len: u64) -> Option<HostRange> {
        if len == 0 {
            return None;
        }
        let regions = self.regions.read().unwrap_or_else(|p| p.into_inner());
        let (&start, &rlen) = regions.range(..=addr).next_back()?;
        let end = start.checked_add(rlen)?;
        if addr >= end {
            return None;
        }
        let n = usize::try_from(len.min(end - addr)).ok()?;
        Some(HostRange {
            ptr: addr as *mut u8,
            len: n,
        })
    }
}

/// Logs GPU events and counts those a waiter sleeps on (fence wake-ups, errors); channel
/// state itself is read from the control page.
struct WakeSink(Arc<EventCount>);

impl EventSink for WakeSink {
    fn event(&self, ev: GpuEvent) {
        match ev {
            GpuEvent::Fence { channel, reference } => {
                log::trace!("channel {}: fence wake-up at REF {reference}", channel.0);
                self.0.bump();
            }
            GpuEvent::Notify { channel, token } => {
                log::debug!("channel {}: notify {token:#x}", channel.0)
            }
            GpuEvent::Error {
                channel,
                code,
                info,
            } => {
                log::debug!("channel {}: error {code} (info {info:#x})", channel.0);
                self.0.bump();
            }
        }
    }
}

enum Backing {
    Vram { alloc: VramAlloc, cpu: Option<Mmap> },
    Host { map: Mmap },
}

struct Mem {
    ctx: CtxHandle,
    size: u64,
    backing: Backing,
}

struct Ctx {
    id: ContextId,
    sysmem: Arc<HostRegions>,
}

struct Chan {
    ctx: CtxHandle,
    /// The mapped control page; kept until the channel is destroyed.
    _page: Mmap,
}

#[derive(Default)]
struct State {
    contexts: HashMap<CtxHandle, Ctx>,
    mems: HashMap<MemHandle, Mem>,
    channels: HashMap<ChanHandle, Chan>,
}

/// A transport over a `Gpu` in this process.
pub struct NativeTransport {
    gpu: Arc<dyn Gpu>,
    state: Mutex<State>,
    next_mem: AtomicU64,
    /// Module and function ids this transport hands the GPU (the owner chooses them).
    next_module: std::sync::atomic::AtomicU32,
    next_function: std::sync::atomic::AtomicU32,
    /// The GPU's fence wake-ups and errors, which blocked waiters sleep on.
    events: Arc<EventCount>,
}

impl NativeTransport {
    pub fn new(gpu: Arc<dyn Gpu>) -> Self {
        NativeTransport {
            gpu,
            state: Mutex::new(State::default()),
            next_mem: AtomicU64::new(1),
            next_module: std::sync::atomic::AtomicU32::new(1),
            next_function: std::sync::atomic::AtomicU32::new(1),
            events: Arc::default(),
        }
    }

    /// The GPU this transport drives (tests read its counters).
    pub fn gpu(&self) -> &Arc<dyn Gpu> {
        &self.gpu
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ctx_id(state: &State, ctx: CtxHandle) -> Result<ContextId> {
        state
            .contexts
            .get(&ctx)
            .map(|c| c.id)
            .ok_or(Error::UnknownHandle("context"))
    }

    fn insert_mem(&self, state: &mut State, mem: Mem) -> MemHandle {
        let h = MemHandle(self.next_mem.fetch_add(1, Ordering::Relaxed));
        state.mems.insert(h, mem);
        h
    }

    /// Releases what a memory object holds. Host memory leaves the region table before
    /// it is unmapped, so the GPU can no longer translate to it.
    fn release_mem(&self, state: &State, mem: Mem) -> Result<()> {
        match mem.backing {
            Backing::Vram { alloc, cpu } => {
                drop(cpu);
                self.gpu.free_vram(alloc.offset)?;
            }
            Backing::Host { map } => {
                if let Some(c) = state.contexts.get(&mem.ctx) {
                    c.sysmem.remove(map.as_ptr() as u64);
                    // Waits until no engine still uses a pointer into the mapping. A
                    // destroyed context fails here, but its teardown already waited.
                    let _ = self.gpu.invalidate_tlb(c.id);
                }
                drop(map);
            }
        }
        Ok(())
    }
}

fn cpu_ptr(map: &Mmap) -> CpuPtr {
    // SAFETY: the mapping is owned by the transport's state and dropped only when the
    // object is freed, which is the validity contract of `CpuPtr`.
    unsafe { CpuPtr::new(map.as_non_null(), map.len()) }
}

fn usize_of(v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::InvalidArgument("size does not fit the host"))
}

impl Transport for NativeTransport {
    fn module_load(&self, ctx: CtxHandle, image: &[u8]) -> Result<u32> {
        let id = Self::ctx_id(&self.state(), ctx)?;
        let module = self.next_module.fetch_add(1, Ordering::Relaxed);
        self.gpu.module_load(id, module, image)?;
        Ok(module)
    }

    fn module_unload(&self, ctx: CtxHandle, module: u32) -> Result<()> {
        let id = Self::ctx_id(&self.state(), ctx)?;
        Ok(self.gpu.module_unload(id, module)?)
    }

    fn function_get(
        &self,
        ctx: CtxHandle,
        module: u32,
        name: &str,
    ) -> Result<(u32, Option<Vec<vgpu_protocol::module::ParamInfo>>)> {
        let id = Self::ctx_id(&self.state(), ctx)?;
        let function = self.next_function.fetch_add(1, Ordering::Relaxed);
        let params = self.gpu.function_get(id, module, name, function)?;
        Ok((function, params))
    }

    fn global_get(&self, ctx: CtxHandle, module: u32, name: &str) -> Result<(u64, u64)> {
        let id = Self::ctx_id(&self.state(), ctx)?;
        let g = self.gpu.global_get(id, module, name)?;
        Ok((g.addr, g.size))
    }

    fn global_write(
        &self,
        ctx: CtxHandle,
        module: u32,
        name: &str,
        offset: u64,
        data: &[u8],
    ) -> Result<()> {
        let id = Self::ctx_id(&self.state(), ctx)?;
        Ok(self.gpu.global_write(id, module, name, offset, data)?)
    }

    fn global_read(
        &self,
        ctx: CtxHandle,
        module: u32,
        name: &str,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        let id = Self::ctx_id(&self.state(), ctx)?;
        Ok(self.gpu.global_read(id, module, name, offset, buf)?)
    }

    fn info(&self) -> Result<DeviceInfo> {
        let i = self.gpu.info();
        Ok(DeviceInfo {
            transport: "native",
            name: i.name,
            protocol_version: vgpu_protocol::PROTOCOL_VERSION,
            vram_bytes: i.vram_bytes,
            compute_engines: i.compute_engines,
            max_channels: i.max_channels,
            max_contexts: i.max_contexts,
        })
    }

    fn create_context(&self) -> Result<NewContext> {
        let sysmem = Arc::new(HostRegions::default());
        let id = self.gpu.create_context(sysmem.clone())?;
        let h = CtxHandle(id.0 as u64);
        self.state().contexts.insert(h, Ctx { id, sysmem });
        Ok(NewContext {
            handle: h,
            huge_slot: None,
        })
    }

    fn destroy_context(&self, ctx: CtxHandle) -> Result<()> {
        let mut st = self.state();
        let c = st
            .contexts
            .get(&ctx)
            .ok_or(Error::UnknownHandle("context"))?;
        // The GPU stops using the address space (and its channels) before any memory it
        // could reach is released.
        self.gpu.destroy_context(c.id)?;
        st.channels.retain(|_, ch| ch.ctx != ctx);
        let mems: Vec<MemHandle> = st
            .mems
            .iter()
            .filter(|(_, m)| m.ctx == ctx)
            .map(|(h, _)| *h)
            .collect();
        for h in mems {
            if let Some(m) = st.mems.remove(&h) {
                if let Err(e) = self.release_mem(&st, m) {
                    log::warn!("freeing leftover memory of context {}: {e}", ctx.0);
                }
            }
        }
        st.contexts.remove(&ctx);
        Ok(())
    }

    fn alloc_vram(&self, ctx: CtxHandle, size: u64, align: u64) -> Result<MemHandle> {
        let mut st = self.state();
        Self::ctx_id(&st, ctx)?;
        let alloc = self.gpu.alloc_vram(size, align)?;
        let mem = Mem {
            ctx,
            size,
            backing: Backing::Vram { alloc, cpu: None },
        };
        Ok(self.insert_mem(&mut st, mem))
    }

    fn alloc_host(&self, ctx: CtxHandle, size: u64, align: u64) -> Result<MemHandle> {
        let map = Mmap::anonymous(usize_of(size)?, usize_of(align)?)?;
        let mut st = self.state();
        let c = st
            .contexts
            .get(&ctx)
            .ok_or(Error::UnknownHandle("context"))?;
        c.sysmem.insert(map.as_ptr() as u64, map.len() as u64);
        let mem = Mem {
            ctx,
            size,
            backing: Backing::Host { map },
        };
        Ok(self.insert_mem(&mut st, mem))
    }

    fn free_mem(&self, ctx: CtxHandle, mem: MemHandle) -> Result<()> {
        let mut st = self.state();
        match st.mems.get(&mem) {
            Some(m) if m.ctx == ctx => {}
            _ => return Err(Error::UnknownHandle("memory")),
        }
        let m = st.mems.remove(&mem).ok_or(Error::UnknownHandle("memory"))?;
        self.release_mem(&st, m)
    }

    fn cpu_map(&self, ctx: CtxHandle, mem: MemHandle) -> Result<CpuPtr> {
        let vram = self.gpu.vram_fd();
        let mut st = self.state();
        let m = st
            .mems
            .get_mut(&mem)
            .filter(|m| m.ctx == ctx)
            .ok_or(Error::UnknownHandle("memory"))?;
        match &mut m.backing {
            Backing::Host { map } => Ok(cpu_ptr(map)),
            Backing::Vram { alloc, cpu } => {
                if cpu.is_none() {
                    // A GPU without a CPU view of VRAM: the buffer stages through copies.
                    let vram = vram.ok_or(Error::Device(ErrorCode::Unsupported))?;
                    let offset = vram
                        .offset
                        .checked_add(alloc.offset)
                        .ok_or(Error::InvalidArgument("VRAM offset overflows"))?;
                    *cpu = Some(Mmap::shared(vram.fd, offset, usize_of(m.size)?)?);
                }
                cpu.as_ref()
                    .map(cpu_ptr)
                    .ok_or(Error::UnknownHandle("memory"))
            }
        }
    }

    fn gpu_map(
        &self,
        ctx: CtxHandle,
        mem: MemHandle,
        va: u64,
        page: PageSize,
        flags: MapFlags,
    ) -> Result<()> {
        let st = self.state();
        let id = Self::ctx_id(&st, ctx)?;
        let m = st
            .mems
            .get(&mem)
            .filter(|m| m.ctx == ctx)
            .ok_or(Error::UnknownHandle("memory"))?;
        let target = match &m.backing {
            Backing::Vram { alloc, .. } => MapTarget::Vram {
                offset: alloc.offset,
            },
            Backing::Host { map } => MapTarget::Sysram {
                addr: map.as_ptr() as u64,
            },
        };
        self.gpu.map(id, va, m.size, target, page, flags)?;
        self.gpu.invalidate_tlb(id)?;
        Ok(())
    }

    fn gpu_unmap(&self, ctx: CtxHandle, va: u64, size: u64) -> Result<()> {
        let st = self.state();
        let id = Self::ctx_id(&st, ctx)?;
        self.gpu.unmap(id, va, size)?;
        self.gpu.invalidate_tlb(id)?;
        Ok(())
    }

    fn create_channel(
        &self,
        ctx: CtxHandle,
        gp_ring_va: u64,
        gp_entries: u32,
    ) -> Result<ChannelDesc> {
        let mut st = self.state();
        let id = Self::ctx_id(&st, ctx)?;
        let cfg = ChannelConfig {
            gp_ring_va,
            gp_entries,
        };
        let ch = self
            .gpu
            .create_channel(id, cfg, Arc::new(WakeSink(self.events.clone())))?;
        let page = self
            .gpu
            .control_page(ch)
            .map_err(Error::from)
            .and_then(|r| Mmap::shared(r.fd, r.offset, PAGE_SIZE as usize));
        let page = match page {
            Ok(p) => p,
            Err(e) => {
                if let Err(e2) = self.gpu.destroy_channel(ch) {
                    log::warn!("destroying half-created channel {}: {e2}", ch.0);
                }
                return Err(e);
            }
        };
        let handle = ChanHandle(ch.0 as u64);
        let control = cpu_ptr(&page);
        st.channels.insert(handle, Chan { ctx, _page: page });
        Ok(ChannelDesc {
            handle,
            control,
            forwarded: false,
        })
    }

    fn destroy_channel(&self, ctx: CtxHandle, ch: ChanHandle) -> Result<()> {
        let mut st = self.state();
        match st.channels.get(&ch) {
            Some(c) if c.ctx == ctx => {}
            _ => return Err(Error::UnknownHandle("channel")),
        }
        let id = ChannelId(u32::try_from(ch.0).map_err(|_| Error::UnknownHandle("channel"))?);
        self.gpu.destroy_channel(id)?;
        st.channels.remove(&ch);
        Ok(())
    }

    fn doorbell(&self, ch: ChanHandle) {
        // Rung only when the front end asked (as a guest's is), so the native baseline
        // gets no wake-up a guest does not.
        if let Ok(id) = u32::try_from(ch.0) {
            self.gpu.doorbell(ChannelId(id));
        }
    }

    fn device_events(&self, _ctx: CtxHandle, _ch: ChanHandle) -> Option<u64> {
        Some(self.events.get())
    }

    fn wait_device_events(
        &self,
        _ctx: CtxHandle,
        _ch: ChanHandle,
        _fence: u32,
        seen: u64,
        timeout: std::time::Duration,
    ) -> bool {
        self.events.wait(seen, timeout)
    }
}

impl Drop for NativeTransport {
    fn drop(&mut self) {
        let ctxs: Vec<CtxHandle> = self.state().contexts.keys().copied().collect();
        for c in ctxs {
            if let Err(e) = self.destroy_context(c) {
                log::warn!("destroying context {} at shutdown: {e}", c.0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_translate_only_what_is_registered() {
        let r = HostRegions::default();
        r.insert(0x10000, 0x2000);
        assert!(r.translate(0xffff, 4).is_none());
        let h = r.translate(0x11000, 0x5000).unwrap();
        assert_eq!(h.ptr as u64, 0x11000);
        assert_eq!(h.len, 0x1000);
        assert!(r.translate(0x12000, 1).is_none());
        assert!(r.translate(0x10000, 0).is_none());
        r.remove(0x10000);
        assert!(r.translate(0x10000, 4).is_none());
    }
}
