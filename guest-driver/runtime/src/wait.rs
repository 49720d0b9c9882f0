//! Waiting for the GPU without burning a core: spin briefly, then yield, then sleep.
//!
//! The project's machines have two cores shared by guests, backend and GPU model, so a
//! waiter must get off the CPU quickly when the GPU is not about to finish.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};

const SPIN_STEPS: u32 = 16;
const YIELD_STEPS: u32 = 32;
const FIRST_SLEEP: Duration = Duration::from_micros(10);
const MAX_SLEEP: Duration = Duration::from_millis(1);

/// Polls `done` with backoff until it returns `Some`, an error, or `deadline` passes.
pub(crate) fn poll_until<T>(
    deadline: Option<Instant>,
    mut done: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let mut step = 0u32;
    let mut sleep = FIRST_SLEEP;
    loop {
        if let Some(v) = done()? {
            return Ok(v);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(Error::Timeout);
        }
        if step < SPIN_STEPS {
            for _ in 0..(1 << step.min(6)) {
                std::hint::spin_loop();
            }
        } else if step < SPIN_STEPS + YIELD_STEPS {
            std::thread::yield_now();
        } else {
            let nap = match deadline {
                Some(d) => sleep.min(d.saturating_duration_since(Instant::now())),
                None => sleep,
            };
            std::thread::sleep(nap);
            sleep = (sleep * 2).min(MAX_SLEEP);
        }
        step = step.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_value_or_times_out() {
        let mut n = 0;
        let v = poll_until(None, || {
            n += 1;
            Ok((n == 100).then_some(n))
        });
        assert_eq!(v.unwrap(), 100);
        let t = Instant::now();
        let r: Result<()> = poll_until(Some(t + Duration::from_millis(20)), || Ok(None));
        assert!(matches!(r, Err(Error::Timeout)));
        assert!(t.elapsed() < Duration::from_secs(1));
    }
}
