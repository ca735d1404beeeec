//! Context parallelism (issue 35) on CPU thread ranks: the load-balanced split and its
//! position ids, the ring exchange, and causal attention over CP = 1, 2, 4 by both
//! communications (`p2p` ring, `all_gather`) against the single-device attention, forward and
//! backward. The f64 finite differences of the ring's gradients are in the
//! `finite_differences` target.

mod attention;
mod ring_exchange;
mod split;

use burn::backend::{Autodiff, NdArray};
pub use burn_megatron_testing::{assert_close, run, tolerance, values};

pub type B = NdArray<f32>;
pub type AD = Autodiff<B>;
