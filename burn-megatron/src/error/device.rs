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

/// A backend message that lists the errors of a failed step (CubeCL's "The server is in an
/// invalid state", with the `Debug` form of every failed operation: a hundred out-of-memory
/// errors after the first, tens of kilobytes) cut to its header, the first error's reason and
/// how many followed. Any other message is kept whole.
fn first_of_many(message: &str) -> String {
    const REASON: &str = "reason: \"";
    let Some((header, list)) = message.split_once("Caused by:") else {
        return message.to_string();
    };
    let mut reasons = list.match_indices(REASON).map(|(at, _)| {
        // The reason's `Debug` text, up to its closing quote (escaped quotes skipped).
        let text = &list[at + REASON.len()..];
        let mut end = text.len();
        let mut escaped = false;
        for (i, c) in text.char_indices() {
            match (escaped, c) {
                (false, '\\') => escaped = true,
                (false, '"') => {
                    end = i;
                    break;
                }
                _ => escaped = false,
            }
        }
        let reason = text[..end].replace("\\n", "\n");
        reason
            .replace("\nNo backtrace available", "")
            .trim()
            .to_string()
    });
    let Some(first) = reasons.next() else {
        return message.to_string();
    };
    let more = reasons.count();
    let header = header.trim().trim_end_matches(':');
    match more {
        0 => format!("{header}: {first}"),
        n => format!("{header}: {first} (and {n} more errors of the same step)"),
    }
}

fn rank_prefix(rank: Option<usize>) -> String {
    rank.map(|r| format!("rank {r}: ")).unwrap_or_default()
}

impl DeviceError {
    /// The error of reading `what`, from the backend's `error`.
    pub fn new(what: impl Into<String>, error: &ExecutionError) -> Self {
        let message = match error {
            ExecutionError::WithContext { reason } | ExecutionError::Generic { reason, .. } => {
                first_of_many(reason.trim())
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
/// names the first parameter that failed, as `` parameter `{name(path)}` {purpose} ``: `name`
/// turns its path in `module` (`layers.3.mlp.fc1.weight`) into the one to show (a model
/// chunk's path in the whole model, say). The parameters after a failure are not read.
pub(crate) fn read_params<B: Backend, M: Module<B>>(
    module: &M,
    name: impl Fn(&str) -> String,
    purpose: &str,
) -> Result<Vec<(ParamId, TensorData)>, DeviceError> {
    struct Read<F> {
        path: Vec<String>,
        name: F,
        out: Result<Vec<(ParamId, TensorData)>, DeviceError>,
        purpose: String,
    }
    impl<B: Backend, F: Fn(&str) -> String> ModuleVisitor<B> for Read<F> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Ok(out) = &mut self.out else { return };
            match unshared(param.val()).try_into_data() {
                Ok(data) => out.push((param.id, data)),
                Err(e) => {
                    let name = (self.name)(&self.path.join("."));
                    let what = format!("parameter `{name}` {}", self.purpose);
                    self.out = Err(DeviceError::new(what, &e));
                }
            }
        }
    }
    let mut read = Read {
        path: Vec::new(),
        name,
        out: Ok(Vec::new()),
        purpose: purpose.to_string(),
    };
    module.visit(&mut read);
    read.out
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

    /// CubeCL's list of a failed step's errors: the header, the first reason, the count.
    #[test]
    fn a_list_of_errors_is_cut_to_the_first() {
        let one = |size: &str| {
            format!(
                "Generic {{ reason: \"out of GPU memory: {size} GiB requested, 68.06 GiB in live \
                 tensors (can't allocate buffer of size: 2147483648\\nNo backtrace available)\", \
                 backtrace: No backtrace available }}"
            )
        };
        let reason = format!(
            "The server is in an invalid state\nCaused by:\n  [{}, {}, {}]",
            one("2.00"),
            one("0.50"),
            one("0.75")
        );
        let error = DeviceError::new("the loss", &ExecutionError::WithContext { reason });
        assert_eq!(
            error.message,
            "The server is in an invalid state: out of GPU memory: 2.00 GiB requested, 68.06 GiB \
             in live tensors (can't allocate buffer of size: 2147483648) (and 2 more errors of \
             the same step)"
        );
        let plain = "Caused by: nothing listed";
        let error = DeviceError::new(
            "the loss",
            &ExecutionError::WithContext {
                reason: plain.into(),
            },
        );
        assert_eq!(error.message, plain);
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
}
