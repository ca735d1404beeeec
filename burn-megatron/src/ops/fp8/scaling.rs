//! Megatron's FP8 settings (`--fp8-format`, `--fp8-recipe`, `--fp8-margin`,
//! `--fp8-amax-history-len`, `--fp8-amax-compute-algo`) and the scales they give.
//!
//! A tensor is cast as `q = round(x · scale)` and the GEMM multiplies its result by
//! `1 / scale`; the scale maps the tensor's largest magnitude (its *amax*) onto the format's
//! largest value, `scale = max / amax / 2^margin`. Everything here stays on the device: the
//! amax is a `[1]` tensor, the scale is computed from it with tensor operations, and a
//! non-finite or zero amax keeps the previous scale through a mask, never a host read.

use burn::config::Config;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

use super::{Fp8Dtype, Fp8Ops};
use crate::error::{ConfigError, DeviceError, read_data};

/// Which FP8 formats the GEMMs use (Megatron's `--fp8-format`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum Fp8Format {
    /// E4M3 for activations and weights, E5M2 (more range, less precision) for the
    /// gradients: Transformer Engine's recommendation.
    Hybrid,
    /// E4M3 everywhere.
    E4M3,
}

impl Fp8Format {
    /// The format of the forward pass's operands (activations and weights): E4M3.
    pub fn forward_dtype(self) -> Fp8Dtype {
        Fp8Dtype::E4M3
    }

    /// The format of the output gradients in the backward pass: E5M2 for `hybrid`, E4M3 for
    /// `e4m3`.
    pub fn gradient_dtype(self) -> Fp8Dtype {
        match self {
            Self::Hybrid => Fp8Dtype::E5M2,
            Self::E4M3 => Fp8Dtype::E4M3,
        }
    }

    /// Megatron's names, `hybrid` and `e4m3` (case-insensitive).
    pub fn parse(name: &str) -> Result<Self, ConfigError> {
        match name.to_ascii_lowercase().as_str() {
            "hybrid" => Ok(Self::Hybrid),
            "e4m3" => Ok(Self::E4M3),
            _ => Err(ConfigError::Invalid(format!(
                "--fp8-format {name:?}: use hybrid (E4M3 forward, E5M2 gradients) or e4m3"
            ))),
        }
    }
}

/// How the scales are chosen (Megatron's `--fp8-recipe`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum Fp8Recipe {
    /// Current scaling: each tensor's scale comes from its own amax, computed on the device
    /// right before the cast. Stateless, so a recomputed forward casts exactly as the first.
    Tensorwise,
    /// Delayed scaling: each tensor's scale comes from a history of the amaxes of its earlier
    /// uses; the current amax is recorded after the cast. Saves the amax pass before the cast
    /// (on a GPU, where the amax can come from the cast kernel itself).
    Delayed,
    /// Blockwise scaling (DeepSeek-V3's recipe): each block of 1 × 128 elements of an
    /// activation or gradient, along the GEMM's inner dimension, and each 128 × 128 block of
    /// a weight has the scale of its own amax (see [`blockwise`](super::blockwise)). Stateless,
    /// no amax crosses ranks; every dimension a multiple of 128.
    Blockwise,
}

impl Fp8Recipe {
    /// Megatron's names, `tensorwise`, `delayed` and `blockwise` (case-insensitive).
    pub fn parse(name: &str) -> Result<Self, ConfigError> {
        match name.to_ascii_lowercase().as_str() {
            "tensorwise" => Ok(Self::Tensorwise),
            "delayed" => Ok(Self::Delayed),
            "blockwise" => Ok(Self::Blockwise),
            "mxfp8" => Err(ConfigError::Invalid(format!(
                "--fp8-recipe {name}: MXFP8 needs Blackwell's block-scaled tensor cores; not \
                 implemented: use tensorwise, delayed or blockwise"
            ))),
            _ => Err(ConfigError::Invalid(format!(
                "--fp8-recipe {name:?}: use tensorwise, delayed or blockwise"
            ))),
        }
    }
}

