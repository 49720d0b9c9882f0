//! PFIFO: the GPU's front end. It polls every channel's control page for new GP_PUT
//! values, fetches one GP entry per channel per turn in round-robin order, and hands the
//! work to an engine. Kernels are not preemptible: an entry keeps its engine until all of
//! its methods have run, so a channel with long kernels gets most of the GPU — the
//! unfairness the backend's scheduler exists to correct.
//!
//! Compute engines are slots owned by this thread. CPU-bound kernels run inline here
//! (a 2-core host gains nothing from running them in parallel); spin kernels occupy their
//! slot until a deadline without burning a core. The copy engine is a separate thread so
//! transfers overlap compute, as on hardware.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::sync::Arc;

use vgpu_protocol::{counter_after, ControlPage, ErrorCode};

use super::channel::SimChannel;
use super::exec::{self, EngineKind, Step, WorkItem};
use super::{CopyJob, Shared};
use crate::clock::{now_ns, thread_cpu_ns};
use crate::fifo::control_pages::add;
use crate::hal::ChannelId;

/// The PFIFO's private view of a channel.
struct ChanExec {
    ch: Arc<SimChannel>,
    /// GP entries completed (authoritative; the control page holds a mirror the guest
    /// could scribble on).
    get: u32,
    /// The entry being executed, if any.
    item: Option<WorkItem>,
    /// True while an engine holds the entry.
    on_engine: bool,
}

#[derive(Clone, Copy)]
enum Slot {
    Idle,
    /// A spin kernel holds the slot until `until`; `start` is when the entry took the slot.
    Spinning {
        chan: ChannelId,
        start: u64,
        until: u64,
    },
}

pub struct Pfifo {
    shared: Arc<Shared>,
    copy_tx: Sender<CopyJob>,
    chans: Vec<ChanExec>,
    seen_gen: u64,
    slots: Vec<Slot>,
    copy_busy: bool,
    rr: usize,
    last_activity: u64,
    idle_sleep_ns: u64,
}

impl Pfifo {
    pub fn new(shared: Arc<Shared>, copy_tx: Sender<CopyJob>) -> Self {
        let engines = shared.cfg.compute_engines.max(1) as usize;
        Pfifo {
            shared,
            copy_tx,
            chans: Vec::new(),
            seen_gen: u64::MAX,
            slots: vec![Slot::Idle; engines],
            copy_busy: false,
            rr: 0,
            last_activity: now_ns(),
            idle_sleep_ns: 0,
        }
    }

    pub fn run(mut self) {
        let mut iterations = 0u64;
        while !self.shared.shutdown.load(Ordering::Acquire) {
            self.refresh();
            let mut progress = self.expire_timers();
            progress |= self.reap_copies();
            progress |= self.dispatch();
            iterations += 1;
            if progress {
                self.last_activity = now_ns();
                self.idle_sleep_ns = 0;
                if iterations.is_multiple_of(256) {
                    self.publish_cpu();
                }
            } else {
                self.idle();
            }
        }
        self.publish_cpu();
    }

    fn publish_cpu(&self) {
        self.shared
            .pfifo_cpu_ns
            .store(thread_cpu_ns(), Ordering::Relaxed);
    }

    /// Picks up created and destroyed channels.
    fn refresh(&mut self) {
        let gen = self.shared.fifo.gen();
        if gen == self.seen_gen {
            return;
        }
        self.seen_gen = gen;
        let current = self.shared.fifo.channels();
        let mut old: HashMap<ChannelId, ChanExec> =
            self.chans.drain(..).map(|e| (e.ch.core.id, e)).collect();
        self.chans = current
            .into_iter()
            .map(|ch| {
                old.remove(&ch.core.id).unwrap_or_else(|| ChanExec {
                    get: ch.core.start_get(),
                    ch,
                    item: None,
                    on_engine: false,
                })
            })
            .collect();
        // Destroyed channels release any compute slot they held.
        for s in &mut self.slots {
            if let Slot::Spinning { chan, .. } = *s {
                if old.contains_key(&chan) {
                    *s = Slot::Idle;
                }
            }
        }
    }

    fn index_of(&self, id: ChannelId) -> Option<usize> {
        self.chans.iter().position(|e| e.ch.core.id == id)
    }

