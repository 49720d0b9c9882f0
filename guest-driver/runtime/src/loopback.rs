//! The loopback transport: resource requests go over the vgpu device's control virtqueue
//! to a real `vgpu-backend` through the loopback vhost-user frontend, exactly as a guest
//! driver would send them; channel control pages and VRAM apertures are pages the backend
//! mapped into the device's shared-memory window (the BAR). Host buffers are guest RAM
//! handed to the backend as guest-physical scatter-gather lists.
//!
//! A VM without the shared-memory region (forwarded submission, `LoopbackConfig::forwarded`)
//! gets channels without a page of the GPU's: the transport hands out a page of its own,
//! submits with `SUBMIT` and fills that page from `CHANNEL_STATUS` replies; VRAM has no
//! aperture (`MAP_APERTURE` is `Unsupported`, so buffers are staged through guest RAM).

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use std::sync::atomic::Ordering;

use vgpu_loopback::{GuestAlloc, LoopbackVm};
use vgpu_protocol::device::{slot_offset, NO_SLOT};
use vgpu_protocol::mem::{MapFlags, PageSize};
use vgpu_protocol::request::{
    decode_reply, GlobalCopy, GuestRange, Op, ReplyBody, Request, MAP_READ_ONLY,
    MAX_GLOBAL_COPY_BYTES, PAGE_2M, PAGE_4K, PAGE_64K,
};
use vgpu_protocol::ControlPage;
use vgpu_protocol::ErrorCode;

use crate::error::{Error, Result};
use crate::transport::{
    ChanHandle, ChannelDesc, CpuPtr, CtxHandle, DeviceInfo, LostProbe, MemHandle, NewContext,
    Transport,
};

enum Backing {
    Vram { mem: u32, aperture: Option<u64> },
    Host { alloc: GuestAlloc },
}

struct Mem {
    ctx: CtxHandle,
    size: u64,
    backing: Backing,
}

/// A forwarded channel's copy of its control page (4 KiB, 8-aligned, zeroed).
struct StatusPage(Box<[std::sync::atomic::AtomicU64; 512]>);

impl StatusPage {
    fn new() -> Self {
        StatusPage(Box::new(std::array::from_fn(|_| {
            std::sync::atomic::AtomicU64::new(0)
        })))
    }

    fn ptr(&self) -> *mut u8 {
        self.0.as_ptr() as *mut u8
    }

    fn word(&self, field: usize) -> &std::sync::atomic::AtomicU32 {
        debug_assert!(field.is_multiple_of(4) && field < vgpu_protocol::ControlPage::USED_BYTES);
        // SAFETY: `field` is a 4-aligned control-page offset inside the 4 KiB page the
        // box owns (8-aligned); an AtomicU32 view of part of an AtomicU64's memory is
        // plain shared memory accessed atomically, as the GPU's page is.
        unsafe { &*(self.ptr().add(field) as *const std::sync::atomic::AtomicU32) }
    }
}

#[derive(Default)]
struct State {
    mems: HashMap<MemHandle, Mem>,
    /// Forwarded channels' pages, by channel (kept until the channel is destroyed).
    status: HashMap<ChanHandle, Arc<StatusPage>>,
    next: u64,
}

/// One guest "process" (identified by `pid`) talking to the device of a loopback VM.
pub struct LoopbackTransport {
    vm: Arc<LoopbackVm>,
    pid: u32,
    /// The device generation this process started in: after a reset under it (the
    /// backend restarted) its requests fail with `DeviceLost`, as `/dev/vgpu` files do.
    epoch: u64,
    state: Mutex<State>,
}

fn page_code(page: PageSize) -> u32 {
    match page {
        PageSize::Small4K => PAGE_4K,
        PageSize::Big64K => PAGE_64K,
        PageSize::Huge2M => PAGE_2M,
    }
}

fn vm_err(e: vgpu_loopback::LoopbackError) -> Error {
    use vgpu_loopback::LoopbackError as E;
    match e {
        E::DeviceReset | E::Disconnected | E::Timeout(_) => Error::DeviceLost,
        e => transport_err(e),
    }
}

fn transport_err(e: impl std::fmt::Display) -> Error {
    Error::Os {
        what: "loopback device",
        source: std::io::Error::other(e.to_string()),
    }
}

