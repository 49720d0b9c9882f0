//! Virtqueue notification state across a live migration (issue 27): a loopback VM whose
//! driver harvests only on interrupts (as a guest does) moves between two backends over
//! the real vhost-user sockets while several threads have control requests in flight;
//! on the destination it runs enough control requests to wrap the control ring hundreds
//! of times and its 16-bit index, and enough notify events to wrap the event ring
//! several times; then it moves back, with the indices mid-way, and back and forth
//! [`PING_PONGS`] more times, each while events wait in the backend for buffers. Every
//! request must be answered within the loopback's request timeout and every event must
//! arrive once and in order, so a kick, an interrupt or an event lost in a move fails
//! the test instead of hanging it; the GPU work must stay bit-exact. Run with and
//! without `VIRTIO_RING_F_EVENT_IDX`. With it, the test caught the backend's ring worker
//! re-arming and draining a ring the migration had stopped, which lost an event.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vgpu_backend::VmLimits;
use vgpu_guest::workloads::Workload;
use vgpu_guest::{Device, KernelArgs};
use vgpu_loopback::{LoopbackConfig, LoopbackVm, NotifyCounts};
use vgpu_protocol::device::QUEUE_SIZE;
use vgpu_protocol::request::{decode_reply, event, Op, ReplyBody, Request};
use vgpu_test_support::{Host, DEFAULT_VM_MEM};
use vgpu_vmm::reconnect::FaultPolicy;

const VM: &str = "vm";
/// A request unanswered for this long (a lost kick or interrupt) fails its thread.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Likewise an event that does not arrive.
const EVENT_TIMEOUT: Duration = Duration::from_secs(10);
/// Control requests on the destination: past 65,536, so the ring's 16-bit index wraps.
const REQUESTS_AFTER_MOVE: u64 = 70_000;
/// Notify events on the destination: eight times round the event ring.
const EVENTS_AFTER_MOVE: u64 = 8 * QUEUE_SIZE as u64;
/// Notify events of a big round: six times the event ring, so that the backend keeps
/// events queued and the driver keeps posting buffers for them.
const BURST: u32 = 6 * QUEUE_SIZE as u32;
/// How far the event producer may run ahead of the consumer before a round (with a
/// burst on top, within the 4,096 events the backend's FIFO holds).
const MAX_LAG: u64 = BURST as u64;
/// Threads that keep control requests in flight.
const REQUESTERS: u32 = 4;
/// Moves back and forth after the wraps.
const PING_PONGS: usize = 60;
/// Bound of each phase of a case.
const PHASE_LIMIT: Duration = Duration::from_secs(40);

fn host(tag: &str) -> Host {
    let _ = env_logger::builder().is_test(true).try_init();
    Host::new(
        &format!("rings-{tag}"),
        256 << 20,
        VmLimits::default(),
        &[VM],
    )
}

/// A VM on `host` whose driver takes used entries only on interrupts, with EVENT_IDX as
/// asked, whose requests time out after [`REQUEST_TIMEOUT`] (no reconnect: a timeout is
/// a failure here).
fn connect(host: &Host, event_idx: bool) -> Arc<LoopbackVm> {
    let cfg = LoopbackConfig::with_mem(DEFAULT_VM_MEM)
        .event_idx(event_idx)
        .interrupts_only(true);
    let faults = FaultPolicy {
        reconnect: None,
        request_timeout: Some(REQUEST_TIMEOUT),
    };
    LoopbackVm::connect_with(&host.socket(VM), cfg, faults).expect("connect")
}

type Worker = JoinHandle<Result<(), String>>;

/// The guest's threads and what they have done so far.
struct Guest {
    stop: Arc<AtomicBool>,
    /// Control requests answered (the cheap ones of the requester threads).
    requests: Arc<AtomicU64>,
    /// The slowest of them, in µs.
    slowest_us: Arc<AtomicU64>,
    /// Notify events emitted by the producer (its last token)...
    produced: Arc<AtomicU64>,
    /// ...and received in order by the consumer.
    events: Arc<AtomicU64>,
    /// The producer has ended (the consumer then takes what is left and ends).
    producer_done: Arc<AtomicBool>,
    /// Verified GPU rounds (pattern fills and saxpy runs).
    gpu_rounds: Arc<AtomicU64>,
    threads: Vec<Worker>,
}

