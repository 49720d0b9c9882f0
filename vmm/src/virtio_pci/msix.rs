//! MSI-X of the virtio-pci function: the capability, the vector table and PBA in BAR0,
//! and the virtio vector registers (`msix_config`, `queue_msix_vector`).
//!
//! The device only keeps the state the guest programs; delivering the messages is the
//! VMM's business (KVM irq routing + irqfds, `boot/irq_routing.rs`). Whenever something a
//! delivery depends on changes, the state is marked dirty and the VMM picks up a
//! [`MsixState`] snapshot with [`super::VirtioPciDevice::take_msix_update`].

/// MSI-X capability id.
pub const PCI_CAP_ID_MSIX: u8 = 0x11;
/// Table and PBA offsets in BAR0 (after the virtio regions).
pub const MSIX_TABLE_OFFSET: u64 = 0x4000;
pub const MSIX_PBA_OFFSET: u64 = 0x5000;
/// Bytes per table entry: address low, address high, data, vector control.
pub const MSIX_ENTRY_SIZE: u64 = 16;
/// Message control bits (in the capability's upper 16 bits of its first dword).
pub const MSIX_ENABLE: u16 = 1 << 15;
pub const MSIX_FUNCTION_MASK: u16 = 1 << 14;
/// Vector control: masked.
const ENTRY_MASKED: u32 = 1;

/// One table entry as the guest programmed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsixEntry {
    pub addr: u64,
    pub data: u32,
    pub masked: bool,
}

/// What the VMM needs to route the function's interrupts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MsixState {
    /// MSI-X enabled and the function not masked: messages, not INTx.
    pub enabled: bool,
    pub entries: Vec<MsixEntry>,
    /// Vector of configuration changes and of each queue (`VIRTIO_MSI_NO_VECTOR` = none).
    pub config_vector: u16,
    pub queue_vectors: Vec<u16>,
}

impl MsixState {
    /// The entry that queue `q` (or the configuration, `None`) signals through, if it is
    /// deliverable now (enabled, a valid vector, not masked).
    pub fn deliverable(&self, q: Option<usize>) -> Option<(u16, MsixEntry)> {
        if !self.enabled {
            return None;
        }
        let v = match q {
            Some(q) => *self.queue_vectors.get(q)?,
            None => self.config_vector,
        };
        let e = *self.entries.get(usize::from(v))?;
        (!e.masked).then_some((v, e))
    }
}

/// MSI-X as the guest programmed it (see [`Msix::saved`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedMsix {
    /// Address low, address high, data, vector control of each entry.
    pub entries: Vec<[u32; 4]>,
    pub control: u16,
    pub config_vector: u16,
    pub queue_vectors: Vec<u16>,
}

/// The device side of MSI-X.
#[derive(Debug, Clone)]
pub struct Msix {
    entries: Vec<[u32; 4]>,
    control: u16,
    pub(super) config_vector: u16,
    pub(super) queue_vectors: Vec<u16>,
    dirty: bool,
}

impl Msix {
    pub fn new(vectors: u16, queues: usize) -> Self {
        Msix {
            entries: vec![[0, 0, 0, ENTRY_MASKED]; usize::from(vectors)],
            control: 0,
            config_vector: super::VIRTIO_MSI_NO_VECTOR,
            queue_vectors: vec![super::VIRTIO_MSI_NO_VECTOR; queues],
            dirty: false,
        }
    }

    pub fn vectors(&self) -> u16 {
        self.entries.len() as u16
    }

    /// The capability body (id, next, message control, table and PBA in BAR0).
    pub fn capability(&self) -> Vec<u8> {
        let mut v = vec![PCI_CAP_ID_MSIX, 0];
        v.extend_from_slice(&(self.vectors() - 1).to_le_bytes());
        v.extend_from_slice(&(MSIX_TABLE_OFFSET as u32).to_le_bytes());
        v.extend_from_slice(&(MSIX_PBA_OFFSET as u32).to_le_bytes());
        v
    }

    /// The guest wrote message control (from the capability's config dword).
    pub fn set_control(&mut self, control: u16) {
        let control = control & (MSIX_ENABLE | MSIX_FUNCTION_MASK);
        if control != self.control {
            self.control = control;
            self.dirty = true;
        }
    }

