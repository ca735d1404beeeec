//! The backend and the deterministic inputs every file shares.

use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use burn_cubecl::CubeBackend;

/// Burn's CubeCL backend on wgpu, without fusion: the backend the fused kernels run on.
pub type W = CubeBackend<WgpuRuntime, f32, i32, u32>;

/// Deterministic values in [-scale, scale).
pub fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

pub fn random_4d(
    shape: [usize; 4],
    seed: u64,
    scale: f32,
    dtype: DType,
    device: &WgpuDevice,
) -> Tensor<W, 4> {
    let n = shape.iter().product();
    Tensor::<W, 4>::from_data(TensorData::new(random(n, seed, scale), shape), device).cast(dtype)
}

pub fn poisoned(shape: [usize; 4], dtype: DType, device: &WgpuDevice) -> Tensor<W, 4> {
    Tensor::<W, 4>::full(shape, f32::NAN, device).cast(dtype)
}

pub fn raw4(t: Tensor<W, 4>) -> burn_cubecl::tensor::CubeTensor<WgpuRuntime> {
    t.into_primitive().tensor()
}

pub fn matrix(
    rows: usize,
    cols: usize,
    seed: u64,
    scale: f32,
    device: &WgpuDevice,
) -> Tensor<W, 2> {
    Tensor::<W, 2>::from_data(
        TensorData::new(random(rows * cols, seed, scale), [rows, cols]),
        device,
    )
}

pub fn vector(n: usize, seed: u64, offset: f32, device: &WgpuDevice) -> Tensor<W, 1> {
    Tensor::<W, 1>::from_data(TensorData::new(random(n, seed, 0.5), [n]), device).add_scalar(offset)
}

pub fn raw<const D: usize>(t: Tensor<W, D>) -> burn_cubecl::tensor::CubeTensor<WgpuRuntime> {
    t.into_primitive().tensor()
}

pub fn wrap<const D: usize>(t: burn_cubecl::tensor::CubeTensor<WgpuRuntime>) -> Tensor<W, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}
