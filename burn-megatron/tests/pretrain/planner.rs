//! The memory planner's formulas against hand-computed values and against the parameters our
//! model actually allocates on CPU ranks.

use burn::backend::NdArray;
use burn_megatron::ModelBackend;
use burn_megatron::models::{GptModel, StageSplit};
use burn_megatron::tensor_parallel::param_infos;
use burn_megatron::training::planner::{
    MIN_CP_TOKENS, PlanInput, PlannedLayout, StepParts, estimate, flat_part_numels,
    layer_activation_bytes, megatron_layer_activation_bytes, optimizer_step_bytes, plan, render,
    stage_param_numels, stage_params,
};
use burn_megatron::transformer::{Recompute, TransformerConfig};
use burn_megatron_dist::{ParallelSizes, ParallelState, RankContext};

use crate::run;

const GIB: u64 = 1 << 30;

/// Megatron's per-layer formula, `s·b·h·(34 + 5·a·s/h)` bytes, at GPT-3 6.7B's shape:
/// 2048 · 4096 · (34 + 80) without flash attention, 2048 · 4096 · 34 with it, a TP 4 share
/// a quarter of that.
#[test]
fn megatrons_activation_formula() {
    assert_eq!(
        megatron_layer_activation_bytes(2048, 1, 4096, 32, 1, false),
        956_301_312.0
    );
    assert_eq!(
        megatron_layer_activation_bytes(2048, 1, 4096, 32, 1, true),
        285_212_672.0
    );
    assert_eq!(
        megatron_layer_activation_bytes(2048, 2, 4096, 32, 4, true),
        142_606_336.0
    );
}

/// Our per-layer activations, hand-counted for a GPT layer (h 64, ffn 256, 4 heads, seq 16,
/// micro-batch 2, bf16) at TP 2 with sequence parallelism: each norm keeps its input (a
/// sequence half) and two f32 statistics a row; each column-parallel layer its gathered
/// input; flash attention the packed QKV half, its output half and an f32 log-sum-exp a row
/// and head; the GeLU MLP its two intermediate halves.
#[test]
fn our_activation_count() {
    let gpt = TransformerConfig::new(64, 2, 4, 256, 1000, 16);
    let (tokens, d) = (32u64, 2u64);
    let norm = d * tokens * 64 / 2 + 8 * tokens / 2;
    let column = d * tokens * 64;
    let attention = d * tokens * 192 / 2 + d * tokens * 64 / 2 + 4 * tokens * 4 / 2;
    let mlp = 2 * d * tokens * 256 / 2;
    assert_eq!(
        layer_activation_bytes(&gpt, 16, 2, 2, true, 2),
        2 * norm + 2 * column + attention + mlp
    );
    // Without sequence parallelism the norms keep whole rows.
    let whole = layer_activation_bytes(&gpt, 16, 2, 2, false, 2);
    assert_eq!(
        whole,
        layer_activation_bytes(&gpt, 16, 2, 2, true, 2) + 2 * norm
    );
}

/// A 4-layer Llama (untied, no biases, RMSNorm, rope, GQA 4/2, SwiGLU) of width 32.
fn small_llama() -> TransformerConfig {
    let llama = TransformerConfig::llama_1b();
    TransformerConfig::new(32, 4, 4, 80, 300, 16)
        .with_make_vocab_size_divisible_by(8)
        .with_num_query_groups(Some(2))
        .with_normalization(llama.normalization)
        .with_activation(llama.activation)
        .with_position_embedding(llama.position_embedding)
        .with_add_bias_linear(false)
        .with_tie_embeddings(false)
}

/// Each pipeline stage's TP rank 0 holds as many parameters as the planner counts: a GPT
/// (tied, biases, LayerNorm, learned positions) and a Llama (untied, no biases, RMSNorm,
/// rope, GQA), at TP 1 and 2 and PP 1 and 2.
#[test]
fn parameter_counts_are_the_models() {
    let gpt = TransformerConfig::new(32, 4, 4, 96, 300, 16).with_make_vocab_size_divisible_by(8);
    for model in [gpt, small_llama()] {
        for (tp, pp) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
            let counted = run(tp, |ctx| {
                let state = ctx.parallel_state(ParallelSizes::default().with_tp(tp))?;
                let split = StageSplit::even(model.num_layers, pp)?;
                let mut counts = Vec::new();
                for s in 0..pp {
                    let chunk = model.init_gpt_stage::<NdArray>(
                        state.tp(),
                        &split.stage(s),
                        &Default::default(),
                    )?;
                    let numels: Vec<u64> = param_infos(&chunk)
                        .iter()
                        .map(|p| p.shape.iter().product::<usize>() as u64)
                        .collect();
                    let largest = numels.iter().copied().max().unwrap_or(0);
                    counts.push((numels.iter().sum::<u64>(), largest));
                }
                Ok(counts)
            });
            for (s, count) in counts_of(counted).into_iter().enumerate() {
                let want = stage_params(&model, tp, 1, pp, s, split_layers(&model, pp, s));
                assert_eq!(
                    (want.total(), want.largest_dense),
                    count,
                    "{:?} TP {tp} PP {pp} stage {s}",
                    model.activation
                );
            }
        }
    }
}

/// This rank's parallel state and pipeline stage of `model` at TP `tp` × PP `pp` × EP `ep`
/// (DP = EP), the layers split evenly.
fn rank_stage<B: ModelBackend>(
    ctx: &RankContext,
    model: &TransformerConfig,
    [tp, pp, ep]: [usize; 3],
) -> Result<(ParallelState, GptModel<B>), Box<dyn std::error::Error + Send + Sync>> {
    let sizes = ParallelSizes::default().with_tp(tp).with_pp(pp).with_ep(ep);
    let state = ctx.parallel_state(sizes)?;
    let split = StageSplit::even(model.num_layers, pp)?;
    let stage = model.init_gpt_stage_with_ep::<B>(
        state.tp(),
        state.ep(),
        &split.stage(state.pp_rank()),
        &Default::default(),
    )?;
    Ok((state, stage))
}