    /// A vector number the driver wrote to a vector register: kept if it names an entry,
    /// else `NO_VECTOR` (which the driver reads back to learn it was refused).
    pub fn checked_vector(&self, v: u16) -> u16 {
        if v < self.vectors() {
            v
        } else {
            super::VIRTIO_MSI_NO_VECTOR
        }
    }

    pub fn mark_dirty(&mut self) {
        self.dirty = true;
    }

    /// Whether `[off, off+len)` of BAR0 is the table or the PBA.
    pub fn covers(&self, off: u64, len: usize) -> bool {
        let end = off + len as u64;
        let table_end = MSIX_TABLE_OFFSET + u64::from(self.vectors()) * MSIX_ENTRY_SIZE;
        (off >= MSIX_TABLE_OFFSET && end <= table_end)
            || (off >= MSIX_PBA_OFFSET && end <= MSIX_PBA_OFFSET + 8)
    }

    pub fn read(&self, off: u64, data: &mut [u8]) {
        data.fill(0);
        if off >= MSIX_PBA_OFFSET {
            // Pending bits: messages are never held back here (a masked vector's irqfd is
            // unregistered and KVM delivers what is pending when it is registered again).
            return;
        }
        let rel = off - MSIX_TABLE_OFFSET;
        let (i, word) = (
            (rel / MSIX_ENTRY_SIZE) as usize,
            ((rel % MSIX_ENTRY_SIZE) / 4) as usize,
        );
        let Some(e) = self.entries.get(i) else {
            return;
        };
        // Dword or qword accesses, dword aligned (the spec allows nothing else).
        let lo = e[word].to_le_bytes();
        let hi = e.get(word + 1).copied().unwrap_or(0).to_le_bytes();
        let bytes = [lo, hi].concat();
        let n = data.len().min(8);
        data[..n].copy_from_slice(&bytes[..n]);
    }

    pub fn write(&mut self, off: u64, data: &[u8]) {
        if off >= MSIX_PBA_OFFSET || !off.is_multiple_of(4) {
            return;
        }
        let rel = off - MSIX_TABLE_OFFSET;
        let i = (rel / MSIX_ENTRY_SIZE) as usize;
        let first = ((rel % MSIX_ENTRY_SIZE) / 4) as usize;
        let Some(e) = self.entries.get_mut(i) else {
            return;
        };
        for (word, chunk) in (first..4).zip(data.chunks(4)) {
            let mut b = [0u8; 4];
            b[..chunk.len()].copy_from_slice(chunk);
            let v = u32::from_le_bytes(b);
            let v = if word == 3 { v & ENTRY_MASKED } else { v };
            if e[word] != v {
                e[word] = v;
                self.dirty = true;
            }
        }
    }

    /// What the guest programmed (table and message control), for live migration.
    pub fn saved(&self) -> SavedMsix {
        SavedMsix {
            entries: self.entries.clone(),
            control: self.control,
            config_vector: self.config_vector,
            queue_vectors: self.queue_vectors.clone(),
        }
    }

    /// Takes over a state from [`Self::saved`] of the same function (same vector and
    /// queue counts, checked by the caller); the VMM re-routes at the next update.
    pub fn restore(&mut self, s: &SavedMsix) {
        self.entries = s.entries.clone();
        self.control = s.control & (MSIX_ENABLE | MSIX_FUNCTION_MASK);
        self.config_vector = self.checked_vector(s.config_vector);
        self.queue_vectors = s
            .queue_vectors
            .iter()
            .map(|&v| self.checked_vector(v))
            .collect();
        self.dirty = true;
    }

    /// The state, if it changed since the last call.
    pub fn take_update(&mut self) -> Option<MsixState> {
        if !std::mem::take(&mut self.dirty) {
            return None;
        }
        Some(MsixState {
            enabled: self.control & MSIX_ENABLE != 0 && self.control & MSIX_FUNCTION_MASK == 0,
            entries: self
                .entries
                .iter()
                .map(|e| MsixEntry {
                    addr: u64::from(e[0]) | u64::from(e[1]) << 32,
                    data: e[2],
                    masked: e[3] & ENTRY_MASKED != 0,
                })
                .collect(),
            config_vector: self.config_vector,
            queue_vectors: self.queue_vectors.clone(),
        })
    }
}
