//! The column-parallel projection of a sequence-parallel input with its communication hidden
//! behind the GEMMs (Megatron's `--tp-comm-overlap`, for the projections that enter a
//! tensor-parallel region: QKV, and fc1 or SwiGLU's gate and up).
//!
//! Composed of separate operations, the input's all-gather is one autodiff node and the
//! projection another: Burn runs the projection's backward (the data-gradient GEMM and the
//! weight-gradient GEMM) before the gather's backward (the reduce-scatter of the data
//! gradient), and the next layer's backward waits for that reduce-scatter with nothing left
//! to run beside it. Here the gather and the projection are one node. On a plain backend
//! (no autodiff: inference) the forward starts a linear projection with this rank's own
//! tokens, which need no communication, while the gather runs, then projects the other ranks'
//! tokens. Under `Autodiff` the forward gathers, then projects every token in one GEMM: the
//! gather is not hidden there (splitting the GEMM would cost a copy of its output to put the
//! rows back in order). Its backward computes the data gradient, starts its reduce-scatter (on NCCL, on the group's own
//! stream), and computes the weight gradients while it runs. The arithmetic is the
//! composition's, operation for operation, on the tokens in rank-major order (the order the
//! MLP's composition gathers them in); for a batch of several sequences, which attention's
//! composition gathers in `[batch, seq]` order, the weight gradient sums the same products in
//! another order.
//!
//! A failed reduce-scatter in the backward is recorded on the group
//! ([`ProcessGroup::fail_in_backward`]) and the input's gradient goes on as zeros.

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_megatron_dist::{DistBackend, DistResult, ProcessGroup, ReduceOp};

use super::autodiff::{AutodiffPrimitive, BackwardStep, inner, parent, record, register};
use super::linear::LinearOps;
use super::primitive::{raw, wrap};
use super::swiglu::{SwiGluBias, SwiGluOps};

/// What the gathered input is multiplied by.
#[derive(Debug, Clone)]
pub enum GatheredProjection<B: Backend> {
    /// `x · weight + bias` (`weight: [d_in, d_out]`).
    Linear {
        /// `[d_in, d_out]`.
        weight: Tensor<B, 2>,
        /// `[d_out]`.
        bias: Option<Tensor<B, 1>>,
    },
    /// `silu(x · gate + b_g) · (x · up + b_u)`: SwiGLU's two projections and its elementwise
    /// part (`gate, up: [d_in, d_out]`).
    SwiGlu {
        /// `[d_in, d_out]`.
        gate: Tensor<B, 2>,
        /// `[d_in, d_out]`.
        up: Tensor<B, 2>,
        /// `[b_g, b_u]`, `[d_out]` each.
        bias: Option<SwiGluBias<B>>,
    },
}

impl<B: LinearOps + SwiGluOps> GatheredProjection<B> {
    /// The projection of `gathered: [size · tokens, d_in]`, as separate operations, where
    /// `own: [tokens, d_in]` is this rank's part (rank `rank` of `size`): a linear projection
    /// starts with `own`, which needs no communication, while the gather runs.
    fn apply(
        self,
        own: Tensor<B, 2>,
        gathered: Tensor<B, 2>,
        rank: usize,
        size: usize,
    ) -> Tensor<B, 2> {
        match self {
            Self::Linear { weight, bias } => local_first(own, gathered, rank, size, |x| {
                <B as LinearOps>::linear(x, weight.clone(), bias.clone())
            }),
            Self::SwiGlu { gate, up, bias } => {
                let g = <B as LinearOps>::linear(gathered.clone(), gate, None);
                let u = <B as LinearOps>::linear(gathered, up, None);
                B::swiglu(g, u, bias)
            }
        }
    }
}

