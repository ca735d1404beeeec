//! Data parallelism against one device: a tiny GPT trained for ten steps on a global batch of
//! four microbatches, with DP ∈ {1, 2, 4} (each rank taking its share of the microbatches),
//! with and without the distributed optimizer, TP = 2 × DP = 2 and PP = 2 × DP = 2 (1F1B),
//! gives the losses, global gradient norms (clipping active) and parameters of the
//! flat-buffer AdamW on one device. The bytes each rank holds follow Megatron's memory table.

use std::collections::BTreeMap;

use burn_megatron::distributed::{
    BufferConfig, BufferLayout, DataParallelConfig, param_gather_columns, shard_columns,
};
use burn_megatron::models::GptModel;
use burn_megatron::optimizer::{DistributedAdamWConfig, MAX_FLAT_NUMEL};
use burn_megatron::optimizer::{
    FlatAdamWConfig, StepScalars, clip_coefficient, global_grad_norm, shared_copies,
};
use burn_megatron::pipeline_parallel::{
    Microbatch, Schedule, StageSplit, forward_backward, forward_backward_no_pipelining,
};
use burn_megatron::tensor_parallel::{Placements, param_infos};
use burn_megatron::transformer::TransformerConfig;
use burn_megatron_dist::{ParallelSizes, ParallelState, ReduceOp};

use super::flat_adamw::{Trajectory, assert_same, full_params};
use crate::{AD, assert_close, microbatches, run, tiny_gpt, tolerance, values};

pub(crate) const STEPS: usize = 10;
/// Microbatches of a global batch.
pub(crate) const GLOBAL: usize = 4;
/// Small enough that every step clips.
pub(crate) const MAX_NORM: f64 = 0.05;
/// Elements per data-parallel bucket: several buckets for the tiny model.
const BUCKET: usize = 700;

pub(crate) fn adam() -> FlatAdamWConfig {
    FlatAdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.95)
        .with_epsilon(1e-5)
        .with_weight_decay(0.1)
}

pub(crate) fn lr(step: usize) -> f64 {
    1e-2 * (1.0 + step as f64) / STEPS as f64
}

/// Losses, norms and final parameters.
pub(crate) struct Run {
    pub(crate) trajectory: Trajectory,
    pub(crate) norms: Vec<f64>,
}

/// One device, the whole global batch, the flat-buffer AdamW with the global-norm clip, for
/// `steps` steps; at step `skip` the optimizer is not called (the loss is still recorded).
pub(crate) fn one_device(config: &TransformerConfig, steps: usize, skip: Option<usize>) -> Run {
    run(1, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let mut model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let mut optim = adam().init::<AD, _>(&model)?;
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for step in 0..steps {
            let (loss, grads) =
                forward_backward_no_pipelining(&model, &microbatches(GLOBAL, 50, step as u64))?;
            losses.push(values(loss)[0]);
            if skip == Some(step) {
                continue;
            }
            let norm = global_grad_norm(
                std::slice::from_ref(&model),
                std::slice::from_ref(&grads),
                &state,
            )?;
            norms.push(values(norm.clone())[0]);
            let scalars = StepScalars {
                grad_factor: Some(clip_coefficient(norm, MAX_NORM)),
                found_inf: None,
            };
            model = optim.step_with(lr(step), model, &grads, scalars)?;
        }
        Ok(Run {
            trajectory: Trajectory {
                losses,
                params: full_params(&model, &state),
            },
            norms,
        })
    })
    .remove(0)
}

/// A layout of the world: TP, PP, and DP what is left.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    pub(crate) tp: usize,
    pub(crate) pp: usize,
    pub(crate) dp: usize,
}

impl Layout {
    pub(crate) fn state(&self, ctx: &burn_megatron_dist::RankContext) -> ParallelState {
        let state = ctx
            .parallel_state(ParallelSizes::default().with_tp(self.tp).with_pp(self.pp))
            .expect("a valid layout");
        assert_eq!(state.dp().size(), self.dp);
        state
    }

