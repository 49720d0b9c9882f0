//! Circular allocation of per-submission data (push buffers, kernel arguments) that the
//! GPU reads after GP_PUT moves and that may be reused only once GP_GET has passed it.

use std::collections::VecDeque;

/// Result of an allocation attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Alloc {
    /// Space at this byte offset of the arena.
    At(u64),
    /// Full: wait until GP_GET reaches this submission counter, then retry.
    WaitFor(u32),
    /// The request cannot fit even with the arena empty of submitted work.
    TooLarge,
}

/// A ring of `cap` bytes. Positions are monotonic byte counts (offset = pos % cap), so
/// "used" is simply `head - tail`. Allocations made since the last submission are
/// *pending*; [`RingArena::commit`] tags them with the submission's GP_PUT value.
#[derive(Debug)]
pub(crate) struct RingArena {
    cap: u64,
    head: u64,
    tail: u64,
    /// Committed spans in order: (GP_PUT value that completes them, end position).
    spans: VecDeque<(u32, u64)>,
}

impl RingArena {
    pub(crate) fn new(cap: u64) -> Self {
        RingArena {
            cap,
            head: 0,
            tail: 0,
            spans: VecDeque::new(),
        }
    }

    /// Frees spans whose submission GP_GET has passed.
    fn retire(&mut self, gp_get: u32) {
        while let Some(&(seq, end)) = self.spans.front() {
            if (gp_get.wrapping_sub(seq) as i32) < 0 {
                break;
            }
            self.tail = end;
            self.spans.pop_front();
        }
    }

    /// Tries to allocate `len` bytes aligned to `align` (a power of two dividing `cap`).
    pub(crate) fn alloc(&mut self, len: u64, align: u64, gp_get: u32) -> Alloc {
        if len == 0 || len > self.cap {
            return Alloc::TooLarge;
        }
        self.retire(gp_get);
        let mut pos = (self.head + align - 1) & !(align - 1);
        if pos % self.cap + len > self.cap {
            // Does not fit before the end: skip to the start of the next lap.
            pos = (pos / self.cap + 1) * self.cap;
        }
        let end = pos + len;
        if end - self.tail <= self.cap {
            self.head = end;
            return Alloc::At(pos % self.cap);
        }
        match self.spans.front() {
            Some(&(seq, _)) => Alloc::WaitFor(seq),
            // Only this submission's own pending data is in the way.
            None => Alloc::TooLarge,
        }
    }

    /// Tags everything allocated since the last commit with submission counter `seq`.
    pub(crate) fn commit(&mut self, seq: u32) {
        let last = self.spans.back().map_or(self.tail, |&(_, end)| end);
        if self.head > last {
            self.spans.push_back((seq, self.head));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_for_the_oldest_submission_before_reuse() {
        let mut a = RingArena::new(256);
        assert_eq!(a.alloc(100, 4, 0), Alloc::At(0));
        a.commit(1);
        assert_eq!(a.alloc(100, 4, 0), Alloc::At(100));
        a.commit(2);
        // 56 bytes left before the end; 64 do not fit, and the wrap would hit span 1.
        assert_eq!(a.alloc(64, 4, 0), Alloc::WaitFor(1));
        // Submission 1 completed: its bytes are free, the allocation wraps to 0.
        assert_eq!(a.alloc(64, 4, 1), Alloc::At(0));
        a.commit(3);
        assert_eq!(a.alloc(100, 4, 1), Alloc::WaitFor(2));
        assert_eq!(a.alloc(100, 4, 3), Alloc::At(64));
    }

    #[test]
    fn pending_data_alone_can_be_too_large() {
        let mut a = RingArena::new(128);
        assert_eq!(a.alloc(100, 4, 0), Alloc::At(0));
        assert_eq!(a.alloc(100, 4, 0), Alloc::TooLarge);
        assert_eq!(a.alloc(129, 4, 0), Alloc::TooLarge);
        assert_eq!(a.alloc(0, 4, 0), Alloc::TooLarge);
    }

    #[test]
    fn counters_wrap() {
        let mut a = RingArena::new(64);
        assert_eq!(a.alloc(64, 4, u32::MAX - 1), Alloc::At(0));
        a.commit(u32::MAX);
        assert_eq!(a.alloc(64, 4, u32::MAX - 1), Alloc::WaitFor(u32::MAX));
        assert_eq!(a.alloc(64, 4, 0), Alloc::At(0));
    }
}
