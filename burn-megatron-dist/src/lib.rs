//! Process groups, parallel state and differentiable collectives for burn-megatron.
//!
//! - [`launch`] runs a closure on N thread ranks (a CPU "cluster") and never hangs on a rank
//!   that fails: the others are released with an error naming it.
//! - [`ProcessGroup`] runs collectives (all-reduce, all-gather, reduce-scatter, broadcast,
//!   all-to-all, barrier, send/recv) on Burn tensors of any [`DeviceTransport`] backend,
//!   synchronously or through [`Work`] handles. A call that cannot complete fails within the timeout, naming
//!   the group, the operation and the missing ranks.
//! - [`ParallelLayout`] and [`ParallelState`] build Megatron's TP/PP/DP/CP/EP groups.
//! - [`mapping`] holds Megatron's differentiable communication operators (*f*, *g*, and the
//!   sequence-parallel and all-to-all ones), on any [`DistBackend`].
//! - [`p2p`] holds the batched point-to-point exchange of pipeline stages.
//!
//! ```
//! use burn::backend::NdArray;
//! use burn::tensor::Tensor;
//! use burn_megatron_dist::{launch, LaunchConfig, ReduceOp};
//!
//! let sums = launch(LaunchConfig::new(4), |ctx| {
//!     let x = Tensor::<NdArray, 1>::from_floats([ctx.rank() as f32], &Default::default());
//!     let sum = ctx.world().all_reduce(x, ReduceOp::Sum)?;
//!     Ok::<_, burn_megatron_dist::DistError>(sum.into_scalar())
//! })
//! .unwrap();
//! assert_eq!(sums, vec![6.0; 4]);
//! ```

mod connect;
mod error;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod flat_collective;
mod host_read;
mod launch;
mod layout;
pub mod mapping;
#[cfg(feature = "cuda")]
pub mod nccl;
mod op;
pub mod p2p;
mod parallel_state;
mod placement;
mod process;
mod process_group;
pub mod shard;
mod spawn;
mod tcp;
mod threads;
mod transport;
#[cfg(feature = "cuda")]
mod watchdog;
mod work;

pub use error::{DistError, DistResult};
pub use host_read::HostRead;
pub use launch::{LaunchConfig, LaunchError, RankContext, launch};
pub use layout::{GroupKind, LayoutError, ParallelLayout, ParallelSizes, RankCoords};
pub use mapping::DistBackend;
pub use op::{CollectiveOp, ReduceOp};
pub use parallel_state::ParallelState;
pub use placement::Placement;
pub use process::{ProcessEnv, run_rank};
pub use process_group::{DeviceTransport, OnDevice, ProcessGroup};
pub use spawn::{SpawnConfig, SpawnReport, spawn_ranks, spawn_ranks_until};
pub use work::Work;
