//! What can go wrong in splitting a model into stages, planning a schedule or running it.

use super::Error;

/// A pipeline that cannot be built, planned or run, with what to change.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PipelineError {
    /// An even split needs the layers to divide over the (virtual) stages.
    #[error(
        "{layers} layers do not split evenly over {stages} pipeline stages (PP × virtual \
         stages): use a number of stages that divides {layers}, or give explicit layer counts \
         per stage"
    )]
    LayersNotDivisible {
        /// Transformer layers of the model.
        layers: usize,
        /// Virtual stages of the pipeline.
        stages: usize,
    },
    /// Explicit layer counts must name every stage and add up to the model's layers.
    #[error(
        "layer counts {counts:?} must give one count per stage ({stages} stages) adding up to \
         the model's {layers} layers"
    )]
    LayerCounts {
        /// The counts given.
        counts: Vec<usize>,
        /// Virtual stages of the pipeline.
        stages: usize,
        /// Transformer layers of the model.
        layers: usize,
    },
    /// Megatron's first/last-stage layer counts that leave the middle stages an uneven or
    /// impossible share.
    #[error(
        "{layers} layers over PP = {pp} with {first:?} on the first and {last:?} on the last \
         pipeline rank: {problem}"
    )]
    UnevenStages {
        /// Transformer layers of the model.
        layers: usize,
        /// Pipeline-parallel size.
        pp: usize,
        /// `--decoder-first-pipeline-num-layers`.
        first: Option<usize>,
        /// `--decoder-last-pipeline-num-layers`.
        last: Option<usize>,
        /// What is wrong, and what to change.
        problem: String,
    },
    /// A schedule needs at least one microbatch.
    #[error("a schedule needs at least one microbatch")]
    NoMicrobatches,
    /// Megatron's interleaved schedule groups microbatches by PP.
    #[error(
        "the interleaved schedule needs the number of microbatches ({microbatches}) to be \
         divisible by PP ({pp}), as Megatron requires: use a multiple of {pp}, such as {}",
        (microbatches / pp + 1) * pp
    )]
    MicrobatchesNotDivisible {
        /// Microbatches given.
        microbatches: usize,
        /// Pipeline-parallel size.
        pp: usize,
    },
    /// The schedule does not take virtual stages, or needs them.
    #[error("the {schedule} schedule {problem}")]
    VirtualStages {
        /// The schedule.
        schedule: String,
        /// What is wrong with the virtual stages.
        problem: String,
    },
    /// The model chunks given do not match the plan.
    #[error(
        "pipeline rank {rank} was given {got} model chunks, the plan has {expected} virtual \
         stages per rank: build one chunk per virtual stage"
    )]
    ChunkCount {
        /// Pipeline rank.
        rank: usize,
        /// Chunks given.
        got: usize,
        /// Virtual stages per rank in the plan.
        expected: usize,
    },
    /// A stage was asked for a part of the model it does not hold.
    #[error(
        "stage {stage} of {stages} has no {piece}: the first stage holds the embedding, the last \
         the final norm, the output layer and the loss; run the model through a schedule in \
         `burn_megatron::pipeline_parallel`"
    )]
    MissingPiece {
        /// The (virtual) stage.
        stage: usize,
        /// Stages in the pipeline.
        stages: usize,
        /// What was asked for.
        piece: &'static str,
    },
    /// `Recompute::Full` needs a schedule to rerun the layers in the backward pass.
    #[error(
        "this model was built with Recompute::Full, which stores only each layer's input and \
         reruns the layers in the backward pass; a plain forward pass on a model that tracks \
         gradients would store everything instead. Train it with a schedule \
         (`burn_megatron::pipeline_parallel::forward_backward`), run inference on \
         `model.valid()` or `model.no_grad()`, or build it with Recompute::None or Selective"
    )]
    RecomputeNeedsSchedule,
    /// A stage failed while running its part of a schedule.
    #[error("pipeline stage {stage} (global rank {rank}) failed in {step}: {source}")]
    StageFailed {
        /// The (virtual) stage that failed.
        stage: usize,
        /// Its global rank.
        rank: usize,
        /// The step it was running, e.g. "forward of microbatch 3".
        step: String,
        /// What went wrong.
        source: Box<Error>,
    },
}
