//! The NCCL watchdog: a thread per communicator that follows its collectives on the GPU.
//!
//! NCCL calls return as soon as they are enqueued, so a collective that a peer never joins
//! hangs on the GPU, not in any call. Each collective is tracked from the moment this rank
//! starts it until the event recorded after it on the communication stream completes. When
//! the oldest is older than the timeout, a peer has failed or exited while one is pending, or
//! NCCL reports an error of its own (`ncclCommGetAsyncError`), the watchdog aborts the communicator (the stuck kernels exit), reports the error to the
//! device (its next read or sync fails) and to the group (its next call fails), and prints
//! this rank's last collectives so a user can see who is stuck where.
//!
//! The watchdog never waits on the transport with its state locked: over TCP the news of the
//! peers comes from rank 0's process, and an answer may take until the call's deadline (a hung
//! rendezvous), while the rank keeps starting and waiting for collectives. A rendezvous that is
//! lost (rank 0's process dead or hung) is itself a reason to abort a pending collective.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use burn::tensor::DType;
use burn_megatron_kernels::cuda::{Alarms, Event, ForeignContext};

use crate::error::{DistError, DistResult};
use crate::transport::{GroupInfo, Transport, WorldStatus};

/// How many finished collectives each communicator remembers for the dump.
const REMEMBERED: usize = 16;
/// A peer's failure or exit is acted on once the oldest collective has waited this long
/// (a peer that exits right after finishing a collective is not a hang).
const PEER_GRACE: Duration = Duration::from_secs(1);
const POLL: Duration = Duration::from_millis(20);

/// One collective, from its start on this rank until its GPU work ends.
#[derive(Debug)]
pub(crate) struct Tracked {
    seq: u64,
    op: String,
    shape: Vec<usize>,
    dtype: DType,
    started: Instant,
    /// Recorded after the NCCL call, on the device thread (`None` inside: no event could be
    /// recorded, or the call was captured into a CUDA graph and did not run; nothing waits
    /// for it).
    end: OnceLock<Option<Event>>,
}

impl Tracked {
    /// Records the end of the collective's GPU work (called from the foreign operation).
    pub fn enqueued(&self, ctx: &ForeignContext<'_>) {
        let _ = self.end.set(ctx.record_event().ok());
    }

    fn describe(&self, state: &str) -> String {
        format!(
            "#{} {} {:?} {:?}: {state}",
            self.seq, self.op, self.shape, self.dtype
        )
    }
}

#[derive(Debug, Default)]
struct State {
    in_flight: VecDeque<Arc<Tracked>>,
    recent: VecDeque<String>,
    error: Option<DistError>,
    /// Whether `error` has been returned to the caller (it is not reported again at exit).
    error_seen: bool,
    stopped: bool,
    last_status_check: Option<Instant>,
}

