//! The GPT as burn-train trains it: this rank's model chunk and the layout its steps run in,
//! with a [`TrainStep`] that is one pipeline-schedule step and an [`InferenceStep`] that is
//! the schedule's forward passes.

use burn::module::Module;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::train::{InferenceStep, TrainOutput, TrainStep};
use burn_megatron_dist::{DistBackend, ParallelState};

use super::failure::or_fail;
use super::optimizer::LossScale;
use super::output::{LanguageModelOutput, MoeStepItem};
use crate::backend::ModelBackend;
use crate::error::Result;
use crate::models::GptModel;
use crate::pipeline_parallel::{
    Microbatch, StageSplit, forward_backward, forward_backward_scaled, forward_only,
};
use crate::training::moe_log::moe_report;
use crate::training::step::{SCHEDULE, loss_on_every_stage};
use crate::transformer::TransformerConfig;

/// What a [`ParallelGpt`] needs besides its parameters: the rank's groups and the model's
/// configuration (for the FLOPs count).
#[derive(Debug, Clone)]
struct StepLayout {
    state: ParallelState,
    config: TransformerConfig,
    /// With fp16: the scale the loss is multiplied by before backward.
    loss_scale: Option<LossScale>,
}

/// This rank's chunk of a GPT (a TP slice of its pipeline stage) for burn-train.
///
/// Its [`TrainStep`] input is the rank's microbatches of one global step (what
/// [`GptStepLoader`](super::GptStepLoader) yields): the step runs them through the pipeline
/// schedule (1F1B; gradient accumulation with one stage), so one `Learner` step is one
/// Megatron iteration, and returns the gradient of the mean loss. The loss is shared from the
/// last stage to every stage; averaging over data-parallel ranks is the strategy's.
///
/// A step that fails (a stage failed, a collective timed out, a token id outside the
/// vocabulary) unwinds, since burn-train's steps cannot fail: under
/// [`MegatronStrategy`](super::MegatronStrategy) the typed error reaches
/// [`pretrain_with_learner`](super::pretrain_with_learner)'s `Result` (the strategy's
/// [`FitFailure`](super::FitFailure)); under another strategy it is a panic with the error's
/// message.
#[derive(Module, Debug)]
pub struct ParallelGpt<B: Backend> {
    /// The rank's model chunk.
    pub model: GptModel<B>,
    #[module(skip)]
    layout: StepLayout,
}

impl<B: ModelBackend> ParallelGpt<B> {
    /// This rank's chunk of `config` in the layout `state`: the even pipeline stage of its PP
    /// rank, sliced for its TP rank, its MoE layers' experts split over `state.ep()`. Parameters depend only on the seed, so every layout
    /// holds slices of the same model.
    pub fn init(
        config: &TransformerConfig,
        state: &ParallelState,
        device: &B::Device,
    ) -> Result<Self> {
        let stage = StageSplit::even(config.num_layers, state.pp().size())?.stage(state.pp_rank());
        let model = config.init_gpt_stage_with_ep::<B>(state.tp(), state.ep(), &stage, device)?;
        Ok(Self::new(model, config, state))
    }

    /// `model`, this rank's chunk of `config` in the layout `state`.
    pub fn new(model: GptModel<B>, config: &TransformerConfig, state: &ParallelState) -> Self {
        Self {
            model: model.with_global_load_group(Some(state.dp_cp().clone())),
            layout: StepLayout {
                state: state.clone(),
                config: config.clone(),
                loss_scale: None,
            },
        }
    }

    /// fp16: every training step multiplies its loss by `scale` before backward (the
    /// [`MegatronOptimizer`](super::MegatronOptimizer) with the loss scaler divides it out).
    pub fn with_loss_scale(mut self, scale: LossScale) -> Self {
        self.layout.loss_scale = Some(scale);
        self
    }

    /// The same layout with `model` (e.g. loaded from a checkpoint) as its chunk.
    pub fn with_model(self, model: GptModel<B>) -> Self {
        Self { model, ..self }
    }

    /// The layout the steps run in.
    pub fn state(&self) -> &ParallelState {
        &self.layout.state
    }

