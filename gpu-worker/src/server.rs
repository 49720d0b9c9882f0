//! The worker's side: serves one [`Gpu`] to the backend over the command socket, sends
//! its channels' events on the event socket, and publishes their counters in the shared
//! counters page.
//!
//! Commands are decoded as untrusted input (`vgpu_worker_wire`) and run one at a time in
//! the order they arrive; each gets exactly one reply with its sequence number. Ids are
//! the backend's: the worker keeps its own GPU's ids behind them, so a backend id it
//! never created is `NotFound`, never another VM's object (a worker serves one VM).

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use log::{debug, error, info, warn};
use vgpu_host_shim::{
    ChannelConfig, ChannelId, ChannelResume, ContextId, EventSink, Gpu, GpuEvent, HalError,
    MapFlags, MapTarget,
};
use vgpu_protocol::{ErrorCode, PAGE_SIZE};
use vgpu_worker_wire::counters::{self, Record};
use vgpu_worker_wire::{
    decode_command, encode_event, encode_reply, Command, Event, Reply, Resume, Target,
};

use crate::guest_ram::GuestRam;
use crate::mapping::{file_len, memfd, Mapping};
use crate::socket;

/// How the worker runs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// How often live channels' counters are published (the scheduler reads them every
    /// interval, 10 ms by default: a millisecond keeps them within a tenth of it).
    pub publish_every: Duration,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            publish_every: Duration::from_millis(1),
        }
    }
}

/// Why the worker stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("the GPU offers no control pages file to share")]
    NoControlPages,
    #[error("the counters page: {0}")]
    Counters(std::io::Error),
    #[error("the command socket: {0}")]
    Socket(std::io::Error),
    #[error("a command frame: {0}")]
    Frame(vgpu_worker_wire::WireError),
    #[error("the first command was not Hello")]
    NoHello,
    #[error("starting the counters thread: {0}")]
    Thread(std::io::Error),
}

/// Sends a channel's events to the backend.
struct EventOut {
    sock: OwnedFd,
    seq: AtomicU32,
}

impl EventOut {
    fn send(&self, ev: Event) {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = socket::send(self.sock.as_fd(), &encode_event(seq, &ev), &[]) {
            // The backend is gone; the command loop sees it too and ends the worker.
            debug!("event {ev:?} not sent: {e}");
        }
    }
}

struct WireSink {
    ch: u32,
    out: Arc<EventOut>,
}

impl EventSink for WireSink {
    fn event(&self, ev: GpuEvent) {
        self.out.send(match ev {
            GpuEvent::Notify { token, .. } => Event::Notify { ch: self.ch, token },
            GpuEvent::Fence { reference, .. } => Event::Fence {
                ch: self.ch,
                reference,
            },
            GpuEvent::Error { code, info, .. } => Event::Error {
                ch: self.ch,
                code,
                info,
            },
        });
    }
}

/// A live channel: the GPU's id, its context (backend id) and its slot.
#[derive(Clone, Copy)]
struct Live {
    id: ChannelId,
    ctx: u32,
    slot: u32,
}

/// What the command loop and the counters thread share.
struct Published {
    gpu: Arc<dyn Gpu>,
    channels: Mutex<HashMap<u32, Live>>,
    counters: Mapping,
    stop: AtomicBool,
}

impl Published {
    fn lock(&self) -> MutexGuard<'_, HashMap<u32, Live>> {
        self.channels.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes every live channel's counters and error.
    fn publish_all(&self) {
        for live in self.lock().values() {
            self.publish(live);
        }
    }

    /// Publishes one channel's counters and error (under the channels' lock: the
    /// command loop frees a slot only under it).
    fn publish(&self, live: &Live) {
        let (Ok(c), Ok(error)) = (
            self.gpu.channel_counters(live.id),
            self.gpu.channel_error(live.id),
        ) else {
            return;
        };
        if let Ok(rec) = counters::record(self.counters.words(), live.slot) {
            counters::publish(
                rec,
                &Record {
                    busy_ns: c.busy_ns,
                    gp_completed: c.gp_completed,
                    kernels: c.kernels,
                    copies: c.copies,
                    sem_wait_ns: c.sem_wait_ns,
                    error,
                },
            );
        }
    }
}