/// How delayed scaling reads its amax history (Megatron's `--fp8-amax-compute-algo`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum AmaxComputeAlgo {
    /// The largest amax of the history.
    Max,
    /// The latest amax.
    MostRecent,
}

impl AmaxComputeAlgo {
    /// Megatron's names, `max` and `most_recent`.
    pub fn parse(name: &str) -> Result<Self, ConfigError> {
        match name.to_ascii_lowercase().as_str() {
            "max" => Ok(Self::Max),
            "most_recent" => Ok(Self::MostRecent),
            _ => Err(ConfigError::Invalid(format!(
                "--fp8-amax-compute-algo {name:?}: use max or most_recent"
            ))),
        }
    }
}

/// FP8 training of the transformer layers' GEMMs (QKV, attention output, the MLP's): which
/// formats, which scaling recipe, and its settings. The embedding, the output layer, the norms,
/// the softmax and the loss stay in the model's dtype, as Megatron does.
#[derive(Config, Debug, PartialEq)]
pub struct Fp8Config {
    /// The formats (`--fp8-format`).
    #[config(default = "Fp8Format::Hybrid")]
    pub format: Fp8Format,
    /// The scaling recipe (`--fp8-recipe`).
    #[config(default = "Fp8Recipe::Tensorwise")]
    pub recipe: Fp8Recipe,
    /// The scale is divided by `2^margin` (`--fp8-margin`): headroom for an amax that grows
    /// before the scale follows (delayed scaling), or none (0, the default).
    #[config(default = 0)]
    pub margin: i32,
    /// Amaxes remembered per tensor by delayed scaling (`--fp8-amax-history-len`). 1024 is
    /// Transformer Engine's default; Megatron's command line defaults to 1.
    #[config(default = 1024)]
    pub amax_history_len: usize,
    /// How delayed scaling reads the history (`--fp8-amax-compute-algo`). `max` is
    /// Transformer Engine's default; Megatron's command line defaults to `most_recent`.
    #[config(default = "AmaxComputeAlgo::Max")]
    pub amax_compute_algo: AmaxComputeAlgo,
    /// Keep each weight's FP8 copy (its scale and both layouts) until the weight itself is
    /// replaced, so that the microbatches of one optimizer step (and a recomputed forward)
    /// cast it once: Transformer Engine's cached FP8 weights. Under tensorwise scaling the
    /// copy is what a fresh cast would give, bit for bit; under delayed scaling it has the
    /// scale of the first forward pass after the weight changed, whose amax alone is
    /// recorded (Transformer Engine's `is_first_microbatch`). Off: every forward casts the
    /// weight (and, delayed, records its amax).
    #[config(default = true)]
    pub cache_weights: bool,
    /// Keep the first [`num_layers_at_start_in_bf16`](Self::num_layers_at_start_in_bf16) and
    /// the last [`num_layers_at_end_in_bf16`](Self::num_layers_at_end_in_bf16) transformer
    /// layers out of FP8, in the model's dtype (`--first-last-layers-bf16`): Megatron's
    /// option for stability, where the first and last layers see the widest ranges.
    #[config(default = false)]
    pub first_last_layers_bf16: bool,
    /// Layers at the start kept out of FP8 with `first_last_layers_bf16`
    /// (`--num-layers-at-start-in-bf16`).
    #[config(default = 1)]
    pub num_layers_at_start_in_bf16: usize,
    /// Layers at the end kept out of FP8 with `first_last_layers_bf16`
    /// (`--num-layers-at-end-in-bf16`).
    #[config(default = 1)]
    pub num_layers_at_end_in_bf16: usize,
    /// Which backward GEMMs run in the model's dtype on the unquantised operands, not in FP8
    /// (`--fp8-backward-bf16`): Transformer Engine's `override_linear_precision`. The
    /// forward GEMM stays FP8. A way to find which GEMM a run's loss is sensitive to, at the
    /// cost of keeping the input and the weight unquantised for the backward pass.
    #[config(default = "Fp8Backward::Fp8")]
    pub backward: Fp8Backward,
    /// Under delayed scaling, leave the amax histories to each data-parallel replica instead
    /// of reducing them over DP once a step (`--tp-only-amax-red`, Megatron's name): the
    /// reduction costs a few hundred small launches a step, which a small model feels.
    #[config(default = false)]
    pub tp_only_amax_reduction: bool,
}

