//! The source side of a live migration ([`MigrationSource::send`]).
//!
//! Order, and why:
//! 1. **RAM pre-copy** with KVM's dirty log: all of RAM once, then what the vCPUs wrote,
//!    round after round, while the guest runs (its vgpu requests are served meanwhile: a
//!    long pre-copy must not outlast the guest driver's request timeout).
//! 2. **Stop the vgpu rings** (GET_VRING_BASE): from here the backend writes nothing into
//!    guest RAM through them; the guest's new control requests wait in the ring. One more
//!    RAM round sends what the vCPUs wrote and every page the backend may have written
//!    through the rings since round 0 — KVM's dirty log does not see its writes: the used
//!    rings, and each buffer a descriptor in the table marks device-writable.
//! 3. **Pause the vCPUs**; each saves its own state. The guest's CPU must be stopped
//!    before the device's state is taken: its stores through aperture windows (VRAM) and
//!    into channel pages after the backend's last round would otherwise be lost.
//! 4. **The vgpu device's state**, relayed frame by frame from the source's backend to
//!    the destination's: the backend's VRAM pre-copy rounds (the GPU may still run work
//!    submitted before the pause), then it pauses the VM's channels and sends the rest.
//! 5. **The last RAM round**: what the vCPUs wrote since the previous round, the ring
//!    pages of step 2 again (a request the backend had taken off the ring when it was
//!    stopped completes after the stop), plus every guest page the GPU could write (the GPU mappings of guest RAM listed in the device
//!    state: KVM's dirty log does not see the GPU's writes).
//! 6. **The tail**: the GP_PUTs the guest stored since the backend paused.
//! 7. **Chips, vCPUs, transport, serial port**, then the commit; once the destination
//!    acknowledges it, the vCPU threads here leave.
//!
//! A failure anywhere before the destination's last acknowledgement resumes the VM here:
//! the vCPUs run on, the rings restart where they stopped and a kick of the control
//! queue lets the backend unpause the channels.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use log::{info, warn};
use vgpu_protocol::device::CONTROL_QUEUE;
use vgpu_protocol::migration::{stream_kind, DeviceState, MappingTargetRecord, KIND_FULL};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

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
use crate::virtio_pci::VirtqConfig;

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

/// What step 2 stopped, to restart on failure.
struct Stopped {
    bases: Vec<u16>,
    rings: RingsRecord,
    /// The device's activation count then: a guest that reset the device meanwhile runs
    /// new rings, which a restart must not touch.
    activations: u64,
}

impl MigrationSource {
    /// Sends the VM to the `vgpu-vmm --incoming` at `addr`; `progress` gets a line per
    /// step. On success the destination runs the VM and the vCPUs here stay parked until
    /// [`Self::hand_over`] (so the caller can report before the process ends).
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

