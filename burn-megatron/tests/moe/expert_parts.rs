//! The routed experts cut into several parts (issue 34: a rank's experts past 32-bit indices
//! together), forced on a tiny model by lowering the part size to 1 536 elements: its four
//! expert matrices (768 elements at EP 1, 384 at EP 2, each aligned to 256) take two parts of
//! two at EP 1 and parts of three and one at EP 2, cut by the expert-DP shards within.
//!
//! - Training: the parameters after two clipped steps equal one part's (f32, 1e-5: the norm's
//!   sum of squares is added in another order, which moves the clip coefficient in its last
//!   bits), and bit for bit when the clip does not bind (the coefficient is exactly 1), at
//!   EP 1 (DP 1, and DP 2 with ZeRO-1), EP 2 × DP 2 and EP 2 × expert-DP 2 with ZeRO-1 and
//!   the bucketed parameter gather. The memory accounting counts every part.
//! - Loss scaling: an +∞ in one part's gradient on one rank skips the step in every part
//!   of every rank.
//! - Checkpoints: saved with several parts, the experts' state loads with one part bit for bit
//!   and back (the files key it by parameter), and training resumes with the losses of
//!   uninterrupted training; also across EP sizes (EP 2 with parts to EP 1, EP 1 to EP 2 with
//!   parts).
//! - A single expert parameter above the part size is refused, naming it.
//!
//! The part size applies to the dense parameters' buffer too, which it cuts into parts of its
//! own (tested alone in the optimizer tests, `dense_parts.rs`).

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use burn::module::ParamId;
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use burn_megatron::checkpointing::{
    Checkpoint, Checkpointer, TrainingState, distributed_adamw_state, load_distributed_adamw,
};
use burn_megatron::distributed::DataParallelConfig;
use burn_megatron::models::{GptModel, Stage};
use burn_megatron::optimizer::{
    DistributedAdamW, DistributedAdamWConfig, FlatAdamWConfig, LossScalerConfig, MAX_FLAT_NUMEL,
};
use burn_megatron::pipeline_parallel::{Schedule, forward_backward, forward_backward_scaled};
use burn_megatron_dist::{ParallelSizes, ParallelState, RankContext, ReduceOp};
use burn_megatron_testing::models::microbatch;
use burn_megatron_testing::{paired, scratch_dir};

use crate::gpt_model::moe_gpt;
use crate::optimizer::full_params;
use crate::{AD, B, assert_close, run, tolerance, values};

/// The part size that cuts the tiny model's experts into several parts.
const SEVERAL: usize = 1536;
/// The default part size: one part.
const ONE: usize = MAX_FLAT_NUMEL;
/// A clip that binds on every step of the tiny model (its norms are above 0.1).
const BINDING: f64 = 0.05;
/// A clip that never binds: the coefficient is exactly 1.
const LOOSE: f64 = 1e3;

/// A layout: the world's ranks (all data-parallel), EP, ZeRO-1, and the part size.
#[derive(Debug, Clone, Copy)]
struct Layout {
    world: usize,
    ep: usize,
    zero1: bool,
    part_numel: usize,
}

const fn layout(world: usize, ep: usize, zero1: bool, part_numel: usize) -> Layout {
    Layout {
        world,
        ep,
        zero1,
        part_numel,
    }
}

impl Layout {
    fn state(&self, ctx: &RankContext) -> burn_megatron_dist::DistResult<ParallelState> {
        ctx.parallel_state(ParallelSizes::default().with_ep(self.ep))
    }

    fn model(&self, state: &ParallelState) -> burn_megatron::Result<GptModel<AD>> {
        let config = moe_gpt();
        Ok(config.init_gpt_stage_with_ep::<AD>(
            state.tp(),
            state.ep(),
            &Stage::whole(config.num_layers),
            &Default::default(),
        )?)
    }

    fn optimizer(&self, clip: f64, bucketed: bool) -> DistributedAdamWConfig {
        DistributedAdamWConfig::new()
            .with_adam(FlatAdamWConfig::new().with_weight_decay(0.1))
            .with_clip_grad(Some(clip))
            .with_data_parallel(
                DataParallelConfig::new()
                    .with_use_distributed_optimizer(self.zero1)
                    .with_overlap_param_gather(bucketed)
                    .with_bucket_numel(700),
            )
            .with_part_numel(self.part_numel)
    }

    /// This rank's share of step `step`'s four microbatches.
    fn microbatches(
        &self,
        state: &ParallelState,
        step: usize,
    ) -> Vec<burn_megatron::data::Microbatch<AD>> {
        let per_rank = 4 / self.world;
        let first = 4 * step + state.coords().dp * per_rank;
        (first..first + per_rank)
            .map(|seed| microbatch::<AD>(50, seed as u64))
            .collect()
    }
}

