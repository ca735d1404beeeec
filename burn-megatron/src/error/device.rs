//! A value the host could not read from the device.
//!
//! Burn's `into_data`, `to_data` and `into_scalar` panic when the device reports an error; the
//! library reads through [`read_data`] and [`read_scalar`] instead, which return a
//! [`DeviceError`] naming what was read and why.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::{Backend, ExecutionError};
use burn::tensor::{BasicOps, Element, Tensor, TensorData};

/// Reading a tensor to the host failed: the device reported an error, often one deferred from
/// an earlier operation that this read is the first to wait for (on a GPU: a token id outside
/// the vocabulary, a collective that the NCCL watchdog aborted because a peer died).
///
/// The message names the rank, when the reader knows it, and the value: "rank 3: reading
/// parameter `block.layers.3.mlp.fc1.weight` for the checkpoint at iteration 40: device error:
/// …".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}reading {what}: device error: {message}", rank_prefix(*.rank))]
pub struct DeviceError {
    /// The global rank that read, where the reader knows it.
    pub rank: Option<usize>,
    /// What was read, and for what (e.g. "the step's loss and gradient norm").
    pub what: String,
    /// The backend's error.
    pub message: String,
}

fn rank_prefix(rank: Option<usize>) -> String {
    rank.map(|r| format!("rank {r}: ")).unwrap_or_default()
}

impl DeviceError {
    /// The error of reading `what`, from the backend's `error`.
    pub fn new(what: impl Into<String>, error: &ExecutionError) -> Self {
        let message = match error {
            ExecutionError::WithContext { reason } | ExecutionError::Generic { reason, .. } => {
                reason.trim().to_string()
            }
        };
        Self {
            rank: None,
            what: what.into(),
            message,
        }
    }

    /// The same error, read by global rank `rank`.
    pub fn on_rank(mut self, rank: usize) -> Self {
        self.rank = Some(rank);
        self
    }
}

/// `tensor`'s values on the host. A device error is a [`DeviceError`] naming `what()` (called
/// only then, so that building the name costs nothing on success).
pub(crate) fn read_data<B, const D: usize, K>(
    tensor: Tensor<B, D, K>,
    what: impl FnOnce() -> String,
) -> Result<TensorData, DeviceError>
where
    B: Backend,
    K: BasicOps<B>,
    K::Elem: Element,
{
    tensor
        .try_into_data()
        .map_err(|e| DeviceError::new(what(), &e))
}

/// `tensor`, made the sole owner of its buffer where that makes reading it faster. NdArray's
/// `into_data` hands over a tensor's buffer as it is when nothing else holds it, and copies
/// it element by element through its n-dimensional iterator when something does, as the
/// module always holds a parameter's value and the optimizer its buffers: that copy took
/// most of a checkpoint save on the CPU. Multiplying by one (exact for every value) makes a
/// vectorised copy that the read then takes over. Other backends read the tensor as it is.
pub(crate) fn unshared<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Tensor<B, D> {
    match B::name(&tensor.device()).contains("ndarray") {
        true => tensor.detach().mul_scalar(1.0),
        false => tensor,
    }
}

/// The value of the one-element `tensor` on the host. A device error is a [`DeviceError`]
/// naming `what()`.
pub(crate) fn read_scalar<B, const D: usize, K>(
    tensor: Tensor<B, D, K>,
    what: impl FnOnce() -> String,
) -> Result<K::Elem, DeviceError>
where
    B: Backend,
    K: BasicOps<B>,
    K::Elem: Element,
{
    tensor
        .try_into_scalar()
        .map_err(|e| DeviceError::new(what(), &e))
}

