//! `Context`: one GPU address space and the allocations and channels living in it.

use std::sync::{Arc, Mutex, MutexGuard};

use vgpu_protocol::mem::PageSize;

use crate::buffer::Buffer;
use crate::channel::{Channel, ChannelOptions};
use crate::error::Result;
use crate::transport::{CtxHandle, DeviceInfo, MemKind, Transport};
use crate::va::VaSpace;

/// Shared by the context's buffers and channels, so the address space outlives them.
pub(crate) struct CtxInner {
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) handle: CtxHandle,
    va: Mutex<VaSpace>,
}

impl CtxInner {
    pub(crate) fn va(&self) -> MutexGuard<'_, VaSpace> {
        self.va.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for CtxInner {
    fn drop(&mut self) {
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

fn page_for(bytes: u64) -> PageSize {
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

    pub(crate) fn new(transport: Arc<dyn Transport>) -> Result<Self> {
        let handle = transport.create_context()?;
        Ok(Context {
            inner: Arc::new(CtxInner {
                transport,
                handle,
                va: Mutex::new(VaSpace::default()),
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
        Buffer::new(self.inner.clone(), MemKind::Vram, bytes, page_for(bytes))
    }

    /// Allocates `bytes` of zeroed host memory mapped into this address space.
    pub fn alloc_host(&self, bytes: u64) -> Result<Buffer> {
        Buffer::new(self.inner.clone(), MemKind::Host, bytes, page_for(bytes))
    }

    /// Allocates a buffer of either kind.
    pub fn alloc(&self, kind: MemKind, bytes: u64) -> Result<Buffer> {
        Buffer::new(self.inner.clone(), kind, bytes, page_for(bytes))
    }

    /// Creates a channel with the default ring and arena sizes.
    pub fn create_channel(&self) -> Result<Channel> {
        self.create_channel_with(ChannelOptions::default())
    }

    pub fn create_channel_with(&self, opts: ChannelOptions) -> Result<Channel> {
        Channel::new(self, opts)
    }
}
