//! Who holds a channel shadowed, and which owners' new channels are born held.
//!
//! Three parties shadow channels for their own reasons: the scheduler (an over-user waits
//! for the next interval), the operator (pause, drain, migration) and the VRAM manager (a
//! move of memory the channel can reach). A channel is shadowed while anyone holds it and
//! unshadowed when the last holder lets go; only a channel that nobody but the scheduler
//! holds may get a capped release. Plain data: [`super::Shadows`] applies it.
//!
//! Holds are also kept per *owner* — the VM, a guest process, a context — so that a
//! channel created while its owner is held starts shadowed, before its creator learns its
//! slot. Otherwise a tenant could escape a hold by creating channels (each would run
//! until the next decision).

use std::collections::BTreeSet;

/// A reason to hold a channel shadowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// The GPU scheduler: the channel's VM or process is over its share.
    Scheduler,
    /// The operator: the VM is paused (or being drained or migrated).
    Operator,
    /// The VRAM manager: memory the channel's context maps is being moved.
    Vram,
}

impl Holder {
    fn bit(self) -> u8 {
        match self {
            Holder::Scheduler => 1,
            Holder::Operator => 2,
            Holder::Vram => 4,
        }
    }
}

/// The set of holders of one channel.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Holders(u8);

impl Holders {
    pub const NONE: Holders = Holders(0);

    pub fn contains(self, h: Holder) -> bool {
        self.0 & h.bit() != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Held by `h` and nobody else.
    pub fn only(self, h: Holder) -> bool {
        self.0 == h.bit()
    }

    #[must_use]
    pub fn with(self, h: Holder) -> Holders {
        Holders(self.0 | h.bit())
    }

    #[must_use]
    pub fn without(self, h: Holder) -> Holders {
        Holders(self.0 & !h.bit())
    }
}

/// Holds on a VM's owners, for channels born while they last.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnerHolds {
    /// The operator paused the VM.
    pub paused: bool,
    /// The scheduler holds the whole VM back.
    pub sched_vm: bool,
    /// Guest processes the scheduler holds back inside the VM.
    pub sched_pids: BTreeSet<u32>,
    /// Contexts whose memory the VRAM manager is moving.
    pub vram_ctxs: BTreeSet<u32>,
}

impl OwnerHolds {
    /// The holders of a channel that process `pid` creates in context `ctx` now.
    pub fn at_birth(&self, pid: u32, ctx: u32) -> Holders {
        let mut h = Holders::NONE;
        if self.paused {
            h = h.with(Holder::Operator);
        }
        if self.sched_vm || self.sched_pids.contains(&pid) {
            h = h.with(Holder::Scheduler);
        }
        if self.vram_ctxs.contains(&ctx) {
            h = h.with(Holder::Vram);
        }
        h
    }

    /// Whether the scheduler holds process `pid` back (itself or its whole VM).
    pub fn sched_holds(&self, pid: u32) -> bool {
        self.sched_vm || self.sched_pids.contains(&pid)
    }

    /// Sets the scheduler's owner holds (what its latest decision holds back).
    pub fn set_sched(&mut self, vm: bool, pids: BTreeSet<u32>) {
        self.sched_vm = vm;
        self.sched_pids = pids;
    }

    /// Drops the scheduler's owner holds (it stopped).
    pub fn clear_sched(&mut self) {
        self.set_sched(false, BTreeSet::new());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_compose_and_only_is_exclusive() {
        let h = Holders::NONE.with(Holder::Scheduler);
        assert!(h.only(Holder::Scheduler));
        let h = h.with(Holder::Vram);
        assert!(h.contains(Holder::Scheduler) && h.contains(Holder::Vram));
        assert!(!h.only(Holder::Scheduler));
        assert!(!h.contains(Holder::Operator));
        let h = h.without(Holder::Scheduler).without(Holder::Vram);
        assert!(h.is_empty());
        assert_eq!(Holders::NONE.without(Holder::Operator), Holders::NONE);
    }

    #[test]
    fn a_channel_is_born_into_every_hold_of_its_owners() {
        let mut o = OwnerHolds::default();
        assert!(o.at_birth(7, 1).is_empty());
        o.set_sched(false, BTreeSet::from([7]));
        assert!(o.at_birth(7, 1).only(Holder::Scheduler));
        assert!(
            o.at_birth(8, 1).is_empty(),
            "another process of the VM runs"
        );
        o.set_sched(true, BTreeSet::new());
        assert!(
            o.at_birth(8, 1).only(Holder::Scheduler),
            "the whole VM is held"
        );
        o.paused = true;
        o.vram_ctxs.insert(2);
        let h = o.at_birth(8, 2);
        assert!(h.contains(Holder::Operator) && h.contains(Holder::Vram));
        assert!(!o.at_birth(8, 1).contains(Holder::Vram));
        o.clear_sched();
        o.paused = false;
        assert!(o.at_birth(8, 1).is_empty());
    }
}
