//! The interrupt thread: waits on the queues' call eventfds and harvests used buffers.

use crate::*;

/// The "interrupt" thread: waits on the call eventfds and harvests used rings; also
/// notices the backend hanging up.
pub(crate) struct IrqThread {
    pub(crate) exit: EventFd,
    pub(crate) thread: Option<JoinHandle<()>>,
}

impl IrqThread {
    /// With `interrupts_only`, a ring is harvested only after its call eventfd fired.
    pub(crate) fn start(
        ctrl: Arc<Ctrl>,
        events: Arc<Events>,
        shm: Arc<ShmWindow>,
        sock: RawFd,
        interrupts_only: bool,
    ) -> Result<Self, LoopbackError> {
        let exit = new_eventfd()?;
        let exit_fd = exit.as_raw_fd();
        let thread = std::thread::Builder::new()
            .name("vgpu-loopback-irq".into())
            .spawn(move || irq_loop(&ctrl, &events, &shm, exit_fd, sock, interrupts_only))
            .map_err(LoopbackError::Spawn)?;
        Ok(IrqThread {
            exit,
            thread: Some(thread),
        })
    }

    pub(crate) fn stop(&mut self) {
        if let Some(t) = self.thread.take() {
            kick(&self.exit);
            if t.join().is_err() {
                error!("irq thread panicked");
            }
        }
    }
}

pub(crate) fn irq_loop(
    ctrl: &Ctrl,
    events: &Events,
    shm: &ShmWindow,
    exit_fd: RawFd,
    mut sock: RawFd,
    interrupts_only: bool,
) {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: exit_fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: ctrl.call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: events.call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                // Negative fds are ignored by poll.
                fd: sock,
                events: libc::POLLRDHUP,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of 4 pollfd for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                error!("irq thread: poll: {e}");
                return;
            }
            continue;
        }
        if fds[0].revents != 0 {
            return;
        }
        if fds[3].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            warn!("backend hung up");
            sock = -1;
            // The backend has freed what it mapped into the BAR. Cleared before the
            // requests fail, so whoever sees the device dead sees the window empty too.
            shm.clear_to(vgpu_vmm::shm_window::HoleFill::Scratch);
            ctrl.kill();
            events.kill();
            ctrl.link.report_lost("the backend hung up");
        }
        let ctrl_irq = fds[1].revents != 0;
        if ctrl_irq {
            ctrl.counters.interrupt(&ctrl.call);
        }
        let events_irq = fds[2].revents != 0;
        if events_irq {
            events.counters.interrupt(&events.call);
        }
        // Unless told to behave as an interrupt handler, harvest unconditionally: cheap,
        // and robust against a lost notification.
        if ctrl_irq || !interrupts_only {
            ctrl.harvest();
        }
        if events_irq || !interrupts_only {
            events.harvest();
        }
    }
}