/// The global indices of pipeline rank `s`'s layers in an even split of `model` over `pp`.
fn split_layers(model: &TransformerConfig, pp: usize, s: usize) -> std::ops::Range<usize> {
    StageSplit::even(model.num_layers, pp)
        .expect("an even split")
        .stage(s)
        .layers
}

/// The planner's dense and expert parameters equal what an MoE model allocates on each
/// pipeline stage's first rank: SwiGLU experts of their own width in every second layer (4
/// layers: layers 0 and 2), a shared expert, the expert bias, at TP 1 and 2, PP 1 and 2, EP 1
/// and 2 (DP = EP).
#[test]
fn expert_parameter_counts_are_the_models() {
    use burn_megatron::transformer::moe::MoeSettings;
    let moe = MoeSettings::new(4)
        .with_ffn_hidden_size(Some(24))
        .with_shared_expert_ffn_hidden_size(Some(40))
        .with_expert_bias(true)
        .with_score_function(burn_megatron::transformer::moe::RouterScoreFunction::Sigmoid)
        .with_layer_freq(2);
    let model = small_llama().with_moe(Some(moe));
    for (tp, pp, ep) in [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 1)] {
        let counted = run(tp * pp * ep, |ctx| {
            let (state, stage) = rank_stage::<NdArray>(&ctx, &model, [tp, pp, ep])?;
            let (mut dense, mut experts) = (0u64, 0u64);
            let (mut largest_dense, mut largest) = (0u64, 0u64);
            for info in param_infos(&stage) {
                let numel = info.shape.iter().product::<usize>() as u64;
                match info.placement.is_expert() {
                    true => {
                        experts += numel;
                        largest = largest.max(numel);
                    }
                    false => {
                        dense += numel;
                        largest_dense = largest_dense.max(numel);
                    }
                }
            }
            let first = state.tp().rank() == 0 && state.ep().rank() == 0;
            let counts = (dense, experts, largest, largest_dense);
            Ok(first.then_some((state.pp_rank(), counts)))
        });
        let mut seen = 0;
        for (s, counts) in counted.into_iter().flatten() {
            let want = stage_params(&model, tp, ep, pp, s, split_layers(&model, pp, s));
            let experts = counts.1;
            assert_eq!(
                (
                    want.dense,
                    want.experts,
                    want.largest_expert,
                    want.largest_dense
                ),
                counts,
                "TP {tp} PP {pp} EP {ep} stage {s}"
            );
            assert!(
                experts > 0,
                "TP {tp} PP {pp} EP {ep} stage {s}: no experts counted"
            );
            seen += 1;
        }
        assert_eq!(
            seen, pp,
            "TP {tp} PP {pp} EP {ep}: every stage counted once"
        );
    }
}

fn counts_of<T>(per_rank: Vec<Vec<T>>) -> Vec<T> {
    per_rank.into_iter().next().expect("rank 0")
}

fn llama_8b_input() -> PlanInput {
    PlanInput {
        model: TransformerConfig::llama_8b(),
        seq: 4096,
        micro_batch: 1,
        global_batch: 16,
        dtype_bytes: 2,
        overlap_grad_reduce: false,
        expert_parallel: 1,
        gpu_memory: 80 * GIB,
        peak_tflops: 989.4,
    }
}

/// The parts the optimizer cuts the dense parameters of the first of `pp` pipeline stages of
/// `model` into at TP `tp`, the stage holding `layers`, over `replicas` ranks.
fn dense_parts(
    model: &TransformerConfig,
    tp: usize,
    pp: usize,
    layers: std::ops::Range<usize>,
    replicas: usize,
) -> Vec<u64> {
    let numels = stage_param_numels(model, tp, 1, pp, 0, layers);
    flat_part_numels(&numels.dense, replicas, u32::MAX as usize, "--x").unwrap()
}

