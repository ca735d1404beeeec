//! How each parameter of a model is split over the tensor-parallel group, and gathering the
//! full parameters or gradients (used by the equivalence tests today).

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn_megatron_dist::{DistBackend, DistResult, ProcessGroup};

use crate::error::{InputError, Result};

/// How a parameter is laid out over the TP group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamShard {
    /// Every rank holds all of it.
    Replicated,
    /// Each rank holds a slice along `dim`.
    Split {
        /// The split dimension.
        dim: usize,
    },
}

/// The layout of a parameter, from the layer that holds it and the field's name.
fn shard_of(container: &str, field: &str) -> ParamShard {
    match (container.trim_start_matches("Struct:"), field) {
        ("ColumnParallelLinear", "weight") => ParamShard::Split { dim: 1 },
        ("ColumnParallelLinear", "bias") => ParamShard::Split { dim: 0 },
        ("RowParallelLinear", "weight") => ParamShard::Split { dim: 0 },
        ("VocabParallelEmbedding" | "VocabParallelOutput", "weight") => {
            ParamShard::Split { dim: 0 }
        }
        _ => ParamShard::Replicated,
    }
}

/// Tracks the path of the parameter being visited.
#[derive(Default)]
pub(crate) struct Path {
    names: Vec<(String, String)>,
}

impl Path {
    pub(crate) fn enter(&mut self, name: &str, container: &str) {
        self.names.push((name.to_string(), container.to_string()));
    }
    pub(crate) fn exit(&mut self) {
        self.names.pop();
    }
    pub(crate) fn current(&self) -> (String, ParamShard) {
        let path = self
            .names
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(".");
        let shard = match self.names.last() {
            Some((field, container)) => shard_of(container, field),
            None => ParamShard::Replicated,
        };
        (path, shard)
    }
}

/// Every float parameter of `module` with its path (`"layers.0.mlp.fc1.weight"`) and layout.
pub fn param_shards<B: Backend, M: Module<B>>(module: &M) -> Vec<(String, ParamShard)> {
    struct Collect(Path, Vec<(String, ParamShard)>);
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.0.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.exit();
        }
        fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<B, D>>) {
            self.1.push(self.0.current());
        }
    }
    let mut visitor = Collect(Path::default(), Vec::new());
    module.visit(&mut visitor);
    visitor.1
}

/// A float parameter of a module: what the optimizer needs to know to treat it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    /// Its id, the key of its gradient in [`GradientsParams`].
    pub id: ParamId,
    /// Its path in the module, e.g. `block.layers.0.mlp.fc1.weight`.
    pub path: String,
    /// Its layout over the TP group.
    pub shard: ParamShard,
    /// This rank's shape of it.
    pub shape: Vec<usize>,
}

/// Every float parameter of `module`, in visiting order, with its id, path, layout and shape.
pub fn param_infos<B: Backend, M: Module<B>>(module: &M) -> Vec<ParamInfo> {
    struct Collect(Path, Vec<ParamInfo>);
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.0.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let (path, shard) = self.0.current();
            self.1.push(ParamInfo {
                id: param.id,
                path,
                shard,
                shape: param.val().dims().to_vec(),
            });
        }
    }
    let mut visitor = Collect(Path::default(), Vec::new());
    module.visit(&mut visitor);
    visitor.1
}

fn gather<B: DistBackend, const D: usize>(
    tensor: Tensor<B, D>,
    shard: ParamShard,
    tp: &ProcessGroup,
) -> DistResult<TensorData> {
    Ok(match shard {
        ParamShard::Replicated => tensor,
        ParamShard::Split { dim } => tp.all_gather(tensor, dim)?,
    }
    .into_data())
}

/// The full value of every float parameter, gathered over the TP group, with its path.
/// Every rank of the group must call it.
pub fn gather_full_params<B: DistBackend, M: Module<B>>(
    module: &M,
    tp: &ProcessGroup,
) -> DistResult<Vec<(String, TensorData)>> {
    struct Gather<'a> {
        path: Path,
        tp: &'a ProcessGroup,
        out: DistResult<Vec<(String, TensorData)>>,
    }
    impl<B: DistBackend> ModuleVisitor<B> for Gather<'_> {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.path.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let (path, shard) = self.path.current();
            if let Ok(out) = &mut self.out {
                match gather(param.val(), shard, self.tp) {
                    Ok(data) => out.push((path, data)),
                    Err(e) => self.out = Err(e),
                }
            }
        }
    }
    let mut visitor = Gather {
        path: Path::default(),
        tp,
        out: Ok(Vec::new()),
    };
    module.visit(&mut visitor);
    visitor.out
}

/// The full gradient of every float parameter, gathered over the TP group, with its path.
/// A parameter without a gradient is an [`InputError::MissingGradient`]. Every rank of the
/// group must call it.
pub fn gather_full_grads<B, M>(
    module: &M,
    grads: &GradientsParams,
    tp: &ProcessGroup,
) -> Result<Vec<(String, TensorData)>>
where
    B: AutodiffBackend,
    B::InnerBackend: DistBackend,
    M: Module<B>,
{
    struct Gather<'a> {
        path: Path,
        tp: &'a ProcessGroup,
        grads: &'a GradientsParams,
        out: Result<Vec<(String, TensorData)>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Gather<'_>
    where
        B::InnerBackend: DistBackend,
    {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.path.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let (path, shard) = self.path.current();
            let Ok(out) = &mut self.out else { return };
            let result = self
                .grads
                .get::<B::InnerBackend, D>(param.id)
                .ok_or_else(|| InputError::MissingGradient { path: path.clone() }.into())
                .and_then(|grad| Ok(gather(grad, shard, self.tp)?));
            match result {
                Ok(data) => out.push((path, data)),
                Err(e) => self.out = Err(e),
            }
        }
    }
    let mut visitor = Gather {
        path: Path::default(),
        tp,
        grads,
        out: Ok(Vec::new()),
    };
    Module::<B>::visit(module, &mut visitor);
    visitor.out
}
