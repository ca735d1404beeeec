//! The distributed optimizer's state (ZeRO-1, [`DistributedAdamW`]) in checkpoints, keyed by
//! parameter path and loadable at any DP size.
//!
//! A DP rank holds the master weights and moments of one range of its chunk's flat buffers;
//! the range cuts parameters at arbitrary elements. On save, each rank's part of each
//! parameter (a flat range of it) is written as the boxes of the parameter that range covers,
//! in groups `optimizer.exp_avg`, `optimizer.exp_avg_sq` and `optimizer.main_param`: together
//! the DP ranks' files cover every parameter exactly, just as Burn's AdamW state does. On
//! load, each rank reads the flat range its own layout gives it out of whatever boxes overlap
//! it. So a checkpoint saved at one DP size loads at any other (and the moments load into
//! Burn's AdamW too, through [`Checkpoint::load_optimizer_state`]).
//!
//! The optimizer's flat buffers are cut into parts when a rank's dense parameters, or its
//! routed experts (reduced over expert DP), pass 32-bit indices together (see
//! [`flat_parts`](crate::optimizer::flat_parts)). They are saved and loaded part by part: the
//! files hold each parameter's state by path, so they are the same whatever the EP size and
//! however many parts the buffers took, and a checkpoint saved with several parts loads into
//! one and back.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use burn::module::ParamId;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};

use super::load::Checkpoint;
use crate::ModelBackend;
use crate::distributed::BufferLayout;
use crate::error::Result;
use crate::error::{CheckpointError, read_data, read_params, unshared};
use crate::models::GptModel;
use crate::optimizer::FLAT_ADAMW;
use crate::optimizer::state::{OptimizerState, ParamState};
use crate::optimizer::{DistributedAdamW, DistributedAdamWState, PartOptimizerState};

/// The state group of the fp32 master weights (`optimizer.main_param`).
pub const MAIN_PARAM: &str = "main_param";

/// The state of `optim` over `chunks` (this rank's model chunks, which it steps as one
/// module), by parameter and cut by chunk (`out[i]` for `chunks[i]`): each parameter's part in
/// this rank's range, as a flat range of it. Give it to
/// [`Checkpointer::save`](super::Checkpointer::save); with the distributed optimizer, every DP
/// rank writes its part.
pub fn distributed_adamw_state<B>(
    chunks: &[GptModel<B>],
    optim: &DistributedAdamW<B>,
) -> Result<Vec<OptimizerState>>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: ModelBackend,
{
    let rank = optim.global_rank();
    let dense = optim.dense_states().map_err(|e| e.on_rank(rank))?;
    let experts = optim.expert_states().map_err(|e| e.on_rank(rank))?;
    // Every part by parameter, whatever the parts.
    let mut params = HashMap::new();
    for part in dense.into_iter().chain(experts) {
        params.extend(part_state(
            chunks,
            part.layout,
            part.range,
            part.state,
            rank,
        )?);
    }
    let state = OptimizerState {
        kind: FLAT_ADAMW.to_string(),
        params,
        dp_sharded: optim.config().data_parallel.use_distributed_optimizer,
    };
    Ok(state.split_by_chunk(chunks))
}

/// The state of one part of the flat buffers (`layout`, of which this rank holds `range`):
/// each parameter's elements in the range, as a flat range of it. A buffer that cannot be read
/// (a device error) is a [`DeviceError`](crate::error::DeviceError) naming it and `rank`.
fn part_state<B>(
    chunks: &[GptModel<B>],
    layout: &BufferLayout,
    range: Range<usize>,
    state: DistributedAdamWState<B::InnerBackend>,
    rank: usize,
) -> Result<HashMap<ParamId, ParamState>>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: ModelBackend,
{
    let host = |t: Tensor<B::InnerBackend, 1>, name: &str| -> Result<Vec<f32>> {
        let what =
            || format!("the distributed optimizer's {name} (range {range:?}) for a checkpoint");
        read_data(unshared(t), what)
            .map_err(|e| e.on_rank(rank))?
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| state_error(chunks, format!("cannot read the optimizer state: {e:?}")))
    };
    let buffers = [
        ("exp_avg", host(state.exp_avg, "exp_avg")?),
        ("exp_avg_sq", host(state.exp_avg_sq, "exp_avg_sq")?),
        (MAIN_PARAM, host(state.main_params, MAIN_PARAM)?),
    ];
    let mut params = HashMap::new();
    for (id, local, in_range) in owned(layout, &range) {
        let tensors: BTreeMap<String, TensorData> = buffers
            .iter()
            .map(|(name, values)| {
                let part = values[in_range.clone()].to_vec();
                let len = part.len();
                (name.to_string(), TensorData::new(part, [len]))
            })
            .collect();
        let param = ParamState {
            step: state.step,
            tensors,
            range: Some(local),
        };
        params.insert(id, param);
    }
    Ok(params)
}