/// The backward GEMMs of an FP8 linear layer that run in the model's dtype instead
/// ([`Fp8Config::backward`]).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum Fp8Backward {
    /// Both in FP8 (the default).
    Fp8,
    /// The input gradient `dx = dy · wᵀ` in the model's dtype, the weight's in FP8.
    Dgrad,
    /// The weight gradient `dw = xᵀ · dy` in the model's dtype, the input's in FP8.
    Wgrad,
    /// Both in the model's dtype: FP8 in the forward pass only.
    Both,
}

impl Fp8Backward {
    /// `--fp8-backward-bf16`'s values: `dgrad`, `wgrad` or `both`.
    pub fn parse(name: &str) -> Result<Self, ConfigError> {
        match name {
            "dgrad" => Ok(Self::Dgrad),
            "wgrad" => Ok(Self::Wgrad),
            "both" => Ok(Self::Both),
            _ => Err(ConfigError::Invalid(format!(
                "--fp8-backward-bf16 {name:?}: use dgrad, wgrad or both"
            ))),
        }
    }

    /// Whether the input gradient's GEMM runs in the model's dtype.
    pub fn dgrad_unquantised(self) -> bool {
        matches!(self, Self::Dgrad | Self::Both)
    }

    /// Whether the weight gradient's GEMM runs in the model's dtype.
    pub fn wgrad_unquantised(self) -> bool {
        matches!(self, Self::Wgrad | Self::Both)
    }
}

impl Fp8Config {
    /// Checks the settings: a history of at least one amax, a margin that keeps the scale's
    /// factor `2^-margin` a normal f32 (|margin| ≤ 100).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.amax_history_len == 0 {
            return Err(ConfigError::Invalid(
                "--fp8-amax-history-len must be at least 1".into(),
            ));
        }
        if self.margin.abs() > 100 {
            return Err(ConfigError::Invalid(format!(
                "--fp8-margin ({}) must be within ±100: the scale is divided by 2^margin",
                self.margin
            )));
        }
        Ok(())
    }

    /// Checks the layers kept out of FP8 against a model of `num_layers` layers: at least
    /// one layer must be left in FP8.
    pub fn validate_layers(&self, num_layers: usize) -> Result<(), ConfigError> {
        let kept = self.num_layers_at_start_in_bf16 + self.num_layers_at_end_in_bf16;
        if self.first_last_layers_bf16 && kept >= num_layers {
            return Err(ConfigError::Invalid(format!(
                "--first-last-layers-bf16 keeps {} layers at the start and {} at the end out \
                 of FP8, which leaves none of the {num_layers} layers in FP8: lower \
                 --num-layers-at-start-in-bf16 or --num-layers-at-end-in-bf16, or drop \
                 --fp8-format",
                self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16
            )));
        }
        Ok(())
    }

    /// Whether global layer `layer` of a model of `num_layers` layers runs its GEMMs in FP8
    /// (not one of the first or last layers that `first_last_layers_bf16` keeps out).
    pub fn covers_layer(&self, layer: usize, num_layers: usize) -> bool {
        !self.first_last_layers_bf16
            || (layer >= self.num_layers_at_start_in_bf16
                && layer + self.num_layers_at_end_in_bf16 < num_layers)
    }
}

/// `dtype.max() / amax / 2^margin` where `amax` is positive and finite, else `fallback` (the
/// previous scale; Transformer Engine's rule, so that a NaN or infinite amax, from an
/// overflowing step, leaves the scale as it was, and an all-zero tensor keeps it too). A
/// scale that would overflow f32 (an amax below `max / f32::MAX`) is capped at `f32::MAX`.
///
/// # Shapes
/// `amax`, `fallback` and the output: `[1]` f32.
pub fn scale_from_amax<B: Backend>(
    amax: Tensor<B, 1>,
    fallback: Tensor<B, 1>,
    dtype: Fp8Dtype,
    margin: i32,
) -> Tensor<B, 1> {
    let max = Tensor::<B, 1>::full([1], dtype.max(), (&amax.device(), DType::F32));
    scales_from_amaxes(amax, fallback, max, margin)
}

