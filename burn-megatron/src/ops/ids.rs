//! Checks that token and target ids fit the vocabulary before a forward pass uses them.
//!
//! A gather with an id past the table reads other memory on a GPU (or panics on the CPU), so
//! every id is checked. Reading ids back to the host costs a sync per step on a GPU; our CUDA
//! backend checks them on the device instead and reports a bad id at the device's next read or
//! sync (`burn_megatron_kernels::cuda::device_check`).

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;

use crate::error::{IdKind, Result, check_ids_on_host, read_data};

/// Checking ids against a vocabulary.
pub trait IdCheckOps: Backend {
    /// Checks that every id of `ids` is a valid `kind` id for a vocabulary of `vocab_size`
    /// tokens.
    ///
    /// By default the ids are read back to the host (free on the CPU): a bad id is an
    /// [`InputError`](crate::InputError), a failed read a
    /// [`DeviceError`](crate::error::DeviceError). Our CUDA backend checks them on the device
    /// instead and returns `Ok` at once: an invalid id fails the device's next read or sync
    /// with the same message, so a training step never waits.
    fn check_ids<const D: usize>(
        ids: Tensor<Self, D, Int>,
        kind: IdKind,
        vocab_size: usize,
    ) -> Result<()> {
        let ids = read_data(ids, || format!("the {kind} ids to check them"))?;
        Ok(check_ids_on_host(&ids, kind, vocab_size)?)
    }
}

/// The inner backend's check (ids carry no gradient).
impl<B: IdCheckOps, C: CheckpointStrategy> IdCheckOps for Autodiff<B, C> {
    fn check_ids<const D: usize>(
        ids: Tensor<Self, D, Int>,
        kind: IdKind,
        vocab_size: usize,
    ) -> Result<()> {
        B::check_ids::<D>(
            Tensor::from_primitive(ids.into_primitive()),
            kind,
            vocab_size,
        )
    }
}

/// Our CUDA backend checks on the device; burn-cuda reads the ids back.
#[cfg(feature = "cuda")]
mod cuda {
    use burn::tensor::{Int, Tensor};
    use burn_cubecl::cubecl::cuda::CudaRuntime;
    use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
    use burn_megatron_kernels::cuda::{MegatronCudaRuntime, check_on_device};

    use super::IdCheckOps;
    use crate::error::{IdKind, InputError};

    impl<F: FloatElement, I: IntElement, BT: BoolElement> IdCheckOps
        for CubeBackend<MegatronCudaRuntime, F, I, BT>
    {
        /// On the device: the smallest and largest id are computed there and checked at the
        /// device's next read or sync (see `burn_megatron_kernels::cuda::device_check`).
        fn check_ids<const D: usize>(
            ids: Tensor<Self, D, Int>,
            kind: IdKind,
            vocab_size: usize,
        ) -> crate::error::Result<()> {
            if ids.shape().num_elements() == 0 {
                return Ok(());
            }
            let ids = ids.flatten::<1>(0, D - 1);
            let extremes = Tensor::cat(vec![ids.clone().min(), ids.max()], 0);
            check_on_device(extremes.into_primitive(), move |values| {
                let &[min, max] = values else {
                    return Some(format!("an id check read {} values, not 2", values.len()));
                };
                [max, min]
                    .into_iter()
                    .find(|&id| !kind.accepts(id, vocab_size))
                    .map(|id| {
                        InputError::IdOutOfRange {
                            kind,
                            id,
                            vocab_size,
                        }
                        .to_string()
                    })
            });
            Ok(())
        }
    }

    impl<F: FloatElement, I: IntElement, BT: BoolElement> IdCheckOps
        for CubeBackend<CudaRuntime, F, I, BT>
    {
    }
}

/// wgpu: the ids read back.
#[cfg(feature = "wgpu")]
impl<F, I, BT> IdCheckOps for burn_cubecl::CubeBackend<burn::backend::wgpu::WgpuRuntime, F, I, BT>
where
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
}
