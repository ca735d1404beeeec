//! Which transformers tensors hold each of our parameters, and how their layouts differ.
//!
//! | ours (whole model)                    | GPT-2 (`transformer.`)   | Llama (`model.`)                      |
//! |---------------------------------------|--------------------------|---------------------------------------|
//! | `embedding.weight` `[V, H]`           | `wte.weight`             | `embed_tokens.weight`                 |
//! | `position_embedding` `[S, H]`         | `wpe.weight`             | (RoPE)                                |
//! | `L.input_norm.scale`/`.shift`         | `h.i.ln_1.weight`/`.bias`| `layers.i.input_layernorm.weight`     |
//! | `L.attention.qkv.weight` `[H, …]`     | `h.i.attn.c_attn.*`      | `layers.i.self_attn.{q,k,v}_proj.weight`ᵀ |
//! | `L.attention.output.weight` `[H, H]`  | `h.i.attn.c_proj.*`      | `layers.i.self_attn.o_proj.weight`ᵀ   |
//! | `L.post_attention_norm.*`             | `h.i.ln_2.*`             | `layers.i.post_attention_layernorm.weight` |
//! | `L.mlp.fc1.*` `[H, F]`                | `h.i.mlp.c_fc.*`         | `layers.i.mlp.up_proj.weight`ᵀ        |
//! | `L.mlp.gate.weight` `[H, F]`          | —                        | `layers.i.mlp.gate_proj.weight`ᵀ      |
//! | `L.mlp.fc2.*` `[F, H]`                | `h.i.mlp.c_proj.*`       | `layers.i.mlp.down_proj.weight`ᵀ      |
//! | `block.final_norm.*`                  | `ln_f.*`                 | `norm.weight`                         |
//! | `output.weight` `[V, H]`              | — (tied to `wte`)        | `lm_head.weight` (no prefix; absent when tied) |
//!
//! (`L` is `block.layers.i`.) Our linear weights are `[in, out]`: GPT-2's Conv1D weights are
//! too, Llama's `nn.Linear` weights are `[out, in]` and are transposed (ᵀ).
//!
//! **Mixtral** is a Llama (same names for all but the MLP) whose MLP is a mixture of experts
//! (`X` is `model.layers.i.block_sparse_moe`, `j` an expert):
//!
//! | ours (whole model)                      | Mixtral (transformers 4, and `save_pretrained`) | transformers 5's fused form |
//! |-----------------------------------------|---------------------------|----------------------------------------|
//! | `L.moe.router.weight` `[H, E]`          | `X.gate.weight`ᵀ          | `…mlp.gate.weight`ᵀ                    |
//! | `L.moe.experts.gate` `[E, H, F]`        | `X.experts.j.w1.weight`ᵀ  | `…mlp.experts.gate_up_proj[j, :F]`ᵀ    |
//! | `L.moe.experts.fc1` `[E, H, F]`         | `X.experts.j.w3.weight`ᵀ  | `…mlp.experts.gate_up_proj[j, F:]`ᵀ    |
//! | `L.moe.experts.fc2` `[E, F, H]`         | `X.experts.j.w2.weight`ᵀ  | `…mlp.experts.down_proj[j]`ᵀ           |
//!
//! (each expert's matrix transposed). transformers 5 keeps the experts fused in memory and
//! writes them back per expert on `save_pretrained` (unless `save_original_format=False`):
//! we read both forms and write the per-expert one, which every version loads.
//!
//! **Qwen3-MoE** is a Mixtral with QK-norm whose MoE tensors are under `mlp` (`Y` is
//! `model.layers.i`; transformers 5's fused experts as Mixtral's):
//!
//! | ours (whole model)                      | Qwen3-MoE                                 |
//! |-----------------------------------------|-------------------------------------------|
//! | `L.attention.q_norm.scale` `[head_dim]` | `Y.self_attn.q_norm.weight`               |
//! | `L.attention.k_norm.scale` `[head_dim]` | `Y.self_attn.k_norm.weight`               |
//! | `L.moe.router.weight` `[H, E]`          | `Y.mlp.gate.weight`ᵀ                      |
//! | `L.moe.experts.gate` `[E, H, F]`        | `Y.mlp.experts.j.gate_proj.weight`ᵀ       |
//! | `L.moe.experts.fc1` `[E, H, F]`         | `Y.mlp.experts.j.up_proj.weight`ᵀ         |
//! | `L.moe.experts.fc2` `[E, F, H]`         | `Y.mlp.experts.j.down_proj.weight`ᵀ       |
//!
//! Its dense layers (`mlp_only_layers`) have a Llama's `mlp.{gate,up,down}_proj`.
//!
//! **QKV.** Our fused QKV columns are ordered query group by query group, `[q heads of the
//! group…, k, v] × head_dim` (so a TP column slice is whole groups). GPT-2's `c_attn` columns
//! are `[all q | all k | all v]`, and Llama's three projections concatenate to the same
//! order: the columns are permuted ([`qkv_order`]).
//!
//! **RoPE.** Our [`packed_rope`](crate::ops::RopeOps::packed_rope) rotates the pairs
//! `(i, i + head_dim / 2)` ("rotate half"), as transformers' Llama does. Meta's original
//! checkpoints rotate interleaved pairs `(2i, 2i + 1)`, and transformers'
//! `convert_llama_weights_to_hf.py` permutes the q/k rows of each head to rotate-half when it
//! converts them; HF files are therefore already in our convention and q/k rows are copied
//! as they are (no permutation, in either direction).
//!
//! **Vocabulary.** HF tables have the real vocabulary; ours are padded (see
//! [`VocabPartition`](crate::tensor_parallel::VocabPartition)): padding rows are zero on
//! import and dropped on export.

