//! `Context`: one GPU address space and the allocations and channels living in it.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use vgpu_protocol::mem::PageSize;

use crate::buffer::Buffer;
use crate::channel::{Channel, ChannelOptions};
use crate::error::{Error, Result};
use crate::stage::Stager;
use crate::transport::{CtxHandle, DeviceInfo, MemKind, Transport};
use crate::va::VaSpace;

/// Shared by the context's buffers and channels, so the address space outlives them.
pub(crate) struct CtxInner {
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) handle: CtxHandle,
    va: Mutex<VaSpace>,
    /// The copy channel and guest-RAM buffer that move bytes to and from VRAM the CPU
    /// cannot map ([`Stager`]), made on first need.
    stager: Mutex<Option<Stager>>,
    /// How long the application's channels' recent fence waits took, ns: what a new
    /// channel of the context expects of its first waits (an application that makes a
    /// channel per loop, as the workloads do, would otherwise start each loop knowing
    /// nothing and nap past its end).
    pub(crate) expected_wait_ns: Arc<std::sync::atomic::AtomicU64>,
    /// The memory (ring and arenas) of the context's last destroyed channel, kept for its
    /// next: a channel made per loop then starts on memory the host has already
    /// registered and touched, not on fresh pages (see [`Channel`](crate::Channel)'s
    /// drop). Owned by the context (a weak link), freed with it.
    spare_arena: Mutex<Option<Buffer>>,
}

impl CtxInner {
    pub(crate) fn va(&self) -> MutexGuard<'_, VaSpace> {
        self.va.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `mem`, a destroyed channel's memory, for the context's next channel (one
    /// at most: a second is freed).
    pub(crate) fn keep_spare_arena(self: &Arc<Self>, mut mem: Buffer) {
        let mut slot = self.spare_arena.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            mem.relink(CtxLink::owned_by(self));
            *slot = Some(mem);
        }
    }

    /// The spare channel memory (see [`Self::keep_spare_arena`]) if it is `len` bytes,
    /// linked to its new owner by `link`.
    pub(crate) fn take_spare_arena(&self, len: u64, link: &CtxLink) -> Option<Buffer> {
        let mut slot = self.spare_arena.lock().unwrap_or_else(|p| p.into_inner());
        let mut mem = slot.take_if(|m| m.len() == len)?;
        drop(slot);
        mem.relink(link.clone());
        Some(mem)
    }

    /// Runs `f` with this context's stager, making it first if needed.
    pub(crate) fn with_stager<T>(
        self: &Arc<Self>,
        f: impl FnOnce(&mut Stager) -> Result<T>,
    ) -> Result<T> {
        let mut guard = self.stager.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            *guard = Some(Stager::new(self)?);
        }
        match guard.as_mut() {
            Some(s) => f(s),
            None => Err(Error::InvalidArgument("no stager")),
        }
    }
}

/// How a buffer or channel reaches its context. Objects the application holds keep the
/// context alive; the context's own objects (its stager) must not, or it would never be
/// dropped: they hold a weak reference and are torn down first when it goes.
#[derive(Clone)]
pub(crate) struct CtxLink {
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) handle: CtxHandle,
    owner: Owner,
}

#[derive(Clone)]
enum Owner {
    Keeps(Arc<CtxInner>),
    OwnedBy(Weak<CtxInner>),
}

impl CtxLink {
    /// A link that keeps `ctx` alive.
    pub(crate) fn keeping(ctx: &Arc<CtxInner>) -> Self {
        CtxLink {
            transport: ctx.transport.clone(),
            handle: ctx.handle,
            owner: Owner::Keeps(ctx.clone()),
        }
    }

    /// A link for an object `ctx` owns itself.
    pub(crate) fn owned_by(ctx: &Arc<CtxInner>) -> Self {
        CtxLink {
            transport: ctx.transport.clone(),
            handle: ctx.handle,
            owner: Owner::OwnedBy(Arc::downgrade(ctx)),
        }
    }

    /// The context, unless it is being torn down.
    pub(crate) fn inner(&self) -> Option<Arc<CtxInner>> {
        match &self.owner {
            Owner::Keeps(c) => Some(c.clone()),
            Owner::OwnedBy(w) => w.upgrade(),
        }
    }
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        // The stager's channel and buffer, and a spare channel's memory, go while the
        // context still exists.
        drop(self.stager.lock().unwrap_or_else(|p| p.into_inner()).take());
        drop(
            self.spare_arena
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
        if let Err(e) = self.transport.destroy_context(self.handle) {
            log::warn!("destroying context {}: {e}", self.handle.0);
        }
    }
}

