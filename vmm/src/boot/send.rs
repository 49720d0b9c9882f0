//! The source side of a live migration ([`MigrationSource::send`]).
//!
//! Order, and why:
//! 1. **Stop the vgpu rings** (GET_VRING_BASE). From here the backend writes nothing into
//!    guest RAM through the rings; the guest's new control requests wait in the ring.
//! 2. **RAM pre-copy** with KVM's dirty log: all of RAM once, then what the vCPUs wrote,
//!    round after round, while the guest runs.
//! 3. **The vgpu device's state**, relayed frame by frame from the source's backend to the
//!    destination's, while the guest runs: the backend's VRAM pre-copy rounds, then it
//!    pauses the VM's channels (the guest now stores into shadow pages) and sends the rest.
//! 4. **Pause the vCPUs**; each saves its own state.
//! 5. **The last RAM round**: what the vCPUs wrote since the previous round, plus every
//!    guest page the GPU could write (the GPU mappings of guest RAM listed in the device
//!    state: KVM's dirty log does not see the GPU's writes).
//! 6. **The tail**: the GP_PUTs the guest stored since the backend paused.
//! 7. **Chips, vCPUs, transport, serial port**, then the commit; once the destination
//!    acknowledges it, the vCPU threads here leave.
//!
//! A failure anywhere before the destination's last acknowledgement resumes the VM here:
//! the vCPUs run on, the rings restart where they stopped and a kick of the control
//! queue lets the backend unpause the channels.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use log::{info, warn};
use vgpu_protocol::device::CONTROL_QUEUE;
use vgpu_protocol::migration::{stream_kind, DeviceState, MappingTargetRecord, KIND_FULL};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::park::VcpuPark;
use super::serial::LegacyDevices;
use super::with_vgpu;
use crate::frontend::read_state_frame;
use crate::guest_memory::{GuestRam, PAGE_SIZE};
use crate::kvm::{SlotId, Vm};
use crate::migration::machine::ChipState;
use crate::migration::records::{Hello, MachineRecord, RingsRecord};
use crate::migration::wire::{self, Address, Conn, Msg, RAM_CHUNK};
use crate::migration::MigrationError;
use crate::pci::PciBus;

/// Pre-copy rounds stop when a round left less than this to send...
const DIRTY_TARGET: u64 = 8 << 20;
/// ...or after this many rounds.
const MAX_ROUNDS: u32 = 8;
/// How long the vCPUs may take to stop.
const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// What a migration moved and how long the guest stood still.
#[derive(Debug, Clone, Default)]
pub struct SendReport {
    /// Bytes of RAM sent per pre-copy round (round 0 is all of RAM), then the last one.
    pub ram_rounds: Vec<u64>,
    /// Bytes of the vgpu device's state stream and of its tail.
    pub device_bytes: u64,
    pub tail_bytes: u64,
    /// Guest pages resent in the last round because the GPU may have written them.
    pub gpu_pages: u64,
    /// From the vCPUs' pause to the destination's acknowledgement of the commit.
    pub downtime: Duration,
    pub total: Duration,
}

/// A handle on a running [`super::LinuxVm`] that can send it away (see the module docs).
#[derive(Clone)]
pub struct MigrationSource {
    pub(super) vm: Arc<Vm>,
    pub(super) ram: Arc<GuestRam>,
    pub(super) mem: GuestMemoryMmap,
    pub(super) hello: Hello,
    pub(super) devices: Arc<LegacyDevices>,
    pub(super) pci: Option<Arc<Mutex<PciBus>>>,
    pub(super) vgpu_slot: Option<u8>,
    pub(super) park: Arc<VcpuPark>,
    pub(super) busy: Arc<AtomicBool>,
}

/// What step 1 stopped, to restart on failure.
struct Stopped {
    bases: Vec<u16>,
    rings: RingsRecord,
}

impl MigrationSource {
    /// Sends the VM to the `vgpu-vmm --incoming` at `addr`; `progress` gets a line per
    /// step. On success the VM's vCPU threads here have been told to leave.
    pub fn send(
        &self,
        addr: &Address,
        progress: &mut dyn FnMut(String),
    ) -> Result<SendReport, MigrationError> {
        if self.busy.swap(true, Ordering::SeqCst) {
            return Err(MigrationError::Busy);
        }
        let r = self.send_unguarded(addr, progress);
        self.busy.store(false, Ordering::SeqCst);
        r
    }

