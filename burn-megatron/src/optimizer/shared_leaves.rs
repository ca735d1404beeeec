//! Refusing parameters shared between thread ranks.
//!
//! Thread ranks that clone one model share its parameters' autodiff leaves. burn-autodiff
//! then merges the ranks' graphs into one, and its locks deadlock when one rank's backward
//! pass cleans up while another records its forward pass (book: "Burn's autodiff and thread ranks"): a hang
//! with no message, about once in fifteen steps. The optimizer's setup checks instead that
//! no two ranks of one process hold the same leaf, and says what to do.

use std::collections::HashSet;
use std::hash::{BuildHasher, RandomState};
use std::sync::OnceLock;

use burn::backend::NdArray;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{DType, Tensor, TensorData};
use burn_megatron_dist::ProcessGroup;

use crate::backend::ModelBackend;
use crate::error::ConfigError;

/// A number drawn once per process: ranks that report the same one are threads of one
/// process (node ids are numbered per process). 52 random bits, exact in f64.
fn process_token() -> f64 {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    let token =
        *TOKEN.get_or_init(|| RandomState::new().hash_one(std::process::id()) & ((1 << 52) - 1));
    token as f64
}

/// The autodiff leaves of `model`'s parameters that require gradients.
fn leaves<B: ModelBackend, M: Module<B>>(model: &M) -> Vec<u64> {
    struct Leaves(Vec<u64>);
    impl<B: ModelBackend> ModuleVisitor<B> for Leaves {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if param.is_require_grad()
                && let Some(id) = B::autodiff_node(&param.val().into_primitive().tensor())
            {
                self.0.push(id);
            }
        }
    }
    let mut leaves = Leaves(Vec::new());
    model.visit(&mut leaves);
    leaves.0
}

/// Fails, naming the ranks, when this rank's `model` shares an autodiff leaf with another
/// rank of `world` in the same process. Every rank of `world` must call it (two host
/// all-gathers of a few numbers).
pub(crate) fn refuse_shared_leaves<B: ModelBackend, M: Module<B>>(
    model: &M,
    world: &ProcessGroup,
) -> crate::Result<()> {
    if world.size() == 1 {
        return Ok(());
    }
    let token = process_token();
    let mine = leaves::<B, M>(model);
    let host = |values: Vec<f64>| {
        let len = values.len();
        Tensor::<NdArray, 1>::from_data(
            TensorData::new(values, [len]),
            (&Default::default(), DType::F64),
        )
    };
    let read = |t: Tensor<NdArray, 1>| {
        t.into_data().to_vec::<f64>().map_err(|e| {
            ConfigError::Invalid(format!(
                "the ranks' parameter leaves could not be read: {e:?}"
            ))
        })
    };
    let header = read(world.all_gather(host(vec![token, mine.len() as f64]), 0)?)?;
    // The token first, so that no rank sends an empty tensor.
    let mut body = vec![token];
    body.extend(mine.iter().map(|&id| id as f64));
    let bodies = read(world.all_gather(host(body), 0)?)?;
    let mine: HashSet<u64> = mine.into_iter().collect();
    let me = world.rank();
    let mut start = 0;
    for (rank, pair) in header.chunks(2).enumerate() {
        let len = pair[1] as usize;
        let theirs = &bodies[start + 1..start + 1 + len];
        start += 1 + len;
        if rank == me || pair[0] != token {
            continue;
        }
        if theirs.iter().any(|&id| mine.contains(&(id as u64))) {
            return Err(ConfigError::Invalid(format!(
                "ranks {} and {} (threads of one process) share parameters: their models are \
                 clones of one model, whose autodiff leaves they share. burn-autodiff would \
                 merge their graphs and can deadlock. Build each rank's model on its rank, or \
                 give each rank its own leaves with `model.fork(&device)`",
                world.ranks()[me],
                world.ranks()[rank]
            ))
            .into());
        }
    }
    Ok(())
}
