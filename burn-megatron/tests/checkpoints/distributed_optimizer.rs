//! The distributed optimizer's (ZeRO-1) state in checkpoints: saved by every DP rank, keyed by
//! parameter path, and loaded at another DP size (and TP) it reassembles bit for bit, and
//! training resumed from it continues with the losses of uninterrupted training.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use burn::tensor::Tensor;
use burn_megatron::checkpointing::{
    Checkpoint, Checkpointer, MAIN_PARAM, TrainingState, distributed_adamw_state,
    load_distributed_adamw,
};
use burn_megatron::distributed::DataParallelConfig;
use burn_megatron::optimizer::FlatAdamWConfig;
use burn_megatron::optimizer::{DistributedAdamW, DistributedAdamWConfig, MAX_FLAT_NUMEL};
use burn_megatron::pipeline_parallel::forward_backward_no_pipelining;
use burn_megatron::transformer::TransformerConfig;
use burn_megatron_dist::{ParallelSizes, ReduceOp};

use crate::{AD, B, assert_close, microbatches, run, scratch, tiny_gpt, tolerance};

/// Microbatches of a global batch.
const GLOBAL: usize = 4;

/// (TP, DP, distributed optimizer).
type Layout = (usize, usize, bool);

fn optimizer(zero: bool) -> DistributedAdamWConfig {
    DistributedAdamWConfig::new()
        .with_adam(FlatAdamWConfig::new().with_weight_decay(0.1))
        .with_data_parallel(
            DataParallelConfig::new()
                .with_use_distributed_optimizer(zero)
                .with_bucket_numel(700),
        )
        .with_clip_grad(Some(0.5))
}

/// One rank's optimizer state, by parameter path: the elements of its range, where they sit
/// in the parameter, for master weights and both moments.
type Parts = Vec<(String, Range<usize>, [Vec<f32>; 3])>;

/// [`Parts`], the step count and the number of parts of the dense parameters.
type RankState = (Parts, u64, usize);

/// `optim`'s state by parameter path (every part of its flat buffers), the step count, and
/// the number of parts.
fn parts(optim: &DistributedAdamW<AD>) -> (Parts, u64, usize) {
    let host = |t: Tensor<B, 1>| t.into_data().into_vec::<f32>().unwrap();
    let mut out = Vec::new();
    let mut steps = Vec::new();
    let dense = optim.dense_states().unwrap();
    let count = dense.len();
    for part in dense {
        let (state, range) = (part.state, part.range);
        steps.push(state.step);
        let buffers = [
            host(state.main_params),
            host(state.exp_avg),
            host(state.exp_avg_sq),
        ];
        for slot in part.layout.params() {
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
    assert!(
        steps.windows(2).all(|w| w[0] == w[1]),
        "every part counts the same steps: {steps:?}"
    );
    (out, steps[0], count)
}

/// The ranks' parts put together: every parameter's whole (TP = 1) state, by path, without
/// the vocabulary padding (the last rows at TP = 1), which checkpoints do not store.
fn assemble(ranks: &[RankState], checkpoint: &Checkpoint) -> BTreeMap<String, [Vec<f32>; 3]> {
    let mut whole: BTreeMap<String, [Vec<f32>; 3]> = BTreeMap::new();
    for (parts, _, _) in ranks {
        for (path, range, values) in parts {
            let entry = whole.entry(path.clone()).or_default();
            for (full, part) in entry.iter_mut().zip(values) {
                if full.len() < range.end {
                    full.resize(range.end, f32::NAN);
                }
                full[range.clone()].copy_from_slice(part);
            }
        }
    }
    for (path, values) in whole.iter_mut() {
        for v in values {
            v.truncate(unpadded(checkpoint, path));
        }
    }
    whole
}

/// Every parameter's state in `got` is `want`'s, bit for bit (the state is copied, never
/// recomputed; an element no rank held is a NaN, which fails too).
fn assert_same_state(
    got: &BTreeMap<String, [Vec<f32>; 3]>,
    want: &BTreeMap<String, [Vec<f32>; 3]>,
    what: &str,
) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}"
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (path, values) in want {
        for (i, name) in ["master weights", "exp_avg", "exp_avg_sq"]
            .iter()
            .enumerate()
        {
            assert!(
                values[i].iter().all(|x| !x.is_nan()),
                "{name} of {path}: an element no rank held ({what})"
            );
            assert_eq!(
                bits(&got[path][i]),
                bits(&values[i]),
                "{name} of {path} {what}"
            );
        }
    }
}

/// Elements of the parameter at `path` without padding.
fn unpadded(checkpoint: &Checkpoint, path: &str) -> usize {
    checkpoint.metadata().model_tensors().unwrap()[path]
        .shape
        .iter()
        .product()
}