    /// This rank's pipeline stage of `config`, a TP slice of it.
    pub(crate) fn stage(&self, config: &TransformerConfig, state: &ParallelState) -> GptModel<AD> {
        let split = StageSplit::even(config.num_layers, self.pp).expect("an even split");
        config
            .init_gpt_stage::<AD>(
                state.tp(),
                &split.stage(state.pp_rank()),
                &Default::default(),
            )
            .expect("a valid model")
    }
}

/// DP rank `r`'s share of step `step`'s global batch: microbatches `r·4/dp .. (r+1)·4/dp`.
pub(crate) fn my_microbatches(state: &ParallelState, step: usize) -> Vec<Microbatch<AD>> {
    let per_rank = GLOBAL / state.dp().size();
    microbatches(GLOBAL, 50, step as u64)
        .into_iter()
        .skip(state.dp().rank() * per_rank)
        .take(per_rank)
        .collect()
}

/// What one rank ends with: its losses (last stage: the DP mean of the ranks' losses), the
/// global norms, and its stage's parameters, gathered over TP, by path in the whole model.
pub(crate) struct RankRun {
    pub(crate) dp_rank: usize,
    pub(crate) tp_rank: usize,
    pub(crate) losses: Option<Vec<f64>>,
    pub(crate) norms: Vec<f64>,
    pub(crate) params: Vec<(String, Vec<f64>)>,
}

impl RankRun {
    /// A rank's outcome; `losses` are kept on the last stage only.
    pub(crate) fn new(
        model: &GptModel<AD>,
        state: &ParallelState,
        losses: Vec<f64>,
        norms: Vec<f64>,
    ) -> Self {
        let params = full_params(model, state)
            .into_iter()
            .map(|(path, values)| (model.global_path(&path), values))
            .collect();
        Self {
            dp_rank: state.dp().rank(),
            tp_rank: state.tp().rank(),
            losses: model.stage().is_last().then_some(losses),
            norms,
            params,
        }
    }
}

/// One replica (a DP rank's TP rank) put together from its pipeline stages.
struct Replica {
    losses: Option<Vec<f64>>,
    norms: Vec<f64>,
    params: BTreeMap<String, Vec<f64>>,
}

/// The ranks' outcomes put together per (DP rank, TP rank): the pipeline stages' parameters
/// in `want`'s order (the two copies of a tied table must agree), the last stage's losses.
pub(crate) fn merge_stages(ranks: Vec<RankRun>, want: &Run) -> Vec<Run> {
    let mut replicas = BTreeMap::<(usize, usize), Replica>::new();
    for rank in ranks {
        let replica = replicas
            .entry((rank.dp_rank, rank.tp_rank))
            .or_insert_with(|| Replica {
                losses: None,
                norms: rank.norms.clone(),
                params: BTreeMap::new(),
            });
        assert_eq!(replica.norms, rank.norms, "the stages' global norms differ");
        replica.losses = replica.losses.take().or(rank.losses);
        for (path, values) in rank.params {
            if let Some(other) = replica.params.insert(path.clone(), values.clone()) {
                assert_close(&format!("the copies of {path}"), &other, &values, 0.0);
            }
        }
    }
    replicas
        .into_values()
        .map(|mut replica| {
            let ordered = want
                .trajectory
                .params
                .iter()
                .map(|(path, _)| {
                    let values = replica.params.remove(path);
                    (path.clone(), values.unwrap_or_else(|| panic!("no {path}")))
                })
                .collect();
            let extra: Vec<_> = replica.params.keys().collect();
            assert!(extra.is_empty(), "parameters not in the model: {extra:?}");
            Run {
                trajectory: Trajectory {
                    losses: replica.losses.expect("the last stage reports the losses"),
                    params: ordered,
                },
                norms: replica.norms,
            }
        })
        .collect()
}

/// `tp × pp × dp` ranks, 1F1B over the pipeline stages (gradient accumulation at PP = 1),
/// each DP rank taking its share of each global batch, [`DistributedAdamW`] with the clip.
fn data_parallel(config: &TransformerConfig, layout: Layout, zero: bool, want: &Run) -> Vec<Run> {
    data_parallel_with(config, layout, Options::new(zero), want)
}

