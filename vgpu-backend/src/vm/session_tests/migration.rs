//! Live migration of a session's state (crate::vm::migration).

use super::*;

/// A session with objects at non-trivial ids and places: two contexts (one id skipped),
/// a 3 MiB VRAM object with a pattern, mapped on the GPU and in the aperture, a guest
/// mapping, two channels with work queued in their shadow pages; paused for migration.
fn migration_source() -> (T, Vec<u32>) {
    use crate::shadow::Holder;
    let mut a = T::new();
    let c1 = a.ctx(7);
    let gone = a.ctx(7);
    a.req(7, gone, Op::DestroyContext).unwrap();
    let c2 = a.ctx(8);
    let (m1, size) = a.alloc(7, c1, 3 * MIB, 4096);
    let b = a.s.hal.vram[&m1].clone();
    for c in &b.chunks {
        if let crate::vram::backing::Loc::Vram(o) = c.loc {
            let bytes: Vec<u8> = (0..c.len).map(|i| ((c.off + i) * 31 % 251) as u8).collect();
            a.gpu.vram_write(o, &bytes).unwrap();
        }
    }
    let map = Op::MapVram {
        mem: m1,
        flags: 0,
        va: 0x40_0000_0000,
        page: PAGE_4K,
    };
    a.req(7, c1, map).unwrap();
    a.req(7, c1, Op::MapAperture { mem: m1 }).unwrap();
    let guest = Op::MapGuest {
        va: 0x20_0000,
        page: PAGE_4K,
        flags: MAP_READ_ONLY,
        ranges: vec![range(R1.0, 0x2000), range(R0.0 + 0x1000, 0x1000)],
    };
    a.req(8, c2, guest).unwrap();
    let (ch1, _) = a.channel(7, c1);
    let (ch2, _) = a.channel(8, c2);
    assert_eq!(size, 3 * MIB);
    a.s.hold.paused = true;
    for ch in [ch1, ch2] {
        a.s.hold_channel(ch, Holder::Operator, true, &a.shm)
            .unwrap();
    }
    (a, vec![ch1, ch2])
}

#[test]
fn migration_round_trip_restores_everything_at_the_same_places() {
    use vgpu_protocol::migration::{DeviceState, VmRecord};
    let (mut a, chans) = migration_source();
    // The guest submitted 3 entries to channel 1 while paused.
    assert!(a.s.shadows.raise_shadow_put(chans[0], 3));
    let st = a.s.save_device_state(VmRecord::default()).unwrap();
    let st = DeviceState::decode(&st.encode()).unwrap();
    assert_eq!(st.channels[0].gp_put, 3);
    assert_eq!(st.mems[0].data.len() as u64, 3 * MIB);
    assert!(st.mems[0]
        .data
        .iter()
        .enumerate()
        .all(|(i, &v)| v == (i as u64 * 31 % 251) as u8));

    let mut b = T::new();
    b.s.load_device_state(&st, &b.mem, &b.shm).unwrap();
    assert_eq!(b.s.state.contexts, a.s.state.contexts);
    assert_eq!(b.s.state.mems, a.s.state.mems);
    assert_eq!(b.s.state.mappings, a.s.state.mappings);
    assert_eq!(b.s.state.channels, a.s.state.channels);
    assert_eq!(b.s.state.usage, a.s.state.usage);
    // Every BAR view at the same offset; channels shadowed with the guest's GP_PUT.
    let (av, bv) = (a.shm.live(), b.shm.live());
    assert_eq!(av, bv);
    for &ch in &chans {
        assert!(b.s.is_shadowed(ch));
        assert_eq!(
            b.s.peek_channel_any(ch).unwrap(),
            a.s.peek_channel_any(ch).unwrap()
        );
    }
    // Same contents: the destination saves what the source saved.
    let again = b.s.save_device_state(VmRecord::default()).unwrap();
    assert_eq!(again.mems, st.mems);
    assert_eq!(again.channels, st.channels);
    // New ids continue after the saved ones.
    let c3 = b.ctx(9);
    assert!(c3 > *st.contexts.iter().map(|c| &c.id).max().unwrap());
}

#[test]
fn a_hostile_state_is_refused_and_leaves_the_destination_empty() {
    use vgpu_protocol::migration::{DeviceState, MappingTargetRecord, VmRecord};
    let (mut a, _) = migration_source();
    let st = a.s.save_device_state(VmRecord::default()).unwrap();
    let mut cases: Vec<(&str, DeviceState)> = Vec::new();
    let mut s = st.clone();
    s.channels[1].slot = s.channels[0].slot;
    cases.push(("two channels in one slot", s));
    let mut s = st.clone();
    s.channels[1].id = s.channels[0].id;
    cases.push(("duplicate channel id", s));
    let mut s = st.clone();
    s.contexts[1].id = s.contexts[0].id;
    cases.push(("duplicate context id", s));
    let mut s = st.clone();
    s.channels[0].pid = 999;
    cases.push(("channel in another process's context", s));
    let mut s = st.clone();
    s.mems[0].data.truncate(10);
    cases.push(("short VRAM contents", s));
    let mut s = st.clone();
    s.mems[0].aperture = Some(3);
    cases.push(("misaligned aperture", s));
    let mut s = st.clone();
    s.mappings[0].va += 1;
    cases.push(("misaligned mapping", s));
    let mut s = st.clone();
    if let MappingTargetRecord::Guest { ranges } = &mut s.mappings[1].target {
        ranges[0].0 = 64 << 30;
    }
    cases.push(("guest range outside RAM", s));
    let mut s = st.clone();
    s.channels[0].error = Some((0xdead, 0));
    cases.push(("unknown error code", s));
    let mut s = st.clone();
    s.channels[0].slot = CHANNEL_SLOTS;
    cases.push(("slot outside the BAR", s));
    for (what, s) in cases {
        let mut b = T::new();
        let r = b.s.load_device_state(&s, &b.mem, &b.shm);
        assert!(r.is_err(), "{what}: accepted");
        assert!(b.s.is_empty(), "{what}: objects left");
        assert!(b.shm.live().is_empty(), "{what}: BAR views left");
        b.assert_baseline();
    }
    // A destination that already serves objects refuses any state.
    let mut b = T::new();
    b.ctx(1);
    assert!(matches!(
        b.s.load_device_state(&st, &b.mem, &b.shm),
        Err(crate::vm::migration::MigrationError::NotEmpty)
    ));
}
