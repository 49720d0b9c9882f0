//! The destination side of a live migration ([`super::LinuxVm::receive`]): builds the
//! machine the source describes, takes its RAM rounds, continues the vgpu device at the
//! source's ring positions in its own backend and loads the device's state there, then
//! restores the chips, vCPUs and devices at the commit. See `send.rs` for the order.
//!
//! The destination's backend gets the rings only at the commit, once the last RAM round
//! is in: before that it has the features and memory table (enough to load the device's
//! state) but no ring to serve, so it cannot write a used entry into guest RAM that a
//! later RAM round overwrites, whatever kicks or events come meanwhile. (It once had them
//! at the rings record, and a request it answered then, before its state was even
//! loaded, was lost: the last round put back the source's used ring.)

use std::io::Write;
use std::time::{Duration, Instant};

use log::{info, warn};
use vgpu_protocol::device::{CONTROL_QUEUE, EVENT_QUEUE};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::serial::SerialOut;
use super::{lock, with_vgpu, BootError, LinuxVm, VmConfig};
use crate::migration::records::{Hello, MachineRecord, RingsRecord};
use crate::migration::wire::{self, Conn, Listener, Msg};
use crate::migration::MigrationError;
use crate::virtio_pci::state::TransportState;

/// What a received migration brought.
#[derive(Debug, Clone, Default)]
pub struct ReceiveReport {
    pub ram_bytes: u64,
    pub rounds: u32,
    pub device_bytes: u64,
    /// From the source's first message to the commit.
    pub total: Duration,
}

impl LinuxVm {
    /// Waits on `listener` for a source, builds the VM it describes (`cfg` gives the
    /// serial output and the vgpu backend; vCPUs and RAM come from the source) and takes
    /// it over. The returned VM is ready to [`run`](Self::run).
    pub fn receive(
        cfg: &VmConfig,
        listener: &Listener,
    ) -> Result<(Self, ReceiveReport), BootError> {
        let mut conn = listener.accept().map_err(BootError::Migration)?;
        info!("migration: a source connected");
        let t0 = Instant::now();
        let mut built: Option<LinuxVm> = None;
        let r = receive_into(cfg, &mut conn, &mut built);
        match (r, built) {
            (Ok(mut rep), Some(vm)) => {
                rep.total = t0.elapsed();
                info!("migration received: {rep:?}");
                Ok((vm, rep))
            }
            (Err(e), _) => {
                // Best effort: the source may be gone already.
                let _ = wire::send(&mut conn, &Msg::Fail(e.to_string()));
                Err(BootError::Migration(e))
            }
            (Ok(_), None) => Err(BootError::Migration(MigrationError::OutOfOrder(
                "the end", "a hello",
            ))),
        }
    }
}