/// Where a run reduces its gradients over DP.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Reduce {
    /// After the backward pass.
    AfterBackward,
    /// From the backward pass's hook, the weight-gradient GEMMs adding into its buffer.
    Hooked,
    /// The same without the gradient-accumulation fusion (every gradient through the
    /// container).
    HookedUnfused,
}

/// How [`data_parallel_with`] steps.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Options {
    /// The distributed optimizer (ZeRO-1).
    pub(crate) zero: bool,
    /// Where the gradients are reduced over DP.
    pub(crate) reduce: Reduce,
    /// The parameters all-gathered in buckets
    /// ([`DataParallelConfig::overlap_param_gather`]).
    pub(crate) param_gather: bool,
    /// The global norm to clip to.
    pub(crate) clip: Option<f64>,
    /// The most elements of one part of the optimizer's flat buffers
    /// ([`DistributedAdamWConfig::part_numel`]).
    pub(crate) part_numel: usize,
}

impl Options {
    /// Reduced after the backward pass, gathered at once, clipped to [`MAX_NORM`], one part.
    pub(crate) fn new(zero: bool) -> Self {
        Self {
            zero,
            reduce: Reduce::AfterBackward,
            param_gather: false,
            clip: Some(MAX_NORM),
            part_numel: MAX_FLAT_NUMEL,
        }
    }
}

/// [`data_parallel`] with `options`.
pub(crate) fn data_parallel_with(
    config: &TransformerConfig,
    layout: Layout,
    options: Options,
    want: &Run,
) -> Vec<Run> {
    let Options {
        zero,
        reduce,
        param_gather,
        clip,
        part_numel,
    } = options;
    let overlap = reduce != Reduce::AfterBackward;
    let ranks = run(layout.tp * layout.pp * layout.dp, |ctx| {
        let state = layout.state(&ctx);
        let mut model = layout.stage(config, &state);
        let mut optim = DistributedAdamWConfig::new()
            .with_adam(adam())
            .with_data_parallel(
                DataParallelConfig::new()
                    .with_use_distributed_optimizer(zero)
                    .with_overlap_param_gather(param_gather)
                    .with_gradient_accumulation_fusion(reduce == Reduce::Hooked)
                    // Several buckets for this tiny model.
                    .with_bucket_numel(BUCKET),
            )
            .with_clip_grad(clip)
            .with_part_numel(part_numel)
            .init::<AD, _>(&model, &state, &shared_copies(&model))?;
        if overlap {
            let hook = optim.overlap_hook(&model, GLOBAL / layout.dp);
            model.set_backward_hook(Some(hook));
        }
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for step in 0..STEPS {
            let chunks = std::slice::from_ref(&model);
            let mbs = my_microbatches(&state, step);
            let mut out = forward_backward(Schedule::OneFOneB, &state, chunks, &mbs)?;
            if let Some(loss) = out.loss {
                losses.push(values(state.dp().all_reduce(loss, ReduceOp::Avg)?)[0]);
            }
            let stepped = optim.step(lr(step), model, &out.grads.remove(0))?;
            model = stepped.model;
            norms.push(values(stepped.grad_norm)[0]);
            // The number of all-gathers shows which path gathered the parameters: one a
            // part, or one a bucket of each part.
            let parts = optim.dense_states()?;
            let gathers = match (zero && layout.dp > 1, param_gather) {
                (false, _) => 0,
                (true, false) => parts.len(),
                (true, true) => parts
                    .iter()
                    .map(|part| param_gather_columns(part.layout, BUCKET).len())
                    .sum(),
            };
            assert_eq!(
                optim.param_gathers(),
                gathers,
                "all-gathers of the parameters"
            );
            if overlap {
                // The layers' gradients went through the hook, but for those sequence
                // parallelism leaves partial (summed over TP after the backward pass); and an
                // untied output layer's (not a tied copy, which the schedule reduces after the
                // backward pass).
                let partial = Placements::of(&model).partial_gradients().to_vec();
                let layers: usize = model
                    .layers()
                    .iter()
                    .flat_map(param_infos)
                    .filter(|info| !partial.contains(&info.id))
                    .map(|info| info.shape.iter().product::<usize>())
                    .sum();
                let output = match (&model.output, shared_copies(&model).is_empty()) {
                    (Some(output), true) => burn::module::Module::num_params(output),
                    _ => 0,
                };
                assert!(
                    optim.hooked_numel() >= layers + output,
                    "the hook took {} elements, the layers hold {layers}, the output layer \
                     {output}",
                    optim.hooked_numel()
                );
                // Of those, the dense layers' weights (and an untied output layer's) never
                // entered the gradient container: their GEMMs added them to the hook's buffer.
                let weights: usize = model
                    .layers()
                    .iter()
                    .flat_map(param_infos)
                    .filter(|info| info.shape.len() == 2)
                    .map(|info| info.shape.iter().product::<usize>())
                    .sum();
                let fused = match reduce {
                    Reduce::Hooked => weights + output,
                    _ => 0,
                };
                assert_eq!(optim.fused_numel(), fused, "fused weight gradients");
            }
        }
        Ok(RankRun::new(&model, &state, losses, norms))
    });
    merge_stages(ranks, want)
}

