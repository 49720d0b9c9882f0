//! The transport's state for live migration: what the guest programmed into the function
//! (configuration space, feature and queue registers, status, MSI-X), without the device
//! behind it. Restoring it does not activate the backend: the VMM continues the device at
//! the source's ring positions itself.

use super::msix::SavedMsix;
use super::{VirtioBackend, VirtioPciDevice, VirtioPciError, VirtqConfig};

/// See the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportState {
    pub config_regs: Vec<u32>,
    pub device_feature_select: u32,
    pub driver_feature_select: u32,
    pub driver_features: u64,
    pub status: u8,
    pub config_generation: u8,
    pub queue_select: u16,
    pub queues: Vec<VirtqConfig>,
    pub isr: u8,
    pub active: bool,
    pub msix: Option<SavedMsix>,
}

impl<B: VirtioBackend> VirtioPciDevice<B> {
    /// The transport's state (see the module documentation).
    pub fn transport_state(&self) -> TransportState {
        TransportState {
            config_regs: self.config.regs().to_vec(),
            device_feature_select: self.device_feature_select,
            driver_feature_select: self.driver_feature_select,
            driver_features: self.driver_features,
            status: self.status,
            config_generation: self.config_generation,
            queue_select: self.queue_select,
            queues: self.queues.clone(),
            isr: self.isr,
            active: self.active,
            msix: self.msix.as_ref().map(|(m, _)| m.saved()),
        }
    }

    /// Takes over `st`, saved from the same kind of function. The backend is not told:
    /// an active transport expects the caller to continue the backend's rings. Fails
    /// (changing nothing) where the layouts differ.
    pub fn restore_transport(&mut self, st: &TransportState) -> Result<(), VirtioPciError> {
        let bad = VirtioPciError::Restore;
        if st.queues.len() != self.queues.len()
            || st
                .queues
                .iter()
                .enumerate()
                .any(|(i, q)| usize::from(q.index) != i)
        {
            return Err(bad("queue count or order"));
        }
        let max = self.backend.queue_max_size();
        if st
            .queues
            .iter()
            .any(|q| q.size > max || (q.ready && !q.size.is_power_of_two()))
        {
            return Err(bad("queue size"));
        }
        match (&mut self.msix, &st.msix) {
            (Some((m, _)), Some(s)) => {
                if s.entries.len() != usize::from(m.vectors())
                    || s.queue_vectors.len() != self.queues.len()
                {
                    return Err(bad("MSI-X vector or queue count"));
                }
            }
            (None, None) => {}
            _ => return Err(bad("MSI-X presence")),
        }
        if st.driver_features & !self.device_features() != 0 {
            return Err(bad("features the device does not offer"));
        }
        self.config
            .restore_regs(&st.config_regs)
            .map_err(VirtioPciError::Config)?;
        if let (Some((m, _)), Some(s)) = (&mut self.msix, &st.msix) {
            m.restore(s);
        }
        self.device_feature_select = st.device_feature_select;
        self.driver_feature_select = st.driver_feature_select;
        self.driver_features = st.driver_features;
        self.status = st.status;
        self.config_generation = st.config_generation;
        self.queue_select = st.queue_select;
        self.queues.clone_from(&st.queues);
        self.isr = st.isr;
        self.active = st.active;
        Ok(())
    }
}
