//! `Channel`: records methods, submits them through the GP ring, and waits on fences.
//!
//! Submission is the fast path and never involves the transport: the runtime writes the
//! push buffer and a GP entry into host memory it owns, then stores GP_PUT into the
//! mapped control page. Ring slots and arena space are reused only after GP_GET shows
//! the GPU has finished with them.

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vgpu_protocol::channel::valid_gp_entries;
use vgpu_protocol::gp::GP_ENTRY_SIZE;
use vgpu_protocol::{ErrorCode, GpEntry, KernelArgs, KernelId, Method, SemaphoreMode};

use crate::arena::{Alloc, RingArena};
use crate::buffer::Buffer;
use crate::context::{page_for, Context, CtxInner, CtxLink};
use crate::control::ControlView;
use crate::error::{Error, Result};
use crate::pushbuf::PushBuffer;
use crate::transport::{ChanHandle, MemKind};
use crate::wait::{poll_until, wait_until};

/// Sizes of a channel's ring and arenas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelOptions {
    /// GP ring entries: a power of two (see `valid_gp_entries`).
    pub gp_entries: u32,
    /// Bytes of push-buffer arena (a multiple of 4 KiB). Two full segments fit by default.
    pub pushbuf_bytes: u64,
    /// Bytes of kernel-argument arena (a multiple of 4 KiB).
    pub arg_bytes: u64,
}

impl Default for ChannelOptions {
    fn default() -> Self {
        ChannelOptions {
            gp_entries: 1024,
            pushbuf_bytes: 512 << 10,
            arg_bytes: 64 << 10,
        }
    }
}

/// Completion marker of one submission: done once the channel's REF reaches `value`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fence {
    channel: u64,
    value: u32,
}

impl Fence {
    /// The `SET_REF` value that signals this fence.
    pub fn value(&self) -> u32 {
        self.value
    }
}

static NEXT_CHANNEL_UID: AtomicU64 = AtomicU64::new(1);

const PB_ALIGN: u64 = 16;
const ARG_ALIGN: u64 = 16;
const SETUP_ALIGN: u64 = 4096;

/// A command-submission channel.
pub struct Channel {
    ctx: CtxLink,
    handle: ChanHandle,
    control: ControlView,
    /// GP ring, push-buffer arena and argument arena, in that order. Taken out only by
    /// `drop` (back to the context for its next channel).
    mem: ManuallyDrop<Buffer>,
    uid: u64,
    gp_entries: u32,
    pb_base: u64,
    arg_base: u64,
    /// GP_PUT as this channel last published it.
    put: u32,
    next_fence: u32,
    pending: PushBuffer,
    pb: RingArena,
    args: RingArena,
    submitted: u64,
    /// Forwarded channel: no control page of the GPU's in reach, GP_PUT goes out as a
    /// request and GP_GET/REF come back as one (see [`ControlView::refresh`]).
    forwarded: bool,
    /// Publish GP_PUT through the transport (API-remoting baseline, and always on a
    /// forwarded channel) instead of a store.
    api_remoting: bool,
    /// Record the host clock just before each publish (for latency measurements).
    stamp_publish: bool,
    last_publish_ns: u64,
    /// How long recent fence waits took, ns (a 1/4-weighted average): a loop's next wait
    /// keeps the core through about that long instead of napping past its end.
    expected_wait_ns: std::sync::atomic::AtomicU64,
    /// The context's expectation, which this channel's waits update (application
    /// channels only).
    context_wait_ns: Option<Arc<AtomicU64>>,
    /// How many times a fence wait went to sleep on the device's events, and how many
    /// of those sleeps an event ended (the others ran out: the waiter's own re-check).
    fence_sleeps: AtomicU64,
    fence_wakeups: AtomicU64,
    /// Whether long fence waits sleep until the device's event (else they nap).
    sleep_on_events: bool,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("handle", &self.handle)
            .field("put", &self.put)
            .field("gp_entries", &self.gp_entries)
            .finish()
    }
}

fn round_setup(v: u64) -> Option<u64> {
    Some(v.checked_add(SETUP_ALIGN - 1)? & !(SETUP_ALIGN - 1))
}

/// Waits until GP_GET reaches `seq` (wrapping), failing if the channel stops first.
fn wait_gp_get(control: &ControlView, seq: u32, deadline: Option<Instant>) -> Result<()> {
    poll_until(deadline, || {
        control.check_device()?;
        control.refresh()?;
        if (control.gp_get().wrapping_sub(seq) as i32) >= 0 {
            return Ok(Some(()));
        }
        control.check()?;
        Ok(None)
    })
}