impl LoopbackTransport {
    pub fn new(vm: Arc<LoopbackVm>, pid: u32) -> Self {
        LoopbackTransport {
            epoch: vm.epoch(),
            vm,
            pid,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends one request and decodes its reply.
    fn call(&self, ctx: u32, op: Op) -> Result<ReplyBody> {
        let req = Request {
            pid: self.pid,
            ctx,
            op,
        };
        let reply = self
            .vm
            .request_in(self.epoch, &req.encode())
            .map_err(vm_err)?;
        match decode_reply(req.opcode(), &reply).map_err(transport_err)? {
            Ok(body) => Ok(body),
            Err(code) => Err(Error::Device(code)),
        }
    }

    /// A copy of `len` bytes between a module global and guest RAM, in requests of at
    /// most [`MAX_GLOBAL_COPY_BYTES`], each through a guest RAM buffer of its own that
    /// `fill` writes before a write's request, or reads after a read's.
    #[allow(clippy::too_many_arguments)]
    fn global_copy(
        &self,
        ctx: CtxHandle,
        module: u32,
        name: &str,
        offset: u64,
        len: usize,
        dir: GlobalCopyDir,
        mut fill: impl FnMut(usize, usize, *mut u8),
    ) -> Result<()> {
        let ctx = Self::ctx_id(ctx)?;
        let mut at = 0usize;
        while at < len {
            let piece = (len - at).min(MAX_GLOBAL_COPY_BYTES as usize);
            let alloc = self
                .vm
                .alloc_guest(piece as u64, 4096)
                .map_err(transport_err)?;
            if dir == GlobalCopyDir::Write {
                fill(piece, at, alloc.ptr);
            }
            let copy = GlobalCopy {
                module,
                name: name.as_bytes().to_vec(),
                offset: offset.saturating_add(at as u64),
                ranges: vec![GuestRange {
                    gpa: alloc.gpa,
                    len: piece as u64,
                }],
            };
            let op = match dir {
                GlobalCopyDir::Write => Op::GlobalWrite(copy),
                GlobalCopyDir::Read => Op::GlobalRead(copy),
            };
            let r = self.call(ctx, op);
            if r.is_ok() && dir == GlobalCopyDir::Read {
                fill(piece, at, alloc.ptr);
            }
            if let Err(e) = self.vm.free_guest(alloc.gpa) {
                log::warn!("freeing a global copy's guest memory: {e}");
            }
            r?;
            at += piece;
        }
        Ok(())
    }

    fn ctx_id(ctx: CtxHandle) -> Result<u32> {
        u32::try_from(ctx.0).map_err(|_| Error::UnknownHandle("context"))
    }

    fn shm_ptr(&self, offset: u64, len: u64) -> Result<CpuPtr> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.vm.shm_len())
            .ok_or(Error::Device(ErrorCode::Internal))?;
        let _ = end;
        let p = self.vm.shm_base().wrapping_add(offset as usize);
        let p = NonNull::new(p).ok_or(Error::Device(ErrorCode::Internal))?;
        // SAFETY: the range lies inside the VM's shared-memory window (checked above),
        // which stays reserved while the LoopbackVm lives; the backend keeps the page
        // mapped there until the object is destroyed through this transport.
        Ok(unsafe { CpuPtr::new(p, len as usize) })
    }

    fn release(&self, m: Mem) -> Result<()> {
        let ctx = Self::ctx_id(m.ctx)?;
        match m.backing {
            Backing::Vram { mem, aperture } => {
                if aperture.is_some() {
                    self.call(ctx, Op::UnmapAperture { mem })?;
                }
                self.call(ctx, Op::FreeMem { mem })?;
            }
            Backing::Host { alloc } => {
                self.vm.free_guest(alloc.gpa).map_err(transport_err)?;
            }
        }
        Ok(())
    }
}

/// Which way a global copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GlobalCopyDir {
    Write,
    Read,
}

impl Drop for LoopbackTransport {
    /// The process ends: its guest RAM goes back to the VM, as a process's memory goes
    /// back to the guest kernel, whether or not it freed its buffers (a process killed,
    /// or one whose device was reset under it).
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for (_, m) in std::mem::take(&mut st.mems) {
            if let Backing::Host { alloc } = m.backing {
                if let Err(e) = self.vm.free_guest(alloc.gpa) {
                    log::warn!("freeing guest memory of an ended process: {e}");
                }
            }
        }
    }
}

impl Transport for LoopbackTransport {
    fn info(&self) -> Result<DeviceInfo> {
        match self.call(0, Op::GetInfo)? {
            ReplyBody::Info(i) => Ok(DeviceInfo {
                transport: "loopback",
                name: "vgpu (loopback)".into(),
                protocol_version: i.version,
                vram_bytes: i.vram_bytes,
                compute_engines: i.compute_engines,
                max_channels: i.channel_slots,
                max_contexts: i.max_contexts,
            }),
            _ => Err(Error::Device(ErrorCode::Internal)),
        }
    }

