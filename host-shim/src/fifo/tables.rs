//! The contexts and channels of a GPU, its control pages and its front-end thread's
//! wake-up: one [`Tables`] per GPU, shared by its API and its front end.
//!
//! Lock order: contexts, then channels. A channel is inserted while the context table is
//! read-locked and only if its context is still there, and a context's removal takes its
//! channels with it, so no channel outlives its context.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::thread::Thread;

use vgpu_protocol::ErrorCode;

use super::channel_core::ChannelCore;
use super::control_pages::ControlPages;
use crate::hal::{
    ActivityCounter, ChannelConfig, ChannelCounters, ChannelId, ChannelResume, ContextId,
    EventSink, FdRange, HalError, MapTarget, Result,
};
use crate::mmu::AddressSpace;

/// A GPU's channel type: a [`ChannelCore`] and whatever the GPU runs it with.
pub trait FifoChannel: Send + Sync {
    fn core(&self) -> &ChannelCore;
    /// The counters, with the busy time as this GPU keeps it.
    fn counters(&self) -> ChannelCounters;
}

/// A context: its address space and what the GPU keeps with it.
pub struct Context<X> {
    pub space: Arc<AddressSpace>,
    pub gpu: X,
}

type ContextMap<X> = HashMap<ContextId, Context<X>>;

pub struct Tables<C, X> {
    pages: Arc<ControlPages>,
    /// Read on every map/unmap/invalidate of any VM, written only when a context comes or
    /// goes (or, on `cuda`, when a system-memory mapping is noted): a reader-writer lock,
    /// so that one VM's page-table calls never queue behind another's (issue 16).
    contexts: RwLock<ContextMap<X>>,
    channels: RwLock<BTreeMap<ChannelId, Arc<C>>>,
    /// Bumped whenever `channels` changes, so the front end re-reads it only then.
    gen: AtomicU64,
    /// The front-end thread, unparked when there is something to look at.
    frontend: OnceLock<Thread>,
    next_context: AtomicU32,
    next_channel: AtomicU32,
    max_contexts: u32,
    /// VRAM size, for the bounds check of mappings.
    vram_bytes: u64,
}

impl<C: FifoChannel, X> Tables<C, X> {
    pub fn new(pages: Arc<ControlPages>, max_contexts: u32, vram_bytes: u64) -> Self {
        Tables {
            pages,
            contexts: RwLock::new(HashMap::new()),
            channels: RwLock::new(BTreeMap::new()),
            gen: AtomicU64::new(0),
            frontend: OnceLock::new(),
            next_context: AtomicU32::new(1),
            next_channel: AtomicU32::new(1),
            max_contexts,
            vram_bytes,
        }
    }

    pub fn pages(&self) -> &Arc<ControlPages> {
        &self.pages
    }

    /// Names the thread [`Tables::wake`] wakes.
    pub fn set_frontend(&self, t: Thread) {
        let _ = self.frontend.set(t);
    }

    /// Tells the front end to look at the channels now.
    pub fn wake(&self) {
        if let Some(t) = self.frontend.get() {
            t.unpark();
        }
    }

    /// The generation of the channel table (changes whenever a channel comes or goes).
    pub fn gen(&self) -> u64 {
        self.gen.load(Ordering::Acquire)
    }

    fn changed(&self) {
        self.gen.fetch_add(1, Ordering::AcqRel);
        self.wake();
    }