/// Llama 3 8B on 4 GPUs of 80 GB: one GPU cannot hold its optimizer state (DP 4 without
/// the distributed optimizer is not a layout offered); the peak is the sum of the parts
/// (hand-checked for TP 4: parameters and gradients of 8.03B / 4 bf16 parameters, their
/// fp32 master weights and moments); the plan puts the layouts that fit first and names one.
#[test]
fn the_plan_for_llama_8b_on_four_gpus() {
    let input = llama_8b_input();
    let tp4 = estimate(
        &input,
        PlannedLayout {
            tp: 4,
            cp: 1,
            pp: 1,
            virtual_stages: 1,
            dp: 1,
            sequence_parallel: true,
            distributed_optimizer: false,
            recompute: Recompute::None,
            last_stage_layers: None,
        },
    )
    .unwrap();
    let params = stage_params(&input.model, 4, 1, 1, 0, 0..32).total();
    assert!((2.0e9..2.1e9).contains(&(params as f64)), "{params}");
    let m = tp4.memory;
    assert_eq!(
        (m.params, m.grads, m.optimizer),
        (2 * params, 2 * params, 12 * params)
    );
    // One part of every parameter, aligned to 256 elements; at DP 1 the step all-reduces
    // nothing: the f32 buffer is the reduction, and the squares of the global norm take a
    // temporary of its size.
    let parts = dense_parts(&input.model, 4, 1, 0..32, 1);
    assert_eq!(parts.len(), 1);
    assert!(
        (params..params + 256 * 300).contains(&parts[0]),
        "{parts:?}"
    );
    assert_eq!(m.step_buffer, 4 * parts[0] + 4 * parts[0]);
    assert_eq!(
        m.peak(),
        m.params + m.grads + m.optimizer + (m.activations + m.logits).max(m.step_buffer)
    );
    assert!(tp4.fits);
    let layouts = plan(&input, 4);
    assert!(layouts.len() >= 8, "{}", layouts.len());
    let first_misfit = layouts
        .iter()
        .position(|e| !e.fits)
        .unwrap_or(layouts.len());
    assert!(layouts[first_misfit..].iter().all(|e| !e.fits));
    assert!(
        layouts[..first_misfit]
            .windows(2)
            .all(|w| w[0].step_seconds <= w[1].step_seconds)
    );
    // Without --overlap-grad-reduce DP 4 gathers all 8.03 billion gradients into f32 buffers
    // at the step, past 32-bit indices together: the optimizer cuts them into two parts, so
    // the layout is planned, and does not fit (32 GB of f32 gradients beside 16 GB of bf16
    // parameters, 16 GB of bf16 gradients and 24 GB of optimizer state). With
    // --overlap-grad-reduce each GPU holds all 8B parameters and their f32 gradients: 45 GiB
    // before any optimizer state or activation.
    let plain_dp4: Vec<_> = layouts.iter().filter(|e| e.layout.dp == 4).collect();
    assert!(!plain_dp4.is_empty(), "DP 4 planned");
    assert!(plain_dp4.iter().all(|e| !e.fits), "DP 4 fits");
    let overlapped_plan = plan(
        &PlanInput {
            overlap_grad_reduce: true,
            ..llama_8b_input()
        },
        4,
    );
    let dp4 = overlapped_plan
        .iter()
        .find(|e| e.layout.dp == 4 && e.layout.recompute == Recompute::None)
        .unwrap();
    assert!(dp4.memory.params + dp4.memory.grads > 44 * GIB);
    let text = render(&input, &layouts);
    assert!(
        text.contains("suggested: --tensor-model-parallel-size"),
        "{text}"
    );

    // With --overlap-grad-reduce the gradients live in f32 reduction units through the
    // backward pass: 4 bytes a parameter instead of 2; the step takes their reductions.
    let pp2_dp2 = PlannedLayout {
        tp: 1,
        cp: 1,
        pp: 2,
        virtual_stages: 1,
        dp: 2,
        sequence_parallel: false,
        distributed_optimizer: true,
        recompute: Recompute::None,
        last_stage_layers: Some(15),
    };
    let plain = estimate(&input, pp2_dp2).unwrap().memory;
    let overlapped = PlanInput {
        overlap_grad_reduce: true,
        expert_parallel: 1,
        ..llama_8b_input()
    };
    let hooked = estimate(&overlapped, pp2_dp2).unwrap().memory;
    let params = stage_params(&input.model, 1, 1, 2, 0, 0..17).total();
    assert_eq!((plain.grads, hooked.grads), (2 * params, 4 * params));
    // One part (4.23 billion elements) reduced over DP 2. After the backward pass: its f32
    // buffer, the reduce-scatter's bucket outputs (a half) and their concatenation (a half).
    // Hooked: every unit's output (a half) and their concatenation (a half), the units
    // themselves counted with the gradients.
    let parts = dense_parts(&input.model, 1, 2, 0..17, 2);
    assert_eq!(parts.len(), 1);
    let n = parts[0];
    assert_eq!(plain.step_buffer, 4 * n + 2 * (4 * n / 2));
    assert_eq!(hooked.step_buffer, 4 * n / 2 + 4 * n / 2);
    let resident =
        |m: &burn_megatron::training::planner::RankMemory| m.params + m.grads + m.optimizer;
    assert_eq!(resident(&hooked) - resident(&plain), 2 * params);

    // At DP 4 (micro-batch 1) the plain path gathers the gradients into f32 buffers (in two
    // parts below 32-bit indices) at the step, one part at a time. The units are those
    // buffers, every part's, so the hooked peak is the backward pass's (measured on 4 H200s:
    // 86.41 GiB of live tensors, book "Benchmarks").
    let dp4 = PlannedLayout {
        pp: 1,
        dp: 4,
        last_stage_layers: None,
        ..pp2_dp2
    };
    let params = stage_params(&input.model, 1, 1, 1, 0, 0..32).total();
    assert!(params > u32::MAX as u64, "{params}");
    let plain = estimate(&input, dp4).unwrap().memory;
    // Two parts, each padded to whole shards of 4 x 256 elements. Plain: one part's f32
    // buffer at a time, with its reduce-scatter's outputs and their concatenation (a quarter
    // each), beside the quarters of the parts reduced before it.
    let parts = dense_parts(&input.model, 1, 1, 0..32, 4);
    let [n0, n1] = parts[..] else {
        panic!("{parts:?}")
    };
    assert!(n0 + n1 - params < 2 * 1024, "{parts:?}");
    assert_eq!(
        plain.step_buffer,
        (4 * n0 + 2 * n0).max(n0 + 4 * n1 + 2 * n1)
    );
    let hooked = estimate(&overlapped, dp4).unwrap().memory;
    // Hooked: every unit's output (a quarter of every part) and the first part's
    // concatenation; below the activations of a step without recomputation.
    assert_eq!(hooked.step_buffer, n0 + n1 + n0);
    assert_eq!(
        hooked.peak(),
        hooked.params + hooked.grads + hooked.optimizer + hooked.activations + hooked.logits
    );
    assert_eq!(hooked.grads, 4 * params);
}

