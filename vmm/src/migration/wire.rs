//! The migration stream between two `vgpu-vmm`s: a magic and version, then messages, each
//! `tag: u8, len: u64 (LE), payload`. The source sends; the destination answers
//! [`Msg::Ack`] or [`Msg::Fail`] where the source waits for a verdict (after the rings,
//! after the device state, after the tail, after the commit).
//!
//! The destination reads hostile input: every length is bounded before anything is
//! allocated for it, and payloads are decoded with bounds checks ([`super::codec`]).

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;

use super::MigrationError;

/// The first bytes of a stream.
pub const MAGIC: [u8; 8] = *b"VGPUVMM\0";
/// The format version this build writes and reads.
pub const VERSION: u32 = 1;
/// The largest message payload: a device-state frame (VRAM chunk rounds) is the largest.
pub const MAX_PAYLOAD: u64 = 1 << 30;
/// Bytes of guest RAM per [`Msg::Ram`].
pub const RAM_CHUNK: usize = 1 << 20;

/// Where a destination listens: `unix:PATH` or `tcp:HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    Unix(PathBuf),
    Tcp(String),
}

impl std::str::FromStr for Address {
    type Err = MigrationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(p) = s.strip_prefix("unix:") {
            if !p.is_empty() {
                return Ok(Address::Unix(PathBuf::from(p)));
            }
        } else if let Some(a) = s.strip_prefix("tcp:") {
            if a.rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
            {
                return Ok(Address::Tcp(a.to_owned()));
            }
        }
        Err(MigrationError::Address(s.to_owned()))
    }
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Address::Unix(p) => write!(f, "unix:{}", p.display()),
            Address::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

/// A byte stream to the other side.
pub trait Conn: Read + Write + Send {}
impl<T: Read + Write + Send> Conn for T {}

/// A listening destination, bound before the sandbox closes `bind`/`listen`.
#[derive(Debug)]
pub enum Listener {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
}

impl Listener {
    pub fn bind(addr: &Address) -> Result<Self, MigrationError> {
        let io = |e| MigrationError::Io("binding the incoming address", e);
        Ok(match addr {
            Address::Unix(p) => {
                // A stale socket file of an earlier run would make bind fail.
                if std::fs::symlink_metadata(p)
                    .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
                {
                    let _ = std::fs::remove_file(p);
                }
                Listener::Unix(UnixListener::bind(p).map_err(io)?, p.clone())
            }
            Address::Tcp(a) => Listener::Tcp(TcpListener::bind(a.as_str()).map_err(io)?),
        })
    }

    /// Waits for the source.
    pub fn accept(&self) -> Result<Box<dyn Conn>, MigrationError> {
        let io = |e| MigrationError::Io("accepting the source", e);
        Ok(match self {
            Listener::Unix(l, _) => Box::new(l.accept().map_err(io)?.0),
            Listener::Tcp(l) => {
                let (s, _) = l.accept().map_err(io)?;
                let _ = s.set_nodelay(true);
                Box::new(s)
            }
        })
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Connects to a destination.
pub fn connect(addr: &Address) -> Result<Box<dyn Conn>, MigrationError> {
    let io = |e| MigrationError::Io("connecting to the destination", e);
    Ok(match addr {
        Address::Unix(p) => Box::new(UnixStream::connect(p).map_err(io)?),
        Address::Tcp(a) => {
            let s = TcpStream::connect(a.as_str()).map_err(io)?;
            let _ = s.set_nodelay(true);
            Box::new(s)
        }
    })
}

/// A message of the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// The machine's shape ([`super::records::Hello`], encoded).
    Hello(Vec<u8>),
    /// Guest RAM at `gpa`.
    Ram { gpa: u64, data: Vec<u8> },
    /// `len` bytes of zeros at `gpa`.
    Zero { gpa: u64, len: u64 },
    /// A pre-copy round of RAM ended.
    RoundEnd { round: u32 },
    /// The vgpu rings stopped on the source: their positions and the transport state
    /// (encoded); the destination continues the device there.
    Rings(Vec<u8>),
    /// A frame of the vgpu device-state stream, relayed from the source's backend.
    DeviceFrame(Vec<u8>),
    /// The device-state stream ended.
    DeviceEnd,
    /// The device-state tail (guest stores since the pause).
    Tail(Vec<u8>),
    /// vCPUs, in-kernel chips and devices, the last thing before the commit (encoded).
    Machine(Vec<u8>),
    /// The source gives the VM up: the destination runs it.
    Commit,
    /// The destination's verdict: fine.
    Ack,
    /// The destination's verdict: failed, why.
    Fail(String),
}

const T_HELLO: u8 = 1;
const T_RAM: u8 = 2;
const T_ZERO: u8 = 3;
const T_ROUND_END: u8 = 4;
const T_RINGS: u8 = 5;
const T_DEVICE_FRAME: u8 = 6;
const T_DEVICE_END: u8 = 7;
const T_TAIL: u8 = 8;
const T_MACHINE: u8 = 9;
const T_COMMIT: u8 = 10;
const T_ACK: u8 = 11;
const T_FAIL: u8 = 12;

/// Writes the stream's opening.
pub fn write_preamble(w: &mut dyn Write) -> io::Result<()> {
    w.write_all(&MAGIC)?;
    w.write_all(&VERSION.to_le_bytes())
}

/// Reads and checks the stream's opening.
pub fn read_preamble(r: &mut dyn Read) -> Result<(), MigrationError> {
    let mut b = [0u8; 12];
    r.read_exact(&mut b)
        .map_err(|e| MigrationError::Io("reading the stream's preamble", e))?;
    if b[..8] != MAGIC {
        return Err(MigrationError::Invalid(
            "preamble",
            "not a vgpu-vmm migration stream",
        ));
    }
    let v = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
    if v != VERSION {
        return Err(MigrationError::Version(v));
    }
    Ok(())
}

fn frame(w: &mut dyn Write, tag: u8, parts: &[&[u8]]) -> io::Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut hdr = [0u8; 9];
    hdr[0] = tag;
    hdr[1..].copy_from_slice(&(len as u64).to_le_bytes());
    w.write_all(&hdr)?;
    for p in parts {
        w.write_all(p)?;
    }
    Ok(())
}

