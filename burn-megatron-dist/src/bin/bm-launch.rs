//! `bm-launch`: starts one process per GPU with the launch variables of
//! [`ProcessEnv`](burn_megatron_dist::ProcessEnv) set, as torchrun does.
//!
//! ```text
//! bm-launch --nproc-per-node 2 -- ./target/release/examples/train --steps 100
//! bm-launch --nproc-per-node 8 --max-restarts 3 -- ./pretrain_gpt --save ck --load ck …
//! ```
//!
//! With `--max-restarts N`, a failed rank stops every rank, and all start again, up to N
//! times (torchrun's elastic agent, on one node's ranks); the program resumes from its last
//! checkpoint, and reads the attempt in `BM_RESTART_COUNT` (or `TORCHELASTIC_RESTART_COUNT`).
//! The ranks die with the launcher, even when it is killed with SIGKILL (Linux).

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use burn_megatron_dist::{SpawnConfig, spawn_ranks_until};
use clap::Parser;

// ANCHOR: args
/// Starts one process per rank on this node and waits for all of them.
#[derive(Debug, Parser)]
#[command(name = "bm-launch", version)]
struct Args {
    /// Processes (ranks) on this node, usually one per GPU.
    #[arg(long, default_value_t = 1)]
    nproc_per_node: usize,
    /// Nodes in all; start bm-launch once on each.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index, 0 on the node that hosts rank 0.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of the node of rank 0, which serves the rendezvous.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous.
    #[arg(long, default_value_t = 29500)]
    master_port: u16,
    /// Seconds the other ranks get to report after the first failure, before being killed.
    #[arg(long, default_value_t = 10)]
    grace_secs: u64,
    /// Times every rank is restarted after one fails (each restart is logged with its cause).
    #[arg(long, default_value_t = 0)]
    max_restarts: usize,
    /// The program to run, and its arguments.
    #[arg(required = true, last = true)]
    command: Vec<String>,
}
// ANCHOR_END: args

/// Set by Ctrl-C or SIGTERM: the ranks run in their own process groups, so the launcher
/// passes the news on by killing them.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn main() -> ExitCode {
    let args = Args::parse();
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    if args.node_rank >= args.nnodes || args.nproc_per_node == 0 {
        eprintln!(
            "bm-launch: --node-rank {} must be below --nnodes {}, and --nproc-per-node at least 1",
            args.node_rank, args.nnodes
        );
        return ExitCode::from(2);
    }
    let config = SpawnConfig {
        nproc_per_node: args.nproc_per_node,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr,
        master_port: args.master_port,
        grace: Duration::from_secs(args.grace_secs),
        max_restarts: args.max_restarts,
    };
    let (program, rest) = args.command.split_first().expect("clap requires a command");
    match spawn_ranks_until(&config, program, rest, &STOP) {
        Ok(_) if STOP.load(Ordering::Relaxed) => {
            eprintln!("bm-launch: interrupted; every rank was killed");
            ExitCode::from(130)
        }
        Ok(report) => match report.first_failure {
            None => ExitCode::SUCCESS,
            Some((rank, status)) => {
                let how = status.map_or("was killed".to_string(), |s| format!("ended with {s}"));
                let restarts = match report.restarts.len() {
                    0 => String::new(),
                    n => format!(", after {n} restarts"),
                };
                eprintln!("bm-launch: rank {rank} failed first ({how}{restarts})");
                for (local, status) in report.statuses.iter().enumerate() {
                    let rank = args.node_rank * args.nproc_per_node + local;
                    match status {
                        Some(s) => eprintln!("bm-launch:   rank {rank}: {s}"),
                        None => {
                            eprintln!("bm-launch:   rank {rank}: killed after the grace period")
                        }
                    }
                }
                ExitCode::FAILURE
            }
        },
        Err(error) => {
            eprintln!("bm-launch: cannot start {program}: {error}");
            ExitCode::from(2)
        }
    }
}
