//! One vCPU's architectural state as KVM keeps it: what a destination needs to continue
//! the vCPU exactly where the source stopped it.
//!
//! Restore order follows KVM's dependencies (as Firecracker and QEMU do): MP state, then
//! registers and system registers, XSAVE (FPU/SSE/AVX), XCRs, debug registers, the LAPIC,
//! MSRs (the TSC among them) and last the pending events (an injected interrupt or
//! exception refers to the state set before it).

use kvm_bindings::{
    kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs, kvm_sregs,
    kvm_vcpu_events, kvm_xcrs, kvm_xsave, Msrs,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd};

use super::codec::{Dec, Enc};
use super::MigrationError;

/// A vCPU's state.
pub struct VcpuState {
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub debugregs: kvm_debugregs,
    pub lapic: kvm_lapic_state,
    pub mp_state: kvm_mp_state,
    pub events: kvm_vcpu_events,
    /// `(index, value)` of every MSR KVM lets us read.
    pub msrs: Vec<(u32, u64)>,
}

impl std::fmt::Debug for VcpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VcpuState")
            .field("rip", &self.regs.rip)
            .field("mp_state", &self.mp_state.mp_state)
            .field("msrs", &self.msrs.len())
            .finish()
    }
}

fn kvm_err(what: &'static str) -> impl Fn(kvm_ioctls::Error) -> MigrationError {
    move |e| MigrationError::Kvm(what, e)
}

/// The MSRs to save: every index KVM reports, less those it refuses to read on this host
/// (found by reading them all: KVM_GET_MSRS stops at the first it refuses).
pub fn readable_msrs(kvm: &Kvm, fd: &VcpuFd) -> Result<Vec<u32>, MigrationError> {
    let all = kvm
        .get_msr_index_list()
        .map_err(kvm_err("KVM_GET_MSR_INDEX_LIST"))?;
    let mut left: Vec<u32> = all.as_slice().to_vec();
    let mut ok = Vec::with_capacity(left.len());
    while !left.is_empty() {
        let mut msrs = msrs_of(left.iter().map(|&i| (i, 0)))?;
        let n = fd.get_msrs(&mut msrs).map_err(kvm_err("KVM_GET_MSRS"))?;
        ok.extend_from_slice(&left[..n]);
        // Skip the one refused and go on after it.
        left.drain(..(n + 1).min(left.len()));
    }
    Ok(ok)
}