    /// The model's configuration.
    pub fn config(&self) -> &TransformerConfig {
        &self.layout.config
    }

    /// Tokens of a global step whose data-parallel rank holds `microbatches`, and their FLOPs.
    fn step_size(&self, microbatches: &[Microbatch<impl Backend>]) -> (usize, usize) {
        let dp = self.layout.state.dp().size();
        let samples: usize = microbatches.iter().map(|m| m.tokens.dims()[0]).sum();
        let seq = microbatches.first().map_or(0, |m| m.tokens.dims()[1]);
        (samples * dp, seq)
    }
}

fn or_panic<T>(what: &str, state: &ParallelState, result: Result<T>) -> T {
    or_fail(state.world().rank(), &format!("the {what}"), result)
}

impl<B> TrainStep for ParallelGpt<B>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: DistBackend + ModelBackend,
{
    type Input = Vec<Microbatch<B>>;
    type Output = LanguageModelOutput<B::InnerBackend>;

    fn step(&self, microbatches: Vec<Microbatch<B>>) -> TrainOutput<Self::Output> {
        let state = &self.layout.state;
        let (samples, seq) = self.step_size(&microbatches);
        let flops = or_panic(
            "FLOPs count",
            state,
            self.layout
                .config
                .training_flops(samples, seq)
                .map_err(Into::into),
        );
        let device = self.model.devices()[0].clone();
        // global_aux_loss counts each optimizer step's load afresh.
        self.model.reset_global_load();
        let chunks = core::slice::from_ref(&self.model);
        let scale = self
            .layout
            .loss_scale
            .as_ref()
            .and_then(LossScale::scale::<B::InnerBackend>);
        let out = or_panic(
            "training step",
            state,
            match scale {
                Some(scale) => {
                    forward_backward_scaled(SCHEDULE, state, chunks, &microbatches, scale)
                }
                None => forward_backward(SCHEDULE, state, chunks, &microbatches),
            },
        );
        // FP8 delayed scaling: every DP rank casts the next step with the same scales.
        or_panic(
            "FP8 amax histories' reduction over DP",
            state,
            self.model
                .reduce_fp8_histories::<B::InnerBackend>(state.dp())
                .map_err(Into::into),
        );
        let loss = or_panic(
            "loss exchange",
            state,
            loss_on_every_stage(state, out.loss, &device),
        );
        // A model with experts reports its MoE layers' losses and load every step, reduced
        // over the world on the device (every rank takes part, with or without MoE layers).
        let moe = match &self.layout.config.moe {
            Some(settings) => Some(MoeStepItem {
                report: or_panic(
                    "MoE report",
                    state,
                    moe_report(state, out.moe.clone(), &device),
                ),
                drops: settings.capacity.is_some(),
                stats: out.moe,
            }),
            None => None,
        };
        let grads = out.grads.into_iter().next().unwrap_or_default();
        let world = state.world().size();
        let mut item = LanguageModelOutput::new(loss, samples * seq, flops, world);
        item.moe = moe;
        TrainOutput { grads, item }
    }
}

impl<B> InferenceStep for ParallelGpt<B>
where
    B: ModelBackend + DistBackend,
{
    type Input = Vec<Microbatch<B>>;
    type Output = LanguageModelOutput<B>;

    /// The schedule's forward passes; the model's count of forward passes (its dropout
    /// masks) is left as it was, so evaluating does not change training's masks.
    fn step(&self, microbatches: Vec<Microbatch<B>>) -> LanguageModelOutput<B> {
        let state = &self.layout.state;
        let (samples, seq) = self.step_size(&microbatches);
        let device = self.model.devices()[0].clone();
        let call = self.model.next_call();
        let loss = or_panic(
            "evaluation step",
            state,
            forward_only(
                SCHEDULE,
                state,
                core::slice::from_ref(&self.model),
                &microbatches,
            ),
        );
        self.model.set_next_call(call);
        let loss = or_panic(
            "loss exchange",
            state,
            loss_on_every_stage(state, loss, &device),
        );
        LanguageModelOutput::new(loss, samples * seq, 0.0, state.world().size())
    }
}
