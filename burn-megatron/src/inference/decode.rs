//! The incremental forward pass of a [`GptModel`]: new tokens through the model's own layers,
//! attending to the [`KvCache`] and writing to it, at the tokens' absolute positions.
//!
//! The numerics are those of [`GptModel::try_forward`] for the same tokens (the same
//! projections, norms, MLPs and output layer; RoPE or learned positions at the same
//! positions), except that attention against cached keys is the plain
//! `softmax(q kᵀ / sqrt(d) + mask) v` by query group (the flash kernel only for the prefill
//! of prompts of one length) and no dropout runs.

use burn::tensor::{Bool, DType, Int, Tensor, TensorData};
use burn_megatron_dist::DistResult;

use super::kv_cache::{KvCache, LayerKv};
use crate::backend::ModelBackend;
use crate::error::{ConfigError, Result};
use crate::models::GptModel;
#[cfg(doc)]
use crate::ops::SoftmaxOps;
use crate::ops::packed_flash_attention;
use crate::transformer::ParallelAttention;
use crate::transformer::moe::MoeLosses;

/// Runs `tokens` (the next columns of every row) through a whole `model`, writing their
/// keys and values to `cache`, and returns this rank's slice of the logits of the last column:
/// [`embed_cached`], [`layers_cached`], then the final norm and the output layer.
///
/// # Shapes
/// - tokens: `[batch, new]`
/// - output: `[batch, 1, padded_vocab / tp]`
pub fn forward_cached<B: ModelBackend>(
    model: &GptModel<B>,
    tokens: Tensor<B, 2, Int>,
    cache: &mut KvCache<B>,
) -> Result<Tensor<B, 3>> {
    let new = tokens.dims()[1];
    let x = layers_cached(model, embed_cached(model, tokens, cache)?, cache)?;
    model.head(x.narrow(1, new - 1, 1))
}

/// The token embeddings of the next columns, plus the learned positions at their absolute
/// positions (see [`KvCache::positions`]); no dropout. First stage only.
///
/// # Shapes
/// - tokens: `[batch, new]`
/// - output: `[batch, new, hidden]`
pub fn embed_cached<B: ModelBackend>(
    model: &GptModel<B>,
    tokens: Tensor<B, 2, Int>,
    cache: &KvCache<B>,
) -> Result<Tensor<B, 3>> {
    let embedding = model.embedding.as_ref().ok_or_else(|| {
        ConfigError::Invalid(format!(
            "pipeline stage {} of {} has no embedding: the first stage embeds the tokens",
            model.stage().index,
            model.stage().num_stages
        ))
    })?;
    let [batch, new] = tokens.dims();
    let device = tokens.device();
    let mut x = embedding.try_forward(tokens)?;
    if let Some(table) = &model.position_embedding {
        let hidden = x.dims()[2];
        let positions = cache.positions(new, max_position(model));
        let ids =
            Tensor::<B, 1, Int>::from_data(TensorData::new(positions, [batch * new]), &device);
        x = x + table.val().select(0, ids).reshape([batch, new, hidden]);
    }
    Ok(x)
}

/// The next columns' residual stream through this stage's layers, attending to `cache` and
/// writing to it (the cache then holds `new` more columns); no dropout. The final norm is
/// not applied ([`GptModel::head`] does it). An error if the columns do not fit the cache.
///
/// Per call it uploads the positions (and, unless this is the prefill of unpadded prompts,
/// the mask) and reads nothing back.
///
/// # Shapes
/// - x and the output: `[batch, new, hidden]`
pub fn layers_cached<B: ModelBackend>(
    model: &GptModel<B>,
    mut x: Tensor<B, 3>,
    cache: &mut KvCache<B>,
) -> Result<Tensor<B, 3>> {
    let [batch, new, _] = x.dims();
    let device = x.device();
    let max = model.max_sequence_length();
    let capacity = cache.reserve(new, max)?;
    let positions = cache.positions(new, max_position(model));
    let layout = model
        .layers()
        .first()
        .map(|layer| layer.attention.decode_layout());
    // A prefill of prompts of one length is plain causal attention: the flash kernel's.
    let unpadded_prefill = cache.is_empty() && cache.pads().iter().all(|&pad| pad == 0);
    let mask = match layout {
        Some((groups, per_group, _, _)) if !unpadded_prefill => {
            Some(grouped_mask(cache.mask(new, &device), groups, per_group))
        }
        _ => None,
    };
    let rotation = match layout {
        Some((_, _, head_dim, Some(base))) => {
            let table = cache.rope_table(capacity.min(max), head_dim, base, &device);
            Some(Rotation::new(
                table,
                positions,
                [batch, new],
                x.dtype(),
                &device,
            ))
        }
        _ => None,
    };
    x = run_layers(
        model,
        x,
        cache,
        rotation.as_ref(),
        mask,
        CacheWrite::Next { capacity },
    )?;
    cache.advance(new);
    Ok(x)
}

