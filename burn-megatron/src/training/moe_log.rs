//! The MoE part of the iteration log: the auxiliary losses and how evenly the experts were
//! loaded, reduced over the ranks at the logged iterations only.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_megatron_dist::{DistBackend, ParallelState, ReduceOp};

use crate::error::Result;
use crate::pipeline_parallel::MoeStepStats;

/// What the MoE layers did in one step, over the whole model and every rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeReport {
    /// The load-balancing losses of every MoE layer, summed over the layers, coefficient
    /// included (the term added to the loss), averaged over DP and the microbatches (under
    /// CP, each CP rank's share summed).
    pub load_balancing_loss: f64,
    /// The z-losses, as `load_balancing_loss`.
    pub z_loss: f64,
    /// The least-loaded expert of any MoE layer: its tokens (over every DP × CP rank and
    /// microbatch of the step) over the layer's mean per expert; 1 is a perfect balance, 0 an
    /// expert that got no token.
    pub expert_load_min: f64,
    /// The most-loaded expert of any MoE layer, as `expert_load_min`.
    pub expert_load_max: f64,
    /// The token assignments (token × expert choices) of the step's MoE layers, over every
    /// layer, microbatch and DP × CP rank: those kept plus those dropped.
    pub assignments: f64,
    /// How many of those over-full experts dropped; `None` for dropless layers (no
    /// `--moe-expert-capacity-factor`).
    pub dropped_assignments: Option<f64>,
}

impl MoeReport {
    /// The report from [`moe_report`]'s values read to the host; `drops`: whether the layers
    /// have a capacity (the dropped assignments are reported). A missing value is NaN.
    pub(crate) fn from_values(values: &[f32], drops: bool) -> Self {
        let value = |i: usize| values.get(i).map_or(f64::NAN, |&v| v as f64);
        Self {
            load_balancing_loss: value(0),
            z_loss: value(1),
            expert_load_min: value(2),
            expert_load_max: value(3),
            assignments: value(4),
            dropped_assignments: drops.then(|| value(5)),
        }
    }
}

/// `[6]` f32 on every rank: the report's values in field order (the dropped assignments
/// always counted). Every rank of the world must call it at the same iterations; `stats` is
/// `None` on a pipeline stage without MoE layers.
pub(crate) fn moe_report<B: DistBackend>(
    state: &ParallelState,
    stats: Option<MoeStepStats<B>>,
    device: &B::Device,
) -> Result<Tensor<B, 1>> {
    let scalar =
        |v: f32| Tensor::<B, 1>::from_data(TensorData::new(vec![v], [1]), (device, DType::F32));
    let (losses, min, max, counts) = match stats {
        Some(stats) => {
            let losses = Tensor::cat(
                vec![
                    stats.load_balancing_loss.cast(DType::F32),
                    stats.z_loss.cast(DType::F32),
                ],
                0,
            );
            // Each CP rank holds its share of its DP rank's losses: summed over CP, averaged
            // over DP.
            let losses = state
                .dp_cp()
                .all_reduce(losses, ReduceOp::Avg)?
                .mul_scalar(state.cp().size() as f64);
            let kept: usize = stats.tokens_per_expert.iter().flat_map(|(_, c)| c).sum();
            let assignments = [(kept + stats.dropped) as f32, stats.dropped as f32];
            let assignments = state.dp_cp().all_reduce(
                Tensor::<B, 1>::from_data(
                    TensorData::new(assignments.to_vec(), [2]),
                    (device, DType::F32),
                ),
                ReduceOp::Sum,
            )?;
            let layers = stats.tokens_per_expert.len();
            let experts = stats.tokens_per_expert.first().map_or(1, |(_, c)| c.len());
            let counts: Vec<f32> = stats
                .tokens_per_expert
                .iter()
                .flat_map(|(_, c)| c.iter().map(|&n| n as f32))
                .collect();
            let counts = Tensor::<B, 1>::from_data(
                TensorData::new(counts, [layers * experts]),
                (device, DType::F32),
            );
            let counts = state
                .dp_cp()
                .all_reduce(counts, ReduceOp::Sum)?
                .reshape([layers, experts]);
            let mean = counts.clone().mean_dim(1).clamp_min(f32::MIN_POSITIVE);
            let load = counts / mean;
            (
                losses,
                load.clone().min().reshape([1]),
                load.max().reshape([1]),
                assignments,
            )
        }
        None => (
            Tensor::zeros([2], (device, DType::F32)),
            scalar(f32::MAX),
            scalar(f32::MIN),
            Tensor::zeros([2], (device, DType::F32)),
        ),
    };
    let pp = state.pp();
    Ok(Tensor::cat(
        vec![
            pp.all_reduce(losses, ReduceOp::Sum)?,
            pp.all_reduce(min, ReduceOp::Min)?,
            pp.all_reduce(max, ReduceOp::Max)?,
            pp.all_reduce(counts, ReduceOp::Sum)?,
        ],
        0,
    ))
}

/// Each MoE layer's tokens per expert over the step's microbatches and every DP × CP rank
/// (global layer index, `[num_experts]` f32 counts on the device, on the model's backend
/// `B`): what the expert-bias update needs. The counts go up from the host (the dispatcher
/// read them) and are summed on the device; nothing is read back. Every rank of this stage's
/// DP × CP group must call it.
pub(crate) fn global_expert_load<B: AutodiffBackend>(
    state: &ParallelState,
    stats: &MoeStepStats<B::InnerBackend>,
    device: &Device<B::InnerBackend>,
) -> Result<Vec<(usize, Tensor<B, 1>)>>
where
    B::InnerBackend: DistBackend,
{
    let counts: Vec<f32> = stats
        .tokens_per_expert
        .iter()
        .flat_map(|(_, c)| c.iter().map(|&n| n as f32))
        .collect();
    let len = counts.len();
    let counts = Tensor::<B::InnerBackend, 1>::from_data(
        TensorData::new(counts, [len]),
        (device, DType::F32),
    );
    let counts = Tensor::<B, 1>::from_inner(state.dp_cp().all_reduce(counts, ReduceOp::Sum)?);
    let mut at = 0;
    Ok(stats
        .tokens_per_expert
        .iter()
        .map(|(layer, c)| {
            let layer_counts = counts.clone().narrow(0, at, c.len());
            at += c.len();
            (*layer, layer_counts)
        })
        .collect())
}