/// Loads the optimizer state of the parameters of `chunks` (this rank's model chunks) from
/// `checkpoint` into `optim` (built for them in this run's layout, at any DP size): each rank
/// reads its own range. Load the model from the same checkpoint first: without saved master
/// weights (a checkpoint of Burn's AdamW) the master weights are the loaded parameters' values.
pub fn load_distributed_adamw<B>(
    checkpoint: &Checkpoint,
    chunks: &[GptModel<B>],
    optim: &mut DistributedAdamW<B>,
) -> Result<()>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: ModelBackend,
{
    let rank = optim.global_rank();
    // Each part's layout, range and device, before the parts are written.
    let places = |parts: Vec<PartOptimizerState<'_, B::InnerBackend>>| {
        parts
            .into_iter()
            .map(|part| {
                let device = part.state.main_params.device();
                (part.layout.clone(), part.range, device)
            })
            .collect::<Vec<_>>()
    };
    let dense = places(optim.dense_states().map_err(|e| e.on_rank(rank))?);
    let experts = places(optim.expert_states().map_err(|e| e.on_rank(rank))?);
    let mut step = None;
    let mut loaded = Vec::with_capacity(dense.len() + experts.len());
    for (layout, range, device) in dense.iter().chain(&experts) {
        let state = load_part(checkpoint, chunks, layout, range.clone(), device, &mut step)?;
        loaded.push(state);
    }
    // Every part counts the same steps; a part whose range on this rank holds padding only
    // (the last shards of a small part) finds no parameter saved with it.
    let step = step.unwrap_or(0);
    let mut loaded = loaded
        .into_iter()
        .map(|state| DistributedAdamWState { step, ..state });
    for (part, state) in (0..dense.len()).zip(loaded.by_ref()) {
        optim.load_dense_state(part, state)?;
    }
    for (part, state) in loaded.enumerate() {
        optim.load_expert_state(part, state)?;
    }
    Ok(())
}

