//! `vgpu-smoke --hostile`: what a hostile process gets from `/dev/vgpu` — raw ioctls with
//! bad arguments, forged ids, mmap of offsets it does not own, and (with a working device)
//! another process trying to use or map this one's objects. Each check names the errno it
//! expects. Checks the driver decides alone run against any device (also the rig's stub,
//! which never answers); the rest need a device that creates contexts and are skipped
//! otherwise.

use std::os::fd::RawFd;

use vgpu_guest::devvgpu::{abi, DevVgpuTransport};

use crate::smoke::Check;

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// One ioctl with a raw argument; the errno, 0 on success.
fn ioctl<T>(fd: RawFd, nr: u32, arg: &mut T) -> i32 {
    // SAFETY: `arg` is a live exclusive `T`; for every `nr` used here the driver reads and
    // writes at most `size_of::<T>()` bytes (the size is encoded in `nr`, or the driver
    // rejects an unknown `nr` without touching memory).
    let rc = unsafe { libc::ioctl(fd, nr as _, arg as *mut T) };
    if rc < 0 {
        errno()
    } else {
        0
    }
}

/// `mmap` of `len` bytes at `offset` (shared unless `private`); the errno, 0 if it
/// mapped (the mapping is removed again at once).
fn try_mmap(fd: RawFd, offset: u64, len: usize, private: bool) -> i32 {
    let flags = if private {
        libc::MAP_PRIVATE
    } else {
        libc::MAP_SHARED
    };
    let Ok(off) = libc::off_t::try_from(offset) else {
        return libc::EINVAL;
    };
    // SAFETY: a fresh mapping with no address hint aliases nothing; it is unmapped below
    // without ever being dereferenced.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd,
            off,
        )
    };
    if p == libc::MAP_FAILED {
        return errno();
    }
    // SAFETY: `p..p+len` is the mapping just created.
    unsafe { libc::munmap(p, len) };
    0
}

fn expect(out: &mut Vec<Check>, name: &str, got: i32, want: i32) {
    let failure = (got != want).then(|| {
        format!(
            "errno {got} ({}), want {want} ({})",
            std::io::Error::from_raw_os_error(got),
            std::io::Error::from_raw_os_error(want)
        )
    });
    out.push(Check {
        name: format!("hostile/{name}"),
        failure,
        skipped: false,
    });
}

fn skip(out: &mut Vec<Check>, name: &str) {
    out.push(Check {
        name: format!("hostile/{name}"),
        failure: None,
        skipped: true,
    });
}

/// Whether the device is forwarded (no shared-memory region); false if GET_INFO fails.
fn forwarded(fd: RawFd) -> bool {
    let mut i = abi::Info::default();
    ioctl(fd, abi::GET_INFO, &mut i) == 0 && i.flags & abi::INFO_FORWARDED != 0
}

/// The module ioctls' own checks: sizes, names and user pointers the driver refuses
/// before it asks the device, and a forged context.
fn module_ioctls(fd: RawFd, out: &mut Vec<Check>) {
    let image = b".version 8.0\n.target sm_90\n";
    let mut m = abi::ModuleLoad {
        ctx: 0xdead,
        user_addr: image.as_ptr() as u64,
        size: 0,
        ..Default::default()
    };
    let mut case = |name, m: &mut abi::ModuleLoad, errno| {
        expect(out, name, ioctl(fd, abi::MODULE_LOAD, m), errno);
    };
    case("module_load_empty", &mut m, libc::EINVAL);
    m.size = abi::MAX_MODULE_BYTES + 1;
    case("module_load_over_32_mib", &mut m, libc::EINVAL);
    // Read from the caller before the context is looked up: a bad pointer faults first.
    m.size = 4096;
    m.user_addr = 0x10;
    case("module_load_bad_pointer", &mut m, libc::EFAULT);
    m.user_addr = image.as_ptr() as u64;
    m.size = image.len() as u64;
    case("module_load_forged_ctx", &mut m, libc::ENOENT);
    let name = b"f";
    let mut f = abi::FunctionGet {
        ctx: 0xdead,
        module: 1,
        name_addr: name.as_ptr() as u64,
        name_len: 0,
        ..Default::default()
    };
    expect(
        out,
        "function_get_empty_name",
        ioctl(fd, abi::FUNCTION_GET, &mut f),
        libc::EINVAL,
    );
    f.name_len = abi::MAX_SYMBOL_LEN + 1;
    expect(
        out,
        "function_get_long_name",
        ioctl(fd, abi::FUNCTION_GET, &mut f),
        libc::EINVAL,
    );
    f.name_len = 1;
    expect(
        out,
        "function_get_forged_ctx",
        ioctl(fd, abi::FUNCTION_GET, &mut f),
        libc::ENOENT,
    );
    let mut g = abi::GlobalGet {
        ctx: 0xdead,
        module: 1,
        name_addr: 0x10,
        name_len: 4,
        ..Default::default()
    };
    expect(
        out,
        "global_get_bad_name_pointer",
        ioctl(fd, abi::GLOBAL_GET, &mut g),
        libc::EFAULT,
    );
}

