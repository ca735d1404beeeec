//! Ranks as threads of one process: the rendezvous behind every CPU process group.
//!
//! Each rank deposits its contribution to a collective under the group's sequence number and
//! later collects everybody's contributions; every wait checks, in order, for completion, a
//! failed rank, a rank that already finished, and the timeout, so no call can hang silently.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::error::{DistError, DistResult};
use crate::transport::{Contribution, GroupInfo, Transport, WorldStatus};

/// The shared state of all thread ranks of one launch.
#[derive(Debug)]
pub(crate) struct ThreadWorld {
    size: usize,
    timeout: Duration,
    state: Mutex<WorldState>,
    changed: Condvar,
    /// Upper bound of the random sleep before each call (zero: none).
    max_delay: Duration,
    /// Calls so far: the random sleeps' counter.
    calls: AtomicU64,
}

#[derive(Debug, Default)]
struct WorldState {
    /// The first rank that failed, with its error: the root cause every waiter reports.
    failure: Option<(usize, String)>,
    exited: Vec<bool>,
    rendezvous: HashMap<(String, u64), Rendezvous>,
    mailboxes: HashMap<(String, usize, usize), VecDeque<Contribution>>,
}

#[derive(Debug)]
struct Rendezvous {
    entries: Vec<Option<Contribution>>,
    unread: usize,
}

impl ThreadWorld {
    pub fn new(size: usize, timeout: Duration) -> Self {
        Self {
            size,
            timeout,
            state: Mutex::new(WorldState {
                exited: vec![false; size],
                ..Default::default()
            }),
            changed: Condvar::new(),
            max_delay: Duration::ZERO,
            calls: AtomicU64::new(0),
        }
    }

    /// Sleeps a pseudo-random time below `max` before every send, receive and collective.
    pub fn with_injected_delays(mut self, max: Duration) -> Self {
        self.max_delay = max;
        self
    }

    fn inject_delay(&self) {
        if self.max_delay.is_zero() {
            return;
        }
        // SplitMix64 of a call counter: reproducible in distribution, cheap, no dependency.
        let mut z = self
            .calls
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let nanos = self.max_delay.as_nanos() as u64;
        std::thread::sleep(Duration::from_nanos(z % nanos.max(1)));
    }

    fn lock(&self) -> MutexGuard<'_, WorldState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The first failure, if any: `(rank, reason)`.
    pub fn failure(&self) -> Option<(usize, String)> {
        self.lock().failure.clone()
    }

    /// Waits until `poll` returns `Some(Ok(_))`. `Some(Err(ranks))` names the ranks still
    /// awaited, which turns into an error as soon as one of them has exited or the time is up.
    fn wait<T>(
        &self,
        group: &GroupInfo,
        op: &str,
        seq: u64,
        mut poll: impl FnMut(&mut WorldState) -> Option<Result<T, Vec<usize>>>,
    ) -> DistResult<T> {
        let deadline = Instant::now() + self.timeout;
        let mut state = self.lock();
        loop {
            let missing = match poll(&mut state) {
                Some(Ok(value)) => return Ok(value),
                Some(Err(missing)) => missing,
                None => group.members.clone(),
            };
            if let Some((failed_rank, reason)) = &state.failure {
                return Err(peer_failed(group, op, *failed_rank, reason));
            }
            let exited: Vec<usize> = missing
                .iter()
                .copied()
                .filter(|&r| state.exited[r])
                .collect();
            if !exited.is_empty() {
                return Err(DistError::PeerExited {
                    rank: group.global_rank,
                    group: group.name.clone(),
                    op: op.to_string(),
                    seq,
                    exited,
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(DistError::Timeout {
                    rank: group.global_rank,
                    group: group.name.clone(),
                    op: op.to_string(),
                    seq,
                    missing,
                    timeout: self.timeout,
                });
            }
            state = self
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Transport for ThreadWorld {
    fn size(&self) -> usize {
        self.size
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn fail(&self, rank: usize, reason: String) {
        let mut state = self.lock();
        if state.failure.is_none() {
            state.failure = Some((rank, reason));
        }
        self.changed.notify_all();
    }

    fn exit(&self, rank: usize) {
        self.lock().exited[rank] = true;
        self.changed.notify_all();
    }

    fn status(&self) -> DistResult<WorldStatus> {
        let state = self.lock();
        Ok(WorldStatus {
            failure: state.failure.clone(),
            exited: state.exited.clone(),
        })
    }

    fn deposit(&self, group: &GroupInfo, seq: u64, part: Contribution) -> DistResult<()> {
        self.inject_delay();
        let mut state = self.lock();
        if let Some((failed_rank, reason)) = &state.failure {
            return Err(peer_failed(
                group,
                &part.op.to_string(),
                *failed_rank,
                reason,
            ));
        }
        let size = group.members.len();
        let slot = state
            .rendezvous
            .entry((group.key.clone(), seq))
            .or_insert_with(|| Rendezvous {
                entries: vec![None; size],
                unread: size,
            });
        slot.entries[group.group_rank] = Some(part);
        self.changed.notify_all();
        Ok(())
    }

    fn collect(&self, group: &GroupInfo, seq: u64, op: &str) -> DistResult<Vec<Contribution>> {
        let key = (group.key.clone(), seq);
        self.wait(group, op, seq, |state| {
            let slot = state.rendezvous.get_mut(&key)?;
            let missing: Vec<usize> = slot
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.is_none())
                .map(|(i, _)| group.members[i])
                .collect();
            if !missing.is_empty() {
                return Some(Err(missing));
            }
            let parts = slot.entries.iter().map(|e| e.clone().unwrap()).collect();
            slot.unread -= 1;
            if slot.unread == 0 {
                state.rendezvous.remove(&key);
            }
            Some(Ok(parts))
        })
    }

    fn send(&self, group: &GroupInfo, dst: usize, message: Contribution) -> DistResult<()> {
        self.inject_delay();
        let mut state = self.lock();
        if let Some((failed_rank, reason)) = &state.failure {
            return Err(peer_failed(
                group,
                &format!("send(dst={dst})"),
                *failed_rank,
                reason,
            ));
        }
        state
            .mailboxes
            .entry((group.key.clone(), group.group_rank, dst))
            .or_default()
            .push_back(message);
        self.changed.notify_all();
        Ok(())
    }

    fn recv(&self, group: &GroupInfo, src: usize, seq: u64) -> DistResult<Contribution> {
        self.inject_delay();
        let key = (group.key.clone(), src, group.group_rank);
        let op = format!("recv(src={src})");
        self.wait(group, &op, seq, |state| {
            match state.mailboxes.get_mut(&key).and_then(|q| q.pop_front()) {
                Some(data) => Some(Ok(data)),
                None => Some(Err(vec![group.members[src]])),
            }
        })
    }
}

fn peer_failed(group: &GroupInfo, op: &str, failed_rank: usize, reason: &str) -> DistError {
    DistError::PeerFailed {
        rank: group.global_rank,
        group: group.name.clone(),
        op: op.to_string(),
        failed_rank,
        reason: reason.to_string(),
    }
}