fn receive_into(
    cfg: &VmConfig,
    conn: &mut Box<dyn Conn>,
    built: &mut Option<LinuxVm>,
) -> Result<ReceiveReport, MigrationError> {
    let mut rep = ReceiveReport::default();
    wire::read_preamble(conn)?;
    let hello = match wire::recv(conn)? {
        Msg::Hello(b) => Hello::decode(&b)?,
        _ => return Err(MigrationError::OutOfOrder("a message", "the hello")),
    };
    if hello.vgpu != cfg.vgpu_socket.is_some() {
        return Err(MigrationError::Mismatch(format!(
            "the source {} a vgpu device, this VMM {}",
            if hello.vgpu { "has" } else { "has no" },
            if cfg.vgpu_socket.is_some() {
                "has"
            } else {
                "has none"
            }
        )));
    }
    let mut cfg = cfg.clone();
    cfg.vcpus = hello.vcpus;
    cfg.mem_mib = hello.mem_mib;
    let out = SerialOut::open(cfg.serial.as_deref())
        .map_err(|e| MigrationError::Device(e.to_string()))?;
    let vm = LinuxVm::build(&cfg, out, false).map_err(|e| MigrationError::Device(e.to_string()))?;
    info!(
        "migration: built a VM of {} MiB and {} vCPU(s)",
        hello.mem_mib, hello.vcpus
    );
    let vm = built.insert(vm);
    let mut loading: Option<std::fs::File> = None;
    let mut load_broken = false;
    loop {
        match wire::recv(conn)? {
            Msg::Ram { gpa, data } => {
                vm.mem
                    .write_slice(&data, GuestAddress(gpa))
                    .map_err(|_| MigrationError::Invalid("RAM", "range outside guest RAM"))?;
                rep.ram_bytes += data.len() as u64;
            }
            Msg::Zero { gpa, len } => {
                // RAM is zero before the first round ends; later a page may have become
                // zero on the source.
                if rep.rounds > 0 {
                    zero(vm, gpa, len)?;
                } else if !vm.mem.check_range(
                    GuestAddress(gpa),
                    usize::try_from(len).unwrap_or(usize::MAX),
                ) {
                    return Err(MigrationError::Invalid("RAM", "range outside guest RAM"));
                }
            }
            Msg::RoundEnd { .. } => rep.rounds += 1,
            Msg::Rings(b) => {
                let r = RingsRecord::decode(&b).and_then(|r| continue_rings(vm, &r));
                reply(conn, &r)?;
                r?;
            }
            Msg::DeviceFrame(f) => {
                rep.device_bytes += f.len() as u64;
                if loading.is_none() && !load_broken {
                    loading = Some(
                        vgpu(vm, |d| d.backend_mut().connection().begin_load())?
                            .map_err(MigrationError::Frontend)?,
                    );
                }
                if let Some(w) = loading.as_mut() {
                    if let Err(e) = w.write_all(&f) {
                        // The backend stopped reading: it refused the stream, and says
                        // why at CHECK_DEVICE_STATE. Keep reading the source's frames.
                        warn!("migration: device-state write: {e}");
                        load_broken = true;
                        loading = None;
                    }
                }
            }
            Msg::DeviceEnd => {
                drop(loading.take());
                let r = vgpu(vm, |d| d.backend_mut().connection().check_state())
                    .and_then(|r| r.map_err(MigrationError::Frontend));
                reply(conn, &r)?;
                r?;
            }
            Msg::Tail(b) => {
                let r = vgpu(vm, |d| d.backend_mut().connection().load_state(&b))
                    .and_then(|r| r.map_err(MigrationError::Frontend));
                reply(conn, &r)?;
                r?;
            }
            Msg::Machine(b) => {
                let m = MachineRecord::decode(&b)?;
                match wire::recv(conn)? {
                    Msg::Commit => {}
                    _ => return Err(MigrationError::OutOfOrder("a message", "the commit")),
                }
                let r = restore_machine(vm, &m).and_then(|()| start_rings(vm));
                reply(conn, &r)?;
                r?;
                resume_device(vm);
                return Ok(rep);
            }
            Msg::Hello(_) => return Err(MigrationError::OutOfOrder("a second hello", "state")),
            Msg::Commit => return Err(MigrationError::OutOfOrder("the commit", "the machine")),
            Msg::Ack | Msg::Fail(_) => {
                return Err(MigrationError::OutOfOrder("a verdict", "state"))
            }
        }
    }
}

/// Answers the source's wait for a verdict.
fn reply(conn: &mut Box<dyn Conn>, r: &Result<(), MigrationError>) -> Result<(), MigrationError> {
    match r {
        Ok(()) => wire::send(conn, &Msg::Ack),
        Err(e) => wire::send(conn, &Msg::Fail(e.to_string())),
    }
}

fn zero(vm: &LinuxVm, gpa: u64, len: u64) -> Result<(), MigrationError> {
    let zeros = vec![0u8; wire::RAM_CHUNK];
    let mut at = gpa;
    let end = gpa
        .checked_add(len)
        .ok_or(MigrationError::Invalid("RAM", "range wraps"))?;
    while at < end {
        let n = (end - at).min(zeros.len() as u64) as usize;
        vm.mem
            .write_slice(&zeros[..n], GuestAddress(at))
            .map_err(|_| MigrationError::Invalid("RAM", "range outside guest RAM"))?;
        at += n as u64;
    }
    Ok(())
}