    fn send_unguarded(
        &self,
        addr: &Address,
        progress: &mut dyn FnMut(String),
    ) -> Result<SendReport, MigrationError> {
        let t0 = Instant::now();
        let mut conn = wire::connect(addr)?;
        wire::write_preamble(&mut conn).map_err(|e| MigrationError::Io("sending", e))?;
        wire::send(&mut conn, &Msg::Hello(self.hello.encode()))?;
        let stopped = self.stop_rings()?;
        let slots = self.ram_slots()?;
        let mut paused = false;
        let r = self.run_steps(&mut conn, &slots, stopped.as_ref(), &mut paused, progress);
        for &s in &slots {
            if let Err(e) = self.vm.set_dirty_logging(s, false) {
                warn!("migration: turning dirty logging off: {e}");
            }
        }
        match r {
            Ok(mut rep) => {
                self.park.leave();
                rep.total = t0.elapsed();
                info!("migration to {addr} done: {rep:?}");
                Ok(rep)
            }
            Err(e) => {
                warn!("migration to {addr} failed ({e}); the VM runs on here");
                if let Some(st) = &stopped {
                    self.restart_rings(st);
                }
                if paused {
                    self.park.resume();
                }
                Err(e)
            }
        }
    }

    fn run_steps(
        &self,
        conn: &mut Box<dyn Conn>,
        slots: &[SlotId],
        stopped: Option<&Stopped>,
        paused: &mut bool,
        progress: &mut dyn FnMut(String),
    ) -> Result<SendReport, MigrationError> {
        let mut rep = SendReport::default();
        // 2. RAM pre-copy.
        for &s in slots {
            self.vm
                .set_dirty_logging(s, true)
                .map_err(MigrationError::KvmLayer)?;
        }
        let mut round = 0u32;
        loop {
            let t = Instant::now();
            let bytes = if round == 0 {
                self.send_all_ram(conn)?
            } else {
                self.send_dirty(conn, slots)?
            };
            wire::send(conn, &Msg::RoundEnd { round })?;
            rep.ram_rounds.push(bytes);
            progress(format!(
                "ram round {round}: {bytes} bytes in {:.0} ms",
                t.elapsed().as_secs_f64() * 1e3
            ));
            round += 1;
            if (round > 1 && bytes < DIRTY_TARGET) || round >= MAX_ROUNDS {
                break;
            }
        }
        // 3. The vgpu device's state.
        let mut gpu_ranges = Vec::new();
        if let Some(st) = stopped {
            wire::send(conn, &Msg::Rings(st.rings.encode()))?;
            wire::verdict(conn, "rings")?;
            let (bytes, ranges) = self.relay_device_state(conn)?;
            rep.device_bytes = bytes;
            gpu_ranges = ranges;
            progress(format!("device state: {bytes} bytes"));
        }
        // 4. Pause.
        let paused_at = Instant::now();
        let vcpus = self.park.pause(PAUSE_TIMEOUT)?;
        *paused = true;
        // 5. The last RAM round.
        let mut bytes = self.send_dirty(conn, slots)?;
        for &(gpa, len) in &gpu_ranges {
            bytes += self.send_range(conn, gpa, len)?;
            rep.gpu_pages += len.div_ceil(PAGE_SIZE);
        }
        wire::send(conn, &Msg::RoundEnd { round })?;
        rep.ram_rounds.push(bytes);
        // 6. The tail.
        if stopped.is_some() {
            let tail = self
                .with_device(|d| d.backend_mut().connection().save_state())?
                .map_err(MigrationError::Frontend)?;
            rep.tail_bytes = tail.len() as u64;
            wire::send(conn, &Msg::Tail(tail))?;
            wire::verdict(conn, "tail")?;
        }
        // 7. Everything else, and the commit.
        let machine = MachineRecord {
            chips: ChipState::save(self.vm.vm_fd())?,
            vcpus,
            transport: self.with_device(|d| d.transport_state()).ok(),
            serial: self.devices.serial_state(),
        };
        wire::send(conn, &Msg::Machine(machine.encode()))?;
        wire::send(conn, &Msg::Commit)?;
        wire::verdict(conn, "commit")?;
        rep.downtime = paused_at.elapsed();
        progress(format!(
            "paused {:.1} ms; last round {bytes} bytes ({} GPU-mapped pages)",
            rep.downtime.as_secs_f64() * 1e3,
            rep.gpu_pages
        ));
        Ok(rep)
    }

