//! Frames over a `SOCK_SEQPACKET` unix socket pair, with file descriptors as
//! `SCM_RIGHTS`: one `sendmsg` per frame, message boundaries kept, and a peer that exits
//! reads as end of file (a datagram pair would block forever instead).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use vgpu_worker_wire::{HEADER_LEN, MAX_FDS, MAX_PAYLOAD};

/// The largest frame either side sends.
pub const MAX_FRAME: usize = HEADER_LEN + MAX_PAYLOAD;

/// A connected pair of `SOCK_SEQPACKET` sockets, close-on-exec.
pub fn pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` is a valid out array of two ints.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and nothing else owns them.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Gives up a blocking receive on `fd` after `t` (`None`: waits for ever).
pub fn set_recv_timeout(fd: BorrowedFd<'_>, t: Option<Duration>) -> io::Result<()> {
    let tv = t.map_or(
        libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        },
        |t| libc::timeval {
            tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_usec: libc::suseconds_t::from(t.subsec_micros()),
        },
    );
    // SAFETY: `tv` is a valid timeval and the length says so.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Room for [`MAX_FDS`] descriptors in a control message.
const CMSG_ROOM: usize = 64;

/// Sends one frame with `fds` (never raising SIGPIPE: a gone peer is an error).
pub fn send(sock: BorrowedFd<'_>, frame: &[u8], fds: &[RawFd]) -> io::Result<()> {
    if fds.len() > usize::from(MAX_FDS) {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    let mut iov = libc::iovec {
        iov_base: frame.as_ptr() as *mut libc::c_void,
        iov_len: frame.len(),
    };
    let mut cbuf = [0u64; CMSG_ROOM / 8];
    // SAFETY: msghdr is plain data; every field used is set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let bytes = std::mem::size_of_val(fds);
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE(bytes as u32) } as usize;
        debug_assert!(space <= CMSG_ROOM);
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer is `space` bytes, aligned for cmsghdr (u64 array),
        // so the first header and its `bytes` of data fit; CMSG_* only do pointer
        // arithmetic inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), fds.len());
        }
    }
    loop {
        // SAFETY: `msg` points at live buffers for the duration of the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return if n as usize == frame.len() {
                Ok(())
            } else {
                Err(io::Error::from(io::ErrorKind::WriteZero))
            };
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// A received frame and the descriptors that came with it.
pub struct Received {
    pub frame: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// Receives one frame; `None` at end of file (the peer closed or exited). A frame longer
/// than [`MAX_FRAME`] or with more descriptors than fit is an error (its descriptors are
/// closed).
pub fn recv(sock: BorrowedFd<'_>) -> io::Result<Option<Received>> {
    let mut buf = [0u8; MAX_FRAME + 1];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; CMSG_ROOM / 8];
    // SAFETY: msghdr is plain data; every field used is set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = CMSG_ROOM as _;
    let n = loop {
        // SAFETY: `msg` points at live buffers for the duration of the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    // Take ownership of every descriptor that arrived before judging the frame, so a
    // refused frame leaks none.
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `msg`'s control buffer; CMSG_* walk it within
    // msg_controllen, and each SCM_RIGHTS payload holds cmsg_len - CMSG_LEN(0) bytes of
    // fds this process now owns.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let p = libc::CMSG_DATA(c).cast::<RawFd>();
                for i in 0..data / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(p.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 || n > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "frame or its descriptors truncated",
        ));
    }
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    Ok(Some(Received {
        frame: buf[..n].to_vec(),
        fds,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn frames_and_fds_cross_and_eof_is_seen() {
        let (a, b) = pair().unwrap();
        let (x, _y) = pair().unwrap();
        send(a.as_fd(), b"hello", &[x.as_raw_fd()]).unwrap();
        send(a.as_fd(), b"world", &[]).unwrap();
        let r = recv(b.as_fd()).unwrap().unwrap();
        assert_eq!((r.frame.as_slice(), r.fds.len()), (&b"hello"[..], 1));
        assert_ne!(r.fds[0].as_raw_fd(), x.as_raw_fd());
        let r = recv(b.as_fd()).unwrap().unwrap();
        assert_eq!((r.frame.as_slice(), r.fds.len()), (&b"world"[..], 0));
        drop(a);
        assert!(recv(b.as_fd()).unwrap().is_none());
    }

    #[test]
    fn an_oversized_frame_is_refused_and_a_timeout_returns() {
        let (a, b) = pair().unwrap();
        send(a.as_fd(), &[0u8; MAX_FRAME + 10], &[]).unwrap();
        assert!(recv(b.as_fd()).is_err());
        set_recv_timeout(b.as_fd(), Some(Duration::from_millis(20))).unwrap();
        let e = recv(b.as_fd()).err().unwrap();
        assert!(matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ));
    }
}