/// Checks the driver answers without asking the device.
fn driver_only(fd: RawFd, out: &mut Vec<Check>) {
    let mut junk = [0u8; 64];
    expect(
        out,
        "unknown_ioctl",
        ioctl(fd, 0xC640_0077, &mut junk),
        libc::ENOTTY,
    );
    let mut a = abi::AllocVram {
        ctx: 1,
        size: 4096,
        align: 3000,
        ..Default::default()
    };
    expect(
        out,
        "alloc_bad_align",
        ioctl(fd, abi::ALLOC_VRAM, &mut a),
        libc::EINVAL,
    );
    a.align = 4096;
    a.size = 0;
    expect(
        out,
        "alloc_zero",
        ioctl(fd, abi::ALLOC_VRAM, &mut a),
        libc::EINVAL,
    );
    a.size = u64::MAX;
    expect(
        out,
        "alloc_huge",
        ioctl(fd, abi::ALLOC_VRAM, &mut a),
        libc::EINVAL,
    );
    a.size = 4096;
    a.ctx = 0xdead;
    expect(
        out,
        "alloc_forged_ctx",
        ioctl(fd, abi::ALLOC_VRAM, &mut a),
        libc::ENOENT,
    );
    module_ioctls(fd, out);
    let mut u = abi::MapUser {
        ctx: 1,
        flags: 0,
        va: 0x1_0000_0000,
        user_addr: 0x1001,
        size: 4096,
    };
    expect(
        out,
        "map_user_unaligned",
        ioctl(fd, abi::MAP_USER, &mut u),
        libc::EINVAL,
    );
    u.user_addr = !0xfff;
    expect(
        out,
        "map_user_overflow",
        ioctl(fd, abi::MAP_USER, &mut u),
        libc::EINVAL,
    );
    u.user_addr = 0x10_0000;
    u.va = (1 << 48) - 4096;
    u.size = 8192;
    expect(
        out,
        "map_user_past_va_limit",
        ioctl(fd, abi::MAP_USER, &mut u),
        libc::EINVAL,
    );
    u.flags = 0x80;
    expect(
        out,
        "map_user_bad_flags",
        ioctl(fd, abi::MAP_USER, &mut u),
        libc::EINVAL,
    );
    let mut c = abi::CreateChannel {
        ctx: 1,
        gp_entries: 1000,
        gp_ring_va: 0x1_0000_0000,
        ..Default::default()
    };
    expect(
        out,
        "channel_bad_ring",
        ioctl(fd, abi::CREATE_CHANNEL, &mut c),
        libc::EINVAL,
    );
    let mut d = abi::ChannelArg { ctx: 7, channel: 1 };
    expect(
        out,
        "destroy_forged_channel",
        ioctl(fd, abi::DESTROY_CHANNEL, &mut d),
        libc::ENOENT,
    );
    let mut w = abi::Wait {
        ctx: 1,
        channel: 1,
        kind: 9,
        ..Default::default()
    };
    expect(
        out,
        "wait_bad_kind",
        ioctl(fd, abi::WAIT, &mut w),
        libc::EINVAL,
    );
    let mut x = abi::Unmap {
        ctx: 1,
        reserved: 5,
        va: 0,
    };
    expect(
        out,
        "reserved_nonzero",
        ioctl(fd, abi::UNMAP, &mut x),
        libc::EINVAL,
    );
    // Slots and windows this file does not own: every slot, the aperture, the region end.
    expect(
        out,
        "mmap_unowned_slot",
        try_mmap(fd, 0, 4096, false),
        libc::EACCES,
    );
    if forwarded(fd) {
        // No region: nothing lies past the channel pages' offsets.
        expect(
            out,
            "mmap_aperture_forwarded",
            try_mmap(fd, 0x40_0000, 4096, false),
            libc::EINVAL,
        );
    } else {
        expect(
            out,
            "mmap_unowned_aperture",
            try_mmap(fd, 0x40_0000, 4096, false),
            libc::EACCES,
        );
    }
    expect(
        out,
        "mmap_past_region",
        try_mmap(fd, 1 << 40, 4096, false),
        libc::EINVAL,
    );
    expect(
        out,
        "mmap_private",
        try_mmap(fd, 0, 4096, true),
        libc::EINVAL,
    );
}

/// Runs `f` in a forked child and returns its exit status (the child never returns).
fn in_child(f: impl FnOnce() -> i32) -> i32 {
    // SAFETY: the child only runs `f` (ioctls, mmap, open) and `_exit`s; this tool is
    // single-threaded while it runs these checks.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = f();
        // SAFETY: leaving the child without running the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    if pid < 0 {
        return -1;
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        -1
    }
}

