//! One vCPU: real-mode setup, the run loop, and kicking it out of the guest.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use kvm_bindings::kvm_regs;
use kvm_ioctls::{VcpuExit, VcpuFd};
use log::warn;
use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

use super::vm::Slots;
use super::KvmError;

/// An exit of [`Vcpu::run`] for userspace to handle. For `IoIn` and `MmioRead`, fill
/// `data` before the next `run`.
#[derive(Debug)]
pub enum VmExit<'a> {
    /// `out` to `port`; `data` is `count * size` bytes (string I/O may batch).
    IoOut { port: u16, data: &'a [u8] },
    /// `in` from `port`.
    IoIn { port: u16, data: &'a mut [u8] },
    /// A read of guest-physical `addr` outside every memslot.
    MmioRead { addr: u64, data: &'a mut [u8] },
    /// A write to guest-physical `addr` outside every memslot.
    MmioWrite { addr: u64, data: &'a [u8] },
    /// HLT with no in-kernel irqchip.
    Hlt,
    /// Triple fault (or another shutdown): the guest is dead.
    Shutdown,
    /// `KVM_RUN` returned with no exit: the vCPU was kicked ([`VcpuKicker`]) or another
    /// signal arrived. Not counted in [`Vcpu::exits`].
    Interrupted,
}

/// The signal that kicks a vCPU thread out of `KVM_RUN` (its handler does nothing; the
/// interruption is the point).
fn kick_signal() -> libc::c_int {
    SIGRTMIN()
}

extern "C" fn noop_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

fn install_kick_handler() -> Result<(), KvmError> {
    static INSTALLED: OnceLock<Result<(), i32>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| register_signal_handler(kick_signal(), noop_handler).map_err(|e| e.errno()))
        .map_err(|e| KvmError::Signal(kvm_ioctls::Error::new(e)))
}

/// What a kicker needs to reach the vCPU, under one lock.
#[derive(Debug)]
struct KickInner {
    /// `kvm_run.immediate_exit` of the vCPU; `None` once the vCPU (and its `kvm_run`
    /// mapping) is gone.
    immediate_exit: Option<*const AtomicU8>,
    /// The thread inside [`Vcpu::run`], if any.
    thread: Option<libc::pthread_t>,
}

// SAFETY: the pointer is only dereferenced under the mutex while `immediate_exit` is
// `Some`, i.e. while the `kvm_run` mapping exists (the vCPU's Drop clears it under the same
// mutex before the mapping goes); the byte is accessed atomically.
unsafe impl Send for KickInner {}

#[derive(Debug)]
struct KickState {
    inner: Mutex<KickInner>,
}

impl KickState {
    fn lock(&self) -> MutexGuard<'_, KickInner> {
        // Every field is valid after every statement: a poisoned lock is fine to use.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_immediate_exit(inner: &KickInner, v: u8) {
        if let Some(p) = inner.immediate_exit {
            // SAFETY: `p` points at `kvm_run.immediate_exit`, valid while `Some` (see
            // `KickInner`); a u8 has no alignment requirement and is only accessed
            // atomically by us (the kernel reads it at KVM_RUN entry).
            unsafe { &*p }.store(v, Ordering::SeqCst);
        }
    }
}

/// Makes a vCPU return from [`Vcpu::run`] with [`VmExit::Interrupted`], from any thread:
/// sets `kvm_run.immediate_exit` (so a `KVM_RUN` about to start returns at once) and signals
/// the thread inside `KVM_RUN`, if any.
#[derive(Debug, Clone)]
pub struct VcpuKicker {
    state: Arc<KickState>,
}

impl VcpuKicker {
    /// Kicks the vCPU. Returns false if the vCPU no longer exists.
    pub fn kick(&self) -> bool {
        let inner = self.state.lock();
        if inner.immediate_exit.is_none() {
            return false;
        }
        KickState::set_immediate_exit(&inner, 1);
        if let Some(t) = inner.thread {
            // SAFETY: `t` is the thread currently inside `Vcpu::run` (it clears `thread`
            // under this lock before leaving), so it is alive; the signal has a no-op
            // handler installed by `Vcpu::new`.
            let r = unsafe { libc::pthread_kill(t, kick_signal()) };
            if r != 0 {
                warn!("cannot signal vCPU thread: errno {r}");
            }
        }
        true
    }
}

/// One vCPU of a [`Vm`](super::Vm).
#[derive(Debug)]
pub struct Vcpu {
    fd: VcpuFd,
    kick: Arc<KickState>,
    exits: u64,
    /// Keeps the memslots' backings alive while this vCPU can run.
    _slots: Slots,
}

impl Vcpu {
    pub(super) fn new(mut fd: VcpuFd, slots: Slots) -> Result<Self, KvmError> {
        install_kick_handler()?;
        let p: *mut u8 = &mut fd.get_kvm_run().immediate_exit;
        let kick = Arc::new(KickState {
            inner: Mutex::new(KickInner {
                immediate_exit: Some(p.cast_const().cast::<AtomicU8>()),
                thread: None,
            }),
        });
        Ok(Vcpu {
            fd,
            kick,
            exits: 0,
            _slots: slots,
        })
    }

    /// Wraps a vCPU fd created outside [`Vm`](super::Vm) (the booting VMM's, whose
    /// memslots it keeps itself), so it runs and is kicked like any other.
    pub fn from_fd(fd: VcpuFd) -> Result<Self, KvmError> {
        Self::new(fd, Slots::default())
    }

    /// The raw vCPU fd, for what this layer does not wrap yet.
    pub fn vcpu_fd(&self) -> &VcpuFd {
        &self.fd
    }

    /// A handle that interrupts this vCPU from another thread.
    pub fn kicker(&self) -> VcpuKicker {
        VcpuKicker {
            state: self.kick.clone(),
        }
    }

    /// Userspace exits so far (every `KVM_RUN` that returned an exit; ioeventfd writes,
    /// memslot accesses and kicks do not count).
    pub fn exits(&self) -> u64 {
        self.exits
    }

    /// Puts the vCPU in 16-bit real mode at `cs:ip` (CS base `cs << 4`), with DS, ES, FS,
    /// GS and SS at 0 and SP 0 (the first push lands at 0xfffe), interrupts off.
    pub fn setup_real_mode(&self, cs: u16, ip: u16) -> Result<(), KvmError> {
        let mut sregs = self.fd.get_sregs().map_err(KvmError::Regs)?;
        sregs.cs.selector = cs;
        sregs.cs.base = u64::from(cs) << 4;
        for seg in [
            &mut sregs.ds,
            &mut sregs.es,
            &mut sregs.fs,
            &mut sregs.gs,
            &mut sregs.ss,
        ] {
            seg.selector = 0;
            seg.base = 0;
        }
        sregs.cr0 &= !1; // PE off (it is at reset; make sure)
        self.fd.set_sregs(&sregs).map_err(KvmError::Regs)?;
        let regs = kvm_regs {
            rip: u64::from(ip),
            rflags: 0x2, // bit 1 is reserved-one; IF off
            ..Default::default()
        };
        self.fd.set_regs(&regs).map_err(KvmError::Regs)
    }

    /// The general-purpose registers.
    pub fn regs(&self) -> Result<kvm_regs, KvmError> {
        self.fd.get_regs().map_err(KvmError::Regs)
    }

    /// Completes what the last exit left pending (the data of an `in` or MMIO read goes
    /// into the guest's registers only at the next `KVM_RUN`) without running guest code:
    /// `KVM_RUN` with `immediate_exit` set. After it the vCPU's state is consistent to
    /// save (live migration).
    pub fn settle(&mut self) -> Result<(), KvmError> {
        KickState::set_immediate_exit(&self.kick.lock(), 1);
        let r = self.fd.run();
        KickState::set_immediate_exit(&self.kick.lock(), 0);
        match r {
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => Ok(()),
            Err(e) => Err(KvmError::Run(e)),
            Ok(exit) => Err(KvmError::UnhandledExit(format!(
                "{exit:?} while settling for a save"
            ))),
        }
    }

    /// Runs the vCPU until the next exit userspace must handle.
    pub fn run(&mut self) -> Result<VmExit<'_>, KvmError> {
        match self.run_raw() {
            Ok(exit) => convert(exit),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                Ok(VmExit::Interrupted)
            }
            Err(e) => Err(KvmError::Run(e)),
        }
    }

    /// One `KVM_RUN`, kickable like [`Vcpu::run`], returning the exit as `kvm-ioctls`
    /// reports it: for a device model that handles more exits than [`VmExit`] names
    /// (the booting VMM: system events, memory faults it retries). A kick returns
    /// `EINTR` (once: the kick is re-armed).
    pub fn run_raw(&mut self) -> Result<VcpuExit<'_>, kvm_ioctls::Error> {
        // `thread` names this thread only while it is inside this function.
        {
            // SAFETY: pthread_self has no preconditions.
            let me = unsafe { libc::pthread_self() };
            self.kick.lock().thread = Some(me);
        }
        let r = self.fd.run();
        self.kick.lock().thread = None;
        match &r {
            Ok(exit) if !matches!(exit, VcpuExit::Intr) => self.exits += 1,
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                // Re-arm: a kick is reported once.
                KickState::set_immediate_exit(&self.kick.lock(), 0);
            }
            _ => {}
        }
        r
    }

    /// Runs the vCPU, handing each exit to `handle`, until `handle` breaks (returns the
    /// number of exits taken, the last included) or `max_exits` exits have passed
    /// ([`KvmError::ExitCap`]). A kick ends it with [`KvmError::Interrupted`].
    pub fn run_bounded<F>(&mut self, max_exits: u64, mut handle: F) -> Result<u64, KvmError>
    where
        F: FnMut(VmExit<'_>) -> Result<ControlFlow<()>, KvmError>,
    {
        for n in 1..=max_exits {
            match self.run()? {
                VmExit::Interrupted => return Err(KvmError::Interrupted),
                exit => {
                    if handle(exit)?.is_break() {
                        return Ok(n);
                    }
                }
            }
        }
        Err(KvmError::ExitCap(max_exits))
    }
}