    /// Ends spin kernels whose deadline passed and continues their entries.
    fn expire_timers(&mut self) -> bool {
        let mut progress = false;
        for s in 0..self.slots.len() {
            let Slot::Spinning { chan, start, until } = self.slots[s] else {
                continue;
            };
            let Some(i) = self.index_of(chan) else {
                self.slots[s] = Slot::Idle;
                continue;
            };
            let now = now_ns();
            let stopped = self.chans[i].ch.core.is_stopped();
            if now < until && !stopped {
                continue;
            }
            progress = true;
            let e = &mut self.chans[i];
            e.ch.clear_running();
            e.ch.charge(now.min(until).saturating_sub(start));
            self.slots[s] = Slot::Idle;
            if stopped {
                e.item = None;
                e.on_engine = false;
                continue;
            }
            // The entry keeps its engine: run the rest of its methods.
            self.slots[s] = run_entry(e, &self.shared).0;
        }
        progress
    }

    fn reap_copies(&mut self) -> bool {
        let done = self.shared.take_copy_results();
        let mut progress = false;
        for r in done {
            self.copy_busy = false;
            progress |= !(r.step == Step::Stalled && r.item.pc == r.pc_before);
            if let Some(i) = self.index_of(r.chan) {
                let e = &mut self.chans[i];
                let stalled_at_once = r.step == Step::Stalled && r.item.pc == r.pc_before;
                e.item = Some(r.item);
                if !stalled_at_once {
                    e.ch.charge(r.busy_ns);
                }
                finish(e, r.step, now_ns(), !stalled_at_once);
            }
        }
        progress
    }

    /// One pass over the channels in round-robin order, starting after the last served.
    fn dispatch(&mut self) -> bool {
        let n = self.chans.len();
        let mut progress = false;
        for k in 0..n {
            let i = (self.rr + k) % n;
            let e = &mut self.chans[i];
            if e.on_engine || e.ch.core.is_stopped() {
                continue;
            }
            if e.item.is_none() {
                match next_entry(e, &self.shared) {
                    Ok(Some(item)) => e.item = Some(item),
                    Ok(None) => continue,
                    Err((code, info)) => {
                        e.ch.core.fault(code, info);
                        progress = true;
                        continue;
                    }
                }
            }
            let kind = match &e.item {
                Some(item) => item.engine(),
                None => continue,
            };
            match kind {
                EngineKind::Compute => {
                    let Some(s) = self.slots.iter().position(|s| matches!(s, Slot::Idle)) else {
                        continue;
                    };
                    let (slot, moved) = run_entry(e, &self.shared);
                    self.slots[s] = slot;
                    if !moved {
                        continue;
                    }
                }
                EngineKind::Copy => {
                    if self.copy_busy {
                        continue;
                    }
                    // Semaphore waits at the head are checked here, not on the copy engine.
                    let t0 = now_ns();
                    let (step, pc) = match e.item.as_mut() {
                        Some(item) => {
                            let pc = item.pc;
                            (exec::host_prefix(&e.ch, &self.shared.vram, item), pc)
                        }
                        None => continue,
                    };
                    if step != Step::Ready {
                        let moved = e.item.as_ref().is_none_or(|it| it.pc != pc);
                        finish(e, step, t0, moved);
                        if step == Step::Stalled && !moved {
                            continue;
                        }
                        progress = true;
                        continue;
                    }
                    // Its head moved past any semaphore wait.
                    e.ch.core.sem_wait.end(now_ns(), 0);
                    let Some(item) = e.item.take() else {
                        continue;
                    };
                    let job = CopyJob {
                        ch: e.ch.clone(),
                        item,
                    };
                    if self.copy_tx.send(job).is_err() {
                        // The copy engine is gone: only happens at shutdown.
                        e.ch.core.fault(ErrorCode::Internal, 0);
                        continue;
                    }
                    e.on_engine = true;
                    self.copy_busy = true;
                }
                EngineKind::None => {
                    if !run_entry(e, &self.shared).1 {
                        continue;
                    }
                }
            }
            progress = true;
            self.rr = i + 1;
        }
        progress
    }