/// Where a step writes its keys and values in each layer's cache.
pub(super) enum CacheWrite<'a, B: ModelBackend> {
    /// The next columns (the cache's length, known to the host); attention reads the used
    /// columns only.
    Next { capacity: usize },
    /// The one column a `[1]` device tensor names; attention reads every column of the
    /// buffers, the mask hiding those past it.
    AtColumn(&'a Tensor<B, 1, Int>),
}

/// `x` through this stage's layers against `cache` (the cache's length is not advanced).
///
/// # Shapes
/// - x and the output: `[batch, new, hidden]`
pub(super) fn run_layers<B: ModelBackend>(
    model: &GptModel<B>,
    mut x: Tensor<B, 3>,
    cache: &mut KvCache<B>,
    rotation: Option<&Rotation<B>>,
    mask: Option<Tensor<B, 4, Bool>>,
    write: CacheWrite<'_, B>,
) -> Result<Tensor<B, 3>> {
    for (layer, kv) in model.layers().iter().zip(cache.layers_mut()) {
        let normed = layer.input_norm.try_forward(x.clone())?;
        let attention = attend(&layer.attention, normed, kv, &write, rotation, mask.clone())?;
        let x_mid = x + attention;
        let mlp = layer.try_forward_mlp(
            layer.post_attention_norm.try_forward(x_mid.clone())?,
            &mut MoeLosses::default(),
        )?;
        x = x_mid + mlp;
    }
    Ok(x)
}

/// The last position the model has (positions past it, of prompts that have finished, are
/// clamped to it).
pub(super) fn max_position<B: ModelBackend>(model: &GptModel<B>) -> usize {
    model.max_sequence_length().saturating_sub(1)
}

/// The cosines and sines of the new columns' positions, `[batch, new, 1, 1, head_dim]` each
/// (the "rotate half" layout of [`crate::ops::rope`]), gathered on the device from the
/// cache's table ([`KvCache::rope_table`]) by a tensor of positions and cast to the
/// activations' dtype once a step; the sines' first half negated, so that a rotation is
/// `x · cos + swap_halves(x) · sin` (the same products as `x · cos + rotate_half(x) · sin`).
pub(super) struct Rotation<B: ModelBackend> {
    cos: Tensor<B, 5>,
    signed_sin: Tensor<B, 5>,
}

impl<B: ModelBackend> Rotation<B> {
    /// # Shapes
    /// - table: `[rows, head_dim]` each, rows past every position
    /// - positions: `batch · new` values, row-major
    fn new(
        table: [Tensor<B, 2>; 2],
        positions: Vec<i64>,
        [batch, new]: [usize; 2],
        dtype: DType,
        device: &B::Device,
    ) -> Self {
        let ids = Tensor::<B, 1, Int>::from_data(TensorData::new(positions, [batch * new]), device);
        Self::at(table, ids, [batch, new], dtype)
    }

    /// The same at the positions of a device tensor `ids` (`batch · new` values, row-major).
    pub(super) fn at(
        [cos, sin]: [Tensor<B, 2>; 2],
        ids: Tensor<B, 1, Int>,
        [batch, new]: [usize; 2],
        dtype: DType,
    ) -> Self {
        let head_dim = cos.dims()[1];
        let half = head_dim / 2;
        let rows = |table: Tensor<B, 2>| {
            table
                .select(0, ids.clone())
                .cast(dtype)
                .reshape([batch, new, 1, 1, head_dim])
        };
        let sin = rows(sin);
        let signed_sin = Tensor::cat(
            vec![
                sin.clone().narrow(4, 0, half).neg(),
                sin.narrow(4, half, half),
            ],
            4,
        );
        Self {
            cos: rows(cos),
            signed_sin,
        }
    }

    /// Query and key `heads` (`[batch, new, groups, slots, head_dim]`) rotated, as
    /// [`RopeOps::packed_rope`](crate::ops::RopeOps::packed_rope) rotates them at positions
    /// `0..seq`.
    fn apply(&self, heads: Tensor<B, 5>) -> Tensor<B, 5> {
        let half = heads.dims()[4] / 2;
        let swapped = Tensor::cat(
            vec![
                heads.clone().narrow(4, half, half),
                heads.clone().narrow(4, 0, half),
            ],
            4,
        );
        heads * self.cos.clone() + swapped * self.signed_sin.clone()
    }
}

