use proptest::prelude::*;

use super::*;
use crate::message::{Command, Event, Reply, Resume, Target};
use crate::{WireError, HEADER_LEN};

const GIB: u64 = 1 << 30;

fn every_command() -> Vec<Command> {
    vec![
        Command::Hello { worker: 7 },
        Command::AddGuestRegion {
            gpa: GIB,
            len: 256 << 20,
            fd_offset: 0,
        },
        Command::ClearGuestRegions,
        Command::CopyBuffer { len: 4 * GIB },
        Command::CreateContext { ctx: 3 },
        Command::DestroyContext { ctx: 3 },
        Command::AllocVram {
            size: 2 << 20,
            align: 2 << 20,
        },
        Command::FreeVram { offset: 64 << 20 },
        Command::VramFree,
        Command::Map {
            ctx: 3,
            va: 0x4000_0000,
            size: 4 << 20,
            target: Target::Vram { offset: 2 << 20 },
            page: PageSize::Huge2M,
            read_only: true,
        },
        Command::Map {
            ctx: 3,
            va: 0x1000,
            size: 0x3000,
            target: Target::Sysram { addr: 0x8000 },
            page: PageSize::Small4K,
            read_only: false,
        },
        Command::Unmap {
            ctx: 3,
            va: 0x1000,
            size: 0x3000,
        },
        Command::Remap {
            ctx: 3,
            va: 0x4000_0000,
            size: 2 << 20,
            target: Target::Sysram { addr: GIB },
        },
        Command::InvalidateTlb { ctx: 3 },
        Command::PageTableBytes { ctx: 3 },
        Command::MapCost {
            ctx: 3,
            va: 0x1234,
            size: 5,
            page: PageSize::Big64K,
        },
        Command::SysramHint {
            ctx: 3,
            addr: GIB,
            len: 2 << 20,
            prepare: true,
        },
        Command::CreateChannel {
            ctx: 3,
            ch: 9,
            gp_ring_va: 0x10_0000,
            gp_entries: 256,
            resume: None,
        },
        Command::CreateChannel {
            ctx: 3,
            ch: 10,
            gp_ring_va: 0x20_0000,
            gp_entries: 1024,
            resume: Some(Resume {
                gp_get: 77,
                reference: 5,
                notify_seq: 2,
                error: Some((ErrorCode::MmuFault, 0xdead_0000)),
            }),
        },
        Command::DestroyChannel { ch: 9 },
        Command::KillChannel {
            ch: 9,
            code: ErrorCode::WatchdogKilled,
        },
        Command::Doorbell { ch: 10 },
        Command::HoldFetch { ch: 10, hold: true },
        Command::HoldFetch {
            ch: 11,
            hold: false,
        },
        Command::FetchedDone { ch: 12 },
        Command::Copy {
            vram_offset: 2 << 20,
            buf_offset: 6 << 20,
            len: 100,
            to_vram: false,
        },
        Command::Shutdown,
        Command::ModuleLoad {
            ctx: 3,
            module: 1,
            len: 32 << 20,
        },
        Command::ModuleUnload { ctx: 3, module: 1 },
        Command::FunctionGet {
            ctx: 3,
            module: 1,
            function: 4,
            name: b"_Z4vaddPjS_S_j".to_vec(),
        },
        Command::GlobalGet {
            ctx: 3,
            module: 1,
            name: vec![b'g'; vgpu_protocol::module::MAX_SYMBOL_LEN],
        },
        Command::VariableCopy {
            ctx: 3,
            module: 1,
            name: b"table".to_vec(),
            offset: 8 << 20,
            len: 4096,
            to_variable: true,
        },
    ]
}

fn fds_of(frame: &[u8]) -> u8 {
    frame[14]
}

#[test]
fn every_command_round_trips_with_its_fds() {
    for (seq, c) in every_command().into_iter().enumerate() {
        let f = encode_command(seq as u32, &c);
        assert_eq!(
            decode_command(&f, fds_of(&f)),
            Ok((seq as u32, c.clone())),
            "{c:?}"
        );
    }
    // A module image comes with its memfd.
    let f = encode_command(
        1,
        &Command::ModuleLoad {
            ctx: 1,
            module: 2,
            len: 100,
        },
    );
    assert_eq!(fds_of(&f), 1);
    // The ones that carry a memfd say so in the header.
    let f = encode_command(1, &Command::CopyBuffer { len: 4096 });
    assert_eq!(fds_of(&f), 1);
    let f = encode_command(1, &Command::Shutdown);
    assert_eq!(fds_of(&f), 0);
}