/// Allocates arena space, waiting for the GPU to finish older submissions if needed.
fn alloc_wait(arena: &mut RingArena, control: &ControlView, len: u64, align: u64) -> Result<u64> {
    loop {
        match arena.alloc(len, align, control.gp_get()) {
            Alloc::At(off) => return Ok(off),
            Alloc::WaitFor(seq) => wait_gp_get(control, seq, None)?,
            Alloc::TooLarge => {
                return Err(Error::SubmissionTooLarge(
                    "does not fit the channel's arena; submit more often",
                ))
            }
        }
    }
}

impl Channel {
    pub(crate) fn new(ctx: &Context, opts: ChannelOptions) -> Result<Self> {
        let mut ch = Self::with_link(ctx.inner(), CtxLink::keeping(ctx.inner()), opts)?;
        // An application's channel learns from, and teaches, its context's waits (the
        // stager's copies are no guide to the application's loops).
        let shared = ctx.inner().expected_wait_ns.clone();
        ch.expected_wait_ns = AtomicU64::new(shared.load(Ordering::Relaxed));
        ch.context_wait_ns = Some(shared);
        Ok(ch)
    }

    /// A channel in `inner` that reaches it through `link` (see [`CtxLink`]).
    pub(crate) fn with_link(
        inner: &Arc<CtxInner>,
        link: CtxLink,
        opts: ChannelOptions,
    ) -> Result<Self> {
        if !valid_gp_entries(opts.gp_entries) {
            return Err(Error::InvalidArgument(
                "GP ring size must be a power of two in range",
            ));
        }
        if opts.pushbuf_bytes == 0
            || opts.arg_bytes == 0
            || opts.pushbuf_bytes & (SETUP_ALIGN - 1) != 0
            || opts.arg_bytes & (SETUP_ALIGN - 1) != 0
        {
            return Err(Error::InvalidArgument(
                "arena sizes must be non-zero multiples of 4 KiB",
            ));
        }
        let ring_bytes = round_setup(opts.gp_entries as u64 * GP_ENTRY_SIZE as u64)
            .ok_or(Error::InvalidArgument("ring too large"))?;
        let pb_base = ring_bytes;
        let arg_base = pb_base
            .checked_add(opts.pushbuf_bytes)
            .ok_or(Error::InvalidArgument("arena too large"))?;
        let total = arg_base
            .checked_add(opts.arg_bytes)
            .ok_or(Error::InvalidArgument("arena too large"))?;
        // The context's last destroyed channel's memory if it fits: registered and
        // touched on the host already (nothing of the old ring is read again: the new
        // channel's GP_PUT and GP_GET start equal, and every entry is written before it
        // is published).
        let mem = match inner.take_spare_arena(total, &link) {
            Some(m) => m,
            None => Buffer::new(inner, link.clone(), MemKind::Host, total, page_for(total))?,
        };
        let desc = inner
            .transport
            .create_channel(inner.handle, mem.gpu_va(), opts.gp_entries)?;
        let destroy = |e: Error| {
            if let Err(e2) = inner.transport.destroy_channel(inner.handle, desc.handle) {
                log::warn!("destroying half-created channel: {e2}");
            }
            e
        };
        let refresh: Option<crate::control::Refresh> = desc.forwarded.then(|| {
            let (t, ctx, ch) = (inner.transport.clone(), inner.handle, desc.handle);
            let r: crate::control::Refresh = Arc::new(move || t.refresh_control(ctx, ch));
            r
        });
        let control = ControlView::new(desc.control, inner.transport.lost_probe(), refresh)
            .map_err(destroy)?;
        let version = control.version();
        if version >> 16 != vgpu_protocol::PROTOCOL_VERSION >> 16 {
            log::warn!("channel speaks protocol {version:#x}");
            return Err(destroy(Error::Device(ErrorCode::VersionMismatch)));
        }
        let put = control.gp_put();
        let next_fence = control.reference().wrapping_add(1);
        log::debug!(
            "channel {} in context {}: ring at {:#x}, {} entries",
            desc.handle.0,
            inner.handle.0,
            mem.gpu_va(),
            opts.gp_entries
        );
        Ok(Channel {
            ctx: link,
            handle: desc.handle,
            control,
            mem: ManuallyDrop::new(mem),
            uid: NEXT_CHANNEL_UID.fetch_add(1, Ordering::Relaxed),
            gp_entries: opts.gp_entries,
            pb_base,
            arg_base,
            put,
            next_fence,
            pending: PushBuffer::default(),
            pb: RingArena::new(opts.pushbuf_bytes),
            args: RingArena::new(opts.arg_bytes),
            submitted: 0,
            expected_wait_ns: std::sync::atomic::AtomicU64::new(0),
            context_wait_ns: None,
            fence_sleeps: AtomicU64::new(0),
            fence_wakeups: AtomicU64::new(0),
            sleep_on_events: true,
            forwarded: desc.forwarded,
            api_remoting: desc.forwarded,
            stamp_publish: false,
            last_publish_ns: 0,
        })
    }

