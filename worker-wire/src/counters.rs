//! The counters page: what the worker's GPU counts per channel, where the backend's
//! scheduler reads it every interval with plain loads (no syscall on that path).
//!
//! One record of [`RECORD_WORDS`] `u64`s per channel slot (the slot the worker gave the
//! channel, the same as its control page's). The worker publishes every live channel's
//! record often (a millisecond or so); the backend reads it.
//!
//! Each record is a sequence lock. The writer (one thread in the worker) makes the
//! sequence word odd, stores the fields, then makes it even again, with release order; a
//! reader takes the fields only if it saw the same even sequence before and after them
//! (acquire order), so it never mixes two publications. The worker is untrusted: a reader
//! gives up after a bounded number of tries ([`ReadError::Torn`]), and checks every field
//! it decodes ([`ReadError::Code`]); the caller keeps counters from going backwards.

use std::sync::atomic::{fence, AtomicU64, Ordering};

use vgpu_protocol::{ErrorCode, PAGE_SIZE};

/// `u64` words per record.
pub const RECORD_WORDS: usize = 8;
const RECORD_BYTES: u64 = (RECORD_WORDS * 8) as u64;

const SEQ: usize = 0;
const BUSY_NS: usize = 1;
const GP_COMPLETED: usize = 2;
const KERNELS: usize = 3;
const COPIES: usize = 4;
const SEM_WAIT_NS: usize = 5;
const ERROR: usize = 6;
const ERROR_INFO: usize = 7;

/// Reads a reader tries before it calls a record torn.
const MAX_TRIES: u32 = 10_000;

/// Bytes of the counters page of a worker with `slots` channel slots (whole pages).
pub fn page_len(slots: u32) -> u64 {
    (u64::from(slots) * RECORD_BYTES).div_ceil(PAGE_SIZE) * PAGE_SIZE
}

/// One channel's counters as published.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Record {
    pub busy_ns: u64,
    pub gp_completed: u64,
    pub kernels: u64,
    pub copies: u64,
    pub sem_wait_ns: u64,
    /// The error the channel stopped on.
    pub error: Option<(ErrorCode, u64)>,
}

/// Why a record could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    #[error("the record changed under every read (a writer that never finishes)")]
    Torn,
    #[error("the record holds an unknown error code {0}")]
    Code(u64),
    #[error("slot {0} is outside the counters page")]
    Slot(u32),
}

/// The words of `slot`'s record in a page of `words`.
pub fn record(words: &[AtomicU64], slot: u32) -> Result<&[AtomicU64], ReadError> {
    let start = usize::try_from(slot)
        .ok()
        .and_then(|s| s.checked_mul(RECORD_WORDS))
        .ok_or(ReadError::Slot(slot))?;
    words
        .get(start..start + RECORD_WORDS)
        .ok_or(ReadError::Slot(slot))
}

/// Publishes `r` into `rec` (the worker; one writer per record).
pub fn publish(rec: &[AtomicU64], r: &Record) {
    let seq = rec[SEQ].load(Ordering::Relaxed);
    rec[SEQ].store(seq.wrapping_add(1) | 1, Ordering::Relaxed);
    fence(Ordering::Release);
    rec[BUSY_NS].store(r.busy_ns, Ordering::Relaxed);
    rec[GP_COMPLETED].store(r.gp_completed, Ordering::Relaxed);
    rec[KERNELS].store(r.kernels, Ordering::Relaxed);
    rec[COPIES].store(r.copies, Ordering::Relaxed);
    rec[SEM_WAIT_NS].store(r.sem_wait_ns, Ordering::Relaxed);
    let (code, info) = r.error.map_or((0, 0), |(c, i)| (u64::from(c.as_u32()), i));
    rec[ERROR].store(code, Ordering::Relaxed);
    rec[ERROR_INFO].store(info, Ordering::Relaxed);
    rec[SEQ].store((seq | 1).wrapping_add(1), Ordering::Release);
}

/// Zeroes a record (a slot given to a new channel), as one publication.
pub fn clear(rec: &[AtomicU64]) {
    publish(rec, &Record::default());
}