use super::HfFamily;
use crate::transformer::TransformerConfig;

/// How one of our full tensors is made from transformers tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Recipe {
    /// One tensor, as it is.
    Copy(String),
    /// One `[out, in]` tensor, transposed.
    Transpose(String),
    /// The query/key/value columns `[q | k | v]`: one fused tensor (GPT-2's `c_attn`, `[in,
    /// 3·out]` or a bias), or three `[out, in]` tensors transposed and concatenated (Llama's),
    /// reordered into our grouped columns.
    Qkv(QkvSource),
    /// Routed experts' weights, ours `[experts, in, out]`: each expert's `[out, in]` tensor
    /// transposed (`per_expert[j]`), or, when those are absent, rows `rows` of each expert's
    /// `[total_rows, in]` matrix of a fused `[experts, total_rows, in]` tensor, transposed.
    Experts {
        /// One tensor an expert.
        per_expert: Vec<String>,
        /// The fused tensor of transformers 5.
        fused: String,
        /// This weight's rows of each fused matrix.
        rows: core::ops::Range<usize>,
        /// Rows of each fused matrix.
        total_rows: usize,
    },
}

/// Where the query/key/value columns come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum QkvSource {
    /// One tensor whose columns are `[q | k | v]`.
    Fused(String),
    /// Three `[out, in]` weights: q, k, v.
    Split([String; 3]),
}