    /// Waits for work without burning a core: spins briefly after activity (so
    /// back-to-back submissions see microsecond latency), then sleeps with growing
    /// intervals, or with nothing to do until a doorbell ([`crate::fifo::doze`]); a
    /// doorbell or a finishing copy unparks the thread.
    fn idle(&mut self) {
        let cfg = &self.shared.cfg;
        let now = now_ns();
        let next_deadline = self
            .slots
            .iter()
            .filter_map(|s| match s {
                Slot::Spinning { until, .. } => Some(*until),
                Slot::Idle => None,
            })
            .min();
        if let Some(d) = next_deadline {
            if d <= now + cfg.spin_window_ns {
                std::hint::spin_loop();
                return;
            }
        }
        let all_compute_busy = self.slots.iter().all(|s| !matches!(s, Slot::Idle));
        if !all_compute_busy && now.saturating_sub(self.last_activity) < cfg.busy_poll_ns {
            std::hint::spin_loop();
            return;
        }
        // Nothing running, copying or stalled (a stalled entry polls its semaphore): sleep
        // until a doorbell.
        let quiet = next_deadline.is_none()
            && !self.copy_busy
            && self.chans.iter().all(|e| e.item.is_none());
        if quiet && cfg.doorbell_sleep_ns > 0 {
            self.publish_cpu();
            crate::fifo::doze::sleep_with_doorbell(
                &self.chans,
                |e| &e.ch.core,
                |e| counter_after(e.ch.core.load(ControlPage::GP_PUT), e.get),
                std::time::Duration::from_nanos(cfg.doorbell_sleep_ns),
            );
            return;
        }
        self.idle_sleep_ns =
            (self.idle_sleep_ns * 2).clamp(cfg.min_idle_sleep_ns, cfg.max_idle_sleep_ns);
        let mut wait = self.idle_sleep_ns;
        if let Some(d) = next_deadline {
            wait = wait.min(d - now - cfg.spin_window_ns);
        }
        self.publish_cpu();
        std::thread::park_timeout(std::time::Duration::from_nanos(wait));
    }
}

/// Looks for the channel's next GP entry and fetches it.
fn next_entry(e: &mut ChanExec, shared: &Shared) -> Result<Option<WorkItem>, (ErrorCode, u64)> {
    // One entry at a time: the next to fetch is the next to complete.
    let methods = e.ch.core.fetch_next(e.get, e.get, Some(&shared.vram))?;
    Ok(methods.map(|methods| WorkItem { methods, pc: 0 }))
}

/// Runs the channel's current entry from where it stopped. Returns the engine slot's
/// state and whether anything happened: an entry that stalls on a semaphore before
/// running any method made no progress (and is charged no engine time), so the PFIFO
/// may back off instead of spinning on it.
fn run_entry(e: &mut ChanExec, shared: &Shared) -> (Slot, bool) {
    let t0 = now_ns();
    let (step, moved) = match e.item.as_mut() {
        Some(item) => {
            let pc = item.pc;
            let step = exec::run(&e.ch, &shared.vram, item, &e.ch.core.stopped);
            (step, step != Step::Stalled || item.pc != pc)
        }
        None => (Step::Done, true),
    };
    (finish(e, step, t0, moved), moved)
}

/// Applies the outcome of running an entry; returns the state of the engine slot it used.
/// `charge` is false when nothing ran (a stall at the first method tried).
fn finish(e: &mut ChanExec, step: Step, start: u64, charge: bool) -> Slot {
    let now = now_ns();
    // A stall is a semaphore wait: one that goes on (nothing ran), or a new one after
    // methods that ran; anything else moved the entry on and ends a wait.
    if step == Step::Stalled {
        if charge {
            e.ch.core.sem_wait.end(now, 0);
        }
        e.ch.core.sem_wait.begin(if charge { now } else { start });
    } else {
        e.ch.core.sem_wait.end(now, 0);
    }
    match step {
        Step::Spin { ns } => {
            e.on_engine = true;
            let until = now.saturating_add(ns);
            e.ch.set_running(start, until);
            return Slot::Spinning {
                chan: e.ch.core.id,
                start,
                until,
            };
        }
        Step::Done => {
            e.ch.charge(now - start);
            e.get = e.get.wrapping_add(1);
            e.ch.core.store(ControlPage::GP_GET, e.get);
            add(&e.ch.core.gp_completed, 1);
            e.ch.core.note_activity();
            e.item = None;
        }
        Step::Stalled => {
            if charge {
                e.ch.charge(now - start);
            }
        }
        Step::Fault(code, info) => {
            e.ch.charge(now - start);
            e.ch.core.fault(code, info);
            e.item = None;
        }
        Step::Aborted => e.item = None,
        // Engine work is next: the caller hands the entry to an engine.
        Step::Ready => {}
    }
    e.on_engine = false;
    Slot::Idle
}
