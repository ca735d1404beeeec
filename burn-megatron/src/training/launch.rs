//! Running a whole job on CPU thread ranks: the data built once and shared, one
//! [`pretrain`] per rank.

use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn_megatron_dist::{LaunchConfig, launch};

use super::config::PretrainConfig;
use super::data::PretrainData;
use super::observer::TrainingObserver;
use super::pretrain::{PretrainSummary, pretrain};
use crate::error::Result;

/// The CPU backend of thread-rank runs.
pub type CpuTraining = Autodiff<NdArray<f32>>;

/// Runs `config` on TP × PP × CP × DP thread ranks of this process (Burn's NdArray backend), reporting
/// to `observer` from rank 0, and returns rank 0's summary. The configuration is checked
/// before any rank starts; a failing rank releases the others and its error is returned.
pub fn pretrain_on_threads(
    config: &PretrainConfig,
    observer: &dyn TrainingObserver,
) -> Result<PretrainSummary> {
    let world = config.world_size();
    config.check(world)?;
    let data = PretrainData::build(config)?;
    let launch_config = LaunchConfig::new(world).with_timeout(Duration::from_secs(300));
    let mut summaries = launch(launch_config, |ctx| {
        pretrain::<CpuTraining>(&ctx, config, &data, &Default::default(), observer)
    })?;
    Ok(summaries.swap_remove(0))
}
