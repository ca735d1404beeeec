//! The decode step whose inputs live on the device: the tokens to feed, their positions and
//! the cache column to write are tensors the step itself advances in place, and each layer's
//! attention is [`DecodeAttentionOps::decode_attention`](crate::ops::DecodeAttentionOps::decode_attention),
//! which finds the columns to read (from the row's left padding to the new one) on the
//! device. Every step then launches the same kernels with the same arguments, reads nothing
//! and uploads nothing, so that on our CUDA backend it can be captured once as a CUDA graph
//! and replayed (see [`super::generate`]).
//!
//! The numerics are the cached step's ([`super::layers_cached`]) up to the order of the
//! softmax's and the product's sums (the composition masks the columns past the new one to
//! exact zeros; the kernel does not read them), and each residual add is fused with the
//! norm after it, with the same bits.

use burn::tensor::{Int, Tensor, TensorData};

use super::decode::{CacheWrite, max_position, run_layers};
use super::kv_cache::KvCache;
use crate::backend::ModelBackend;
use crate::error::{ConfigError, Result};
use crate::models::GptModel;
use crate::ops::DecodeIndices;

/// The device-resident inputs of the next decode step.
///
/// # Shapes
/// - tokens: `[batch, 1]`
/// - indices: see [`DecodeIndices`] (the pads constant)
pub(crate) struct DeviceStep<B: ModelBackend> {
    tokens: Tensor<B, 2, Int>,
    indices: DecodeIndices<B>,
}

impl<B: ModelBackend> DeviceStep<B> {
    /// The inputs of the step after the columns `cache` holds, feeding `tokens` (one a row).
    pub(crate) fn new(
        model: &GptModel<B>,
        cache: &KvCache<B>,
        tokens: Vec<i64>,
        device: &B::Device,
    ) -> Result<Self> {
        let batch = cache.batch();
        if cache.capacity().is_none() {
            return Err(ConfigError::Invalid(
                "the device-resident decode step runs after the prefill".into(),
            )
            .into());
        }
        let int = |values: Vec<i64>| {
            let n = values.len();
            Tensor::<B, 1, Int>::from_data(TensorData::new(values, [n]), device)
        };
        let pads = cache.pads().iter().map(|&pad| pad as i64).collect();
        Ok(Self {
            tokens: int(tokens).reshape([batch, 1]),
            indices: DecodeIndices {
                column: int(vec![cache.len() as i64]),
                pads: int(pads),
                positions: int(cache.positions(1, max_position(model))),
            },
        })
    }

    /// One decode step of a whole model (first and last stage): the tokens through the model
    /// against `cache` (its next column written), `pick` choosing each row's token from the
    /// logits (`[batch, vocab]` → `[batch]`, on the device), and the inputs advanced in place
    /// (the picks fed next). Returns the picks, `[batch]`. The cache's length is advanced by
    /// the caller once the step ran ([`KvCache::advance_all`]).
    pub(crate) fn run(
        self,
        model: &GptModel<B>,
        cache: &mut KvCache<B>,
        pick: impl FnOnce(Tensor<B, 3>) -> Result<Tensor<B, 1, Int>>,
    ) -> Result<(Self, Tensor<B, 1, Int>)> {
        let Self { tokens, indices } = self;
        let batch = tokens.dims()[0];
        let max = model.max_sequence_length();
        let capacity = cache.reserve(1, max)?;
        let embedding = model.embedding.as_ref().ok_or_else(|| {
            ConfigError::Invalid("the device-resident decode step needs a whole model".into())
        })?;
        let mut x = embedding.try_forward(tokens.clone())?;
        if let Some(table) = &model.position_embedding {
            let hidden = x.dims()[2];
            x = x + table
                .val()
                .select(0, indices.positions.clone())
                .reshape([batch, 1, hidden]);
        }
        let rope = match model.layers().first() {
            Some(layer) => match layer.attention.decode_layout() {
                (_, _, head_dim, Some(base)) => {
                    Some(cache.rope_table(capacity.min(max), head_dim, base, &x.device()))
                }
                _ => None,
            },
            None => None,
        };
        let write = CacheWrite::AtColumn {
            indices: &indices,
            rope,
        };
        let x = run_layers(model, x, cache, &write)?;
        let picks = pick(model.head(x)?)?;
        // The inputs of the next step, each written into its own buffer (in place where the
        // backend can: what a captured step needs).
        let DecodeIndices {
            column,
            pads,
            positions,
        } = indices;
        let tokens = tokens.slice_assign([0..batch, 0..1], picks.clone().reshape([batch, 1]));
        let next = positions
            .clone()
            .add_scalar(1)
            .clamp_max(max_position(model) as i64);
        let positions = positions.slice_assign(0..batch, next);
        let next = column.clone().add_scalar(1);
        let column = column.slice_assign(0..1, next);
        let state = Self {
            tokens,
            indices: DecodeIndices {
                column,
                pads,
                positions,
            },
        };
        Ok((state, picks))
    }

    /// The device addresses of the inputs the step advances (see
    /// [`BackendInfo::int_address`](crate::backend::BackendInfo::int_address)).
    pub(crate) fn addresses(&self) -> [Option<u64>; 3] {
        [
            B::int_address(&self.tokens.clone().into_primitive()),
            B::int_address(&self.indices.positions.clone().into_primitive()),
            B::int_address(&self.indices.column.clone().into_primitive()),
        ]
    }
}