pub(crate) fn check(
    label: &str,
    config: &TransformerConfig,
    got: &[Run],
    want: &Run,
    tolerance: f64,
) {
    for (rank, got) in got.iter().enumerate() {
        let label = format!("{label}, replica {rank}");
        assert_close(
            &format!("{label}: norms"),
            &got.norms,
            &want.norms,
            tolerance,
        );
        assert_same(&label, config, &got.trajectory, &want.trajectory, tolerance);
    }
}

/// Every step clips: the comparison covers the clip coefficient.
fn assert_clipping(want: &Run) {
    assert!(
        want.norms.iter().all(|&n| n > MAX_NORM),
        "norms {:?} should all exceed {MAX_NORM}",
        want.norms
    );
}

#[test]
fn data_parallel_steps_equal_one_device() {
    let config = tiny_gpt();
    let want = one_device(&config, STEPS, None);
    assert_clipping(&want);
    for dp in [1, 2, 4] {
        for zero in [false, true] {
            let layout = Layout { tp: 1, pp: 1, dp };
            let got = data_parallel(&config, layout, zero, &want);
            assert_eq!(got.len(), dp);
            check(
                &format!("dp {dp}, distributed optimizer {zero}"),
                &config,
                &got,
                &want,
                tolerance::F32,
            );
        }
    }
}

/// The reduction started from the backward pass's hook (copies during the backward pass,
/// collectives after it on thread ranks; gradient accumulation over the microbatches in the
/// f32 units) gives the same bits as the reduction after the backward pass, at DP 1, 2 and 4,
/// TP 2 × DP 2 and PP 2 × DP 2, with and without the distributed optimizer.
#[test]
fn overlapped_reduction_equals_reduction_after_backward() {
    overlap_equals_reduction_after_backward(&tiny_gpt());
}

/// [`overlapped_reduction_equals_reduction_after_backward`] with an untied output layer, whose
/// gradient the hook takes at the first layer marker.
#[test]
fn overlapped_reduction_with_an_untied_output_layer_equals_reduction_after_backward() {
    overlap_equals_reduction_after_backward(&tiny_gpt().with_tie_embeddings(false));
}

/// [`overlapped_reduction_equals_reduction_after_backward`] with sequence parallelism: the
/// norms' and row-parallel biases' gradients, partial on each TP rank, are left to the
/// schedule's sum over TP and reduced over DP after it.
#[test]
fn overlapped_reduction_with_sequence_parallelism_equals_reduction_after_backward() {
    overlap_equals_reduction_after_backward(&tiny_gpt().with_sequence_parallel(true));
}