    pub fn read_contexts(&self) -> RwLockReadGuard<'_, ContextMap<X>> {
        self.contexts.read().unwrap_or_else(|e| e.into_inner())
    }

    pub fn write_contexts(&self) -> RwLockWriteGuard<'_, ContextMap<X>> {
        self.contexts.write().unwrap_or_else(|e| e.into_inner())
    }

    fn read_channels(&self) -> RwLockReadGuard<'_, BTreeMap<ChannelId, Arc<C>>> {
        self.channels.read().unwrap_or_else(|e| e.into_inner())
    }

    /// A new context with `space`, unless there are as many as the GPU allows.
    pub fn create_context(&self, space: Arc<AddressSpace>, gpu: X) -> Result<ContextId> {
        let mut ctxs = self.write_contexts();
        if ctxs.len() >= self.max_contexts as usize {
            return Err(HalError::TooMany("contexts"));
        }
        let id = ContextId(self.next_context.fetch_add(1, Ordering::Relaxed));
        ctxs.insert(id, Context { space, gpu });
        Ok(id)
    }

    /// Removes a context and its channels (stopped, returned for the GPU to reap) and
    /// kills its address space: engines that still hold it cannot touch its memory, so
    /// the owner may free that memory as soon as the context is destroyed.
    pub fn remove_context(&self, ctx: ContextId) -> Result<(Context<X>, Vec<Arc<C>>)> {
        let context = self
            .write_contexts()
            .remove(&ctx)
            .ok_or(HalError::NoContext(ctx))?;
        let removed = self.remove_channels(|c| c.core().ctx == ctx);
        context.space.kill();
        Ok((context, removed))
    }

    pub fn context_count(&self) -> usize {
        self.read_contexts().len()
    }

    pub fn space(&self, ctx: ContextId) -> Result<Arc<AddressSpace>> {
        self.read_contexts()
            .get(&ctx)
            .map(|c| c.space.clone())
            .ok_or(HalError::NoContext(ctx))
    }

    /// Refuses a VRAM target that does not lie wholly inside VRAM.
    pub fn check_vram_target(&self, target: MapTarget, size: u64) -> Result<()> {
        if let MapTarget::Vram { offset } = target {
            if offset
                .checked_add(size)
                .is_none_or(|end| end > self.vram_bytes)
            {
                return Err(HalError::InvalidArgument("VRAM target out of bounds"));
            }
        }
        Ok(())
    }

    /// The core of a new channel of `ctx`, fresh or resumed at `at` (see
    /// [`crate::hal::Gpu::create_channel_resumed`]), and what `owner` takes from its
    /// context. Not yet visible: see [`Tables::insert_channel`].
    pub fn new_core<T>(
        &self,
        ctx: ContextId,
        cfg: ChannelConfig,
        sink: Arc<dyn EventSink>,
        at: Option<ChannelResume>,
        owner: impl FnOnce(&Context<X>) -> T,
    ) -> Result<(ChannelCore, T)> {
        cfg.check()?;
        let (space, owned) = self
            .read_contexts()
            .get(&ctx)
            .map(|c| (c.space.clone(), owner(c)))
            .ok_or(HalError::NoContext(ctx))?;
        let slot = self.pages.take().ok_or(HalError::TooMany("channels"))?;
        let id = ChannelId(self.next_channel.fetch_add(1, Ordering::Relaxed));
        let core = ChannelCore::new(id, ctx, space, cfg, slot, self.pages.clone(), sink);
        if let Some(at) = at {
            core.resume_at(at);
        }
        Ok((core, owned))
    }

    /// Makes a new channel visible to the API and the front end.
    pub fn insert_channel(&self, ch: Arc<C>) -> Result<ChannelId> {
        let (id, ctx) = (ch.core().id, ch.core().ctx);
        {
            // The context may have been destroyed meanwhile; check under the lock order
            // (contexts, then channels) so no channel outlives its context.
            let ctxs = self.read_contexts();
            if !ctxs.contains_key(&ctx) {
                return Err(HalError::NoContext(ctx));
            }
            self.channels
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id, ch);
        }
        self.changed();
        Ok(id)
    }

    pub fn channel(&self, ch: ChannelId) -> Result<Arc<C>> {
        self.read_channels()
            .get(&ch)
            .cloned()
            .ok_or(HalError::NoChannel(ch))
    }

    /// Every live channel.
    pub fn channels(&self) -> Vec<Arc<C>> {
        self.read_channels().values().cloned().collect()
    }

    pub fn channel_count(&self) -> usize {
        self.read_channels().len()
    }

    /// Every live channel with its context and counters (tools and demos).
    pub fn channel_list(&self) -> Vec<(ChannelId, ContextId, ChannelCounters)> {
        self.channels()
            .iter()
            .map(|c| (c.core().id, c.core().ctx, c.counters()))
            .collect()
    }

    /// Removes (and stops) the channels `pred` picks; returns them.
    pub fn remove_channels(&self, pred: impl Fn(&C) -> bool) -> Vec<Arc<C>> {
        let mut chans = self.channels.write().unwrap_or_else(|e| e.into_inner());
        let mut removed = Vec::new();
        chans.retain(|_, c| {
            if pred(c) {
                c.core().stop();
                removed.push(c.clone());
                false
            } else {
                true
            }
        });
        drop(chans);
        if !removed.is_empty() {
            self.changed();
        }
        removed
    }

    pub fn control_page(&self, ch: ChannelId) -> Result<FdRange> {
        Ok(self.pages.fd_range(self.channel(ch)?.core().slot))
    }

    pub fn channel_counters(&self, ch: ChannelId) -> Result<ChannelCounters> {
        Ok(self.channel(ch)?.counters())
    }

    pub fn count_activity(&self, ch: ChannelId, counter: Arc<ActivityCounter>) -> Result<bool> {
        Ok(self.channel(ch)?.core().count_activity(counter))
    }

    pub fn channel_error(&self, ch: ChannelId) -> Result<Option<(ErrorCode, u64)>> {
        Ok(self.channel(ch)?.core().error())
    }

    /// Stops a channel with an error event and wakes the front end to drop its work.
    pub fn kill_channel(&self, ch: ChannelId, code: ErrorCode) -> Result<()> {
        self.channel(ch)?.core().fault(code, 0);
        self.wake();
        Ok(())
    }
}