/// [`scale_from_amax`] of many tensors at once: `tops / amaxes / 2^margin` element-wise (each
/// tensor's format's largest value over its amax), or `fallback` where an amax is zero, NaN
/// or infinite; a few launches whatever the count.
///
/// # Shapes
/// - amaxes, fallback, tops, output: `[n]` (f32 out)
pub fn scales_from_amaxes<B: Backend>(
    amaxes: Tensor<B, 1>,
    fallback: Tensor<B, 1>,
    tops: Tensor<B, 1>,
    margin: i32,
) -> Tensor<B, 1> {
    let amaxes = amaxes.cast(DType::F32);
    let scales = (tops.cast(DType::F32) / amaxes.clone())
        .mul_scalar(2f64.powi(-margin))
        .clamp_max(f32::MAX);
    // NaN fails both comparisons.
    let usable = amaxes
        .clone()
        .greater_elem(0.0)
        .bool_and(amaxes.lower_elem(f32::INFINITY));
    fallback.cast(DType::F32).mask_where(usable, scales)
}

/// The tensorwise (current) scale of a tensor whose amax is `amax`: `max / amax / 2^margin`,
/// or 1 where the amax is zero, NaN or infinite (there is no previous scale to keep; a NaN in
/// the tensor stays NaN through the cast and reaches the loss).
///
/// # Shapes
/// `amax` and the output: `[1]` f32.
pub fn tensorwise_scale<B: Backend>(
    amax: Tensor<B, 1>,
    dtype: Fp8Dtype,
    margin: i32,
) -> Tensor<B, 1> {
    let ones = Tensor::<B, 1>::ones([1], (&amax.device(), DType::F32));
    scale_from_amax(amax, ones, dtype, margin)
}

/// One tensor's delayed-scaling state on the host, as checkpoints keep it: the amax history,
/// newest first, and the scale of the next cast.
#[derive(Debug, Clone, PartialEq)]
pub struct DelayedData {
    /// The amaxes of the tensor's last casts, newest first.
    pub amax_history: Vec<f32>,
    /// The scale the next cast uses.
    pub scale: f32,
}

/// One tensor's delayed-scaling state, on the device: the amaxes of its last uses, newest
/// first (zeros before there are any), and the scale the next cast uses (1 at first).
#[derive(Debug, Clone)]
pub struct DelayedScaling<B: Backend> {
    history: Tensor<B, 1>,
    scale: Tensor<B, 1>,
}

impl<B: Backend> DelayedScaling<B> {
    /// A fresh state of `history_len` amaxes on `device`.
    pub fn new(history_len: usize, device: &B::Device) -> Self {
        Self {
            history: Tensor::zeros([history_len.max(1)], (device, DType::F32)),
            scale: Tensor::ones([1], (device, DType::F32)),
        }
    }

    /// The state of a checkpoint on `device`, its history cut or padded with zeros (at the
    /// oldest end) to `history_len` amaxes: a run may resume with another
    /// `--fp8-amax-history-len`.
    pub fn from_data(data: &DelayedData, history_len: usize, device: &B::Device) -> Self {
        let mut history = data.amax_history.clone();
        history.resize(history_len.max(1), 0.0);
        let len = history.len();
        Self {
            history: Tensor::from_data(TensorData::new(history, [len]), (device, DType::F32)),
            scale: Tensor::from_data(TensorData::new(vec![data.scale], [1]), (device, DType::F32)),
        }
    }

    /// A state of `history` (`[len]` f32, newest first) and `scale` (`[1]` f32): e.g. the
    /// data-parallel ranks' histories reduced to their maximum, and the scale from it.
    pub fn from_tensors(history: Tensor<B, 1>, scale: Tensor<B, 1>) -> Self {
        Self { history, scale }
    }