fn overlap_equals_reduction_after_backward(config: &TransformerConfig) {
    let config = config.clone();
    let want = one_device(&config, STEPS, None);
    let layouts = [(1, 1, 1), (1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2)];
    for (tp, pp, dp) in layouts {
        for zero in [false, true] {
            let layout = Layout { tp, pp, dp };
            let after = data_parallel_with(&config, layout, Options::new(zero), &want);
            for reduce in [Reduce::Hooked, Reduce::HookedUnfused] {
                let options = Options {
                    reduce,
                    ..Options::new(zero)
                };
                let hooked = data_parallel_with(&config, layout, options, &want);
                let label = format!("{layout:?}, distributed optimizer {zero}, {reduce:?}");
                check(&label, &config, &hooked, &want, tolerance::F32);
                for (h, a) in hooked.iter().zip(&after) {
                    assert_close(&format!("{label}: norms"), &h.norms, &a.norms, 0.0);
                    assert_same(&label, &config, &h.trajectory, &a.trajectory, 0.0);
                }
            }
        }
    }
}

/// The distributed optimizer's parameter all-gather in buckets, issued in the next forward
/// pass's order (`--overlap-param-gather`), gives the same bits (losses, norms, parameters) as
/// one gather of the whole buffer, at DP 2 and 4, TP 2 × DP 2 and PP 2 × DP 2, with and
/// without the reduction hooked into the backward pass. The buckets are small enough that
/// parameters cross buckets' and shards' edges (checked on the layout), and the run counts
/// the bucketed gathers, so a step that gathered in one piece fails it.
#[test]
fn parameters_gathered_in_buckets_equal_one_gather() {
    let config = tiny_gpt();
    let want = one_device(&config, STEPS, None);
    let layouts = [(1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2)];
    for (tp, pp, dp) in layouts {
        for reduce in [Reduce::AfterBackward, Reduce::Hooked] {
            let layout = Layout { tp, pp, dp };
            let once = Options {
                reduce,
                ..Options::new(true)
            };
            let bucketed = Options {
                param_gather: true,
                ..once
            };
            let once = data_parallel_with(&config, layout, once, &want);
            let bucketed = data_parallel_with(&config, layout, bucketed, &want);
            let label = format!("{layout:?}, {reduce:?}, bucketed gather");
            check(&label, &config, &bucketed, &want, tolerance::F32);
            assert_eq!(bucketed.len(), once.len());
            for (b, o) in bucketed.iter().zip(&once) {
                assert_close(&format!("{label}: norms"), &b.norms, &o.norms, 0.0);
                assert_same(&label, &config, &b.trajectory, &o.trajectory, 0.0);
            }
        }
    }
}

/// At DP 2 and 4 the buckets cover each shard at aligned columns; they are issued in the
/// forward pass's order: in the last shard (where the forward's first parameters are, the word
/// embeddings last in the buffer) each parameter, taken in the forward's order, waits for no
/// later bucket than the next one, and the embeddings not for the last bucket. The
/// tiny GPT's layout has parameters that cross a bucket's edge inside a shard and parameters
/// that cross from one shard to the next: the two cases where the bucketed gather
/// concatenates pieces.
#[test]
fn parameter_gather_buckets_cut_parameters() {
    let config = tiny_gpt();
    run(1, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        for dp in [2, 4] {
            let buffer = BufferConfig::new().with_dp_size(dp);
            let layout = BufferLayout::new(&param_infos(&model), buffer)?;
            let shard = layout.numel() / dp;
            let columns = param_gather_columns(&layout, BUCKET);
            assert!(columns.len() > 1, "dp {dp}: {columns:?}");
            assert_eq!(
                columns.first().map(|c| c.end),
                Some(shard),
                "the last columns first"
            );
            assert_eq!(columns.last().map(|c| c.start), Some(0));
            assert!(columns.windows(2).all(|w| w[1].end == w[0].start));
            let align = buffer.param_alignment;
            assert!(columns.iter().all(|c| c.start % align == 0), "{columns:?}");
            let bucket = |i: usize| columns.iter().position(|c| c.contains(&(i % shard)));
            let slots = layout.params();
            let first = slots.last().expect("parameters");
            assert!(first.path.contains("embedding"), "{}", first.path);
            // The last bucket a parameter of the last shard needs is its first column's.
            let waits: Vec<_> = slots
                .iter()
                .rev()
                .take_while(|s| s.offset >= (dp - 1) * shard)
                .map(|s| bucket(s.offset).expect("a bucket"))
                .collect();
            assert!(waits.len() > 1 && waits.is_sorted(), "dp {dp}: {waits:?}");
            assert!(waits[0] + 1 < columns.len(), "dp {dp}: {waits:?}");
            let across_rows = slots
                .iter()
                .any(|s| s.offset / shard != (s.offset + s.numel - 1) / shard);
            let across_buckets = slots.iter().any(|s| {
                s.offset / shard == (s.offset + s.numel - 1) / shard
                    && bucket(s.offset) != bucket(s.offset + s.numel - 1)
            });
            assert!(across_rows, "dp {dp}: no parameter crosses a shard's edge");
            assert!(
                across_buckets,
                "dp {dp}: no parameter crosses a bucket's edge"
            );
        }
        Ok(())
    });
}