/// Sends `msg`.
pub fn send(w: &mut dyn Write, msg: &Msg) -> Result<(), MigrationError> {
    let r = match msg {
        Msg::Hello(b) => frame(w, T_HELLO, &[b]),
        Msg::Ram { gpa, data } => frame(w, T_RAM, &[&gpa.to_le_bytes(), data]),
        Msg::Zero { gpa, len } => frame(w, T_ZERO, &[&gpa.to_le_bytes(), &len.to_le_bytes()]),
        Msg::RoundEnd { round } => frame(w, T_ROUND_END, &[&round.to_le_bytes()]),
        Msg::Rings(b) => frame(w, T_RINGS, &[b]),
        Msg::DeviceFrame(b) => frame(w, T_DEVICE_FRAME, &[b]),
        Msg::DeviceEnd => frame(w, T_DEVICE_END, &[]),
        Msg::Tail(b) => frame(w, T_TAIL, &[b]),
        Msg::Machine(b) => frame(w, T_MACHINE, &[b]),
        Msg::Commit => frame(w, T_COMMIT, &[]),
        Msg::Ack => frame(w, T_ACK, &[]),
        Msg::Fail(s) => frame(w, T_FAIL, &[s.as_bytes()]),
    };
    r.and_then(|()| w.flush())
        .map_err(|e| MigrationError::Io("sending", e))
}

fn le64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// Receives the next message.
pub fn recv(r: &mut dyn Read) -> Result<Msg, MigrationError> {
    let io = |e| MigrationError::Io("receiving", e);
    let mut hdr = [0u8; 9];
    r.read_exact(&mut hdr).map_err(io)?;
    let tag = hdr[0];
    let len = le64(&hdr[1..]);
    let max = match tag {
        T_RAM => 8 + RAM_CHUNK as u64,
        T_ZERO => 16,
        T_ROUND_END => 4,
        T_DEVICE_END | T_COMMIT | T_ACK => 0,
        T_FAIL => 4096,
        _ => MAX_PAYLOAD,
    };
    if len > max {
        return Err(MigrationError::Invalid("message", "payload too long"));
    }
    // Read as it arrives: a lying length cannot make us allocate more than was sent.
    let mut body = Vec::new();
    r.take(len).read_to_end(&mut body).map_err(io)?;
    if body.len() as u64 != len {
        return Err(MigrationError::Truncated("message"));
    }
    let exact = |n: usize| {
        if body.len() == n {
            Ok(())
        } else {
            Err(MigrationError::Invalid("message", "payload size"))
        }
    };
    Ok(match tag {
        T_HELLO => Msg::Hello(body),
        T_RAM => {
            if body.len() < 8 {
                return Err(MigrationError::Truncated("RAM message"));
            }
            let gpa = le64(&body);
            body.drain(..8);
            Msg::Ram { gpa, data: body }
        }
        T_ZERO => {
            exact(16)?;
            Msg::Zero {
                gpa: le64(&body),
                len: le64(&body[8..]),
            }
        }
        T_ROUND_END => {
            exact(4)?;
            Msg::RoundEnd {
                round: u32::from_le_bytes([body[0], body[1], body[2], body[3]]),
            }
        }
        T_RINGS => Msg::Rings(body),
        T_DEVICE_FRAME => Msg::DeviceFrame(body),
        T_DEVICE_END => Msg::DeviceEnd,
        T_TAIL => Msg::Tail(body),
        T_MACHINE => Msg::Machine(body),
        T_COMMIT => Msg::Commit,
        T_ACK => Msg::Ack,
        T_FAIL => Msg::Fail(String::from_utf8_lossy(&body).into_owned()),
        t => return Err(MigrationError::UnknownMessage(t)),
    })
}