/// `product(gathered)` for a product that works row by row, computed as `product(own)` (this
/// rank's rows, ready before the gather ends) and the product of the other ranks' rows, then
/// concatenated in rank order: the GEMM on `own` runs while the gather is in flight.
///
/// # Shapes
/// - `own`: `[tokens, d_in]`, rank `rank`'s rows of `gathered: [size · tokens, d_in]`
/// - output: `[size · tokens, d_out]`
pub(crate) fn local_first<B: Backend>(
    own: Tensor<B, 2>,
    gathered: Tensor<B, 2>,
    rank: usize,
    size: usize,
    product: impl Fn(Tensor<B, 2>) -> Tensor<B, 2>,
) -> Tensor<B, 2> {
    let tokens = own.dims()[0];
    let own = product(own);
    let before = (rank > 0).then(|| product(gathered.clone().narrow(0, 0, rank * tokens)));
    let after_rows = (size - rank - 1) * tokens;
    let after =
        (after_rows > 0).then(|| product(gathered.narrow(0, (rank + 1) * tokens, after_rows)));
    Tensor::cat(before.into_iter().chain([own]).chain(after).collect(), 0)
}

/// The projection of an input all-gathered over a tensor-parallel group.
pub trait GatheredLinearOps: LinearOps + SwiGluOps + DistBackend {
    /// `projection(all_gather(x))`, the gather along the tokens (dimension 0, rank-major).
    /// `Autodiff<B>` records one node whose backward reduce-scatters the input's gradient while
    /// it computes the weights' gradients (see the [module docs](self)).
    ///
    /// # Shapes
    /// - `x`: `[tokens, d_in]`, this rank's tokens
    /// - output: `[size · tokens, d_out]`, every rank's tokens in rank order
    fn gathered_linear(
        x: Tensor<Self, 2>,
        projection: GatheredProjection<Self>,
        group: &ProcessGroup,
    ) -> DistResult<Tensor<Self, 2>> {
        let gathered = group.all_gather(x.clone(), 0)?;
        Ok(projection.apply(x, gathered, group.rank(), group.size()))
    }
}

impl<B: GatheredLinearOps, C: CheckpointStrategy> GatheredLinearOps for Autodiff<B, C> {
    fn gathered_linear(
        x: Tensor<Self, 2>,
        projection: GatheredProjection<Self>,
        group: &ProcessGroup,
    ) -> DistResult<Tensor<Self, 2>> {
        let x = raw(x);
        let gathered = group.all_gather(inner::<B, 2>(&x), 0)?;
        let input = raw(gathered.clone());
        let group = group.clone();
        let output = match projection {
            GatheredProjection::Linear { weight, bias } => {
                let (weight, bias) = (raw(weight), bias.map(raw));
                let y =
                    <B as LinearOps>::linear(gathered, inner(&weight), bias.as_ref().map(inner));
                let state = GatheredState {
                    input,
                    group,
                    product: Product::Linear {
                        weight: weight.primitive.clone(),
                        bias: bias.is_some(),
                    },
                };
                let mut inputs: Vec<&AutodiffPrimitive<B>> = vec![&x, &weight];
                inputs.extend(bias.as_ref());
                record::<B, C, _>(GatheredBackward, &inputs, state, raw(y))
            }
            GatheredProjection::SwiGlu { gate, up, bias } => {
                let (gate, up) = (raw(gate), raw(up));
                let bias = bias.map(|b| b.map(raw));
                let g = <B as LinearOps>::linear(gathered.clone(), inner(&gate), None);
                let u = <B as LinearOps>::linear(gathered, inner(&up), None);
                let inner_bias = bias.as_ref().map(|b| b.each_ref().map(inner));
                let h = B::swiglu(g.clone(), u.clone(), inner_bias);
                let state = GatheredState {
                    input,
                    group,
                    product: Product::SwiGlu {
                        gate: gate.primitive.clone(),
                        up: up.primitive.clone(),
                        g: raw(g),
                        u: raw(u),
                        bias: bias
                            .as_ref()
                            .map(|b| b.each_ref().map(|b| b.primitive.clone())),
                    },
                };
                let mut inputs: Vec<&AutodiffPrimitive<B>> = vec![&x, &gate, &up];
                if let Some([b_g, b_u]) = &bias {
                    inputs.extend([b_g, b_u]);
                }
                record::<B, C, _>(GatheredBackward, &inputs, state, raw(h))
            }
        };
        Ok(wrap(output))
    }
}

