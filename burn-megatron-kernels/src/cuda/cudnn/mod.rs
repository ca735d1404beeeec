//! cuDNN through its backend (graph) API, as foreign operations in stream order: the fused
//! flash-attention engines.

pub mod attention;
mod graph;
