//! The scheduler's narrow handle on a VM ([`SchedVm`]): what it reads and changes, and
//! nothing else of the session.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use log::warn;
use vgpu_host_shim::{ActivityCounter, Gpu};

use crate::sched::handle::{ChannelView, HoldChange, SchedVm, VmHolds, VmView};
use crate::shadow::{Holder, Holders, ShadowError};
use crate::vm::VmState;

impl SchedVm for VmState {
    fn name(&self) -> &str {
        &self.name
    }

    fn weight(&self) -> u32 {
        self.weight.load(Ordering::Relaxed)
    }

    fn connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    fn activity(&self) -> Arc<ActivityCounter> {
        self.shared.activity()
    }

    fn observe(&self, gpu: &dyn Gpu, wait: Duration, full: bool) -> VmView {
        // Channels come and go under the session lock: with it held, the book's live
        // channels and destroyed ones are one consistent view (taken in the lock order
        // session, then book, without copying the list).
        let mut session = self.lock_session_within(wait);
        let locked = session.is_some();
        let mut book = self.shared.busy();
        let retired = book.take_recent();
        let mut quiet = 0;
        let mut channels = Vec::new();
        for (ch, live) in book.live_mut() {
            let (pid, hal) = (live.pid, live.hal);
            let (peek, holders) = match session.as_mut() {
                Some(s) => {
                    // Read before the look: whatever moves after it moves the count.
                    let count = live.activity.get();
                    if !full && live.quiet_at == Some(count) && s.quiet_unmoved(ch) {
                        quiet += 1;
                        continue;
                    }
                    let was_quiet = s.quiet_channel(ch);
                    live.quiet_at = was_quiet.then_some(count);
                    if was_quiet && !full {
                        quiet += 1;
                        continue;
                    }
                    (s.peek_channel(ch).ok(), s.channel_holders(ch))
                }
                None => (None, Holders::NONE),
            };
            // A channel whose counters cannot be read is gone meanwhile.
            let Ok(counters) = gpu.channel_counters(hal) else {
                continue;
            };
            channels.push(ChannelView {
                ch,
                pid,
                hal,
                counters,
                peek,
                holders,
            });
        }
        drop(book);
        // Failed unshadows to retry are shadowed channels too.
        let shadowing = session
            .as_ref()
            .is_some_and(|s| s.shadow_stats().shadowed_now > 0);
        VmView {
            channels,
            retired,
            locked,
            quiet,
            shadowing,
            connection: self.shared.disconnects(),
            counted: self.shared.activity_counted(),
        }
    }

    fn apply(&self, holds: &VmHolds, wait: Duration) -> Option<Vec<Result<(), ShadowError>>> {
        let shm = self.shm.lock().unwrap_or_else(|e| e.into_inner()).clone()?;
        let mut s = self.lock_session_within(wait)?;
        s.hold.set_sched(holds.vm, holds.pids.clone());
        let results = holds
            .changes
            .iter()
            .map(|&(ch, change)| match change {
                HoldChange::Hold => s
                    .hold_channel(ch, Holder::Scheduler, true, shm.as_ref())
                    .map(drop),
                HoldChange::Release => {
                    match s.hold_channel(ch, Holder::Scheduler, false, shm.as_ref()) {
                        // Gone meanwhile: nothing of it is held any more.
                        Err(ShadowError::NoChannel(_)) => Ok(()),
                        r => r.map(drop),
                    }
                }
                HoldChange::ReleaseCapped(n) => s.release_capped(ch, n).map(drop),
            })
            .collect();
        s.retry_orphans(shm.as_ref());
        if s.shadow_stats().shadowed_now > 0 {
            s.mirror_shadows();
        }
        Some(results)
    }

    fn backlogged(&self, ch: u32, wait: Duration) -> bool {
        self.lock_session_within(wait)
            .is_some_and(|mut s| s.peek_channel(ch).is_ok_and(|p| p.real_put != p.gp_get))
    }

    fn release_scheduler(&self) -> u64 {
        let shm = self.shm.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut s = self.lock_session();
        s.hold.clear_sched();
        // Disconnected: the teardown dropped every hold.
        let Some(shm) = shm else { return 0 };
        let mut un = 0;
        for (ch, _) in s.channel_list() {
            if !s.channel_holders(ch).contains(Holder::Scheduler) {
                continue;
            }
            match s.hold_channel(ch, Holder::Scheduler, false, shm.as_ref()) {
                Ok(_) => un += 1,
                Err(e) => warn!("scheduler: final unshadow {}/{ch}: {e}", self.name),
            }
        }
        un
    }
}
