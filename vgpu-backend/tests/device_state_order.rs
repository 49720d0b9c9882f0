//! A device state loaded before the memory table (Cloud Hypervisor's order), through the
//! device's vhost-user handlers: the stream is checked when it arrives and applied — its
//! guest mappings resolved — by the first memory table, which refuses it whole if a
//! mapping lies outside the table. (`bench/tests/migrate_loopback.rs` drives the same
//! order over a real socket with a running VM.)

use std::io::Write;
use std::sync::Arc;

use vgpu_backend::vhu_vgpu::VhuVgpu;
use vgpu_backend::{EventQueue, GuestMemory, VmLimits};
use vgpu_host_shim::{Gpu, SimConfig, SimGpu};
use vgpu_protocol::migration::{ContextRecord, DeviceState, MappingRecord, MappingTargetRecord};
use vgpu_protocol::request::PAGE_4K;
use vhost::vhost_user::message::{VhostTransferStateDirection, VhostTransferStatePhase};
use vhost_user_backend::VhostUserBackend;
use vm_memory::{GuestAddress, GuestMemoryAtomic};

/// Guest RAM of the table that arrives after the state.
const RAM: (u64, usize) = (0x10_0000, 0x10_0000);

fn device() -> (VhuVgpu, Arc<SimGpu>) {
    let gpu = SimGpu::new(SimConfig {
        vram_bytes: 32 << 20,
        max_channels: 16,
        max_contexts: 16,
        ..SimConfig::default()
    })
    .expect("sim GPU");
    let dyn_gpu: Arc<dyn Gpu> = gpu.clone();
    let no_table = GuestMemoryAtomic::new(GuestMemory::new());
    let dev = VhuVgpu::detached(
        "order",
        dyn_gpu,
        VmLimits::default(),
        Arc::new(EventQueue::detached(16)),
        no_table,
    )
    .expect("device");
    (dev, gpu)
}

fn table() -> GuestMemoryAtomic<GuestMemory> {
    let mem = GuestMemory::from_ranges(&[(GuestAddress(RAM.0), RAM.1)]).expect("guest RAM");
    GuestMemoryAtomic::new(mem)
}

/// One context mapping one guest page at `gpa` into its GPU address space.
fn state_mapping(gpa: u64) -> Vec<u8> {
    DeviceState {
        contexts: vec![ContextRecord { id: 1, pid: 7 }],
        mappings: vec![MappingRecord {
            ctx: 1,
            va: 1 << 32,
            pid: 7,
            size: 0x1000,
            page: PAGE_4K,
            flags: 0,
            target: MappingTargetRecord::Guest {
                ranges: vec![(gpa, 0x1000)],
            },
        }],
        ..DeviceState::default()
    }
    .encode()
}

/// SET_DEVICE_STATE_FD (LOAD) with `bytes` written to EOF, then CHECK_DEVICE_STATE.
fn load(dev: &VhuVgpu, bytes: &[u8]) -> std::io::Result<()> {
    let (rd, mut wr) = std::io::pipe()?;
    dev.set_device_state_fd(
        VhostTransferStateDirection::LOAD,
        VhostTransferStatePhase::STOPPED,
        std::fs::File::from(std::os::fd::OwnedFd::from(rd)),
    )?;
    wr.write_all(bytes)?;
    drop(wr);
    dev.check_device_state()
}

#[test]
fn a_state_loaded_before_the_table_is_applied_by_the_table() {
    let (dev, gpu) = device();
    load(&dev, &state_mapping(RAM.0 + 0x2000)).expect("the state is accepted");
    assert_eq!(
        gpu.stats().contexts,
        0,
        "nothing is applied before the table"
    );
    dev.update_memory(table())
        .expect("the table applies the state");
    assert_eq!(gpu.stats().contexts, 1, "the context was re-created");
    // Applied once: a later table has nothing left to apply.
    dev.update_memory(table()).expect("a second table");
    assert_eq!(gpu.stats().contexts, 1);
}

#[test]
fn a_state_whose_mapping_misses_the_table_is_refused_by_it_and_nothing_stays() {
    let (dev, gpu) = device();
    load(&dev, &state_mapping(RAM.0 + RAM.1 as u64)).expect("it decodes: accepted");
    let e = dev
        .update_memory(table())
        .expect_err("a mapping outside the table");
    assert!(e.to_string().contains("mapping"), "{e}");
    assert_eq!(
        gpu.stats().contexts,
        0,
        "the restored context was torn down"
    );
}

#[test]
fn a_malformed_state_before_the_table_fails_its_check() {
    let (dev, gpu) = device();
    let mut bad = state_mapping(RAM.0);
    let n = bad.len();
    bad[n - 1] ^= 0x40; // the body's checksum no longer matches
    assert!(load(&dev, &bad).is_err(), "a corrupt state was accepted");
    dev.update_memory(table())
        .expect("nothing waits for the table");
    assert_eq!(gpu.stats().contexts, 0);
}

#[test]
fn one_state_waits_for_the_table_at_a_time_and_a_reset_drops_it() {
    let (dev, _gpu) = device();
    load(&dev, &state_mapping(RAM.0)).expect("the first state");
    assert!(
        load(&dev, &state_mapping(RAM.0)).is_err(),
        "a second state before the table was taken"
    );
    dev.reset_device();
    load(&dev, &state_mapping(RAM.0)).expect("after a reset the slot is free");
}
