//! A linear layer whose output features are split across tensor-parallel ranks.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{Tensor, backend::Backend};
use burn_megatron_dist::mapping::gather_from_tensor_parallel_region;
use burn_megatron_dist::{DistBackend, DistResult, ProcessGroup};

use crate::backend::ModelBackend;
use crate::ops::GatheredProjection;
use crate::ops::fp8::{Fp8Config, Fp8Linear, Fp8Split, hooked_fp8_linear};
use crate::ops::hooked_linear;
use crate::ops::swiglu::bias_swiglu;

use super::placement::{DeclarePlacements, ParamPlacement, Placements};
use super::tp_context::{SequenceParallelGrads, TpContext};
use crate::error::ConfigError;
use crate::init::{InitDistribution, init_slice, param_seed};
use crate::ops::CounterNormalOps;

/// Configuration of a [`ColumnParallelLinear`].
#[derive(Config, Debug)]
pub struct ColumnParallelLinearConfig {
    /// Input features.
    pub d_input: usize,
    /// Output features of the whole layer, over all TP ranks.
    pub d_output: usize,
    /// Whether the layer has a bias (initialised to zero).
    #[config(default = true)]
    pub bias: bool,
    /// Whether to all-gather the output, so that every rank holds all `d_output` features.
    #[config(default = false)]
    pub gather_output: bool,
    /// Sequence parallelism: the input is sharded along the sequence (dimension 1) and is
    /// all-gathered before the product.
    #[config(default = false)]
    pub sequence_parallel: bool,
    /// Under sequence parallelism, the input's all-gather and the product run as one
    /// operation whose backward reduce-scatters the input's gradient while it computes the
    /// weight's gradient ([`crate::ops::gathered_linear`], Megatron's `--tp-comm-overlap`).
    /// Same results. Ignored without sequence parallelism and in FP8.
    #[config(default = false)]
    pub comm_overlap: bool,
    /// Standard deviation of the normal initialisation of the weight.
    #[config(default = 0.02)]
    pub init_std: f64,
    /// FP8 GEMMs (forward and backward) with these settings; `None` for the model's dtype.
    pub fp8: Option<Fp8Config>,
}

/// `y = x A + b` with `A` split by columns: rank `r` holds columns
/// `[r · d_output / tp, (r + 1) · d_output / tp)` and computes that slice of `y`.
///
/// Megatron's first layer of a pair (MLP up-projection, attention QKV): its input is copied
/// into the tensor-parallel region (the *f* operator: identity forward, all-reduce backward).
#[derive(Module, Debug)]
pub struct ColumnParallelLinear<B: Backend> {
    /// `[d_input, d_output / tp]`: this rank's column slice of the full weight,
    /// drawn from `N(0, init_std²)`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[d_output / tp]`: this rank's slice of the bias, initialised to zero.
    pub bias: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    tp: TpContext,
    #[module(skip)]
    gather_output: bool,
    #[module(skip)]
    comm_overlap: bool,
    /// The FP8 settings and scaling state, when the GEMMs run in FP8.
    #[module(skip)]
    fp8: Option<Fp8Linear>,
}

impl ColumnParallelLinearConfig {
    /// This rank's slice of the layer. Parameter values depend on `seed` only, not on the
    /// tensor-parallel size.
    pub fn init<B: DistBackend + CounterNormalOps>(
        &self,
        tp: &ProcessGroup,
        seed: u64,
        device: &B::Device,
    ) -> Result<ColumnParallelLinear<B>, ConfigError> {
        ConfigError::check_divisible("output features", self.d_output, tp.size())?;
        let width = self.d_output / tp.size();
        let cols = tp.rank() * width..(tp.rank() + 1) * width;
        let weight = init_slice(
            [self.d_input, self.d_output],
            [0..self.d_input, cols],
            InitDistribution::Normal { std: self.init_std },
            param_seed(seed, "weight"),
            device,
        );
        let bias = self
            .bias
            .then(|| Param::from_tensor(Tensor::zeros([width], device)));
        Ok(ColumnParallelLinear {
            weight: Param::from_tensor(weight),
            bias,
            tp: TpContext::new(tp, self.sequence_parallel),
            gather_output: self.gather_output,
            comm_overlap: self.comm_overlap,
            fp8: self
                .fp8
                .clone()
                .map(|c| Fp8Linear::new(c, Some(tp), Fp8Split::COLUMN_PARALLEL)),
        })
    }
}

/// The weight's columns and the bias are sharded over TP (dimensions 1 and 0).
impl<B: Backend> DeclarePlacements for ColumnParallelLinear<B> {
    fn declare_placements(&self, out: &mut Placements) {
        out.declare(&self.weight, ParamPlacement::sharded(1, &self.tp.group));
        if let Some(bias) = &self.bias {
            out.declare(bias, ParamPlacement::sharded(0, &self.tp.group));
        }
    }
}

