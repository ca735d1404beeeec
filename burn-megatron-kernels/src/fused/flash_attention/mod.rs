//! Flash attention (work in progress: the portable kernel and the public API land next).

pub mod tensor_core;
