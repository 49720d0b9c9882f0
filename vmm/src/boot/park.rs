//! Stopping the vCPU threads for a save (live migration) and letting them go on or leave.
//!
//! The migration thread asks ([`VcpuPark::pause`]); each vCPU thread notices at the top of
//! its run loop (a kick gets it out of `KVM_RUN`), completes what its last exit left
//! pending ([`Vcpu::settle`]), saves its own state and waits. Then the migration either
//! fails and [`VcpuPark::resume`]s them, or succeeds and lets them
//! [`leave`](VcpuPark::leave) (the VM runs elsewhere now).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use log::{info, warn};

use crate::kvm::{Vcpu, VcpuKicker, Vm};
use crate::migration::cpu::{readable_msrs, xsave_fits, VcpuState};
use crate::migration::MigrationError;

/// What a parked vCPU does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parked {
    /// Runs on (the migration failed or was a dry run).
    Resume,
    /// Ends its thread: the VM moved away.
    Leave,
}

#[derive(Debug, Default)]
struct State {
    kickers: Vec<VcpuKicker>,
    /// Each parked vCPU's saved state (or why it could not save).
    saved: BTreeMap<u8, Result<VcpuState, String>>,
    leave: bool,
}

/// See the module documentation.
#[derive(Debug)]
pub struct VcpuPark {
    /// For KVM's MSR list and capabilities (no `/dev/kvm` open under the sandbox).
    vm: Arc<Vm>,
    requested: AtomicBool,
    state: Mutex<State>,
    cv: Condvar,
}

impl VcpuPark {
    pub fn new(vm: Arc<Vm>) -> Self {
        VcpuPark {
            vm,
            requested: AtomicBool::new(false),
            state: Mutex::default(),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every field is valid after every statement: a poisoned lock is fine to use.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The running vCPUs' kickers (when their threads start).
    pub fn set_vcpus(&self, kickers: Vec<VcpuKicker>) {
        self.lock().kickers = kickers;
    }

    /// The vCPU side's cheap check, at the top of every loop.
    pub fn requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    /// Stops every vCPU and returns their states, by vCPU number; waits at most
    /// `timeout`. On failure the vCPUs that did park are resumed.
    pub fn pause(&self, timeout: Duration) -> Result<Vec<VcpuState>, MigrationError> {
        let t0 = Instant::now();
        self.requested.store(true, Ordering::SeqCst);
        let mut st = self.lock();
        let n = st.kickers.len();
        if n == 0 {
            drop(st);
            self.resume();
            return Err(MigrationError::NotRunning);
        }
        while st.saved.len() < n {
            // A kick may land just before KVM_RUN; `immediate_exit` makes it stick, and
            // repeating it covers a vCPU that was between checks.
            for k in &st.kickers {
                k.kick();
            }
            if t0.elapsed() > timeout {
                drop(st);
                self.resume();
                return Err(MigrationError::PauseTimeout(timeout));
            }
            st = self
                .cv
                .wait_timeout(st, Duration::from_millis(5))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        let mut states = Vec::with_capacity(n);
        for (cpu, r) in std::mem::take(&mut st.saved) {
            match r {
                Ok(s) => states.push(s),
                Err(why) => {
                    drop(st);
                    self.resume();
                    return Err(MigrationError::VcpuSave { cpu, why });
                }
            }
        }
        info!(
            "{n} vCPU(s) paused and saved in {:.1} ms",
            t0.elapsed().as_secs_f64() * 1e3
        );
        Ok(states)
    }

    /// Lets parked vCPUs run on.
    pub fn resume(&self) {
        let mut st = self.lock();
        self.requested.store(false, Ordering::SeqCst);
        st.saved.clear();
        self.cv.notify_all();
    }

    /// Ends the parked vCPUs' threads (the VM runs elsewhere).
    pub fn leave(&self) {
        let mut st = self.lock();
        st.leave = true;
        self.cv.notify_all();
    }

    /// The vCPU side: saves `vcpu` and waits for the verdict.
    pub fn park(&self, cpu: u8, vcpu: &mut Vcpu) -> Parked {
        let saved = save(self.vm.kvm(), vcpu);
        if let Err(e) = &saved {
            warn!("vCPU {cpu}: saving for migration: {e}");
        }
        let mut st = self.lock();
        st.saved.insert(cpu, saved.map_err(|e| e.to_string()));
        self.cv.notify_all();
        loop {
            if st.leave {
                return Parked::Leave;
            }
            if !self.requested() {
                return Parked::Resume;
            }
            st = self
                .cv
                .wait_timeout(st, Duration::from_millis(50))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }
}

fn save(kvm: &kvm_ioctls::Kvm, vcpu: &mut Vcpu) -> Result<VcpuState, MigrationError> {
    vcpu.settle().map_err(MigrationError::KvmLayer)?;
    if !xsave_fits(kvm) {
        return Err(MigrationError::XsaveTooLarge);
    }
    let msrs = readable_msrs(kvm, vcpu.vcpu_fd())?;
    VcpuState::save(vcpu.vcpu_fd(), &msrs)
}
