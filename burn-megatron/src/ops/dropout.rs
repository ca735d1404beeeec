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
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_megatron_kernels::counter_rng::{drop_threshold, element_bits, multiplier, stream_key};

use crate::backend::{ModelBackend, wrap};

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

/// [`ModelBackend::dropout`] as a Burn composition: the mask built on the host, then
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

/// The `Autodiff<B>` operation: the inner backend's forward, and a node that keeps only the
/// mask's description.
pub(crate) fn autodiff_dropout<B: ModelBackend, C: CheckpointStrategy>(
    x: Tensor<Autodiff<B, C>, 4>,
    residual: Option<Tensor<Autodiff<B, C>, 4>>,
    mask: DropoutMask,
) -> Tensor<Autodiff<B, C>, 4> {
    let x = x.into_primitive().tensor();
    let residual = residual.map(|r| r.into_primitive().tensor());
    let output = B::dropout(
        wrap::<B, 4>(x.primitive.clone()),
        residual.as_ref().map(|r| wrap::<B, 4>(r.primitive.clone())),
        mask,
    )
    .into_primitive()
    .tensor();
    let output = match residual {
        Some(residual) => match DropoutAddBackward
            .prepare::<C>([x.node.clone(), residual.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(mask, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
        None => match DropoutBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(mask, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
    };
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// The backward of `y = x ∘ m`: `dx = dy ∘ m`.
#[derive(Debug)]
struct DropoutBackward;

impl<B: ModelBackend> Backward<B, 1> for DropoutBackward {
    type State = DropoutMask;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [Some(x)] = ops.parents else { return };
        let dx = B::dropout(wrap::<B, 4>(grad), None, ops.state);
        grads.register::<B>(x.id, dx.into_primitive().tensor());
    }
}

/// The backward of `y = residual + x ∘ m`: `dx = dy ∘ m`, `d_residual = dy`. Its parents are
/// `[x, residual]`.
#[derive(Debug)]
struct DropoutAddBackward;

impl<B: ModelBackend> Backward<B, 2> for DropoutAddBackward {
    type State = DropoutMask;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [x, residual] = ops.parents;
        if let Some(x) = x {
            let dx = B::dropout(wrap::<B, 4>(grad.clone()), None, ops.state);
            grads.register::<B>(x.id, dx.into_primitive().tensor());
        }
        if let Some(residual) = residual {
            grads.register::<B>(residual.id, grad);
        }
    }
}
