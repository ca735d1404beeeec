//! The incremental forward pass of a [`GptModel`]: new tokens through the model's own layers,
//! attending to the [`KvCache`] and appending to it, at the tokens' absolute positions.
//!
//! The numerics are those of [`GptModel::try_forward`] for the same tokens (the same
//! projections, norms, MLPs and output layer; RoPE or learned positions at the same
//! positions), except that attention is the plain `softmax(q kᵀ / sqrt(d) + mask) v` over the
//! cached keys (no flash kernel) and no dropout runs.

use burn::tensor::activation::softmax;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_megatron_dist::DistResult;

use super::kv_cache::{KvCache, LayerKv};
use crate::backend::ModelBackend;
use crate::error::{ConfigError, Result};
use crate::models::GptModel;
use crate::ops::packed_flash_attention;
use crate::ops::rope::rotation_table;
use crate::transformer::ParallelAttention;
use crate::transformer::moe::MoeLosses;

/// Runs `tokens` (the next columns of every row) through a whole `model`, appending their
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
/// appending to it (the cache then holds `new` more columns); no dropout. The final norm is
/// not applied ([`GptModel::head`] does it).
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
    let positions = cache.positions(new, max_position(model));
    let mask = cache.mask(new, &device);
    let rotation = model.layers().first().and_then(|layer| {
        let (_, _, head_dim, base) = layer.attention.decode_layout();
        base.map(|base| Rotation::new(&positions, [batch, new], head_dim, base, &device))
    });
    for (layer, kv) in model.layers().iter().zip(cache.layers_mut()) {
        let normed = layer.input_norm.try_forward(x.clone())?;
        let attention = attend(
            &layer.attention,
            normed,
            kv,
            rotation.as_ref(),
            mask.clone(),
        )?;
        let x_mid = x + attention;
        let mlp = layer.try_forward_mlp(
            layer.post_attention_norm.try_forward(x_mid.clone())?,
            &mut MoeLosses::default(),
        )?;
        x = x_mid + mlp;
    }
    cache.advance(new);
    Ok(x)
}

/// The last position the model has (positions past it, of prompts that have finished, are
/// clamped to it).
fn max_position<B: ModelBackend>(model: &GptModel<B>) -> usize {
    model.max_sequence_length().saturating_sub(1)
}

/// The cosines and sines of the new columns' positions, `[batch, new, 1, 1, head_dim]` each
/// (the "rotate half" layout of [`crate::ops::rope`]), from the same f64 table.
struct Rotation<B: ModelBackend> {
    cos: Tensor<B, 5>,
    sin: Tensor<B, 5>,
}

impl<B: ModelBackend> Rotation<B> {
    fn new(
        positions: &[i64],
        [batch, new]: [usize; 2],
        head_dim: usize,
        base: f64,
        device: &B::Device,
    ) -> Self {
        let half = head_dim / 2;
        let rows = positions.iter().copied().max().unwrap_or(0) as usize + 1;
        let [cos, sin] = rotation_table(rows, head_dim, base).map(|table| {
            let values: Vec<f32> = positions
                .iter()
                .flat_map(|&p| table[p as usize * half..(p as usize + 1) * half].to_vec())
                .collect();
            let t = Tensor::<B, 3>::from_data(
                TensorData::new(values, [batch, new, half]),
                (device, DType::F32),
            );
            Tensor::cat(vec![t.clone(), t], 2).reshape([batch, new, 1, 1, head_dim])
        });
        Self { cos, sin }
    }

    /// The packed `qkv` (`[batch, new, groups, heads_per_group + 2, head_dim]`) with its query
    /// and key heads rotated, as [`RopeOps::packed_rope`](crate::ops::RopeOps::packed_rope)
    /// rotates them at positions `0..seq`.
    fn apply(&self, qkv: Tensor<B, 5>) -> Tensor<B, 5> {
        let [_, _, _, slots, head_dim] = qkv.dims();
        let half = head_dim / 2;
        let dtype = qkv.dtype();
        let heads = qkv.clone().narrow(3, 0, slots - 1);
        let values = qkv.narrow(3, slots - 1, 1);
        let rotated_half = Tensor::cat(
            vec![
                heads.clone().narrow(4, half, half).neg(),
                heads.clone().narrow(4, 0, half),
            ],
            4,
        );
        let rotated =
            heads * self.cos.clone().cast(dtype) + rotated_half * self.sin.clone().cast(dtype);
        Tensor::cat(vec![rotated, values], 3)
    }
}

/// `attention`'s output for the new columns `x`, their queries attending to the cached keys
/// and values (theirs appended to `kv`) under `mask`.
///
/// # Shapes
/// - x and the output: `[batch, new, hidden]`
/// - mask: `[batch, 1, new, len + new]` (`true`: masked)
fn attend<B: ModelBackend>(
    attention: &ParallelAttention<B>,
    x: Tensor<B, 3>,
    kv: &mut LayerKv<B>,
    rotation: Option<&Rotation<B>>,
    mask: Tensor<B, 4, burn::tensor::Bool>,
) -> DistResult<Tensor<B, 3>> {
    let (groups, per_group, head_dim, _) = attention.decode_layout();
    let qkv = attention.qkv.try_forward(x)?;
    let [batch, new, _] = qkv.dims();
    let qkv = qkv.reshape([batch, new, groups, per_group + 2, head_dim]);
    let qkv = match rotation {
        Some(rotation) => rotation.apply(qkv),
        None => qkv,
    };
    let [q, k, v] = packed_flash_attention::split(qkv);
    let [k, v] = kv.append(k, v);
    let total = k.dims()[2];
    let heads = groups * per_group;
    // Each key/value head serves its group's query heads.
    let repeat = |t: Tensor<B, 4>| -> Tensor<B, 4> {
        t.unsqueeze_dim::<5>(2)
            .expand([batch, groups, per_group, total, head_dim])
            .reshape([batch, heads, total, head_dim])
    };
    let scores = q
        .matmul(repeat(k).swap_dims(2, 3))
        .mul_scalar(1.0 / (head_dim as f64).sqrt());
    let scores = scores.mask_fill(mask.repeat_dim(1, heads), f32::NEG_INFINITY);
    let context = softmax(scores, 3)
        .matmul(repeat(v))
        .swap_dims(1, 2)
        .reshape([batch, new, heads * head_dim]);
    attention.output.try_forward(context)
}