    /// Records a kernel launch; the argument block is copied into the argument arena.
    pub fn launch(&mut self, args: &KernelArgs, grid: [u32; 3]) -> Result<()> {
        self.launch_bytes(args.kernel(), grid, &args.encode())
    }

    /// Records a launch with an argument block given as raw bytes (which the GPU
    /// validates; tests use this to send malformed blocks).
    pub fn launch_bytes(&mut self, kernel: KernelId, grid: [u32; 3], args: &[u8]) -> Result<()> {
        let m_len = Method::Launch {
            kernel,
            grid,
            args_va: 0,
            args_len: 0,
        }
        .len_words();
        self.pending.room_for(m_len)?;
        let args_len = u32::try_from(args.len())
            .map_err(|_| Error::InvalidArgument("argument block too large"))?;
        let args_va = if args.is_empty() {
            0
        } else {
            let off = alloc_wait(&mut self.args, &self.control, args.len() as u64, ARG_ALIGN)?;
            let at = self.arg_base + off;
            self.mem.write(at, args)?;
            self.mem.gpu_va() + at
        };
        self.pending.push(&Method::Launch {
            kernel,
            grid,
            args_va,
            args_len,
        })
    }

    /// Records a launch of a module function with `args` (see [`crate::Function::params`]).
    pub fn launch_function(
        &mut self,
        f: &crate::Function,
        grid: [u32; 3],
        block: [u32; 3],
        args: &[crate::Arg<'_>],
    ) -> Result<()> {
        let m = f.launch(grid, block, 0, args)?;
        self.pending.push(&m)
    }

    /// Records a copy-engine DMA of `len` bytes.
    pub fn copy(&mut self, dst_va: u64, src_va: u64, len: u64) -> Result<()> {
        self.pending.push(&Method::Copy {
            src: src_va,
            dst: dst_va,
            len,
        })
    }

    /// Records a semaphore release: writes `value` at `va` after earlier work is done.
    pub fn sem_release(&mut self, va: u64, value: u32) -> Result<()> {
        self.pending.push(&Method::SemRelease {
            va,
            value,
            timestamp: false,
        })
    }

    /// Like [`Channel::sem_release`], also writing the GPU clock (u64 ns) at `va + 8`.
    pub fn sem_release_timestamp(&mut self, va: u64, value: u32) -> Result<()> {
        self.pending.push(&Method::SemRelease {
            va,
            value,
            timestamp: true,
        })
    }

    /// Records a semaphore acquire: the channel stalls until `va` satisfies `mode`.
    pub fn sem_acquire(&mut self, va: u64, value: u32, mode: SemaphoreMode) -> Result<()> {
        self.pending.push(&Method::SemAcquire { va, value, mode })
    }

    /// Records a notify event carrying `token`.
    pub fn notify(&mut self, token: u32) -> Result<()> {
        self.pending.push(&Method::Notify { token })
    }

    /// Records any method.
    pub fn push_method(&mut self, m: &Method) -> Result<()> {
        self.pending.push(m)
    }

    /// Appends raw push-buffer words, unchecked (for tests of the GPU's validation).
    pub fn push_raw_words(&mut self, words: &[u32]) -> Result<()> {
        self.pending.push_raw(words)
    }

    /// Whether methods are recorded but not yet submitted.
    pub fn has_pending(&self) -> bool {
        self.pending.len() > 0
    }

    /// Waits until the ring slot for the next entry is free (the GPU completed the
    /// entry that used it last).
    fn reserve_slot(&self) -> Result<u64> {
        let in_flight = self.put.wrapping_sub(self.control.gp_get());
        if in_flight >= self.gp_entries {
            let need = self.put.wrapping_sub(self.gp_entries).wrapping_add(1);
            wait_gp_get(&self.control, need, None)?;
        }
        Ok((self.put % self.gp_entries) as u64 * GP_ENTRY_SIZE as u64)
    }

    /// Writes `entry` into the next ring slot and publishes it.
    fn publish(&mut self, entry: &[u8; GP_ENTRY_SIZE]) -> Result<u32> {
        let slot = self.reserve_slot()?;
        self.mem.write(slot, entry)?;
        let seq = self.put.wrapping_add(1);
        if self.stamp_publish {
            self.last_publish_ns = crate::clock::now_ns();
        }
        if self.api_remoting {
            self.ctx
                .transport
                .remote_submit(self.ctx.handle, self.handle, seq)?;
        } else {
            // Never store into a page that belongs to another generation of the device.
            self.control.check_device()?;
            self.control.set_gp_put(seq);
            if self.control.doorbell_wanted() {
                self.ctx.transport.doorbell(self.handle);
            }
        }
        self.put = seq;
        self.submitted += 1;
        Ok(seq)
    }

    fn submit_pending(&mut self) -> Result<()> {
        self.control.check()?;
        let words = self.pending.words();
        let bytes = words.len() as u64 * 4;
        let len_words = u32::try_from(words.len())
            .map_err(|_| Error::SubmissionTooLarge("push buffer segment"))?;
        let off = alloc_wait(&mut self.pb, &self.control, bytes, PB_ALIGN)?;
        let at = self.pb_base + off;
        self.mem.write_u32(at, self.pending.words())?;
        let entry = GpEntry::new(self.mem.gpu_va() + at, len_words)?;
        // Everything allocated for this submission is reusable once it completes.
        let seq = self.put.wrapping_add(1);
        self.pb.commit(seq);
        self.args.commit(seq);
        self.publish(&entry.encode())?;
        Ok(())
    }

    /// Submits the recorded methods as one GP entry closed by a `SET_REF`; the fence
    /// signals when all of them have completed. Submitting nothing is allowed.
    pub fn submit(&mut self) -> Result<Fence> {
        let fence = self.next_fence;
        let mark = self.pending.len();
        self.pending.close(fence);
        if let Err(e) = self.submit_pending() {
            self.pending.truncate(mark);
            return Err(e);
        }
        self.pending.clear();
        self.next_fence = fence.wrapping_add(1);
        Ok(Fence {
            channel: self.uid,
            value: fence,
        })
    }

    /// Writes a raw, possibly malformed GP entry into the next ring slot and publishes
    /// it; returns the GP_PUT value after it. Pending methods stay pending.
    pub fn submit_raw_gp(&mut self, entry: [u8; GP_ENTRY_SIZE]) -> Result<u32> {
        self.publish(&entry)
    }

    /// API-remoting mode, the baseline the direct path is measured against: GP_PUT is
    /// sent to the host in a request (which stores it) instead of stored by the guest.
    /// A forwarded channel has no other way and stays remoted.
    pub fn set_api_remoting(&mut self, on: bool) {
        self.api_remoting = on || self.forwarded;
    }

    /// Whether the channel is forwarded: submissions and completions each cost a
    /// request (the device has no shared-memory region).
    pub fn is_forwarded(&self) -> bool {
        self.forwarded
    }

    /// Whether fence waits past 10 ms sleep until the device's event
    /// (the default, where the transport has events) or keep napping (benchmarks compare
    /// the two).
    pub fn set_sleep_on_events(&mut self, on: bool) {
        self.sleep_on_events = on;
    }

    /// Records the clock (`CLOCK_MONOTONIC`, the host GPU clock when on a host) right before every GP_PUT
    /// store (or remoted submit), so benchmarks can time store → kernel start exactly.
    pub fn set_stamp_publish(&mut self, on: bool) {
        self.stamp_publish = on;
    }

    /// The clock recorded before the last publish (0 unless `set_stamp_publish(true)`).
    pub fn last_publish_ns(&self) -> u64 {
        self.last_publish_ns
    }

    /// Submits and waits.
    pub fn finish(&mut self) -> Result<()> {
        let f = self.submit()?;
        self.wait(f)
    }

    fn reached(&self, fence: Fence) -> Result<bool> {
        if fence.channel != self.uid {
            return Err(Error::WrongChannel);
        }
        self.control.check_device()?;
        self.control.refresh()?;
        if (self.control.reference().wrapping_sub(fence.value) as i32) >= 0 {
            return Ok(true);
        }
        self.control.check()?;
        Ok(false)
    }

    /// Whether `fence` has signalled; an error if the channel stopped before it did.
    pub fn is_complete(&self, fence: Fence) -> Result<bool> {
        self.reached(fence)
    }

    /// Waits until `fence` signals, or fails with the channel's error.
    pub fn wait(&self, fence: Fence) -> Result<()> {
        self.wait_deadline(fence, None)
    }

    /// Like [`Channel::wait`], failing with `Error::Timeout` after `timeout`.
    pub fn wait_timeout(&self, fence: Fence, timeout: Duration) -> Result<()> {
        self.wait_deadline(fence, Instant::now().checked_add(timeout))
    }

    fn wait_deadline(&self, fence: Fence, deadline: Option<Instant>) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        let start = Instant::now();
        let expected = Duration::from_nanos(self.expected_wait_ns.load(Relaxed));
        let done = || Ok(self.reached(fence)?.then_some(()));
        // Past its spin and yields, a wait sleeps until the GPU says REF moved, where the
        // transport delivers the device's events and the page is the GPU's own.
        let mut sleep = |most: Duration| self.sleep_on_fence(fence, most);
        let block: Option<&mut dyn FnMut(Duration) -> Result<()>> = if !self.sleep_on_events
            || self.forwarded
            || self
                .ctx
                .transport
                .device_events(self.ctx.handle, self.handle)
                .is_none()
        {
            None
        } else {
            Some(&mut sleep)
        };
        wait_until(deadline, expected, done, block)?;
        let took = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let old = self.expected_wait_ns.load(Relaxed);
        let new = old - old / 4 + took / 4;
        self.expected_wait_ns.store(new, Relaxed);
        if let Some(shared) = &self.context_wait_ns {
            shared.store(new, Relaxed);
        }
        Ok(())
    }