/// The command loop's state.
struct Worker {
    gpu: Arc<dyn Gpu>,
    ram: Arc<GuestRam>,
    copy_buf: Option<Mapping>,
    contexts: HashMap<u32, ContextId>,
    published: Arc<Published>,
    events: Arc<EventOut>,
}

/// A module image: `len` bytes of the memfd the backend sent (its one copy of what the
/// guest wrote; sealed, so it cannot change under the driver's JIT).
fn read_image(fd: OwnedFd, len: u64) -> Result<Vec<u8>, Refused> {
    use std::os::unix::fs::FileExt;
    if file_len(fd.as_fd()).map_or(true, |f| f < len) {
        return Err(Refused(ErrorCode::InvalidArgument));
    }
    let n = usize::try_from(len).map_err(|_| Refused(ErrorCode::InvalidArgument))?;
    let mut image = vec![0u8; n];
    std::fs::File::from(fd)
        .read_exact_at(&mut image, 0)
        .map_err(|e| {
            warn!("reading a module image: {e}");
            Refused(ErrorCode::InvalidArgument)
        })?;
    Ok(image)
}

/// A command refused: the code the backend gets.
struct Refused(ErrorCode);

impl From<HalError> for Refused {
    fn from(e: HalError) -> Self {
        debug!("refused: {e}");
        Refused(e.code())
    }
}

fn target(t: Target) -> MapTarget {
    match t {
        Target::Vram { offset } => MapTarget::Vram { offset },
        Target::Sysram { addr } => MapTarget::Sysram { addr },
    }
}

impl Worker {
    /// `len` bytes of the copy buffer at `offset`, for one command's copy (the backend
    /// does not touch them while the command runs). Mutable from `&self`: the buffer is
    /// shared memory reached through the mapping's pointer, and the worker serves one
    /// command at a time, so no two pieces are alive at once.
    #[allow(clippy::mut_from_ref)]
    fn copy_piece(&self, offset: u64, len: u64) -> Result<&mut [u8], Refused> {
        let buf = self
            .copy_buf
            .as_ref()
            .and_then(|b| b.ptr(offset, len))
            .ok_or(Refused(ErrorCode::InvalidArgument))?;
        let n = usize::try_from(len).map_err(|_| Refused(ErrorCode::InvalidArgument))?;
        // SAFETY: `buf..buf+n` lies inside the copy buffer's mapping (checked by `ptr`),
        // which lives as long as `self`; only the command being served uses it.
        Ok(unsafe { std::slice::from_raw_parts_mut(buf, n) })
    }

    fn ctx(&self, ctx: u32) -> Result<ContextId, Refused> {
        self.contexts
            .get(&ctx)
            .copied()
            .ok_or(Refused(ErrorCode::NotFound))
    }

    fn channel(&self, ch: u32) -> Result<Live, Refused> {
        self.published
            .lock()
            .get(&ch)
            .copied()
            .ok_or(Refused(ErrorCode::NotFound))
    }

