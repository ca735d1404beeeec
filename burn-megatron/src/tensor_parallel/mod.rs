//! Tensor-parallel layers: Megatron's column- and row-parallel linear layers.

mod column;
mod row;

pub use column::{ColumnParallelLinear, ColumnParallelLinearConfig};
pub use row::{RowParallelLinear, RowParallelLinearConfig};