/// The watchdog of one communicator.
pub(crate) struct Watchdog {
    info: GroupInfo,
    timeout: Duration,
    transport: Arc<dyn Transport>,
    alarms: Alarms,
    /// Aborts the communicator (runs once).
    abort: Box<dyn Fn() + Send + Sync>,
    /// The communicator's own error, if NCCL has one (`ncclCommGetAsyncError`).
    comm_error: Box<dyn Fn() -> Option<String> + Send + Sync>,
    /// The CUDA context, made current on the watchdog's and waiters' threads.
    context: usize,
    state: Mutex<State>,
    changed: Condvar,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog")
            .field("group", &self.info.name)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// Makes `context` current on the calling thread (event queries need it); 0 is no context
/// (the watchdog's tests, which track collectives without GPU work).
fn make_current(context: usize) {
    if context == 0 {
        return;
    }
    // SAFETY: the retained primary context of the communicator's device.
    let _ = unsafe {
        cudarc::driver::result::ctx::set_current(context as cudarc::driver::sys::CUcontext)
    };
}

impl Watchdog {
    pub fn start(
        info: GroupInfo,
        transport: Arc<dyn Transport>,
        alarms: Alarms,
        context: usize,
        abort: Box<dyn Fn() + Send + Sync>,
        comm_error: Box<dyn Fn() -> Option<String> + Send + Sync>,
    ) -> Arc<Self> {
        let watchdog = Arc::new(Self {
            info,
            timeout: transport.timeout(),
            transport,
            alarms,
            abort,
            comm_error,
            context,
            state: Mutex::default(),
            changed: Condvar::new(),
        });
        let watching = watchdog.clone();
        std::thread::Builder::new()
            .name(format!("bm-watchdog-{}", watchdog.info.name))
            .spawn(move || watching.run())
            .expect("spawning the NCCL watchdog");
        watchdog
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts tracking collective `seq`; fails if the communicator is already gone.
    pub fn track(
        &self,
        seq: u64,
        op: String,
        shape: Vec<usize>,
        dtype: DType,
    ) -> DistResult<Arc<Tracked>> {
        let mut state = self.lock();
        if let Some(error) = state.error.clone() {
            state.error_seen = true;
            return Err(error);
        }
        let tracked = Arc::new(Tracked {
            seq,
            op,
            shape,
            dtype,
            started: Instant::now(),
            end: OnceLock::new(),
        });
        // Wake the watchdog only from its idle wait: while collectives are pending it polls
        // anyway, and waking it at every call (hundreds a step under tensor parallelism)
        // would make it query CUDA events against the thread that launches kernels.
        let was_idle = state.in_flight.is_empty();
        state.in_flight.push_back(tracked.clone());
        if was_idle {
            self.changed.notify_all();
        }
        Ok(tracked)
    }

    /// The error that ended a collective (a failed peer, a timeout), if the watchdog has seen
    /// one, without waiting for the collectives in flight.
    pub fn failure(&self) -> DistResult<()> {
        let mut state = self.lock();
        match state.error.clone() {
            Some(error) => {
                state.error_seen = true;
                Err(error)
            }
            None => Ok(()),
        }
    }

    /// Waits until every tracked collective has ended, or returns the error that ended one.
    pub fn synchronize(&self) -> DistResult<()> {
        self.wait(true)
    }

    /// Waits as [`synchronize`](Self::synchronize) does at a rank's end: an error already
    /// returned to the rank is not returned again.
    pub fn finish(&self) -> DistResult<()> {
        self.wait(false)
    }

    fn wait(&self, repeat_error: bool) -> DistResult<()> {
        make_current(self.context);
        let mut state = self.lock();
        loop {
            if let Some(error) = state.error.clone() {
                if state.error_seen && !repeat_error {
                    return Ok(());
                }
                state.error_seen = true;
                return Err(error);
            }
            let Some(last) = state.in_flight.back().cloned() else {
                return Ok(());
            };
            drop(state);
            // Wait in the driver for the newest collective's end (the stream runs them in
            // order); a hung one ends when the watchdog aborts the communicator. Until the
            // device thread has enqueued it, there is no event yet: wait a moment.
            match last.end.get() {
                Some(Some(event)) => {
                    let _ = event.synchronize();
                }
                Some(None) => {}
                None => std::thread::sleep(Duration::from_micros(20)),
            }
            state = self.lock();
            self.retire(&mut state);
        }
    }

    /// Stops the thread (the communicator is being destroyed).
    pub fn stop(&self) {
        self.lock().stopped = true;
        self.changed.notify_all();
    }

    /// Moves collectives whose GPU work has ended to the recent list.
    fn retire(&self, state: &mut State) {
        while let Some(front) = state.in_flight.front() {
            match front.end.get() {
                Some(None) => {
                    state.in_flight.pop_front();
                }
                Some(Some(event)) if event.is_complete() => {
                    let done = state.in_flight.pop_front().expect("front exists");
                    state.recent.push_back(done.describe("done"));
                    if state.recent.len() > REMEMBERED {
                        state.recent.pop_front();
                    }
                }
                _ => break,
            }
        }
        if state.in_flight.is_empty() {
            self.changed.notify_all();
        }
    }

    fn run(&self) {
        make_current(self.context);
        let mut state = self.lock();
        while !state.stopped && state.error.is_none() {
            self.retire(&mut state);
            let mut verdict = self.timed_out(&state).or_else(|| self.nccl_failed(&state));
            if verdict.is_none() && self.peer_check_due(&mut state) {
                // Ask the transport with the state unlocked: over TCP the answer may take up
                // to its deadline (a hung rendezvous), and meanwhile the rank's collectives
                // must still start and be waited for.
                drop(state);
                let status = self.transport.status();
                state = self.lock();
                if state.stopped || state.error.is_some() {
                    break;
                }
                self.retire(&mut state);
                verdict = self
                    .timed_out(&state)
                    .or_else(|| self.peers_stuck(&state, status));
            }
            if let Some(reason) = verdict {
                self.abort(&mut state, reason);
                break;
            }
            // Idle until a collective starts (`track` notifies); poll while some are pending.
            state = if state.in_flight.is_empty() {
                self.changed
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner)
            } else {
                self.changed
                    .wait_timeout(state, POLL)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            };
        }
    }

