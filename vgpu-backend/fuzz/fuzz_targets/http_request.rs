//! The control API's hand-written HTTP/1.1 request parser (`api::http::RequestReader`)
//! fed arbitrary bytes: no input may panic or hang, every request it accepts keeps the
//! parser's limits, and every error it reports maps to a status or to closing.
//!
//! Input: `[chunk, bytes..]`. The bytes are the connection's stream, delivered `chunk`
//! bytes per read (1..=256), so heads, bodies and pipelined requests are split at every
//! place; the stream ends (EOF) after the last byte.
#![no_main]

use std::io::{self, Read};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use vgpu_backend::api::http::{
    HttpError, RequestReader, TimedRead, MAX_BODY_BYTES, MAX_HEADERS,
};

/// A connection whose peer has sent `data` and then closed it.
struct Stream<'a> {
    data: &'a [u8],
    chunk: usize,
}

impl Read for Stream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.chunk.min(buf.len()).min(self.data.len());
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Ok(n)
    }
}

impl TimedRead for Stream<'_> {
    fn set_timeout(&self, _: Option<Duration>) -> io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|input: &[u8]| {
    let Some((&chunk, data)) = input.split_first() else {
        return;
    };
    let mut reader = RequestReader::new(Stream {
        data,
        chunk: usize::from(chunk) + 1,
    });
    // Each accepted request consumes at least its 4-byte head terminator, so this ends.
    for _ in 0..=data.len() / 4 {
        match reader.next(Duration::from_secs(10), Duration::from_secs(10)) {
            Ok(req) => {
                assert!(req.path.starts_with('/'), "{req:?}");
                assert!(!req.method.is_empty());
                assert!(req.headers.len() <= MAX_HEADERS);
                assert!(req.body.len() <= MAX_BODY_BYTES);
                assert!(req.headers.iter().all(|(n, _)| *n == n.to_ascii_lowercase()));
            }
            Err(e) => {
                // Every error but the peer going away is answered with a status.
                assert_eq!(
                    e.status().is_none(),
                    matches!(e, HttpError::Closed | HttpError::Io(_)),
                    "{e}"
                );
                return;
            }
        }
    }
    panic!("more requests than the input can hold");
});
