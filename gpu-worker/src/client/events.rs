//! The backend's event thread for one worker: decodes the worker's events (untrusted),
//! hands each to its channel's sink, and when the worker goes away tells every channel
//! it has lost its GPU.

use std::os::fd::AsFd;
use std::sync::Arc;

use log::{info, warn};
use vgpu_host_shim::{ChannelId, GpuEvent};
use vgpu_protocol::ErrorCode;
use vgpu_worker_wire::{decode_event, Event};

use super::Inner;
use crate::socket;

pub(super) fn run(inner: Arc<Inner>) {
    let why = loop {
        let got = match socket::recv(inner.events.as_fd()) {
            Ok(Some(r)) => r,
            Ok(None) => break "the worker exited".to_string(),
            Err(e) => break format!("event socket: {e}"),
        };
        let ev = match decode_event(&got.frame, got.fds.len() as u8) {
            Ok((_, ev)) => ev,
            Err(e) => break format!("a bad event frame: {e}"),
        };
        let (ch, gev) = match ev {
            Event::Notify { ch, token } => (
                ch,
                GpuEvent::Notify {
                    channel: ChannelId(ch),
                    token,
                },
            ),
            Event::Fence { ch, reference } => (
                ch,
                GpuEvent::Fence {
                    channel: ChannelId(ch),
                    reference,
                },
            ),
            Event::Error { ch, code, info } => (
                ch,
                GpuEvent::Error {
                    channel: ChannelId(ch),
                    code,
                    info,
                },
            ),
        };
        // A channel destroyed meanwhile (or never created) has nobody to tell.
        if let Some(sink) = inner.sink(ch) {
            sink.event(gev);
        }
    };
    if inner.shutting_down() {
        info!("GPU worker {}: ended", inner.worker);
        inner.lose(super::LossKind::Exited, &why);
        return;
    }
    warn!("GPU worker {}: lost ({why})", inner.worker);
    inner.lose(super::LossKind::Exited, &why);
    // No zombie waits for the handle's drop.
    super::reap(&inner);
    inner.fail_pages();
    for (ch, sink) in inner.take_sinks() {
        sink.event(GpuEvent::Error {
            channel: ChannelId(ch),
            code: ErrorCode::DeviceLost,
            info: 0,
        });
    }
}