    /// The oldest collective, if it has run past the timeout.
    fn timed_out(&self, state: &State) -> Option<DistError> {
        let oldest = state.in_flight.front()?;
        let info = &self.info;
        (oldest.started.elapsed() >= self.timeout).then(|| DistError::WatchdogTimeout {
            rank: info.global_rank,
            group: info.name.clone(),
            op: oldest.op.clone(),
            seq: oldest.seq,
            timeout: self.timeout,
            recent: String::new(),
        })
    }

    /// The oldest pending collective, if NCCL has reported an error of its own: a kernel
    /// waiting for a connection NCCL failed to set up would otherwise wait until the timeout.
    fn nccl_failed(&self, state: &State) -> Option<DistError> {
        let oldest = state.in_flight.front()?;
        let error = (self.comm_error)()?;
        Some(DistError::NcclAsync {
            rank: self.info.global_rank,
            group: self.info.name.clone(),
            op: oldest.op.clone(),
            seq: oldest.seq,
            error,
        })
    }

    /// Whether to ask the transport about the peers now: the oldest collective has waited
    /// [`PEER_GRACE`], and the last question is a quarter of a second old.
    fn peer_check_due(&self, state: &mut State) -> bool {
        let pending_long = state
            .in_flight
            .front()
            .is_some_and(|oldest| oldest.started.elapsed() >= PEER_GRACE);
        let due = state
            .last_status_check
            .is_none_or(|t| t.elapsed() >= Duration::from_millis(250));
        if pending_long && due {
            state.last_status_check = Some(Instant::now());
        }
        pending_long && due
    }

    /// Why the oldest collective (if still pending for [`PEER_GRACE`]) will never end, given
    /// the world's `status`: a peer failed or exited, or the rendezvous itself is lost (rank
    /// 0's process is dead or hung), so no peer's news can come any more.
    fn peers_stuck(&self, state: &State, status: DistResult<WorldStatus>) -> Option<DistError> {
        let oldest = state.in_flight.front()?;
        if oldest.started.elapsed() < PEER_GRACE {
            return None;
        }
        let info = &self.info;
        let status = match status {
            Ok(status) => status,
            Err(lost) => return Some(lost),
        };
        if let Some((failed_rank, reason)) = status.failure {
            return Some(DistError::PeerFailed {
                rank: info.global_rank,
                group: info.name.clone(),
                op: format!("{} #{}", oldest.op, oldest.seq),
                failed_rank,
                reason,
            });
        }
        let exited: Vec<usize> = info
            .members
            .iter()
            .copied()
            .filter(|&r| r != info.global_rank && status.exited.get(r) == Some(&true))
            .collect();
        (!exited.is_empty()).then(|| DistError::PeerExited {
            rank: info.global_rank,
            group: info.name.clone(),
            op: oldest.op.clone(),
            seq: oldest.seq,
            exited,
        })
    }

