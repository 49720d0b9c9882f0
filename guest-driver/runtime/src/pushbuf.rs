//! The pending push buffer of a channel: methods recorded since the last submit.

use vgpu_protocol::gp::MAX_PB_WORDS;
use vgpu_protocol::Method;

use crate::error::{Error, Result};

/// Words kept free at the end of every segment for the `SET_REF` that closes it.
const RESERVED_WORDS: usize = 2;

/// Method words waiting for the next GP entry.
#[derive(Debug, Default)]
pub(crate) struct PushBuffer {
    words: Vec<u32>,
}

impl PushBuffer {
    /// Fails unless `n` more words fit in this segment.
    pub(crate) fn room_for(&self, n: usize) -> Result<()> {
        if self.words.len() + n + RESERVED_WORDS > MAX_PB_WORDS as usize {
            return Err(Error::SubmissionTooLarge(
                "push buffer segment full; submit first",
            ));
        }
        Ok(())
    }

    pub(crate) fn push(&mut self, m: &Method) -> Result<()> {
        self.room_for(m.len_words())?;
        m.encode_into(&mut self.words);
        Ok(())
    }

    /// Appends words as they are, valid or not (for tests of the GPU's validation).
    pub(crate) fn push_raw(&mut self, words: &[u32]) -> Result<()> {
        self.room_for(words.len())?;
        self.words.extend_from_slice(words);
        Ok(())
    }

    /// Closes the segment with `SET_REF value` (always fits: room is reserved).
    pub(crate) fn close(&mut self, fence: u32) {
        Method::SetRef { value: fence }.encode_into(&mut self.words);
    }

    pub(crate) fn words(&self) -> &[u32] {
        &self.words
    }

    pub(crate) fn len(&self) -> usize {
        self.words.len()
    }

    pub(crate) fn clear(&mut self) {
        self.words.clear();
    }

    /// Drops words appended after `len` (undoes a failed `close`).
    pub(crate) fn truncate(&mut self, len: usize) {
        self.words.truncate(len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_to_overflow_a_segment() {
        let mut p = PushBuffer::default();
        let big = vec![0u32; MAX_PB_WORDS as usize - RESERVED_WORDS];
        p.push_raw(&big).unwrap();
        assert!(p.push(&Method::Nop).is_err());
        p.close(7);
        assert_eq!(p.len(), MAX_PB_WORDS as usize);
        assert_eq!(&p.words()[p.len() - 2..], &[0x0105, 7]);
    }
}