/// Trains `config` at `layout` over `steps` (the global batch's microbatches split over DP),
/// from the latest checkpoint under `load` if given (the optimizer state too, unless
/// `model_only`), saving under `save` at the end. Returns the losses and each rank's state.
fn train(
    config: &TransformerConfig,
    layout: Layout,
    steps: Range<usize>,
    load: Option<(&Path, bool)>,
    save: Option<&Path>,
) -> (Vec<f64>, Vec<RankState>) {
    train_in_parts(config, layout, MAX_FLAT_NUMEL, steps, load, save)
}

/// [`train`] with the optimizer's flat buffers cut into parts of at most `part_numel`
/// elements.
fn train_in_parts(
    config: &TransformerConfig,
    (tp, dp, zero): Layout,
    part_numel: usize,
    steps: Range<usize>,
    load: Option<(&Path, bool)>,
    save: Option<&Path>,
) -> (Vec<f64>, Vec<RankState>) {
    let per_rank = run(tp * dp, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(tp))?;
        let mut model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let checkpoint = load
            .map(|(root, _)| Checkpoint::open_latest(root))
            .transpose()?;
        if let Some(checkpoint) = &checkpoint {
            model = checkpoint.load_model(model)?;
        }
        let mut optim =
            optimizer(zero)
                .with_part_numel(part_numel)
                .init::<AD, _>(&model, &state, &[])?;
        if let (Some(checkpoint), Some((_, false))) = (&checkpoint, load) {
            load_distributed_adamw(checkpoint, core::slice::from_ref(&model), &mut optim)?;
        }
        let mut losses = Vec::new();
        for s in steps.clone() {
            let mine: Vec<_> = microbatches(s, GLOBAL, config.vocab_size)
                .into_iter()
                .skip(state.dp().rank() * GLOBAL / dp)
                .take(GLOBAL / dp)
                .collect();
            let (loss, grads) = forward_backward_no_pipelining(&model, &mine)?;
            let loss = state.dp().all_reduce(loss, ReduceOp::Avg)?.into_scalar();
            losses.push(loss as f64);
            model = optim.step(1e-2, model, &grads)?.model;
        }
        if let Some(root) = save {
            let saved = distributed_adamw_state(core::slice::from_ref(&model), &optim)?;
            let training = TrainingState {
                iteration: steps.end as u64,
                ..Default::default()
            };
            Checkpointer::new(root).save(&state, config, &[model], Some(&saved), &training)?;
        }
        Ok((losses, parts(&optim)))
    });
    let losses = per_rank[0].0.clone();
    for (other, _) in &per_rank {
        assert_eq!(other, &losses, "ranks disagree on the losses");
    }
    (losses, per_rank.into_iter().map(|(_, p)| p).collect())
}

#[test]
fn zero_state_saved_at_dp2_reassembles_exactly_at_dp4_and_dp1() {
    let config = tiny_gpt();
    let root = scratch("zero-exact");
    let (_, saved) = train(&config, (1, 2, true), 0..2, None, Some(&root));
    let checkpoint = Checkpoint::open_latest(&root).unwrap();
    let want = assemble(&saved, &checkpoint);
    assert!(saved.iter().all(|(_, step, _)| *step == 2));
    let reseeded = config.clone().with_seed(config.seed + 1);
    for layout in [(1, 4, true), (1, 1, false), (1, 2, true)] {
        let (_, loaded) = train(&reseeded, layout, 0..0, Some((&root, false)), None);
        assert!(loaded.iter().all(|(_, step, _)| *step == 2), "{layout:?}");
        let got = assemble(&loaded, &checkpoint);
        assert_same_state(&got, &want, &format!("loaded at {layout:?}"));
    }
    // The same tensors through Burn's AdamW path: whole parameters, keyed by path.
    run(1, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let checkpoint = Checkpoint::open_latest(&root)?;
        assert!(checkpoint.metadata().optimizer.as_ref().unwrap().dp_sharded);
        let whole = checkpoint.load_optimizer_state(&model)?;
        let optim = optimizer(false).init::<AD, _>(&model, &state, &[])?;
        for slot in optim.dense_states()?[0].layout.params() {
            let saved = &whole.params[&slot.id];
            assert_eq!(saved.step, 2);
            for (name, i) in [(MAIN_PARAM, 0), ("exp_avg", 1), ("exp_avg_sq", 2)] {
                let mut values = saved.tensors[name].to_vec::<f32>().unwrap();
                values.truncate(unpadded(&checkpoint, &slot.path));
                assert_eq!(values, want[&slot.path][i], "{name} of {}", slot.path);
            }
        }
        Ok(())
    });
    std::fs::remove_dir_all(root).unwrap();
}