    /// Runs `f` on the vgpu function.
    fn with_device<R>(
        &self,
        f: impl FnOnce(&mut crate::virtio_pci::VirtioPciDevice<crate::vgpu_device::VhostUserVgpu>) -> R,
    ) -> Result<R, MigrationError> {
        let (Some(bus), Some(slot)) = (&self.pci, self.vgpu_slot) else {
            return Err(MigrationError::Device("no vgpu device".into()));
        };
        with_vgpu(bus, slot, f).ok_or_else(|| MigrationError::Device("no vgpu device".into()))
    }

    /// Step 1, where the guest's driver has the device running.
    fn stop_rings(&self) -> Result<Option<Stopped>, MigrationError> {
        if self.vgpu_slot.is_none() {
            return Ok(None);
        }
        self.with_device(|d| {
            if !d.is_active() {
                // Nothing to continue: the destination starts it when the driver does.
                return Ok(None);
            }
            let bases = d.backend_mut().stop_rings()?;
            Ok(Some(Stopped {
                rings: RingsRecord {
                    bases: bases.clone(),
                    transport: d.transport_state(),
                },
                bases,
            }))
        })?
    }

    fn restart_rings(&self, st: &Stopped) {
        let r = self.with_device(|d| {
            let queues = d.queues().to_vec();
            let b = d.backend_mut();
            let r = b.restart_rings(&queues, &st.bases);
            // The kick that tells the backend to unpause the VM's channels.
            if let Some(k) = b.kick(CONTROL_QUEUE as usize) {
                let _ = k.write(1);
            }
            r
        });
        match r {
            Ok(Ok(())) => info!("migration: vgpu rings restarted on the source"),
            Ok(Err(e)) => warn!("migration: restarting the vgpu rings: {e}"),
            Err(e) => warn!("migration: restarting the vgpu rings: {e}"),
        }
    }

    /// The memslots of guest RAM (not the BAR window).
    fn ram_slots(&self) -> Result<Vec<SlotId>, MigrationError> {
        let slots = self.vm.memslots();
        self.ram
            .regions()
            .iter()
            .map(|r| {
                slots
                    .iter()
                    .find(|s| s.gpa == r.gpa() && s.len == r.len())
                    .map(|s| s.slot)
                    .ok_or(MigrationError::Device("a RAM region has no memslot".into()))
            })
            .collect()
    }

    /// Sends `[gpa, gpa+len)`, chunk by chunk; all-zero chunks as [`Msg::Zero`].
    fn send_range(
        &self,
        conn: &mut Box<dyn Conn>,
        gpa: u64,
        len: u64,
    ) -> Result<u64, MigrationError> {
        let mut sent = 0;
        let mut buf = vec![0u8; RAM_CHUNK];
        let mut at = gpa;
        let end = gpa.saturating_add(len);
        while at < end {
            let n = (end - at).min(RAM_CHUNK as u64) as usize;
            let chunk = &mut buf[..n];
            self.mem
                .read_slice(chunk, GuestAddress(at))
                .map_err(|_| MigrationError::Device(format!("RAM read at {at:#x}")))?;
            if chunk.iter().all(|&b| b == 0) {
                wire::send(
                    conn,
                    &Msg::Zero {
                        gpa: at,
                        len: n as u64,
                    },
                )?;
            } else {
                wire::send(
                    conn,
                    &Msg::Ram {
                        gpa: at,
                        data: chunk.to_vec(),
                    },
                )?;
                sent += n as u64;
            }
            at += n as u64;
        }
        Ok(sent)
    }

    fn send_all_ram(&self, conn: &mut Box<dyn Conn>) -> Result<u64, MigrationError> {
        let mut sent = 0;
        for r in self.ram.regions() {
            sent += self.send_range(conn, r.gpa(), r.len())?;
        }
        Ok(sent)
    }

