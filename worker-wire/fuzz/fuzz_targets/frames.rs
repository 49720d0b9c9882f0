//! Arbitrary frames (and fd counts) through both decoders: never a panic, and whatever
//! decodes encodes back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vgpu_worker_wire::{decode_command, decode_reply, encode_command, encode_reply};

fuzz_target!(|data: &[u8]| {
    let Some((&fds, frame)) = data.split_first() else {
        return;
    };
    let fds = fds % 4;
    if let Ok((seq, c)) = decode_command(frame, fds) {
        assert_eq!(encode_command(seq, &c), frame);
    }
    if let Ok((seq, r)) = decode_reply(frame, fds) {
        assert_eq!(encode_reply(seq, &r), frame);
    }
});
