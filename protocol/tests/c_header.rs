//! Checks the C header `include/vgpu_protocol.h` — the one C header of the wire format,
//! which the guest driver includes too — against the Rust definitions.
//!
//! Every `#define VGPU_NAME value` of the header must appear in the table built here from
//! the Rust constants (and every table entry in the header), with the same value. Where
//! the Rust side can be enumerated (kernels, error codes, method opcodes), the table is
//! generated from it, so adding a kernel, code or opcode in Rust without updating the
//! header fails this test. If a C compiler is available, the header is compiled together
//! with `offsetof`/`sizeof` assertions derived from the Rust encoders.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use vgpu_protocol::channel::{MAX_GP_ENTRIES, MIN_GP_ENTRIES};
use vgpu_protocol::device::{
    DeviceConfig, APERTURE_OFFSET, APERTURE_SIZE, CHANNEL_SLOTS, CONTROL_QUEUE, EVENT_QUEUE,
    NO_SLOT, NUM_QUEUES, SHM_REGION_ID, SHM_SIZE, VIRTIO_ID_VGPU, VIRTIO_VGPU_F_FORWARDED,
};
use vgpu_protocol::gp::{GPU_VA_LIMIT, GP_ENTRY_SIZE, MAX_PB_WORDS};
use vgpu_protocol::kernel::{fnv1a64, FNV_OFFSET, MAX_DIM, MAX_KERNEL_BYTES, MAX_SPIN_NS};
use vgpu_protocol::method::{op, MethodError, MAX_GRID_THREADS, SEM_RELEASE_TIMESTAMP};
use vgpu_protocol::request::{
    self as req, event, EVENT_SIZE, HEADER_SIZE, MAP_READ_ONLY, MAX_REPLY_SIZE, MAX_REQUEST_SIZE,
    MAX_SG_ENTRIES, PAGE_4K, REPLY_HEADER_SIZE,
};
use vgpu_protocol::{
    ControlPage, ErrorCode, GpEntry, KernelArgs, KernelId, Method, SemaphoreMode, PAGE_SIZE,
    PROTOCOL_VERSION,
};

/// The only define allowed without a value.
const INCLUDE_GUARD: &str = "VGPU_PROTOCOL_H";

fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("include")
}

fn header_text() -> String {
    let path = include_dir().join("vgpu_protocol.h");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Parses an integer literal as C writes it: decimal or `0x` hex, optional `u`/`l`
/// suffixes, optionally in parentheses.
fn parse_c_int(s: &str) -> Option<u64> {
    let s = s.trim();
    let s = s
        .strip_prefix('(')
        .and_then(|s| s.strip_suffix(')'))
        .unwrap_or(s)
        .trim();
    let s = s.trim_end_matches(['u', 'U', 'l', 'L']);
    if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u64::from_str_radix(hex, 16).ok()
    } else if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        s.parse().ok()
    } else {
        None
    }
}

/// Every `VGPU_` define of the header with its value. Panics on anything this test cannot
/// check: function-like or multi-line macros, non-literal values, duplicates.
fn parse_header(text: &str) -> BTreeMap<String, u64> {
    let mut defines = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let n = n + 1;
        let Some(rest) = line.trim_start().strip_prefix("#define") else {
            continue;
        };
        let rest = rest.trim_start();
        let name_end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        let (name, value) = rest.split_at(name_end);
        if !name.starts_with("VGPU_") {
            continue;
        }
        assert!(
            !value.starts_with('('),
            "line {n}: function-like macro {name} cannot be checked"
        );
        let value = value
            .split("/*")
            .next()
            .and_then(|v| v.split("//").next())
            .unwrap_or("")
            .trim();
        assert!(!value.ends_with('\\'), "line {n}: multi-line define {name}");
        if value.is_empty() {
            assert_eq!(name, INCLUDE_GUARD, "line {n}: define {name} has no value");
            continue;
        }
        let v = parse_c_int(value)
            .unwrap_or_else(|| panic!("line {n}: value of {name} is not an integer: {value:?}"));
        assert!(
            defines.insert(name.to_string(), v).is_none(),
            "line {n}: {name} defined twice"
        );
    }
    defines
}