/// `attention`'s output for the new columns `x`, their queries attending to the cached keys
/// and values (theirs written to `kv` as `write` says) under `mask`; without a mask (the
/// prefill of unpadded prompts), causal attention by [`packed_flash_attention::attention`].
///
/// # Shapes
/// - x and the output: `[batch, new, hidden]`
/// - mask: `[batch, groups, new · heads_per_group, len + new]` (see [`grouped_mask`])
fn attend<B: ModelBackend>(
    attention: &ParallelAttention<B>,
    x: Tensor<B, 3>,
    kv: &mut LayerKv<B>,
    write: &CacheWrite<'_, B>,
    rotation: Option<&Rotation<B>>,
    mask: Option<Tensor<B, 4, Bool>>,
) -> DistResult<Tensor<B, 3>> {
    let (groups, per_group, head_dim, _) = attention.decode_layout();
    let qkv = attention.qkv.try_forward(x)?;
    let [batch, new, _] = qkv.dims();
    let qkv = qkv.reshape([batch, new, groups, per_group + 2, head_dim]);
    let qkv = attention.qk_norm(qkv)?;
    let heads = qkv.clone().narrow(3, 0, per_group + 1);
    let value_heads = qkv.narrow(3, per_group + 1, 1);
    let heads = match rotation {
        Some(rotation) => rotation.apply(heads),
        None => heads,
    };
    let [k, v] = [heads.clone().narrow(3, per_group, 1), value_heads.clone()]
        .map(|t| t.reshape([batch, new, groups, head_dim]).swap_dims(1, 2));
    let [keys, values] = match write {
        CacheWrite::Next { capacity } => kv.write(*capacity, k, v),
        CacheWrite::AtColumn(column) => kv.write_at((*column).clone(), k, v),
    };
    let scale = 1.0 / (head_dim as f64).sqrt();
    let context = match mask {
        Some(mask) => grouped_attention(heads.narrow(3, 0, per_group), keys, values, mask, scale),
        None => {
            packed_flash_attention::attention(Tensor::cat(vec![heads, value_heads], 3), scale, true)
        }
    };
    attention
        .output
        .try_forward(context.reshape([batch, new, groups * per_group * head_dim]))
}

/// `softmax(scale · q kᵀ + mask) v` of the new columns' query heads against their group's
/// cached key/value head, without copying K and V per query head: a group's query heads are
/// rows of one matrix (`[new · heads_per_group, head_dim]`) against the group's keys. The
/// scores are the product's, masked, and the softmax ([`SoftmaxOps::masked_softmax`](crate::ops::SoftmaxOps::masked_softmax): one
/// kernel on CubeCL backends) scales them and keeps f32 statistics.
///
/// # Shapes
/// - queries: `[batch, new, groups, heads_per_group, head_dim]` (rotated)
/// - keys, values: `[batch, groups, total, head_dim]`
/// - mask: `[batch, groups, new · heads_per_group, total]` (see [`grouped_mask`])
/// - output: `[batch, new, heads, head_dim]`, heads group by group
fn grouped_attention<B: ModelBackend>(
    queries: Tensor<B, 5>,
    keys: Tensor<B, 4>,
    values: Tensor<B, 4>,
    mask: Tensor<B, 4, Bool>,
    scale: f64,
) -> Tensor<B, 4> {
    let [batch, new, groups, per_group, head_dim] = queries.dims();
    let rows = new * per_group;
    let q = queries
        .swap_dims(1, 2)
        .reshape([batch, groups, rows, head_dim]);
    let scores = q
        .matmul(keys.swap_dims(2, 3))
        .mask_fill(mask, f32::NEG_INFINITY);
    B::masked_softmax(scores, None, scale, false)
        .matmul(values)
        .reshape([batch, groups, new, per_group, head_dim])
        .swap_dims(1, 2)
        .reshape([batch, new, groups * per_group, head_dim])
}

/// The mask of [`KvCache::mask`] laid out for [`grouped_attention`]'s rows (token-major, then
/// the group's query heads), built once a step for every layer.
///
/// # Shapes
/// - mask: `[batch, 1, new, total]` (`true`: masked)
/// - output: `[batch, groups, new · heads_per_group, total]`
pub(super) fn grouped_mask<B: ModelBackend>(
    mask: Tensor<B, 4, Bool>,
    groups: usize,
    per_group: usize,
) -> Tensor<B, 4, Bool> {
    let [batch, _, new, total] = mask.dims();
    mask.reshape([batch, 1, new, 1, total])
        .expand([batch, groups, new, per_group, total])
        .reshape([batch, groups, new * per_group, total])
}