    /// About how long this channel expects its next fence wait to take (its recent waits
    /// or, before its first, those of its context's last application channel).
    pub fn expected_wait(&self) -> Duration {
        Duration::from_nanos(self.expected_wait_ns.load(Ordering::Relaxed))
    }

    /// How many times this channel's fence waits slept on the device's events, and how
    /// many of those sleeps an event ended rather than the waiter's own re-check (every
    /// 20 ms): (sleeps, woken).
    pub fn fence_sleeps(&self) -> (u64, u64) {
        (
            self.fence_sleeps.load(Ordering::Relaxed),
            self.fence_wakeups.load(Ordering::Relaxed),
        )
    }

    /// Sleeps until the device's next event (the GPU's wake-up for `fence`, or any other)
    /// or for at most `most`, with the channel's fence wake-up armed for `fence` (a
    /// channel has one waiter at a time: waiting borrows it, and it is not `Sync`).
    fn sleep_on_fence(&self, fence: Fence, most: Duration) -> Result<()> {
        let transport = &self.ctx.transport;
        // Taken before arming: an event that comes between the arming and the sleep
        // ends the sleep at once.
        let Some(seen) = transport.device_events(self.ctx.handle, self.handle) else {
            std::thread::sleep(most.min(Duration::from_micros(100)));
            return Ok(());
        };
        self.control.arm_fence_wake(fence.value);
        let result = match self.reached(fence) {
            Ok(false) => {
                self.fence_sleeps.fetch_add(1, Ordering::Relaxed);
                if transport.wait_device_events(
                    self.ctx.handle,
                    self.handle,
                    fence.value,
                    seen,
                    most,
                ) {
                    self.fence_wakeups.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            }
            other => other.map(|_| ()),
        };
        // Woken by the GPU it is disarmed already; otherwise no wake-up is wanted now.
        self.control.disarm_fence_wake();
        result
    }

    /// Like [`Channel::wait_timeout`], but sleeps in the driver (woken by the GPU's fence
    /// wake-up and other events, re-checked every few ms) instead of polling;
    /// `Unsupported` on transports without a kernel driver.
    pub fn block_on(&self, fence: Fence, timeout: Duration) -> Result<()> {
        if fence.channel != self.uid {
            return Err(Error::WrongChannel);
        }
        // The GPU's fence wake-up ends the sleep as soon as REF gets there (a forwarded
        // channel's page is the driver's copy: there the driver's re-checks do).
        if !self.forwarded {
            self.control.arm_fence_wake(fence.value);
        }
        let r = self.ctx.transport.block_on(
            self.ctx.handle,
            self.handle,
            crate::transport::BlockOn::Fence(fence.value),
            timeout,
        );
        if !self.forwarded {
            self.control.disarm_fence_wake();
        }
        r
    }

    /// Sleeps in the driver until the channel has executed `seq` NOTIFY methods (in
    /// total, wrapping), woken by the notify event.
    pub fn block_on_notify(&self, seq: u32, timeout: Duration) -> Result<()> {
        self.ctx.transport.block_on(
            self.ctx.handle,
            self.handle,
            crate::transport::BlockOn::Notify(seq),
            timeout,
        )
    }

    /// Waits until GP_GET reaches `seq` (e.g. a value from [`Channel::submit_raw_gp`]).
    pub fn wait_gp_get(&self, seq: u32, timeout: Option<Duration>) -> Result<()> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        wait_gp_get(&self.control, seq, deadline)
    }