impl Guest {
    fn start(vm: &Arc<LoopbackVm>) -> Guest {
        let mut g = Guest {
            stop: Arc::new(AtomicBool::new(false)),
            requests: Arc::new(AtomicU64::new(0)),
            slowest_us: Arc::new(AtomicU64::new(0)),
            produced: Arc::new(AtomicU64::new(0)),
            events: Arc::new(AtomicU64::new(0)),
            producer_done: Arc::new(AtomicBool::new(false)),
            gpu_rounds: Arc::new(AtomicU64::new(0)),
            threads: Vec::new(),
        };
        for i in 0..REQUESTERS {
            g.threads.push(g.requester(vm, 100 + i));
        }
        g.threads.push(g.producer(vm));
        g.threads.push(g.consumer(vm));
        g.threads.push(g.saxpy(vm));
        g
    }

    /// Cheap control requests back to back (GET_INFO, GET_STATS), each checked.
    fn requester(&self, vm: &Arc<LoopbackVm>, pid: u32) -> Worker {
        let (vm, stop) = (vm.clone(), self.stop.clone());
        let (count, slowest) = (self.requests.clone(), self.slowest_us.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Acquire) {
                let op = if n.is_multiple_of(2) {
                    Op::GetInfo
                } else {
                    Op::GetStats
                };
                let req = Request { pid, ctx: 0, op };
                let t0 = Instant::now();
                let reply = vm
                    .request(&req.encode())
                    .map_err(|e| format!("pid {pid}, request {n}: {e}"))?;
                let us = t0.elapsed().as_micros() as u64;
                slowest.fetch_max(us, Ordering::Relaxed);
                match decode_reply(req.opcode(), &reply) {
                    Ok(Ok(ReplyBody::Info(_) | ReplyBody::Stats(_))) => {}
                    other => return Err(format!("pid {pid}, request {n}: {other:?}")),
                }
                n += 1;
                count.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        })
    }

    /// A GPU process whose rounds fill a VRAM buffer with a round-specific pattern,
    /// check it bit-exactly and emit notify events, alternately a [`BURST`] (the backend
    /// runs out of buffers and waits for the driver's kicks) and a few; it stays at most
    /// [`MAX_LAG`] events ahead of the consumer.
    fn producer(&self, vm: &Arc<LoopbackVm>) -> Worker {
        let (vm, stop) = (vm.clone(), self.stop.clone());
        let (produced, consumed) = (self.produced.clone(), self.events.clone());
        let (rounds, finished) = (self.gpu_rounds.clone(), self.producer_done.clone());
        std::thread::spawn(move || {
            // Whatever the outcome, the consumer stops waiting for more.
            struct Done(Arc<AtomicBool>);
            impl Drop for Done {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Release);
                }
            }
            let _done = Done(finished);
            let e = |x: vgpu_guest::Error| x.to_string();
            let dev = Device::loopback(vm, 300).map_err(e)?;
            let ctx = dev.create_context().map_err(e)?;
            const LEN: u64 = 64 << 10;
            let buf = ctx.alloc_vram(LEN).map_err(e)?;
            let mut ch = ctx.create_channel().map_err(e)?;
            let mut token = 0u32;
            let mut got = vec![0u8; LEN as usize];
            let mut round = 0u32;
            while !stop.load(Ordering::Acquire) {
                round += 1;
                let pattern = round.wrapping_mul(0x9e37_79b9) | 1;
                ch.launch(
                    &KernelArgs::Memset {
                        dst: buf.gpu_va(),
                        len: LEN,
                        pattern,
                    },
                    [1, 1, 1],
                )
                .map_err(e)?;
                let n = if round % 2 == 1 { BURST } else { 7 };
                for _ in 0..n {
                    token += 1;
                    ch.notify(token).map_err(e)?;
                }
                produced.store(u64::from(token), Ordering::Release);
                let f = ch.submit().map_err(e)?;
                ch.wait_timeout(f, Duration::from_secs(30))
                    .map_err(|x| format!("round {round}: {x}"))?;
                buf.read(0, &mut got).map_err(e)?;
                let want = pattern.to_le_bytes();
                if let Some(at) = got.chunks(4).position(|w| w != want) {
                    return Err(format!("round {round}: word {at} is not {pattern:#x}"));
                }
                rounds.fetch_add(1, Ordering::Relaxed);
                let t0 = Instant::now();
                while consumed.load(Ordering::Acquire) + MAX_LAG < u64::from(token) {
                    if t0.elapsed() > EVENT_TIMEOUT {
                        return Err(format!("round {round}: the events stopped coming"));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            Ok(())
        })
    }

    /// Takes the notify events off the event queue as a guest driver does, checking that
    /// each arrives once and in order, none later than [`EVENT_TIMEOUT`]; at the stop it
    /// takes what the producer emitted and ends after it.
    fn consumer(&self, vm: &Arc<LoopbackVm>) -> Worker {
        let (vm, finished) = (vm.clone(), self.producer_done.clone());
        let (produced, consumed) = (self.produced.clone(), self.events.clone());
        std::thread::spawn(move || {
            let mut last = Instant::now();
            loop {
                let gone = finished.load(Ordering::Acquire);
                let done = consumed.load(Ordering::Relaxed);
                let owed = produced.load(Ordering::Acquire);
                if gone && done == owed {
                    return Ok(());
                }
                match vm.next_event(Duration::from_millis(50)) {
                    Some(ev) => {
                        let want = done + 1;
                        if (ev.kind, u64::from(ev.value)) != (event::NOTIFY, want) {
                            return Err(format!("event {ev:?}, wanted token {want}"));
                        }
                        consumed.store(want, Ordering::Release);
                        last = Instant::now();
                    }
                    None if done < owed && last.elapsed() > EVENT_TIMEOUT => {
                        return Err(format!("event {} never came ({owed} emitted)", done + 1));
                    }
                    None => {
                        if done == owed {
                            last = Instant::now();
                        }
                    }
                }
            }
        })
    }

    /// The saxpy workload over and over, verified against its CPU reference.
    fn saxpy(&self, vm: &Arc<LoopbackVm>) -> Worker {
        let (vm, stop, rounds) = (vm.clone(), self.stop.clone(), self.gpu_rounds.clone());
        std::thread::spawn(move || {
            let dev = Device::loopback(vm, 400).map_err(|e| e.to_string())?;
            let w = Workload::by_name("saxpy", true).ok_or("no saxpy")?;
            while !stop.load(Ordering::Acquire) {
                let ctx = dev.create_context().map_err(|e| e.to_string())?;
                let r = w.run(&ctx).map_err(|e| format!("saxpy: {e}"))?;
                if !r.verified {
                    return Err("saxpy: not verified".into());
                }
                rounds.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        })
    }

    /// What the guest has done so far: (requests, events, GPU rounds).
    fn progress(&self) -> (u64, u64, u64) {
        (
            self.requests.load(Ordering::Relaxed),
            self.events.load(Ordering::Relaxed),
            self.gpu_rounds.load(Ordering::Relaxed),
        )
    }

    /// Waits (up to a second) until more events are owed than the event ring and the
    /// driver's queue can hold, i.e. some wait in the backend, with the driver posting
    /// buffers for them: a move then stops the event ring in the middle of that. Says
    /// whether it happened.
    fn wait_for_queued_events(&self) -> bool {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(1) {
            let owed = self.produced.load(Ordering::Acquire);
            if owed > self.events.load(Ordering::Acquire) + 2 * u64::from(QUEUE_SIZE) {
                return true;
            }
            std::thread::yield_now();
        }
        false
    }

    /// Waits until `more` requests, events and GPU rounds than `since` are done; a
    /// thread that ends (an error) or a phase over its bound fails the test.
    fn wait(&mut self, what: &str, since: (u64, u64, u64), more: (u64, u64, u64)) {
        let t0 = Instant::now();
        loop {
            let now = self.progress();
            if now.0 >= since.0 + more.0 && now.1 >= since.1 + more.1 && now.2 >= since.2 + more.2 {
                return;
            }
            if let Some(i) = self.threads.iter().position(|t| t.is_finished()) {
                let r = self.threads.swap_remove(i).join();
                panic!("{what}: a guest thread ended: {r:?}");
            }
            assert!(
                t0.elapsed() < PHASE_LIMIT,
                "{what}: stalled at {now:?} (from {since:?}, wanted {more:?} more)"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the threads; each must end well, within a bound.
    fn finish(self) {
        self.stop.store(true, Ordering::Release);
        let t0 = Instant::now();
        while !self.threads.iter().all(|t| t.is_finished()) {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "a guest thread is stuck"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        for t in self.threads {
            t.join()
                .expect("guest thread")
                .expect("guest thread's work");
        }
    }
}

fn delta(a: NotifyCounts, b: NotifyCounts) -> NotifyCounts {
    NotifyCounts {
        ctrl_kicks: b.ctrl_kicks - a.ctrl_kicks,
        ctrl_interrupts: b.ctrl_interrupts - a.ctrl_interrupts,
        ctrl_signals: b.ctrl_signals - a.ctrl_signals,
        event_kicks: b.event_kicks - a.event_kicks,
        event_interrupts: b.event_interrupts - a.event_interrupts,
        event_signals: b.event_signals - a.event_signals,
    }
}

fn migrate_and_wrap(event_idx: bool) {
    let t_case = Instant::now();
    let tag = if event_idx { "eidx" } else { "plain" };
    let (a, b) = (host(&format!("{tag}-a")), host(&format!("{tag}-b")));
    let vm = connect(&a, event_idx);
    assert_eq!(vm.event_idx(), event_idx, "EVENT_IDX negotiated as asked");
    let mut guest = Guest::start(&vm);

    // On A: some of everything, the event ring wrapped once.
    guest.wait("on A", (0, 0, 0), (2_000, u64::from(QUEUE_SIZE), 4));

    // The move, with requests in flight from every requester thread.
    let idx_a = vm.avail_indices();
    let rep = vm.migrate_to(&b.socket(VM)).expect("migration to B");
    let at_move = guest.progress();
    let counts_move = vm.notify_counts();
    let idx_move = vm.avail_indices();
    let served_b0 = b.backend.vm_stats(VM).expect("vm on B").requests;
    eprintln!(
        "[{tag}] A -> B: downtime {:?}, rings at {idx_a:?} -> {idx_move:?}, guest {at_move:?}",
        rep.downtime
    );

    // On B: wrap the control ring past its 16-bit index, the event ring 8 times.
    let t0 = Instant::now();
    guest.wait("on B", at_move, (REQUESTS_AFTER_MOVE, EVENTS_AFTER_MOVE, 8));
    let on_b = guest.progress();
    let counts_b = delta(counts_move, vm.notify_counts());
    let idx_b = vm.avail_indices();
    let served_b = b.backend.vm_stats(VM).expect("vm on B").requests - served_b0;
    let requests_b = on_b.0 - at_move.0;
    let events_b = on_b.1 - at_move.1;
    eprintln!(
        "[{tag}] on B in {:?}: {requests_b} requests ({} control-ring wraps, served {served_b}), \
         {events_b} events ({} event-ring wraps), slowest request {} µs, rings at {idx_b:?}; \
         {counts_b:?}",
        t0.elapsed(),
        requests_b / u64::from(QUEUE_SIZE),
        events_b / u64::from(QUEUE_SIZE),
        guest.slowest_us.load(Ordering::Relaxed),
    );
    assert!(served_b >= REQUESTS_AFTER_MOVE, "B served {served_b}");
    assert!(
        u64::from(idx_move[0]) + requests_b > 1 << 16,
        "the control ring's index wrapped on B"
    );

    // Back to A, the indices mid-way; the rings keep working.
    let back = vm.migrate_to(&a.socket(VM)).expect("migration back to A");
    let at_back = guest.progress();
    let counts_back = vm.notify_counts();
    eprintln!(
        "[{tag}] B -> A: downtime {:?}, rings at {:?}",
        back.downtime,
        vm.avail_indices()
    );
    guest.wait("back on A", at_back, (5_000, 2 * u64::from(QUEUE_SIZE), 2));
    let end = guest.progress();
    let counts_a = delta(counts_back, vm.notify_counts());
    eprintln!(
        "[{tag}] back on A: {} requests, {} events; {counts_a:?}",
        end.0 - at_back.0,
        end.1 - at_back.1
    );

    // Back and forth under the same load, each move while events wait in the backend
    // for buffers the driver is posting: the backend's ring worker is then busy with the
    // event ring when it is stopped (a race there shows on some moves only).
    let t0 = Instant::now();
    let mut downtime = Duration::ZERO;
    let mut queued = 0;
    for i in 0..PING_PONGS {
        let to = if i % 2 == 0 { &b } else { &a };
        queued += usize::from(guest.wait_for_queued_events());
        let rep = vm
            .migrate_to(&to.socket(VM))
            .unwrap_or_else(|e| panic!("ping-pong move {i}: {e}"));
        downtime = downtime.max(rep.downtime);
        let since = guest.progress();
        guest.wait(
            &format!("after ping-pong move {i}"),
            since,
            (500, u64::from(QUEUE_SIZE), 1),
        );
    }
    let last = guest.progress();
    eprintln!(
        "[{tag}] {PING_PONGS} more moves in {:?} ({queued} with events queued in the backend, \
         longest downtime {downtime:?}): {} requests, {} events; rings at {:?}",
        t0.elapsed(),
        last.0 - end.0,
        last.1 - end.1,
        vm.avail_indices()
    );
    guest.finish();

    // Suppression: every request kicks without EVENT_IDX, far fewer do with it.
    let kicks = counts_b.ctrl_kicks + counts_a.ctrl_kicks;
    let requests = requests_b + (end.0 - at_back.0);
    if event_idx {
        assert!(kicks < requests, "{kicks} kicks for {requests} requests");
    } else {
        assert!(kicks >= requests, "{kicks} kicks for {requests} requests");
    }
    assert!(counts_b.ctrl_interrupts > 0 && counts_b.event_interrupts > 0);
    eprintln!("[{tag}] case took {:?}", t_case.elapsed());
}

#[test]
fn rings_wrap_after_a_migration_without_event_idx() {
    migrate_and_wrap(false);
}

#[test]
fn rings_wrap_after_a_migration_with_event_idx() {
    migrate_and_wrap(true);
}