impl<B: Backend> ColumnParallelLinear<B> {
    /// The same layer (same parameters and ids) in a context that sums sequence parallelism's
    /// partial gradients where `grads` says. A column-parallel layer has none of its own; it
    /// keeps its context like the layers beside it.
    pub fn with_sequence_parallel_grads(self, grads: SequenceParallelGrads) -> Self {
        self.map_tp_context(&|tp| tp.with_sequence_parallel_grads(grads))
    }

    /// The same (same parameters and ids) with its tensor-parallel context mapped by `f`.
    pub fn map_tp_context(self, f: &dyn Fn(TpContext) -> TpContext) -> Self {
        Self {
            tp: f(self.tp),
            ..self
        }
    }

    /// The same (same parameters and ids) with its tokens split over `cp` (the
    /// context-parallel group, `None`: not split): an FP8 layer reduces the amaxes of its
    /// input and output gradient over it ([`Fp8Linear::with_sequence_group`]).
    pub fn with_sequence_group(self, cp: Option<&ProcessGroup>) -> Self {
        Self {
            fp8: self.fp8.map(|fp8| fp8.with_sequence_group(cp)),
            ..self
        }
    }
}

impl<B: ModelBackend> ColumnParallelLinear<B> {
    /// `[.., d_input]` → `[.., d_output / tp]`, or `[.., d_output]` with `gather_output`.
    /// Under sequence parallelism the input is `[batch, seq / tp, d_input]` and the output
    /// covers the whole sequence.
    ///
    /// Burn's convention of an infallible `forward`, for code written against it.
    ///
    /// # Shapes
    /// - input: `[..., d_input]` (`seq / tp` along the sequence dimension under sequence
    ///   parallelism, gathered here)
    /// - output: `[..., d_output / tp]`, this rank's columns (all of them with
    ///   `gather_output`)
    ///
    /// # Panics
    /// If a collective fails (a peer died, a timeout); [`try_forward`](Self::try_forward)
    /// returns the error instead and is preferred.
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        self.try_forward(input).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`forward`](Self::forward), returning communication errors.
    pub fn try_forward<const D: usize>(&self, input: Tensor<B, D>) -> DistResult<Tensor<B, D>> {
        let bias = self.bias.as_ref().map(|b| b.val());
        let output = match D == 3 && self.overlaps() {
            true => {
                let weight = self.weight.val();
                self.gathered(input, GatheredProjection::Linear { weight, bias })?
            }
            false => self.product(self.input(input)?, bias)?,
        };
        self.output(output)
    }

    /// SwiGLU's `silu(x · gate + b_g) · (x · up + b_u)` with this layer as the up projection
    /// and `gate` as the gate, both entered from one input: `[.., d_output / tp]`, this rank's
    /// features. With [`comm_overlap`](ColumnParallelLinearConfig::comm_overlap) under
    /// sequence parallelism one operation with the input's all-gather
    /// ([`crate::ops::gathered_linear`]); otherwise the input enters once and the two products
    /// feed [`bias_swiglu`].
    ///
    /// # Shapes
    /// - input: `[batch, seq, d_input]` (`seq / tp` under sequence parallelism)
    /// - output: `[batch, seq, d_output / tp]` (the whole sequence)
    pub fn try_forward_swiglu(&self, gate: &Self, input: Tensor<B, 3>) -> DistResult<Tensor<B, 3>> {
        debug_assert!(gate.shares_input_with(self) && !self.gather_output);
        let bias = match (&gate.bias, &self.bias) {
            (Some(gate_bias), Some(up_bias)) => Some([gate_bias.val(), up_bias.val()]),
            (None, None) => None,
            _ => unreachable!("the gate and up projections of an MLP share the bias setting"),
        };
        if self.overlaps() && gate.overlaps() {
            let projection = GatheredProjection::SwiGlu {
                gate: gate.weight.val(),
                up: self.weight.val(),
                bias,
            };
            return self.gathered(input, projection);
        }
        let x = self.input(input)?;
        let (g, _) = gate.try_forward_entered_skip_bias(x.clone())?;
        let (u, _) = self.try_forward_entered_skip_bias(x)?;
        Ok(bias_swiglu(g, u, bias))
    }

    /// Whether the input's all-gather and the product run as one overlapped operation:
    /// `comm_overlap`, sequence parallelism over more than one rank, and no FP8.
    fn overlaps(&self) -> bool {
        self.comm_overlap
            && self.tp.sequence_parallel
            && self.tp.group.size() > 1
            && self.fp8.is_none()
    }

    /// `projection(all_gather(input))` along the sequence as one operation
    /// ([`gathered_linear`](crate::ops::GatheredLinearOps::gathered_linear)) for a `[batch, seq / tp, d_input]` input. The
    /// operation gathers whole rank shards (rank-major tokens); for a batch of more than one
    /// sequence the output's tokens are put back in `[batch, seq]` order.
    fn gathered<const D: usize>(
        &self,
        input: Tensor<B, D>,
        projection: GatheredProjection<B>,
    ) -> DistResult<Tensor<B, D>> {
        let dims = input.dims();
        assert_eq!(
            D, 3,
            "a sequence-parallel input is [batch, seq / tp, features]"
        );
        let (batch, local, size) = (dims[0], dims[1], self.tp.group.size());
        let rows = input.reshape([batch * local, dims[2]]);
        let y = B::gathered_linear(rows, projection, &self.tp.group)?;
        let d_out = y.dims()[1];
        let mut out = dims;
        out[1] = size * local;
        out[D - 1] = d_out;
        Ok(match batch {
            1 => y.reshape(out),
            _ => y
                .reshape([size, batch, local, d_out])
                .swap_dims(0, 1)
                .reshape(out),
        })
    }

    /// `x A` and the bias, not yet added (Megatron's `skip_bias_add`), for a next operation
    /// that adds it itself (bias-GeLU). The bias is this rank's `[d_output / tp]`, or the
    /// whole `[d_output]` with `gather_output`.
    pub fn try_forward_skip_bias<const D: usize>(
        &self,
        input: Tensor<B, D>,
    ) -> DistResult<(Tensor<B, D>, Option<Tensor<B, 1>>)> {
        if D == 3 && self.overlaps() {
            let weight = self.weight.val();
            let output = self.gathered(input, GatheredProjection::Linear { weight, bias: None })?;
            let bias = self.bias.as_ref().map(|b| b.val());
            return Ok((self.output(output)?, bias));
        }
        self.try_forward_entered_skip_bias(self.input(input)?)
    }

    /// [`try_forward_skip_bias`](Self::try_forward_skip_bias) of an input that has already
    /// entered the tensor-parallel region through [`input`](Self::input) (of this layer, or
    /// of another with the same group and sequence parallelism). Layers that read one input
    /// (SwiGLU's gate and up projections) enter it once: one all-gather forward and one
    /// reduce-scatter backward under sequence parallelism, instead of one per layer.
    pub fn try_forward_entered_skip_bias<const D: usize>(
        &self,
        entered: Tensor<B, D>,
    ) -> DistResult<(Tensor<B, D>, Option<Tensor<B, 1>>)> {
        let output = self.output(self.product(entered, None)?)?;
        let bias = match &self.bias {
            Some(bias) => Some(self.output(bias.val())?),
            None => None,
        };
        Ok((output, bias))
    }

    /// `x A + b` on this rank's columns: [`linear`], or [`hooked_fp8_linear`] when the layer
    /// runs in FP8 (its amaxes of the weight and the output gradient reduced over the group).
    fn product<const D: usize>(
        &self,
        x: Tensor<B, D>,
        bias: Option<Tensor<B, 1>>,
    ) -> DistResult<Tensor<B, D>> {
        match &self.fp8 {
            Some(fp8) => hooked_fp8_linear(
                x,
                self.weight.val(),
                bias,
                fp8,
                self.tp.backward_hook.as_ref(),
            ),
            None => Ok(hooked_linear(
                x,
                self.weight.val(),
                bias,
                false,
                self.tp.backward_hook.as_ref(),
            )),
        }
    }

    /// The FP8 settings and scaling state, when the layer's GEMMs run in FP8.
    pub fn fp8(&self) -> Option<&Fp8Linear> {
        self.fp8.as_ref()
    }

    /// Whether `other` enters its input into the same region the same way, so that one
    /// [`input`](Self::input) serves both.
    pub fn shares_input_with(&self, other: &Self) -> bool {
        self.tp == other.tp
    }

    /// The input as the product needs it: copied into the tensor-parallel region (the *f*
    /// operator), or gathered along the sequence (dimension 1) under sequence parallelism.
    pub fn input<const D: usize>(&self, input: Tensor<B, D>) -> DistResult<Tensor<B, D>> {
        self.tp.enter(input)
    }

    /// This rank's features, or all of them with `gather_output`.
    fn output<const D: usize>(&self, output: Tensor<B, D>) -> DistResult<Tensor<B, D>> {
        if self.gather_output {
            gather_from_tensor_parallel_region(output, &self.tp.group)
        } else {
            Ok(output)
        }
    }

    /// The tensor-parallel group.
    pub fn tp(&self) -> &ProcessGroup {
        &self.tp.group
    }
}