/// Past 32-bit indices the optimizer cuts the dense parameters' flat buffers into parts, so
/// 16 of Llama-3 8B's layers on one GPU (4.55 billion parameters with both tables) are
/// planned; a dense parameter whose own buffer passes them (a vocabulary of 1.1 million rows
/// of 4 096 at TP 1) is left out, named with the option that cuts it, and planned at TP 2.
#[test]
fn the_plan_cuts_dense_buffers_and_refuses_one_parameter_past_32_bit_indices() {
    let one_gpu = PlannedLayout {
        tp: 1,
        cp: 1,
        pp: 1,
        virtual_stages: 1,
        dp: 1,
        sequence_parallel: false,
        distributed_optimizer: false,
        recompute: Recompute::Full,
        last_stage_layers: None,
    };
    let mut sixteen = llama_8b_input();
    sixteen.model.num_layers = 16;
    let params = stage_params(&sixteen.model, 1, 1, 1, 0, 0..16);
    assert!(params.dense > u32::MAX as u64, "{params:?}");
    estimate(&sixteen, one_gpu).unwrap();
    let mut wide = llama_8b_input();
    wide.model.vocab_size = 1_100_000;
    let error = estimate(&wide, one_gpu).unwrap_err().to_string();
    assert!(
        error.contains("the flat buffer of one dense parameter alone would hold")
            && error.contains("more TP"),
        "{error}"
    );
    let tp2 = PlannedLayout {
        tp: 2,
        sequence_parallel: true,
        ..one_gpu
    };
    estimate(&wide, tp2).unwrap();
}

/// The interleaved schedule in the plan: Llama 3 8B at TP 2 x PP 2 with 16 microbatches of 2
/// samples (whose activations, not the optimizer step, make the first stage's peak). The
/// first stage keeps the activations of 2 microbatches of 16 layers under 1F1B, and under
/// the interleaved schedule with 2 chunks of 8 layers, 5 chunk passes: Megatron's factor
/// `1 + (pp - 1) / (pp · v)` = 1.25 of 1F1B's 32 layers. The bubble halves, so the estimate
/// is faster. A chunk count that does not divide a rank's layers is planned as the run splits
/// it (the earlier chunks one layer more); no chunks at all is refused.
#[test]
fn the_plan_counts_the_interleaved_schedule() {
    let input = PlanInput {
        micro_batch: 2,
        global_batch: 32,
        ..llama_8b_input()
    };
    let layout = |virtual_stages| PlannedLayout {
        tp: 2,
        cp: 1,
        pp: 2,
        virtual_stages,
        dp: 1,
        sequence_parallel: true,
        distributed_optimizer: false,
        recompute: Recompute::None,
        last_stage_layers: None,
    };
    let layer = layer_activation_bytes(&input.model, 4096, 2, 2, true, 2);
    let one_f_one_b = estimate(&input, layout(1)).unwrap();
    let interleaved = estimate(&input, layout(2)).unwrap();
    // The first stage is the fuller one (the last holds one microbatch and the logits).
    assert_eq!((one_f_one_b.stage, interleaved.stage), (0, 0));
    assert_eq!(one_f_one_b.memory.activations, 32 * layer);
    assert_eq!(interleaved.memory.activations, 40 * layer);
    assert!(interleaved.step_seconds < one_f_one_b.step_seconds);
    assert!(estimate(&input, layout(3)).is_ok());
    assert!(estimate(&input, layout(0)).is_err());
    let layouts = plan(&input, 4);
    assert!(layouts.iter().any(|e| e.layout.virtual_stages == 2));
    assert!(
        layouts
            .iter()
            .all(|e| e.layout.pp > 1 || e.layout.virtual_stages == 1)
    );
}

/// Llama-3 8B's output layer (4096 × 128 256) costs 2.09 of its layers, so at PP = 4 with 8
/// layers a rank the last rank does 18 % more than the average and every rank waits for it:
/// the planner puts 5 layers there (9 + 9 + 9 + 5, 6 % over the average), with and without
/// interleaving, ranks that layout first among PP = 4's without interleaving, and suggests
/// Megatron's options for it.
#[test]
fn the_plan_balances_the_output_layer() {
    use burn_megatron::training::planner::{balanced_last_stage_layers, pipeline_imbalance};
    let input = llama_8b_input();
    let split = |last| StageSplit::pipeline(32, 4, 1, None, last).unwrap();
    let layer = 4096.0 * (4096.0 + 2.0 * 1024.0)
        + 4096.0 * 4096.0
        + 2.0 * 4096.0 * 4096.0
        + 3.0 * 4096.0 * 14336.0;
    let output = 4096.0 * 128_256.0;
    let mean = (32.0 * layer + output) / 4.0;
    let even = pipeline_imbalance(&input, &split(None), 4);
    assert!(
        (even - (8.0 * layer + output) / mean).abs() < 1e-9,
        "{even}"
    );
    let balanced = pipeline_imbalance(&input, &split(Some(5)), 4);
    assert!((balanced - 9.0 * layer / mean).abs() < 1e-9, "{balanced}");
    assert!((1.18..1.19).contains(&even) && (1.05..1.06).contains(&balanced));
    assert_eq!(balanced_last_stage_layers(&input, 4, 1), Some(5));
    assert_eq!(balanced_last_stage_layers(&input, 4, 4), Some(5));
    // Without a pipeline there is nothing to balance.
    assert_eq!(pipeline_imbalance(&input, &split(None), 1), 1.0);

    let layouts = plan(&input, 4);
    // Without interleaving: interleaved, the balanced split's first rank holds more in-flight
    // activations, and the fastest interleaved layout that fits 80 GB (with the pool's
    // allowance) splits evenly.
    let pp4 = layouts
        .iter()
        .find(|e| e.layout.pp == 4 && e.layout.virtual_stages == 1 && e.fits)
        .expect("a PP 4 layout that fits");
    assert_eq!(pp4.layout.last_stage_layers, Some(5));
    // The suggestion (the first layout) carries its split: 15 of 32 on the last of PP = 2.
    let text = render(&input, &layouts);
    let best = layouts[0].layout;
    assert_eq!((best.pp, best.last_stage_layers), (2, Some(15)), "{text}");
    assert!(
        text.contains("--decoder-last-pipeline-num-layers 15")
            && text.contains("--num-virtual-stages-per-pipeline-rank"),
        "{text}"
    );
}

