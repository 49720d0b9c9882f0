//! Legacy PC devices on the I/O port bus: a 16550 UART (vm-superio) on COM1 whose
//! interrupt is an irqfd on GSI 4, a minimal i8042 controller (no keyboard, no mouse; its
//! CPU-reset command ends the VM), and defaults for the ports Linux probes (RTC, POST,
//! other COM ports).

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use std::collections::VecDeque;

use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::BootError;

/// vm-superio's receive FIFO.
const SERIAL_FIFO: usize = 64;

/// COM1.
pub const SERIAL_PORT_BASE: u16 = 0x3f8;
pub const SERIAL_PORT_LEN: u16 = 8;
/// COM1's ISA IRQ.
pub const SERIAL_IRQ: u32 = 4;
/// i8042 data and command/status ports.
pub const I8042_DATA_PORT: u16 = 0x60;
pub const I8042_CMD_PORT: u16 = 0x64;

/// An interrupt line backed by an eventfd (registered as an irqfd).
#[derive(Debug)]
pub struct EventFdTrigger(EventFd);

impl EventFdTrigger {
    pub fn new() -> io::Result<Self> {
        Ok(EventFdTrigger(EventFd::new(EFD_NONBLOCK)?))
    }
    pub fn eventfd(&self) -> &EventFd {
        &self.0
    }
}

