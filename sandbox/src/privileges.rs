//! Privileges: `PR_SET_NO_NEW_PRIVS` and dropping every capability. Neither binary needs
//! a capability once started (sockets are bound and `/dev/kvm` is opened by fds owned by
//! the user it runs as), so one run as root keeps none: not in the effective, permitted
//! or inheritable sets, not ambient, not in the bounding set.

use crate::SandboxError;

/// `_LINUX_CAPABILITY_VERSION_3`: 64-bit capability sets in two words.
const CAP_VERSION_3: u32 = 0x2008_0522;
/// `CAP_SETPCAP`, needed to shrink the bounding set.
const CAP_SETPCAP: u32 = 8;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

fn os_err(what: &'static str) -> SandboxError {
    SandboxError::Privileges {
        what,
        source: std::io::Error::last_os_error(),
    }
}

/// Sets `PR_SET_NO_NEW_PRIVS`: no `execve` of this process (were it allowed) gains
/// privileges. Inherited by threads started afterwards.
pub fn no_new_privs() -> Result<(), SandboxError> {
    // SAFETY: prctl with integer arguments only; it changes this thread's flag.
    let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    if rc != 0 {
        return Err(os_err("PR_SET_NO_NEW_PRIVS"));
    }
    Ok(())
}

/// The calling thread's (effective, permitted, inheritable) capability sets.
pub fn current() -> Result<(u64, u64, u64), SandboxError> {
    let mut hdr = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget writes two CapData words, the size version 3 defines, into `data`.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut hdr, data.as_mut_ptr()) };
    if rc != 0 {
        return Err(os_err("capget"));
    }
    let join = |f: fn(&CapData) -> u32| u64::from(f(&data[0])) | (u64::from(f(&data[1])) << 32);
    Ok((
        join(|d| d.effective),
        join(|d| d.permitted),
        join(|d| d.inheritable),
    ))
}

/// Whether capability `cap` is in the bounding set.
pub fn in_bounding_set(cap: u32) -> bool {
    // SAFETY: prctl with integer arguments only; it reads this thread's bounding set.
    unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap as libc::c_ulong, 0, 0, 0) == 1 }
}

/// Drops every capability of the calling thread (call it before starting threads: they
/// inherit the sets). Returns whether there were any. The bounding set is emptied where
/// `CAP_SETPCAP` allows (it does for root); without it there is nothing to regain.
pub fn drop_all() -> Result<bool, SandboxError> {
    let (eff, perm, inh) = current()?;
    // SAFETY: prctl with integer arguments only; it clears this thread's ambient set.
    let rc = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    if rc != 0 {
        return Err(os_err("PR_CAP_AMBIENT_CLEAR_ALL"));
    }
    if eff & (1 << CAP_SETPCAP) != 0 {
        for cap in 0..64u32 {
            if !in_bounding_set(cap) {
                continue;
            }
            // SAFETY: prctl with integer arguments only; it shrinks this thread's
            // bounding set.
            let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
            if rc != 0 {
                return Err(os_err("PR_CAPBSET_DROP"));
            }
        }
    }
    if eff | perm | inh == 0 {
        return Ok(false);
    }
    let mut hdr = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let data = [CapData::default(); 2];
    // SAFETY: capset reads the header and two CapData words (version 3) that live here.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut hdr, data.as_ptr()) };
    if rc != 0 {
        return Err(os_err("capset"));
    }
    Ok(true)
}