/// Context parallelism in the plan: the 1.1B Llama of `examples/configs/llama_1b_long.toml`
/// at 128k tokens on 4 GPUs of 80 GB, without recomputation. A CP 4 rank holds the whole
/// model and a quarter of the sequence: its activations and logits are CP 1's at 32k tokens
/// (hand-checked: 16 layers of `layer_activation_bytes` at 32768 tokens; the logits and their
/// gradient, `2 · 2 · 32768 · 32000` bytes, and the final norm's output, `2 · 32768 · 2048`),
/// its parameters and optimizer state those of one unsharded rank (a quarter of the state with
/// the distributed optimizer, sharded over DP × CP). CP 1 × DP 4 does not fit
/// and CP 4 does (as measured on 4 H100s, book "Context parallelism"). At 4k tokens the plan
/// offers no CP layout (a rank would keep fewer than `MIN_CP_TOKENS`), and a sequence that
/// does not cut into `2 · cp` chunks is refused.
#[test]
fn the_plan_splits_long_sequences_over_cp() {
    let model = TransformerConfig {
        vocab_size: 32_000,
        max_sequence_length: 131_072,
        ..TransformerConfig::llama_1b().with_tie_embeddings(false)
    };
    let input = PlanInput {
        model: model.clone(),
        seq: 131_072,
        micro_batch: 1,
        global_batch: 4,
        dtype_bytes: 2,
        overlap_grad_reduce: false,
        expert_parallel: 1,
        gpu_memory: 80 * GIB,
        peak_tflops: 989.4,
    };
    let layout = |cp: usize, dp: usize| PlannedLayout {
        tp: 1,
        cp,
        pp: 1,
        virtual_stages: 1,
        dp,
        sequence_parallel: false,
        distributed_optimizer: dp > 1,
        recompute: Recompute::None,
        last_stage_layers: None,
    };
    let cp4 = estimate(&input, layout(4, 1)).unwrap();
    let cp1 = estimate(&input, layout(1, 1)).unwrap();
    let quarter = PlanInput {
        seq: 32_768,
        ..input.clone()
    };
    let cp1_at_32k = estimate(&quarter, layout(1, 1)).unwrap();
    assert_eq!(cp4.memory, cp1_at_32k.memory);
    assert_eq!(
        cp4.memory.activations,
        16 * layer_activation_bytes(&model, 32_768, 1, 1, false, 2)
    );
    assert_eq!(
        cp4.memory.logits,
        2 * 2 * 32_768 * 32_000 + 2 * 32_768 * 2048
    );
    assert_eq!(
        (cp4.memory.params, cp4.memory.optimizer),
        (cp1.memory.params, cp1.memory.optimizer)
    );
    assert_eq!(cp1.memory.activations, 4 * cp4.memory.activations);
    // The distributed optimizer shards its state over DP × CP: a quarter a CP 4 rank.
    let zero = PlannedLayout {
        distributed_optimizer: true,
        ..layout(4, 1)
    };
    let zero = estimate(&input, zero).unwrap();
    assert_eq!(zero.memory.optimizer * 4, cp4.memory.optimizer);
    let dp4 = estimate(&input, layout(1, 4)).unwrap();
    assert!(!dp4.fits && cp4.fits, "{dp4:?}\n{cp4:?}");
    // The same FLOPs on the same GPUs, plus the ring's exchanges.
    assert!(cp4.step_seconds > estimate(&quarter, layout(1, 4)).unwrap().step_seconds / 4.0);

    let layouts = plan(&input, 4);
    let cp_sizes: Vec<usize> = layouts.iter().map(|e| e.layout.cp).collect();
    assert!(
        cp_sizes.contains(&2) && cp_sizes.contains(&4),
        "{cp_sizes:?}"
    );
    let text = render(&input, &layouts);
    let row = text
        .lines()
        .find(|l| l.split_whitespace().take(2).eq(["1", "4"]))
        .unwrap_or_else(|| panic!("a TP 1 x CP 4 row in\n{text}"));
    assert!(row.contains("yes"), "{row}");

    let short = llama_8b_input();
    assert!(short.seq / 2 < MIN_CP_TOKENS);
    assert!(plan(&short, 4).iter().all(|e| e.layout.cp == 1));

    let ragged = PlanInput {
        seq: 131_068,
        ..input
    };
    let e = estimate(&ragged, layout(4, 1)).unwrap_err().to_string();
    assert!(e.contains("does not cut into 8 equal chunks"), "{e}");
}