impl Drop for Vcpu {
    fn drop(&mut self) {
        // Before `fd` (and the `kvm_run` mapping) goes: kickers must not touch it any more.
        let mut inner = self.kick.lock();
        inner.immediate_exit = None;
        inner.thread = None;
    }
}

fn convert(exit: VcpuExit<'_>) -> Result<VmExit<'_>, KvmError> {
    Ok(match exit {
        VcpuExit::IoOut(port, data) => VmExit::IoOut { port, data },
        VcpuExit::IoIn(port, data) => VmExit::IoIn { port, data },
        VcpuExit::MmioRead(addr, data) => VmExit::MmioRead { addr, data },
        VcpuExit::MmioWrite(addr, data) => VmExit::MmioWrite { addr, data },
        VcpuExit::Hlt => VmExit::Hlt,
        VcpuExit::Shutdown => VmExit::Shutdown,
        VcpuExit::Intr => VmExit::Interrupted,
        VcpuExit::FailEntry(reason, cpu) => return Err(KvmError::FailEntry { reason, cpu }),
        VcpuExit::MemoryFault { flags, gpa, size } => {
            return Err(KvmError::MemoryFault { gpa, size, flags })
        }
        other => return Err(KvmError::UnhandledExit(format!("{other:?}"))),
    })
}
