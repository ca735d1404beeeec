//! Dropout whose mask is a function of the element's global coordinates, optionally fused
//! with the residual add after it: `residual + x ∘ m`.
//!
//! `m` is 0 or `1 / (1 - p)`, decided by [`burn_megatron_kernels::counter_rng`] from the
//! stream's seed and the element's coordinates in the global tensor. Nothing is stored for the
//! backward pass: dropout is linear, its gradient is `dy ∘ m` with `m` drawn again.
//! CubeCL backends draw `m` inside one kernel each way (`burn_megatron_kernels::fused::dropout`);
//! the default composition builds the mask on the host.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorData};
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_megatron_kernels::counter_rng::{drop_threshold, element_bits, multiplier, stream_key};

use super::autodiff::{BackwardStep, inner, parent, record, register};
use super::primitive::{raw, wrap};

/// Dropout with masks drawn from global coordinates.
pub trait DropoutOps: Backend {
    /// `residual + x ∘ m` (without a residual, `x ∘ m`) for `x` and `residual` of one shape:
    /// dropout with the mask `m` of the [module docs](self), drawn from the global coordinates
    /// of each element, and the residual add after it. `Autodiff<B>` stores nothing but the
    /// mask's description; its backward is this op on the output's gradient. CubeCL backends
    /// draw the mask inside one kernel (`burn_megatron_kernels::fused::dropout`), others on
    /// the host.
    fn dropout(
        x: Tensor<Self, 4>,
        residual: Option<Tensor<Self, 4>>,
        mask: DropoutMask,
    ) -> Tensor<Self, 4> {
        dropout_composition(x, residual, mask)
    }
}

/// One dropout mask: the drop probability, the stream it is drawn from, and where the tensor
/// it is applied to sits in the global 4D tensor the mask is drawn for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutMask {
    /// The drop probability, in `[0, 1)`.
    pub prob: f64,
    /// The stream's seed.
    pub seed: u64,
    /// The coordinates of the tensor's first element in the global tensor.
    pub offset: [usize; 4],
}

impl DropoutMask {
    /// The multipliers of a block of shape `dims` at the mask's offset, on the host.
    pub fn multipliers(&self, dims: [usize; 4]) -> Vec<f32> {
        let key = stream_key(self.seed);
        let threshold = drop_threshold(self.prob);
        let scale = (1.0 / (1.0 - self.prob)) as f32;
        let coordinate = |d: usize, i: usize| (self.offset[d] + i) as u32;
        let mut values = Vec::with_capacity(dims.iter().product());
        for i0 in 0..dims[0] {
            for i1 in 0..dims[1] {
                for i2 in 0..dims[2] {
                    for i3 in 0..dims[3] {
                        let c = [
                            coordinate(0, i0),
                            coordinate(1, i1),
                            coordinate(2, i2),
                            coordinate(3, i3),
                        ];
                        values.push(multiplier(element_bits(key, c), threshold, scale));
                    }
                }
            }
        }
        values
    }
}

/// [`DropoutOps::dropout`] as a Burn composition: the mask built on the host, then
/// `residual + x · mask` in `x`'s dtype.
pub fn dropout_composition<B: Backend>(
    x: Tensor<B, 4>,
    residual: Option<Tensor<B, 4>>,
    mask: DropoutMask,
) -> Tensor<B, 4> {
    let dims = x.dims();
    let multipliers = TensorData::new(mask.multipliers(dims), dims);
    let dropped = x.clone() * Tensor::<B, 4>::from_data(multipliers, &x.device()).cast(x.dtype());
    match residual {
        Some(residual) => residual + dropped,
        None => dropped,
    }
}

/// The inner backend's forward, and a node that keeps only the mask's description.
impl<B: DropoutOps, C: CheckpointStrategy> DropoutOps for Autodiff<B, C> {
    fn dropout(
        x: Tensor<Self, 4>,
        residual: Option<Tensor<Self, 4>>,
        mask: DropoutMask,
    ) -> Tensor<Self, 4> {
        let (x, residual) = (raw(x), residual.map(raw));
        let output = raw(B::dropout(inner(&x), residual.as_ref().map(inner), mask));
        wrap(match &residual {
            Some(residual) => record::<B, C, _>(DropoutBackward, &[&x, residual], mask, output),
            None => record::<B, C, _>(DropoutBackward, &[&x], mask, output),
        })
    }
}

/// The backward of `y = residual + x ∘ m` (or `y = x ∘ m`): `dx = dy ∘ m`, `d_residual = dy`.
/// Its parents are `[x]` or `[x, residual]`.
#[derive(Debug)]
struct DropoutBackward;

impl<B: DropoutOps> BackwardStep<B> for DropoutBackward {
    type State = DropoutMask;

    fn backward(
        self,
        grad: FloatTensor<B>,
        mask: DropoutMask,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        register(grads, parent(parents, 0), || {
            B::dropout(wrap::<B, 4>(grad.clone()), None, mask)
        });
        register(grads, parent(parents, 1), || wrap::<B, 4>(grad));
    }
}

/// CubeCL backends: the mask drawn inside one kernel (f64: the composition).
#[cfg(feature = "fused")]
mod cube {
    use burn::tensor::{DType, Tensor};
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_megatron_kernels::fused::dropout as kernels;

    use super::{DropoutMask, DropoutOps, dropout_composition};
    use crate::ops::primitive::{raw, wrap};

    impl<R, F, I, BT> DropoutOps for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        fn dropout(
            x: Tensor<Self, 4>,
            residual: Option<Tensor<Self, 4>>,
            mask: DropoutMask,
        ) -> Tensor<Self, 4> {
            if x.dtype() == DType::F64 {
                return dropout_composition(x, residual, mask);
            }
            let dims @ [d0, d1, d2, d3] = x.dims();
            let flat = |t: Tensor<Self, 4>| raw(t.reshape([d0 * d1 * d2, d3]));
            let residual = residual.map(|r| flat(r.cast(x.dtype())));
            let placement = kernels::MaskPlacement {
                prob: mask.prob,
                seed: mask.seed,
                inner: [d1, d2],
                offset: mask.offset,
            };
            wrap::<Self, 2>(kernels::forward(flat(x), residual, placement)).reshape(dims)
        }
    }
}