/// A GPU address space. Buffers and channels keep it alive; it is destroyed when the
/// last of them and the `Context` itself are gone.
#[derive(Clone)]
pub struct Context {
    inner: Arc<CtxInner>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("handle", &self.inner.handle)
            .finish()
    }
}

/// Buffers at least this large use 64 KiB GPU pages (fewer page-table entries).
pub const BIG_PAGE_THRESHOLD: u64 = 64 << 10;
/// Buffers at least this large use 2 MiB GPU pages: fewer translations per byte moved.
pub const HUGE_PAGE_THRESHOLD: u64 = 2 << 20;

pub(crate) fn page_for(bytes: u64) -> PageSize {
    if bytes >= HUGE_PAGE_THRESHOLD {
        PageSize::Huge2M
    } else if bytes >= BIG_PAGE_THRESHOLD {
        PageSize::Big64K
    } else {
        PageSize::Small4K
    }
}

impl Context {
    /// The transport's handle for this context (for tools that correlate with the GPU's
    /// own accounting).
    pub fn handle(&self) -> CtxHandle {
        self.inner.handle
    }

    /// Copies `data` to `offset` of global `name` of this context's module `module` (its
    /// device id, [`crate::Module::id`]): `cuMemcpyHtoD` at a global's address. Not
    /// ordered against the context's GPU work: the caller waits for it first.
    pub fn global_write(&self, module: u32, name: &str, offset: u64, data: &[u8]) -> Result<()> {
        self.inner
            .transport
            .global_write(self.inner.handle, module, name, offset, data)
    }

    /// Reads `buf.len()` bytes from `offset` of global `name` of module `module`, as
    /// [`Context::global_write`].
    pub fn global_read(&self, module: u32, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.inner
            .transport
            .global_read(self.inner.handle, module, name, offset, buf)
    }

    pub(crate) fn new(transport: Arc<dyn Transport>) -> Result<Self> {
        let made = transport.create_context()?;
        // The host's slot keeps the VM's contexts apart (identity addressing); without
        // one (the native transport, an older host) a random one makes a clash rare.
        let va = made
            .huge_slot
            .map_or_else(VaSpace::default, |s| VaSpace::with_huge_slot(u64::from(s)));
        Ok(Context {
            inner: Arc::new(CtxInner {
                transport,
                handle: made.handle,
                va: Mutex::new(va),
                stager: Mutex::new(None),
                expected_wait_ns: Arc::default(),
                spare_arena: Mutex::new(None),
            }),
        })
    }

    pub(crate) fn inner(&self) -> &Arc<CtxInner> {
        &self.inner
    }

    pub fn info(&self) -> Result<DeviceInfo> {
        self.inner.transport.info()
    }

    /// Allocates `bytes` of VRAM mapped into this address space.
    pub fn alloc_vram(&self, bytes: u64) -> Result<Buffer> {
        Buffer::new(
            &self.inner,
            CtxLink::keeping(&self.inner),
            MemKind::Vram,
            bytes,
            page_for(bytes),
        )
    }

    /// Allocates `bytes` of zeroed host memory mapped into this address space.
    pub fn alloc_host(&self, bytes: u64) -> Result<Buffer> {
        Buffer::new(
            &self.inner,
            CtxLink::keeping(&self.inner),
            MemKind::Host,
            bytes,
            page_for(bytes),
        )
    }

    /// Allocates a buffer of either kind.
    pub fn alloc(&self, kind: MemKind, bytes: u64) -> Result<Buffer> {
        Buffer::new(
            &self.inner,
            CtxLink::keeping(&self.inner),
            kind,
            bytes,
            page_for(bytes),
        )
    }

    /// Creates a channel with the default ring and arena sizes.
    pub fn create_channel(&self) -> Result<Channel> {
        self.create_channel_with(ChannelOptions::default())
    }

    pub fn create_channel_with(&self, opts: ChannelOptions) -> Result<Channel> {
        Channel::new(self, opts)
    }

    /// Loads a module image (PTX text, cubin or fatbin) into this context. Only a GPU
    /// that runs a VM's work in a process of its own loads guest modules; others refuse
    /// with `ModulesNeedCudaGpu` or `ModulesNeedWorker` (docs/design/guest-modules.md).
    pub fn load_module(&self, image: &[u8]) -> Result<crate::module::Module> {
        crate::module::Module::load(&self.inner, image)
    }
}