    /// On a forwarded channel, fetches the control page's fields first (a request; a
    /// failure leaves the last values, and the next wait reports it).
    fn fresh(&self) {
        if self.forwarded {
            if let Err(e) = self.control.refresh() {
                log::debug!("channel {}: refreshing its status: {e}", self.handle.0);
            }
        }
    }

    /// The channel's error and its detail (faulting address or method offset), if any.
    pub fn error(&self) -> Option<(ErrorCode, u64)> {
        self.fresh();
        self.control.error()
    }

    /// GP_PUT as this channel published it.
    pub fn gp_put(&self) -> u32 {
        self.put
    }

    /// GP_GET: entries the GPU has completed.
    pub fn gp_get(&self) -> u32 {
        self.fresh();
        self.control.gp_get()
    }

    /// The REF field: the last fence value the GPU signalled.
    pub fn reference(&self) -> u32 {
        self.fresh();
        self.control.reference()
    }

    /// Count of notify methods executed.
    pub fn notify_seq(&self) -> u32 {
        self.fresh();
        self.control.notify_seq()
    }

    pub fn gp_entries(&self) -> u32 {
        self.gp_entries
    }

    /// GP entries this channel has published.
    pub fn submitted(&self) -> u64 {
        self.submitted
    }

    /// The transport's name for this channel (for logs and host-side lookups).
    pub fn handle(&self) -> ChanHandle {
        self.handle
    }

