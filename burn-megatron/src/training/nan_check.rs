//! `--check-for-nan-in-loss-and-grad`: a NaN or an infinity stops the run before anything of
//! its iteration is saved.
//!
//! - [`check_step_values`]: the loss and gradient norm a loop has read anyway (pretrain's
//!   loop reads both every iteration for its log), so the check costs no device sync.
//! - [`StepFlag`]: for a loop that does not read them (the Learner's), the first non-finite
//!   step recorded on the device with no sync; read where a sync is due anyway (before a
//!   save, at the end of the run).
//! - [`check_finite_parameters`]: every parameter of every rank, before a checkpoint is saved
//!   and at the end of the run: one all-reduce and one host read.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor};
use burn_megatron_dist::{DistBackend, ParallelState, ReduceOp};

use crate::error::{DeviceError, NonFiniteValue, Result, TrainingError, read_data};

/// Errors unless `loss` and `grad_norm` (when given; `None` where an overflow is expected,
/// as under fp16's loss scaler) are finite: iteration `iteration` (1 for the first step), as
/// seen on `rank`.
pub(crate) fn check_step_values(
    iteration: u64,
    rank: usize,
    loss: f64,
    grad_norm: Option<f64>,
) -> Result<()> {
    let value = if !loss.is_finite() {
        NonFiniteValue::Loss(loss)
    } else {
        match grad_norm {
            Some(norm) if !norm.is_finite() => NonFiniteValue::GradNorm(norm),
            _ => return Ok(()),
        }
    };
    Err(TrainingError::NonFinite {
        iteration,
        rank,
        value,
    }
    .into())
}

/// The first step whose loss or gradient norm was not finite, kept on the device: a few
/// tiny device operations per step and no host read until [`check`](Self::check).
pub(crate) struct StepFlag<B: Backend> {
    /// `[3]` f32: the iteration (0 while every step was finite), its loss and gradient norm.
    record: Option<Tensor<B, 1>>,
}

impl<B: Backend> StepFlag<B> {
    pub(crate) fn new() -> Self {
        Self { record: None }
    }

    /// Records step `iteration` (from 1) if it is the first non-finite one. `grad_norm` is
    /// `None` where an overflow is expected (fp16's loss scaler skips that step).
    pub(crate) fn observe(
        &mut self,
        iteration: u64,
        loss: &Tensor<B, 1>,
        grad_norm: Option<&Tensor<B, 1>>,
    ) {
        let device = loss.device();
        let loss = loss.clone().cast(DType::F32);
        let mut bad = loss.clone().is_finite().bool_not();
        let norm = match grad_norm {
            Some(norm) => {
                let norm = norm.clone().cast(DType::F32);
                bad = bad.bool_or(norm.clone().is_finite().bool_not());
                norm
            }
            None => Tensor::zeros([1], (&device, DType::F32)),
        };
        let step = Tensor::full([1], iteration as f32, (&device, DType::F32));
        let current = Tensor::cat(vec![step, loss, norm], 0);
        let record = self
            .record
            .take()
            .unwrap_or_else(|| Tensor::zeros([3], (&device, DType::F32)));
        let first = record.clone().slice(0..1).equal_elem(0.0);
        let take = bad.bool_and(first).expand([3]);
        self.record = Some(record.mask_where(take, current));
    }

    /// Errors with the first non-finite step recorded, as seen on `rank`: one host read.
    pub(crate) fn check(&self, rank: usize) -> Result<()> {
        let Some(record) = &self.record else {
            return Ok(());
        };
        let values = read_f32(record.clone(), rank, "the non-finite step flag")?;
        let [iteration, loss, norm] = [0, 1, 2].map(|i| values.get(i).copied().unwrap_or(0.0));
        if iteration == 0.0 {
            return Ok(());
        }
        let value = match loss.is_finite() {
            false => NonFiniteValue::Loss(loss as f64),
            true => NonFiniteValue::GradNorm(norm as f64),
        };
        Err(TrainingError::NonFinite {
            iteration: iteration as u64,
            rank,
            value,
        }
        .into())
    }
}

