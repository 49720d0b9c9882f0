//! The `/dev/vgpu` transport: what an application in a VM uses. Resource requests are
//! ioctls to the guest driver `vgpu.ko`, which forwards them over the control virtqueue
//! tagged with the process id; channel control pages and VRAM apertures are `mmap`s of
//! the device's shared-memory region (the BAR) through `/dev/vgpu`; host buffers are
//! anonymous memory of this process that the driver pins and maps into the GPU address
//! space (`MAP_USER`). Same API as the loopback transport, which speaks the protocol
//! directly (`loopback.rs`).

pub mod abi;

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use vgpu_protocol::mem::{MapFlags, PageSize};
use vgpu_protocol::module::ParamInfo;
use vgpu_protocol::ErrorCode;

use crate::error::{Error, Result};
use crate::mmap::Mmap;
use crate::transport::{
    BlockOn, ChanHandle, ChannelDesc, CpuPtr, CtxHandle, DeviceInfo, MemHandle, NewContext,
    Transport,
};

/// Where the driver's device node lives.
pub const DEFAULT_PATH: &str = "/dev/vgpu";

enum Backing {
    Vram { mem: u32, window: Option<Mmap> },
    Host { map: Mmap },
}

struct Mem {
    ctx: CtxHandle,
    size: u64,
    backing: Backing,
}

struct Chan {
    ctx: CtxHandle,
    _page: Mmap,
    /// The driver's copy of the control page (forwarded device).
    forwarded: bool,
}

#[derive(Default)]
struct State {
    mems: HashMap<MemHandle, Mem>,
    chans: HashMap<ChanHandle, Chan>,
    next: u64,
}

/// One open file of `/dev/vgpu`: everything created through it belongs to this process
/// and is released by the driver when the file closes.
pub struct DevVgpuTransport {
    file: File,
    state: Mutex<State>,
    /// Whether the device is forwarded (`VGPU_INFO_FORWARDED`), asked once.
    forwarded: std::sync::OnceLock<bool>,
    /// Whether a failed DOORBELL was logged (once is enough).
    doorbell_warned: AtomicBool,
}

fn page_code(page: PageSize) -> u32 {
    match page {
        PageSize::Small4K => abi::PAGE_4K,
        PageSize::Big64K => abi::PAGE_64K,
        PageSize::Huge2M => abi::PAGE_2M,
    }
}

/// errno of a failed ioctl → the runtime's error: device refusals keep their protocol
/// code; anything else stays an OS error naming the ioctl.
fn ioctl_error(what: &'static str, e: std::io::Error) -> Error {
    let code = match e.raw_os_error() {
        Some(libc::EINVAL) => Some(ErrorCode::InvalidArgument),
        Some(libc::ENOENT) => Some(ErrorCode::NotFound),
        Some(libc::ENOMEM) => Some(ErrorCode::NoMemory),
        Some(libc::EACCES) => Some(ErrorCode::PermissionDenied),
        Some(libc::ENOSPC) => Some(ErrorCode::LimitExceeded),
        Some(libc::EBUSY) => Some(ErrorCode::Busy),
        Some(libc::EOPNOTSUPP) => Some(ErrorCode::Unsupported),
        // The device's refusals of guest modules (vgpu_ioctl.h, MODULE_LOAD).
        Some(libc::ENOEXEC) => Some(ErrorCode::ModulesNeedCudaGpu),
        Some(libc::EPERM) => Some(ErrorCode::ModulesNeedWorker),
        Some(libc::EBADMSG) => Some(ErrorCode::BadModule),
        Some(libc::ETIMEDOUT) => return Error::Timeout,
        // The driver reset the device under this file (its backend was lost).
        Some(libc::ENODEV) => return Error::DeviceLost,
        _ => None,
    };
    match code {
        Some(c) => Error::Device(c),
        None => Error::Os { what, source: e },
    }
}

fn ctx_id(ctx: CtxHandle) -> Result<u32> {
    u32::try_from(ctx.0).map_err(|_| Error::UnknownHandle("context"))
}

