//! Sharded checkpoints on CPU thread ranks: saved in one layout, loaded in another, the model
//! equals the single-device model; training resumed in a new layout continues as if never
//! stopped; broken checkpoints are refused with their errors; a save killed at any step of
//! its publish protocol leaves the previous checkpoint or the new one.

mod async_save;
mod convert;
mod distributed_optimizer;
mod flat_adamw;
mod fp8_states;
mod hugging_face;
mod hugging_face_mixtral;
mod hugging_face_qwen3_moe;
mod loss_scaler;
mod partial_reads;
mod placements;
mod publish;
mod resharding;
mod resume;
mod safety;

use std::collections::BTreeMap;
use std::path::PathBuf;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::TensorData;
use burn_megatron::models::GptModel;
use burn_megatron::pipeline_parallel::{Microbatch, Schedule, StageSplit, forward_backward};
use burn_megatron::tensor_parallel::gather_full_grads;
use burn_megatron::transformer::TransformerConfig;
use burn_megatron_dist::{ParallelSizes, ParallelState, RankContext};
use burn_megatron_testing::models::microbatch;
pub use burn_megatron_testing::models::{tiny_gpt, tiny_llama};
pub use burn_megatron_testing::{assert_close, compare::data_values, run, tolerance};

pub type B = NdArray<f32>;
pub type AD = Autodiff<B>;
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A fresh directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    burn_megatron_testing::scratch_dir("bm-ckpt", name)
}

/// The `count` microbatches of step `step` (microbatch `i` drawn with seed `step · 16 + i`):
/// `[2, 8]` tokens and next-token-like targets.
pub fn microbatches(step: usize, count: usize, vocab: usize) -> Vec<Microbatch<AD>> {
    (0..count)
        .map(|i| microbatch(vocab, (step * 16 + i) as u64))
        .collect()
}

/// This rank's layout state and its model chunks of `config` at TP × PP (one chunk a rank).
pub fn build(
    ctx: &RankContext,
    config: &TransformerConfig,
    tp: usize,
    pp: usize,
) -> Result<(ParallelState, Vec<GptModel<AD>>), BoxError> {
    let state = ctx.parallel_state(ParallelSizes::default().with_tp(tp).with_pp(pp))?;
    let split = StageSplit::even(config.num_layers, pp)?;
    let stage = split.stage(state.pp_rank());
    let chunk = config.init_gpt_stage::<AD>(state.tp(), &stage, &Default::default())?;
    Ok((state, vec![chunk]))
}

/// A step's loss (last stage) and full gradients by path in the whole model.
pub struct Outcome {
    pub loss: Option<f64>,
    pub grads: Vec<(String, TensorData)>,
    pub tp_rank: usize,
}

/// One forward/backward step (1F1B) of `chunks` on `microbatches`; gradients gathered over
/// TP and named by their path in the whole model. Returns the per-chunk gradients too.
pub fn step(
    state: &ParallelState,
    chunks: &[GptModel<AD>],
    microbatches: &[Microbatch<AD>],
) -> Result<(Outcome, Vec<burn::optim::GradientsParams>), BoxError> {
    let out = forward_backward(Schedule::OneFOneB, state, chunks, microbatches)?;
    let mut grads = Vec::new();
    for (chunk, chunk_grads) in chunks.iter().zip(&out.grads) {
        for (path, data) in gather_full_grads::<AD, _>(chunk, chunk_grads, state.tp())? {
            grads.push((chunk.global_path(&path), data));
        }
    }
    Ok((
        Outcome {
            loss: out.loss.map(|l| l.into_scalar() as f64),
            grads,
            tp_rank: state.tp().rank(),
        },
        out.grads,
    ))
}

/// The ranks' outcomes merged: the loss and every full gradient once.
pub fn merge(outcomes: Vec<Outcome>) -> (f64, BTreeMap<String, TensorData>) {
    let mut loss = None;
    let mut grads = BTreeMap::new();
    for o in outcomes {
        loss = loss.or(o.loss);
        if o.tp_rank == 0 {
            grads.extend(o.grads);
        }
    }
    (loss.expect("the last stage reports the loss"), grads)
}

/// Loss and gradients of `got` equal `want` (f32, 1e-5 relative).
pub fn assert_same_step(
    what: &str,
    got: &(f64, BTreeMap<String, TensorData>),
    want: &(f64, BTreeMap<String, TensorData>),
) {
    assert_close(
        &format!("{what}: loss"),
        &[got.0],
        &[want.0],
        tolerance::F32,
    );
    let got_paths: Vec<_> = got.1.keys().collect();
    let want_paths: Vec<_> = want.1.keys().collect();
    assert_eq!(got_paths, want_paths, "{what}: parameters");
    for (path, data) in &want.1 {
        assert_close(
            &format!("{what}: gradient of {path}"),
            &data_values(&got.1[path]),
            &data_values(data),
            tolerance::F32,
        );
    }
}
