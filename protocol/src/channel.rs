//! Layout of a channel's control page (Fermi's USERD in spirit).
//!
//! One 4 KiB page per channel. The application writes `GP_PUT` and the fence waiter's
//! two words (`REF_WAKE`, `REF_WAKE_ARMED`); the GPU writes the rest. The page is what the backend maps into a VM's BAR, and what the scheduler swaps
//! for a shadow page, so it must hold nothing the GPU needs that the application could
//! corrupt: the ring's address and size live in GPU-private channel state; the copies
//! here are for information only.

/// Byte offsets of the control-page fields. All fields are little-endian `u32` unless noted.
pub struct ControlPage;

impl ControlPage {
    /// Submission counter written by the application: the number of GP entries ever
    /// submitted (wrapping). Entry `n` lives at ring index `n % gp_entries`.
    pub const GP_PUT: usize = 0x00;
    /// Completion counter written by the GPU: the number of GP entries whose push
    /// buffers have finished executing (wrapping).
    pub const GP_GET: usize = 0x04;
    /// Reference counter, written by the `SET_REF` method (a cheap fence).
    pub const REF: usize = 0x08;
    /// Channel error: an [`crate::ErrorCode`] value, 0 while the channel is healthy.
    pub const ERROR: usize = 0x0c;
    /// [`crate::PROTOCOL_VERSION`], written at channel creation.
    pub const VERSION: usize = 0x10;
    /// Number of GP ring entries (informational copy).
    pub const GP_ENTRIES: usize = 0x14;
    /// Count of `NOTIFY` methods executed (wrapping).
    pub const NOTIFY_SEQ: usize = 0x18;
    /// Nonzero while the GPU's front end sleeps rather than polls: an application that
    /// advanced `GP_PUT` and then (after a full fence) reads nonzero here rings the
    /// doorbell (docs/protocol.md, "Doorbell"). Written by the GPU only.
    pub const WANT_DOORBELL: usize = 0x1c;
    /// `u64`: detail for `ERROR`: the faulting GPU virtual address, or the GPU address of
    /// the malformed GP entry or method header.
    pub const ERROR_INFO: usize = 0x20;
    /// The fence value a sleeping waiter waits for (`REF` reaching it, wrapping
    /// compare), written by the application before it arms `REF_WAKE_ARMED`
    /// (docs/protocol.md, "Blocking fence waits").
    pub const REF_WAKE: usize = 0x28;
    /// Nonzero while a waiter sleeps until `REF` reaches `REF_WAKE`: set by the
    /// application, cleared by the GPU when it sends the channel's `FENCE` event.
    pub const REF_WAKE_ARMED: usize = 0x2c;
    /// Bytes of the page that carry state; the rest reads as zero.
    pub const USED_BYTES: usize = 0x30;
}

/// Limits on a channel's GP ring.
pub const MIN_GP_ENTRIES: u32 = 2;
pub const MAX_GP_ENTRIES: u32 = 1 << 16;

/// Validates a GP ring size: a power of two within the limits.
pub fn valid_gp_entries(n: u32) -> bool {
    (MIN_GP_ENTRIES..=MAX_GP_ENTRIES).contains(&n) && n.is_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_do_not_overlap_and_fit_the_page() {
        let mut fields = [
            (ControlPage::GP_PUT, 4),
            (ControlPage::GP_GET, 4),
            (ControlPage::REF, 4),
            (ControlPage::ERROR, 4),
            (ControlPage::VERSION, 4),
            (ControlPage::GP_ENTRIES, 4),
            (ControlPage::NOTIFY_SEQ, 4),
            (ControlPage::WANT_DOORBELL, 4),
            (ControlPage::ERROR_INFO, 8),
            (ControlPage::REF_WAKE, 4),
            (ControlPage::REF_WAKE_ARMED, 4),
        ];
        fields.sort();
        for w in fields.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0);
        }
        for (off, len) in fields {
            assert_eq!(off % len, 0, "naturally aligned");
            assert!(off + len <= ControlPage::USED_BYTES);
        }
        assert!(ControlPage::USED_BYTES as u64 <= crate::PAGE_SIZE);
    }

    #[test]
    fn ring_sizes() {
        assert!(valid_gp_entries(2));
        assert!(valid_gp_entries(1024));
        assert!(!valid_gp_entries(0));
        assert!(!valid_gp_entries(1));
        assert!(!valid_gp_entries(1000));
        assert!(!valid_gp_entries(MAX_GP_ENTRIES * 2));
    }
}
