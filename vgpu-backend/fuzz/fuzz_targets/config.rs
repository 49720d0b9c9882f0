//! The daemon's TOML configuration (`config::FileConfig::parse` then `resolve`) fed either
//! arbitrary text or files assembled from every real section and key with values at and
//! around their limits (numbers, negatives, floats, strings, booleans, arrays). No input
//! may panic; a configuration that resolves holds only values inside the documented
//! ranges, VMs with valid unique names in file order, and resolves the same twice.
//!
//! Input: first byte even — the rest is the file's text (lossy UTF-8); odd — the rest is a
//! list of `[what, value]` byte pairs, each adding a section header or `key = value` line.
#![no_main]

use std::fmt::Write;
use std::path::Path;

use libfuzzer_sys::fuzz_target;
use vgpu_backend::config::{Config, FileConfig};
use vgpu_backend::sched::{MAX_WEIGHT, MIN_WEIGHT};

const MIB: u64 = 1 << 20;

const SECTIONS: &[&str] = &["", "[gpu]", "[api]", "[scheduler]", "[defaults]", "[[vm]]"];
const KEYS: &[&str] = &[
    "socket_dir",
    "model",
    "vram_mib",
    "compute_engines",
    "max_channels",
    "max_contexts",
    "socket",
    "policy",
    "interval_ms",
    "threshold_us",
    "unshadow_cap",
    "slice_ms",
    "sample_period_ms",
    "watchdog_ms",
    "charge_idle",
    "weight",
    "mapped_guest_mib",
    "swap_mib",
    "name",
    "unknown_key",
];
const VALUES: &[&str] = &[
    "0",
    "1",
    "2",
    "9",
    "10",
    "64",
    "65",
    "1000",
    "1001",
    "10000",
    "10001",
    "65536",
    "65537",
    "1048576",
    "1048577",
    "16777216",
    "16777217",
    "3600000",
    "4294967295",
    "4294967296",
    "18446744073709551615",
    "9223372036854775807",
    "-1",
    "1.5",
    "true",
    "false",
    "\"sim\"",
    "\"cuda\"",
    "\"cuda:1\"",
    "\"cuda:x\"",
    "\"none\"",
    "\"fair\"",
    "\"timeslice\"",
    "\"sampling\"",
    "\"vm0\"",
    "\"vm1\"",
    "\".hidden\"",
    "\"a b\"",
    "\"\"",
    "\"/tmp/vgpu\"",
    "[1, 2]",
    "{ a = 1 }",
];

/// A file from `[what, value]` pairs: `what` picks a section header or a key, `value` its
/// value.
fn assemble(pairs: &[u8]) -> String {
    let mut text = String::new();
    for p in pairs.chunks_exact(2) {
        let (what, value) = (p[0] as usize, p[1] as usize);
        if what % 4 == 0 {
            let _ = writeln!(text, "{}", SECTIONS[what / 4 % SECTIONS.len()]);
        } else {
            let _ = writeln!(
                text,
                "{} = {}",
                KEYS[what / 4 % KEYS.len()],
                VALUES[value % VALUES.len()]
            );
        }
    }
    text
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// What a resolved configuration promises.
fn check(file: &FileConfig, c: &Config) {
    let g = &c.gpu;
    assert!(g.vram_bytes >= MIB && g.vram_bytes <= (1 << 20) * MIB && g.vram_bytes % MIB == 0);
    assert!((1..=64).contains(&g.compute_engines));
    assert!((1..=65536).contains(&g.max_channels));
    assert!((1..=65536).contains(&g.max_contexts));
    assert!((1..=1000).contains(&c.scheduler.interval_ms));
    assert_eq!(c.vms.len(), file.vm.len());
    for (i, (vm, entry)) in c.vms.iter().zip(&file.vm).enumerate() {
        assert_eq!(vm.name, entry.name);
        assert!(valid_name(&vm.name), "invalid name {:?} accepted", vm.name);
        assert!(
            c.vms[..i].iter().all(|o| o.name != vm.name),
            "duplicate VM {:?} accepted",
            vm.name
        );
        assert!((MIN_WEIGHT..=MAX_WEIGHT).contains(&vm.weight));
        let l = &vm.limits;
        assert!(l.vram_bytes >= MIB || l.vram_bytes == g.vram_bytes);
        assert!(l.max_contexts >= 1 && l.max_channels >= 1 && l.mapped_guest_bytes >= MIB);
        assert!(!vm.socket.as_os_str().is_empty());
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let text = if mode % 2 == 0 {
        String::from_utf8_lossy(rest).into_owned()
    } else {
        assemble(rest)
    };
    let Ok(file) = FileConfig::parse(&text, Path::new("fuzz.toml")) else {
        return;
    };
    if let Ok(c) = file.resolve() {
        check(&file, &c);
        assert_eq!(file.resolve().ok(), Some(c), "resolve is not deterministic");
    }
});