    /// Sends the pages the vCPUs wrote since the last look, as runs of pages.
    fn send_dirty(
        &self,
        conn: &mut Box<dyn Conn>,
        slots: &[SlotId],
    ) -> Result<u64, MigrationError> {
        let mut sent = 0;
        for (r, &slot) in self.ram.regions().iter().zip(slots) {
            let bitmap = self.vm.take_dirty(slot).map_err(MigrationError::KvmLayer)?;
            let mut run: Option<(u64, u64)> = None;
            let pages = r.len() / PAGE_SIZE;
            for page in 0..pages {
                let dirty = bitmap
                    .get((page / 64) as usize)
                    .is_some_and(|w| w & (1 << (page % 64)) != 0);
                match (dirty, run) {
                    (true, Some((start, n))) => run = Some((start, n + 1)),
                    (true, None) => run = Some((page, 1)),
                    (false, Some((start, n))) => {
                        sent +=
                            self.send_range(conn, r.gpa() + start * PAGE_SIZE, n * PAGE_SIZE)?;
                        run = None;
                    }
                    (false, None) => {}
                }
            }
            if let Some((start, n)) = run {
                sent += self.send_range(conn, r.gpa() + start * PAGE_SIZE, n * PAGE_SIZE)?;
            }
        }
        Ok(sent)
    }

    /// Step 3: pipes the backend's save to the destination frame by frame; returns the
    /// bytes relayed and the guest-RAM ranges the GPU may write (from the full state).
    fn relay_device_state(
        &self,
        conn: &mut Box<dyn Conn>,
    ) -> Result<(u64, Vec<(u64, u64)>), MigrationError> {
        let mut rd = self
            .with_device(|d| d.backend_mut().connection().begin_save())?
            .map_err(MigrationError::Frontend)?;
        let mut bytes = 0u64;
        let mut ranges = Vec::new();
        let pumped = loop {
            let frame = match read_state_frame(&mut rd) {
                Ok(Some(f)) => f,
                Ok(None) => break Ok(()),
                Err(e) => break Err(MigrationError::Io("reading the device state", e)),
            };
            bytes += frame.len() as u64;
            if stream_kind(&frame) == Ok(KIND_FULL) {
                if let Ok(st) = DeviceState::decode(&frame) {
                    ranges = gpu_writable_ranges(&st);
                }
            }
            if let Err(e) = wire::send(conn, &Msg::DeviceFrame(frame)) {
                break Err(e);
            }
        };
        drop(rd);
        let checked = self
            .with_device(|d| d.backend_mut().connection().check_state())?
            .map_err(MigrationError::Frontend);
        pumped?;
        checked?;
        wire::send(conn, &Msg::DeviceEnd)?;
        wire::verdict(conn, "device state")?;
        Ok((bytes, ranges))
    }
}

/// The guest-physical ranges the GPU can write: every guest-RAM mapping not read-only.
fn gpu_writable_ranges(st: &DeviceState) -> Vec<(u64, u64)> {
    st.mappings
        .iter()
        .filter(|m| m.flags & vgpu_protocol::request::MAP_READ_ONLY == 0)
        .filter_map(|m| match &m.target {
            MappingTargetRecord::Guest { ranges } => Some(ranges.clone()),
            MappingTargetRecord::Vram { .. } => None,
        })
        .flatten()
        .collect()
}

impl super::LinuxVm {
    /// A handle that can send this VM to another `vgpu-vmm` while it runs (call before
    /// [`super::LinuxVm::run`]).
    pub fn migration_source(&self) -> MigrationSource {
        MigrationSource {
            vm: self.vm.clone(),
            ram: self.ram.clone(),
            mem: self.mem.clone(),
            hello: Hello {
                vcpus: self.vcpu_count,
                mem_mib: self.mem_mib,
                vgpu: self.vgpu_slot.is_some(),
            },
            devices: self.devices.clone(),
            pci: self.pci.clone(),
            vgpu_slot: self.vgpu_slot,
            park: self.park.clone(),
            busy: Arc::new(AtomicBool::new(false)),
        }
    }
}
