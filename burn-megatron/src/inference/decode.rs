//! The incremental forward pass of a [`GptModel`]: new tokens through the model's own layers,
//! attending to the [`KvCache`] and writing to it, at the tokens' absolute positions.
//!
//! The numerics are those of [`GptModel::try_forward`] for the same tokens (the same
//! projections, norms, MLPs and output layer; RoPE or learned positions at the same
//! positions), except that attention against cached keys is the plain
//! `softmax(q kᵀ / sqrt(d) + mask) v` by query group (the flash kernel only for the prefill
//! of prompts of one length) and no dropout runs.

use burn::tensor::{Bool, Int, Tensor, TensorData};

use super::kv_cache::{KvCache, LayerKv};
use crate::backend::ModelBackend;
use crate::error::{ConfigError, Result};
use crate::models::GptModel;
use crate::ops::decode_attention::{Rotation, grouped_attention, grouped_mask};
use crate::ops::{DecodeIndices, packed_flash_attention};
use crate::tensor_parallel::DropoutSite;
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
            let ids =
                Tensor::<B, 1, Int>::from_data(TensorData::new(positions, [batch * new]), &device);
            Some(Rotation::at(table, ids, [batch, new], x.dtype()))
        }
        _ => None,
    };
    let write = CacheWrite::Next {
        capacity,
        rotation,
        mask,
    };
    x = run_layers(model, x, cache, &write)?;
    cache.advance(new);
    Ok(x)
}

/// Where and how a step writes its keys and values to each layer's cache and attends.
pub(super) enum CacheWrite<'a, B: ModelBackend> {
    /// The next columns (the cache's length, known to the host), rotated by `rotation`;
    /// attention reads the used columns only, under `mask` (`[batch, groups, new ·
    /// heads_per_group, len + new]`, see [`grouped_mask`]), or causal by the flash kernel
    /// without one (the prefill of unpadded prompts).
    Next {
        capacity: usize,
        rotation: Option<Rotation<B>>,
        mask: Option<Tensor<B, 4, Bool>>,
    },
    /// One new column a row at the column the indices name, by
    /// [`DecodeAttentionOps::decode_attention`](crate::ops::DecodeAttentionOps::decode_attention)
    /// (RoPE from `rope`'s table): each row attends to its columns from its left padding to
    /// the new one.
    AtColumn {
        indices: &'a DecodeIndices<B>,
        rope: Option<[Tensor<B, 2>; 2]>,
    },
}

/// `x` through this stage's layers against `cache` (the cache's length is not advanced).
///
/// # Shapes
/// - x and the output: `[batch, new, hidden]`
pub(super) fn run_layers<B: ModelBackend>(
    model: &GptModel<B>,
    mut x: Tensor<B, 3>,
    cache: &mut KvCache<B>,
    write: &CacheWrite<'_, B>,
) -> Result<Tensor<B, 3>> {
    // Each residual add is fused with the norm after it (one kernel on CubeCL backends): the
    // MLP's output is added by the next layer's input norm, the last one here.
    let mut mlp: Option<Tensor<B, 3>> = None;
    for (layer, kv) in model.layers().iter().zip(cache.layers_mut()) {
        let normed = match mlp.take() {
            Some(mlp) => {
                let [sum, normed] = layer.input_norm.try_forward_add(x, mlp)?;
                x = sum;
                normed
            }
            None => layer.input_norm.try_forward(x.clone())?,
        };
        let attention = attend(&layer.attention, normed, kv, write)?;
        let [x_mid, normed] = layer.post_attention_norm.try_forward_add(x, attention)?;
        // No jitter in inference: the site is never drawn from.
        let site = DropoutSite::new(0, 0, "decode");
        mlp = Some(layer.try_forward_mlp(normed, site, &mut MoeLosses::default())?);
        x = x_mid;
    }
    Ok(match mlp {
        Some(mlp) => x + mlp,
        None => x,
    })
}

/// The last position the model has (positions past it, of prompts that have finished, are
/// clamped to it).
pub(super) fn max_position<B: ModelBackend>(model: &GptModel<B>) -> usize {
    model.max_sequence_length().saturating_sub(1)
}

/// `attention`'s output for the new columns `x`, their queries attending to the cached keys
/// and values (theirs written to `kv` as `write` says).
///
/// # Shapes
/// - x and the output: `[batch, new, hidden]`
fn attend<B: ModelBackend>(
    attention: &ParallelAttention<B>,
    x: Tensor<B, 3>,
    kv: &mut LayerKv<B>,
    write: &CacheWrite<'_, B>,
) -> Result<Tensor<B, 3>> {
    let (groups, per_group, head_dim, _) = attention.decode_layout();
    let qkv = attention.qkv.try_forward(x)?;
    let [batch, new, _] = qkv.dims();
    let qkv = qkv.reshape([batch, new, groups, per_group + 2, head_dim]);
    let qkv = attention.qk_norm(qkv)?;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let context = match write {
        CacheWrite::Next {
            capacity,
            rotation,
            mask,
        } => {
            let heads = qkv.clone().narrow(3, 0, per_group + 1);
            let value_heads = qkv.narrow(3, per_group + 1, 1);
            let heads = match rotation {
                Some(rotation) => rotation.apply(heads),
                None => heads,
            };
            let [k, v] = [heads.clone().narrow(3, per_group, 1), value_heads.clone()]
                .map(|t| t.reshape([batch, new, groups, head_dim]).swap_dims(1, 2));
            let [keys, values] = kv.write(*capacity, k, v);
            match mask {
                Some(mask) => grouped_attention(
                    heads.narrow(3, 0, per_group),
                    keys,
                    values,
                    mask.clone(),
                    scale,
                ),
                None => packed_flash_attention::attention(
                    Tensor::cat(vec![heads, value_heads], 3),
                    scale,
                    true,
                ),
            }
        }
        CacheWrite::AtColumn { indices, rope } => {
            let buffers = kv.take().ok_or_else(|| {
                ConfigError::Invalid(
                    "a decode step at a device column runs after the prefill filled the cache"
                        .into(),
                )
            })?;
            let [context, keys, values] =
                B::decode_attention(qkv, buffers, (*indices).clone(), rope.clone(), scale);
            kv.put([keys, values]);
            context
        }
    };
    Ok(attention.output.try_forward(context.reshape([
        batch,
        new,
        groups * per_group * head_dim,
    ]))?)
}
