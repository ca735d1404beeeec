//! What a language model's training or validation step gives burn-train: the loss and the
//! step's size, never the logits (burn-train's `SequenceOutput` copies the full
//! `[batch, seq, vocab]` logits to the host every step).

use burn::backend::NdArray;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData, Transaction};
use burn::train::ItemLazy;
use burn::train::metric::{Adaptor, LossInput};

use crate::pipeline_parallel::MoeStepStats;
use crate::training::MoeReport;

/// One step of a language model, as its [`TrainStep`](burn::train::TrainStep) or
/// [`InferenceStep`](burn::train::InferenceStep) reports it. The tensors stay on the device
/// until burn-train's event processor reads them ([`ItemLazy::sync`]), in one transfer.
#[derive(Debug, Clone)]
pub struct LanguageModelOutput<B: Backend> {
    /// `[1]`: the step's mean next-token loss (nats). On every rank the same value once the
    /// strategy has averaged it over the data-parallel group.
    pub loss: Tensor<B, 1>,
    /// Tokens the step trained on or evaluated, over the whole data-parallel world.
    pub tokens: usize,
    /// Model FLOPs of the step over the whole world (Megatron's count, forward and backward;
    /// 0 for validation).
    pub flops: f64,
    /// `[1]`: the global gradient norm before clipping, set by the strategy after the
    /// optimizer step; `None` for validation.
    pub grad_norm: Option<Tensor<B, 1>>,
    /// Devices the step ran on (the world size), for per-device throughput.
    pub devices: usize,
    /// `[1]`: device memory in use after the step, the largest over all ranks, in MiB; set
    /// by the strategy on backends that track memory (GPUs).
    pub max_memory_mib: Option<Tensor<B, 1>>,
    /// `[1]`: with fp16, the loss scale the step's backward pass used; set by the strategy.
    pub loss_scale: Option<Tensor<B, 1>>,
    /// What the MoE layers did in a training step of a model with experts.
    pub moe: Option<MoeStepItem<B>>,
}

/// What a training step's MoE layers did: the report for the metrics, and this rank's load
/// for the expert-bias update.
#[derive(Debug, Clone)]
pub struct MoeStepItem<B: Backend> {
    /// `[6]` f32: the step's MoE losses, load and assignments over the whole world, in the
    /// field order of [`MoeReport`], on every rank.
    pub report: Tensor<B, 1>,
    /// Whether the MoE layers have a capacity (the report counts the assignments dropped).
    pub drops: bool,
    /// This rank's losses and load; `None` on a pipeline stage without MoE layers.
    pub stats: Option<MoeStepStats<B>>,
}

impl<B: Backend> LanguageModelOutput<B> {
    /// A step's output with no gradient norm yet.
    pub fn new(loss: Tensor<B, 1>, tokens: usize, flops: f64, devices: usize) -> Self {
        Self {
            loss,
            tokens,
            flops,
            grad_norm: None,
            devices,
            max_memory_mib: None,
            loss_scale: None,
            moe: None,
        }
    }
}

/// [`LanguageModelOutput`] on the host: what burn-train's metrics read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LanguageModelStats {
    /// The step's mean loss.
    pub loss: f64,
    /// Tokens of the step.
    pub tokens: usize,
    /// Model FLOPs of the step.
    pub flops: f64,
    /// The global gradient norm before clipping (training steps only).
    pub grad_norm: Option<f64>,
    /// Devices the step ran on.
    pub devices: usize,
    /// Device memory in use after the step, the largest over all ranks, in bytes.
    pub max_memory_bytes: Option<f64>,
    /// With fp16, the loss scale of the step.
    pub loss_scale: Option<f64>,
    /// The MoE layers' losses and load (training steps of a model with experts).
    pub moe: Option<MoeReport>,
}

impl<B: Backend> ItemLazy for LanguageModelOutput<B> {
    type ItemSync = LanguageModelStats;

    fn sync(self) -> LanguageModelStats {
        let optional = [
            self.grad_norm.clone(),
            self.max_memory_mib.clone(),
            self.loss_scale.clone(),
        ];
        let mut transaction = Transaction::default().register(self.loss.cast(DType::F32));
        for tensor in optional.iter().flatten() {
            transaction = transaction.register(tensor.clone().cast(DType::F32));
        }
        if let Some(moe) = &self.moe {
            transaction = transaction.register(moe.report.clone().cast(DType::F32));
        }
        // A failed read (a deferred device error) gives NaN here, on burn-train's metric
        // thread, instead of a panic there; the rank's own next read reports the error.
        let read = transaction.try_execute().unwrap_or_default();
        let mut read = read
            .into_iter()
            .map(|data| data.convert::<f32>().to_vec::<f32>().unwrap_or_default());
        let mut value = || {
            read.next()
                .and_then(|v| v.first().copied())
                .map_or(f64::NAN, f64::from)
        };
        let loss = value();
        let [grad_norm, memory_mib, loss_scale] = optional.map(|t| t.map(|_| value()));
        let moe = (self.moe.as_ref())
            .map(|moe| MoeReport::from_values(&read.next().unwrap_or_default(), moe.drops));
        LanguageModelStats {
            loss,
            tokens: self.tokens,
            flops: self.flops,
            grad_norm,
            devices: self.devices,
            max_memory_bytes: memory_mib.map(|mib| mib * crate::training::step::MIB),
            loss_scale,
            moe,
        }
    }
}

impl Adaptor<LossInput<NdArray>> for LanguageModelStats {
    fn adapt(&self) -> LossInput<NdArray> {
        let loss = TensorData::new(vec![self.loss as f32], [1]);
        LossInput::new(Tensor::from_data(loss, &Default::default()))
    }
}
