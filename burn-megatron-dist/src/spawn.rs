//! Starting one process per rank on this node: what `bm-launch` does.
//!
//! No rank outlives its launcher: each runs in its own process group (so that the launcher
//! can kill it with whatever it started), and on Linux asks the kernel to kill it when the
//! launcher dies, even by SIGKILL, which no handler sees. When a rank fails, every rank of the
//! node is stopped and, up to `max_restarts` times, all are started again, as torchrun's
//! elastic agent does; resuming from the last checkpoint is the training program's part
//! (`pretrain_gpt --load`).

use std::io;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How to start a node's ranks (the `bm-launch` options).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpawnConfig {
    /// Processes on this node.
    pub nproc_per_node: usize,
    /// Nodes in all.
    pub nnodes: usize,
    /// This node's index.
    pub node_rank: usize,
    /// Host of rank 0's rendezvous.
    pub master_addr: String,
    /// Port of rank 0's rendezvous.
    pub master_port: u16,
    /// How long the others may take to report after the first rank fails, before they are
    /// killed.
    pub grace: Duration,
    /// How many times every rank is started again after one fails (torchrun's
    /// `--max-restarts`); 0, the default, never.
    pub max_restarts: usize,
}

impl SpawnConfig {
    /// `nproc_per_node` ranks on one node, rendezvous at 127.0.0.1:29500, 10 s grace.
    pub fn new(nproc_per_node: usize) -> Self {
        Self {
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            grace: Duration::from_secs(10),
            max_restarts: 0,
        }
    }
}

/// How the node's ranks ended (in the last attempt, after any restarts).
#[derive(Debug)]
pub struct SpawnReport {
    /// Per local rank: its exit status, or `None` if it was killed after the grace period.
    pub statuses: Vec<Option<ExitStatus>>,
    /// The global rank that failed first, with its status.
    pub first_failure: Option<(usize, Option<ExitStatus>)>,
    /// The cause of each restart, in order: the global rank that failed first in that
    /// attempt, with its status.
    pub restarts: Vec<(usize, Option<ExitStatus>)>,
}

impl SpawnReport {
    /// Whether every rank succeeded.
    pub fn success(&self) -> bool {
        self.first_failure.is_none()
    }
}

/// Runs `program args…` once per local rank with the launch variables set (`RANK`,
/// `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, and the
/// attempt: `BM_RESTART_COUNT` and `BM_MAX_RESTARTS`, torchrun's `TORCHELASTIC_RESTART_COUNT`
/// and `TORCHELASTIC_MAX_RESTARTS`), and waits for all of them. When one fails, the others
/// get `config.grace` to fail with their own errors, then are killed with everything they
/// started (each rank runs in its own process group): no process is left behind. Then, if
/// `config.max_restarts` allows, every rank is started again (the restart and its cause are
/// logged to stderr).
///
/// On Linux each rank gets SIGKILL when the thread that called this function ends (the
/// launcher died): call it from a thread that lives until it returns.
pub fn spawn_ranks(
    config: &SpawnConfig,
    program: &str,
    args: &[String],
) -> std::io::Result<SpawnReport> {
    spawn_ranks_until(config, program, args, &AtomicBool::new(false))
}

/// [`spawn_ranks`], which also kills every rank as soon as `stop` is set (`bm-launch` sets
/// it on Ctrl-C or SIGTERM), and then restarts none.
pub fn spawn_ranks_until(
    config: &SpawnConfig,
    program: &str,
    args: &[String],
    stop: &AtomicBool,
) -> std::io::Result<SpawnReport> {
    let mut restarts = Vec::new();
    loop {
        let attempt = restarts.len();
        let (statuses, first_failure) = run_attempt(config, program, args, stop, attempt)?;
        match first_failure {
            Some(cause) if attempt < config.max_restarts && !stop.load(Ordering::Relaxed) => {
                let (rank, status) = cause;
                eprintln!(
                    "bm-launch: rank {rank} {}; every rank was stopped, restarting all \
                     (restart {} of {})",
                    describe(status),
                    attempt + 1,
                    config.max_restarts
                );
                restarts.push(cause);
            }
            _ => {
                return Ok(SpawnReport {
                    statuses,
                    first_failure,
                    restarts,
                });
            }
        }
    }
}

/// How a rank ended, in a sentence's predicate.
fn describe(status: Option<ExitStatus>) -> String {
    status.map_or("was killed after the grace period".into(), |s| {
        format!("failed ({s})")
    })
}

type Outcome = (Vec<Option<ExitStatus>>, Option<(usize, Option<ExitStatus>)>);

/// Starts every local rank once and waits for all of them (see [`spawn_ranks`]).
fn run_attempt(
    config: &SpawnConfig,
    program: &str,
    args: &[String],
    stop: &AtomicBool,
    attempt: usize,
) -> io::Result<Outcome> {
    let world_size = config.nproc_per_node * config.nnodes;
    let first = config.node_rank * config.nproc_per_node;
    let mut children: Vec<Option<Child>> = Vec::new();
    for local in 0..config.nproc_per_node {
        let mut command = Command::new(program);
        command
            .args(args)
            .env("RANK", (first + local).to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", config.nproc_per_node.to_string())
            .env("MASTER_ADDR", &config.master_addr)
            .env("MASTER_PORT", config.master_port.to_string())
            .env("BM_RESTART_COUNT", attempt.to_string())
            .env("BM_MAX_RESTARTS", config.max_restarts.to_string())
            .env("TORCHELASTIC_RESTART_COUNT", attempt.to_string())
            .env("TORCHELASTIC_MAX_RESTARTS", config.max_restarts.to_string())
            .process_group(0);
        die_with_launcher(&mut command);
        match command.spawn() {
            Ok(child) => children.push(Some(child)),
            Err(error) => {
                kill_all(&mut children);
                return Err(error);
            }
        }
    }
    let mut statuses = vec![None; children.len()];
    let mut first_failure = None;
    let mut deadline: Option<Instant> = None;
    while children.iter().any(Option::is_some) {
        for (local, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            if let Some(status) = child.try_wait()? {
                statuses[local] = Some(status);
                *slot = None;
                if !status.success() && first_failure.is_none() {
                    first_failure = Some((first + local, Some(status)));
                    deadline = Some(Instant::now() + config.grace);
                }
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) || stop.load(Ordering::Relaxed) {
            kill_all(&mut children);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((statuses, first_failure))
}

/// Has the kernel kill the rank when the launcher dies (Linux's parent-death signal): a
/// launcher killed by SIGKILL cannot pass the news on itself.
#[cfg(target_os = "linux")]
fn die_with_launcher(command: &mut Command) {
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: between fork and exec the hook makes only async-signal-safe calls (prctl,
    // getppid, raise) and allocates nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The launcher died before the signal was asked for: nothing would send it now.
            if libc::getppid() != launcher {
                libc::raise(libc::SIGKILL);
            }
            Ok(())
        });
    }
}

/// Elsewhere ranks outlive a launcher killed by SIGKILL (other signals still reach them).
#[cfg(not(target_os = "linux"))]
fn die_with_launcher(_: &mut Command) {}

/// Kills each child's process group: the rank and whatever it started.
fn kill_all(children: &mut [Option<Child>]) {
    for mut child in children.iter_mut().filter_map(Option::take) {
        // SAFETY: signals the process group the child leads (created by `process_group(0)`).
        unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
        let _ = child.wait();
    }
}