/// Runs `f` on the vgpu function of `vm`.
fn vgpu<R>(
    vm: &LinuxVm,
    f: impl FnOnce(&mut crate::virtio_pci::VirtioPciDevice<crate::vgpu_device::VhostUserVgpu>) -> R,
) -> Result<R, MigrationError> {
    let (Some(bus), Some(slot)) = (&vm.pci, vm.vgpu_slot) else {
        return Err(MigrationError::Mismatch(
            "this VMM has no vgpu device".into(),
        ));
    };
    with_vgpu(bus, slot, f).ok_or_else(|| MigrationError::Mismatch("no vgpu function".into()))
}

/// Takes over the transport the guest programmed on the source, and moves the BAR
/// backing and interrupt routes to where it says.
fn restore_transport(vm: &LinuxVm, t: &TransportState) -> Result<(), MigrationError> {
    vgpu(vm, |d| d.restore_transport(t))?.map_err(|e| MigrationError::Device(e.to_string()))?;
    if let (Some(bus), Some(slot), Some(hooks)) = (&vm.pci, vm.vgpu_slot, &vm.hooks) {
        let mut bus = lock(bus);
        bus.refresh_slot(slot);
        hooks.after_guest_write(&mut bus);
    }
    Ok(())
}

/// Prepares the device to continue at the source's ring positions; the rings start at
/// the commit ([`start_rings`]).
fn continue_rings(vm: &LinuxVm, r: &RingsRecord) -> Result<(), MigrationError> {
    restore_transport(vm, &r.transport)?;
    let t = &r.transport;
    vgpu(vm, |d| {
        d.backend_mut()
            .prepare_at(t.driver_features, &t.queues, &r.bases)
    })?
    .map_err(|e| MigrationError::Device(e.to_string()))
}

/// Hands the backend the rings (guest RAM is final now); a VM without a running vgpu
/// device has nothing prepared.
fn start_rings(vm: &LinuxVm) -> Result<(), MigrationError> {
    if vm.vgpu_slot.is_none() {
        return Ok(());
    }
    vgpu(vm, |d| {
        let b = d.backend_mut();
        if b.has_prepared() {
            b.start_prepared()
        } else {
            Ok(())
        }
    })?
    .map_err(|e| MigrationError::Device(e.to_string()))
}

fn restore_machine(vm: &LinuxVm, m: &MachineRecord) -> Result<(), MigrationError> {
    if m.vcpus.len() != vm.vcpus.len() {
        return Err(MigrationError::Mismatch(format!(
            "{} saved vCPUs for {} here",
            m.vcpus.len(),
            vm.vcpus.len()
        )));
    }
    m.chips.restore(vm.vm.vm_fd())?;
    for (v, st) in vm.vcpus.iter().zip(&m.vcpus) {
        st.restore(v.vcpu_fd())?;
    }
    if let Some(t) = &m.transport {
        restore_transport(vm, t)?;
    }
    vm.devices
        .restore_serial(&m.serial)
        .map_err(|e| MigrationError::Device(e.to_string()))?;
    Ok(())
}

/// The device runs here now: a kick makes the backend look at the control queue (it
/// unpauses the VM's channels and serves what the guest queued meanwhile) and at the
/// event queue (events restored with the state), and a call on each queue makes the
/// driver look at its used rings (harmless if nothing is new).
fn resume_device(vm: &LinuxVm) {
    let r = vgpu(vm, |d| {
        let b = d.backend_mut();
        for q in [CONTROL_QUEUE, EVENT_QUEUE] {
            if let Some(k) = b.kick(q as usize) {
                if let Err(e) = k.write(1) {
                    warn!("migration: kicking queue {q}: {e}");
                }
            }
        }
        for c in b.calls() {
            let _ = c.write(1);
        }
    });
    if let Err(e) = r {
        if vm.vgpu_slot.is_some() {
            warn!("migration: resuming the vgpu device: {e}");
        }
    }
}
