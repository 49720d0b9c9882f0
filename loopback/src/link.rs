//! Losing the backend and reconnecting ([`LoopbackVm::connect_with`]).
//!
//! The irq thread reports a hang-up and a control request that outlived its deadline
//! reports a hung backend; both fail the requests in flight at once (the BAR window is
//! cleared so nobody touches the old backend's pages). A supervisor thread then closes
//! the connection and, under a reconnect policy, tries the socket again with backoff.
//! On success the device starts over, as a guest driver's reset would: fresh rings at
//! index 0, the event buffers posted again, and a new **generation** — requests of
//! processes that began before it fail with `DeviceReset`, new ones work.

use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use log::{error, info, warn};
use vgpu_protocol::device::DeviceConfig;

use super::{driver_features, set_event_idx, uses_event_idx};
use super::{lock, loopback_requirements, with_queues, IrqThread, LoopbackError, LoopbackVm};
use vgpu_vmm::frontend::VhostUserDevice;
use vgpu_vmm::reconnect::retry;

#[derive(Debug, Default)]
struct LinkState {
    /// Why the backend counts as lost (not yet acted upon).
    lost: Option<&'static str>,
    stop: bool,
}

/// Loss reports and the supervisor's sleep.
#[derive(Debug, Default)]
pub(super) struct Link {
    st: Mutex<LinkState>,
    cv: Condvar,
}

impl Link {
    /// The backend is gone or hung; the supervisor reacts.
    pub(super) fn report_lost(&self, why: &'static str) {
        lock(&self.st).lost.get_or_insert(why);
        self.cv.notify_all();
    }

    /// The VM is going away: the supervisor stops (also mid-backoff).
    pub(super) fn stop(&self) {
        lock(&self.st).stop = true;
        self.cv.notify_all();
    }

    /// Forgets reports about a connection that is already closed.
    fn clear_lost(&self) {
        lock(&self.st).lost = None;
    }

    /// The next loss report, or `None` once stopped.
    fn wait_lost(&self) -> Option<&'static str> {
        let mut st = lock(&self.st);
        loop {
            if st.stop {
                return None;
            }
            if let Some(why) = st.lost.take() {
                return Some(why);
            }
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Sleeps `d`; false if stopped meanwhile.
    fn sleep(&self, d: Duration) -> bool {
        let deadline = Instant::now() + d;
        let mut st = lock(&self.st);
        loop {
            if st.stop {
                return false;
            }
            let now = Instant::now();
            if now >= deadline {
                return true;
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// Starts the VM's supervisor thread (it holds the VM only weakly).
pub(super) fn start_supervisor(vm: &Arc<LoopbackVm>) -> Result<(), LoopbackError> {
    let weak = Arc::downgrade(vm);
    let link = vm.link.clone();
    let t = std::thread::Builder::new()
        .name("vgpu-loopback-link".into())
        .spawn(move || supervise(&weak, &link))
        .map_err(LoopbackError::Spawn)?;
    *lock(&vm.supervisor) = Some(t);
    Ok(())
}

/// Joins the supervisor (after [`Link::stop`]), unless this is the supervisor itself
/// dropping the last reference to the VM.
pub(super) fn join_supervisor(vm: &LoopbackVm) {
    let Some(t) = lock(&vm.supervisor).take() else {
        return;
    };
    if t.thread().id() == std::thread::current().id() {
        return;
    }
    if t.join().is_err() {
        error!("loopback VM supervisor panicked");
    }
}

fn supervise(weak: &Weak<LoopbackVm>, link: &Link) {
    while let Some(why) = link.wait_lost() {
        let Some(vm) = weak.upgrade() else {
            return;
        };
        warn!("loopback VM: {why}; closing the connection, the device needs a reset");
        vm.drop_connection();
        let Some(policy) = vm.faults.reconnect else {
            error!("loopback VM: no reconnect policy; the device stays broken");
            return;
        };
        // Hold the VM only while trying, so that it can go away between attempts.
        drop(vm);
        let relinked = retry(
            &policy,
            "loopback VM",
            |d| link.sleep(d),
            || weak.upgrade().ok_or(LoopbackError::Disconnected)?.relink(),
        );
        if let Err(e) = relinked {
            error!("loopback VM: no backend ({e}); the device stays broken");
            return;
        }
    }
}

impl LoopbackVm {
    /// Closes a lost connection: requests in flight fail, the rings stop, the old
    /// backend's pages leave the BAR window.
    fn drop_connection(&self) {
        let mut dev = lock(&self.dev);
        lock(&self.irq).stop();
        self.ctrl.kill();
        self.events.kill();
        // Also stops the backend-request thread: a hung backend's late SHMEM_MAP can no
        // longer land in the window after the clear below.
        dev.disconnect();
        self.shm.clear_to(vgpu_vmm::shm_window::HoleFill::Scratch);
    }

    /// One reconnect attempt: connect, negotiate, start the device over on fresh rings.
    fn relink(&self) -> Result<(), LoopbackError> {
        let socket = lock(&self.socket).clone();
        let mut dev = VhostUserDevice::connect(
            &socket,
            &loopback_requirements(self.faults.request_timeout, self.forwarded),
            self.handler.clone(),
        )?;
        if DeviceConfig::decode(dev.config()).is_none() {
            return Err(LoopbackError::BadDeviceConfig);
        }
        let mut cur = lock(&self.dev);
        if !self.connected.load(std::sync::atomic::Ordering::Acquire) {
            dev.disconnect();
            return Err(LoopbackError::Disconnected);
        }
        // The new backend starts both rings at index 0, with EVENT_IDX if it offers it.
        let event_idx = uses_event_idx(&dev, self.want_event_idx);
        set_event_idx(&self.ctrl, &self.events, event_idx);
        self.ctrl.reset_rings();
        self.events.revive()?;
        with_queues(&self.ctrl, &self.events, |queues| {
            dev.activate(
                driver_features(self.forwarded, event_idx),
                &self.ram.vhost_regions(),
                queues,
            )
        })?;
        self.link.clear_lost();
        let irq = IrqThread::start(
            self.ctrl.clone(),
            self.events.clone(),
            self.shm.clone(),
            dev.socket_fd(),
            self.interrupts_only,
        )?;
        *lock(&self.irq) = irq;
        *cur = dev;
        self.ctrl.revive();
        self.events.kick();
        info!(
            "loopback VM: reconnected to {}; device generation {}",
            socket.display(),
            self.ctrl.epoch()
        );
        Ok(())
    }
}
