//! What travels besides RAM and vCPUs: the machine's shape ([`Hello`]), the vgpu rings
//! and transport ([`RingsRecord`]), and the last state before the commit
//! ([`MachineRecord`]: chips, vCPUs, transport again, serial port).

use vm_superio::serial::SerialState;

use super::codec::{Dec, Enc};
use super::cpu::VcpuState;
use super::machine::ChipState;
use super::MigrationError;
use crate::virtio_pci::msix::SavedMsix;
use crate::virtio_pci::state::TransportState;
use crate::virtio_pci::VirtqConfig;

/// The machine's shape: the destination builds the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub vcpus: u8,
    pub mem_mib: u64,
    /// The vgpu function is on the PCI bus (backed by a vhost-user backend).
    pub vgpu: bool,
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.u8(self.vcpus).u64(self.mem_mib).bool(self.vgpu);
        e.0
    }
    pub fn decode(b: &[u8]) -> Result<Self, MigrationError> {
        let mut d = Dec::new(b, "hello");
        let h = Hello {
            vcpus: d.u8()?,
            mem_mib: d.u64()?,
            vgpu: d.bool()?,
        };
        d.end()?;
        Ok(h)
    }
}

fn encode_transport(e: &mut Enc, t: &TransportState) {
    e.u32(t.config_regs.len() as u32);
    for &r in &t.config_regs {
        e.u32(r);
    }
    e.u32(t.device_feature_select)
        .u32(t.driver_feature_select)
        .u64(t.driver_features)
        .u8(t.status)
        .u8(t.config_generation)
        .u16(t.queue_select);
    e.u32(t.queues.len() as u32);
    for q in &t.queues {
        e.u16(q.index)
            .u16(q.size)
            .bool(q.ready)
            .u64(q.desc)
            .u64(q.avail)
            .u64(q.used);
    }
    e.u8(t.isr).bool(t.active);
    match &t.msix {
        None => {
            e.bool(false);
        }
        Some(m) => {
            e.bool(true).u32(m.entries.len() as u32);
            for w in &m.entries {
                for &x in w {
                    e.u32(x);
                }
            }
            e.u16(m.control).u16(m.config_vector);
            e.u32(m.queue_vectors.len() as u32);
            for &v in &m.queue_vectors {
                e.u16(v);
            }
        }
    }
}

fn decode_transport(d: &mut Dec<'_>) -> Result<TransportState, MigrationError> {
    let n = d.count(4)?;
    let mut config_regs = Vec::with_capacity(n);
    for _ in 0..n {
        config_regs.push(d.u32()?);
    }
    let device_feature_select = d.u32()?;
    let driver_feature_select = d.u32()?;
    let driver_features = d.u64()?;
    let status = d.u8()?;
    let config_generation = d.u8()?;
    let queue_select = d.u16()?;
    let n = d.count(29)?;
    let mut queues = Vec::with_capacity(n);
    for _ in 0..n {
        queues.push(VirtqConfig {
            index: d.u16()?,
            size: d.u16()?,
            ready: d.bool()?,
            desc: d.u64()?,
            avail: d.u64()?,
            used: d.u64()?,
        });
    }
    let isr = d.u8()?;
    let active = d.bool()?;
    let msix = if d.bool()? {
        let n = d.count(16)?;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            entries.push([d.u32()?, d.u32()?, d.u32()?, d.u32()?]);
        }
        let control = d.u16()?;
        let config_vector = d.u16()?;
        let n = d.count(2)?;
        let mut queue_vectors = Vec::with_capacity(n);
        for _ in 0..n {
            queue_vectors.push(d.u16()?);
        }
        Some(SavedMsix {
            entries,
            control,
            config_vector,
            queue_vectors,
        })
    } else {
        None
    };
    Ok(TransportState {
        config_regs,
        device_feature_select,
        driver_feature_select,
        driver_features,
        status,
        config_generation,
        queue_select,
        queues,
        isr,
        active,
        msix,
    })
}

/// The vgpu rings stopped on the source: where each ready queue goes on (in queue order)
/// and the transport the guest programmed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingsRecord {
    pub bases: Vec<u16>,
    pub transport: TransportState,
}