/// What the backward keeps: the gathered input, the group, and the product's operands.
#[derive(Debug, Clone)]
struct GatheredState<B: Backend> {
    input: FloatTensor<B>,
    group: ProcessGroup,
    product: Product<B>,
}

/// The product's operands as the backward needs them.
#[derive(Debug, Clone)]
enum Product<B: Backend> {
    /// Parents `[x, weight]` or `[x, weight, bias]`.
    Linear { weight: FloatTensor<B>, bias: bool },
    /// Parents `[x, gate, up]` or `[x, gate, up, b_g, b_u]`; `g` and `u` are the projections
    /// before their biases.
    SwiGlu {
        gate: FloatTensor<B>,
        up: FloatTensor<B>,
        g: FloatTensor<B>,
        u: FloatTensor<B>,
        bias: Option<[FloatTensor<B>; 2]>,
    },
}

/// A projection's weight and the gradient of its product.
type WeightAndGrad<B> = (Tensor<B, 2>, Tensor<B, 2>);

/// The backward: the data gradient, its reduce-scatter started, then the weights' gradients.
#[derive(Debug)]
struct GatheredBackward;

impl<B: GatheredLinearOps> BackwardStep<B> for GatheredBackward {
    type State = GatheredState<B>;

    fn backward(
        self,
        grad: FloatTensor<B>,
        state: <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        let GatheredState {
            input,
            group,
            product,
        } = state;
        let input = wrap::<B, 2>(input);
        let dy = wrap::<B, 2>(grad);
        // `[(weight, gradient of its product)]`, and the biases' gradients.
        let (products, bias_grads): (Vec<WeightAndGrad<B>>, Vec<Tensor<B, 1>>) = match product {
            Product::Linear { weight, bias } => {
                let bias_grads = match bias {
                    true => vec![B::bias_gradient(dy.clone())],
                    false => vec![],
                };
                (vec![(wrap(weight), dy)], bias_grads)
            }
            Product::SwiGlu {
                gate,
                up,
                g,
                u,
                bias,
            } => {
                let (g, u) = (wrap(g), wrap(u));
                let bias = bias.map(|b| b.map(wrap));
                let ([dg, du], bias_grads) = match bias {
                    Some(bias) => {
                        let (d, b) = B::swiglu_backward_and_bias_gradients(g, u, bias, dy);
                        (d, b.into())
                    }
                    None => (B::swiglu_backward(g, u, None, dy), vec![]),
                };
                (vec![(wrap(gate), dg), (wrap(up), du)], bias_grads)
            }
        };
        // The input's gradient first, so that its reduce-scatter runs beside the weight
        // gradients' GEMMs. Summed in the order Burn sums a parent's gradients.
        register(grads, parent(parents, 0), || {
            let dx = products
                .iter()
                .map(|(w, d)| B::gemm(d.clone(), w.clone(), false, true))
                .reduce(|a, b| a + b)
                .expect("a projection has a weight");
            let ([rows, features], dtype, device) = (dx.dims(), dx.dtype(), dx.device());
            match group.reduce_scatter(dx, 0, ReduceOp::Sum) {
                Ok(dx) => dx,
                Err(error) => {
                    group.fail_in_backward(error);
                    Tensor::zeros([rows / group.size(), features], (&device, dtype))
                }
            }
        });
        let weights = products.len();
        for (index, (_, d)) in products.into_iter().enumerate() {
            register(grads, parent(parents, 1 + index), || {
                B::gemm(input.clone(), d, true, false)
            });
        }
        for (index, db) in bias_grads.into_iter().enumerate() {
            register(grads, parent(parents, 1 + weights + index), || db);
        }
    }
}

/// CubeCL backends: the default.
#[cfg(feature = "fused")]
impl<R, F, I, BT> GatheredLinearOps for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
    Self: LinearOps + SwiGluOps + DistBackend,
{
}