    fn abort(&self, state: &mut State, error: DistError) {
        let mut dump = String::new();
        for line in &state.recent {
            let _ = write!(dump, "\n  {line}");
        }
        for tracked in &state.in_flight {
            let waited = tracked.started.elapsed();
            let _ = write!(
                dump,
                "\n  {}",
                tracked.describe(&format!("PENDING for {waited:.1?}"))
            );
        }
        let error = match error {
            DistError::WatchdogTimeout {
                rank,
                group,
                op,
                seq,
                timeout,
                ..
            } => DistError::WatchdogTimeout {
                rank,
                group,
                op,
                seq,
                timeout,
                recent: dump.clone(),
            },
            other => other,
        };
        match &error {
            // The timeout's message carries the dump already.
            DistError::WatchdogTimeout { .. } => eprintln!("burn-megatron NCCL watchdog: {error}"),
            _ => eprintln!(
                "burn-megatron NCCL watchdog: {error}\n  rank {}'s last collectives on group \
                 '{}':{dump}",
                self.info.global_rank, self.info.name
            ),
        }
        // The error is recorded before the communicator is aborted: the abort ends the stuck
        // kernels, and a rank reading a value that waited for them checks `failure` next
        // (which waits for this lock), so it never takes what they left for a result.
        self.alarms.raise(error.to_string());
        state.error = Some(error);
        (self.abort)();
        state.in_flight.clear();
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc;

    use super::*;
    use crate::transport::Contribution;

    /// A transport whose `status` blocks until the test answers, as a hung rendezvous does.
    #[derive(Debug)]
    struct SlowRendezvous {
        asked: mpsc::Sender<()>,
        answers: Mutex<mpsc::Receiver<DistResult<WorldStatus>>>,
    }

    impl Transport for SlowRendezvous {
        fn size(&self) -> usize {
            2
        }
        fn timeout(&self) -> Duration {
            Duration::from_secs(60)
        }
        fn fail(&self, _: usize, _: String) {}
        fn exit(&self, _: usize) {}
        fn status(&self) -> DistResult<WorldStatus> {
            let _ = self.asked.send(());
            let answers = self.answers.lock().unwrap_or_else(PoisonError::into_inner);
            answers
                .recv()
                .unwrap_or_else(|_| Err(DistError::Rendezvous("test over".into())))
        }
        fn deposit(&self, _: &GroupInfo, _: u64, _: Contribution) -> DistResult<()> {
            unreachable!("the watchdog only reads the status")
        }
        fn collect(&self, _: &GroupInfo, _: u64, _: &str) -> DistResult<Vec<Contribution>> {
            unreachable!("the watchdog only reads the status")
        }
        fn send(&self, _: &GroupInfo, _: usize, _: Contribution) -> DistResult<()> {
            unreachable!("the watchdog only reads the status")
        }
        fn recv(&self, _: &GroupInfo, _: usize, _: u64) -> DistResult<Contribution> {
            unreachable!("the watchdog only reads the status")
        }
    }

    struct Setup {
        watchdog: Arc<Watchdog>,
        asked: mpsc::Receiver<()>,
        answer: mpsc::Sender<DistResult<WorldStatus>>,
        aborted: Arc<AtomicBool>,
        /// What `ncclCommGetAsyncError` reports (the test sets it).
        comm_error: Arc<Mutex<Option<String>>>,
    }

    /// A watchdog of rank 0 of a world of 2 over a [`SlowRendezvous`], with no CUDA context:
    /// its collectives never end by themselves (no event is ever recorded).
    fn setup() -> Setup {
        let (asked_tx, asked) = mpsc::channel();
        let (answer, answers) = mpsc::channel();
        let transport = Arc::new(SlowRendezvous {
            asked: asked_tx,
            answers: Mutex::new(answers),
        });
        let info = GroupInfo {
            name: "world".into(),
            key: "world:0,1".into(),
            members: vec![0, 1],
            group_rank: 0,
            global_rank: 0,
        };
        let aborted = Arc::new(AtomicBool::new(false));
        let flag = aborted.clone();
        let abort = Box::new(move || flag.store(true, Ordering::SeqCst));
        let comm_error = Arc::new(Mutex::new(None));
        let reported = comm_error.clone();
        let check = Box::new(move || reported.lock().unwrap().clone());
        let watchdog = Watchdog::start(info, transport, Alarms::default(), 0, abort, check);
        Setup {
            watchdog,
            asked,
            answer,
            aborted,
            comm_error,
        }
    }

    fn track(watchdog: &Watchdog, seq: u64) -> DistResult<Arc<Tracked>> {
        watchdog.track(seq, "all_reduce(sum)".into(), vec![4], DType::F32)
    }

    /// The error the watchdog ends with, once it has aborted (bounded wait).
    fn abort_error(setup: &Setup) -> DistError {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !setup.aborted.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "the watchdog did not abort");
            std::thread::sleep(Duration::from_millis(10));
        }
        track(&setup.watchdog, 99).expect_err("an aborted communicator refuses collectives")
    }