#[test]
fn tp2_dp2_steps_equal_one_device() {
    let config = tiny_gpt();
    let want = one_device(&config, STEPS, None);
    for zero in [false, true] {
        let layout = Layout {
            tp: 2,
            pp: 1,
            dp: 2,
        };
        let got = data_parallel(&config, layout, zero, &want);
        assert_eq!(got.len(), 4);
        check(
            &format!("tp 2 × dp 2, distributed optimizer {zero}"),
            &config,
            &got,
            &want,
            tolerance::F32,
        );
    }
}

/// PP = 2 × DP = 2 with 1F1B: each DP rank runs its two microbatches through the two stages,
/// the tied embedding's two copies get the sum of their gradients, and its last-stage copy is
/// not counted in the norm.
#[test]
fn pp2_dp2_steps_equal_one_device() {
    let config = tiny_gpt();
    let want = one_device(&config, STEPS, None);
    assert_clipping(&want);
    for zero in [false, true] {
        let layout = Layout {
            tp: 1,
            pp: 2,
            dp: 2,
        };
        let got = data_parallel(&config, layout, zero, &want);
        assert_eq!(got.len(), 2);
        check(
            &format!("pp 2 × dp 2, distributed optimizer {zero}"),
            &config,
            &got,
            &want,
            tolerance::F32,
        );
    }
}

/// Megatron's table: `param_bytes + 4 + 12 / d` bytes per parameter with the distributed
/// optimizer (fp32 gradients; fp32 master weights and two moments sharded), `6 + 12/d` for
/// bf16 parameters. For f32 parameters our master shard is its own copy: `8 + 12/d`.
fn bytes_per_param(param_bytes: f64, dp: usize) -> f64 {
    param_bytes + 4.0 + 12.0 / dp as f64
}

#[test]
fn each_rank_holds_megatrons_bytes_per_parameter() {
    assert_eq!(bytes_per_param(2.0, 8), 6.0 + 12.0 / 8.0, "bf16 row");
    let config = tiny_gpt();
    for dp in [1, 2, 4] {
        let held = run(dp, |ctx| {
            let state = ctx.parallel_state(ParallelSizes::default())?;
            let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
            let optim = DistributedAdamWConfig::new()
                .with_adam(adam().with_buffer(BufferConfig::new().with_param_alignment(1)))
                .with_data_parallel(DataParallelConfig::new().with_use_distributed_optimizer(true))
                .init::<AD, _>(&model, &state, &[])?;
            let params: usize = param_infos(&model)
                .iter()
                .map(|p| p.shape.iter().product::<usize>())
                .sum();
            let memory = optim.memory(&model);
            let numel = optim.dense_states()?[0].layout.numel();
            assert_eq!(memory.params, 4 * params);
            assert_eq!(memory.grads, 4 * numel);
            assert_eq!(memory.optimizer_state(), 3 * 4 * numel / dp);
            Ok((memory, params))
        });
        for (memory, params) in held {
            let per_param = memory.total() as f64 / params as f64;
            // Padding adds fewer than `dp` elements to the buffers.
            assert_close(
                &format!("bytes per parameter at dp {dp}"),
                &[per_param],
                &[bytes_per_param(4.0, dp)],
                1e-3,
            );
        }
    }
}