/// The recipe of our full tensor `path` (a path in the whole model), `None` when transformers
/// has no such tensor (a tied output layer) or the path is not ours.
pub(crate) fn recipe(family: HfFamily, path: &str, config: &TransformerConfig) -> Option<Recipe> {
    use Recipe::{Copy, Experts, Qkv, Transpose};
    match family {
        HfFamily::Gpt2 => {
            let t = |name: &str| format!("transformer.{name}");
            Some(match path {
                "embedding.weight" => Copy(t("wte.weight")),
                "position_embedding" => Copy(t("wpe.weight")),
                "block.final_norm.scale" => Copy(t("ln_f.weight")),
                "block.final_norm.shift" => Copy(t("ln_f.bias")),
                _ => {
                    let (i, rest) = layer_path(path)?;
                    let h = |name: &str| t(&format!("h.{i}.{name}"));
                    match rest {
                        "input_norm.scale" => Copy(h("ln_1.weight")),
                        "input_norm.shift" => Copy(h("ln_1.bias")),
                        "attention.qkv.weight" => Qkv(QkvSource::Fused(h("attn.c_attn.weight"))),
                        "attention.qkv.bias" => Qkv(QkvSource::Fused(h("attn.c_attn.bias"))),
                        "attention.output.weight" => Copy(h("attn.c_proj.weight")),
                        "attention.output.bias" => Copy(h("attn.c_proj.bias")),
                        "post_attention_norm.scale" => Copy(h("ln_2.weight")),
                        "post_attention_norm.shift" => Copy(h("ln_2.bias")),
                        "mlp.fc1.weight" => Copy(h("mlp.c_fc.weight")),
                        "mlp.fc1.bias" => Copy(h("mlp.c_fc.bias")),
                        "mlp.fc2.weight" => Copy(h("mlp.c_proj.weight")),
                        "mlp.fc2.bias" => Copy(h("mlp.c_proj.bias")),
                        _ => return None,
                    }
                }
            })
        }
        HfFamily::Llama | HfFamily::Mixtral | HfFamily::Qwen3Moe => {
            let qwen = family == HfFamily::Qwen3Moe;
            let m = |name: &str| format!("model.{name}");
            Some(match path {
                "embedding.weight" => Copy(m("embed_tokens.weight")),
                "block.final_norm.scale" => Copy(m("norm.weight")),
                "output.weight" if !config.tie_embeddings => Copy("lm_head.weight".into()),
                _ => {
                    let (i, rest) = layer_path(path)?;
                    let l = |name: &str| m(&format!("layers.{i}.{name}"));
                    match rest {
                        "input_norm.scale" => Copy(l("input_layernorm.weight")),
                        "attention.qkv.weight" => Qkv(QkvSource::Split([
                            l("self_attn.q_proj.weight"),
                            l("self_attn.k_proj.weight"),
                            l("self_attn.v_proj.weight"),
                        ])),
                        "attention.output.weight" => Transpose(l("self_attn.o_proj.weight")),
                        "attention.q_norm.scale" if qwen => Copy(l("self_attn.q_norm.weight")),
                        "attention.k_norm.scale" if qwen => Copy(l("self_attn.k_norm.weight")),
                        "post_attention_norm.scale" => Copy(l("post_attention_layernorm.weight")),
                        "mlp.fc1.weight" => Transpose(l("mlp.up_proj.weight")),
                        "mlp.gate.weight" => Transpose(l("mlp.gate_proj.weight")),
                        "mlp.fc2.weight" => Transpose(l("mlp.down_proj.weight")),
                        "moe.router.weight" if qwen => Transpose(l("mlp.gate.weight")),
                        "moe.router.weight" => Transpose(l("block_sparse_moe.gate.weight")),
                        _ => {
                            let moe = config.moe.as_ref()?;
                            let f = moe.ffn_hidden_size.unwrap_or(config.ffn_hidden_size);
                            let experts = |w: &str, fused: &str, rows, total_rows| {
                                let (block, w) = match qwen {
                                    true => ("mlp", qwen_name(w)),
                                    false => ("block_sparse_moe", w),
                                };
                                let per_expert = (0..moe.num_experts)
                                    .map(|j| l(&format!("{block}.experts.{j}.{w}.weight")))
                                    .collect();
                                let fused = l(&format!("mlp.experts.{fused}"));
                                Experts {
                                    per_expert,
                                    fused,
                                    rows,
                                    total_rows,
                                }
                            };
                            match rest {
                                "moe.experts.gate" => experts("w1", "gate_up_proj", 0..f, 2 * f),
                                "moe.experts.fc1" => experts("w3", "gate_up_proj", f..2 * f, 2 * f),
                                "moe.experts.fc2" => {
                                    let h = config.hidden_size;
                                    experts("w2", "down_proj", 0..h, h)
                                }
                                _ => return None,
                            }
                        }
                    }
                }
            })
        }
    }
}

/// Qwen3-MoE's name of a Mixtral expert's weight (`w1`, `w3`, `w2`).
fn qwen_name(mixtral: &str) -> &'static str {
    match mixtral {
        "w1" => "gate_proj",
        "w3" => "up_proj",
        _ => "down_proj",
    }
}

/// Another name transformers may have written tensor `name` under: GPT-2 files saved without
/// the `transformer.` prefix (the original `gpt2` upload), and Mixtral's router as
/// transformers 5 names it in memory (`mlp.gate`).
pub(crate) fn alias(name: &str) -> Option<String> {
    if let Some(bare) = name.strip_prefix("transformer.") {
        return Some(bare.to_string());
    }
    name.contains(".block_sparse_moe.gate.")
        .then(|| name.replace(".block_sparse_moe.gate.", ".mlp.gate."))
}

