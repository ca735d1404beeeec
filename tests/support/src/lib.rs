//! Test helpers shared by every burn-megatron test crate (a dev-dependency only).
//!
//! - [`compare`]: the relative difference of two tensors, which fails on any non-finite value
//!   in either operand (naming the tensor and the index), so a NaN can never pass a test.
//! - [`tolerance`]: the bounds a comparison uses, named per dtype.
//! - [`run`]: a launch of thread ranks that fails the test with every rank's error.

pub mod compare;
pub mod tolerance;

use std::time::Duration;

use burn_megatron_dist::{LaunchConfig, RankContext, launch};

pub use compare::{assert_close, data_values, relative_difference, values, values_f32};

/// Runs `f` on `n` thread ranks (60 s collective timeout) and returns every rank's result;
/// a failed launch fails the test with each rank's error.
pub fn run<T: Send>(
    n: usize,
    f: impl Fn(RankContext) -> Result<T, Box<dyn std::error::Error + Send + Sync>> + Sync,
) -> Vec<T> {
    let config = LaunchConfig::new(n).with_timeout(Duration::from_secs(60));
    launch(config, f).unwrap_or_else(|e| panic!("launch failed: {e}\n{:#?}", e.failures))
}