/// Every float parameter of `module` on the host, by id, in visiting order. A device error
/// names the first parameter that failed (on a device, the first of the batch whose read
/// failed), as `` parameter `{name(path)}` {purpose} ``: `name` turns its path in `module`
/// (`layers.3.mlp.fc1.weight`) into the one to show (a model chunk's path in the whole model,
/// say). The parameters after a failure are not read.
///
/// On a device the parameters are read in batches of up to [`READ_BATCH_BYTES`]: each batch's
/// parameters (consecutive, of one dtype) are concatenated on the device and read in one copy,
/// then cut apart on the host. A read per parameter waits for the device each time: on a GPU
/// the hundreds of small waits of a model took most of a checkpoint's blocking time. On the
/// CPU each parameter is read as it is (see [`unshared`]).
pub(crate) fn read_params<B: Backend, M: Module<B>>(
    module: &M,
    name: impl Fn(&str) -> String,
    purpose: &str,
) -> Result<Vec<(ParamId, TensorData)>, DeviceError> {
    let params = flat_params(module);
    let batched = params
        .first()
        .is_some_and(|p| !B::name(&p.value.device()).contains("ndarray"));
    read_flat_params(params, name, purpose, batched.then_some(READ_BATCH_BYTES))
}

/// [`read_params`] of `params`, in batches of up to `batch_bytes` (`None`: one by one).
fn read_flat_params<B: Backend>(
    params: Vec<FlatParam<B>>,
    name: impl Fn(&str) -> String,
    purpose: &str,
    batch_bytes: Option<usize>,
) -> Result<Vec<(ParamId, TensorData)>, DeviceError> {
    let failed = |path: &str, e: &ExecutionError| {
        DeviceError::new(format!("parameter `{}` {purpose}", name(path)), e)
    };
    let mut out = Vec::with_capacity(params.len());
    let Some(batch_bytes) = batch_bytes else {
        for p in params {
            let mut data = unshared(p.value)
                .try_into_data()
                .map_err(|e| failed(&p.path, &e))?;
            data.shape = p.shape.into();
            out.push((p.id, data));
        }
        return Ok(out);
    };
    let mut params = params.into_iter().peekable();
    while let Some(first) = params.next() {
        let dtype = first.value.dtype();
        let mut bytes = first.bytes();
        let mut batch = vec![first];
        while let Some(next) =
            params.next_if(|p| p.value.dtype() == dtype && bytes + p.bytes() <= batch_bytes)
        {
            bytes += next.bytes();
            batch.push(next);
        }
        let values = batch.iter().map(|p| p.value.clone()).collect::<Vec<_>>();
        let data = match values.len() {
            1 => values.into_iter().next().expect("one value"),
            _ => Tensor::cat(values, 0),
        }
        .try_into_data()
        .map_err(|e| failed(&batch[0].path, &e))?;
        let all = data.as_bytes();
        let mut start = 0;
        for p in batch {
            let end = start + p.bytes();
            out.push((
                p.id,
                TensorData::from_bytes_vec(all[start..end].to_vec(), p.shape, dtype),
            ));
            start = end;
        }
    }
    Ok(out)
}

/// The most bytes [`read_params`] concatenates on the device for one read (the extra memory
/// a read takes).
pub(crate) const READ_BATCH_BYTES: usize = 256 << 20;

/// A float parameter flattened, with its id, its path in the module and its shape.
struct FlatParam<B: Backend> {
    id: ParamId,
    path: String,
    shape: Vec<usize>,
    value: Tensor<B, 1>,
}

impl<B: Backend> FlatParam<B> {
    fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.value.dtype().size()
    }
}

