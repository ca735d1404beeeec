//! A linear layer whose input features are split across tensor-parallel ranks.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{Tensor, backend::Backend};
use burn_megatron_dist::mapping::scatter_to_tensor_parallel_region;
use burn_megatron_dist::{DistBackend, DistResult, ProcessGroup};

use crate::backend::ModelBackend;
use crate::ops::fp8::{Fp8Config, Fp8Linear, Fp8Split, hooked_fp8_linear};
use crate::ops::{bias_add, hooked_linear};

use super::placement::{DeclarePlacements, ParamPlacement, Placements};
use super::tp_context::{SequenceParallelGrads, TpContext};
use crate::error::ConfigError;
use crate::init::{InitDistribution, init_slice, param_seed};
use crate::ops::CounterNormalOps;

/// Configuration of a [`RowParallelLinear`].
#[derive(Config, Debug)]
pub struct RowParallelLinearConfig {
    /// Input features of the whole layer, over all TP ranks.
    pub d_input: usize,
    /// Output features.
    pub d_output: usize,
    /// Whether the layer has a bias (initialised to zero).
    #[config(default = true)]
    pub bias: bool,
    /// Whether the input is already split by features (the output of a
    /// [`ColumnParallelLinear`](super::ColumnParallelLinear)); otherwise each rank takes its
    /// slice of a full input.
    #[config(default = true)]
    pub input_is_parallel: bool,
    /// Sequence parallelism: the output is reduce-scattered along the sequence (dimension 1)
    /// instead of all-reduced.
    #[config(default = false)]
    pub sequence_parallel: bool,
    /// Under sequence parallelism, the product and the reduce-scatter run as one operation,
    /// in chunks whose collectives overlap the next chunk's GEMM, and whose backward computes
    /// this rank's tokens' input gradient while the output gradient's all-gather runs
    /// ([`crate::ops::reduce_scattered_linear`], Megatron's `--tp-comm-overlap`). For inputs of one sequence (`[1, seq, ..]`, as the MLP runs);
    /// ignored otherwise, without sequence parallelism and in FP8.
    #[config(default = false)]
    pub comm_overlap: bool,
    /// Standard deviation of the normal initialisation of the weight (Megatron scales it by
    /// `1 / sqrt(2 · layers)` for the output layers of a transformer).
    #[config(default = 0.02)]
    pub init_std: f64,
    /// FP8 GEMMs (forward and backward) with these settings; `None` for the model's dtype.
    pub fp8: Option<Fp8Config>,
}

/// `y = x A + b` with `A` split by rows: rank `r` holds rows
/// `[r · d_input / tp, (r + 1) · d_input / tp)`, multiplies its slice of the input, and the
/// partial products are summed over the group (the *g* operator: all-reduce forward, identity
/// backward), or reduce-scattered along the sequence under sequence parallelism.
#[derive(Module, Debug)]
pub struct RowParallelLinear<B: Backend> {
    /// `[d_input / tp, d_output]`: this rank's row slice of the full weight, drawn from
    /// `N(0, init_std²)`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[d_output]`: the whole bias, replicated on every rank, initialised to zero. It is added
    /// after the reduction.
    pub bias: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    tp: TpContext,
    #[module(skip)]
    input_is_parallel: bool,
    #[module(skip)]
    comm_overlap: bool,
    /// The FP8 settings and scaling state, when the GEMMs run in FP8.
    #[module(skip)]
    fp8: Option<Fp8Linear>,
}

impl RowParallelLinearConfig {
    /// This rank's slice of the layer. Parameter values depend on `seed` only, not on the
    /// tensor-parallel size.
    pub fn init<B: DistBackend + CounterNormalOps>(
        &self,
        tp: &ProcessGroup,
        seed: u64,
        device: &B::Device,
    ) -> Result<RowParallelLinear<B>, ConfigError> {
        ConfigError::check_divisible("input features", self.d_input, tp.size())?;
        let height = self.d_input / tp.size();
        let rows = tp.rank() * height..(tp.rank() + 1) * height;
        let weight = init_slice(
            [self.d_input, self.d_output],
            [rows, 0..self.d_output],
            InitDistribution::Normal { std: self.init_std },
            param_seed(seed, "weight"),
            device,
        );
        let bias = self
            .bias
            .then(|| Param::from_tensor(Tensor::zeros([self.d_output], device)));
        Ok(RowParallelLinear {
            weight: Param::from_tensor(weight),
            bias,
            tp: TpContext::new(tp, self.sequence_parallel),
            input_is_parallel: self.input_is_parallel,
            comm_overlap: self.comm_overlap,
            fp8: self
                .fp8
                .clone()
                .map(|c| Fp8Linear::new(c, Some(tp), Fp8Split::ROW_PARALLEL)),
        })
    }
}

