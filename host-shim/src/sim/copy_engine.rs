//! The copy engine: a thread that runs entries routed to it, concurrently with compute.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use super::exec;
use super::{CopyJob, CopyResult, Shared};
use crate::clock::{now_ns, thread_cpu_ns};

pub fn run(shared: Arc<Shared>, rx: Receiver<CopyJob>) {
    loop {
        let job = match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(job) => job,
            Err(RecvTimeoutError::Timeout) => {
                if shared.shutdown.load(Ordering::Acquire) {
                    break;
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        let CopyJob { ch, mut item } = job;
        let t0 = now_ns();
        let pc_before = item.pc;
        let step = exec::run(&ch, &shared.vram, &mut item, &ch.core.stopped);
        let busy_ns = now_ns() - t0;
        shared.copy_cpu_ns.store(thread_cpu_ns(), Ordering::Relaxed);
        shared.push_copy_result(CopyResult {
            chan: ch.core.id,
            item,
            step,
            busy_ns,
            pc_before,
        });
    }
}