    fn device_attributes(&self) -> Result<Vec<(u32, i32)>> {
        match self.call(0, Op::GetAttributes)? {
            ReplyBody::Attributes(pairs) => Ok(pairs),
            _ => Err(Error::Device(ErrorCode::Internal)),
        }
    }

    fn create_context(&self) -> Result<NewContext> {
        match self.call(0, Op::CreateContext)? {
            ReplyBody::Context { ctx, huge_slot } => Ok(NewContext {
                handle: CtxHandle(ctx as u64),
                huge_slot,
            }),
            _ => Err(Error::Device(ErrorCode::Internal)),
        }
    }

    fn destroy_context(&self, ctx: CtxHandle) -> Result<()> {
        // The backend frees the context's channels, mappings and VRAM; guest RAM is ours,
        // and is freed whatever the device answered: after a device reset (`DeviceLost`)
        // nothing of the context is left there, and its RAM must not leak with it.
        let destroyed = self.call(Self::ctx_id(ctx)?, Op::DestroyContext);
        let mut st = self.state();
        let handles: Vec<MemHandle> = st
            .mems
            .iter()
            .filter(|(_, m)| m.ctx == ctx)
            .map(|(h, _)| *h)
            .collect();
        for h in handles {
            if let Some(Mem {
                backing: Backing::Host { alloc },
                ..
            }) = st.mems.remove(&h)
            {
                if let Err(e) = self.vm.free_guest(alloc.gpa) {
                    log::warn!("freeing guest memory of a destroyed context: {e}");
                }
            }
        }
        destroyed.map(|_| ())
    }

    fn alloc_vram(&self, ctx: CtxHandle, size: u64, align: u64) -> Result<MemHandle> {
        let (mem, size) = match self.call(Self::ctx_id(ctx)?, Op::AllocVram { size, align })? {
            ReplyBody::Mem { mem, size } => (mem, size),
            _ => return Err(Error::Device(ErrorCode::Internal)),
        };
        let mut st = self.state();
        st.next += 1;
        let h = MemHandle(st.next);
        st.mems.insert(
            h,
            Mem {
                ctx,
                size,
                backing: Backing::Vram {
                    mem,
                    aperture: None,
                },
            },
        );
        Ok(h)
    }

    fn alloc_host(&self, ctx: CtxHandle, size: u64, align: u64) -> Result<MemHandle> {
        let alloc = self.vm.alloc_guest(size, align).map_err(transport_err)?;
        // SAFETY: `alloc` is a fresh allocation of `alloc.len` bytes of guest RAM mapped
        // in this process; nothing else uses it yet.
        unsafe { std::ptr::write_bytes(alloc.ptr, 0, alloc.len as usize) };
        let mut st = self.state();
        st.next += 1;
        let h = MemHandle(st.next);
        st.mems.insert(
            h,
            Mem {
                ctx,
                size,
                backing: Backing::Host { alloc },
            },
        );
        Ok(h)
    }

    fn free_mem(&self, ctx: CtxHandle, mem: MemHandle) -> Result<()> {
        let m = {
            let mut st = self.state();
            match st.mems.get(&mem) {
                Some(m) if m.ctx == ctx => {}
                _ => return Err(Error::UnknownHandle("memory")),
            }
            st.mems.remove(&mem).ok_or(Error::UnknownHandle("memory"))?
        };
        self.release(m)
    }

    fn cpu_map(&self, ctx: CtxHandle, mem: MemHandle) -> Result<CpuPtr> {
        let (vram_mem, size) = {
            let st = self.state();
            let m = st
                .mems
                .get(&mem)
                .filter(|m| m.ctx == ctx)
                .ok_or(Error::UnknownHandle("memory"))?;
            match &m.backing {
                Backing::Host { alloc } => {
                    let p = NonNull::new(alloc.ptr).ok_or(Error::UnknownHandle("memory"))?;
                    // SAFETY: guest RAM of this VM, owned by this allocation until freed.
                    return Ok(unsafe { CpuPtr::new(p, alloc.len as usize) });
                }
                Backing::Vram {
                    aperture: Some(off),
                    ..
                } => return self.shm_ptr(*off, m.size),
                Backing::Vram {
                    mem,
                    aperture: None,
                } => (*mem, m.size),
            }
        };
        let offset = match self.call(Self::ctx_id(ctx)?, Op::MapAperture { mem: vram_mem })? {
            ReplyBody::Aperture { offset } => offset,
            _ => return Err(Error::Device(ErrorCode::Internal)),
        };
        if let Some(Mem {
            backing: Backing::Vram { aperture, .. },
            ..
        }) = self.state().mems.get_mut(&mem)
        {
            *aperture = Some(offset);
        }
        self.shm_ptr(offset, size)
    }