/// The loss averaged over DP, and this rank's gradients.
fn forward_backward_step(
    state: &ParallelState,
    model: &GptModel<AD>,
    microbatches: &[burn_megatron::data::Microbatch<AD>],
) -> Result<(f64, GradientsParams), Box<dyn std::error::Error + Send + Sync>> {
    let mut out = forward_backward(
        Schedule::NoPipelining,
        state,
        std::slice::from_ref(model),
        microbatches,
    )?;
    let loss = out.loss.ok_or("the loss of the only stage")?;
    let loss = values(state.dp().all_reduce(loss, ReduceOp::Avg)?)[0];
    Ok((loss, out.grads.remove(0)))
}

type Params = Vec<(String, Vec<f64>)>;

/// Two steps at `layout`: every parameter after them (experts gathered over EP), the two
/// gradient norms, and the number of expert parts.
fn two_steps(layout: Layout, clip: f64, bucketed: bool) -> (Params, Vec<f64>, usize) {
    run(layout.world, |ctx| {
        let state = layout.state(&ctx)?;
        let mut model = layout.model(&state)?;
        let mut optim = layout.optimizer(clip, bucketed).init(&model, &state, &[])?;
        let parts = optim.expert_states()?.len();
        let mut norms = Vec::new();
        for step in 0..2 {
            let microbatches = layout.microbatches(&state, step);
            let (_, grads) = forward_backward_step(&state, &model, &microbatches)?;
            let stepped = optim.step(1e-2, model, &grads)?;
            model = stepped.model;
            norms.push(values(stepped.grad_norm)[0]);
        }
        Ok((full_params(&model, &state)?, norms, parts))
    })
    .into_iter()
    .next()
    .expect("rank 0")
}

#[test]
fn experts_in_several_parts_train_as_in_one() {
    for (name, l, parts, bucketed) in [
        ("EP 1", layout(1, 1, false, SEVERAL), 2, false),
        ("EP 1 x DP 2, ZeRO-1", layout(2, 1, true, SEVERAL), 2, false),
        ("EP 2 x DP 2", layout(2, 2, false, SEVERAL), 2, false),
        (
            "EP 2 x expert-DP 2, ZeRO-1, bucketed gather",
            layout(4, 2, true, SEVERAL),
            2,
            true,
        ),
    ] {
        let one = Layout {
            part_numel: ONE,
            ..l
        };
        // A binding clip: the coefficient follows the norm, summed in another order.
        let want = two_steps(one, BINDING, bucketed);
        assert_eq!(want.2, 1, "{name}: one part by default");
        assert!(want.1[0] > BINDING, "{name}: the clip must bind");
        let got = two_steps(l, BINDING, bucketed);
        assert_eq!(got.2, parts, "{name}: the parts");
        assert_close(&format!("{name}: norms"), &got.1, &want.1, tolerance::F32);
        for (path, g, w) in paired(name, &got.0, &want.0) {
            assert_close(&format!("{name}: {path}"), g, w, tolerance::F32);
        }
        // A loose clip: the same bits (the norms up to their order of summation).
        let want = two_steps(one, LOOSE, bucketed);
        let got = two_steps(l, LOOSE, bucketed);
        assert_close(&format!("{name}: norms"), &got.1, &want.1, tolerance::F32);
        for (path, g, w) in paired(name, &got.0, &want.0) {
            assert_close(&format!("{name}, loose clip: {path}"), g, w, 0.0);
        }
    }
}

/// The bytes of the optimizer state count every part: the moments of the dense range and of
/// each part's range, and the gradient buffers of the dense layout and of each part's.
#[test]
fn the_memory_counts_every_part() {
    for l in [layout(1, 1, false, SEVERAL), layout(2, 1, true, SEVERAL)] {
        let counted = run(l.world, |ctx| {
            let state = l.state(&ctx)?;
            let model = l.model(&state)?;
            let optim = l.optimizer(LOOSE, false).init(&model, &state, &[])?;
            let memory = optim.memory(&model);
            let experts = optim.expert_states()?;
            assert_eq!(experts.len(), 2, "{l:?}");
            let dense = optim.dense_states()?;
            assert!(dense.len() > 1, "{l:?}: the dense parameters in parts too");
            let parts = || dense.iter().chain(&experts);
            let ranges: usize = parts().map(|p| p.range.len()).sum();
            let layouts: usize = parts().map(|p| p.layout.numel()).sum();
            assert_eq!(memory.exp_avg, 4 * ranges, "{l:?}");
            assert_eq!(memory.exp_avg_sq, memory.exp_avg, "{l:?}");
            assert_eq!(memory.grads, 4 * layouts, "{l:?}");
            // f32 parameters view the master weights without sharding.
            let main = if l.zero1 { memory.exp_avg } else { 0 };
            assert_eq!(memory.main_params, main, "{l:?}");
            Ok(())
        });
        assert_eq!(counted.len(), l.world);
    }
}

