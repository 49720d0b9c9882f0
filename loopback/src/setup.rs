//! Feature negotiation and queue setup shared by connect and reconnect.

use crate::*;

/// Virtio features the loopback driver acks (of those the backend offers): forwarded
/// submission when it has no shared-memory region, EVENT_IDX when asked for.
pub(crate) fn driver_features(forwarded: bool, event_idx: bool) -> u64 {
    let fwd = if forwarded {
        1 << vgpu_protocol::device::VIRTIO_VGPU_F_FORWARDED
    } else {
        0
    };
    let eidx = if event_idx {
        1 << VIRTIO_RING_F_EVENT_IDX
    } else {
        0
    };
    1 << VIRTIO_F_VERSION_1 | fwd | eidx
}

/// Whether the driver runs its rings with EVENT_IDX on `dev`: asked for and offered.
pub(crate) fn uses_event_idx(dev: &VhostUserDevice, want: bool) -> bool {
    want && dev.offered_features() & (1 << VIRTIO_RING_F_EVENT_IDX) != 0
}

/// Sets both queues' EVENT_IDX mode (before the device uses the rings).
pub(crate) fn set_event_idx(ctrl: &Ctrl, events: &Events, on: bool) {
    lock(&ctrl.st).q.set_event_idx(on);
    lock(&events.st).q.set_event_idx(on);
}

/// What the loopback VM needs of the backend: the vgpu requirements, plus device-state
/// transfer where offered (for [`LoopbackVm::migrate_to`]).
pub(crate) fn loopback_requirements(
    request_timeout: Option<Duration>,
    forwarded: bool,
) -> vgpu_vmm::frontend::DeviceRequirements {
    let mut r = vgpu_requirements();
    r.request_timeout = request_timeout;
    r.optional_protocol_features |= vhost::vhost_user::VhostUserProtocolFeatures::DEVICE_STATE;
    if forwarded {
        // As QEMU 10 does: a backend-request channel, but no SHMEM and no region; the
        // driver then acks the forwarded-submission feature.
        r.protocol_features -= vhost::vhost_user::VhostUserProtocolFeatures::SHMEM;
        r.shm_regions.clear();
        r.virtio_features |= 1 << vgpu_protocol::device::VIRTIO_VGPU_F_FORWARDED;
    }
    r
}

/// Runs `f` with the setup of both queues (control, event).
pub(crate) fn with_queues<T>(
    ctrl: &Ctrl,
    events: &Events,
    f: impl FnOnce(&[QueueSetup<'_>]) -> T,
) -> T {
    let (cd, ca, cu) = lock(&ctrl.st).q.host_addrs();
    let (ed, ea, eu) = lock(&events.st).q.host_addrs();
    let queues = [
        QueueSetup {
            index: CONTROL_QUEUE as usize,
            size: QUEUE_SIZE,
            desc_addr: cd,
            avail_addr: ca,
            used_addr: cu,
            call: &ctrl.call,
            kick: &ctrl.kick,
        },
        QueueSetup {
            index: EVENT_QUEUE as usize,
            size: QUEUE_SIZE,
            desc_addr: ed,
            avail_addr: ea,
            used_addr: eu,
            call: &events.call,
            kick: &events.kick,
        },
    ];
    f(&queues)
}