/// A `[n]` tensor's values as f32, one host read; a device error is a
/// [`DeviceError`](crate::error::DeviceError) naming `what` and `rank`.
pub(crate) fn read_f32<B: Backend>(
    tensor: Tensor<B, 1>,
    rank: usize,
    what: &str,
) -> Result<Vec<f32>> {
    let data =
        read_data(tensor.cast(DType::F32), || what.to_string()).map_err(|e| e.on_rank(rank))?;
    data.convert::<f32>().to_vec::<f32>().map_err(|e| {
        DeviceError {
            rank: Some(rank),
            what: what.to_string(),
            message: format!("{e:?}"),
        }
        .into()
    })
}

/// Checks that every parameter of `model`, on every rank of `state`'s world, is finite after
/// iteration `iteration`; every rank of the world must call it. One all-reduce (the lowest
/// rank holding a non-finite value) and one host read: call it where a sync is due anyway,
/// before a checkpoint is saved (so that no checkpoint holds a NaN) and at the end of a run.
///
/// The error ([`TrainingError::NonFinite`] with [`NonFiniteValue::Parameter`]) is the same
/// on every rank: it names the iteration and the lowest rank holding a non-finite parameter;
/// that rank's error also names the parameter.
///
/// A model without parameters still joins the collective, on the backend's default device
/// (`pretrain_gpt`'s loop checks a rank's chunks together, on the rank's device).
pub fn check_finite_parameters<B, M>(state: &ParallelState, model: &M, iteration: u64) -> Result<()>
where
    B: AutodiffBackend,
    B::InnerBackend: DistBackend,
    M: Module<B>,
{
    let device = model.devices().into_iter().next().unwrap_or_default();
    check_finite_chunks(state, core::slice::from_ref(model), &device, iteration)
}

/// [`check_finite_parameters`] of a rank's model chunks in one collective; a path names its
/// chunk (`chunk 1: block.layers.0.…`) where there are several. A chunk may hold no
/// parameters (an interleaved stage of no layers); the collective runs on `device` then.
pub(crate) fn check_finite_chunks<B, M>(
    state: &ParallelState,
    chunks: &[M],
    device: &B::Device,
    iteration: u64,
) -> Result<()>
where
    B: AutodiffBackend,
    B::InnerBackend: DistBackend,
    M: Module<B>,
{
    let mut flags = Flags::<B> {
        path: Vec::new(),
        flags: Vec::new(),
    };
    for (index, chunk) in chunks.iter().enumerate() {
        if chunks.len() > 1 {
            flags.path = vec![format!("chunk {index}:")];
        }
        chunk.visit(&mut flags);
    }
    let world = state.world();
    let rank = world.rank();
    let device = device.clone();
    let local: Vec<Tensor<B::InnerBackend, 1>> =
        flags.flags.iter().map(|(_, f)| f.clone()).collect();
    let local = match local.is_empty() {
        true => Tensor::<B::InnerBackend, 1>::zeros([1], (&device, DType::F32)),
        false => Tensor::cat(local, 0),
    };
    // The lowest rank holding a non-finite parameter (the world size if none): each rank
    // offers its own number, or the world size, and the minimum wins.
    let size = world.size() as f32;
    let mine = local
        .clone()
        .max()
        .greater_elem(0.0)
        .float()
        .mul_scalar(rank as f32 - size)
        .add_scalar(size);
    let lowest = world.all_reduce(mine, ReduceOp::Min)?;
    let values = read_f32(
        Tensor::cat(vec![lowest, local], 0),
        rank,
        "the parameters' finiteness flags",
    )?;
    let lowest = values.first().copied().unwrap_or(size);
    if lowest >= size {
        return Ok(());
    }
    let on_rank = lowest as usize;
    let path = match on_rank == rank {
        true => values[1..]
            .iter()
            .zip(&flags.flags)
            .find(|(bad, _)| **bad > 0.0)
            .map(|(_, (path, _))| path.clone()),
        false => None,
    };
    Err(TrainingError::NonFinite {
        iteration,
        rank,
        value: NonFiniteValue::Parameter { on_rank, path },
    }
    .into())
}

/// Each float parameter's path and a `[1]` f32 flag: 1 where it holds a NaN or an infinity.
struct Flags<B: AutodiffBackend> {
    path: Vec<String>,
    flags: Vec<(String, Tensor<B::InnerBackend, 1>)>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Flags<B> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val().inner();
        let bad = value.is_finite().bool_not().any().float().cast(DType::F32);
        self.flags.push((self.path.join("."), bad));
    }
}
