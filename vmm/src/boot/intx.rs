//! INTx delivery for the vhost-user vgpu device.
//!
//! The backend signals a queue's call eventfd when it adds used buffers. With INTx the
//! guest's handler (`vp_interrupt`) first reads the ISR and ignores the interrupt if the
//! queue bit is clear, so the call cannot be wired straight to an irqfd: a thread waits on
//! the call eventfds, sets the ISR's queue bit in the device, then pulses the function's
//! interrupt line through an irqfd (programmed edge-triggered by the MP table, so a pulse
//! that arrives while the guest still handles the previous one is not lost).
//!
//! The same thread watches the vhost-user socket: when the backend goes away (or the
//! request watchdog closed it because it stopped answering) the connection is dropped —
//! the old backend's pages leave the BAR window —, the device is marked
//! `DEVICE_NEEDS_RESET` with a configuration interrupt (through `config_irq`, which the VMM
//! routes to INTx or to the configuration's MSI-X vector), and an error is logged. Under
//! the device's reconnect policy the thread then retries the socket with backoff; once a
//! backend answers, the device asks the driver for a reset again (the driver may have
//! reset it while no backend was there), and the driver's reset and `DRIVER_OK` bring it
//! up on the new backend. A queue whose calls go straight to an MSI-X irqfd is taken out of the thread's
//! wait set ([`IntxForwarder::forward_queue`]).

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use std::time::Duration;

use log::{debug, error, info, warn};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::with_vgpu;
use crate::pci::PciBus;
use crate::reconnect::{retry, ReconnectError, ReconnectPolicy};
use crate::vgpu_device::VhostUserVgpu;
use crate::virtio_pci::VirtioPciDevice;

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

/// Sleeps `d` in `epoll`, dropping queue signals (no backend serves the queues);
/// false if asked to stop.
fn sleep_unless_stopped(epoll: &Epoll, calls: &[Arc<EventFd>], d: Duration) -> bool {
    let deadline = std::time::Instant::now() + d;
    let mut events = vec![EpollEvent::default(); calls.len() + 2];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return true;
        }
        let ms = i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX);
        let n = match epoll.wait(ms, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                error!("vgpu-intx: epoll: {e}");
                return false;
            }
        };
        for ev in &events[..n] {
            match ev.data() {
                TAG_STOP => return false,
                q => {
                    if let Some(c) = calls.get(q as usize) {
                        let _ = c.read();
                    }
                }
            }
        }
    }
}

/// Raises the configuration interrupt.
fn raise_config(config_irq: &EventFd) {
    if let Err(e) = config_irq.write(1) {
        warn!("vgpu-intx: raising the configuration interrupt: {e}");
    }
}

/// The backend is lost: drop the connection and ask the driver for a reset.
fn backend_lost(bus: &Mutex<PciBus>, slot: u8, config_irq: &EventFd) {
    let failed = with_vgpu(bus, slot, |d| {
        d.backend_mut().drop_connection();
        d.device_failed()
    });
    if failed == Some(true) {
        raise_config(config_irq);
    }
}

/// Retries the backend under `policy`; the new connection's socket on success, and
/// whether the driver must be asked for a reset.
fn reconnect(
    epoll: &Epoll,
    calls: &[Arc<EventFd>],
    bus: &Mutex<PciBus>,
    slot: u8,
    policy: &ReconnectPolicy,
) -> Result<(RawFd, bool), ReconnectError> {
    let Some((path, faults, handler, config)) = with_vgpu(bus, slot, |d| {
        let b = d.backend();
        (
            b.socket_path().to_path_buf(),
            b.fault_policy(),
            b.handler().clone(),
            b.config_bytes().to_vec(),
        )
    }) else {
        return Err(ReconnectError::Stopped);
    };
    let what = format!("vgpu backend at {}", path.display());
    // Connecting and negotiating happen without the bus lock: vCPUs keep running.
    let dev = retry(
        policy,
        &what,
        |d| sleep_unless_stopped(epoll, calls, d),
        || VhostUserVgpu::connect_again(&path, faults, &handler, Some(&config)),
    )?;
    let socket = dev.socket_fd();
    let ask = with_vgpu(bus, slot, |d| adopt(d, dev)).ok_or(ReconnectError::Stopped)?;
    Ok((socket, ask))
}

/// Installs the new connection; a driver that touched the device meanwhile (its status is
/// not 0: it may have reset and activated while no backend was there) is asked for a
/// reset again (true).
fn adopt(d: &mut VirtioPciDevice<VhostUserVgpu>, dev: crate::frontend::VhostUserDevice) -> bool {
    d.backend_mut().adopt(dev);
    d.device_failed()
}

fn forward(
    epoll: &Epoll,
    calls: &[Arc<EventFd>],
    mut socket: RawFd,
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
                    error!("vgpu: the vhost-user connection to the backend ended; the device needs a reset");
                    let _ = epoll.ctl(ControlOperation::Delete, socket, EpollEvent::default());
                    backend_lost(bus, slot, config_irq);
                    let policy = with_vgpu(bus, slot, |d| d.backend().fault_policy().reconnect);
                    let Some(Some(policy)) = policy else {
                        error!("vgpu: no reconnect policy; the device stays broken");
                        continue;
                    };
                    match reconnect(epoll, calls, bus, slot, &policy) {
                        Ok((new, ask)) => {
                            socket = new;
                            if let Err(e) = epoll.ctl(
                                ControlOperation::Add,
                                socket,
                                EpollEvent::new(
                                    EventSet::READ_HANG_UP | EventSet::HANG_UP,
                                    TAG_SOCKET,
                                ),
                            ) {
                                error!("vgpu-intx: watching the new connection: {e}");
                            }
                            if ask {
                                info!("vgpu: backend back; asking the driver for a reset");
                                raise_config(config_irq);
                            } else {
                                info!("vgpu: backend back; the device is in reset");
                            }
                        }
                        Err(ReconnectError::Stopped) => return,
                        Err(e) => error!("vgpu: {e}; the device stays broken"),
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