    fn run(&mut self, c: Command, mut fds: Vec<OwnedFd>) -> Result<Reply, Refused> {
        let g = &self.gpu;
        Ok(match c {
            Command::Hello { .. } => return Err(Refused(ErrorCode::InvalidArgument)),
            Command::AddGuestRegion {
                gpa,
                len,
                fd_offset,
            } => {
                let fd = fds.pop().ok_or(Refused(ErrorCode::InvalidArgument))?;
                self.ram.add(fd, gpa, len, fd_offset).map_err(|e| {
                    warn!("guest region refused: {e}");
                    Refused(ErrorCode::InvalidArgument)
                })?;
                Reply::Ok
            }
            Command::ClearGuestRegions => {
                // A context's GPU work may reach the regions until the context is gone.
                if !self.contexts.is_empty() {
                    return Err(Refused(ErrorCode::Busy));
                }
                self.ram.clear();
                Reply::Ok
            }
            Command::CopyBuffer { len } => {
                let fd = fds.pop().ok_or(Refused(ErrorCode::InvalidArgument))?;
                if file_len(fd.as_fd()).map_or(true, |f| f < len) {
                    return Err(Refused(ErrorCode::InvalidArgument));
                }
                self.copy_buf = Some(
                    Mapping::new(fd.as_fd(), 0, len, true)
                        .map_err(|_| Refused(ErrorCode::NoMemory))?,
                );
                Reply::Ok
            }
            Command::CreateContext { ctx } => {
                if self.contexts.contains_key(&ctx) {
                    return Err(Refused(ErrorCode::InvalidArgument));
                }
                let id = g.create_context(self.ram.clone())?;
                self.contexts.insert(ctx, id);
                Reply::Ok
            }
            Command::DestroyContext { ctx } => {
                let id = self.ctx(ctx)?;
                g.destroy_context(id)?;
                self.contexts.remove(&ctx);
                self.published.lock().retain(|_, l| l.ctx != ctx);
                Reply::Ok
            }
            Command::AllocVram { size, align } => {
                let a = g.alloc_vram(size, align)?;
                Reply::Vram {
                    offset: a.offset,
                    len: a.size,
                }
            }
            Command::FreeVram { offset } => {
                g.free_vram(offset)?;
                Reply::Ok
            }
            Command::VramFree => Reply::Bytes {
                n: g.vram_free_bytes(),
            },
            Command::Map {
                ctx,
                va,
                size,
                target: t,
                page,
                read_only,
            } => {
                g.map(
                    self.ctx(ctx)?,
                    va,
                    size,
                    target(t),
                    page,
                    MapFlags { read_only },
                )?;
                Reply::Ok
            }
            Command::Unmap { ctx, va, size } => {
                g.unmap(self.ctx(ctx)?, va, size)?;
                Reply::Ok
            }
            Command::Remap {
                ctx,
                va,
                size,
                target: t,
            } => {
                g.remap(self.ctx(ctx)?, va, size, target(t))?;
                Reply::Ok
            }
            Command::InvalidateTlb { ctx } => {
                g.invalidate_tlb(self.ctx(ctx)?)?;
                Reply::Ok
            }
            Command::PageTableBytes { ctx } => Reply::Bytes {
                n: g.page_table_bytes(self.ctx(ctx)?)?,
            },
            Command::MapCost {
                ctx,
                va,
                size,
                page,
            } => Reply::Bytes {
                n: g.map_cost(self.ctx(ctx)?, va, size, page)?,
            },
            Command::SysramHint {
                ctx,
                addr,
                len,
                prepare,
            } => {
                let id = self.ctx(ctx)?;
                if prepare {
                    g.prepare_sysram_hint(id, addr, len)?;
                } else {
                    g.release_sysram_hint(id, addr, len);
                }
                Reply::Ok
            }
            Command::CreateChannel {
                ctx,
                ch,
                gp_ring_va,
                gp_entries,
                resume,
            } => self.create_channel(ctx, ch, gp_ring_va, gp_entries, resume)?,
            Command::DestroyChannel { ch } => {
                let live = self.channel(ch)?;
                g.destroy_channel(live.id)?;
                self.published.lock().remove(&ch);
                Reply::Ok
            }
            Command::KillChannel { ch, code } => {
                g.kill_channel(self.channel(ch)?.id, code)?;
                Reply::Ok
            }
            Command::Doorbell { ch } => {
                g.doorbell(self.channel(ch)?.id);
                Reply::Ok
            }
            Command::HoldFetch { ch, hold } => Reply::Bytes {
                n: u64::from(g.hold_fetch(self.channel(ch)?.id, hold)?),
            },
            Command::FetchedDone { ch } => Reply::Bytes {
                n: match g.fetched_done(self.channel(ch)?.id)? {
                    None => 0,
                    Some(false) => 1,
                    Some(true) => 2,
                },
            },
            Command::Copy {
                vram_offset,
                buf_offset,
                len,
                to_vram,
            } => {
                let piece = self.copy_piece(buf_offset, len)?;
                if to_vram {
                    g.vram_write(vram_offset, piece)?;
                } else {
                    g.vram_read(vram_offset, piece)?;
                }
                Reply::Ok
            }
            Command::Shutdown => Reply::Ok,
            Command::ModuleLoad { ctx, module, len } => {
                let id = self.ctx(ctx)?;
                let fd = fds.pop().ok_or(Refused(ErrorCode::InvalidArgument))?;
                let image = read_image(fd, len)?;
                g.module_load(id, module, &image)?;
                Reply::Ok
            }
            Command::ModuleUnload { ctx, module } => {
                g.module_unload(self.ctx(ctx)?, module)?;
                Reply::Ok
            }
            Command::FunctionGet {
                ctx,
                module,
                function,
                name,
            } => {
                let name =
                    std::str::from_utf8(&name).map_err(|_| Refused(ErrorCode::InvalidArgument))?;
                Reply::Function {
                    params: g.function_get(self.ctx(ctx)?, module, name, function)?,
                }
            }
            Command::GlobalGet { ctx, module, name } => {
                let name =
                    std::str::from_utf8(&name).map_err(|_| Refused(ErrorCode::InvalidArgument))?;
                let gl = g.global_get(self.ctx(ctx)?, module, name)?;
                Reply::Global {
                    addr: gl.addr,
                    size: gl.size,
                }
            }
            Command::VariableCopy {
                ctx,
                module,
                name,
                offset,
                len,
                to_variable,
            } => {
                let name =
                    std::str::from_utf8(&name).map_err(|_| Refused(ErrorCode::InvalidArgument))?;
                let id = self.ctx(ctx)?;
                let piece = self.copy_piece(0, len)?;
                if to_variable {
                    g.global_write(id, module, name, offset, piece)?;
                } else {
                    g.global_read(id, module, name, offset, piece)?;
                }
                Reply::Ok
            }
        })
    }