/// The plan of an MoE model counts each rank's experts at the run's EP and says, above the
/// table, that their activations are planned as the dense MLP's; a dense model's table says
/// nothing of experts. Layouts whose DP × CP the EP does not divide are left out. A rank's
/// experts past 32-bit indices together are planned (the optimizer cuts them into parts); a
/// layout where one expert parameter alone would pass them is refused, naming it.
#[test]
fn the_plan_counts_the_experts_and_says_what_it_does_not() {
    use burn_megatron::transformer::moe::MoeSettings;
    let dense = llama_8b_input();
    let text = render(&dense, &plan(&dense, 4));
    assert!(!text.contains("experts"), "{text}");
    // 8 experts of width 1024 in every layer: 32 · 8 · 3 · 4096 · 1024 = 3.2 billion expert
    // parameters, 1.6 billion a rank at EP 2.
    let mut moe = PlanInput {
        expert_parallel: 2,
        overlap_grad_reduce: true,
        ..llama_8b_input()
    };
    moe.model.moe = Some(MoeSettings::new(8).with_ffn_hidden_size(Some(1024)));
    let layouts = plan(&moe, 4);
    assert!(!layouts.is_empty());
    assert!(layouts.iter().all(|e| (e.layout.dp * e.layout.cp) % 2 == 0));
    let text = render(&moe, &layouts);
    assert!(
        text.contains("experts: 8 a layer at EP 2")
            && text.contains("NOT COUNTED: their activations"),
        "{text}"
    );
    let dp4 = PlannedLayout {
        tp: 1,
        cp: 1,
        pp: 1,
        virtual_stages: 1,
        dp: 4,
        sequence_parallel: false,
        distributed_optimizer: true,
        recompute: Recompute::None,
        last_stage_layers: None,
    };
    let experts = 32 * 8 / 2 * 3 * 4096 * 1024;
    let split = stage_params(&moe.model, 1, 2, 1, 0, 0..32);
    assert_eq!(split.experts, experts);
    let m = estimate(&moe, dp4).unwrap().memory;
    // bf16 parameters; dense f32 units and bf16 expert gradients; the dense state sharded
    // over DP 4, the experts' over expert DP 2; the experts' f32 buffer at the step.
    assert_eq!(m.params, 2 * (split.dense + experts));
    assert_eq!(m.grads, 4 * split.dense + 2 * experts);
    assert_eq!(m.optimizer, 12 * split.dense / 4 + 12 * experts / 2);
    // The step: the dense parts' hooked reduction (every unit's quarter and their
    // concatenation), then, their units freed, the experts' f32 buffer reduce-scattered over
    // expert DP 2 (its half, and the concatenation's half).
    let numels = stage_param_numels(&moe.model, 1, 2, 1, 0, 0..32);
    let dense = flat_part_numels(&numels.dense, 4, u32::MAX as usize, "").unwrap();
    let expert = flat_part_numels(&numels.experts, 2, u32::MAX as usize, "").unwrap();
    let ([d], [e]) = (&dense[..], &expert[..]) else {
        panic!("{dense:?} {expert:?}")
    };
    assert_eq!(m.step_buffer, (d + d).max(d + 4 * e + 2 * (2 * e) - 4 * d));
    // With experts of 14 336 a rank holds 45 billion expert parameters at EP 1 and 11 at
    // EP 4, past 32-bit indices, in parts of whole matrices (2 · 4096 · 14 336 at EP 4):
    // planned.
    let mut wide = PlanInput {
        expert_parallel: 4,
        ..moe.clone()
    };
    wide.model.moe = Some(MoeSettings::new(8));
    let split = stage_params(&wide.model, 1, 4, 1, 0, 0..32);
    assert!(split.experts > u32::MAX as u64, "{split:?}");
    assert_eq!(split.largest_expert, 2 * 4096 * 14_336);
    let m = estimate(&wide, dp4).unwrap().memory;
    let numels = stage_param_numels(&wide.model, 1, 4, 1, 0, 0..32);
    let parts = |numels: &[u64], replicas| {
        flat_part_numels(numels, replicas, u32::MAX as usize, "").unwrap()
    };
    let kinds = [
        StepParts {
            parts: parts(&numels.dense, 4),
            replicas: 4,
            sharded: true,
            hooked: true,
        },
        StepParts {
            parts: parts(&numels.experts, 1),
            replicas: 1,
            sharded: true,
            hooked: false,
        },
    ];
    assert_eq!(kinds[1].parts.len(), 3, "{:?}", kinds[1].parts);
    assert_eq!(m.step_buffer, optimizer_step_bytes(&kinds, 2));
    // 64 experts of 16 384 stack 2³² elements in one matrix at EP 1: refused, named; at EP 2
    // half that. Expert tensor parallelism (the default) halves it at TP 2 too, so every
    // layout of 4 GPUs planned at EP 1 has TP > 1; with whole experts none is.
    let mut huge = PlanInput {
        expert_parallel: 1,
        ..moe.clone()
    };
    huge.model.moe = Some(MoeSettings::new(64).with_ffn_hidden_size(Some(16_384)));
    let error = estimate(&huge, dp4).unwrap_err().to_string();
    assert!(
        error.contains(
            "the flat buffer of one expert parameter alone would hold 4294967296 elements"
        ) && error.contains("more EP"),
        "{error}"
    );
    let planned = plan(&huge, 4);
    assert!(!planned.is_empty());
    assert!(planned.iter().all(|e| e.layout.tp > 1), "{planned:?}");
    let tp2 = stage_params(&huge.model, 2, 1, 1, 0, 0..32);
    assert_eq!(tp2.largest_expert, 64 * 4096 * 16_384 / 2);
    let mut whole = huge.clone();
    whole.model.moe = whole
        .model
        .moe
        .map(|m| m.with_expert_tensor_parallel_size(Some(1)));
    assert!(plan(&whole, 4).is_empty());
    huge.expert_parallel = 2;
    estimate(&huge, dp4).unwrap();
    let odd = estimate(
        &PlanInput {
            expert_parallel: 3,
            ..moe.clone()
        },
        dp4,
    )
    .unwrap_err();
    assert!(
        odd.to_string().contains("EP 3 does not divide DP 4"),
        "{odd}"
    );
}