fn resume(from: Layout, to: Layout) {
    let config = tiny_gpt();
    let root = scratch(&format!("zero-resume-{from:?}-{to:?}"));
    let (n, k) = (3, 3);
    let (uninterrupted, _) = train(&config, to, 0..n + k, None, None);
    let (first, _) = train(&config, from, 0..n, None, Some(&root));
    let reseeded = config.clone().with_seed(config.seed + 1);
    let (resumed, _) = train(&reseeded, to, n..n + k, Some((&root, false)), None);
    let what = format!("saved at (TP, DP, ZeRO) = {from:?}, resumed at {to:?}");
    assert_close(
        &format!("{what}: losses before the save"),
        &first,
        &uninterrupted[..n],
        tolerance::F32_TRAINING,
    );
    assert_close(
        &format!("{what}: losses after the resume"),
        &resumed,
        &uninterrupted[n..],
        tolerance::F32_TRAINING,
    );
    // Without the optimizer state the resumed losses differ: the comparison is sharp.
    let (model_only, _) = train(&reseeded, to, n..n + k, Some((&root, true)), None);
    let gap = (model_only[1] - uninterrupted[n + 1]).abs() / uninterrupted[n + 1].abs();
    assert!(
        gap > 100.0 * tolerance::F32_TRAINING,
        "{what}: a fresh optimizer gives the same losses ({model_only:?} vs {uninterrupted:?})"
    );
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn zero_saved_at_dp2_resumes_at_dp4_and_without_sharding() {
    resume((1, 2, true), (1, 4, true));
    resume((1, 2, true), (1, 1, false));
}

#[test]
fn zero_saved_at_tp2_dp2_resumes_at_tp1_dp2() {
    resume((2, 2, true), (1, 2, true));
}

/// The tiny GPT's dense buffer cut into parts of at most 8 192 elements: 3 parts at DP 1, 2
/// and 4.
const SEVERAL: usize = 8192;

/// The dense parameters' state saved in several parts (ZeRO-1 at DP 2) is keyed by parameter:
/// loaded into one part (DP 2, DP 1 without sharding) and into parts at DP 4 it reassembles
/// bit for bit; saved in one part it loads into parts just as exactly. Training resumed in
/// parts from a checkpoint of one part continues with the losses of uninterrupted training.
#[test]
fn zero_state_saved_in_dense_parts_loads_in_one_part_and_back() {
    let config = tiny_gpt();
    let reseeded = config.clone().with_seed(config.seed + 1);
    for (name, saved_in, loaded_in) in [
        ("parts-to-one", SEVERAL, MAX_FLAT_NUMEL),
        ("one-to-parts", MAX_FLAT_NUMEL, SEVERAL),
    ] {
        let root = scratch(&format!("zero-dense-{name}"));
        let (_, saved) = train_in_parts(&config, (1, 2, true), saved_in, 0..2, None, Some(&root));
        let parts = |ranks: &[RankState]| ranks[0].2;
        let many = |numel: usize| if numel == SEVERAL { 3 } else { 1 };
        assert_eq!(parts(&saved), many(saved_in), "{name}: parts saved");
        let checkpoint = Checkpoint::open_latest(&root).unwrap();
        let want = assemble(&saved, &checkpoint);
        for layout in [(1, 2, true), (1, 1, false), (1, 4, true)] {
            let load = Some((root.as_path(), false));
            let (_, loaded) = train_in_parts(&reseeded, layout, loaded_in, 0..0, load, None);
            assert_eq!(parts(&loaded), many(loaded_in), "{name}: parts loaded");
            assert!(loaded.iter().all(|(_, step, _)| *step == 2), "{layout:?}");
            let got = assemble(&loaded, &checkpoint);
            assert_same_state(&got, &want, &format!("{name}, loaded at {layout:?}"));
        }
        std::fs::remove_dir_all(root).unwrap();
    }
    let root = scratch("zero-dense-resume");
    let (uninterrupted, _) = train(&config, (1, 2, true), 0..4, None, None);
    train(&config, (1, 2, true), 0..2, None, Some(&root));
    let load = Some((root.as_path(), false));
    let (resumed, _) = train_in_parts(&reseeded, (1, 2, true), SEVERAL, 2..4, load, None);
    assert_close(
        "resumed in parts: losses",
        &resumed,
        &uninterrupted[2..],
        tolerance::F32_SAME_ORDER,
    );
    std::fs::remove_dir_all(root).unwrap();
}