    fn create_channel(
        &mut self,
        ctx: u32,
        ch: u32,
        gp_ring_va: u64,
        gp_entries: u32,
        resume: Option<Resume>,
    ) -> Result<Reply, Refused> {
        let cid = self.ctx(ctx)?;
        if self.published.lock().contains_key(&ch) {
            return Err(Refused(ErrorCode::InvalidArgument));
        }
        let cfg = ChannelConfig {
            gp_ring_va,
            gp_entries,
        };
        let sink = Arc::new(WireSink {
            ch,
            out: self.events.clone(),
        });
        let id = match resume {
            None => self.gpu.create_channel(cid, cfg, sink)?,
            Some(r) => self.gpu.create_channel_resumed(
                cid,
                cfg,
                sink,
                ChannelResume {
                    gp_get: r.gp_get,
                    reference: r.reference,
                    notify_seq: r.notify_seq,
                    error: r.error,
                },
            )?,
        };
        let slot = match self.gpu.control_page(id) {
            Ok(p) => u32::try_from(p.offset / PAGE_SIZE).ok(),
            Err(_) => None,
        };
        let words = self.published.counters.words();
        let Some(slot) = slot.filter(|s| counters::record(words, *s).is_ok()) else {
            if let Err(e) = self.gpu.destroy_channel(id) {
                warn!("undoing channel {ch}: {e}");
            }
            return Err(Refused(ErrorCode::Internal));
        };
        // Published before the backend hears of the channel: it never reads the slot's
        // previous channel's counters, and a resumed channel's error is there at once.
        let live = Live { id, ctx, slot };
        let mut chans = self.published.lock();
        self.published.publish(&live);
        chans.insert(ch, live);
        Ok(Reply::Channel { slot })
    }
}

/// Serves `gpu` on `cmd` (commands in, replies out) and `events` (events out) until the
/// backend says `Shutdown` or goes away.
/// A worker's exit status when its GPU faulted for good (a sticky CUDA error).
pub const EXIT_GPU_LOST: i32 = 75;