    /// The state read to the host (a device synchronisation: for checkpoints, not in a step).
    pub fn to_data(&self) -> Result<DelayedData, DeviceError> {
        let read = |tensor: &Tensor<B, 1>, what: &str| {
            read_data(tensor.clone(), || format!("FP8 delayed scaling's {what}"))
                .map(|data| data.iter::<f32>().collect::<Vec<_>>())
        };
        Ok(DelayedData {
            amax_history: read(&self.history, "amax history")?,
            scale: read(&self.scale, "scale")?[0],
        })
    }

    /// The scale of the next cast, `[1]` f32.
    pub fn scale(&self) -> Tensor<B, 1> {
        self.scale.clone()
    }

    /// The amax history, newest first, `[history_len]` f32.
    pub fn history(&self) -> Tensor<B, 1> {
        self.history.clone()
    }

    /// Records `amax` (`[1]`, the amax of the tensor just cast with [`scale`](Self::scale)):
    /// it enters the history at the front, the oldest entry drops out, and the next scale is
    /// computed from the history's largest (`max`) or newest (`most_recent`) amax by
    /// [`scale_from_amax`], the current scale its fallback ([`delayed_update_composition`];
    /// one kernel on our CUDA backend, [`Fp8Ops::fp8_delayed_update`]).
    ///
    /// A NaN or infinite `amax` is not recorded at all: history and scale stay as they were.
    /// Transformer Engine skips the scale update too but writes the amax into its history,
    /// where (with `max`) it freezes the scale until it rolls out; leaving it out lets the
    /// next finite step update the scale again. No host read.
    pub fn record(
        &mut self,
        amax: Tensor<B, 1>,
        dtype: Fp8Dtype,
        margin: i32,
        algo: AmaxComputeAlgo,
    ) where
        B: Fp8Ops,
    {
        let (history, scale) = B::fp8_delayed_update(
            self.history.clone(),
            self.scale.clone(),
            amax,
            dtype,
            margin,
            algo,
        );
        self.history = history;
        self.scale = scale;
    }
}

/// Delayed scaling's update as Burn operations (mask operations only): `amax` (`[1]`) enters
/// `history` (`[len]` f32, newest first) at the front, the oldest entry drops out, and the
/// next scale comes from the new history's largest (`max`) or newest (`most_recent`) amax by
/// [`scale_from_amax`], `scale` its fallback; a NaN or infinite `amax` changes neither.
/// Returns `(history, scale)`.
pub fn delayed_update_composition<B: Backend>(
    history: Tensor<B, 1>,
    scale: Tensor<B, 1>,
    amax: Tensor<B, 1>,
    dtype: Fp8Dtype,
    margin: i32,
    algo: AmaxComputeAlgo,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let amax = amax.cast(DType::F32);
    let len = history.dims()[0];
    let rolled = match len {
        1 => amax.clone(),
        _ => Tensor::cat(vec![amax.clone(), history.clone().narrow(0, 0, len - 1)], 0),
    };
    let finite = amax.clone().lower_elem(f32::INFINITY);
    let history = history.mask_where(finite.clone().expand([len]), rolled);
    let chosen = history_amaxes(history.clone().unsqueeze(), algo);
    let next = scale_from_amax(chosen, scale.clone(), dtype, margin);
    (history, scale.mask_where(finite, next))
}

/// The amax each of `n` histories (`[n, len]`, newest first) gives its next scale: its
/// largest (`max`) or its newest (`most_recent`) entry, `[n]`.
pub fn history_amaxes<B: Backend>(histories: Tensor<B, 2>, algo: AmaxComputeAlgo) -> Tensor<B, 1> {
    let [n, _] = histories.dims();
    match algo {
        AmaxComputeAlgo::Max => histories.max_dim(1),
        AmaxComputeAlgo::MostRecent => histories.narrow(1, 0, 1),
    }
    .reshape([n])
}