/// The saved state of one part of the flat buffers (`layout`, of which this rank holds
/// `range`); master weights missing from the checkpoint are the loaded parameters' values.
/// The step count is `step`'s, which the parameters found set (and must agree with); the
/// returned state's is 0.
fn load_part<B>(
    checkpoint: &Checkpoint,
    chunks: &[GptModel<B>],
    layout: &BufferLayout,
    range: Range<usize>,
    device: &B::Device,
    step: &mut Option<u64>,
) -> Result<DistributedAdamWState<B::InnerBackend>>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: ModelBackend,
{
    let owned = owned(layout, &range);
    let ranges = owned
        .iter()
        .map(|(id, local, _)| (*id, local.clone()))
        .collect();
    let saved = chunks
        .iter()
        .map(|chunk| checkpoint.load_optimizer_shard(chunk, &ranges))
        .collect::<Result<Vec<_>>>()?;
    let saved = OptimizerState::merge(saved).unwrap_or_default();
    let mut main_params = vec![0.0f32; range.len()];
    let mut from_params = None;
    let mut exp_avg = vec![0.0f32; range.len()];
    let mut exp_avg_sq = vec![0.0f32; range.len()];
    for (id, local, in_range) in owned {
        if saved
            .params
            .get(&id)
            .is_none_or(|p| !p.tensors.contains_key(MAIN_PARAM))
        {
            if from_params.is_none() {
                from_params = Some(param_values(chunks, checkpoint)?);
            }
            let values = from_params.as_ref().expect("filled above");
            let value = values.get(&id).ok_or_else(|| {
                state_error(
                    chunks,
                    "a parameter of the optimizer is not in the model".into(),
                )
            })?;
            main_params[in_range.clone()].copy_from_slice(&value[local.clone()]);
        }
        let Some(param) = saved.params.get(&id) else {
            continue;
        };
        if *step.get_or_insert(param.step) != param.step {
            return Err(CheckpointError::mismatch(
                checkpoint.dir(),
                format!(
                    "parameters were saved at different optimizer steps ({} and {}): the \
                     distributed optimizer keeps one step count",
                    step.unwrap_or_default(),
                    param.step
                ),
            )
            .into());
        }
        for (name, out, required) in [
            ("exp_avg", &mut exp_avg, true),
            ("exp_avg_sq", &mut exp_avg_sq, true),
            (MAIN_PARAM, &mut main_params, false),
        ] {
            let Some(data) = param.tensors.get(name) else {
                if required {
                    return Err(CheckpointError::mismatch(
                        checkpoint.dir(),
                        format!("the optimizer state has no {name}"),
                    )
                    .into());
                }
                continue;
            };
            let values = data
                .clone()
                .convert::<f32>()
                .into_vec::<f32>()
                .map_err(|e| state_error(chunks, format!("optimizer {name}: {e:?}")))?;
            out[in_range.clone()].copy_from_slice(&values);
        }
    }
    let tensor = |values: Vec<f32>| {
        let len = values.len();
        Tensor::from_data(TensorData::new(values, [len]), device)
    };
    Ok(DistributedAdamWState {
        main_params: tensor(main_params),
        exp_avg: tensor(exp_avg),
        exp_avg_sq: tensor(exp_avg_sq),
        step: 0,
    })
}

/// Every float parameter's value (its local tensor, row-major) as f32, by id: the master
/// weights that `checkpoint` lacks. A device error names the parameter.
fn param_values<B: AutodiffBackend + ModelBackend>(
    chunks: &[GptModel<B>],
    checkpoint: &Checkpoint,
) -> Result<HashMap<ParamId, Vec<f32>>> {
    let purpose = format!(
        "for the master weights that checkpoint {} lacks",
        checkpoint.dir().display()
    );
    let mut out = HashMap::new();
    for chunk in chunks {
        let values = read_params(chunk, |path| chunk.global_path(path), &purpose)
            .map_err(|e| e.on_rank(chunk.tp().global_rank()))?;
        for (id, data) in values {
            if let Ok(values) = data.convert::<f32>().into_vec::<f32>() {
                out.insert(id, values);
            }
        }
    }
    Ok(out)
}

/// The parameters with elements in `range` (of the flat buffers): id, the flat range of the
/// parameter's local tensor they cover, and where those elements sit in `range`.
fn owned(
    layout: &BufferLayout,
    range: &Range<usize>,
) -> Vec<(ParamId, Range<usize>, Range<usize>)> {
    layout
        .params()
        .iter()
        .filter_map(|slot| {
            let start = slot.offset.max(range.start);
            let end = (slot.offset + slot.numel).min(range.end);
            (start < end).then(|| {
                let local = start - slot.offset..end - slot.offset;
                (slot.id, local, start - range.start..end - range.start)
            })
        })
        .collect()
}

fn state_error<B: ModelBackend>(chunks: &[GptModel<B>], problem: String) -> crate::Error {
    let stages: Vec<String> = chunks
        .iter()
        .map(|chunk| {
            let stage = chunk.stage();
            format!("stage {} (layers {:?})", stage.index, stage.layers)
        })
        .collect();
    crate::error::ConfigError::Invalid(format!(
        "the distributed optimizer of {}: {problem}",
        stages.join(", ")
    ))
    .into()
}