/// The weight's rows are sharded over TP (dimension 0); the bias, added after the reduction,
/// is replicated.
impl<B: Backend> DeclarePlacements for RowParallelLinear<B> {
    fn declare_placements(&self, out: &mut Placements) {
        out.declare(&self.weight, ParamPlacement::sharded(0, &self.tp.group));
        if let Some(bias) = &self.bias {
            out.declare(bias, ParamPlacement::replicated());
            if self.tp.sequence_parallel {
                out.declare_partial_gradient(bias, self.tp.sequence_parallel_grads);
            }
        }
    }
}

impl<B: Backend> RowParallelLinear<B> {
    /// The same layer (same parameters and ids), summing its bias's partial gradient under
    /// sequence parallelism where `grads` says (see [`TpContext::replicated`]).
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

impl<B: ModelBackend> RowParallelLinear<B> {
    /// `[.., d_input / tp]` (or `[.., d_input]` without `input_is_parallel`) → `[.., d_output]`.
    /// Under sequence parallelism the input is `[batch, seq, d_input / tp]` and the output
    /// `[batch, seq / tp, d_output]`.
    ///
    /// Burn's convention of an infallible `forward`, for code written against it.
    ///
    /// # Shapes
    /// - input: `[..., d_input / tp]` (this rank's slice; the whole `d_input` without
    ///   `input_is_parallel`, split here)
    /// - output: `[..., d_output]`, summed over the group (`seq / tp` along the sequence
    ///   dimension under sequence parallelism)
    ///
    /// # Panics
    /// If a collective fails (a peer died, a timeout); [`try_forward`](Self::try_forward)
    /// returns the error instead and is preferred.
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        self.try_forward(input).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`forward`](Self::forward), returning communication errors.
    pub fn try_forward<const D: usize>(&self, input: Tensor<B, D>) -> DistResult<Tensor<B, D>> {
        let input = if self.input_is_parallel {
            input
        } else {
            scatter_to_tensor_parallel_region(input, &self.tp.group)?
        };
        if self.tp.group.size() == 1 {
            // Nothing to reduce between the GEMM and the bias: the bias goes into the GEMM
            // (cuBLASLt's epilogue on our CUDA backend), with no separate add.
            let bias = self.bias.as_ref().map(|b| b.val());
            return self.product(input, bias);
        }
        let dims = input.dims();
        let output = match self.overlaps(&dims) {
            true => {
                // `[1, seq, d_input / tp]`: the sequence's rank shards are contiguous rows.
                let rows = input.reshape([dims[1], dims[D - 1]]);
                let group = &self.tp.group;
                let y = B::reduce_scattered_linear(rows, self.weight.val(), group)?;
                let mut out = dims;
                out[1] /= group.size();
                out[D - 1] = y.dims()[1];
                y.reshape(out)
            }
            false => self.tp.leave(self.product(input, None)?)?,
        };
        let Some(bias) = &self.bias else {
            return Ok(output);
        };
        // Under sequence parallelism each rank adds the bias to its own part of the sequence:
        // its gradient is partial (see `TpContext::replicated`).
        Ok(bias_add(output, self.tp.replicated(bias.val())?))
    }

    /// Whether the product and the reduce-scatter run as one overlapped operation for an input
    /// of `dims`: `comm_overlap` under sequence parallelism, no FP8, and one sequence
    /// `[1, seq, d_input / tp]`.
    fn overlaps(&self, dims: &[usize]) -> bool {
        self.comm_overlap
            && self.tp.sequence_parallel
            && self.fp8.is_none()
            && self.input_is_parallel
            && dims.len() == 3
            && dims[0] == 1
    }

    /// `x A + b` on this rank's rows: [`linear`], or [`hooked_fp8_linear`] when the layer
    /// runs in FP8 (its amaxes of the input and the weight reduced over the group).
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

    /// The tensor-parallel group.
    pub fn tp(&self) -> &ProcessGroup {
        &self.tp.group
    }
}