/// Replicas built from different seeds are refused at initialisation, on every rank, with and
/// without the distributed optimizer; replicas of one seed are not.
#[test]
fn replicas_with_other_parameters_are_refused() {
    for zero in [false, true] {
        let results = run(2, |ctx| {
            let state = ctx.parallel_state(ParallelSizes::default())?;
            let config = tiny_gpt().with_seed(7 + state.dp().rank() as u64);
            let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
            let optim = DistributedAdamWConfig::new()
                .with_data_parallel(DataParallelConfig::new().with_use_distributed_optimizer(zero))
                .init::<AD, _>(&model, &state, &[]);
            Ok(optim.err().map(|e| e.to_string()))
        });
        for message in results {
            let message = message.unwrap_or_else(|| panic!("zero {zero}: accepted"));
            assert!(
                message.contains("starts from other parameters"),
                "{message}"
            );
        }
        run(2, |ctx| {
            let state = ctx.parallel_state(ParallelSizes::default())?;
            let model = tiny_gpt().init_gpt::<AD>(state.tp(), &Default::default())?;
            DistributedAdamWConfig::new()
                .with_data_parallel(DataParallelConfig::new().with_use_distributed_optimizer(zero))
                .init::<AD, _>(&model, &state, &[])?;
            Ok(())
        });
    }
}

/// Thread ranks that clone one model share its autodiff leaves, which can deadlock
/// burn-autodiff: the optimizer's setup refuses them, naming the ranks and the fix; a forked
/// copy per rank (own leaves, same values) is accepted.
#[test]
fn a_model_cloned_between_thread_ranks_is_refused() {
    // One model, built once (on a one-rank launch) and cloned by two thread ranks.
    let shared = run(1, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        Ok(tiny_gpt().init_gpt::<AD>(state.tp(), &Default::default())?)
    })
    .remove(0);
    for fork in [false, true] {
        let results = run(2, |ctx| {
            let state = ctx.parallel_state(ParallelSizes::default())?;
            let model = match fork {
                true => burn::module::Module::fork(shared.clone(), &Default::default()),
                false => shared.clone(),
            };
            let optim = DistributedAdamWConfig::new().init::<AD, _>(&model, &state, &[]);
            Ok(optim.err().map(|e| e.to_string()))
        });
        for message in results {
            match (fork, message) {
                (false, Some(message)) => assert!(
                    message.contains("share parameters") && message.contains("fork"),
                    "{message}"
                ),
                (false, None) => panic!("a shared model was accepted"),
                (true, None) => {}
                (true, Some(message)) => panic!("forked copies were refused: {message}"),
            }
        }
    }
}

#[test]
fn reduce_scatter_buckets_cover_each_shard() {
    assert_eq!(shard_columns(10, 2, 8), vec![0..4, 4..8, 8..10]);
    assert_eq!(shard_columns(3, 4, 1), vec![0..1, 1..2, 2..3]);
}

/// Under context parallelism the distributed optimizer shards its state over DP × CP, as
/// Megatron does: at DP 2 × CP 2 the four ranks hold four different quarters of the buffer
/// (the CP ranks of one DP rank hold the same parameters, not the same shard).
#[test]
fn the_distributed_optimizer_shards_over_dp_and_cp() {
    let config = tiny_gpt();
    let ranks = run(4, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_cp(2))?;
        let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let optim = DistributedAdamWConfig::new()
            .with_data_parallel(DataParallelConfig::new().with_use_distributed_optimizer(true))
            .init::<AD, _>(&model, &state, &shared_copies(&model))?;
        let parts = optim.dense_states()?;
        Ok((
            state.dp().size(),
            parts[0].range.clone(),
            parts[0].layout.numel(),
        ))
    });
    let numel = ranks[0].2;
    let mut starts: Vec<usize> = ranks
        .iter()
        .map(|(dp, range, n)| {
            assert_eq!((*dp, *n), (2, numel), "DP 2, one layout");
            assert_eq!(range.len() * 4, numel, "a quarter of the buffer: {range:?}");
            range.start
        })
        .collect();
    starts.sort_unstable();
    starts.dedup();
    assert_eq!(starts.len(), 4, "four different shards: {ranks:?}");
}
