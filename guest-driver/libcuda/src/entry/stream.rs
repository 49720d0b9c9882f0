//! Streams (a channel each) and events (a semaphore each, released by the GPU with its
//! clock when the stream gets there).

#![allow(non_snake_case)]

use std::ffi::{c_int, c_uint};

use vgpu_guest::SemaphoreMode;

use super::{handle, id_of, out};
use crate::driver::{self, Driver, Event, Stream, SYNC_PATIENCE};
use crate::errors::{from_error, guard, CuResult};
use crate::types::*;

fn create_stream(ps: *mut CUstream, flags: c_uint) -> CuResult {
    if ps.is_null() || flags & !CU_STREAM_NON_BLOCKING != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let id = driver::with_current(|st| {
        let s = Stream::new(&st.ctx, flags & CU_STREAM_NON_BLOCKING == 0)?;
        let id = driver::next_id();
        st.streams.insert(id, s);
        Ok(id)
    })?;
    out(ps, handle(id))
}

#[no_mangle]
pub extern "C" fn cuStreamCreate(ps: *mut CUstream, flags: c_uint) -> CUresult {
    guard("cuStreamCreate", || create_stream(ps, flags))
}

#[no_mangle]
pub extern "C" fn cuStreamCreateWithPriority(
    ps: *mut CUstream,
    flags: c_uint,
    _priority: c_int,
) -> CUresult {
    // Priorities between one process's streams are a hint; the host's scheduler decides
    // between VMs and processes.
    guard("cuStreamCreateWithPriority", || create_stream(ps, flags))
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(s: CUstream) -> CUresult {
    guard("cuStreamDestroy", || {
        driver::with(|d| {
            let (_, st) = d.current()?;
            let mut stream = st
                .streams
                .remove(&id_of(s))
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            // CUDA lets queued work finish after the destroy; here the call waits for it.
            if st.sticky.is_none() {
                stream.sync().map_err(|c| st.note(c))?;
            }
            Ok(())
        })
    })
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy(s: CUstream) -> CUresult {
    cuStreamDestroy_v2(s)
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(s: CUstream) -> CUresult {
    guard("cuStreamSynchronize", || {
        driver::with_current(|st| st.stream(s)?.sync())
    })
}

#[no_mangle]
pub extern "C" fn cuStreamQuery(s: CUstream) -> CUresult {
    guard("cuStreamQuery", || {
        driver::with_current(|st| {
            let stream = st.stream(s)?;
            if stream.ch.has_pending() {
                stream.submit()?;
            }
            match stream.idle()? {
                true => Ok(()),
                false => Err(CUDA_ERROR_NOT_READY),
            }
        })
    })
}

#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(s: CUstream, e: CUevent, _flags: c_uint) -> CUresult {
    guard("cuStreamWaitEvent", || {
        driver::with(|d| {
            let (ctx, st, events) = d.current_and_events()?;
            st.alive()?;
            let ev = events.get(&id_of(e)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            if ev.ctx != ctx {
                return Err(CUDA_ERROR_INVALID_HANDLE);
            }
            // An event never recorded is complete: nothing to wait for.
            if ev.recorded.is_none() {
                return Ok(());
            }
            let (va, seq) = (st.event_va(ev.slot)?, ev.seq);
            let stream = st.stream(s)?;
            stream
                .ch
                .sem_acquire(va, seq, SemaphoreMode::AtLeast)
                .map_err(|e| from_error(&e))
        })
    })
}

#[no_mangle]
pub extern "C" fn cuEventCreate(pe: *mut CUevent, flags: c_uint) -> CUresult {
    guard("cuEventCreate", || {
        if pe.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = driver::with(|d| {
            let (ctx, st) = d.current()?;
            st.alive()?;
            let slot = st.take_slot()?;
            let id = driver::next_id();
            d.events.insert(
                id,
                Event {
                    ctx,
                    slot,
                    seq: 0,
                    recorded: None,
                    timing: flags & CU_EVENT_DISABLE_TIMING == 0,
                },
            );
            Ok(id)
        })?;
        out(pe, handle(id))
    })
}

#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(e: CUevent) -> CUresult {
    guard("cuEventDestroy", || {
        driver::with(|d| {
            let ev = d
                .events
                .remove(&id_of(e))
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            // The slot is reused only once its last release has landed.
            if let Ok(st) = d.ctx(ev.ctx) {
                let done = match ev.recorded {
                    Some((s, f)) => stream_of(st, s)
                        .map(|stream| stream.ch.is_complete(f).unwrap_or(true))
                        .unwrap_or(true),
                    None => true,
                };
                if done {
                    st.free_slots.push(ev.slot);
                }
            }
            Ok(())
        })
    })
}

#[no_mangle]
pub extern "C" fn cuEventDestroy(e: CUevent) -> CUresult {
    cuEventDestroy_v2(e)
}

/// The stream an event was recorded on, if it still exists (a destroyed stream finished
/// its work before it went).
fn stream_of(st: &mut driver::CtxState, id: u64) -> Option<&mut Stream> {
    if id == 0 {
        Some(&mut st.default_stream)
    } else {
        st.streams.get_mut(&id)
    }
}

#[no_mangle]
pub extern "C" fn cuEventRecord(e: CUevent, s: CUstream) -> CUresult {
    guard("cuEventRecord", || {
        driver::with(|d| {
            let (ctx, st, events) = d.current_and_events()?;
            st.alive()?;
            let ev = events.get_mut(&id_of(e)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            if ev.ctx != ctx {
                return Err(CUDA_ERROR_INVALID_HANDLE);
            }
            let va = st.event_va(ev.slot)?;
            let seq = ev.seq.wrapping_add(1);
            let sid = match s as usize {
                0 | CU_STREAM_LEGACY | CU_STREAM_PER_THREAD => 0,
                id => id as u64,
            };
            let stream = st.stream(s)?;
            let r = if ev.timing {
                stream.ch.sem_release_timestamp(va, seq)
            } else {
                stream.ch.sem_release(va, seq)
            };
            r.map_err(|e| from_error(&e))?;
            let f = stream.submit().map_err(|c| st.note(c))?;
            ev.seq = seq;
            ev.recorded = Some((sid, f));
            Ok(())
        })
    })
}

#[no_mangle]
pub extern "C" fn cuEventRecordWithFlags(e: CUevent, s: CUstream, _flags: c_uint) -> CUresult {
    cuEventRecord(e, s)
}

/// Whether the event's last record has completed (waiting for it when `wait`).
fn event_done(d: &mut Driver, e: CUevent, wait: bool) -> CuResult<bool> {
    let ev = d.events.get(&id_of(e)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    let Some((sid, f)) = ev.recorded else {
        return Ok(true);
    };
    let st = d.ctx(ev.ctx)?;
    st.alive()?;
    let Some(stream) = stream_of(st, sid) else {
        return Ok(true);
    };
    let r = if wait {
        stream.ch.wait_timeout(f, SYNC_PATIENCE).map(|_| true)
    } else {
        stream.ch.is_complete(f)
    };
    r.map_err(|e| st.note(from_error(&e)))
}

#[no_mangle]
pub extern "C" fn cuEventSynchronize(e: CUevent) -> CUresult {
    guard("cuEventSynchronize", || {
        driver::with(|d| event_done(d, e, true).map(|_| ()))
    })
}

#[no_mangle]
pub extern "C" fn cuEventQuery(e: CUevent) -> CUresult {
    guard("cuEventQuery", || {
        match driver::with(|d| event_done(d, e, false))? {
            true => Ok(()),
            false => Err(CUDA_ERROR_NOT_READY),
        }
    })
}

#[no_mangle]
pub extern "C" fn cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent) -> CUresult {
    guard("cuEventElapsedTime", || {
        let t = driver::with(|d| {
            let mut times = [0u64; 2];
            for (i, e) in [start, end].into_iter().enumerate() {
                let ev = d.events.get(&id_of(e)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
                if !ev.timing || ev.recorded.is_none() {
                    return Err(CUDA_ERROR_INVALID_HANDLE);
                }
                let (ctx, slot) = (ev.ctx, ev.slot);
                if !event_done(d, e, false)? {
                    return Err(CUDA_ERROR_NOT_READY);
                }
                times[i] = d.ctx(ctx)?.event_time(slot)?;
            }
            Ok(times[1] as f64 - times[0] as f64)
        })?;
        out(ms, (t / 1e6) as f32)
    })
}