/// `InvalidArgument` → `INVALID_ARGUMENT`.
fn upper_snake(camel: &str) -> String {
    let mut out = String::new();
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// Every opcode the decoder accepts with its argument count, found by asking the decoder
/// (a header claiming 255 arguments is refused with the opcode's real count).
fn opcodes_from_decoder() -> BTreeMap<u8, u64> {
    let mut found = BTreeMap::new();
    for opcode in 0..=u8::MAX {
        let words = [opcode as u32 | 0xff << 8];
        match Method::decode(&words, 0) {
            Err(MethodError::UnknownOpcode { .. }) => {}
            Err(MethodError::WrongArgCount { expected, .. }) => {
                found.insert(opcode, expected as u64);
            }
            other => panic!("opcode {opcode:#x}: unexpected decode result {other:?}"),
        }
    }
    found
}

/// The header-word bits the decoder requires to be zero.
fn reserved_header_bits() -> u64 {
    (0..32)
        .filter(|bit| {
            matches!(
                Method::decode(&[1u32 << bit, 0, 0, 0, 0, 0, 0, 0], 0),
                Err(MethodError::ReservedBits { .. })
            )
        })
        .fold(0u64, |m, bit| m | 1 << bit)
}

/// (name, value) for every define the header must have, from the Rust code.
fn expected_defines() -> Vec<(String, u64)> {
    let mut t: Vec<(String, u64)> = Vec::new();
    let mut add = |name: &str, v: u64| t.push((name.to_string(), v));

    add("VGPU_PROTOCOL_VERSION", PROTOCOL_VERSION.into());
    add("VGPU_PAGE_SIZE", PAGE_SIZE);

    for (name, off) in [
        ("GP_PUT", ControlPage::GP_PUT),
        ("GP_GET", ControlPage::GP_GET),
        ("REF", ControlPage::REF),
        ("ERROR", ControlPage::ERROR),
        ("VERSION", ControlPage::VERSION),
        ("GP_ENTRIES", ControlPage::GP_ENTRIES),
        ("NOTIFY_SEQ", ControlPage::NOTIFY_SEQ),
        ("WANT_DOORBELL", ControlPage::WANT_DOORBELL),
        ("ERROR_INFO", ControlPage::ERROR_INFO),
        ("REF_WAKE", ControlPage::REF_WAKE),
        ("REF_WAKE_ARMED", ControlPage::REF_WAKE_ARMED),
        ("USED_BYTES", ControlPage::USED_BYTES),
    ] {
        add(&format!("VGPU_CTRL_{name}"), off as u64);
    }

    add("VGPU_GP_ENTRY_SIZE", GP_ENTRY_SIZE as u64);
    add("VGPU_MIN_GP_ENTRIES", MIN_GP_ENTRIES.into());
    add("VGPU_MAX_GP_ENTRIES", MAX_GP_ENTRIES.into());
    add("VGPU_MAX_PB_WORDS", MAX_PB_WORDS.into());
    add("VGPU_GPU_VA_LIMIT", GPU_VA_LIMIT);

    // Header word layout, as the encoder writes it and the decoder enforces it.
    let mut words = Vec::new();
    Method::SetRef { value: 0 }.encode_into(&mut words);
    let args_shift = (words[0] ^ op::SET_REF as u32).trailing_zeros() as u64;
    let reserved = reserved_header_bits();
    let opcode_mask = (1u64 << args_shift) - 1;
    assert_eq!(opcode_mask, u8::MAX as u64, "opcodes are bytes");
    add("VGPU_METHOD_OPCODE_MASK", opcode_mask);
    add("VGPU_METHOD_ARGS_SHIFT", args_shift);
    add(
        "VGPU_METHOD_ARGS_MASK",
        (!reserved & 0xffff_ffff) >> args_shift,
    );
    add("VGPU_METHOD_RESERVED_MASK", reserved);

    let named = [
        ("NOP", op::NOP),
        ("LAUNCH", op::LAUNCH),
        ("COPY", op::COPY),
        ("SEM_RELEASE", op::SEM_RELEASE),
        ("SEM_ACQUIRE", op::SEM_ACQUIRE),
        ("SET_REF", op::SET_REF),
        ("NOTIFY", op::NOTIFY),
        ("LAUNCH_FUNCTION", op::LAUNCH_FUNCTION),
    ];
    let decoded = opcodes_from_decoder();
    assert_eq!(
        decoded.keys().copied().collect::<Vec<_>>(),
        named.iter().map(|&(_, o)| o).collect::<Vec<_>>(),
        "the decoder accepts opcodes this test does not name"
    );
    for (name, opcode) in named {
        add(&format!("VGPU_METHOD_{name}"), opcode.into());
        add(&format!("VGPU_METHOD_{name}_ARGS"), decoded[&opcode]);
    }

    add("VGPU_SEM_RELEASE_TIMESTAMP", SEM_RELEASE_TIMESTAMP.into());
    add("VGPU_SEM_ACQUIRE_EQUAL", SemaphoreMode::Equal as u64);
    add("VGPU_SEM_ACQUIRE_AT_LEAST", SemaphoreMode::AtLeast as u64);
    add("VGPU_MAX_GRID_THREADS", MAX_GRID_THREADS);

    for k in KernelId::ALL {
        let name = k.name().to_uppercase();
        add(&format!("VGPU_KERNEL_{name}"), k as u64);
        add(
            &format!("VGPU_KERNEL_{name}_ARGS_SIZE"),
            KernelArgs::encoded_len(k) as u64,
        );
    }
    add("VGPU_KERNEL_COUNT", KernelId::ALL.len() as u64);
    add("VGPU_MAX_SPIN_NS", MAX_SPIN_NS);
    add("VGPU_MAX_KERNEL_BYTES", MAX_KERNEL_BYTES);
    add("VGPU_MAX_DIM", MAX_DIM.into());
    add("VGPU_FNV1A64_OFFSET", FNV_OFFSET);
    // One step over the byte 1 from h = 0 leaves exactly the prime.
    add("VGPU_FNV1A64_PRIME", fnv1a64(&[1], 0));

    for code in ErrorCode::ALL {
        let name = upper_snake(&format!("{code:?}"));
        add(&format!("VGPU_ERR_{name}"), code.as_u32().into());
    }
    add("VGPU_ERR_COUNT", ErrorCode::ALL.len() as u64);

    // The virtio device, control requests and events.
    add("VGPU_VIRTIO_ID", VIRTIO_ID_VGPU.into());
    add("VGPU_CONTROL_QUEUE", CONTROL_QUEUE as u64);
    add("VGPU_EVENT_QUEUE", EVENT_QUEUE as u64);
    add("VGPU_NUM_QUEUES", NUM_QUEUES as u64);
    add("VGPU_SHM_REGION_ID", SHM_REGION_ID.into());
    add("VGPU_CHANNEL_SLOTS", CHANNEL_SLOTS.into());
    add("VGPU_APERTURE_OFFSET", APERTURE_OFFSET);
    add("VGPU_APERTURE_SIZE", APERTURE_SIZE);
    add("VGPU_SHM_SIZE", SHM_SIZE);
    add("VGPU_F_FORWARDED", VIRTIO_VGPU_F_FORWARDED.into());
    add("VGPU_NO_SLOT", NO_SLOT.into());
    for (name, opcode) in [
        ("GET_INFO", req::op::GET_INFO),
        ("CREATE_CONTEXT", req::op::CREATE_CONTEXT),
        ("DESTROY_CONTEXT", req::op::DESTROY_CONTEXT),
        ("ALLOC_VRAM", req::op::ALLOC_VRAM),
        ("FREE_MEM", req::op::FREE_MEM),
        ("MAP_VRAM", req::op::MAP_VRAM),
        ("MAP_GUEST", req::op::MAP_GUEST),
        ("UNMAP", req::op::UNMAP),
        ("MAP_APERTURE", req::op::MAP_APERTURE),
        ("UNMAP_APERTURE", req::op::UNMAP_APERTURE),
        ("CREATE_CHANNEL", req::op::CREATE_CHANNEL),
        ("DESTROY_CHANNEL", req::op::DESTROY_CHANNEL),
        ("GET_STATS", req::op::GET_STATS),
        ("SUBMIT", req::op::SUBMIT),
        ("CHANNEL_STATUS", req::op::CHANNEL_STATUS),
        ("MODULE_LOAD", req::op::MODULE_LOAD),
        ("MODULE_UNLOAD", req::op::MODULE_UNLOAD),
        ("FUNCTION_GET", req::op::FUNCTION_GET),
        ("GLOBAL_GET", req::op::GLOBAL_GET),
        ("GET_ATTRIBUTES", req::op::GET_ATTRIBUTES),
        ("GLOBAL_WRITE", req::op::GLOBAL_WRITE),
        ("GLOBAL_READ", req::op::GLOBAL_READ),
    ] {
        add(&format!("VGPU_OP_{name}"), opcode as u64);
    }
    add("VGPU_REQ_HEADER_SIZE", HEADER_SIZE as u64);
    add("VGPU_REPLY_HEADER_SIZE", REPLY_HEADER_SIZE as u64);
    add("VGPU_MAX_SG_ENTRIES", MAX_SG_ENTRIES as u64);
    add("VGPU_MAX_REQUEST_SIZE", MAX_REQUEST_SIZE as u64);
    add("VGPU_MAX_REPLY_SIZE", MAX_REPLY_SIZE as u64);
    add("VGPU_MAX_GLOBAL_COPY_BYTES", req::MAX_GLOBAL_COPY_BYTES);
    add(
        "VGPU_MAX_GLOBAL_COPY_RANGES",
        req::MAX_GLOBAL_COPY_RANGES as u64,
    );
    add("VGPU_WIRE_PAGE_4K", PAGE_4K as u64);
    add("VGPU_WIRE_MAP_READ_ONLY", MAP_READ_ONLY as u64);
    add("VGPU_EVENT_NOTIFY", event::NOTIFY as u64);
    add("VGPU_EVENT_CHANNEL_ERROR", event::CHANNEL_ERROR as u64);
    add("VGPU_EVENT_FENCE", event::FENCE as u64);
    add("VGPU_EVENT_SIZE", EVENT_SIZE as u64);

    // Guest modules (issue 31).
    use vgpu_protocol::module as m;
    add("VGPU_MAX_MODULE_BYTES", m::MAX_MODULE_BYTES);
    add(
        "VGPU_MAX_MODULES_PER_CONTEXT",
        m::MAX_MODULES_PER_CONTEXT as u64,
    );
    add("VGPU_MAX_SYMBOL_LEN", m::MAX_SYMBOL_LEN as u64);
    add("VGPU_MAX_FUNCTION_PARAMS", m::MAX_FUNCTION_PARAMS as u64);
    add("VGPU_MAX_ATTRIBUTES", req::MAX_ATTRIBUTES as u64);
    add("VGPU_PARAMS_UNKNOWN", m::PARAMS_UNKNOWN.into());
    add("VGPU_MAX_PARAM_BYTES", m::MAX_PARAM_BYTES.into());
    add("VGPU_MAX_RELOCS", m::MAX_RELOCS.into());
    add(
        "VGPU_RELOC_WORDS",
        vgpu_protocol::method::RELOC_WORDS as u64,
    );
    add("VGPU_RELOC_WRITE", m::RELOC_WRITE.into());
    add("VGPU_MAX_SHARED_MEM", m::MAX_SHARED_MEM.into());
    t
}

/// The CHANNEL_STATUS reply body's size, from the Rust encoder.
fn channel_status_size() -> usize {
    let reply = req::encode_reply(Ok(req::ReplyBody::ChannelStatus(Default::default())));
    reply.len() - REPLY_HEADER_SIZE
}

#[test]
fn header_defines_match_rust() {
    let header = parse_header(&header_text());
    let expected = expected_defines();
    let mut problems = Vec::new();
    let mut seen = BTreeMap::new();
    for (name, want) in &expected {
        if let Some(prev) = seen.insert(name.clone(), *want) {
            problems.push(format!("test table names {name} twice ({prev}, {want})"));
        }
        match header.get(name) {
            None => problems.push(format!("{name} missing from the header (Rust: {want:#x})")),
            Some(got) if got != want => {
                problems.push(format!("{name}: header {got:#x}, Rust {want:#x}"))
            }
            Some(_) => {}
        }
    }
    for name in header.keys() {
        if !seen.contains_key(name) {
            problems.push(format!(
                "{name} is in the header but not checked against Rust"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "C header drift:\n{}",
        problems.join("\n")
    );
}

#[test]
fn parser_reads_c_literals() {
    assert_eq!(parse_c_int("0x00010000"), Some(0x1_0000));
    assert_eq!(parse_c_int("0xcbf29ce484222325ULL"), Some(FNV_OFFSET));
    assert_eq!(parse_c_int("(60000000000ULL)"), Some(60_000_000_000));
    assert_eq!(parse_c_int("4096"), Some(4096));
    assert_eq!(parse_c_int("1 << 16"), None);
    assert_eq!(parse_c_int("FOO"), None);
    let d = parse_header("#define VGPU_A 0x10 /* c */\n#define VGPU_B 7 // c\n#define OTHER 1\n");
    assert_eq!(
        d.into_iter().collect::<Vec<_>>(),
        [("VGPU_A".into(), 16), ("VGPU_B".into(), 7)]
    );
}

#[test]
#[should_panic(expected = "function-like")]
fn parser_refuses_function_like_macros() {
    parse_header("#define VGPU_F(x) ((x) + 1)\n");
}

/// Marker values whose little-endian bytes are unique within one encoded block.
fn m64(i: u64) -> u64 {
    0xf0e1_d2c3_b4a5_9600 + i
}
fn m32(i: u32) -> u32 {
    // A normal f32 (about 0.5), so float fields can carry it unchanged.
    0x3f00_7700 + i
}
fn f(i: u32) -> f32 {
    f32::from_bits(m32(i))
}

enum Marker {
    U64(u64),
    U32(u32),
}

/// The C struct of one encoded block: its name, encoded bytes and named fields.
struct Layout {
    c_struct: &'static str,
    bytes: Vec<u8>,
    fields: Vec<(&'static str, Marker)>,
}

fn kernel_layout(k: KernelId) -> Option<Layout> {
    use Marker::{U32, U64};
    let (c_struct, args, fields): (_, _, Vec<(&'static str, Marker)>) = match k {
        KernelId::Empty => return None,
        KernelId::Spin => (
            "vgpu_spin_args",
            KernelArgs::Spin { ns: m64(0) },
            vec![("ns", U64(m64(0)))],
        ),
        KernelId::Memset => (
            "vgpu_memset_args",
            KernelArgs::Memset {
                dst: m64(0),
                len: m64(1),
                pattern: m32(0),
            },
            vec![
                ("dst", U64(m64(0))),
                ("len", U64(m64(1))),
                ("pattern", U32(m32(0))),
            ],
        ),
        KernelId::Memcpy => (
            "vgpu_memcpy_args",
            KernelArgs::Memcpy {
                dst: m64(0),
                src: m64(1),
                len: m64(2),
            },
            vec![
                ("dst", U64(m64(0))),
                ("src", U64(m64(1))),
                ("len", U64(m64(2))),
            ],
        ),
        KernelId::Saxpy => (
            "vgpu_saxpy_args",
            KernelArgs::Saxpy {
                x: m64(0),
                y: m64(1),
                n: m64(2),
                a: f(0),
            },
            vec![
                ("x", U64(m64(0))),
                ("y", U64(m64(1))),
                ("n", U64(m64(2))),
                ("a", U32(m32(0))),
            ],
        ),
        KernelId::Sgemm => (
            "vgpu_sgemm_args",
            KernelArgs::Sgemm {
                a: m64(0),
                b: m64(1),
                c: m64(2),
                m: m32(0),
                n: m32(1),
                k: m32(2),
                alpha: f(3),
                beta: f(4),
            },
            vec![
                ("a", U64(m64(0))),
                ("b", U64(m64(1))),
                ("c", U64(m64(2))),
                ("m", U32(m32(0))),
                ("n", U32(m32(1))),
                ("k", U32(m32(2))),
                ("alpha", U32(m32(3))),
                ("beta", U32(m32(4))),
            ],
        ),
        KernelId::ReduceSum => (
            "vgpu_reduce_sum_args",
            KernelArgs::ReduceSum {
                src: m64(0),
                n: m64(1),
                dst: m64(2),
            },
            vec![
                ("src", U64(m64(0))),
                ("n", U64(m64(1))),
                ("dst", U64(m64(2))),
            ],
        ),
        KernelId::Checksum => (
            "vgpu_checksum_args",
            KernelArgs::Checksum {
                src: m64(0),
                len: m64(1),
                dst: m64(2),
            },
            vec![
                ("src", U64(m64(0))),
                ("len", U64(m64(1))),
                ("dst", U64(m64(2))),
            ],
        ),
        KernelId::Stencil2d => (
            "vgpu_stencil2d_args",
            KernelArgs::Stencil2d {
                src: m64(0),
                dst: m64(1),
                width: m32(0),
                height: m32(1),
                c_center: f(2),
                c_neighbor: f(3),
            },
            vec![
                ("src", U64(m64(0))),
                ("dst", U64(m64(1))),
                ("width", U32(m32(0))),
                ("height", U32(m32(1))),
                ("c_center", U32(m32(2))),
                ("c_neighbor", U32(m32(3))),
            ],
        ),
        KernelId::Timestamp => (
            "vgpu_timestamp_args",
            KernelArgs::Timestamp { dst: m64(0) },
            vec![("dst", U64(m64(0)))],
        ),
    };
    Some(Layout {
        c_struct,
        bytes: args.encode(),
        fields,
    })
}

fn gp_entry_layout() -> Layout {
    let e = GpEntry {
        pb_va: m64(0),
        len_words: m32(0),
    };
    Layout {
        c_struct: "vgpu_gp_entry",
        bytes: e.encode().to_vec(),
        fields: vec![
            ("pb_va", Marker::U64(m64(0))),
            ("len_words", Marker::U32(m32(0))),
        ],
    }
}

/// `(field, offset)` for each marked field, plus a zero-filled 4-byte `reserved`/`flags`
/// field for the one gap the markers leave (if any).
fn field_offsets(l: &Layout) -> Vec<(&'static str, usize)> {
    let mut covered = vec![false; l.bytes.len()];
    let mut out = Vec::new();
    for (name, marker) in &l.fields {
        let needle = match marker {
            Marker::U64(v) => v.to_le_bytes().to_vec(),
            Marker::U32(v) => v.to_le_bytes().to_vec(),
        };
        let hits: Vec<usize> = l
            .bytes
            .windows(needle.len())
            .enumerate()
            .filter(|(_, w)| *w == needle.as_slice())
            .map(|(i, _)| i)
            .collect();
        assert_eq!(
            hits.len(),
            1,
            "{}.{name}: marker found {hits:?}",
            l.c_struct
        );
        covered[hits[0]..hits[0] + needle.len()].fill(true);
        out.push((*name, hits[0]));
    }
    let gap: Vec<usize> = (0..l.bytes.len()).filter(|&i| !covered[i]).collect();
    if !gap.is_empty() {
        assert_eq!(gap.len(), 4, "{}: unexpected gap {gap:?}", l.c_struct);
        assert_eq!(gap[3] - gap[0], 3, "{}: gap not contiguous", l.c_struct);
        assert!(gap.iter().all(|&i| l.bytes[i] == 0), "{}: gap", l.c_struct);
        let name = if l.c_struct == "vgpu_gp_entry" {
            "flags"
        } else {
            "reserved"
        };
        out.push((name, gap[0]));
    }
    out
}

/// C assertions tying the header's structs to the Rust encoders.
fn layout_asserts() -> String {
    let mut layouts = vec![gp_entry_layout()];
    for k in KernelId::ALL {
        match kernel_layout(k) {
            Some(l) => {
                assert_eq!(l.bytes.len(), KernelArgs::encoded_len(k));
                layouts.push(l);
            }
            None => assert_eq!(KernelArgs::encoded_len(k), 0, "{k:?} needs a C struct"),
        }
    }
    let mut c = String::from("#include \"vgpu_protocol.h\"\n\n");
    for l in &layouts {
        let s = l.c_struct;
        c += &format!(
            "_Static_assert(sizeof(struct {s}) == {}, \"sizeof {s}\");\n",
            l.bytes.len()
        );
        for (field, off) in field_offsets(l) {
            c += &format!(
                "_Static_assert(offsetof(struct {s}, {field}) == {off}, \"{s}.{field}\");\n"
            );
        }
    }
    // The device's wire structs (the guest driver builds them by hand).
    for (name, size) in [
        ("vgpu_virtio_config", DeviceConfig::SIZE),
        ("vgpu_req_header", HEADER_SIZE),
        ("vgpu_reply_header", REPLY_HEADER_SIZE),
        ("vgpu_sg_range", 16),
        ("vgpu_wire_event", EVENT_SIZE),
        ("vgpu_wire_channel_status", channel_status_size()),
    ] {
        c += &format!("_Static_assert(sizeof(struct {name}) == {size}, \"sizeof {name}\");\n");
    }
    c += "\nint vgpu_header_check(void);\nint vgpu_header_check(void) { return 0; }\n";
    c
}

#[test]
fn layouts_are_derived_consistently() {
    // Runs without a compiler: the marker search itself must succeed for every block.
    let c = layout_asserts();
    assert!(
        c.contains("offsetof(struct vgpu_sgemm_args, k) == 32"),
        "{c}"
    );
    assert!(
        c.contains("offsetof(struct vgpu_gp_entry, flags) == 12"),
        "{c}"
    );
    assert!(
        c.contains("offsetof(struct vgpu_saxpy_args, reserved) == 28"),
        "{c}"
    );
}

#[test]
fn header_compiles_with_layout_asserts() {
    if Command::new("cc").arg("--version").output().is_err() {
        println!("note: no `cc` found; skipping the C compile check of vgpu_protocol.h");
        return;
    }
    let dir = std::env::temp_dir().join(format!("vgpu_c_header_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("check.c");
    std::fs::write(&src, layout_asserts()).unwrap();
    let out = Command::new("cc")
        .args([
            "-fsyntax-only",
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Wpedantic",
            "-Werror",
        ])
        .arg("-I")
        .arg(include_dir())
        .arg(&src)
        .output()
        .expect("running cc");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "cc rejected the header:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