/// Checks that need objects on a working device.
fn with_device(dev_path: &str, fd: RawFd, out: &mut Vec<Check>) {
    let mut ctx = abi::ContextArg::default();
    if ioctl(fd, abi::CREATE_CONTEXT, &mut ctx) != 0 {
        for n in [
            "other_process_uses_ctx",
            "other_process_maps_slot",
            "forged_mem_id",
            "slot_gone_after_destroy",
        ] {
            skip(out, n);
        }
        return;
    }
    let mut ch = abi::CreateChannel {
        ctx: ctx.ctx,
        gp_entries: 16,
        gp_ring_va: 0x1_0000_0000,
        ..Default::default()
    };
    let e = ioctl(fd, abi::CREATE_CHANNEL, &mut ch);
    expect(out, "create_channel", e, 0);
    // A fork child shares the file but is another process: EACCES on the parent's
    // context; its own open of /dev/vgpu owns nothing, so the parent's slot is EACCES.
    let parent_ctx = ctx.ctx;
    let code = in_child(|| {
        let mut a = abi::AllocVram {
            ctx: parent_ctx,
            size: 4096,
            align: 4096,
            ..Default::default()
        };
        ioctl(fd, abi::ALLOC_VRAM, &mut a)
    });
    expect(out, "other_process_uses_ctx", code, libc::EACCES);
    let (path, slot_off) = (dev_path.to_string(), ch.offset);
    let code = in_child(move || match DevVgpuTransport::open(&path) {
        Ok(t) => try_mmap(t.raw_fd(), slot_off, 4096, false),
        Err(_) => 100,
    });
    expect(out, "other_process_maps_slot", code, libc::EACCES);
    expect(
        out,
        "own_slot_maps",
        try_mmap(fd, ch.offset, 4096, false),
        0,
    );
    let mut st = abi::ChannelStatus {
        ctx: ctx.ctx,
        channel: 0x7777,
        ..Default::default()
    };
    expect(
        out,
        "channel_status_forged_id",
        ioctl(fd, abi::CHANNEL_STATUS, &mut st),
        libc::ENOENT,
    );
    let parent_ch = ch.channel;
    let code = in_child(move || {
        let mut s = abi::ChannelStatus {
            ctx: parent_ctx,
            channel: parent_ch,
            ..Default::default()
        };
        ioctl(fd, abi::CHANNEL_STATUS, &mut s)
    });
    expect(out, "other_process_channel_status", code, libc::EACCES);
    let mut sub = abi::Submit {
        ctx: ctx.ctx,
        channel: 0x7777,
        gp_put: 1,
        reserved: 0,
    };
    expect(
        out,
        "submit_forged_id",
        ioctl(fd, abi::SUBMIT, &mut sub),
        libc::ENOENT,
    );
    if forwarded(fd) {
        let mut v = abi::AllocVram {
            ctx: ctx.ctx,
            size: 4096,
            align: 4096,
            ..Default::default()
        };
        if ioctl(fd, abi::ALLOC_VRAM, &mut v) == 0 {
            let mut ap = abi::MapAperture {
                ctx: ctx.ctx,
                mem: v.mem,
                ..Default::default()
            };
            expect(
                out,
                "map_aperture_forwarded",
                ioctl(fd, abi::MAP_APERTURE, &mut ap),
                libc::EOPNOTSUPP,
            );
        } else {
            skip(out, "map_aperture_forwarded");
        }
    }
    let mut f = abi::MemArg {
        ctx: ctx.ctx,
        mem: 0x7777,
    };
    expect(
        out,
        "forged_mem_id",
        ioctl(fd, abi::FREE_MEM, &mut f),
        libc::ENOENT,
    );
    let mut d = abi::ChannelArg {
        ctx: ctx.ctx,
        channel: ch.channel,
    };
    expect(
        out,
        "destroy_channel",
        ioctl(fd, abi::DESTROY_CHANNEL, &mut d),
        0,
    );
    expect(
        out,
        "slot_gone_after_destroy",
        try_mmap(fd, ch.offset, 4096, false),
        libc::EACCES,
    );
    expect(
        out,
        "destroy_context",
        ioctl(fd, abi::DESTROY_CONTEXT, &mut ctx),
        0,
    );
}

/// Runs every hostile check against the device node at `path`.
pub fn run(path: &str) -> Vec<Check> {
    let mut out = Vec::new();
    let t = match DevVgpuTransport::open(path) {
        Ok(t) => t,
        Err(e) => {
            out.push(Check {
                name: "hostile/open".into(),
                failure: Some(e.to_string()),
                skipped: false,
            });
            return out;
        }
    };
    driver_only(t.raw_fd(), &mut out);
    with_device(path, t.raw_fd(), &mut out);
    out
}