impl RingsRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.u32(self.bases.len() as u32);
        for &b in &self.bases {
            e.u16(b);
        }
        encode_transport(&mut e, &self.transport);
        e.0
    }
    pub fn decode(b: &[u8]) -> Result<Self, MigrationError> {
        let mut d = Dec::new(b, "rings");
        let n = d.count(2)?;
        let mut bases = Vec::with_capacity(n);
        for _ in 0..n {
            bases.push(d.u16()?);
        }
        let transport = decode_transport(&mut d)?;
        d.end()?;
        Ok(RingsRecord { bases, transport })
    }
}

/// Everything of the stopped machine but RAM and the vgpu device's own state.
#[derive(Debug)]
pub struct MachineRecord {
    pub chips: ChipState,
    pub vcpus: Vec<VcpuState>,
    /// The vgpu transport as it was when the vCPUs stopped (the guest may have changed
    /// MSI-X since [`RingsRecord`]).
    pub transport: Option<TransportState>,
    pub serial: SerialState,
}

impl MachineRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        self.chips.encode(&mut e);
        e.u32(self.vcpus.len() as u32);
        for v in &self.vcpus {
            v.encode(&mut e);
        }
        match &self.transport {
            None => {
                e.bool(false);
            }
            Some(t) => {
                e.bool(true);
                encode_transport(&mut e, t);
            }
        }
        let s = &self.serial;
        e.u8(s.baud_divisor_low)
            .u8(s.baud_divisor_high)
            .u8(s.interrupt_enable)
            .u8(s.interrupt_identification)
            .u8(s.line_control)
            .u8(s.line_status)
            .u8(s.modem_control)
            .u8(s.modem_status)
            .u8(s.scratch)
            .bytes(&s.in_buffer);
        e.0
    }

    pub fn decode(b: &[u8]) -> Result<Self, MigrationError> {
        let mut d = Dec::new(b, "machine");
        let chips = ChipState::decode(&mut d)?;
        let n = d.count(64)?;
        let mut vcpus = Vec::with_capacity(n);
        for _ in 0..n {
            vcpus.push(VcpuState::decode(&mut d)?);
        }
        let transport = if d.bool()? {
            Some(decode_transport(&mut d)?)
        } else {
            None
        };
        let serial = SerialState {
            baud_divisor_low: d.u8()?,
            baud_divisor_high: d.u8()?,
            interrupt_enable: d.u8()?,
            interrupt_identification: d.u8()?,
            line_control: d.u8()?,
            line_status: d.u8()?,
            modem_control: d.u8()?,
            modem_status: d.u8()?,
            scratch: d.u8()?,
            in_buffer: d.bytes()?.to_vec(),
        };
        d.end()?;
        Ok(MachineRecord {
            chips,
            vcpus,
            transport,
            serial,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transport() -> TransportState {
        TransportState {
            config_regs: (0..64).collect(),
            device_feature_select: 1,
            driver_feature_select: 0,
            driver_features: 0x1_0000_0000,
            status: 0xf,
            config_generation: 2,
            queue_select: 1,
            queues: vec![
                VirtqConfig {
                    index: 0,
                    size: 256,
                    ready: true,
                    desc: 0x1000,
                    avail: 0x2000,
                    used: 0x3000,
                },
                VirtqConfig {
                    index: 1,
                    size: 64,
                    ready: false,
                    desc: 0,
                    avail: 0,
                    used: 0,
                },
            ],
            isr: 1,
            active: true,
            msix: Some(SavedMsix {
                entries: vec![[1, 2, 3, 0]; 3],
                control: 0x8000,
                config_vector: 2,
                queue_vectors: vec![0, 1],
            }),
        }
    }

    #[test]
    fn records_round_trip_and_refuse_truncation() {
        let h = Hello {
            vcpus: 2,
            mem_mib: 512,
            vgpu: true,
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        let r = RingsRecord {
            bases: vec![7, 9],
            transport: transport(),
        };
        let b = r.encode();
        assert_eq!(RingsRecord::decode(&b).unwrap(), r);
        for cut in 0..b.len() {
            assert!(RingsRecord::decode(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(RingsRecord::decode(&long).is_err());
        // A count that claims more than the input holds is refused before allocating.
        let mut huge = b.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(RingsRecord::decode(&huge).is_err());
    }
}