pub fn serve(
    gpu: Arc<dyn Gpu>,
    cmd: OwnedFd,
    events: OwnedFd,
    opts: ServeOptions,
) -> Result<(), ServeError> {
    let pages = gpu.control_pages().ok_or(ServeError::NoControlPages)?;
    let gi = gpu.info();
    let counters_len = counters::page_len(gi.max_channels);
    let counters_fd = memfd("vgpu-worker-counters", counters_len).map_err(ServeError::Counters)?;
    let counters_map =
        Mapping::new(counters_fd.as_fd(), 0, counters_len, true).map_err(ServeError::Counters)?;

    // Hello first: the backend learns the GPU's shape and gets the shared pages.
    let first = socket::recv(cmd.as_fd())
        .map_err(ServeError::Socket)?
        .ok_or(ServeError::NoHello)?;
    let (seq, hello) =
        decode_command(&first.frame, first.fds.len() as u8).map_err(ServeError::Frame)?;
    let Command::Hello { worker } = hello else {
        return Err(ServeError::NoHello);
    };
    let reply = Reply::Hello {
        vram_bytes: gi.vram_bytes,
        max_channels: gi.max_channels,
        max_contexts: gi.max_contexts,
        compute_engines: gi.compute_engines,
        control_pages_len: pages.len,
        counters_len,
        attributes: gpu.device_attributes(0).unwrap_or_default(),
    };
    socket::send(
        cmd.as_fd(),
        &encode_reply(seq, &reply),
        &[pages.fd, counters_fd.as_raw_fd()],
    )
    .map_err(ServeError::Socket)?;
    info!(
        "worker {worker}: serving {} ({} MiB VRAM)",
        gi.name,
        gi.vram_bytes >> 20
    );

    let published = Arc::new(Published {
        gpu: gpu.clone(),
        channels: Mutex::new(HashMap::new()),
        counters: counters_map,
        stop: AtomicBool::new(false),
    });
    let p = published.clone();
    let every = opts.publish_every;
    let publisher = std::thread::Builder::new()
        .name("worker-counters".into())
        .spawn(move || {
            while !p.stop.load(Ordering::Acquire) {
                p.publish_all();
                if let Some(why) = p.gpu.lost() {
                    // Every context of this process is gone: only a new worker gets a
                    // working GPU. The backend reads the exit status as a GPU fault.
                    error!("the GPU is lost ({why}); exiting");
                    std::process::exit(EXIT_GPU_LOST);
                }
                std::thread::sleep(every);
            }
        })
        .map_err(ServeError::Thread)?;

    let mut w = Worker {
        gpu,
        ram: Arc::new(GuestRam::default()),
        copy_buf: None,
        contexts: HashMap::new(),
        published: published.clone(),
        events: Arc::new(EventOut {
            sock: events,
            seq: AtomicU32::new(0),
        }),
    };
    let result = loop {
        let got = match socket::recv(cmd.as_fd()) {
            Ok(Some(r)) => r,
            Ok(None) => {
                info!("worker {worker}: the backend closed the connection");
                break Ok(());
            }
            Err(e) => break Err(ServeError::Socket(e)),
        };
        let (seq, c) = match decode_command(&got.frame, got.fds.len() as u8) {
            Ok(x) => x,
            Err(e) => break Err(ServeError::Frame(e)),
        };
        let shutdown = c == Command::Shutdown;
        let reply = w
            .run(c, got.fds)
            .unwrap_or_else(|Refused(code)| Reply::Error { code });
        if let Err(e) = socket::send(cmd.as_fd(), &encode_reply(seq, &reply), &[]) {
            break Err(ServeError::Socket(e));
        }
        if shutdown {
            info!("worker {worker}: shut down");
            break Ok(());
        }
    };
    published.stop.store(true, Ordering::Release);
    let _ = publisher.join();
    // Channels and contexts go before the GPU (the channels' sinks hold the event socket).
    for (_, id) in w.contexts.drain() {
        if let Err(e) = w.gpu.destroy_context(id) {
            warn!("worker {worker}: destroying a context: {e}");
        }
    }
    result
}
