//! Optimizer state keyed by parameter, and its conversion from and to Burn's AdamW record.
//!
//! Burn keys optimizer records by [`ParamId`], which is random per initialisation: a record
//! saved by one process means nothing to a model built by another. A checkpoint stores each
//! state tensor under its parameter's path instead (group `optimizer.<name>`), split and
//! resharded exactly like the parameter itself; [`OptimizerState`] is the bridge, keyed by the
//! ids of the model chunk at hand.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param, ParamId, list_param_ids};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::record::AdaptorRecord;
use burn::optim::{AdamW, AdamWState, AdaptiveMomentumState, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

use crate::error::{DeviceError, read_data};

/// The optimizer name AdamW's state is saved under.
pub const ADAMW: &str = "adamw";

/// One parameter's optimizer state: tensors of the parameter's local shape (or of a flat range
/// of it), and its step count.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamState {
    /// Steps taken (AdamW's bias correction uses it).
    pub step: u64,
    /// State tensors by name (`exp_avg`, `exp_avg_sq` for AdamW), each shaped like this rank's
    /// slice of the parameter, or `[range.len()]` when `range` is set.
    pub tensors: BTreeMap<String, TensorData>,
    /// `None`: the tensors cover the rank's whole slice. `Some(r)`: they hold only the
    /// elements `r` of the slice in row-major order (a distributed optimizer's shard cuts
    /// parameters at arbitrary element boundaries).
    pub range: Option<Range<usize>>,
}

/// A model chunk's optimizer state, by the ids of its parameters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OptimizerState {
    /// The optimizer (`"adamw"`).
    pub kind: String,
    /// Each parameter's state; a parameter without state (never stepped) is absent.
    pub params: HashMap<ParamId, ParamState>,
    /// Whether each data-parallel rank holds a different part of the state (the distributed
    /// optimizer): then every DP rank writes its part, else DP rank 0 writes for all.
    pub dp_sharded: bool,
}

impl OptimizerState {
    /// This state cut by model chunk: `out[i]` holds the states of `chunks[i]`'s parameters,
    /// as [`Checkpointer::save`](crate::checkpointing::Checkpointer::save) takes them. How
    /// an optimizer that steps a rank's chunks as one module (a `Vec` of them, under the
    /// interleaved schedule) saves its state.
    pub fn split_by_chunk<B: Backend, M: Module<B>>(mut self, chunks: &[M]) -> Vec<Self> {
        chunks
            .iter()
            .map(|chunk| {
                let params = list_param_ids(chunk)
                    .into_iter()
                    .filter_map(|id| self.params.remove(&id).map(|state| (id, state)))
                    .collect();
                Self {
                    kind: self.kind.clone(),
                    params,
                    dp_sharded: self.dp_sharded,
                }
            })
            .collect()
    }

    /// The union of the states of several chunks (parameter ids are unique), the inverse of
    /// [`split_by_chunk`](Self::split_by_chunk); `None` for no states.
    pub fn merge(states: Vec<Self>) -> Option<Self> {
        let mut states = states.into_iter();
        let mut out = states.next()?;
        for state in states {
            out.params.extend(state.params);
        }
        Some(out)
    }
}

/// The state of a Burn [`AdamW`] optimizer over `module` (one model chunk), by parameter,
/// read to the host. A moment that cannot be read (a device error) is a [`DeviceError`]
/// naming its parameter's path in `module`.
pub fn adamw_state<B, M>(
    module: &M,
    optimizer: &OptimizerAdaptor<AdamW, M, B>,
) -> Result<OptimizerState, DeviceError>
where
    B: AutodiffBackend,
    M: burn::module::AutodiffModule<B>,
{
    struct Collect<B: AutodiffBackend> {
        record: HashMap<ParamId, AdaptorRecord<AdamW, B>>,
        path: Vec<String>,
        out: Result<HashMap<ParamId, ParamState>, DeviceError>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<B> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Ok(out) = &mut self.out else { return };
            let Some(record) = self.record.remove(&param.id) else {
                return;
            };
            let state: AdamWState<B::InnerBackend, D> = record.into_state();
            let momentum = state.momentum;
            let path = self.path.join(".");
            let what =
                |name: &str| format!("AdamW's {name} of parameter `{path}` for a checkpoint");
            let read = read_data(momentum.moment_1, || what("exp_avg"))
                .and_then(|m1| Ok((m1, read_data(momentum.moment_2, || what("exp_avg_sq"))?)));
            let (moment_1, moment_2) = match read {
                Ok(moments) => moments,
                Err(e) => {
                    self.out = Err(e);
                    return;
                }
            };
            let tensors = BTreeMap::from([
                ("exp_avg".to_string(), moment_1),
                ("exp_avg_sq".to_string(), moment_2),
            ]);
            out.insert(
                param.id,
                ParamState {
                    step: momentum.time as u64,
                    tensors,
                    range: None,
                },
            );
        }
    }
    let mut collect = Collect::<B> {
        record: optimizer.to_record().into_iter().collect(),
        path: Vec::new(),
        out: Ok(HashMap::new()),
    };
    module.visit(&mut collect);
    Ok(OptimizerState {
        kind: ADAMW.to_string(),
        params: collect.out?,
        dp_sharded: false,
    })
}

/// Burn's AdamW record for `module` from `state` (as [`Checkpoint::load_optimizer_state`]
/// gives it), to pass to `optimizer.load_record(..)`. Tensors go to the parameters' devices.
///
/// [`Checkpoint::load_optimizer_state`]: crate::checkpointing::Checkpoint::load_optimizer_state
pub fn adamw_record<B, M>(
    module: &M,
    state: &OptimizerState,
) -> <OptimizerAdaptor<AdamW, M, B> as Optimizer<M, B>>::Record
where
    B: AutodiffBackend,
    M: burn::module::AutodiffModule<B>,
{
    struct Build<'a, B: AutodiffBackend> {
        state: &'a OptimizerState,
        out: HashMap<ParamId, AdaptorRecord<AdamW, B>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Build<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Some(saved) = self.state.params.get(&param.id) else {
                return;
            };
            if saved.range.is_some() {
                return;
            }
            let (Some(m1), Some(m2)) = (
                saved.tensors.get("exp_avg"),
                saved.tensors.get("exp_avg_sq"),
            ) else {
                return;
            };
            let value = param.val().inner();
            let device = value.device();
            let dtype = value.dtype();
            let tensor = |data: &TensorData| {
                Tensor::<B::InnerBackend, D>::from_data(data.clone().convert_dtype(dtype), &device)
            };
            let momentum = AdaptiveMomentumState {
                time: saved.step as usize,
                moment_1: tensor(m1),
                moment_2: tensor(m2),
                max_moment_2: None,
            };
            self.out
                .insert(param.id, AdaptorRecord::from_state(AdamWState { momentum }));
        }
    }
    let mut build = Build::<B> {
        state,
        out: HashMap::new(),
    };
    module.visit(&mut build);
    build.out.into_iter().collect()
}
