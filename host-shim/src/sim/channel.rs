//! A sim channel: configuration, control-page slot, counters and error state. The PFIFO's
//! execution state for it (fetch position, pending work) lives in the PFIFO thread.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vgpu_protocol::{ControlPage, ErrorCode};

use super::control_pages::ControlPages;
use crate::hal::{ChannelConfig, ChannelCounters, ChannelId, ContextId, EventSink, GpuEvent};
use crate::mmu::AddressSpace;

pub struct SimChannel {
    pub id: ChannelId,
    pub ctx: ContextId,
    pub space: Arc<AddressSpace>,
    pub cfg: ChannelConfig,
    pub slot: u32,
    pages: Arc<ControlPages>,
    sink: Arc<dyn EventSink>,
    busy_ns: AtomicU64,
    /// The context's running total, which outlives its channels.
    context_busy_ns: Arc<AtomicU64>,
    pub gp_completed: AtomicU64,
    pub kernels: AtomicU64,
    pub copies: AtomicU64,
    error: Mutex<Option<(ErrorCode, u64)>>,
    /// Set once the channel has stopped (error, kill or destroy): engines drop its work.
    pub stopped: AtomicBool,
}

/// What a channel shares with its context.
pub struct Owner {
    pub ctx: ContextId,
    pub space: Arc<AddressSpace>,
    pub busy_ns: Arc<AtomicU64>,
}

impl SimChannel {
    pub fn new(
        id: ChannelId,
        owner: Owner,
        cfg: ChannelConfig,
        slot: u32,
        pages: Arc<ControlPages>,
        sink: Arc<dyn EventSink>,
    ) -> Self {
        pages.init(slot, cfg.gp_entries);
        let Owner {
            ctx,
            space,
            busy_ns: context_busy_ns,
        } = owner;
        SimChannel {
            id,
            ctx,
            space,
            cfg,
            slot,
            pages,
            sink,
            busy_ns: AtomicU64::new(0),
            context_busy_ns,
            gp_completed: AtomicU64::new(0),
            kernels: AtomicU64::new(0),
            copies: AtomicU64::new(0),
            error: Mutex::new(None),
            stopped: AtomicBool::new(false),
        }
    }

    pub fn load(&self, field: usize) -> u32 {
        self.pages.load(self.slot, field)
    }

    pub fn store(&self, field: usize, v: u32) {
        self.pages.store(self.slot, field, v)
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    pub fn error(&self) -> Option<(ErrorCode, u64)> {
        *self.error.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops the channel with an error: recorded, written to the control page, and sent
    /// to the owner once. Later faults of an already stopped channel are ignored.
    pub fn fault(&self, code: ErrorCode, info: u64) {
        {
            let mut e = self.error.lock().unwrap_or_else(|e| e.into_inner());
            if e.is_some() {
                return;
            }
            *e = Some((code, info));
        }
        self.stopped.store(true, Ordering::Release);
        self.pages
            .store_u64(self.slot, ControlPage::ERROR_INFO, info);
        self.store(ControlPage::ERROR, code.as_u32());
        log::debug!("channel {:?} faulted: {code} ({info:#x})", self.id);
        self.sink.event(GpuEvent::Error {
            channel: self.id,
            code,
            info,
        });
    }

    /// Stops the channel without an error event (destroy).
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
    }

    /// Charges engine time to the channel and its context.
    pub fn charge(&self, ns: u64) {
        self.busy_ns.fetch_add(ns, Ordering::Relaxed);
        self.context_busy_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub fn notify(&self, token: u32) {
        self.pages.bump(self.slot, ControlPage::NOTIFY_SEQ);
        self.sink.event(GpuEvent::Notify {
            channel: self.id,
            token,
        });
    }

    pub fn counters(&self) -> ChannelCounters {
        ChannelCounters {
            busy_ns: self.busy_ns.load(Ordering::Relaxed),
            gp_completed: self.gp_completed.load(Ordering::Relaxed),
            kernels: self.kernels.load(Ordering::Relaxed),
            copies: self.copies.load(Ordering::Relaxed),
        }
    }
}

impl Drop for SimChannel {
    fn drop(&mut self) {
        // The last reference is gone (no engine holds the channel), so the slot can be reused.
        self.pages.give_back(self.slot);
    }
}