#[test]
fn every_reply_round_trips() {
    let replies = [
        Reply::Ok,
        Reply::Hello {
            vram_bytes: 80 * GIB,
            max_channels: 256,
            max_contexts: 64,
            compute_engines: 1,
            control_pages_len: 256 * 4096,
            counters_len: crate::counters::page_len(256),
            attributes: vec![(75, 9), (16, 132), (8, -1)],
        },
        Reply::Vram {
            offset: 4 << 20,
            len: 2 << 20,
        },
        Reply::Bytes { n: 12345 },
        Reply::Channel { slot: 17 },
        Reply::Error {
            code: ErrorCode::NoMemory,
        },
        Reply::Function { params: None },
        Reply::Function {
            params: Some(
                (0..vgpu_protocol::module::MAX_FUNCTION_PARAMS as u32)
                    .map(|i| vgpu_protocol::module::ParamInfo {
                        offset: i * 8,
                        size: 8,
                    })
                    .collect(),
            ),
        },
        Reply::Global {
            addr: 0x7f00_0000_1000,
            size: 4,
        },
    ];
    for (seq, r) in replies.iter().enumerate() {
        let f = encode_reply(seq as u32, r);
        assert_eq!(
            decode_reply(&f, fds_of(&f)),
            Ok((seq as u32, r.clone())),
            "{r:?}"
        );
    }
    // The Hello reply brings the control pages and the counters page.
    assert_eq!(fds_of(&encode_reply(0, &replies[1])), 2);
}

#[test]
fn every_event_round_trips_and_a_fault_names_an_error() {
    let events = [
        Event::Notify { ch: 4, token: 99 },
        Event::Fence {
            ch: 4,
            reference: 0xffff_fffe,
        },
        Event::Error {
            ch: 4,
            code: ErrorCode::MmuFault,
            info: 0xdead_beef,
        },
    ];
    for (seq, e) in events.into_iter().enumerate() {
        let f = encode_event(seq as u32, &e);
        assert_eq!(decode_event(&f, 0), Ok((seq as u32, e)), "{e:?}");
        assert!(matches!(decode_event(&f, 1), Err(WireError::Fds { .. })));
    }
    let f = encode_event(
        1,
        &Event::Error {
            ch: 1,
            code: ErrorCode::Ok,
            info: 0,
        },
    );
    assert_eq!(decode_event(&f, 0), Err(WireError::Field("code")));
    // A command is not an event.
    let c = encode_command(1, &Command::Shutdown);
    assert!(matches!(decode_event(&c, 0), Err(WireError::Kind(_))));
}

#[test]
fn a_hello_whose_pages_do_not_fit_its_slots_is_refused() {
    let lie = |max_channels, control_pages_len, counters_len| Reply::Hello {
        vram_bytes: GIB,
        max_channels,
        max_contexts: 1,
        compute_engines: 1,
        control_pages_len,
        counters_len,
        attributes: Vec::new(),
    };
    for r in [
        lie(256, 4096, crate::counters::page_len(256)),
        lie(256, 256 * 4096, 4096 * 64),
        lie(0, 4096, 4096),
        lie(
            1 << 20,
            (1 << 20) * 4096,
            crate::counters::page_len(1 << 20),
        ),
    ] {
        let f = encode_reply(1, &r);
        assert!(
            matches!(decode_reply(&f, 2), Err(WireError::Field(_))),
            "accepted {r:?}"
        );
    }
}

#[test]
fn frames_that_lie_are_refused() {
    let good = encode_command(5, &Command::FreeVram { offset: 0 });
    // Too short for a header; bad magic; another version.
    assert_eq!(decode_command(&good[..10], 0), Err(WireError::Short(10)));
    let mut f = good.clone();
    f[0] ^= 1;
    assert!(matches!(decode_command(&f, 0), Err(WireError::Magic(_))));
    let mut f = good.clone();
    f[4] = 9;
    assert_eq!(decode_command(&f, 0), Err(WireError::Version(9)));
    // Truncated and padded payloads.
    assert!(matches!(
        decode_command(&good[..good.len() - 1], 0),
        Err(WireError::Length { .. })
    ));
    let mut f = good.clone();
    f.push(0);
    assert!(matches!(
        decode_command(&f, 0),
        Err(WireError::Length { .. })
    ));
    // A header that agrees with a payload one byte too long for the kind.
    let mut f = good.clone();
    f.push(0);
    f[12] += 1;
    assert!(matches!(
        decode_command(&f, 0),
        Err(WireError::PayloadSize { .. })
    ));
    // Fds: a command that carries none, sent with one; one that needs one, sent without.
    assert!(matches!(
        decode_command(&good, 1),
        Err(WireError::Fds { .. })
    ));
    let f = encode_command(1, &Command::CopyBuffer { len: GIB });
    assert!(matches!(decode_command(&f, 0), Err(WireError::Fds { .. })));
    // An unknown kind, and a reply decoded as a command.
    let mut f = good.clone();
    f[6] = 0x7f;
    assert_eq!(decode_command(&f, 0), Err(WireError::Kind(0x7f)));
    let r = encode_reply(1, &Reply::Ok);
    assert_eq!(decode_command(&r, 0), Err(WireError::Kind(0x100)));
}

