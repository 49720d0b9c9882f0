//! `vgpu-vmm`: the VMM side of vgpu.
//!
//! - [`frontend`]: the vhost-user frontend (handshake, backend-request channel, vring
//!   setup), shared by the KVM VMM and the loopback frontend (crate `vgpu-loopback`,
//!   which the VMM does not ship).
//! - [`shm_window`]: the device's shared-memory window (BAR) served by SHMEM_MAP/UNMAP.
//! - [`guest_memory`]: memfd-backed guest RAM and a page allocator over it.
//! - [`virtq`]: a split-virtqueue driver (the guest side of a virtqueue).
//! - [`pci`]: a PCI bus (config mechanism #1, host bridge, BARs, capabilities).
//! - [`virtio_pci`]: a modern virtio-pci function with a shared-memory BAR over a
//!   [`virtio_pci::VirtioBackend`].
//! - [`reconnect`]: the fault policy (request timeout, reconnect with backoff) and its
//!   retry loop; [`request_timeout`]: the watchdog that ends an unanswered request.
//! - [`migration`]: live migration of a KVM VM between two `vgpu-vmm`s (the stream,
//!   vCPU, chip and device state; the steps are in `boot::send` and `boot::receive`).

pub mod boot;
pub mod frontend;
pub mod guest_memory;
pub mod kvm;
pub mod migration;
pub mod pci;
pub mod reconnect;
pub mod request_timeout;
pub mod sandbox;
pub mod shm_window;
pub mod vgpu_device;
pub mod virtio_pci;
pub mod virtq;
pub mod write_protect;