    #[test]
    fn a_slow_status_call_never_blocks_the_rank() {
        let setup = setup();
        track(&setup.watchdog, 0).unwrap();
        setup
            .asked
            .recv_timeout(Duration::from_secs(10))
            .expect("the watchdog asks about the peers of a collective pending for a second");
        // The status call hangs; the rank starts another collective meanwhile.
        let (tracked, started) = mpsc::channel();
        let watchdog = setup.watchdog.clone();
        std::thread::spawn(move || {
            let _ = tracked.send(track(&watchdog, 1).is_ok());
        });
        assert_eq!(
            started.recv_timeout(Duration::from_secs(2)),
            Ok(true),
            "starting a collective waited for the watchdog's status call"
        );
        // The answer: rank 1 failed. The watchdog aborts, naming it.
        let failed = WorldStatus {
            failure: Some((1, "out of memory".into())),
            exited: vec![false, false],
        };
        setup.answer.send(Ok(failed)).unwrap();
        match abort_error(&setup) {
            DistError::PeerFailed {
                failed_rank: 1, op, ..
            } => assert_eq!(op, "all_reduce(sum) #0"),
            other => panic!("{other:?}"),
        }
        setup.watchdog.stop();
    }

    #[test]
    fn an_error_nccl_reports_aborts_the_pending_collective_at_once() {
        let setup = setup();
        track(&setup.watchdog, 0).unwrap();
        track(&setup.watchdog, 1).unwrap();
        let started = Instant::now();
        *setup.comm_error.lock().unwrap() = Some("unhandled cuda error".into());
        match abort_error(&setup) {
            DistError::NcclAsync {
                rank: 0,
                op,
                seq: 0,
                error,
                ..
            } => {
                assert_eq!(op, "all_reduce(sum)");
                assert_eq!(error, "unhandled cuda error");
            }
            other => panic!("{other:?}"),
        }
        // Well before the peer check's grace or any timeout.
        assert!(started.elapsed() < PEER_GRACE, "{:?}", started.elapsed());
        setup.watchdog.stop();
    }

    #[test]
    fn a_lost_rendezvous_aborts_a_pending_collective() {
        let setup = setup();
        track(&setup.watchdog, 0).unwrap();
        setup.asked.recv_timeout(Duration::from_secs(10)).unwrap();
        let lost =
            DistError::Rendezvous("rank 0: lost rank 0's rendezvous at 10.0.0.1:29500".into());
        setup.answer.send(Err(lost)).unwrap();
        let error = abort_error(&setup);
        assert!(
            error
                .to_string()
                .contains("lost rank 0's rendezvous at 10.0.0.1:29500"),
            "{error}"
        );
        setup.watchdog.stop();
    }
}