/// Receives the destination's verdict.
pub fn verdict(r: &mut dyn Read, step: &'static str) -> Result<(), MigrationError> {
    match recv(r)? {
        Msg::Ack => Ok(()),
        Msg::Fail(why) => Err(MigrationError::Refused { step, why }),
        _ => Err(MigrationError::Invalid("verdict", "not an ACK or FAIL")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_round_trips() {
        let msgs = [
            Msg::Hello(vec![1, 2, 3]),
            Msg::Ram {
                gpa: 0x1000,
                data: vec![7; 4096],
            },
            Msg::Zero {
                gpa: 0x2000,
                len: 0x3000,
            },
            Msg::RoundEnd { round: 3 },
            Msg::Rings(vec![9; 40]),
            Msg::DeviceFrame(vec![5; 100]),
            Msg::DeviceEnd,
            Msg::Tail(vec![1]),
            Msg::Machine(vec![2; 10]),
            Msg::Commit,
            Msg::Ack,
            Msg::Fail("no".into()),
        ];
        let mut buf = Vec::new();
        write_preamble(&mut buf).unwrap();
        for m in &msgs {
            send(&mut buf, m).unwrap();
        }
        let mut r = &buf[..];
        read_preamble(&mut r).unwrap();
        for m in &msgs {
            assert_eq!(&recv(&mut r).unwrap(), m);
        }
        assert!(matches!(recv(&mut r), Err(MigrationError::Io(..))));
    }

    /// The stream over both transports an operator can name: a unix socket (same host)
    /// and TCP (between hosts), through `Listener::bind`, `accept` and `connect`.
    #[test]
    fn the_stream_crosses_a_unix_socket_and_tcp() {
        let path = std::env::temp_dir().join(format!("vgpu-wire-test-{}.sock", std::process::id()));
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = tcp.local_addr().unwrap().port();
        drop(tcp);
        for addr in [
            format!("unix:{}", path.display()),
            format!("tcp:127.0.0.1:{port}"),
        ] {
            let addr: Address = addr.parse().unwrap();
            let listener = Listener::bind(&addr).unwrap();
            let to = addr.clone();
            let sender = std::thread::spawn(move || {
                let mut c = connect(&to).unwrap();
                write_preamble(&mut c).unwrap();
                send(
                    &mut c,
                    &Msg::Ram {
                        gpa: 0x4000,
                        data: vec![0xa5; 1 << 20],
                    },
                )
                .unwrap();
                send(&mut c, &Msg::Commit).unwrap();
                verdict(&mut c, "commit")
            });
            let mut c = listener.accept().unwrap();
            read_preamble(&mut c).unwrap();
            match recv(&mut c).unwrap() {
                Msg::Ram { gpa, data } => {
                    assert_eq!(gpa, 0x4000, "{addr}");
                    assert!(
                        data.len() == 1 << 20 && data.iter().all(|&b| b == 0xa5),
                        "{addr}"
                    );
                }
                other => panic!("{addr}: {other:?}"),
            }
            assert_eq!(recv(&mut c).unwrap(), Msg::Commit, "{addr}");
            send(&mut c, &Msg::Ack).unwrap();
            sender.join().unwrap().unwrap();
        }
        assert!(!path.exists(), "the unix listener removes its socket");
    }

    #[test]
    fn hostile_headers_are_refused_without_allocating() {
        // A RAM message claiming 1 TiB.
        let mut b = vec![T_RAM];
        b.extend_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(matches!(
            recv(&mut &b[..]),
            Err(MigrationError::Invalid(_, "payload too long"))
        ));
        // A device frame claiming 1 GiB with 3 bytes behind it.
        let mut b = vec![T_DEVICE_FRAME];
        b.extend_from_slice(&(MAX_PAYLOAD).to_le_bytes());
        b.extend_from_slice(&[1, 2, 3]);
        assert!(matches!(
            recv(&mut &b[..]),
            Err(MigrationError::Truncated(_))
        ));
        // An unknown tag, a bad preamble, a newer version.
        let mut b = vec![200];
        b.extend_from_slice(&0u64.to_le_bytes());
        assert!(matches!(
            recv(&mut &b[..]),
            Err(MigrationError::UnknownMessage(200))
        ));
        assert!(read_preamble(&mut &b"NOTVGPU!\x01\0\0\0"[..]).is_err());
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&2u32.to_le_bytes());
        assert!(matches!(
            read_preamble(&mut &b[..]),
            Err(MigrationError::Version(2))
        ));
        for a in ["unix:", "tcp:host", "tcp::1", "ftp:x", "tcp:h:99999"] {
            assert!(a.parse::<Address>().is_err(), "{a}");
        }
        assert_eq!(
            "tcp:10.0.0.1:4444".parse::<Address>().unwrap(),
            Address::Tcp("10.0.0.1:4444".into())
        );
    }
}