/// The run: Llama-3 8B at DP 2 with the distributed optimizer, micro-batch 1, full
/// recomputation, on GPUs of 140 GiB. Every rank holds all 8 030 261 248 parameters (the
/// two tables of 128 256 × 4 096, 32 layers of 218 112 000, the final norm): past 32-bit
/// indices, so the optimizer cuts them into two parts, whole parameters in the buffers'
/// order (the output layer first). The first part takes the output layer, the final norm,
/// 17 layers and the 18th's `fc2` (4 291 964 928 elements, a multiple of the 512 of two
/// shards of 256); the second the rest (3 738 296 320).
///
/// Resident: bf16 parameters and gradients (2 + 2 bytes a parameter) and half of the fp32
/// master weights and moments (12 / 2). The step, part by part: the first part's f32 buffer
/// (4 bytes an element), its reduce-scatter's bucket outputs and their concatenation (2 + 2);
/// then, the first part's reduced half kept (2), the second part's buffer, outputs and
/// concatenation (4 + 2 + 2). The second part's moment is the peak: 35.85 GiB, where every
/// part's f32 buffer at once would be 29.9 GiB and one buffer of all the parameters 59.8.
///
/// Measured on 2 H200s (book "Benchmarks", 2026-11-28): 76.95 GiB of live tensors at the
/// peak between the schedule's passes, which the passes' share of the plan (resident,
/// activations, logits) matches within 2 %. The log does not see the optimizer step.
#[test]
fn the_step_is_planned_part_by_part_at_dp_2() {
    let input = PlanInput {
        global_batch: 8,
        gpu_memory: 140 * GIB,
        ..llama_8b_input()
    };
    let layout = PlannedLayout {
        tp: 1,
        cp: 1,
        pp: 1,
        virtual_stages: 1,
        dp: 2,
        sequence_parallel: false,
        distributed_optimizer: true,
        recompute: Recompute::Full,
        last_stage_layers: None,
    };
    let (table, layer, norm) = (128_256 * 4096u64, 218_112_000u64, 4096u64);
    let params = 2 * table + 32 * layer + norm;
    assert_eq!(params, 8_030_261_248);
    assert_eq!(
        stage_params(&input.model, 1, 1, 1, 0, 0..32).total(),
        params
    );
    let n0 = table + norm + 17 * layer + 4096 * 14_336;
    let n1 = params - n0;
    assert_eq!((n0, n1), (4_291_964_928, 3_738_296_320));
    assert_eq!(dense_parts(&input.model, 1, 1, 0..32, 2), [n0, n1]);

    let e = estimate(&input, layout).unwrap();
    let m = e.memory;
    assert_eq!(
        (m.params, m.grads, m.optimizer),
        (2 * params, 2 * params, 12 * params / 2)
    );
    let step = (4 * n0 + 2 * n0 + 2 * n0).max(2 * n0 + 4 * n1 + 2 * n1 + 2 * n1);
    assert_eq!(step, 38_490_300_416);
    assert_eq!(m.step_buffer, step);
    assert_eq!(m.peak(), 10 * params + step);
    assert_eq!(m.peak(), 118_792_912_896);
    assert!(e.fits, "110.6 GiB of 140, the pool's 20 % kept");
    let passes = (10 * params + m.activations + m.logits) as f64;
    let measured = 76.95 * GIB as f64;
    assert!(
        (passes / measured - 1.0).abs() < 0.02,
        "{:.2} GiB",
        passes / GIB as f64
    );
}

/// 16 of Llama-3 8B's layers on one GPU (the second command): 4 540 469 248
/// parameters, two parts (the output layer, the final norm and the 16 layers: 4 015 132 672;
/// the embedding table: 525 336 576). At DP 1 nothing is all-reduced: each part's f32 buffer
/// is its reduction and is kept for the update, so both buffers are held at once, and the
/// global norm's squares take a temporary of the part's size. The first part's buffer and its
/// squares are the peak: 29.92 GiB beside 67.66 GiB of parameters, gradients and state.
#[test]
fn the_step_is_planned_part_by_part_on_one_gpu() {
    let mut input = PlanInput {
        global_batch: 8,
        gpu_memory: 140 * GIB,
        ..llama_8b_input()
    };
    input.model.num_layers = 16;
    let layout = PlannedLayout {
        tp: 1,
        cp: 1,
        pp: 1,
        virtual_stages: 1,
        dp: 1,
        sequence_parallel: false,
        distributed_optimizer: true,
        recompute: Recompute::Full,
        last_stage_layers: None,
    };
    let (table, layer, norm) = (128_256 * 4096u64, 218_112_000u64, 4096u64);
    let params = 2 * table + 16 * layer + norm;
    let (n0, n1) = (table + norm + 16 * layer, table);
    assert_eq!((params, n0), (4_540_469_248, 4_015_132_672));
    assert_eq!(dense_parts(&input.model, 1, 1, 0..16, 1), [n0, n1]);
    let m = estimate(&input, layout).unwrap().memory;
    assert_eq!(m.optimizer, 12 * params);
    let step = (4 * n0 + 4 * n0).max(4 * n0 + 4 * n1 + 4 * n1);
    assert_eq!(step, 32_121_061_376);
    assert_eq!(m.step_buffer, step);
    assert_eq!(m.peak(), 16 * params + step);
    // Without ZeRO the same: one rank holds every shard.
    let plain = PlannedLayout {
        distributed_optimizer: false,
        ..layout
    };
    assert_eq!(estimate(&input, plain).unwrap().memory, m);
}

