//! Pausing a VM's GPU work by channel: the operator's pause, resume and drain
//! ([`crate::control`]) and the migration pause ([`crate::vm::migration`]) are one
//! mechanism — every channel held shadowed by [`Holder::Operator`], channels born while
//! paused start held, and the drain waits (bounded) until the engines finished what they
//! had already fetched. Work the guest submitted but the GPU has not fetched stays in the
//! ring, behind the shadow pages' GP_PUT; resume drops the holds through the normal
//! reconcile path of [`crate::shadow`].

use std::time::{Duration, Instant};

use log::{info, warn};

use crate::control::{ControlError, DrainOutcome, PauseOutcome};
use crate::shadow::Holder;
use crate::shmem::ShmMapper;
use crate::vm::session::Session;
use crate::vm::VmState;

impl VmState {
    /// Holds every channel of the VM shadowed for the operator (see the module docs).
    /// Tries every channel; the VM is marked paused even if one fails (the error names
    /// it). Without a frontend (`shm` None) only the marks are set: nothing runs.
    pub(crate) fn pause(&self, shm: Option<&dyn ShmMapper>) -> Result<PauseOutcome, ControlError> {
        let mut session = self.lock_session();
        session.hold.paused = true;
        self.control.set_paused(true);
        let channels = session.channel_list();
        let mut out = PauseOutcome {
            channels: channels.len() as u32,
            switched: 0,
        };
        let mut first_err = None;
        if let Some(shm) = shm {
            for (ch, _) in channels {
                match session.hold_channel(ch, Holder::Operator, true, shm) {
                    Ok(s) => out.switched += u32::from(s.changed),
                    Err(source) => {
                        warn!("VM {}: pause: channel {ch}: {source}", self.name);
                        first_err.get_or_insert(ControlError::Shadow {
                            channel: ch,
                            source,
                        });
                    }
                }
            }
        }
        info!(
            "VM {}: paused ({} channel(s), {} switched)",
            self.name, out.channels, out.switched
        );
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// Drops the operator's holds (channels nobody else holds are unshadowed).
    pub(crate) fn resume(&self, shm: Option<&dyn ShmMapper>) -> Result<PauseOutcome, ControlError> {
        let mut session = self.lock_session();
        session.hold.paused = false;
        self.control.set_paused(false);
        let channels = session.channel_list();
        let mut out = PauseOutcome {
            channels: channels.len() as u32,
            switched: 0,
        };
        let mut first_err = None;
        for (ch, _) in channels {
            if !session.channel_holders(ch).contains(Holder::Operator) {
                continue;
            }
            let Some(shm) = shm else {
                break;
            };
            match session.hold_channel(ch, Holder::Operator, false, shm) {
                Ok(s) => out.switched += u32::from(s.changed),
                Err(source) => {
                    warn!("VM {}: resume: channel {ch}: {source}", self.name);
                    first_err.get_or_insert(ControlError::Shadow {
                        channel: ch,
                        source,
                    });
                }
            }
        }
        info!(
            "VM {}: resumed ({} channel(s), {} switched)",
            self.name, out.channels, out.switched
        );
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// Pauses and waits (at most `timeout`) until the GPU completed all the work that had
    /// been released to it: kernels are not preemptible, so this is the only way to a
    /// GPU that is quiet for the VM. On timeout the VM stays paused.
    pub(crate) fn drain(
        &self,
        shm: Option<&dyn ShmMapper>,
        timeout: Duration,
    ) -> Result<DrainOutcome, ControlError> {
        let pause = self.pause(shm)?;
        let t0 = Instant::now();
        loop {
            let pending = {
                let mut session = self.lock_session();
                // Let the guest see the progress of what it released.
                session.mirror_shadows();
                running_channels(&mut session)
            };
            let waited = t0.elapsed();
            if pending == 0 {
                return Ok(DrainOutcome {
                    pause,
                    waited_ns: u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX),
                });
            }
            if waited >= timeout {
                return Err(ControlError::DrainTimeout {
                    waited_ms: u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
                    pending,
                });
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }
}

/// Channels whose released work the GPU has not completed yet (a channel stopped on an
/// error counts as done: it will not run anything more).
pub(crate) fn running_channels(session: &mut Session) -> u32 {
    let gpu = session.gpu.clone();
    let mut n = 0;
    for (ch, _) in session.channel_list() {
        let stopped = session
            .hal
            .channels
            .get(&ch)
            .and_then(|h| gpu.channel_error(*h).ok().flatten())
            .is_some();
        if stopped {
            continue;
        }
        if let Ok(p) = session.peek_channel_any(ch) {
            if p.gp_get != p.real_put {
                n += 1;
            }
        }
    }
    n
}