    /// The GPU address of the channel's memory (its GP ring first, then its arenas).
    pub fn ring_va(&self) -> u64 {
        self.mem.gpu_va()
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // Destroy first: the GPU must stop reading the ring before its memory goes or
        // another channel reuses it.
        let destroyed = self
            .ctx
            .transport
            .destroy_channel(self.ctx.handle, self.handle);
        // SAFETY: `mem` is taken once, here, and the channel is not used after `drop`.
        let mem = unsafe { ManuallyDrop::take(&mut self.mem) };
        match (destroyed, self.ctx.inner()) {
            (Ok(()), Some(ctx)) => ctx.keep_spare_arena(mem),
            (Err(e), _) => log::warn!("destroying channel {}: {e}", self.handle.0),
            (Ok(()), None) => {}
        }
    }
}

#[cfg(all(test, feature = "native"))]
mod tests {
    use std::sync::Arc;

    use vgpu_host_shim::sim::{SimConfig, SimGpu};

    use crate::Device;

    fn device() -> Device {
        let gpu = SimGpu::new(SimConfig {
            vram_bytes: 64 << 20,
            ..Default::default()
        })
        .expect("sim GPU");
        Device::native(gpu as Arc<dyn vgpu_host_shim::hal::Gpu>).expect("native device")
    }

    /// A new channel starts on the memory of its context's last destroyed channel (its
    /// bytes are still there), and only one channel at a time gets it.
    #[test]
    fn a_new_channel_starts_on_the_last_destroyed_channels_memory() {
        let ctx = device().create_context().unwrap();
        let first = ctx.create_channel().unwrap();
        let end = first.mem.len() - 4;
        first.mem.write_u32(end, &[0xfeed_f00d]).unwrap();
        drop(first);
        let second = ctx.create_channel().unwrap();
        assert_eq!(second.mem.read_u32_vec(end, 1).unwrap(), [0xfeed_f00d]);
        let third = ctx.create_channel().unwrap();
        assert_eq!(third.mem.read_u32_vec(end, 1).unwrap(), [0], "fresh memory");
        // A channel of another size leaves the spare to one of its size.
        third.mem.write_u32(end, &[0xbeef]).unwrap();
        drop(third);
        let _other = ctx
            .create_channel_with(super::ChannelOptions {
                gp_entries: 4096,
                ..Default::default()
            })
            .unwrap();
        let fourth = ctx.create_channel().unwrap();
        assert_eq!(fourth.mem.read_u32_vec(end, 1).unwrap(), [0xbeef]);
    }
}
