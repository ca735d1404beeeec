//! Writing a gradient into its slot of the flat fp32 gradient buffer (Megatron's
//! `ParamAndGradBuffer`): a cast and a copy, in place and in one kernel on CubeCL backends.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;

/// Writing into a flat buffer.
pub trait WriteSlotOps: Backend {
    /// `buffer` (`[numel]` f32) with `values` (`[n]`, any float dtype) cast to f32 written at
    /// `start..start + n`: how each gradient enters the flat fp32 gradient buffer. CubeCL
    /// backends write in place, in one kernel, when nothing else holds `buffer`.
    fn write_slot(
        buffer: Tensor<Self, 1>,
        start: usize,
        values: Tensor<Self, 1>,
    ) -> Tensor<Self, 1> {
        write_slot_composition(buffer, start, values)
    }

    /// `buffer` (`[numel]` f32) with `values` (`[n]`, any float dtype) cast to f32 added at
    /// `start..start + n`: a later microbatch's gradient accumulated in the flat fp32 buffer.
    /// CubeCL backends add in place, in one kernel, when nothing else holds `buffer`.
    fn add_slot(buffer: Tensor<Self, 1>, start: usize, values: Tensor<Self, 1>) -> Tensor<Self, 1> {
        add_slot_composition(buffer, start, values)
    }
}

/// `buffer` with `values` (any shape and float dtype) added row-major at its slot from
/// `start`: [`WriteSlotOps::add_slot`] of the values flattened. How the compositions of the
/// weight-gradient products that accumulate in place add a product computed apart.
pub fn add_to_slot<B: WriteSlotOps, const D: usize>(
    buffer: Tensor<B, 1>,
    start: usize,
    values: Tensor<B, D>,
) -> Tensor<B, 1> {
    let numel = values.shape().num_elements();
    B::add_slot(buffer, start, values.reshape([numel]))
}

/// [`WriteSlotOps::write_slot`] as Burn operations: a cast (unless already f32), then a
/// `slice_assign`.
pub fn write_slot_composition<B: Backend>(
    buffer: Tensor<B, 1>,
    start: usize,
    values: Tensor<B, 1>,
) -> Tensor<B, 1> {
    let n = values.dims()[0];
    let values = match values.dtype() {
        DType::F32 => values,
        _ => values.cast(DType::F32),
    };
    buffer.slice_assign(start..start + n, values)
}

/// [`WriteSlotOps::add_slot`] as Burn operations: a cast (unless already f32), a slice, the
/// sum and a `slice_assign`.
pub fn add_slot_composition<B: Backend>(
    buffer: Tensor<B, 1>,
    start: usize,
    values: Tensor<B, 1>,
) -> Tensor<B, 1> {
    let n = values.dims()[0];
    let sum = buffer.clone().slice(start..start + n) + values.cast(DType::F32);
    buffer.slice_assign(start..start + n, sum)
}

/// Buffers are written outside the graph: the composition.
impl<B: WriteSlotOps, C: CheckpointStrategy> WriteSlotOps for Autodiff<B, C> {}

/// CubeCL backends: one copy kernel, in place.
#[cfg(feature = "fused")]
mod cube {
    use burn::tensor::{DType, Tensor};
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_megatron_kernels::fused::flat_copy::{add_into, copy_into};

    use super::{WriteSlotOps, add_slot_composition, write_slot_composition};
    use crate::ops::primitive::{raw, wrap};

    /// Whether the kernel may write `buffer` in place: contiguous f32 that nothing else
    /// holds, and values of a dtype it reads.
    fn direct<R: CubeRuntime, B: burn::tensor::backend::Backend>(
        buffer: &burn_cubecl::tensor::CubeTensor<R>,
        values: &Tensor<B, 1>,
    ) -> bool {
        buffer.dtype == DType::F32
            && buffer.is_contiguous()
            && buffer.can_mut()
            && matches!(values.dtype(), DType::F32 | DType::F16 | DType::BF16)
    }

    /// `values` written into (or, with `add`, added to) `buffer`'s slot at `start` by one
    /// kernel where [`direct`] allows it, else by the composition.
    fn in_place<R, F, I, BT>(
        buffer: Tensor<CubeBackend<R, F, I, BT>, 1>,
        start: usize,
        values: Tensor<CubeBackend<R, F, I, BT>, 1>,
        add: bool,
    ) -> Tensor<CubeBackend<R, F, I, BT>, 1>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        let buffer = raw(buffer);
        match (direct(&buffer, &values), add) {
            (true, false) => copy_into(raw(values), &buffer, start),
            (true, true) => add_into(raw(values), &buffer, start),
            (false, false) => return write_slot_composition(wrap(buffer), start, values),
            (false, true) => return add_slot_composition(wrap(buffer), start, values),
        }
        wrap(buffer)
    }

    impl<R, F, I, BT> WriteSlotOps for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        /// In place, in one kernel (the composition when `buffer` is shared, not contiguous
        /// f32, or `values` are f64).
        fn write_slot(
            buffer: Tensor<Self, 1>,
            start: usize,
            values: Tensor<Self, 1>,
        ) -> Tensor<Self, 1> {
            in_place(buffer, start, values, false)
        }

        /// In place, in one kernel (the composition as for `write_slot`).
        fn add_slot(
            buffer: Tensor<Self, 1>,
            start: usize,
            values: Tensor<Self, 1>,
        ) -> Tensor<Self, 1> {
            in_place(buffer, start, values, true)
        }
    }
}
