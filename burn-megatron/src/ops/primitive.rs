//! Moving between Burn's tensors and the primitives that backends and kernels take.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

/// A float primitive as a tensor.
pub(crate) fn wrap<B: Backend, const D: usize>(primitive: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

/// A float tensor's primitive (on a CubeCL backend, the `CubeTensor` kernels take).
pub(crate) fn raw<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> FloatTensor<B> {
    tensor.into_primitive().tensor()
}
