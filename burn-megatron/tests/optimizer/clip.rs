//! Global-norm clipping: the norm over every rank of a model replica equals the
//! single-device norm of the same model's gradients (TP = 1, 2, 4 with and without sequence
//! parallelism; PP = 2 with tied embeddings, one or two chunks per rank; PP = 2 × TP = 2, also
//! with DP = 2), and the clipped gradients equal the single-device gradients scaled by
//! `min(1, max_norm / (norm + 1e-6))` (f32, 1e-5 relative).

use std::collections::BTreeMap;

use burn::tensor::TensorData;
use burn_megatron::optimizer::{CLIP_EPSILON, GradClipConfig, clip_grad_norm, global_grad_norm};
use burn_megatron::pipeline_parallel::{Schedule, StageSplit, forward_backward};
use burn_megatron::tensor_parallel::gather_full_grads;
use burn_megatron::transformer::TransformerConfig;
use burn_megatron_dist::ParallelSizes;

use crate::{
    AD, assert_close, data_values, microbatches, run, tiny_gpt, tiny_llama, tolerance, values,
};

const MICROBATCHES: usize = 2;

/// A layout: TP and PP sizes, sequence parallelism, model chunks per pipeline rank (2: the
/// interleaved schedule), and data-parallel replicas (each given the same microbatches, so
/// each holds the reduced gradients).
#[derive(Debug, Clone, Copy)]
struct Layout {
    tp: usize,
    pp: usize,
    sp: bool,
    v: usize,
    dp: usize,
}

/// A layout of one chunk per pipeline rank.
const fn layout(tp: usize, pp: usize, sp: bool) -> Layout {
    Layout {
        tp,
        pp,
        sp,
        v: 1,
        dp: 1,
    }
}

/// What each rank saw: the global norm before and after clipping, and its full (TP-gathered)
/// clipped gradients under the whole model's paths.
struct RankOutcome {
    norm: f64,
    clipped_norm: f64,
    tp_rank: usize,
    grads: Vec<(String, TensorData)>,
}

/// Runs one step's forward and backward of `config` in `layout`, clips to `max_norm` and
/// returns every rank's outcome.
fn clipped(config: &TransformerConfig, layout: Layout, max_norm: f64) -> Vec<RankOutcome> {
    let Layout { tp, pp, sp, v, dp } = layout;
    let config = config.clone().with_sequence_parallel(sp);
    run(tp * pp * dp, |ctx| {
        let state = ctx
            .parallel_state(ParallelSizes::default().with_tp(tp).with_pp(pp))?
            .with_virtual_pipeline_size(v)?;
        let split = StageSplit::even(config.num_layers, pp * v)?;
        let chunks = (0..v)
            .map(|c| {
                let stage = split.stage(state.virtual_stage(c));
                config.init_gpt_stage::<AD>(state.tp(), &stage, &Default::default())
            })
            .collect::<Result<Vec<_>, _>>()?;
        let schedule = match (pp, v) {
            (1, _) => Schedule::NoPipelining,
            (_, 1) => Schedule::OneFOneB,
            _ => Schedule::Interleaved,
        };
        let mbs = microbatches(MICROBATCHES, config.vocab_size, 0);
        let mut out = forward_backward(schedule, &state, &chunks, &mbs)?;
        let norm = clip_grad_norm(
            &chunks,
            &mut out.grads,
            &state,
            &GradClipConfig::new().with_max_norm(max_norm),
        )?;
        let clipped_norm = global_grad_norm(&chunks, &out.grads, &state)?;
        let mut grads = Vec::new();
        for (chunk, chunk_grads) in chunks.iter().zip(&out.grads) {
            for (path, data) in gather_full_grads::<AD, _>(chunk, chunk_grads, state.tp())? {
                grads.push((chunk.global_path(&path), data));
            }
        }
        Ok(RankOutcome {
            norm: values(norm)[0],
            clipped_norm: values(clipped_norm)[0],
            tp_rank: state.tp().rank(),
            grads,
        })
    })
}

