//! Checks the Rust mirror of the `/dev/vgpu` ioctl ABI (`src/devvgpu/abi.rs`) against the
//! driver's header `guest-driver/kernel/vgpu_ioctl.h`: a C file of `_Static_assert`s
//! generated from the Rust side (sizes, field offsets, ioctl numbers, constants) must
//! compile with the header. Every ioctl the header defines must also be in the Rust table.
//! (The wire format's C header, `protocol/include/vgpu_protocol.h`, which the driver
//! includes too, is checked by `protocol/tests/c_header.rs`.)

use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

use vgpu_guest::devvgpu::abi;
use vgpu_protocol::request::{MAP_READ_ONLY, PAGE_2M, PAGE_4K, PAGE_64K};

fn kernel_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernel")
}

/// (C field, Rust offset) pairs of one struct.
type Fields = Vec<(&'static str, usize)>;

/// (C struct, size, fields) for every ioctl argument struct.
fn structs() -> Vec<(&'static str, usize, Fields)> {
    macro_rules! s {
        ($c:literal, $t:ty, [$($cf:literal => $rf:ident),* $(,)?]) => {
            ($c, size_of::<$t>(), vec![$(($cf, offset_of!($t, $rf))),*])
        };
    }
    vec![
        s!("vgpu_ioc_info", abi::Info, [
            "abi_version" => abi_version, "protocol_version" => protocol_version,
            "vram_bytes" => vram_bytes, "compute_engines" => compute_engines,
            "channel_slots" => channel_slots, "max_contexts" => max_contexts,
            "flags" => flags, "shm_size" => shm_size,
            "aperture_offset" => aperture_offset, "aperture_size" => aperture_size,
        ]),
        s!("vgpu_ioc_stats", abi::Stats, [
            "contexts" => contexts, "channels" => channels, "vram_bytes" => vram_bytes,
            "mapped_guest_bytes" => mapped_guest_bytes, "aperture_bytes" => aperture_bytes,
            "vram_limit" => vram_limit,
        ]),
        s!("vgpu_ioc_context", abi::ContextArg, ["ctx" => ctx, "huge_slot" => huge_slot]),
        s!("vgpu_ioc_alloc_vram", abi::AllocVram, [
            "ctx" => ctx, "mem" => mem, "size" => size, "align" => align,
            "alloc_size" => alloc_size,
        ]),
        s!("vgpu_ioc_mem", abi::MemArg, ["ctx" => ctx, "mem" => mem]),
        s!("vgpu_ioc_map_vram", abi::MapVram, [
            "ctx" => ctx, "mem" => mem, "va" => va, "page" => page, "flags" => flags,
        ]),
        s!("vgpu_ioc_map_user", abi::MapUser, [
            "ctx" => ctx, "flags" => flags, "va" => va, "user_addr" => user_addr,
            "size" => size,
        ]),
        s!("vgpu_ioc_unmap", abi::Unmap, ["ctx" => ctx, "reserved" => reserved, "va" => va]),
        s!("vgpu_ioc_map_aperture", abi::MapAperture, [
            "ctx" => ctx, "mem" => mem, "offset" => offset, "size" => size,
        ]),
        s!("vgpu_ioc_create_channel", abi::CreateChannel, [
            "ctx" => ctx, "gp_entries" => gp_entries, "gp_ring_va" => gp_ring_va,
            "channel" => channel, "slot" => slot, "offset" => offset,
        ]),
        s!("vgpu_ioc_channel", abi::ChannelArg, ["ctx" => ctx, "channel" => channel]),
        s!("vgpu_ioc_submit", abi::Submit, [
            "ctx" => ctx, "channel" => channel, "gp_put" => gp_put, "reserved" => reserved,
        ]),
        s!("vgpu_ioc_wait", abi::Wait, [
            "ctx" => ctx, "channel" => channel, "kind" => kind, "value" => value,
            "timeout_ns" => timeout_ns, "ref" => reference, "notify_seq" => notify_seq,
            "error" => error, "notify_token" => notify_token, "error_info" => error_info,
        ]),
        s!("vgpu_ioc_channel_status", abi::ChannelStatus, [
            "ctx" => ctx, "channel" => channel, "gp_put" => gp_put, "gp_get" => gp_get,
            "ref" => reference, "notify_seq" => notify_seq, "error" => error,
            "reserved" => reserved, "error_info" => error_info,
        ]),
        s!("vgpu_ioc_module_load", abi::ModuleLoad, [
            "ctx" => ctx, "module" => module, "user_addr" => user_addr, "size" => size,
        ]),
        s!("vgpu_ioc_module", abi::ModuleArg, ["ctx" => ctx, "module" => module]),
        s!("vgpu_ioc_function_get", abi::FunctionGet, [
            "ctx" => ctx, "module" => module, "name_addr" => name_addr,
            "name_len" => name_len, "function" => function, "params_addr" => params_addr,
            "max_params" => max_params, "param_count" => param_count,
        ]),
        s!("vgpu_ioc_global_get", abi::GlobalGet, [
            "ctx" => ctx, "module" => module, "name_addr" => name_addr,
            "name_len" => name_len, "reserved" => reserved, "addr" => addr, "size" => size,
        ]),
    ]
}

/// Scalar defines of the header with the Rust value they must have.
fn constants() -> Vec<(&'static str, u64)> {
    vec![
        ("VGPU_IOCTL_ABI_VERSION", abi::ABI_VERSION as u64),
        ("VGPU_IOCTL_MAGIC", abi::IOCTL_MAGIC as u64),
        ("VGPU_IOC_PAGE_4K", abi::PAGE_4K as u64),
        ("VGPU_IOC_PAGE_64K", abi::PAGE_64K as u64),
        ("VGPU_IOC_PAGE_2M", abi::PAGE_2M as u64),
        ("VGPU_IOC_MAP_READ_ONLY", abi::MAP_READ_ONLY as u64),
        ("VGPU_IOC_MAX_USER_MAP", abi::MAX_USER_MAP),
        ("VGPU_WAIT_FENCE", abi::WAIT_FENCE as u64),
        ("VGPU_WAIT_NOTIFY", abi::WAIT_NOTIFY as u64),
        ("VGPU_INFO_FORWARDED", abi::INFO_FORWARDED as u64),
        ("VGPU_IOC_MAX_MODULE_BYTES", abi::MAX_MODULE_BYTES),
        ("VGPU_IOC_MAX_SYMBOL_LEN", abi::MAX_SYMBOL_LEN as u64),
        ("VGPU_IOC_PARAMS_UNKNOWN", abi::PARAMS_UNKNOWN as u64),
        // The ioctl limits are the protocol's.
        (
            "VGPU_IOC_MAX_MODULE_BYTES",
            vgpu_protocol::module::MAX_MODULE_BYTES,
        ),
        (
            "VGPU_IOC_MAX_SYMBOL_LEN",
            vgpu_protocol::module::MAX_SYMBOL_LEN as u64,
        ),
        (
            "VGPU_IOC_PARAMS_UNKNOWN",
            vgpu_protocol::module::PARAMS_UNKNOWN as u64,
        ),
        // The ioctl page codes are the protocol's.
        ("VGPU_IOC_PAGE_4K", PAGE_4K as u64),
        ("VGPU_IOC_PAGE_64K", PAGE_64K as u64),
        ("VGPU_IOC_PAGE_2M", PAGE_2M as u64),
        ("VGPU_IOC_MAP_READ_ONLY", MAP_READ_ONLY as u64),
    ]
}

fn asserts() -> String {
    let mut c = String::from("#include <stddef.h>\n#include \"vgpu_ioctl.h\"\n");
    for (name, size, fields) in structs() {
        c += &format!("_Static_assert(sizeof(struct {name}) == {size}, \"{name} size\");\n");
        for (f, off) in fields {
            c += &format!(
                "_Static_assert(offsetof(struct {name}, {f}) == {off}, \"{name}.{f}\");\n"
            );
        }
    }
    for (name, v) in abi::IOCTLS {
        c += &format!("_Static_assert({name} == {v:#x}u, \"{name}\");\n");
    }
    for (name, v) in constants() {
        c += &format!("_Static_assert({name} == {v:#x}ull, \"{name}\");\n");
    }
    c
}

#[test]
fn every_header_ioctl_is_mirrored() {
    let text = std::fs::read_to_string(kernel_dir().join("vgpu_ioctl.h")).unwrap();
    let in_header: Vec<&str> = text
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("#define "))
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let name = w.next()?;
            w.next()?.starts_with("_IO").then_some(name)
        })
        .collect();
    assert_eq!(in_header.len(), abi::IOCTLS.len(), "{in_header:?}");
    for name in in_header {
        assert!(
            abi::IOCTLS.iter().any(|(n, _)| *n == name),
            "{name} is not in abi::IOCTLS"
        );
    }
}

#[test]
fn ioctl_numbers_are_distinct() {
    let mut nrs: Vec<u32> = abi::IOCTLS.iter().map(|(_, v)| v & 0xff).collect();
    nrs.sort_unstable();
    nrs.dedup();
    assert_eq!(nrs.len(), abi::IOCTLS.len());
}

#[test]
fn headers_match_rust() {
    if Command::new("cc").arg("--version").output().is_err() {
        println!("note: no `cc` found; skipping the C check of vgpu_ioctl.h");
        return;
    }
    let dir = std::env::temp_dir().join(format!("vgpu_ioctl_abi_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("check.c");
    std::fs::write(&src, asserts()).unwrap();
    let out = Command::new("cc")
        .args(["-fsyntax-only", "-std=gnu11", "-Wall", "-Wextra", "-Werror"])
        .arg("-I")
        .arg(kernel_dir())
        .arg(&src)
        .output()
        .expect("running cc");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "the header disagrees with the Rust side:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