/// Replaces the first element of the gradient of parameter `id` with +∞.
fn inject_inf(grads: &mut GradientsParams, id: ParamId) -> Result<(), &'static str> {
    let grad: Tensor<B, 3> = grads.remove(id).ok_or("a gradient")?;
    let dims = grad.dims();
    let mut data = grad.into_data().to_vec::<f32>().map_err(|_| "f32 values")?;
    data[0] = f32::INFINITY;
    grads.register(
        id,
        Tensor::<B, 3>::from_data(TensorData::new(data, dims), &Default::default()),
    );
    Ok(())
}

/// Three loss-scaled steps at EP 2 × expert-DP 2 with ZeRO-1; at step 1 the last rank's
/// gradient of the first parameter of the first part is +∞. Returns rank 0's parameters
/// after each step.
fn scaled_steps(part_numel: usize) -> Vec<Params> {
    let l = layout(4, 2, true, part_numel);
    run(l.world, |ctx| {
        let state = l.state(&ctx)?;
        let mut model = l.model(&state)?;
        let mut optim = l.optimizer(LOOSE, false).init(&model, &state, &[])?;
        let mut scaler = LossScalerConfig::new()
            .with_initial_scale(1024.0)
            .with_hysteresis(1)
            .init::<B>(&Default::default())?;
        let first = optim.expert_states()?[0].layout.params()[0].id;
        let mut after = Vec::new();
        for step in 0..3 {
            let microbatches = l.microbatches(&state, step);
            let chunks = std::slice::from_ref(&model);
            let mut out = forward_backward_scaled(
                Schedule::NoPipelining,
                &state,
                chunks,
                &microbatches,
                scaler.scale(),
            )?;
            let mut grads = out.grads.remove(0);
            if step == 1 && ctx.rank() == l.world - 1 {
                inject_inf(&mut grads, first)?;
            }
            let stepped = optim.step_scaled(1e-2, model, &grads, &mut scaler)?;
            model = stepped.model;
            let found = stepped.found_inf.ok_or("a scaled step reports its flag")?;
            assert_eq!(found.read()?, step == 1, "step {step}: the flag");
            let steps: Vec<u64> = optim
                .expert_states()?
                .iter()
                .map(|p| p.state.step)
                .collect();
            let want = [1, 1, 2][step];
            assert!(
                steps.len() > 1 || part_numel == ONE,
                "several parts: {steps:?}"
            );
            assert!(
                steps.iter().all(|&s| s == want),
                "step {step}: every part's step count ({steps:?})"
            );
            after.push(full_params(&model, &state)?);
        }
        Ok(after)
    })
    .into_iter()
    .next()
    .expect("rank 0")
}

#[test]
fn an_overflow_in_one_part_skips_the_step_in_every_part() {
    let got = scaled_steps(SEVERAL);
    // Bit for bit: the skipped step moved no parameter of any part.
    assert_eq!(got[0], got[1], "the skipped step moved a parameter");
    assert_ne!(got[1], got[2], "the next step moves the parameters");
    let want = scaled_steps(ONE);
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        for (path, g, w) in paired("loss-scaled", g, w) {
            assert_close(&format!("step {step}: {path}"), g, w, 0.0);
        }
    }
}

/// A rank's optimizer state of the experts by parameter path (every part): where its elements
/// sit in the rank's tensor of the parameter, and their master weights and moments.
type RankState = Vec<(String, Range<usize>, [Vec<f32>; 3])>;