/// The step's bytes in the four ways it reduces a part, by hand, for parts of 1 024 and 512
/// elements over 4 replicas in bf16: sharded, not sharded, hooked, and an f32 model.
#[test]
fn the_step_follows_each_way_of_reducing() {
    let kind = |sharded, hooked| StepParts {
        parts: vec![1024, 512],
        replicas: 4,
        sharded,
        hooked,
    };
    // Sharded, the first part's reduction is the peak: its buffer, its reduce-scatter's
    // outputs and their concatenation, 4 + 1 + 1 bytes a part element. The second part's
    // (4 + 1 + 1) · 512 beside the first part's quarter (1024), and the update's largest
    // moment (the quarters kept, the first part's written quarter, 512, and its gathered
    // parameters, 2048, its gradients' quarter freed) are below it.
    assert_eq!(optimizer_step_bytes(&[kind(true, false)], 2), 6 * 1024);
    // All-reduced: each buffer is kept, and the squares of the norm take a temporary of its
    // size (4 + 4): 8 · 1024 for the first part, as much for the second beside the first's
    // buffer, and for the first part's update (both buffers and the written part).
    assert_eq!(optimizer_step_bytes(&[kind(false, false)], 2), 8 * 1024);
    // Hooked: every unit's output (1 a part element) and the first concatenation (1).
    assert_eq!(optimizer_step_bytes(&[kind(true, true)], 2), 1536 + 1024);
    // f32, not sharded: the update writes new master weights, which the parameters view (4 a
    // part element): both buffers and the first part's new weights.
    assert_eq!(
        optimizer_step_bytes(&[kind(false, false)], 4),
        4 * 1536 + 4 * 1024
    );
    // No parts, no bytes.
    let none = StepParts {
        parts: Vec::new(),
        ..kind(true, false)
    };
    assert_eq!(optimizer_step_bytes(&[none], 2), 0);
}

/// The planner's parameters, one by one in the model's order, and its parts are the
/// optimizer's on CPU ranks: a GPT (tied, biases, LayerNorm, learned positions, QK-norm, in
/// SwiGLU), a Llama and an MoE Llama, at TP 1 and 2, PP 1 and 2, DP 1 and 2 (ZeRO-1 and not),
/// EP 2, with the part size lowered to 16 384 elements so that every buffer takes several
/// parts, as the dense-parts tests lower it; the f32 gradient buffers the optimizer counts
/// (`DistributedAdamW::memory`) are 4 bytes an element of the planned parts.
#[test]
fn the_planned_parts_are_the_optimizers() {
    use burn::backend::Autodiff;
    use burn_megatron::distributed::DataParallelConfig;
    use burn_megatron::optimizer::DistributedAdamWConfig;
    use burn_megatron::transformer::moe::MoeSettings;
    type AD = Autodiff<NdArray>;
    const LIMIT: usize = 16_384;
    let gpt = TransformerConfig::new(32, 4, 4, 96, 300, 16)
        .with_make_vocab_size_divisible_by(8)
        .with_activation(small_llama().activation)
        .with_qk_layernorm(true);
    let moe = MoeSettings::new(4)
        .with_ffn_hidden_size(Some(24))
        .with_shared_expert_ffn_hidden_size(Some(40))
        .with_expert_bias(true)
        .with_score_function(burn_megatron::transformer::moe::RouterScoreFunction::Sigmoid)
        .with_layer_freq(2);
    let moe = small_llama().with_moe(Some(moe));
    let cases = [
        (gpt.clone(), 1, 1, 1, 1, false),
        (gpt.clone(), 2, 2, 1, 1, false),
        (gpt, 1, 2, 2, 1, true),
        (small_llama(), 1, 1, 2, 1, true),
        (small_llama(), 2, 1, 2, 1, false),
        (moe.clone(), 1, 1, 2, 2, true),
        (moe, 1, 2, 2, 2, false),
    ];
    for (model, tp, pp, dp, ep, zero) in cases {
        let label = format!(
            "{:?} TP {tp} PP {pp} DP {dp} EP {ep} ZeRO {zero}",
            model.activation
        );
        let per_rank = run(tp * pp * dp, |ctx| {
            let (state, stage) = rank_stage::<AD>(&ctx, &model, [tp, pp, ep])?;
            let (mut dense, mut experts, mut frozen) = (Vec::new(), Vec::new(), Vec::new());
            for info in param_infos(&stage) {
                let numel = info.shape.iter().product::<usize>() as u64;
                match (info.placement.is_expert(), info.placement.frozen) {
                    (true, _) => experts.push(numel),
                    (false, true) => frozen.push(numel),
                    (false, false) => dense.push(numel),
                }
            }
            let optim = DistributedAdamWConfig::new()
                .with_data_parallel(DataParallelConfig::new().with_use_distributed_optimizer(zero))
                .with_part_numel(LIMIT)
                .init::<AD, _>(&stage, &state, &[])?;
            let numel = |parts: Vec<burn_megatron::optimizer::PartOptimizerState<'_, NdArray>>| {
                parts
                    .iter()
                    .map(|p| p.layout.numel() as u64)
                    .collect::<Vec<_>>()
            };
            let grads = optim.memory(&stage).grads as u64;
            Ok((
                state.pp_rank(),
                (dense, experts, frozen),
                (numel(optim.dense_states()?), numel(optim.expert_states()?)),
                grads,
            ))
        });
        for (s, listed, (dense_parts, expert_parts), grads) in per_rank {
            let want = stage_param_numels(&model, tp, ep, pp, s, split_layers(&model, pp, s));
            assert_eq!(
                (&want.dense, &want.experts, &want.frozen),
                (&listed.0, &listed.1, &listed.2),
                "{label} stage {s}"
            );
            let planned = (
                flat_part_numels(&want.dense, dp, LIMIT, "--x").unwrap(),
                flat_part_numels(&want.experts, dp / ep, LIMIT, "--x").unwrap(),
            );
            assert!(planned.0.len() >= 2, "{label} stage {s}: {planned:?}");
            assert_eq!(
                (&planned.0, &planned.1),
                (&dense_parts, &expert_parts),
                "{label} stage {s}"
            );
            let planned_numel: u64 = planned.0.iter().chain(&planned.1).sum();
            assert_eq!(grads, 4 * planned_numel, "{label} stage {s}");
        }
    }
}
