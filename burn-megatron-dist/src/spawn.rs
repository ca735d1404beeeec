//! Starting one process per rank on this node: what `bm-launch` does.

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
        }
    }
}

/// How the node's ranks ended.
#[derive(Debug)]
pub struct SpawnReport {
    /// Per local rank: its exit status, or `None` if it was killed after the grace period.
    pub statuses: Vec<Option<ExitStatus>>,
    /// The global rank that failed first, with its status.
    pub first_failure: Option<(usize, Option<ExitStatus>)>,
}

impl SpawnReport {
    /// Whether every rank succeeded.
    pub fn success(&self) -> bool {
        self.first_failure.is_none()
    }
}

/// Runs `program args…` once per local rank with the launch variables set (`RANK`,
/// `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), and waits
/// for all of them. When one fails, the others get `config.grace` to fail with their own
/// errors, then are killed with everything they started (each rank runs in its own process
/// group): no process is left behind.
pub fn spawn_ranks(
    config: &SpawnConfig,
    program: &str,
    args: &[String],
) -> std::io::Result<SpawnReport> {
    spawn_ranks_until(config, program, args, &AtomicBool::new(false))
}

/// [`spawn_ranks`], which also kills every rank as soon as `stop` is set (`bm-launch` sets
/// it on Ctrl-C or SIGTERM).
pub fn spawn_ranks_until(
    config: &SpawnConfig,
    program: &str,
    args: &[String],
    stop: &AtomicBool,
) -> std::io::Result<SpawnReport> {
    let world_size = config.nproc_per_node * config.nnodes;
    let first = config.node_rank * config.nproc_per_node;
    let mut children: Vec<Option<Child>> = Vec::new();
    for local in 0..config.nproc_per_node {
        let child = Command::new(program)
            .args(args)
            .env("RANK", (first + local).to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", config.nproc_per_node.to_string())
            .env("MASTER_ADDR", &config.master_addr)
            .env("MASTER_PORT", config.master_port.to_string())
            .process_group(0)
            .spawn();
        match child {
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
    Ok(SpawnReport {
        statuses,
        first_failure,
    })
}

/// Kills each child's process group: the rank and whatever it started.
fn kill_all(children: &mut [Option<Child>]) {
    for mut child in children.iter_mut().filter_map(Option::take) {
        // SAFETY: signals the process group the child leads (created by `process_group(0)`).
        unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
        let _ = child.wait();
    }
}