/// Reads `rec` (the backend).
pub fn read(rec: &[AtomicU64]) -> Result<Record, ReadError> {
    for _ in 0..MAX_TRIES {
        let before = rec[SEQ].load(Ordering::Acquire);
        if before & 1 == 1 {
            std::hint::spin_loop();
            continue;
        }
        let words: [u64; RECORD_WORDS] = std::array::from_fn(|i| rec[i].load(Ordering::Relaxed));
        fence(Ordering::Acquire);
        if rec[SEQ].load(Ordering::Relaxed) != before {
            continue;
        }
        let error = match words[ERROR] {
            0 => None,
            c => {
                let code = u32::try_from(c)
                    .ok()
                    .and_then(|c| ErrorCode::from_u32(c).ok())
                    .filter(|c| *c != ErrorCode::Ok)
                    .ok_or(ReadError::Code(c))?;
                Some((code, words[ERROR_INFO]))
            }
        };
        return Ok(Record {
            busy_ns: words[BUSY_NS],
            gp_completed: words[GP_COMPLETED],
            kernels: words[KERNELS],
            copies: words[COPIES],
            sem_wait_ns: words[SEM_WAIT_NS],
            error,
        });
    }
    Err(ReadError::Torn)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(slots: u32) -> Vec<AtomicU64> {
        (0..page_len(slots) / 8)
            .map(|_| AtomicU64::new(0))
            .collect()
    }

    #[test]
    fn a_published_record_reads_back() {
        let p = page(4);
        assert_eq!(page_len(4), PAGE_SIZE);
        assert_eq!(page_len(65), 2 * PAGE_SIZE);
        let r = Record {
            busy_ns: 5,
            gp_completed: 6,
            kernels: 7,
            copies: 8,
            sem_wait_ns: 9,
            error: Some((ErrorCode::MmuFault, 0xdead)),
        };
        publish(record(&p, 3).unwrap(), &r);
        assert_eq!(read(record(&p, 3).unwrap()), Ok(r));
        assert_eq!(read(record(&p, 2).unwrap()), Ok(Record::default()));
        clear(record(&p, 3).unwrap());
        assert_eq!(read(record(&p, 3).unwrap()), Ok(Record::default()));
        assert_eq!(record(&p, 64).err(), Some(ReadError::Slot(64)));
    }

    #[test]
    fn a_hostile_writer_cannot_make_a_reader_hang_or_lie() {
        let p = page(1);
        let rec = record(&p, 0).unwrap();
        rec[SEQ].store(7, Ordering::Relaxed);
        assert_eq!(read(rec), Err(ReadError::Torn));
        rec[SEQ].store(8, Ordering::Relaxed);
        rec[ERROR].store(99, Ordering::Relaxed);
        assert_eq!(read(rec), Err(ReadError::Code(99)));
    }

    #[test]
    fn a_reader_never_mixes_two_publications() {
        let p = std::sync::Arc::new(page(1));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (p2, stop2) = (p.clone(), stop.clone());
        let writer = std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop2.load(Ordering::Relaxed) {
                n += 1;
                let r = Record {
                    busy_ns: n,
                    gp_completed: n,
                    kernels: n,
                    copies: n,
                    sem_wait_ns: n,
                    error: None,
                };
                publish(record(&p2, 0).unwrap(), &r);
            }
        });
        // Reads while the writer runs: from its first publication (a loaded machine may
        // start it late) until it has published many more.
        let rec = record(&p, 0).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let first = loop {
            match read(rec) {
                Ok(r) if r.busy_ns > 0 => break r.busy_ns,
                _ if std::time::Instant::now() > deadline => panic!("the writer never ran"),
                _ => std::thread::yield_now(),
            }
        };
        let (mut seen, mut reads) = (first, 0u64);
        while (seen < first + 10_000 || reads < 100_000) && std::time::Instant::now() < deadline {
            if let Ok(r) = read(rec) {
                assert!(r.busy_ns == r.gp_completed && r.kernels == r.copies);
                assert_eq!(r.busy_ns, r.sem_wait_ns);
                seen = seen.max(r.busy_ns);
                reads += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        assert!(reads >= 100_000, "{reads} consistent reads");
    }
}
