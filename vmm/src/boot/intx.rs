//! INTx delivery for the vhost-user vgpu device.
//!
//! The backend signals a queue's call eventfd when it adds used buffers. With INTx the
//! guest's handler (`vp_interrupt`) first reads the ISR and ignores the interrupt if the
//! queue bit is clear, so the call cannot be wired straight to an irqfd: a thread waits on
//! the call eventfds, sets the ISR's queue bit in the device, then pulses the function's
//! interrupt line through an irqfd (programmed edge-triggered by the MP table, so a pulse
//! that arrives while the guest still handles the previous one is not lost).
//!
//! The same thread watches the vhost-user socket: when the backend goes away the device
//! is marked `DEVICE_NEEDS_RESET` with a configuration interrupt (through `config_irq`,
//! which the VMM routes to INTx or to the configuration's MSI-X vector), and an error is
//! logged. A queue whose calls go straight to an MSI-X irqfd is taken out of the thread's
//! wait set ([`IntxForwarder::forward_queue`]).

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use log::{debug, error, warn};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::with_vgpu;
use crate::pci::PciBus;

/// epoll tags: queue calls are `0..n`.
const TAG_STOP: u64 = u64::MAX;
const TAG_SOCKET: u64 = u64::MAX - 1;

/// The forwarding thread; stopped and joined on drop.
pub struct IntxForwarder {
    stop: EventFd,
    epoll: Arc<Epoll>,
    calls: Vec<Arc<EventFd>>,
    thread: Option<JoinHandle<()>>,
}

impl IntxForwarder {
    /// Starts forwarding the calls of the vgpu function in `slot` to `irq` (an eventfd
    /// registered as an irqfd on the function's interrupt line); configuration interrupts
    /// go to `config_irq`.
    pub fn start(
        bus: Arc<Mutex<PciBus>>,
        slot: u8,
        irq: EventFd,
        config_irq: Arc<EventFd>,
    ) -> io::Result<Self> {
        let (calls, socket) = with_vgpu(&bus, slot, |d| {
            (d.backend().calls().to_vec(), d.backend().socket_fd())
        })
        .ok_or_else(|| io::Error::other("no vgpu function in that slot"))?;
        let stop = EventFd::new(EFD_NONBLOCK)?;
        let epoll = Arc::new(Epoll::new()?);
        let add = |fd: RawFd, events: EventSet, tag: u64| {
            epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(events, tag))
        };
        for (i, c) in calls.iter().enumerate() {
            add(c.as_raw_fd(), EventSet::IN, i as u64)?;
        }
        add(stop.as_raw_fd(), EventSet::IN, TAG_STOP)?;
        // Only hang-ups: the frontend reads the socket itself.
        add(
            socket,
            EventSet::READ_HANG_UP | EventSet::HANG_UP,
            TAG_SOCKET,
        )?;
        // The epoll set refers to `stop`'s file, which lives as long as `self`.
        let (ep, cs) = (epoll.clone(), calls.clone());
        let thread = std::thread::Builder::new()
            .name("vgpu-intx".into())
            .spawn(move || {
                vgpu_sandbox::enter(vgpu_sandbox::Role::VmmIrq);
                forward(&ep, &cs, socket, &bus, slot, &irq, &config_irq)
            })?;
        Ok(IntxForwarder {
            stop,
            epoll,
            calls,
            thread: Some(thread),
        })
    }

    /// Whether queue `q`'s calls go through this thread (INTx) or not (an MSI-X irqfd
    /// consumes them).
    pub fn forward_queue(&self, q: usize, on: bool) -> io::Result<()> {
        let Some(c) = self.calls.get(q) else {
            return Ok(());
        };
        let res = if on {
            self.epoll.ctl(
                ControlOperation::Add,
                c.as_raw_fd(),
                EpollEvent::new(EventSet::IN, q as u64),
            )
        } else {
            self.epoll.ctl(
                ControlOperation::Delete,
                c.as_raw_fd(),
                EpollEvent::default(),
            )
        };
        match res {
            // Already in (or out of) the set.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EEXIST) | Some(libc::ENOENT)) => Ok(()),
            other => other,
        }
    }
}

fn forward(
    epoll: &Epoll,
    calls: &[Arc<EventFd>],
    socket: RawFd,
    bus: &Mutex<PciBus>,
    slot: u8,
    irq: &EventFd,
    config_irq: &EventFd,
) {
    let mut events = vec![EpollEvent::default(); calls.len() + 2];
    loop {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                error!("vgpu-intx: epoll: {e}");
                return;
            }
        };
        let mut raise = false;
        for ev in &events[..n] {
            match ev.data() {
                TAG_STOP => return,
                TAG_SOCKET => {
                    error!("vgpu: the backend closed the vhost-user connection; the device needs a reset");
                    let _ = epoll.ctl(ControlOperation::Delete, socket, EpollEvent::default());
                    with_vgpu(bus, slot, |d| d.device_failed());
                    if let Err(e) = config_irq.write(1) {
                        warn!("vgpu-intx: raising the configuration interrupt: {e}");
                    }
                }
                q => {
                    if let Some(c) = calls.get(q as usize) {
                        // Non-blocking: a spurious wake-up reads EAGAIN.
                        if c.read().is_ok() {
                            with_vgpu(bus, slot, |d| d.signal_queue());
                            raise = true;
                        }
                    }
                }
            }
        }
        if raise {
            if let Err(e) = irq.write(1) {
                warn!("vgpu-intx: raising the interrupt: {e}");
            }
        }
        debug!("vgpu-intx: {n} event(s), interrupt: {raise}");
    }
}

impl Drop for IntxForwarder {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