#[test]
fn fields_out_of_range_are_refused() {
    let bad = [
        Command::CopyBuffer { len: 0 },
        Command::CopyBuffer { len: 4097 },
        Command::AddGuestRegion {
            gpa: !4095,
            len: 8192,
            fd_offset: 0,
        },
        Command::CopyBuffer { len: 2 << 40 },
        Command::SysramHint {
            ctx: 0,
            addr: 4095,
            len: 4096,
            prepare: false,
        },
        Command::AllocVram {
            size: 4096,
            align: 3 << 12,
        },
        Command::AllocVram {
            size: 4096,
            align: 1024,
        },
        Command::FreeVram { offset: 12 },
        Command::Map {
            ctx: 0,
            va: 0x1000,
            size: 2 << 20,
            target: Target::Vram { offset: 0 },
            page: PageSize::Huge2M,
            read_only: false,
        },
        Command::Map {
            ctx: 0,
            va: (1 << 48) - 4096,
            size: 8192,
            target: Target::Vram { offset: 0 },
            page: PageSize::Small4K,
            read_only: false,
        },
        Command::Unmap {
            ctx: 0,
            va: 0,
            size: 0,
        },
        Command::Remap {
            ctx: 0,
            va: 0,
            size: 4096,
            target: Target::Sysram { addr: 5 },
        },
        Command::CreateChannel {
            ctx: 0,
            ch: 0,
            gp_ring_va: 0x1000,
            gp_entries: 100,
            resume: None,
        },
        Command::CreateChannel {
            ctx: 0,
            ch: 0,
            gp_ring_va: 0x1008,
            gp_entries: 256,
            resume: None,
        },
        Command::Copy {
            vram_offset: 0,
            buf_offset: (1 << 40) - 4096,
            len: 8192,
            to_vram: true,
        },
        Command::Copy {
            vram_offset: 0,
            buf_offset: 0,
            len: 0,
            to_vram: true,
        },
        Command::ModuleLoad {
            ctx: 0,
            module: 1,
            len: 0,
        },
        Command::ModuleLoad {
            ctx: 0,
            module: 1,
            len: (32 << 20) + 1,
        },
        Command::FunctionGet {
            ctx: 0,
            module: 1,
            function: 1,
            name: Vec::new(),
        },
        Command::GlobalGet {
            ctx: 0,
            module: 1,
            name: b"with space".to_vec(),
        },
        Command::GlobalGet {
            ctx: 0,
            module: 1,
            name: vec![b'g'; vgpu_protocol::module::MAX_SYMBOL_LEN + 1],
        },
        Command::VariableCopy {
            ctx: 0,
            module: 1,
            name: b"g".to_vec(),
            offset: u64::MAX,
            len: 2,
            to_variable: false,
        },
    ];
    for c in bad {
        let f = encode_command(1, &c);
        assert!(
            matches!(decode_command(&f, fds_of(&f)), Err(WireError::Field(_))),
            "accepted {c:?}"
        );
    }
    // A parameter layout past the parameter buffer's limit, or longer than a reply's.
    for params in [
        vec![vgpu_protocol::module::ParamInfo {
            offset: 4092,
            size: 8,
        }],
        vec![vgpu_protocol::module::ParamInfo { offset: 0, size: 1 }; 129],
    ] {
        let f = encode_reply(
            1,
            &Reply::Function {
                params: Some(params),
            },
        );
        assert!(matches!(
            decode_reply(&f, fds_of(&f)),
            Err(WireError::Field(_))
        ));
    }
    // An error code or a flag byte no encoder writes.
    let mut f = encode_command(
        1,
        &Command::KillChannel {
            ch: 1,
            code: ErrorCode::Internal,
        },
    );
    f[HEADER_LEN + 4] = 200;
    assert_eq!(decode_command(&f, 0), Err(WireError::Field("code")));
    let mut f = encode_command(
        1,
        &Command::Copy {
            vram_offset: 0,
            buf_offset: 0,
            len: 4096,
            to_vram: true,
        },
    );
    let last = f.len() - 1;
    f[last] = 2;
    assert_eq!(decode_command(&f, 0), Err(WireError::Field("to_vram")));
}

proptest! {
    /// Whatever arrives, decoding returns (never panics), and what it accepts encodes
    /// back to the same bytes.
    #[test]
    fn any_bytes_decode_or_fail_cleanly(bytes in proptest::collection::vec(any::<u8>(), 0..300), fds in 0u8..3) {
        if let Ok((seq, c)) = decode_command(&bytes, fds) {
            prop_assert_eq!(encode_command(seq, &c), bytes.clone());
        }
        if let Ok((seq, r)) = decode_reply(&bytes, fds) {
            prop_assert_eq!(encode_reply(seq, &r), bytes.clone());
        }
        if let Ok((seq, e)) = decode_event(&bytes, fds) {
            prop_assert_eq!(encode_event(seq, &e), bytes);
        }
    }

    /// Valid frames with one byte changed still decode or fail cleanly.
    #[test]
    fn a_changed_byte_never_panics(i in 0usize..64, v in any::<u8>(), which in 0usize..21) {
        let cmds = every_command();
        let c = cmds[which % cmds.len()].clone();
        let mut f = encode_command(3, &c);
        let n = f.len();
        f[i % n] = v;
        let fds = fds_of(&f);
        let _ = decode_command(&f, fds);
    }
}
