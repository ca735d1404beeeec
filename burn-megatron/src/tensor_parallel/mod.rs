//! Tensor-parallel layers: Megatron's column- and row-parallel linear layers, the
//! vocabulary-parallel embedding and cross-entropy, and layout-independent dropout.

mod column;
mod cross_entropy;
mod dropout;
mod param_kind;
mod placement;
mod row;
mod sequence_parallel_grads;
mod tp_context;
mod vocab;
mod vocab_embedding;
mod vocab_output;

pub use column::{ColumnParallelLinear, ColumnParallelLinearConfig};
pub use cross_entropy::{masked_mean, vocab_parallel_cross_entropy};
pub use dropout::{DropoutSite, dropout};
pub use param_kind::ParamKind;
pub(crate) use placement::Path;
pub use placement::{
    DeclarePlacements, ExpertShard, ParamInfo, ParamPlacement, Placements, gather_full_grads,
    gather_full_params, param_infos, param_shards, try_param_infos,
};
pub use row::{RowParallelLinear, RowParallelLinearConfig};
pub use sequence_parallel_grads::sum_sequence_parallel_grads;
pub use tp_context::{SEQ_DIM, SequenceParallelGrads, TpContext};
pub use vocab::VocabPartition;
pub use vocab_embedding::VocabParallelEmbedding;
pub use vocab_output::{VocabParallelOutput, parallel_lm_logits};
