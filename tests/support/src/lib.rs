//! Test helpers shared by every burn-megatron test crate (a dev-dependency only).
//!
//! - [`compare`]: the relative difference of two tensors, which fails on any non-finite value
//!   in either operand (naming the tensor and the index), so a NaN can never pass a test;
//!   [`assert_near_zero`] for results that must be 0; [`paired`] for lists of named results
//!   (gradients by path), which must hold the same names.
//! - [`tolerance`]: the bounds a comparison uses, named per dtype.
//! - [`run`]: a launch of thread ranks that fails the test with every rank's error.
//! - [`scratch_dir`]: a fresh directory for one test's files.
//! - `models` (feature `models`): the tiny GPT and Llama configurations, token ids and
//!   microbatches that burn-megatron's test crates share.

pub mod compare;
#[cfg(feature = "models")]
pub mod models;
pub mod tolerance;

use std::path::PathBuf;
use std::time::Duration;

use burn_megatron_dist::{LaunchConfig, RankContext, launch};

pub use compare::{
    assert_close, assert_near_zero, data_values, paired, relative_difference, values, values_f32,
};

/// Runs `f` on `n` thread ranks (60 s collective timeout) and returns every rank's result;
/// a failed launch fails the test with each rank's error.
pub fn run<T: Send>(
    n: usize,
    f: impl Fn(RankContext) -> Result<T, Box<dyn std::error::Error + Send + Sync>> + Sync,
) -> Vec<T> {
    let config = LaunchConfig::new(n).with_timeout(Duration::from_secs(60));
    launch(config, f).unwrap_or_else(|e| panic!("launch failed: {e}\n{:#?}", e.failures))
}

/// A fresh, empty directory `<temp>/<prefix>-<pid>-<test>` for one test's files (whatever an
/// earlier run left there removed).
pub fn scratch_dir(prefix: &str, test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{prefix}-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creating a scratch directory");
    dir
}
