use proptest::prelude::*;

use super::*;
use crate::message::{Command, Reply, Resume, Target};
use crate::{WireError, HEADER_LEN};

const GIB: u64 = 1 << 30;

fn every_command() -> Vec<Command> {
    vec![
        Command::Hello { worker: 7 },
        Command::ControlPages { len: 1 << 20 },
        Command::AddGuestRegion {
            gpa: GIB,
            len: 256 << 20,
            fd_offset: 0,
        },
        Command::SwapStore { len: 4 * GIB },
        Command::CreateContext { ctx: 3 },
        Command::DestroyContext { ctx: 3 },
        Command::AllocVram {
            size: 2 << 20,
            align: 2 << 20,
        },
        Command::FreeVram { offset: 64 << 20 },
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
        Command::CreateChannel {
            ctx: 3,
            ch: 9,
            slot: 4,
            gp_ring_va: 0x10_0000,
            gp_entries: 256,
            resume: None,
        },
        Command::CreateChannel {
            ctx: 3,
            ch: 10,
            slot: 5,
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
        Command::MoveChunk {
            vram_offset: 2 << 20,
            store_offset: 6 << 20,
            len: 2 << 20,
            to_vram: false,
        },
        Command::Pause,
        Command::Resume,
        Command::Shutdown,
    ]
}

fn fds_of(frame: &[u8]) -> u8 {
    frame[14]
}

#[test]
fn every_command_round_trips_with_its_fds() {
    for (seq, c) in every_command().into_iter().enumerate() {
        let f = encode_command(seq as u32, &c);
        assert_eq!(decode_command(&f, fds_of(&f)), Ok((seq as u32, c)), "{c:?}");
    }
    // The ones that carry a memfd say so in the header.
    let f = encode_command(1, &Command::ControlPages { len: 4096 });
    assert_eq!(fds_of(&f), 1);
    let f = encode_command(1, &Command::Pause);
    assert_eq!(fds_of(&f), 0);
}

#[test]
fn every_reply_round_trips() {
    let replies = [
        Reply::Ok,
        Reply::Hello {
            vram_bytes: 80 * GIB,
            aperture_len: 256 << 20,
        },
        Reply::Vram {
            offset: 4 << 20,
            len: 2 << 20,
        },
        Reply::Error {
            code: ErrorCode::NoMemory,
        },
    ];
    for (seq, r) in replies.into_iter().enumerate() {
        let f = encode_reply(seq as u32, &r);
        assert_eq!(decode_reply(&f, fds_of(&f)), Ok((seq as u32, r)), "{r:?}");
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
    let f = encode_command(1, &Command::SwapStore { len: GIB });
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
        Command::ControlPages { len: 0 },
        Command::ControlPages { len: 4097 },
        Command::AddGuestRegion {
            gpa: !4095,
            len: 8192,
            fd_offset: 0,
        },
        Command::SwapStore { len: 2 << 40 },
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
            slot: 0,
            gp_ring_va: 0x1000,
            gp_entries: 100,
            resume: None,
        },
        Command::CreateChannel {
            ctx: 0,
            ch: 0,
            slot: 0,
            gp_ring_va: 0x1008,
            gp_entries: 256,
            resume: None,
        },
        Command::MoveChunk {
            vram_offset: 0,
            store_offset: (1 << 40) - 4096,
            len: 8192,
            to_vram: true,
        },
    ];
    for c in bad {
        let f = encode_command(1, &c);
        assert!(
            matches!(decode_command(&f, fds_of(&f)), Err(WireError::Field(_))),
            "accepted {c:?}"
        );
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
        &Command::MoveChunk {
            vram_offset: 0,
            store_offset: 0,
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
            prop_assert_eq!(encode_reply(seq, &r), bytes);
        }
    }

    /// Valid frames with one byte changed still decode or fail cleanly.
    #[test]
    fn a_changed_byte_never_panics(i in 0usize..64, v in any::<u8>(), which in 0usize..21) {
        let cmds = every_command();
        let c = cmds[which % cmds.len()];
        let mut f = encode_command(3, &c);
        let n = f.len();
        f[i % n] = v;
        let fds = fds_of(&f);
        let _ = decode_command(&f, fds);
    }
}
