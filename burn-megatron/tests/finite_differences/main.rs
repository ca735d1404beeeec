//! Gradients against central finite differences, in f64 on the CPU: the dropout, RoPE, masked
//! softmax, GeLU, SwiGLU, norm, flash-attention (split and packed), embedding, bias-add,
//! output-major linear and grouped linear ops, ring attention over CP thread ranks, the
//! MoE dispatcher's variable-size all-to-all over thread ranks,
//! `--tp-comm-overlap`'s gathered and reduce-scattered projections over TP thread ranks, and
//! every parameter of a tiny GPT and a tiny Llama.
//!
//! The layout-equivalence tests compare two computations that share every backward, so a
//! wrong backward passes them; a finite difference of the forward cannot share the mistake.
//!
//! f64 has its own test binary: Burn keys a device's default float dtype by the device alone,
//! `NdArray<f32>` and `NdArray<f64>` share the CPU device, and the first tensor of a process
//! fixes it. [`device`] checks that this process got f64.

mod all_to_all_v;
mod backward_hook;
mod context_parallel;
mod dropout;
mod embedding_and_bias;
mod flash_attention;
mod gelu;
mod grouped_linear;
mod masked_softmax;
mod models;
mod moe;
mod norm;
mod packed_flash_attention;
mod rope;
mod swiglu;
mod tp_comm_overlap;

use burn::backend::ndarray::NdArrayDevice;
use burn::backend::{Autodiff, NdArray};
use burn::tensor::{DType, Tensor};

pub type B = NdArray<f64>;
pub type AD = Autodiff<B>;

/// The finite-difference step: truncation error `h² f''' / 6` ~ 1e-10, rounding error
/// `ε |f| / h` ~ 1e-11 relative to the function's scale.
pub const STEP: f64 = 1e-5;

/// The CPU device, after checking that its float tensors are f64.
pub fn device() -> NdArrayDevice {
    let device = NdArrayDevice::default();
    let dtype = Tensor::<AD, 1>::zeros([1], &device).dtype();
    assert_eq!(
        dtype,
        DType::F64,
        "this binary's tensors must be f64 (did an f32 test join it?)"
    );
    device
}