    fn gpu_map(
        &self,
        ctx: CtxHandle,
        mem: MemHandle,
        va: u64,
        page: PageSize,
        flags: MapFlags,
    ) -> Result<()> {
        let flags = if flags.read_only { MAP_READ_ONLY } else { 0 };
        let op = {
            let st = self.state();
            let m = st
                .mems
                .get(&mem)
                .filter(|m| m.ctx == ctx)
                .ok_or(Error::UnknownHandle("memory"))?;
            match &m.backing {
                Backing::Vram { mem, .. } => Op::MapVram {
                    mem: *mem,
                    flags,
                    va,
                    page: page_code(page),
                },
                Backing::Host { alloc } => Op::MapGuest {
                    va,
                    page: page_code(page),
                    flags,
                    ranges: vec![GuestRange {
                        gpa: alloc.gpa,
                        len: m.size,
                    }],
                },
            }
        };
        self.call(Self::ctx_id(ctx)?, op).map(|_| ())
    }

    fn gpu_unmap(&self, ctx: CtxHandle, va: u64, _size: u64) -> Result<()> {
        self.call(Self::ctx_id(ctx)?, Op::Unmap { va }).map(|_| ())
    }

    fn create_channel(
        &self,
        ctx: CtxHandle,
        gp_ring_va: u64,
        gp_entries: u32,
    ) -> Result<ChannelDesc> {
        let op = Op::CreateChannel {
            gp_ring_va,
            gp_entries,
        };
        let (channel, slot) = match self.call(Self::ctx_id(ctx)?, op)? {
            ReplyBody::Channel { channel, slot } => (channel, slot),
            _ => return Err(Error::Device(ErrorCode::Internal)),
        };
        let handle = ChanHandle(channel as u64);
        if self.vm.forwarded() {
            if slot != NO_SLOT {
                log::warn!("forwarded channel {channel} came with slot {slot}");
            }
            let page = Arc::new(StatusPage::new());
            let version = self.vm.config().map_err(vm_err)?.version;
            page.word(ControlPage::VERSION)
                .store(version, Ordering::Relaxed);
            page.word(ControlPage::GP_ENTRIES)
                .store(gp_entries, Ordering::Relaxed);
            let p = NonNull::new(page.ptr()).ok_or(Error::Device(ErrorCode::Internal))?;
            self.state().status.insert(handle, page);
            // SAFETY: the page lives in `status` (an Arc the map keeps) until
            // `destroy_channel` for this channel, after the channel's last use of it.
            let control = unsafe { CpuPtr::new(p, vgpu_protocol::PAGE_SIZE as usize) };
            return Ok(ChannelDesc {
                handle,
                control,
                forwarded: true,
            });
        }
        let offset = slot_offset(slot).ok_or(Error::Device(ErrorCode::Internal))?;
        Ok(ChannelDesc {
            handle,
            control: self.shm_ptr(offset, vgpu_protocol::PAGE_SIZE)?,
            forwarded: false,
        })
    }

    fn destroy_channel(&self, ctx: CtxHandle, ch: ChanHandle) -> Result<()> {
        let channel = u32::try_from(ch.0).map_err(|_| Error::UnknownHandle("channel"))?;
        let r = self
            .call(Self::ctx_id(ctx)?, Op::DestroyChannel { channel })
            .map(|_| ());
        self.state().status.remove(&ch);
        r
    }

    fn refresh_control(&self, ctx: CtxHandle, ch: ChanHandle) -> Result<()> {
        let Some(page) = self.state().status.get(&ch).cloned() else {
            return Ok(()); // a direct channel: its page is the GPU's
        };
        let channel = u32::try_from(ch.0).map_err(|_| Error::UnknownHandle("channel"))?;
        let s = match self.call(Self::ctx_id(ctx)?, Op::ChannelStatus { channel })? {
            ReplyBody::ChannelStatus(s) => s,
            _ => return Err(Error::Device(ErrorCode::Internal)),
        };
        // As the GPU orders its writes: ERROR_INFO before ERROR, everything released.
        let info = &page.0[ControlPage::ERROR_INFO / 8];
        info.store(s.error_info, Ordering::Release);
        for (field, v) in [
            (ControlPage::GP_GET, s.gp_get),
            (ControlPage::REF, s.reference),
            (ControlPage::NOTIFY_SEQ, s.notify_seq),
            (ControlPage::ERROR, s.error),
        ] {
            page.word(field).store(v, Ordering::Release);
        }
        Ok(())
    }