/// Every float parameter of `module`, flattened (a view: no copy of a contiguous value), in
/// visiting order.
fn flat_params<B: Backend, M: Module<B>>(module: &M) -> Vec<FlatParam<B>> {
    struct Collect<B: Backend> {
        path: Vec<String>,
        out: Vec<FlatParam<B>>,
    }
    impl<B: Backend> ModuleVisitor<B> for Collect<B> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val();
            let shape = value.dims().to_vec();
            self.out.push(FlatParam {
                id: param.id,
                path: self.path.join("."),
                value: value.reshape([shape.iter().product::<usize>()]),
                shape,
            });
        }
    }
    let mut collect = Collect {
        path: Vec::new(),
        out: Vec::new(),
    };
    module.visit(&mut collect);
    collect.out
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    #[test]
    fn names_the_rank_the_value_and_the_backend_reason() {
        let backend = ExecutionError::WithContext {
            reason: "CUDA_ERROR_ILLEGAL_ADDRESS\n".into(),
        };
        let error = DeviceError::new(
            "parameter `block.layers.3.mlp.fc1.weight` for the checkpoint at iteration 40",
            &backend,
        );
        assert_eq!(
            error.to_string(),
            "reading parameter `block.layers.3.mlp.fc1.weight` for the checkpoint at iteration \
             40: device error: CUDA_ERROR_ILLEGAL_ADDRESS"
        );
        assert_eq!(
            error.on_rank(3).to_string(),
            "rank 3: reading parameter `block.layers.3.mlp.fc1.weight` for the checkpoint at \
             iteration 40: device error: CUDA_ERROR_ILLEGAL_ADDRESS"
        );
        let generic = ExecutionError::Generic {
            reason: "watchdog abort".into(),
            backtrace: Default::default(),
        };
        assert_eq!(
            DeviceError::new("the loss", &generic).message,
            "watchdog abort"
        );
    }

    #[test]
    fn reaches_the_crate_error_as_it_is() {
        let backend = ExecutionError::WithContext {
            reason: "an id check failed: token id 70000 is outside the vocabulary".into(),
        };
        let error = DeviceError::new("the step's loss and gradient norm", &backend).on_rank(1);
        let message = error.to_string();
        let error: crate::Error = error.into();
        assert!(matches!(&error, crate::Error::Device(e) if e.rank == Some(1)));
        assert_eq!(error.to_string(), message);
    }

    #[test]
    fn reads_without_naming_on_success() {
        let t = Tensor::<NdArray, 1>::from_floats([1.5, 2.5], &Default::default());
        let data = read_data(t.clone(), || unreachable!("named only on failure")).unwrap();
        assert_eq!(data.to_vec::<f32>().unwrap(), vec![1.5, 2.5]);
        let sum: f32 = read_scalar(t.sum(), || unreachable!()).unwrap();
        assert_eq!(sum, 4.0);
    }

    /// Reading in batches (consecutive parameters of one dtype concatenated, cut apart on the
    /// host) gives every parameter's bytes, shape and dtype as reading them one by one: batches
    /// of several parameters, a parameter larger than the batch, and a dtype change that starts
    /// a new batch.
    #[test]
    fn batched_reads_equal_reads_one_by_one() {
        use burn::module::Param;
        use burn::tensor::DType;
        type B = NdArray;
        #[derive(Module, Debug)]
        struct Three<B: Backend> {
            a: Param<Tensor<B, 2>>,
            b: Param<Tensor<B, 1>>,
            c: Param<Tensor<B, 3>>,
            d: Param<Tensor<B, 2>>,
        }
        let device = Default::default();
        let ramp = |n: usize, shift: f32| {
            Tensor::<B, 1>::from_floats(
                (0..n)
                    .map(|i| i as f32 * 0.37 + shift)
                    .collect::<Vec<_>>()
                    .as_slice(),
                &device,
            )
        };
        let module = Three {
            a: Param::from_tensor(ramp(12, 1.0).reshape([3, 4])),
            b: Param::from_tensor(ramp(5, -2.0)),
            c: Param::from_tensor(ramp(60, 0.5).reshape([3, 4, 5])),
            d: Param::from_tensor(ramp(6, 3.0).reshape([2, 3]).cast(DType::F64)),
        };
        let name = |p: &str| p.to_string();
        let one_by_one = read_flat_params(flat_params(&module), name, "", None).unwrap();
        // 80 bytes: `a` and `b` in one batch, `c` (240 bytes) alone, `d` (f64) alone.
        let batched = read_flat_params(flat_params(&module), name, "", Some(80)).unwrap();
        assert_eq!(one_by_one.len(), 4);
        assert_eq!(batched.len(), 4);
        for ((id_a, a), (id_b, b)) in one_by_one.iter().zip(&batched) {
            assert_eq!(id_a, id_b);
            assert_eq!(a.shape, b.shape);
            assert_eq!(a.dtype, b.dtype);
            assert_eq!(a.as_bytes(), b.as_bytes());
        }
        assert_eq!(batched[2].1.shape, vec![3, 4, 5].into());
        assert_eq!(batched[3].1.dtype, DType::F64);
    }
}
