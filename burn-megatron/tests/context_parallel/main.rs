//! Context parallelism (issue 35) on CPU thread ranks: the load-balanced split and its
//! position ids, the ring exchange, causal attention over CP = 1, 2, 4 by each communication
//! (`p2p` ring, `all_gather`, `a2a`) against the single-device attention, forward and
//! backward, and the whole GPT and Llama models at CP 2 and 4 (with TP, SP and DP) against
//! CP 1. The f64 finite differences of the ring's gradients are in the
//! `finite_differences` target.

mod attention;
mod model;
mod ring_exchange;
mod split;

use burn::backend::{Autodiff, NdArray};
pub use burn_megatron_testing::{assert_close, run, tolerance, values};

pub type B = NdArray<f32>;
pub type AD = Autodiff<B>;