/// `optim`'s state of the experts by path, the step counts of every part (the dense
/// parameters' and the experts'), and the number of the experts' parts.
#[allow(clippy::type_complexity)]
fn rank_state(
    optim: &DistributedAdamW<AD>,
) -> Result<(RankState, Vec<u64>, usize), Box<dyn std::error::Error + Send + Sync>> {
    let mut ranges = Vec::new();
    let mut steps: Vec<u64> = optim.dense_states()?.iter().map(|p| p.state.step).collect();
    let experts = optim.expert_states()?;
    let count = experts.len();
    for part in experts {
        steps.push(part.state.step);
        ranges.push((part.layout.clone(), part.range, part.state));
    }
    let mut out = Vec::new();
    for (layout, range, state) in ranges {
        let host = |t: Tensor<B, 1>| t.into_data().to_vec::<f32>();
        let buffers = [
            host(state.main_params).map_err(|e| format!("{e:?}"))?,
            host(state.exp_avg).map_err(|e| format!("{e:?}"))?,
            host(state.exp_avg_sq).map_err(|e| format!("{e:?}"))?,
        ];
        for slot in layout.params() {
            let (start, end) = (
                slot.offset.max(range.start),
                (slot.offset + slot.numel).min(range.end),
            );
            if start < end {
                let values = buffers
                    .each_ref()
                    .map(|b| b[start - range.start..end - range.start].to_vec());
                out.push((
                    slot.path.clone(),
                    start - slot.offset..end - slot.offset,
                    values,
                ));
            }
        }
    }
    Ok((out, steps, count))
}

/// What [`train`] gives: rank 0's losses, and each rank's EP rank, state, step counts and
/// number of the experts' parts.
struct Trained {
    losses: Vec<f64>,
    ranks: Vec<(usize, RankState, Vec<u64>, usize)>,
}

/// Trains at `layout` over `steps` with a binding clip or not, from the latest checkpoint
/// under `load` if given (the optimizer state too, unless the flag says the model only),
/// saving under `save` at the end.
fn train(
    l: Layout,
    steps: Range<usize>,
    clip: f64,
    load: Option<(&Path, bool)>,
    save: Option<&Path>,
) -> Trained {
    let config = moe_gpt();
    let ranks = run(l.world, |ctx| {
        let state = l.state(&ctx)?;
        let mut model = l.model(&state)?;
        let checkpoint = load
            .map(|(root, _)| Checkpoint::open_latest(root))
            .transpose()?;
        if let Some(checkpoint) = &checkpoint {
            model = checkpoint.load_model(model)?;
        }
        let mut optim = l.optimizer(clip, false).init(&model, &state, &[])?;
        if let (Some(checkpoint), Some((_, false))) = (&checkpoint, load) {
            load_distributed_adamw(checkpoint, std::slice::from_ref(&model), &mut optim)?;
        }
        let mut losses = Vec::new();
        for step in steps.clone() {
            let microbatches = l.microbatches(&state, step);
            let (loss, grads) = forward_backward_step(&state, &model, &microbatches)?;
            losses.push(loss);
            model = optim.step(1e-2, model, &grads)?.model;
        }
        if let Some(root) = save {
            let saved = distributed_adamw_state(std::slice::from_ref(&model), &optim)?;
            let training = TrainingState {
                iteration: steps.end as u64,
                ..Default::default()
            };
            Checkpointer::new(root).save(
                &state,
                &config,
                std::slice::from_ref(&model),
                Some(&saved),
                &training,
            )?;
        }
        let (rank_state, step_counts, parts) = rank_state(&optim)?;
        Ok((losses, (state.ep().rank(), rank_state, step_counts, parts)))
    });
    let losses = ranks[0].0.clone();
    Trained {
        losses,
        ranks: ranks.into_iter().map(|(_, r)| r).collect(),
    }
}

/// The ranks' states put together: each parameter's state on each EP rank (the expert-DP
/// shards joined), by (EP rank, path).
fn assemble(trained: &Trained) -> BTreeMap<(usize, String), [Vec<f32>; 3]> {
    let mut whole: BTreeMap<(usize, String), [Vec<f32>; 3]> = BTreeMap::new();
    for (ep_rank, parts, _, _) in &trained.ranks {
        for (path, range, values) in parts {
            let entry = whole.entry((*ep_rank, path.clone())).or_default();
            for (full, part) in entry.iter_mut().zip(values) {
                if full.len() < range.end {
                    full.resize(range.end, f32::NAN);
                }
                full[range.clone()].copy_from_slice(part);
            }
        }
    }
    whole
}