    fn lost_probe(&self) -> Option<LostProbe> {
        let (vm, epoch) = (self.vm.clone(), self.epoch);
        Some(Arc::new(move || !vm.live_in(epoch)))
    }

    fn doorbell(&self, _ch: ChanHandle) {
        self.vm.ring_doorbell();
    }

    fn device_events(&self, _ctx: CtxHandle, ch: ChanHandle) -> Option<u64> {
        // A forwarded channel's page is this transport's copy: the GPU never sees its
        // waiter armed there.
        if self.state().status.contains_key(&ch) {
            return None;
        }
        Some(self.vm.event_count())
    }

    fn wait_device_events(
        &self,
        _ctx: CtxHandle,
        _ch: ChanHandle,
        _fence: u32,
        seen: u64,
        timeout: std::time::Duration,
    ) -> bool {
        self.vm.wait_event_count(seen, timeout) != seen
    }

    fn module_load(&self, ctx: CtxHandle, image: &[u8]) -> Result<u32> {
        if image.is_empty() {
            return Err(Error::InvalidArgument("empty module image"));
        }
        // The image goes to the device from guest RAM, as a driver hands it over; the
        // device reads it once, so the buffer is ours again when the reply comes.
        let len = image.len() as u64;
        let alloc = self.vm.alloc_guest(len, 4096).map_err(transport_err)?;
        // SAFETY: a fresh allocation of at least `len` bytes of guest RAM mapped in this
        // process; nothing else uses it until it is freed below.
        unsafe { std::ptr::copy_nonoverlapping(image.as_ptr(), alloc.ptr, image.len()) };
        let r = self.call(
            Self::ctx_id(ctx)?,
            Op::ModuleLoad {
                ranges: vec![GuestRange {
                    gpa: alloc.gpa,
                    len,
                }],
            },
        );
        if let Err(e) = self.vm.free_guest(alloc.gpa) {
            log::warn!("freeing a module image's guest memory: {e}");
        }
        match r? {
            ReplyBody::Module { module } => Ok(module),
            _ => Err(Error::Device(ErrorCode::Internal)),
        }
    }

    fn module_unload(&self, ctx: CtxHandle, module: u32) -> Result<()> {
        self.call(Self::ctx_id(ctx)?, Op::ModuleUnload { module })
            .map(|_| ())
    }

    fn function_get(
        &self,
        ctx: CtxHandle,
        module: u32,
        name: &str,
    ) -> Result<(u32, Option<Vec<vgpu_protocol::module::ParamInfo>>)> {
        let op = Op::FunctionGet {
            module,
            name: name.as_bytes().to_vec(),
        };
        match self.call(Self::ctx_id(ctx)?, op)? {
            ReplyBody::Function(f) => Ok((f.function, f.params)),
            _ => Err(Error::Device(ErrorCode::Internal)),
        }
    }

    fn global_get(&self, ctx: CtxHandle, module: u32, name: &str) -> Result<(u64, u64)> {
        let op = Op::GlobalGet {
            module,
            name: name.as_bytes().to_vec(),
        };
        match self.call(Self::ctx_id(ctx)?, op)? {
            ReplyBody::Global { addr, size } => Ok((addr, size)),
            _ => Err(Error::Device(ErrorCode::Internal)),
        }
    }

    fn global_write(
        &self,
        ctx: CtxHandle,
        module: u32,
        name: &str,
        offset: u64,
        data: &[u8],
    ) -> Result<()> {
        let copy = GlobalCopyDir::Write;
        self.global_copy(
            ctx,
            module,
            name,
            offset,
            data.len(),
            copy,
            |piece, at, host| {
                let src = &data[at..at + piece];
                // SAFETY: `host` is a fresh guest RAM allocation of at least `piece` bytes,
                // this call's alone until it is freed.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), host, piece) };
            },
        )
    }

    fn global_read(
        &self,
        ctx: CtxHandle,
        module: u32,
        name: &str,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        let len = buf.len();
        let copy = GlobalCopyDir::Read;
        self.global_copy(ctx, module, name, offset, len, copy, |piece, at, host| {
            let dst = &mut buf[at..at + piece];
            // SAFETY: as in `global_write`; the device wrote the piece before replying.
            unsafe { std::ptr::copy_nonoverlapping(host, dst.as_mut_ptr(), piece) };
        })
    }

    fn remote_submit(&self, ctx: CtxHandle, ch: ChanHandle, gp_put: u32) -> Result<()> {
        let channel = u32::try_from(ch.0).map_err(|_| Error::UnknownHandle("channel"))?;
        self.call(Self::ctx_id(ctx)?, Op::Submit { channel, gp_put })
            .map(|_| ())
    }
}
