//! Pipeline parallelism: the model split into stages over the pipeline group, and the
//! schedules that run a step's microbatches through them (Megatron-Core's
//! `pipeline_parallel/`).
//!
//! - [`StageSplit`] and [`Stage`]: which layers each (virtual) stage holds;
//!   [`TransformerConfig::init_gpt_stage`](crate::transformer::TransformerConfig::init_gpt_stage)
//!   builds one.
//! - [`Schedule`] makes a [`Plan`]: per rank, its forward, backward and exchange steps.
//!   [`Plan::render_timeline`] prints it, bubble included.
//! - [`forward_backward`] runs a plan's training step on this rank's model chunks
//!   ([`forward_backward_scaled`] with an fp16 loss scale);
//!   [`forward_backward_no_pipelining`] is the single-stage case (gradient accumulation), and
//!   [`forward_only`] the evaluation step.
//!
//! Every schedule, activation recomputation included, works on the model's pieces
//! ([`GptModel::embed`], [`GptModel::layers`], [`GptModel::head`], [`GptModel::loss`]). A
//! stage's input from the previous stage is a leaf that requires grad; the gradient sent back
//! is that leaf's gradient. Neighbouring stages exchange tensors through
//! [`batch_isend_irecv`](burn_megatron_dist::p2p::batch_isend_irecv), one batched call per
//! exchange step.

mod exchange;
mod executor;
mod forward_only;
mod plan;
pub mod schedules;

use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn_megatron_dist::{DistBackend, ParallelState};

pub use crate::data::Microbatch;
pub use crate::error::PipelineError;
pub use crate::models::{Stage, StageSplit};
pub use executor::{MoeStepStats, StepOutput};
pub use plan::{Compute, Direction, Payload, Plan, Slot, Step, Timeline, Transfer};
pub use schedules::Schedule;

use crate::backend::ModelBackend;
use crate::error::Result;
use crate::models::GptModel;
use executor::{Executor, Groups};

/// One training step of `schedule` on this rank: `chunks` are its model chunks (one per
/// virtual stage, chunk `c` being virtual stage `c · pp + pp_rank`), `microbatches` the step's
/// data (every rank gets all of them). Returns the mean loss (last stage), each chunk's
/// gradients and the activation count. With tied embeddings over several stages, the first
/// and last stage's tables get the sum of their gradients (over the embedding group).
///
/// Every rank of the pipeline and TP groups must call it with the same schedule and
/// microbatch shapes. A failing step returns [`PipelineError::StageFailed`] naming the stage;
/// the other ranks are then released with an error naming it too.
pub fn forward_backward<B>(
    schedule: Schedule,
    state: &ParallelState,
    chunks: &[GptModel<B>],
    microbatches: &[Microbatch<B>],
) -> Result<StepOutput<B>>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: DistBackend,
{
    run_schedule(schedule, state, chunks, microbatches, None)
}

/// [`forward_backward`] with fp16 loss scaling (Megatron's `grad_scale_func`): every backward
/// pass starts from the loss times `loss_scale` (`[1]` f32 on the device, a
/// [`DynamicLossScaler`](crate::optimizer::DynamicLossScaler)'s `scale()`), so that small
/// gradients do not underflow in half precision and come out multiplied by the scale. The
/// reported loss is not scaled. The optimizer divides the scale out
/// ([`DistributedAdamW::step_scaled`](crate::optimizer::DistributedAdamW::step_scaled)).
pub fn forward_backward_scaled<B>(
    schedule: Schedule,
    state: &ParallelState,
    chunks: &[GptModel<B>],
    microbatches: &[Microbatch<B>],
    loss_scale: Tensor<B::InnerBackend, 1>,
) -> Result<StepOutput<B>>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: DistBackend,
{
    run_schedule(schedule, state, chunks, microbatches, Some(loss_scale))
}

fn run_schedule<B>(
    schedule: Schedule,
    state: &ParallelState,
    chunks: &[GptModel<B>],
    microbatches: &[Microbatch<B>],
    loss_scale: Option<Tensor<B::InnerBackend, 1>>,
) -> Result<StepOutput<B>>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: DistBackend,
{
    let plan = schedule.plan(
        state.pp().size(),
        state.virtual_pipeline_size(),
        microbatches.len(),
    )?;
    let groups = groups(state, chunks, plan.virtual_size)?;
    Executor::new(chunks, microbatches, &groups, plan.pp)
        .with_loss_scale(loss_scale)
        .run(&plan)
}

/// Megatron's `forward_backward_no_pipelining` for a whole model (no pipeline group): each
/// microbatch's forward and backward pass in turn, gradients accumulated. Returns the mean
/// loss over the microbatches and the gradient of that mean. Honours
/// [`Recompute::Full`](crate::transformer::Recompute::Full).
pub fn forward_backward_no_pipelining<B>(
    model: &GptModel<B>,
    microbatches: &[Microbatch<B>],
) -> Result<(Tensor<B::InnerBackend, 1>, GradientsParams)>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: DistBackend,
{
    let stage = model.stage();
    if !(stage.is_first() && stage.is_last()) {
        return Err(PipelineError::MissingPiece {
            stage: stage.index,
            stages: stage.num_stages,
            piece: if stage.is_first() {
                "output layer"
            } else {
                "embedding"
            },
        }
        .into());
    }
    let plan = Schedule::NoPipelining.plan(1, 1, microbatches.len())?;
    let groups = Groups {
        pp: None,
        pp_rank: 0,
        embedding: None,
    };
    let chunks = core::slice::from_ref(model);
    let mut out = Executor::new(chunks, microbatches, &groups, 1).run(&plan)?;
    let loss = out
        .loss
        .take()
        .ok_or_else(|| executor::internal("a whole model's step has a loss".into()))?;
    Ok((loss, out.grads.remove(0)))
}

/// The evaluation step of `schedule`: its forward passes only, on any backend (give it the
/// chunks' `valid()` models to run without a graph). Returns the mean of the microbatches'
/// losses on the last stage, `None` elsewhere.
pub fn forward_only<B: ModelBackend>(
    schedule: Schedule,
    state: &ParallelState,
    chunks: &[GptModel<B>],
    microbatches: &[Microbatch<B>],
) -> Result<Option<Tensor<B, 1>>> {
    let plan = schedule.plan_forward_only(
        state.pp().size(),
        state.virtual_pipeline_size(),
        microbatches.len(),
    )?;
    let groups = groups(state, chunks, plan.virtual_size)?;
    forward_only::run(&plan, &groups, chunks, microbatches)
}

fn groups<B: ModelBackend>(
    state: &ParallelState,
    chunks: &[GptModel<B>],
    virtual_size: usize,
) -> Result<Groups> {
    if chunks.len() != virtual_size {
        return Err(PipelineError::ChunkCount {
            rank: state.pp_rank(),
            got: chunks.len(),
            expected: virtual_size,
        }
        .into());
    }
    Ok(Groups {
        pp: Some(state.pp().clone()),
        pp_rank: state.pp_rank(),
        embedding: state.embedding().cloned(),
    })
}