impl Trigger for EventFdTrigger {
    type E = io::Error;
    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// A minimal i8042 keyboard controller without devices behind it. It answers the
/// controller commands Linux's driver issues at probe (read/write the configuration byte,
/// self tests) at once — vm-superio's i8042 answers none, which costs the guest about a
/// second of probe timeouts — and turns the CPU-reset command (0xfe on port 0x64, or an
/// output-port write with bit 0 clear) into a VM reset.
#[derive(Debug)]
pub struct I8042 {
    /// Controller configuration byte: keyboard interrupt on, system flag, translation.
    ctr: u8,
    /// Bytes waiting in the output buffer (read from port 0x60).
    out: VecDeque<u8>,
    /// The controller command whose data byte the next port 0x60 write carries.
    pending: Option<u8>,
    reset: Arc<AtomicBool>,
}

const I8042_STATUS_OBF: u8 = 0x01;
const I8042_STATUS_SYS: u8 = 0x04;
const I8042_STATUS_CMD: u8 = 0x08;
/// Set = keyboard not inhibited (no key lock).
const I8042_STATUS_UNLOCKED: u8 = 0x10;
const I8042_CMD_READ_CTR: u8 = 0x20;
const I8042_CMD_WRITE_CTR: u8 = 0x60;
const I8042_CMD_AUX_TEST: u8 = 0xa9;
const I8042_CMD_SELF_TEST: u8 = 0xaa;
const I8042_CMD_KBD_TEST: u8 = 0xab;
const I8042_CMD_WRITE_OUTPUT: u8 = 0xd1;
const I8042_CMD_RESET_CPU: u8 = 0xfe;

impl Default for I8042 {
    fn default() -> Self {
        I8042 {
            ctr: 0x45,
            out: VecDeque::new(),
            pending: None,
            reset: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl I8042 {
    /// Whether the guest asked for a CPU reset.
    pub fn reset_requested(&self) -> bool {
        self.reset.load(Ordering::SeqCst)
    }

    /// Read from `port` (0x60 data, 0x64 status).
    pub fn read(&mut self, port: u16) -> u8 {
        match port {
            I8042_DATA_PORT => self.out.pop_front().unwrap_or(0),
            _ => {
                let mut st = I8042_STATUS_SYS | I8042_STATUS_UNLOCKED;
                if !self.out.is_empty() {
                    st |= I8042_STATUS_OBF;
                }
                if self.pending.is_some() {
                    st |= I8042_STATUS_CMD;
                }
                st
            }
        }
    }

    /// Write `v` to `port` (0x60 data, 0x64 command).
    pub fn write(&mut self, port: u16, v: u8) {
        if port == I8042_DATA_PORT {
            match self.pending.take() {
                Some(I8042_CMD_WRITE_CTR) => self.ctr = v,
                Some(I8042_CMD_WRITE_OUTPUT) if v & 1 == 0 => {
                    self.reset.store(true, Ordering::SeqCst)
                }
                // Bytes for a keyboard that is not there: dropped (the driver times out).
                _ => {}
            }
            return;
        }
        self.pending = None;
        match v {
            I8042_CMD_READ_CTR => self.out.push_back(self.ctr),
            I8042_CMD_WRITE_CTR | I8042_CMD_WRITE_OUTPUT => self.pending = Some(v),
            I8042_CMD_SELF_TEST => self.out.push_back(0x55),
            I8042_CMD_KBD_TEST | I8042_CMD_AUX_TEST => self.out.push_back(0x00),
            I8042_CMD_RESET_CPU => self.reset.store(true, Ordering::SeqCst),
            _ => {}
        }
    }
}

/// Where the guest's serial output goes: every byte is written through at once, so that
/// output is never lost when the VM ends.
pub struct SerialOut(Box<dyn Write + Send>);

impl SerialOut {
    /// `None`: standard output; `Some(path)`: a file, created or truncated.
    pub fn open(path: Option<&Path>) -> Result<Self, BootError> {
        match path {
            None => Ok(SerialOut(Box::new(io::stdout()))),
            Some(p) => {
                let f = OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(p)
                    .map_err(|source| BootError::SerialOut {
                        path: p.to_owned(),
                        source,
                    })?;
                Ok(SerialOut(Box::new(f)))
            }
        }
    }

    /// Any writer (tests).
    pub fn from_writer(w: Box<dyn Write + Send>) -> Self {
        SerialOut(w)
    }
}

impl Write for SerialOut {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

/// The legacy devices on the PIO bus.
pub struct LegacyDevices {
    serial: Mutex<Serial<EventFdTrigger, vm_superio::serial::NoEvents, SerialOut>>,
    i8042: Mutex<I8042>,
    reset: Arc<AtomicBool>,
}

impl LegacyDevices {
    /// `irq` is the serial interrupt's eventfd; the caller registers it as an irqfd.
    pub fn new(irq: EventFdTrigger, out: SerialOut) -> Self {
        let i8042 = I8042::default();
        let reset = i8042.reset.clone();
        LegacyDevices {
            serial: Mutex::new(Serial::new(irq, out)),
            i8042: Mutex::new(i8042),
            reset,
        }
    }

    /// Whether the guest pulsed the i8042 reset line.
    pub fn reset_requested(&self) -> bool {
        self.reset.load(Ordering::SeqCst)
    }

    /// A guest `in` from `port`; `data` is filled with the value read.
    pub fn pio_read(&self, port: u16, data: &mut [u8]) {
        match port {
            p if (SERIAL_PORT_BASE..SERIAL_PORT_BASE + SERIAL_PORT_LEN).contains(&p)
                && data.len() == 1 =>
            {
                if let Ok(mut s) = self.serial.lock() {
                    data[0] = s.read((p - SERIAL_PORT_BASE) as u8);
                }
            }
            I8042_DATA_PORT | I8042_CMD_PORT if data.len() == 1 => {
                if let Ok(mut k) = self.i8042.lock() {
                    data[0] = k.read(port);
                }
            }
            // RTC/CMOS: reads as zero (update-in-progress clear), so the kernel does not
            // wait for it; the guest uses kvmclock.
            0x70 | 0x71 => data.fill(0),
            // Nothing there: an ISA bus floats high.
            _ => {
                log::trace!("unhandled PIO read of {} bytes at {port:#x}", data.len());
                data.fill(0xff);
            }
        }
    }

    /// A guest `out` of `data` to `port`.
    pub fn pio_write(&self, port: u16, data: &[u8]) {
        match port {
            p if (SERIAL_PORT_BASE..SERIAL_PORT_BASE + SERIAL_PORT_LEN).contains(&p)
                && data.len() == 1 =>
            {
                if let Ok(mut s) = self.serial.lock() {
                    if let Err(e) = s.write((p - SERIAL_PORT_BASE) as u8, data[0]) {
                        log::warn!("serial: {e}");
                    }
                }
            }
            I8042_DATA_PORT | I8042_CMD_PORT if data.len() == 1 => {
                if let Ok(mut k) = self.i8042.lock() {
                    k.write(port, data[0]);
                }
            }
            // POST code port (also used by the kernel for I/O delays).
            0x80 => {}
            _ => log::trace!("unhandled PIO write {data:x?} at {port:#x}"),
        }
    }

    /// The serial port's registers and receive buffer (live migration).
    pub fn serial_state(&self) -> vm_superio::serial::SerialState {
        self.serial
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .state()
    }

    /// Takes over a serial port state from [`Self::serial_state`], keeping this port's
    /// interrupt line and output.
    pub fn restore_serial(&self, st: &vm_superio::serial::SerialState) -> Result<(), BootError> {
        // vm-superio refuses a receive buffer over its FIFO; check first, so that a refusal
        // leaves the port (and its output) as it was.
        if st.in_buffer.len() > SERIAL_FIFO {
            return Err(BootError::SerialIn("saved receive buffer too long".into()));
        }
        let mut s = self.serial.lock().unwrap_or_else(|e| e.into_inner());
        let irq = s
            .interrupt_evt()
            .0
            .try_clone()
            .map_err(BootError::EventFd)?;
        let out = std::mem::replace(s.writer_mut(), SerialOut::from_writer(Box::new(io::sink())));
        *s = Serial::from_state(st, EventFdTrigger(irq), vm_superio::serial::NoEvents, out)
            .map_err(|e| BootError::SerialIn(format!("restoring the serial port: {e:?}")))?;
        Ok(())
    }

    /// Queues input bytes for the guest (the serial console's receive side).
    pub fn serial_input(&self, bytes: &[u8]) -> Result<usize, BootError> {
        let mut s = self
            .serial
            .lock()
            .map_err(|_| BootError::Poisoned("serial"))?;
        s.enqueue_raw_bytes(bytes)
            .map_err(|e| BootError::SerialIn(format!("{e:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    struct Chan(mpsc::Sender<u8>);
    impl Write for Chan {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            for &x in b {
                let _ = self.0.send(x);
            }
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn serial_out_irq_and_reset() {
        let (tx, rx) = mpsc::channel();
        let irq = EventFdTrigger::new().unwrap();
        let efd = irq.eventfd().try_clone().unwrap();
        let dev = LegacyDevices::new(irq, SerialOut::from_writer(Box::new(Chan(tx))));
        // Enable the THR-empty interrupt, then write a byte.
        dev.pio_write(SERIAL_PORT_BASE + 1, &[0x02]);
        dev.pio_write(SERIAL_PORT_BASE, b"A");
        assert_eq!(rx.try_recv().unwrap(), b'A');
        assert!(efd.read().unwrap() >= 1);
        // LSR: transmitter empty.
        let mut b = [0u8];
        dev.pio_read(SERIAL_PORT_BASE + 5, &mut b);
        assert_ne!(b[0] & 0x20, 0);
        // Absent COM2 floats high; RTC reads zero.
        dev.pio_read(0x2f8 + 5, &mut b);
        assert_eq!(b[0], 0xff);
        dev.pio_read(0x71, &mut b);
        assert_eq!(b[0], 0);
        assert!(!dev.reset_requested());
        dev.pio_write(I8042_CMD_PORT, &[0xfe]);
        assert!(dev.reset_requested());
    }

    #[test]
    fn i8042_probe_and_reset() {
        let mut k = I8042::default();
        assert_eq!(k.read(I8042_CMD_PORT) & I8042_STATUS_OBF, 0);
        k.write(I8042_CMD_PORT, I8042_CMD_READ_CTR);
        assert_ne!(k.read(I8042_CMD_PORT) & I8042_STATUS_OBF, 0);
        assert_eq!(k.read(I8042_DATA_PORT), 0x45);
        k.write(I8042_CMD_PORT, I8042_CMD_WRITE_CTR);
        k.write(I8042_DATA_PORT, 0x30);
        k.write(I8042_CMD_PORT, I8042_CMD_READ_CTR);
        assert_eq!(k.read(I8042_DATA_PORT), 0x30);
        k.write(I8042_CMD_PORT, I8042_CMD_SELF_TEST);
        assert_eq!(k.read(I8042_DATA_PORT), 0x55);
        // A keyboard byte goes nowhere; an output-port write with bit 0 set is no reset.
        k.write(I8042_DATA_PORT, 0xf2);
        k.write(I8042_CMD_PORT, I8042_CMD_WRITE_OUTPUT);
        k.write(I8042_DATA_PORT, 0x01);
        assert!(!k.reset_requested());
        k.write(I8042_CMD_PORT, I8042_CMD_WRITE_OUTPUT);
        k.write(I8042_DATA_PORT, 0x00);
        assert!(k.reset_requested());
    }
}