    /// After a successful [`Self::send`]: the parked vCPU threads leave, and with them
    /// [`super::LinuxVm::run`] returns [`super::GuestExit::MigratedOut`].
    pub fn hand_over(&self) {
        self.park.leave();
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
        let slots = self.ram_slots()?;
        let mut paused = false;
        let mut stopped = None;
        let r = self.run_steps(&mut conn, &slots, &mut stopped, &mut paused, progress);
        for &s in &slots {
            if let Err(e) = self.vm.set_dirty_logging(s, false) {
                warn!("migration: turning dirty logging off: {e}");
            }
        }
        match r {
            Ok(mut rep) => {
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
        stopped: &mut Option<Stopped>,
        paused: &mut bool,
        progress: &mut dyn FnMut(String),
    ) -> Result<SendReport, MigrationError> {
        let mut rep = SendReport::default();
        // 1. RAM pre-copy.
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
        // 2. Stop the rings; what the backend wrote through them since round 0.
        *stopped = self.stop_rings()?;
        if let Some(st) = stopped.as_ref() {
            let t = Instant::now();
            let mut pages = self.dirty_pages(slots)?;
            ring_written_pages(&self.mem, &st.rings.transport.queues, &mut pages);
            let bytes = self.send_pages(conn, &pages)?;
            wire::send(conn, &Msg::RoundEnd { round })?;
            rep.ram_rounds.push(bytes);
            progress(format!(
                "rings stopped; ram round {round}: {bytes} bytes in {:.0} ms",
                t.elapsed().as_secs_f64() * 1e3
            ));
            round += 1;
        }
        // 3. Pause. Before the device's state, not after it: guest CPU stores through an
        // aperture window (VRAM) or into a channel page after the backend's last round
        // would not reach the destination (seen in the rig as a channel's MMU fault
        // there); with the vCPUs stopped the device's state is final when it is sent.
        let paused_at = Instant::now();
        let vcpus = self.park.pause(PAUSE_TIMEOUT)?;
        *paused = true;
        // 4. The vgpu device's state.
        let mut gpu_ranges = Vec::new();
        if let Some(st) = stopped.as_ref() {
            wire::send(conn, &Msg::Rings(st.rings.encode()))?;
            wire::verdict(conn, "rings")?;
            let (bytes, ranges) = self.relay_device_state(conn)?;
            rep.device_bytes = bytes;
            gpu_ranges = ranges;
            progress(format!("device state: {bytes} bytes"));
        }
        // 5. The last RAM round.
        let mut pages = self.dirty_pages(slots)?;
        if let Some(st) = stopped.as_ref() {
            // Again: a request the backend had taken off the ring when GET_VRING_BASE
            // came completes after it (its used entry and reply land late).
            ring_written_pages(&self.mem, &st.rings.transport.queues, &mut pages);
        }
        for &(gpa, len) in &gpu_ranges {
            rep.gpu_pages += add_pages(&self.mem, gpa, len, &mut pages);
        }
        let bytes = self.send_pages(conn, &pages)?;
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
                activations: d.backend().activations(),
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
            if !d.is_active() || d.backend().activations() != st.activations {
                info!("migration: the guest reset the vgpu device meanwhile; its new rings run");
                return Ok(());
            }
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

    /// The pages the vCPUs wrote since the last look (reading the log clears it).
    fn dirty_pages(&self, slots: &[SlotId]) -> Result<BTreeSet<u64>, MigrationError> {
        let mut pages = BTreeSet::new();
        for (r, &slot) in self.ram.regions().iter().zip(slots) {
            let bitmap = self.vm.take_dirty(slot).map_err(MigrationError::KvmLayer)?;
            for (w, &word) in bitmap.iter().enumerate() {
                let mut bits = word;
                while bits != 0 {
                    let b = u64::from(bits.trailing_zeros());
                    bits &= bits - 1;
                    let page = w as u64 * 64 + b;
                    if page < r.len() / PAGE_SIZE {
                        pages.insert(r.gpa() + page * PAGE_SIZE);
                    }
                }
            }
        }
        Ok(pages)
    }

    /// Sends `pages` (guest-physical, page aligned) as runs of neighbouring pages.
    fn send_pages(
        &self,
        conn: &mut Box<dyn Conn>,
        pages: &BTreeSet<u64>,
    ) -> Result<u64, MigrationError> {
        let mut sent = 0;
        let mut run: Option<(u64, u64)> = None;
        for &p in pages {
            run = match run {
                Some((start, len)) if start + len == p => Some((start, len + PAGE_SIZE)),
                Some((start, len)) => {
                    sent += self.send_range(conn, start, len)?;
                    Some((p, PAGE_SIZE))
                }
                None => Some((p, PAGE_SIZE)),
            };
        }
        if let Some((start, len)) = run {
            sent += self.send_range(conn, start, len)?;
        }
        Ok(sent)
    }

    /// Sends the pages the vCPUs wrote since the last look.
    fn send_dirty(
        &self,
        conn: &mut Box<dyn Conn>,
        slots: &[SlotId],
    ) -> Result<u64, MigrationError> {
        let pages = self.dirty_pages(slots)?;
        self.send_pages(conn, &pages)
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

/// Adds the pages of `[gpa, gpa+len)` that lie in guest RAM to `pages`; returns how many
/// pages the range covers.
fn add_pages(mem: &GuestMemoryMmap, gpa: u64, len: u64, pages: &mut BTreeSet<u64>) -> u64 {
    let Some(end) = gpa.checked_add(len) else {
        return 0;
    };
    let mut p = gpa & !(PAGE_SIZE - 1);
    let mut n = 0;
    while p < end {
        if mem.check_range(GuestAddress(p), PAGE_SIZE as usize) {
            pages.insert(p);
            n += 1;
        }
        p += PAGE_SIZE;
    }
    n
}

/// Split-ring descriptor flags (virtio 1.x §2.7.5).
const VRING_DESC_F_WRITE: u16 = 2;

/// The pages the backend may have written through the rings of `queues`: each used ring,
/// and each buffer a descriptor in the table marks device-writable (read from guest RAM
/// now; the rings are stopped). A buffer whose descriptor the guest reused before this
/// look was consumed by the guest already.
fn ring_written_pages(mem: &GuestMemoryMmap, queues: &[VirtqConfig], pages: &mut BTreeSet<u64>) {
    for q in queues.iter().filter(|q| q.ready) {
        let n = u64::from(q.size);
        add_pages(mem, q.used, 6 + 8 * n, pages);
        for i in 0..n {
            let mut d = [0u8; 16];
            if mem
                .read_slice(&mut d, GuestAddress(q.desc + 16 * i))
                .is_err()
            {
                break;
            }
            let addr = u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]]);
            let len = u32::from_le_bytes([d[8], d[9], d[10], d[11]]);
            let flags = u16::from_le_bytes([d[12], d[13]]);
            if flags & VRING_DESC_F_WRITE != 0 {
                add_pages(mem, addr, u64::from(len), pages);
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(mem: &GuestMemoryMmap, table: u64, i: u64, addr: u64, len: u32, flags: u16) {
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        mem.write_slice(&d, GuestAddress(table + 16 * i)).unwrap();
    }

    /// The pages a stopped ring's device may have written: its used ring and every
    /// device-writable buffer in the descriptor table (page by page, across page
    /// boundaries), never a read-only buffer, nothing outside guest RAM.
    #[test]
    fn ring_written_pages_are_the_used_ring_and_writable_buffers() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let q = VirtqConfig {
            index: 0,
            size: 4,
            ready: true,
            desc: 0x1000,
            avail: 0x2000,
            used: 0x3000,
        };
        desc(&mem, q.desc, 0, 0x10000, 0x2000, VRING_DESC_F_WRITE);
        desc(&mem, q.desc, 1, 0x20000, 16, 0);
        desc(&mem, q.desc, 2, 0xffff_f000, 0x1000, VRING_DESC_F_WRITE);
        desc(&mem, q.desc, 3, 0x30ff0, 0x20, VRING_DESC_F_WRITE);
        let not_ready = VirtqConfig {
            index: 1,
            ready: false,
            desc: 0x5000,
            used: 0x6000,
            ..q
        };
        let mut pages = BTreeSet::new();
        ring_written_pages(&mem, &[q, not_ready], &mut pages);
        let want: BTreeSet<u64> = [0x3000, 0x10000, 0x11000, 0x30000, 0x31000].into();
        assert_eq!(pages, want);
        // A range that wraps the address space adds nothing.
        assert_eq!(add_pages(&mem, u64::MAX - 10, 100, &mut pages), 0);
    }
}