/// Saved with `from`'s parts after two steps and loaded with `to`'s (the same ranks): every
/// state bit for bit, every step count 2; then two more steps give the losses of
/// uninterrupted training at `to`, bit for bit (the clip does not bind).
fn round_trip(name: &str, from: Layout, to: Layout) {
    let root = scratch_dir("bm-moe-parts", name);
    let saved = train(from, 0..2, LOOSE, None, Some(&root));
    let loaded = train(to, 2..2, LOOSE, Some((&root, false)), None);
    for (what, t) in [("saved", &saved), ("loaded", &loaded)] {
        for (_, _, steps, _) in &t.ranks {
            assert!(steps.iter().all(|&s| s == 2), "{name}, {what}: {steps:?}");
        }
    }
    let parts = |t: &Trained| t.ranks[0].3;
    assert_eq!(
        (parts(&saved), parts(&loaded)),
        (
            if from.part_numel == ONE { 1 } else { 2 },
            if to.part_numel == ONE { 1 } else { 2 }
        ),
        "{name}: the parts"
    );
    let (want, got) = (assemble(&saved), assemble(&loaded));
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{name}"
    );
    for (key, values) in &want {
        for (i, role) in ["master weights", "exp_avg", "exp_avg_sq"]
            .iter()
            .enumerate()
        {
            let (got, want) = (&got[key][i], &values[i]);
            assert_eq!(got.len(), want.len(), "{name}: {role} of {key:?}");
            // Bit for bit (a NaN, an element no rank held, fails too).
            let differs = got
                .iter()
                .zip(want)
                .position(|(g, w)| g.to_bits() != w.to_bits() || g.is_nan());
            assert_eq!(differs, None, "{name}: {role} of {key:?}");
        }
    }
    let resumed = train(to, 2..4, LOOSE, Some((&root, false)), None);
    let uninterrupted = train(to, 0..4, LOOSE, None, None);
    assert_close(
        &format!("{name}: losses after the resume"),
        &resumed.losses,
        &uninterrupted.losses[2..],
        0.0,
    );
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn expert_state_saved_in_parts_loads_in_one_part_and_back() {
    round_trip(
        "parts-to-one",
        layout(4, 2, true, SEVERAL),
        layout(4, 2, true, ONE),
    );
    round_trip(
        "one-to-parts",
        layout(4, 2, true, ONE),
        layout(4, 2, true, SEVERAL),
    );
}

/// Saved after two clipped steps at `from`, resumed at `to` (another EP size): the next two
/// losses are uninterrupted training's at `to`; without the optimizer state they are not.
fn reshard(name: &str, from: Layout, to: Layout) {
    let root = scratch_dir("bm-moe-parts", name);
    let uninterrupted = train(to, 0..4, BINDING, None, None);
    train(from, 0..2, BINDING, None, Some(&root));
    let resumed = train(to, 2..4, BINDING, Some((&root, false)), None);
    assert_close(
        &format!("{name}: losses after the resume"),
        &resumed.losses,
        &uninterrupted.losses[2..],
        tolerance::F32_TRAINING,
    );
    let model_only = train(to, 2..4, BINDING, Some((&root, true)), None);
    let (fresh, want) = (model_only.losses[1], uninterrupted.losses[3]);
    assert!(
        (fresh - want).abs() > 100.0 * tolerance::F32_TRAINING * want.abs(),
        "{name}: a fresh optimizer gives the same loss ({fresh} vs {want})"
    );
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn expert_state_in_parts_reshards_over_ep() {
    reshard(
        "ep2-parts-to-ep1",
        layout(4, 2, true, SEVERAL),
        layout(1, 1, false, ONE),
    );
    reshard(
        "ep1-to-ep2-parts",
        layout(2, 1, true, ONE),
        layout(4, 2, true, SEVERAL),
    );
}

/// A single expert parameter above the part size cannot be cut: refused when the optimizer
/// is built, naming the parameter and the option (experts of width 64 stack 4 096 elements a
/// matrix, parts of 2 048 hold every dense parameter); so is a part size of 0 or past the
/// limit.
#[test]
fn an_expert_parameter_above_the_part_size_is_refused() {
    let errors = run(1, |ctx| {
        let l = layout(1, 1, false, 2048);
        let state = l.state(&ctx)?;
        let mut config = moe_gpt();
        if let Some(moe) = config.moe.as_mut() {
            moe.ffn_hidden_size = Some(64);
        }
        let model = config.init_gpt_stage_with_ep::<AD>(
            state.tp(),
            state.ep(),
            &Stage::whole(config.num_layers),
            &Default::default(),
        )?;
        let error = match l.optimizer(LOOSE, false).init(&model, &state, &[]) {
            Ok(_) => return Err("a 4096-element expert matrix taken in parts of 2048".into()),
            Err(e) => e.to_string(),
        };
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(error)
    });
    let error = &errors[0];
    for part in [
        "experts.fc",
        "alone (4096 elements",
        "would hold 4096 elements, more than the 2048",
        "--expert-model-parallel-size",
    ] {
        assert!(error.contains(part), "{part}: {error}");
    }
    for bad in [0, MAX_FLAT_NUMEL + 1] {
        let error = DistributedAdamWConfig::new()
            .with_part_numel(bad)
            .validate()
            .unwrap_err()
            .to_string();
        assert!(error.contains("part_numel"), "{error}");
    }
}