/// `block.layers.{i}.{rest}` → `(i, rest)`.
fn layer_path(path: &str) -> Option<(usize, &str)> {
    let (index, rest) = path.strip_prefix("block.layers.")?.split_once('.')?;
    Some((index.parse().ok()?, rest))
}

/// For each of our QKV columns, its column in `[q | k | v]` (q: `heads · head_dim` columns,
/// k and v: `groups · head_dim` each). Ours are ordered group by group, `[q heads of the group…,
/// k, v]`, each `head_dim` wide.
pub(crate) fn qkv_order(config: &TransformerConfig) -> Vec<usize> {
    let (heads, groups, head_dim) = (
        config.num_attention_heads,
        config.query_groups(),
        config.head_dim(),
    );
    let per_group = heads / groups;
    let (k_start, v_start) = (heads * head_dim, (heads + groups) * head_dim);
    let mut order = Vec::with_capacity((heads + 2 * groups) * head_dim);
    for g in 0..groups {
        for slot in 0..per_group + 2 {
            let start = if slot < per_group {
                (g * per_group + slot) * head_dim
            } else if slot == per_group {
                k_start + g * head_dim
            } else {
                v_start + g * head_dim
            };
            order.extend(start..start + head_dim);
        }
    }
    order
}

/// A row-major f32 tensor: the full tensors being converted.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Dense {
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

impl Dense {
    /// `(rows, columns)` of a matrix, or of a vector taken as one row.
    fn matrix(&self) -> (usize, usize) {
        match self.shape.as_slice() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            _ => (1, self.values.len()),
        }
    }

    /// The transpose of a matrix.
    pub fn transpose(&self) -> Self {
        let (r, c) = self.matrix();
        let mut values = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                values[j * r + i] = self.values[i * c + j];
            }
        }
        Self {
            shape: vec![c, r],
            values,
        }
    }

    /// The columns `order` (a vector's entries), in that order.
    pub fn columns(&self, order: &[usize]) -> Self {
        let (r, c) = self.matrix();
        let mut values = Vec::with_capacity(r * order.len());
        for i in 0..r {
            values.extend(order.iter().map(|&j| self.values[i * c + j]));
        }
        let mut shape = self.shape.clone();
        *shape.last_mut().expect("a tensor of rank 1 or 2") = order.len();
        Self { shape, values }
    }

    /// Matrices (or vectors) side by side.
    pub fn concat_columns(parts: &[Dense]) -> Self {
        let r = parts[0].matrix().0;
        let width: usize = parts.iter().map(|p| p.matrix().1).sum();
        let mut values = Vec::with_capacity(r * width);
        for i in 0..r {
            for p in parts {
                let c = p.matrix().1;
                values.extend_from_slice(&p.values[i * c..(i + 1) * c]);
            }
        }
        let mut shape = parts[0].shape.clone();
        *shape.last_mut().expect("a tensor of rank 1 or 2") = width;
        Self { shape, values }
    }

    /// Consecutive column blocks of the given widths.
    pub fn split_columns(&self, widths: &[usize]) -> Vec<Self> {
        let mut start = 0;
        widths
            .iter()
            .map(|&w| {
                let part = self.columns(&(start..start + w).collect::<Vec<_>>());
                start += w;
                part
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qkv_columns_follow_the_groups() {
        // 4 heads in 2 groups of head_dim 1: q0 q1 k0 v0 | q2 q3 k1 v1, from [q0..q3 | k0 k1 | v0 v1].
        let config = TransformerConfig::new(4, 1, 4, 4, 8, 4).with_num_query_groups(Some(2));
        assert_eq!(qkv_order(&config), vec![0, 1, 4, 6, 2, 3, 5, 7]);
        let m = Dense {
            shape: vec![2, 3],
            values: vec![1., 2., 3., 4., 5., 6.],
        };
        assert_eq!(m.transpose().values, vec![1., 4., 2., 5., 3., 6.]);
        let parts = m.split_columns(&[1, 2]);
        assert_eq!(Dense::concat_columns(&parts), m);
    }
}