/// The single-device gradients (TP = PP = 1, no clipping) and their norm, in f64 on the host.
fn reference(config: &TransformerConfig) -> (f64, BTreeMap<String, Vec<f64>>) {
    let outcome = clipped(config, layout(1, 1, false), 1e30).remove(0);
    let grads: BTreeMap<String, Vec<f64>> = outcome
        .grads
        .iter()
        .map(|(path, data)| (path.clone(), data_values(data)))
        .collect();
    let norm = grads.values().flatten().map(|g| g * g).sum::<f64>().sqrt();
    (norm, grads)
}

fn check(config: &TransformerConfig, name: &str, layouts: &[Layout]) {
    let (norm, grads) = reference(config);
    assert!(norm > 0.0, "the reference gradients are zero");
    for &layout in layouts {
        // Clip to a third of the norm: the coefficient is well below 1.
        let max_norm = norm / 3.0;
        let coefficient = (max_norm / (norm + CLIP_EPSILON)).min(1.0);
        let ranks = clipped(config, layout, max_norm);
        let what = |s: &str| format!("{name} {layout:?}: {s}");
        for rank in &ranks {
            assert_close(&what("global norm"), &[rank.norm], &[norm], tolerance::F32);
            assert_close(
                &what("norm after clipping"),
                &[rank.clipped_norm],
                &[norm * coefficient],
                tolerance::F32,
            );
        }
        // Every parameter of the reference appears once or (a tied table) twice, on TP rank 0
        // of its stage.
        let mut seen = BTreeMap::new();
        for rank in ranks.iter().filter(|r| r.tp_rank == 0) {
            for (path, data) in &rank.grads {
                let want: Vec<f64> = grads[path].iter().map(|g| g * coefficient).collect();
                let got = data_values(data);
                // Vocabulary padding rows (zero gradients) depend on TP: compare real rows.
                let got = &got[..want.len()];
                assert_close(
                    &what(&format!("clipped gradient of {path}")),
                    got,
                    &want,
                    tolerance::F32,
                );
                seen.insert(path.clone(), ());
            }
        }
        assert_eq!(
            seen.len(),
            grads.len(),
            "{}",
            what("every parameter compared")
        );
    }
}

/// With a `max_norm` above the norm nothing changes.
#[test]
fn a_large_max_norm_leaves_gradients_unchanged() {
    let config = tiny_gpt();
    let (norm, grads) = reference(&config);
    let ranks = clipped(&config, layout(2, 1, true), norm * 2.0);
    for rank in ranks.iter().filter(|r| r.tp_rank == 0) {
        assert_close("norm", &[rank.norm], &[norm], tolerance::F32);
        for (path, data) in &rank.grads {
            let want = &grads[path];
            assert_close(path, &data_values(data)[..want.len()], want, tolerance::F32);
        }
    }
}

#[test]
fn gpt_norm_and_clipping_match_single_device_over_tp() {
    let layouts = [
        layout(1, 1, false),
        layout(2, 1, false),
        layout(2, 1, true),
        layout(4, 1, false),
        layout(4, 1, true),
    ];
    check(&tiny_gpt(), "GPT", &layouts);
}

#[test]
fn llama_norm_and_clipping_match_single_device_over_tp() {
    let layouts = [layout(2, 1, true), layout(4, 1, false)];
    check(&tiny_llama(), "Llama", &layouts);
}

/// The tied embedding table lives on the first and the last stage and counts once.
#[test]
fn gpt_norm_and_clipping_match_single_device_over_pp() {
    let layouts = [
        layout(1, 2, false),
        layout(2, 2, true),
        // Interleaved: two chunks per rank, the tied copy on the second chunk of rank 1.
        Layout {
            v: 2,
            ..layout(1, 2, false)
        },
        // Two DP replicas of PP = 2 × TP = 2: the norm is reduced over the model-parallel
        // group, not over DP (which would count every parameter twice).
        Layout {
            dp: 2,
            ..layout(2, 2, true)
        },
    ];
    check(&tiny_gpt(), "GPT", &layouts);
}
