//! Ranks as processes, one per GPU: where this process sits, read from the launch
//! environment, and running its rank.

use std::error::Error;
use std::net::TcpListener;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use crate::error::{DistError, DistResult};
use crate::launch::{LaunchConfig, LaunchError, RankContext, finish_rank, panic_message};
use crate::process_group::{ProcessGroup, RankGroups};
use crate::tcp::{TcpServer, TcpTransport};
use crate::transport::Transport;

/// This process's place in a multi-process launch.
///
/// Read from torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, which `bm-launch`
/// sets too) or, failing those, SLURM's (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`).
/// Rank 0 serves the rendezvous at `MASTER_ADDR:MASTER_PORT` (default `127.0.0.1:29500`);
/// on several nodes, `MASTER_ADDR` must name rank 0's node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessEnv {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks in all.
    pub world_size: usize,
    /// Rank on this node: the GPU to use.
    pub local_rank: usize,
    /// Host of rank 0's rendezvous.
    pub master_addr: String,
    /// Port of rank 0's rendezvous.
    pub master_port: u16,
}

impl ProcessEnv {
    /// Reads the process environment.
    pub fn from_env() -> DistResult<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    // ANCHOR: from_vars
    /// Reads variables through `var` (the environment, or a map in tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> DistResult<Self> {
        let number = |name: &str| -> DistResult<Option<usize>> {
            var(name)
                .map(|v| {
                    v.trim()
                        .parse()
                        .map_err(|_| DistError::Rendezvous(format!("{name}={v:?} is not a number")))
                })
                .transpose()
        };
        let names = if var("RANK").is_some() {
            ["RANK", "WORLD_SIZE", "LOCAL_RANK"]
        } else if var("SLURM_PROCID").is_some() {
            ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"]
        } else {
            return Err(DistError::Rendezvous(
                "no launch variables: start ranks with bm-launch or torchrun (RANK, WORLD_SIZE, \
                 LOCAL_RANK) or under SLURM (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID)"
                    .into(),
            ));
        };
        let required = |name: &str| {
            number(name)?.ok_or_else(|| {
                DistError::Rendezvous(format!("{} is set but {name} is not", names[0]))
            })
        };
        let (rank, world_size) = (required(names[0])?, required(names[1])?);
        let local_rank = number(names[2])?.unwrap_or(0);
        if rank >= world_size {
            return Err(DistError::Rendezvous(format!(
                "{}={rank} is not below {}={world_size}",
                names[0], names[1]
            )));
        }
        let master_port = match var("MASTER_PORT") {
            Some(port) => port.trim().parse().map_err(|_| {
                DistError::Rendezvous(format!("MASTER_PORT={port:?} is not a port number"))
            })?,
            None => 29500,
        };
        Ok(Self {
            rank,
            world_size,
            local_rank,
            master_addr: var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
            master_port,
        })
    }
    // ANCHOR_END: from_vars

    fn address(&self) -> String {
        format!("{}:{}", self.master_addr, self.master_port)
    }
}

/// Runs `f` as this process's rank and reports how it ended to the others.
///
/// Rank 0 serves the rendezvous, and after its own work waits for every other rank to end
/// (the others need the rendezvous until then), failing if one neither ends nor calls it for
/// the timeout. As with [`launch`](crate::launch), a rank that fails or panics releases the
/// others with an error naming it; a process that dies outright releases them too. Rank 0's
/// process itself dead, hung or unreachable is an error naming its address within the
/// timeout (plus a few seconds), and within `config.master_start_wait` when nothing listens
/// there. `config` gives the timeout and checks; its world size must be the environment's.
pub fn run_rank<T, E, F>(env: &ProcessEnv, config: LaunchConfig, f: F) -> Result<T, LaunchError>
where
    E: Into<Box<dyn Error + Send + Sync>>,
    F: FnOnce(RankContext) -> Result<T, E>,
{
    let failed = |message: String| LaunchError {
        rank: env.rank,
        message: message.clone(),
        failures: vec![(env.rank, message)],
    };
    if config.world_size != env.world_size {
        return Err(failed(format!(
            "the launch config is for {} ranks, the environment says {}",
            config.world_size, env.world_size
        )));
    }
    let timeout = config.timeout;
    let server = match env.rank {
        0 => {
            let listener = TcpListener::bind(env.address()).map_err(|e| {
                failed(format!(
                    "rank 0 cannot serve the rendezvous at {}: {e}",
                    env.address()
                ))
            })?;
            Some(TcpServer::start(listener, env.world_size, timeout))
        }
        _ => None,
    };
    let transport = TcpTransport::connect(
        &env.address(),
        env.rank,
        env.world_size,
        timeout,
        config.master_start_wait,
    )
    .map_err(|e| failed(e.to_string()))?;
    let transport: Arc<dyn Transport> = Arc::new(transport);
    let groups = Arc::new(RankGroups::new(config.check_collectives));
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let members = (0..env.world_size).collect();
        let world = ProcessGroup::new(
            transport.clone(),
            groups.clone(),
            "world",
            members,
            env.rank,
        )
        .map_err(|e| e.to_string())?;
        f(RankContext {
            world,
            local_rank: env.local_rank,
        })
        .map_err(|e| e.into().to_string())
    }))
    .unwrap_or_else(|panic| Err(format!("panicked: {}", panic_message(&panic))));
    let mut outcome = finish_rank(transport.as_ref(), &groups, env.rank, outcome);
    if let Some(server) = server
        && let Err(error) = server.wait_all_ended()
    {
        // The ranks that went silent fail the job; rank 0's own error, if any, comes first.
        outcome = outcome.and(Err(error.to_string()));
    }
    outcome.map_err(|message| {
        // Report the root cause where the rendezvous still knows it.
        let root = transport.status().ok().and_then(|s| s.failure);
        let (rank, root_message) = root.unwrap_or((env.rank, message.clone()));
        LaunchError {
            rank,
            message: root_message,
            failures: vec![(env.rank, message)],
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> DistResult<ProcessEnv> {
        ProcessEnv::from_vars(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    }

    // ANCHOR: reads_variables
    #[test]
    fn reads_torchrun_then_slurm_variables() {
        let torchrun = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
            ("SLURM_PROCID", "7"),
        ]);
        let expected = ProcessEnv {
            rank: 3,
            world_size: 8,
            local_rank: 1,
            master_addr: "node0".into(),
            master_port: 1234,
        };
        assert_eq!(torchrun.unwrap(), expected);
        let slurm = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
            ("SLURM_LOCALID", "1"),
        ]);
        let slurm = slurm.unwrap();
        assert_eq!((slurm.rank, slurm.world_size, slurm.local_rank), (5, 6, 1));
        assert_eq!(
            (slurm.master_addr.as_str(), slurm.master_port),
            ("127.0.0.1", 29500)
        );
    }
    // ANCHOR_END: reads_variables

    #[test]
    fn bad_launch_variables_are_named() {
        let message = |vars: &[(&str, &str)]| env(vars).unwrap_err().to_string();
        assert!(message(&[]).contains("bm-launch or torchrun"));
        assert!(message(&[("RANK", "0")]).contains("WORLD_SIZE is not"));
        assert!(message(&[("RANK", "x"), ("WORLD_SIZE", "2")]).contains("RANK=\"x\""));
        assert!(message(&[("RANK", "2"), ("WORLD_SIZE", "2")]).contains("not below"));
        let port = [("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "99999")];
        assert!(message(&port).contains("MASTER_PORT"));
    }
}