fn chan_id(ch: ChanHandle) -> Result<u32> {
    u32::try_from(ch.0).map_err(|_| Error::UnknownHandle("channel"))
}

impl DevVgpuTransport {
    /// Opens the device node (normally [`DEFAULT_PATH`]).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path.as_ref())
            .map_err(|source| Error::Os {
                what: "open /dev/vgpu",
                source,
            })?;
        Ok(DevVgpuTransport {
            file,
            state: Mutex::new(State::default()),
            forwarded: std::sync::OnceLock::new(),
            doorbell_warned: AtomicBool::new(false),
        })
    }

    /// The file descriptor (for tools that issue raw ioctls, e.g. hostile tests).
    pub fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Issues one ioctl whose argument is `arg` (read and/or written by the driver).
    fn ioctl<T>(&self, what: &'static str, nr: u32, arg: &mut T) -> Result<()> {
        // SAFETY: `nr` encodes `size_of::<T>()` (abi.rs, checked against the C header by
        // tests/ioctl_abi.rs), so the driver reads/writes exactly the `T` behind `arg`,
        // a live exclusive reference for the duration of the call.
        let rc = unsafe { libc::ioctl(self.raw_fd(), nr as _, arg as *mut T) };
        if rc < 0 {
            return Err(ioctl_error(what, std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// The driver's and device's facts, including the region layout.
    pub fn raw_info(&self) -> Result<abi::Info> {
        let mut i = abi::Info::default();
        self.ioctl("VGPU_IOC_GET_INFO", abi::GET_INFO, &mut i)?;
        Ok(i)
    }

    /// What the backend holds for this whole VM (all processes).
    pub fn stats(&self) -> Result<abi::Stats> {
        let mut s = abi::Stats::default();
        self.ioctl("VGPU_IOC_GET_STATS", abi::GET_STATS, &mut s)?;
        Ok(s)
    }

    /// Whether the device has no shared-memory region (forwarded submission).
    pub fn is_forwarded(&self) -> Result<bool> {
        if let Some(f) = self.forwarded.get() {
            return Ok(*f);
        }
        let f = self.raw_info()?.flags & abi::INFO_FORWARDED != 0;
        Ok(*self.forwarded.get_or_init(|| f))
    }

    /// The channel's control-page fields as the device reads them (one request); on a
    /// forwarded device the driver also copies them into the channel's mapped page.
    pub fn channel_status(&self, ctx: CtxHandle, ch: ChanHandle) -> Result<abi::ChannelStatus> {
        let mut a = abi::ChannelStatus {
            ctx: ctx_id(ctx)?,
            channel: chan_id(ch)?,
            ..Default::default()
        };
        self.ioctl("VGPU_IOC_CHANNEL_STATUS", abi::CHANNEL_STATUS, &mut a)?;
        Ok(a)
    }

    fn map_window(&self, offset: u64, len: u64) -> Result<Mmap> {
        let len = usize::try_from(len).map_err(|_| Error::Device(ErrorCode::Internal))?;
        Mmap::shared(self.raw_fd(), offset, len)
    }
}

impl Transport for DevVgpuTransport {
    fn info(&self) -> Result<DeviceInfo> {
        let i = self.raw_info()?;
        if i.abi_version != abi::ABI_VERSION {
            return Err(Error::Device(ErrorCode::VersionMismatch));
        }
        Ok(DeviceInfo {
            transport: "devvgpu",
            name: "vgpu (/dev/vgpu)".into(),
            protocol_version: i.protocol_version,
            vram_bytes: i.vram_bytes,
            compute_engines: i.compute_engines,
            max_channels: i.channel_slots,
            max_contexts: i.max_contexts,
        })
    }

    fn create_context(&self) -> Result<NewContext> {
        let mut a = abi::ContextArg::default();
        self.ioctl("VGPU_IOC_CREATE_CONTEXT", abi::CREATE_CONTEXT, &mut a)?;
        Ok(NewContext {
            handle: CtxHandle(a.ctx as u64),
            // The device's word as it sent it.
            huge_slot: vgpu_protocol::mem::huge_slot_from_wire(a.huge_slot),
        })
    }

    fn destroy_context(&self, ctx: CtxHandle) -> Result<()> {
        let mut a = abi::ContextArg {
            ctx: ctx_id(ctx)?,
            huge_slot: 0,
        };
        self.ioctl("VGPU_IOC_DESTROY_CONTEXT", abi::DESTROY_CONTEXT, &mut a)?;
        // The driver destroyed everything of the context; drop our views of it.
        let mut st = self.state();
        st.mems.retain(|_, m| m.ctx != ctx);
        st.chans.retain(|_, c| c.ctx != ctx);
        Ok(())
    }

    fn alloc_vram(&self, ctx: CtxHandle, size: u64, align: u64) -> Result<MemHandle> {
        let mut a = abi::AllocVram {
            ctx: ctx_id(ctx)?,
            size,
            align,
            ..Default::default()
        };
        self.ioctl("VGPU_IOC_ALLOC_VRAM", abi::ALLOC_VRAM, &mut a)?;
        let mut st = self.state();
        st.next += 1;
        let h = MemHandle(st.next);
        st.mems.insert(
            h,
            Mem {
                ctx,
                size: a.alloc_size,
                backing: Backing::Vram {
                    mem: a.mem,
                    window: None,
                },
            },
        );
        Ok(h)
    }

    fn alloc_host(&self, ctx: CtxHandle, size: u64, align: u64) -> Result<MemHandle> {
        let len = usize::try_from(size).map_err(|_| Error::InvalidArgument("size"))?;
        let align = usize::try_from(align).map_err(|_| Error::InvalidArgument("align"))?;
        // Zeroed anonymous memory; the driver pins it when it is mapped for the GPU.
        let map = Mmap::anonymous(len, align.max(crate::mmap::HOST_PAGE))?;
        let mut st = self.state();
        st.next += 1;
        let h = MemHandle(st.next);
        st.mems.insert(
            h,
            Mem {
                ctx,
                size,
                backing: Backing::Host { map },
            },
        );
        Ok(h)
    }

    fn host_page_size(&self, _wanted: PageSize) -> PageSize {
        // Pinned pages are scattered in guest-physical memory: MAP_USER maps 4 KiB pages,
        // so the buffer goes where no larger page shares its 2 MiB region.
        PageSize::Small4K
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
        match m.backing {
            Backing::Vram { mem, window } => {
                drop(window);
                let mut a = abi::MemArg {
                    ctx: ctx_id(ctx)?,
                    mem,
                };
                self.ioctl("VGPU_IOC_FREE_MEM", abi::FREE_MEM, &mut a)
            }
            // Unpinned by the driver at UNMAP; our mapping goes now.
            Backing::Host { map } => {
                drop(map);
                Ok(())
            }
        }
    }

    fn cpu_map(&self, ctx: CtxHandle, mem: MemHandle) -> Result<CpuPtr> {
        let mut st = self.state();
        let m = st
            .mems
            .get_mut(&mem)
            .filter(|m| m.ctx == ctx)
            .ok_or(Error::UnknownHandle("memory"))?;
        let size = m.size;
        let view = match &mut m.backing {
            Backing::Host { map } => map,
            Backing::Vram {
                window: Some(w), ..
            } => w,
            Backing::Vram { mem, window } => {
                let mut a = abi::MapAperture {
                    ctx: ctx_id(ctx)?,
                    mem: *mem,
                    ..Default::default()
                };
                self.ioctl("VGPU_IOC_MAP_APERTURE", abi::MAP_APERTURE, &mut a)?;
                if a.size < size {
                    return Err(Error::Device(ErrorCode::Internal));
                }
                window.insert(self.map_window(a.offset, a.size)?)
            }
        };
        // SAFETY: the mapping is owned by this transport's books and unmapped only by
        // `free_mem`/`destroy_context`, i.e. when the object goes.
        Ok(unsafe { CpuPtr::new(view.as_non_null(), view.len()) })
    }

    fn gpu_map(
        &self,
        ctx: CtxHandle,
        mem: MemHandle,
        va: u64,
        page: PageSize,
        flags: MapFlags,
    ) -> Result<()> {
        let flags = if flags.read_only {
            abi::MAP_READ_ONLY
        } else {
            0
        };
        let ctx_raw = ctx_id(ctx)?;
        enum Req {
            Vram(abi::MapVram),
            User(abi::MapUser),
        }
        let req = {
            let st = self.state();
            let m = st
                .mems
                .get(&mem)
                .filter(|m| m.ctx == ctx)
                .ok_or(Error::UnknownHandle("memory"))?;
            match &m.backing {
                Backing::Vram { mem, .. } => Req::Vram(abi::MapVram {
                    ctx: ctx_raw,
                    mem: *mem,
                    va,
                    page: page_code(page),
                    flags,
                }),
                // Guest RAM is mapped with 4 KiB GPU pages (`host_page_size`).
                Backing::Host { map } => Req::User(abi::MapUser {
                    ctx: ctx_raw,
                    flags,
                    va,
                    user_addr: map.as_ptr() as u64,
                    size: m.size,
                }),
            }
        };
        match req {
            Req::Vram(mut a) => self.ioctl("VGPU_IOC_MAP_VRAM", abi::MAP_VRAM, &mut a),
            Req::User(mut a) => self.ioctl("VGPU_IOC_MAP_USER", abi::MAP_USER, &mut a),
        }
    }

    fn gpu_unmap(&self, ctx: CtxHandle, va: u64, _size: u64) -> Result<()> {
        let mut a = abi::Unmap {
            ctx: ctx_id(ctx)?,
            reserved: 0,
            va,
        };
        self.ioctl("VGPU_IOC_UNMAP", abi::UNMAP, &mut a)
    }

    fn create_channel(
        &self,
        ctx: CtxHandle,
        gp_ring_va: u64,
        gp_entries: u32,
    ) -> Result<ChannelDesc> {
        let mut a = abi::CreateChannel {
            ctx: ctx_id(ctx)?,
            gp_entries,
            gp_ring_va,
            ..Default::default()
        };
        let forwarded = self.is_forwarded()?;
        self.ioctl("VGPU_IOC_CREATE_CHANNEL", abi::CREATE_CHANNEL, &mut a)?;
        let handle = ChanHandle(a.channel as u64);
        let page = match self.map_window(a.offset, vgpu_protocol::PAGE_SIZE) {
            Ok(p) => p,
            Err(e) => {
                let _ = self.destroy_channel(ctx, handle);
                return Err(e);
            }
        };
        // SAFETY: the page stays mapped (owned by the `Chan` entry) until
        // `destroy_channel` or `destroy_context` removes it.
        let control = unsafe { CpuPtr::new(page.as_non_null(), page.len()) };
        self.state().chans.insert(
            handle,
            Chan {
                ctx,
                _page: page,
                forwarded,
            },
        );
        Ok(ChannelDesc {
            handle,
            control,
            forwarded,
        })
    }

    fn destroy_channel(&self, ctx: CtxHandle, ch: ChanHandle) -> Result<()> {
        // Our mapping goes first (the driver would revoke it anyway).
        if let Some(c) = self.state().chans.remove(&ch) {
            if c.ctx != ctx {
                self.state().chans.insert(ch, c);
                return Err(Error::UnknownHandle("channel"));
            }
        }
        let mut a = abi::ChannelArg {
            ctx: ctx_id(ctx)?,
            channel: chan_id(ch)?,
        };
        self.ioctl("VGPU_IOC_DESTROY_CHANNEL", abi::DESTROY_CHANNEL, &mut a)
    }

    fn doorbell(&self, _ch: ChanHandle) {
        // SAFETY: DOORBELL takes no argument and touches no user memory.
        let rc = unsafe { libc::ioctl(self.raw_fd(), abi::DOORBELL as _, 0usize) };
        if rc < 0 && !self.doorbell_warned.swap(true, Ordering::Relaxed) {
            // A driver without the ioctl: the front end's sleep ends by itself.
            log::warn!(
                "VGPU_IOC_DOORBELL: {}: submissions wait for the GPU's next poll",
                std::io::Error::last_os_error()
            );
        }
    }

    fn device_events(&self, _ctx: CtxHandle, _ch: ChanHandle) -> Option<u64> {
        // The driver's wait counts the events itself (VGPU_IOC_WAIT below); a forwarded
        // device's pages are the driver's copies, where nothing arms the GPU.
        (!self.is_forwarded().unwrap_or(true)).then_some(0)
    }

    /// Sleeps in the driver's `VGPU_IOC_WAIT` (the page armed by the caller): every
    /// device event wakes it to look at REF, the GPU's `FENCE` event among them.
    fn wait_device_events(
        &self,
        ctx: CtxHandle,
        ch: ChanHandle,
        fence: u32,
        _seen: u64,
        timeout: Duration,
    ) -> bool {
        self.block_on(ctx, ch, BlockOn::Fence(fence), timeout)
            .is_ok()
    }

    fn refresh_control(&self, ctx: CtxHandle, ch: ChanHandle) -> Result<()> {
        if !self.state().chans.get(&ch).is_some_and(|c| c.forwarded) {
            return Ok(()); // a direct channel's page is the GPU's own
        }
        self.channel_status(ctx, ch).map(|_| ())
    }

    fn remote_submit(&self, ctx: CtxHandle, ch: ChanHandle, gp_put: u32) -> Result<()> {
        let mut a = abi::Submit {
            ctx: ctx_id(ctx)?,
            channel: chan_id(ch)?,
            gp_put,
            reserved: 0,
        };
        self.ioctl("VGPU_IOC_SUBMIT", abi::SUBMIT, &mut a)
    }

    fn module_load(&self, ctx: CtxHandle, image: &[u8]) -> Result<u32> {
        if image.is_empty() || image.len() as u64 > abi::MAX_MODULE_BYTES {
            return Err(Error::InvalidArgument("module image size"));
        }
        // The driver copies the image once (into its own pages) before the device reads it.
        let mut a = abi::ModuleLoad {
            ctx: ctx_id(ctx)?,
            user_addr: image.as_ptr() as u64,
            size: image.len() as u64,
            ..Default::default()
        };
        self.ioctl("VGPU_IOC_MODULE_LOAD", abi::MODULE_LOAD, &mut a)?;
        Ok(a.module)
    }

    fn module_unload(&self, ctx: CtxHandle, module: u32) -> Result<()> {
        let mut a = abi::ModuleArg {
            ctx: ctx_id(ctx)?,
            module,
        };
        self.ioctl("VGPU_IOC_MODULE_UNLOAD", abi::MODULE_UNLOAD, &mut a)
    }

    fn function_get(
        &self,
        ctx: CtxHandle,
        module: u32,
        name: &str,
    ) -> Result<(u32, Option<Vec<ParamInfo>>)> {
        let mut pairs = vec![[0u32; 2]; vgpu_protocol::module::MAX_FUNCTION_PARAMS];
        let mut a = abi::FunctionGet {
            ctx: ctx_id(ctx)?,
            module,
            name_addr: name.as_ptr() as u64,
            name_len: u32::try_from(name.len()).map_err(|_| Error::InvalidArgument("name"))?,
            params_addr: pairs.as_mut_ptr() as u64,
            max_params: pairs.len() as u32,
            ..Default::default()
        };
        self.ioctl("VGPU_IOC_FUNCTION_GET", abi::FUNCTION_GET, &mut a)?;
        if a.param_count == abi::PARAMS_UNKNOWN {
            return Ok((a.function, None));
        }
        let n = (a.param_count as usize).min(pairs.len());
        let params = pairs[..n]
            .iter()
            .map(|&[offset, size]| ParamInfo { offset, size })
            .collect();
        Ok((a.function, Some(params)))
    }

    fn device_attributes(&self) -> Result<Vec<(u32, i32)>> {
        let mut pairs = vec![[0u32; 2]; vgpu_protocol::request::MAX_ATTRIBUTES];
        let mut a = abi::Attributes {
            pairs_addr: pairs.as_mut_ptr() as u64,
            max_pairs: pairs.len() as u32,
            ..Default::default()
        };
        match self.ioctl("VGPU_IOC_GET_ATTRIBUTES", abi::GET_ATTRIBUTES, &mut a) {
            // A driver older than the ioctl: no attributes to tell.
            Err(Error::Os { source, .. }) if source.raw_os_error() == Some(libc::ENOTTY) => {
                return Err(Error::Device(ErrorCode::Unsupported))
            }
            r => r?,
        }
        let n = (a.count as usize).min(pairs.len());
        Ok(pairs[..n].iter().map(|&[k, v]| (k, v as i32)).collect())
    }

    fn global_get(&self, ctx: CtxHandle, module: u32, name: &str) -> Result<(u64, u64)> {
        let mut a = abi::GlobalGet {
            ctx: ctx_id(ctx)?,
            module,
            name_addr: name.as_ptr() as u64,
            name_len: u32::try_from(name.len()).map_err(|_| Error::InvalidArgument("name"))?,
            ..Default::default()
        };
        self.ioctl("VGPU_IOC_GLOBAL_GET", abi::GLOBAL_GET, &mut a)?;
        Ok((a.addr, a.size))
    }

    fn block_on(
        &self,
        ctx: CtxHandle,
        ch: ChanHandle,
        what: BlockOn,
        timeout: Duration,
    ) -> Result<()> {
        let (kind, value) = match what {
            BlockOn::Fence(v) => (abi::WAIT_FENCE, v),
            BlockOn::Notify(v) => (abi::WAIT_NOTIFY, v),
        };
        let mut a = abi::Wait {
            ctx: ctx_id(ctx)?,
            channel: chan_id(ch)?,
            kind,
            value,
            timeout_ns: u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX),
            ..Default::default()
        };
        match self.ioctl("VGPU_IOC_WAIT", abi::WAIT, &mut a) {
            Err(Error::Os { source, .. }) if source.raw_os_error() == Some(libc::EIO) => {
                let code = ErrorCode::from_u32(a.error).unwrap_or(ErrorCode::Internal);
                Err(Error::ChannelFault {
                    code,
                    info: a.error_info,
                })
            }
            r => r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_mapping_keeps_device_codes() {
        let e = |n| ioctl_error("t", std::io::Error::from_raw_os_error(n));
        assert!(matches!(
            e(libc::EACCES),
            Error::Device(ErrorCode::PermissionDenied)
        ));
        assert!(matches!(
            e(libc::ENOSPC),
            Error::Device(ErrorCode::LimitExceeded)
        ));
        assert!(matches!(e(libc::ETIMEDOUT), Error::Timeout));
        assert!(matches!(e(libc::EFAULT), Error::Os { .. }));
        // The device's refusals of guest modules (vgpu_virtio.c's vgpu_errno).
        assert!(matches!(
            e(libc::ENOEXEC),
            Error::Device(ErrorCode::ModulesNeedCudaGpu)
        ));
        assert!(matches!(
            e(libc::EPERM),
            Error::Device(ErrorCode::ModulesNeedWorker)
        ));
        assert!(matches!(
            e(libc::EBADMSG),
            Error::Device(ErrorCode::BadModule)
        ));
    }

    #[test]
    fn opening_a_missing_node_is_an_os_error() {
        let r = DevVgpuTransport::open("/nonexistent/vgpu");
        assert!(matches!(r, Err(Error::Os { .. })));
    }

    #[test]
    fn ioctl_on_a_non_vgpu_fd_fails_cleanly() {
        // /dev/null knows none of our ioctls: ENOTTY, never a crash.
        let t = DevVgpuTransport::open("/dev/null").unwrap();
        assert!(matches!(t.raw_info(), Err(Error::Os { .. })));
        assert!(t.create_context().is_err());
    }
}
