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

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};

use super::load::Checkpoint;
use crate::ModelBackend;
use crate::distributed::BufferLayout;
use crate::error::CheckpointError;
use crate::error::Result;
use crate::models::GptModel;
use crate::optimizer::FLAT_ADAMW;
use crate::optimizer::state::{OptimizerState, ParamState};
use crate::optimizer::{DistributedAdamW, DistributedAdamWState};

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
    let mut params = part_state(chunks, optim.layout(), optim.range(), optim.state())?;
    if let Some(experts) = optim.expert_state() {
        params.extend(part_state(
            chunks,
            experts.layout,
            experts.range,
            experts.state,
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
/// each parameter's elements in the range, as a flat range of it.
fn part_state<B>(
    chunks: &[GptModel<B>],
    layout: &BufferLayout,
    range: Range<usize>,
    state: DistributedAdamWState<B::InnerBackend>,
) -> Result<HashMap<ParamId, ParamState>>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: ModelBackend,
{
    let host = |t: Tensor<B::InnerBackend, 1>| -> Result<Vec<f32>> {
        t.into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| state_error(chunks, format!("cannot read the optimizer state: {e:?}")))
    };
    let buffers = [
        ("exp_avg", host(state.exp_avg)?),
        ("exp_avg_sq", host(state.exp_avg_sq)?),
        (MAIN_PARAM, host(state.main_params)?),
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
    let device = optim.state().main_params.device();
    let state = load_part(checkpoint, chunks, optim.layout(), optim.range(), &device)?;
    optim.load_state(state)?;
    if let Some(experts) = optim.expert_state() {
        let (layout, range) = (experts.layout.clone(), experts.range);
        let state = load_part(checkpoint, chunks, &layout, range, &device)?;
        optim.load_expert_state(state)?;
    }
    Ok(())
}

/// The saved state of one part of the flat buffers (`layout`, of which this rank holds
/// `range`); master weights missing from the checkpoint are the loaded parameters' values.
fn load_part<B>(
    checkpoint: &Checkpoint,
    chunks: &[GptModel<B>],
    layout: &BufferLayout,
    range: Range<usize>,
    device: &B::Device,
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
    let mut step = None;
    for (id, local, in_range) in owned {
        if saved
            .params
            .get(&id)
            .is_none_or(|p| !p.tensors.contains_key(MAIN_PARAM))
        {
            let values = from_params.get_or_insert_with(|| param_values(chunks));
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
        step: step.unwrap_or(0),
    })
}

/// Every float parameter's value (its local tensor, row-major) as f32, by id.
fn param_values<B: AutodiffBackend + ModelBackend>(
    chunks: &[GptModel<B>],
) -> HashMap<ParamId, Vec<f32>> {
    struct Collect(HashMap<ParamId, Vec<f32>>);
    impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let data = param.val().into_data().convert::<f32>();
            if let Ok(values) = data.into_vec::<f32>() {
                self.0.insert(param.id, values);
            }
        }
    }
    let mut collect = Collect(HashMap::new());
    for chunk in chunks {
        chunk.visit(&mut collect);
    }
    collect.0
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