/// KVM's MSR list for `(index, value)` pairs.
fn msrs_of(pairs: impl Iterator<Item = (u32, u64)>) -> Result<Msrs, MigrationError> {
    let entries: Vec<kvm_msr_entry> = pairs
        .map(|(index, data)| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect();
    Msrs::from_entries(&entries)
        .map_err(|_| MigrationError::Invalid("MSR list", "too many entries"))
}

/// Whether KVM's XSAVE area fits `kvm_xsave` (no AMX-sized state): the only size we move.
pub fn xsave_fits(kvm: &Kvm) -> bool {
    let size = kvm.check_extension_int(Cap::Xsave2);
    size <= 0 || size as usize <= std::mem::size_of::<kvm_xsave>()
}

impl VcpuState {
    /// Reads the stopped vCPU's state (`msr_list` from [`readable_msrs`]).
    pub fn save(fd: &VcpuFd, msr_list: &[u32]) -> Result<Self, MigrationError> {
        // First: KVM_GET_MP_STATE and KVM_GET_VCPU_EVENTS flush what KVM still holds
        // (a pending INIT/SIPI, an interrupt being injected).
        let mp_state = fd.get_mp_state().map_err(kvm_err("KVM_GET_MP_STATE"))?;
        let events = fd
            .get_vcpu_events()
            .map_err(kvm_err("KVM_GET_VCPU_EVENTS"))?;
        let regs = fd.get_regs().map_err(kvm_err("KVM_GET_REGS"))?;
        let sregs = fd.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?;
        let xsave = fd.get_xsave().map_err(kvm_err("KVM_GET_XSAVE"))?;
        let xcrs = fd.get_xcrs().map_err(kvm_err("KVM_GET_XCRS"))?;
        let debugregs = fd.get_debug_regs().map_err(kvm_err("KVM_GET_DEBUGREGS"))?;
        let lapic = fd.get_lapic().map_err(kvm_err("KVM_GET_LAPIC"))?;
        let mut m = msrs_of(msr_list.iter().map(|&i| (i, 0)))?;
        let n = fd.get_msrs(&mut m).map_err(kvm_err("KVM_GET_MSRS"))?;
        if n != msr_list.len() {
            return Err(MigrationError::Msrs {
                got: n,
                want: msr_list.len(),
            });
        }
        let msrs = m.as_slice().iter().map(|e| (e.index, e.data)).collect();
        Ok(VcpuState {
            regs,
            sregs,
            xsave,
            xcrs,
            debugregs,
            lapic,
            mp_state,
            events,
            msrs,
        })
    }

    /// Puts the state into a created vCPU whose CPUID is already set.
    pub fn restore(&self, fd: &VcpuFd) -> Result<(), MigrationError> {
        fd.set_mp_state(self.mp_state)
            .map_err(kvm_err("KVM_SET_MP_STATE"))?;
        fd.set_regs(&self.regs).map_err(kvm_err("KVM_SET_REGS"))?;
        fd.set_sregs(&self.sregs)
            .map_err(kvm_err("KVM_SET_SREGS"))?;
        // SAFETY: `self.xsave` is a whole `kvm_xsave`; the sender only saves when KVM's
        // XSAVE area fits it (`xsave_fits`), and so does the receiver before restoring,
        // so KVM reads no more than the structure holds.
        unsafe { fd.set_xsave(&self.xsave) }.map_err(kvm_err("KVM_SET_XSAVE"))?;
        fd.set_xcrs(&self.xcrs).map_err(kvm_err("KVM_SET_XCRS"))?;
        fd.set_debug_regs(&self.debugregs)
            .map_err(kvm_err("KVM_SET_DEBUGREGS"))?;
        fd.set_lapic(&self.lapic)
            .map_err(kvm_err("KVM_SET_LAPIC"))?;
        let m = msrs_of(self.msrs.iter().copied())?;
        let n = fd.set_msrs(&m).map_err(kvm_err("KVM_SET_MSRS"))?;
        if n != self.msrs.len() {
            return Err(MigrationError::MsrRefused(
                self.msrs.get(n).map_or(0, |e| e.0),
            ));
        }
        fd.set_vcpu_events(&self.events)
            .map_err(kvm_err("KVM_SET_VCPU_EVENTS"))?;
        Ok(())
    }

    pub fn encode(&self, e: &mut Enc) {
        e.pod(&self.regs)
            .pod(&self.sregs)
            .pod(&self.xsave)
            .pod(&self.xcrs)
            .pod(&self.debugregs)
            .pod(&self.lapic)
            .pod(&self.mp_state)
            .pod(&self.events);
        e.u32(self.msrs.len() as u32);
        for &(i, v) in &self.msrs {
            e.u32(i).u64(v);
        }
    }

    pub fn decode(d: &mut Dec<'_>) -> Result<Self, MigrationError> {
        let regs = d.pod()?;
        let sregs = d.pod()?;
        let xsave = d.pod()?;
        let xcrs = d.pod()?;
        let debugregs = d.pod()?;
        let lapic = d.pod()?;
        let mp_state = d.pod()?;
        let events = d.pod()?;
        let n = d.count(12)?;
        let mut msrs = Vec::with_capacity(n);
        for _ in 0..n {
            msrs.push((d.u32()?, d.u64()?));
        }
        Ok(VcpuState {
            regs,
            sregs,
            xsave,
            xcrs,
            debugregs,
            lapic,
            mp_state,
            events,
            msrs,
        })
    }
}
