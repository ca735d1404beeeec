//! Running a closure on N thread ranks.

use std::any::Any;
use std::error::Error;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::error::DistResult;
use crate::layout::ParallelSizes;
use crate::parallel_state::ParallelState;
use crate::process_group::{ProcessGroup, RankGroups};
use crate::threads::ThreadWorld;
use crate::transport::Transport;

/// How to launch thread ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Number of ranks (threads).
    pub world_size: usize,
    /// How long a collective waits for its peers before failing (on the GPU too: the NCCL
    /// watchdog aborts a collective that has not ended after this long).
    pub timeout: Duration,
    /// Whether GPU collectives are first matched across ranks on the host (operation,
    /// shape, dtype). On by default: a mismatch is then an error naming every rank's call, not
    /// a hang, and shards may be uneven. Off, NCCL calls skip that round trip and shards
    /// must be equal. Host collectives always check.
    pub check_collectives: bool,
    /// Test knob: each host-side send, receive and collective of a thread rank first sleeps a
    /// pseudo-random time below this (zero, the default, sleeps never). Shakes out schedules
    /// that only work when ranks keep in step.
    pub max_injected_delay: Duration,
    /// Process ranks only: how long a rank retries a refused connection to rank 0's
    /// rendezvous (nothing listens at `MASTER_ADDR:MASTER_PORT` yet: rank 0's process may
    /// start a little later). 5 s by default; a master that is down stays an error within
    /// seconds, not minutes. An address that does not answer at all fails after the timeout.
    pub master_start_wait: Duration,
}

impl LaunchConfig {
    /// `world_size` ranks with the default timeout of 300 s.
    pub fn new(world_size: usize) -> Self {
        Self {
            world_size,
            timeout: Duration::from_secs(300),
            check_collectives: true,
            max_injected_delay: Duration::ZERO,
            master_start_wait: Duration::from_secs(5),
        }
    }

    /// Sets how long a process rank retries a refused connection to rank 0's rendezvous (see
    /// [`master_start_wait`](Self::master_start_wait)).
    pub fn with_master_start_wait(mut self, wait: Duration) -> Self {
        self.master_start_wait = wait;
        self
    }

    /// Injects random delays below `max` into every host-side communication of thread ranks
    /// (see [`max_injected_delay`](Self::max_injected_delay)).
    pub fn with_injected_delays(mut self, max: Duration) -> Self {
        self.max_injected_delay = max;
        self
    }

    /// Turns the host-side matching of GPU collectives on or off.
    pub fn with_collective_checks(mut self, check: bool) -> Self {
        self.check_collectives = check;
        self
    }

    /// Sets the collective timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// What a rank's closure is given: its rank and the world it can build groups in.
#[derive(Debug, Clone)]
pub struct RankContext {
    pub(crate) world: ProcessGroup,
    pub(crate) local_rank: usize,
}

impl RankContext {
    /// This rank's global rank.
    pub fn rank(&self) -> usize {
        self.world.rank()
    }

    /// This rank's index on its node: the GPU it should use. Thread ranks are all on one node,
    /// so it equals [`rank`](Self::rank); process ranks get it from the launcher.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world.size()
    }

    /// The group of all ranks.
    pub fn world(&self) -> &ProcessGroup {
        &self.world
    }

    /// A group of the given global ranks, in group order. Every member creates it with the
    /// same name and ranks; creating it again returns the same group.
    pub fn new_group(&self, name: &str, ranks: &[usize]) -> DistResult<ProcessGroup> {
        self.world.new_group(name, ranks)
    }

    /// This rank's groups in Megatron's layout for `sizes`.
    pub fn parallel_state(&self, sizes: ParallelSizes) -> DistResult<ParallelState> {
        ParallelState::new(&self.world, sizes)
    }
}

/// A launch that failed: the rank that failed first, and what every failed rank said.
#[derive(Debug, Clone, thiserror::Error)]
#[error("rank {rank} failed: {message}")]
pub struct LaunchError {
    /// The rank that failed first: the root cause.
    pub rank: usize,
    /// Its error or panic message.
    pub message: String,
    /// Every rank that failed, with its message, in rank order (the first one included;
    /// the others usually report that they were released because of it).
    pub failures: Vec<(usize, String)>,
}

/// Runs `f` on `config.world_size` thread ranks and returns each rank's result, in rank order,
/// or the first failure.
///
/// A rank that returns an error or panics releases every other rank: their pending and
/// future collectives fail at once with an error naming it, so a launch never hangs on a dead
/// rank. Each rank must build its own modules and tensors (they may be equal, but must not be
/// shared across ranks).
///
/// Launches in one process run one at a time (a second waits for the first): Burn's autodiff
/// cleans up after every backward pass by locking every graph in the process, so a rank of one
/// launch could wait on the graph of a rank of another launch that is itself waiting for a
/// collective, and neither launch would finish.
pub fn launch<T, E, F>(config: LaunchConfig, f: F) -> Result<Vec<T>, LaunchError>
where
    T: Send,
    E: Into<Box<dyn Error + Send + Sync>>,
    F: Fn(RankContext) -> Result<T, E> + Sync,
{
    static ONE_LAUNCH_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _running = ONE_LAUNCH_AT_A_TIME
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let world = Arc::new(
        ThreadWorld::new(config.world_size, config.timeout)
            .with_injected_delays(config.max_injected_delay),
    );
    let transport: Arc<dyn Transport> = world.clone();
    let members: Vec<usize> = (0..config.world_size).collect();
    let outcomes: Vec<Result<T, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = members
            .iter()
            .map(|&rank| {
                let transport = transport.clone();
                let members = members.clone();
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let groups = Arc::new(RankGroups::new(config.check_collectives));
                        let outcome = catch_unwind(AssertUnwindSafe(|| {
                            let world = ProcessGroup::new(
                                transport.clone(),
                                groups.clone(),
                                "world",
                                members,
                                rank,
                            )
                            .map_err(|e| e.to_string())?;
                            f(RankContext {
                                world,
                                local_rank: rank,
                            })
                            .map_err(|e| e.into().to_string())
                        }))
                        .unwrap_or_else(|panic| {
                            Err(format!("panicked: {}", panic_message(&panic)))
                        });
                        finish_rank(transport.as_ref(), &groups, rank, outcome)
                    })
                    .expect("spawning a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("thread panicked".to_string()))
            })
            .collect()
    });

    let failures: Vec<(usize, String)> = outcomes
        .iter()
        .enumerate()
        .filter_map(|(rank, o)| o.as_ref().err().map(|m| (rank, m.clone())))
        .collect();
    if failures.is_empty() {
        return Ok(outcomes.into_iter().map(|o| o.ok().unwrap()).collect());
    }
    let (rank, message) = world.failure().unwrap_or_else(|| failures[0].clone());
    Err(LaunchError {
        rank,
        message,
        failures,
    })
}

/// Reports how a rank ended. A rank that succeeded first waits for its GPU collectives to end
/// (so that peers never wait on a collective it has left behind), then counts as exited.
pub(crate) fn finish_rank<T>(
    transport: &dyn Transport,
    groups: &RankGroups,
    rank: usize,
    outcome: Result<T, String>,
) -> Result<T, String> {
    let outcome =
        outcome.and_then(|value| groups.finish().map(|_| value).map_err(|e| e.to_string()));
    match &outcome {
        Ok(_) => transport.exit(rank),
        Err(message) => transport.fail(rank, message.clone()),
    }
    outcome
}

pub(crate) fn panic_message(panic: &Box<dyn Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}
