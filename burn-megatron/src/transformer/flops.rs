//! Model FLOPs of a training step, the numerator of MFU, as Megatron counts them.
//!
//! Megatron-LM's paper (Narayanan et al., 2021, appendix) counts, for a GPT with
//! `ffn = 4h`, `72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))` FLOPs per iteration: the matrix
//! multiplications of the forward pass (2 FLOPs per multiply-add) times 3 (the backward pass
//! does twice the forward's work), with the attention scores counted in full (not halved for
//! the causal mask) and no recomputation (recomputed work is not model work). Written per
//! GEMM it covers any FFN width, grouped-query attention and SwiGLU, and equals that formula
//! for GPT.

use super::{Activation, TransformerConfig};
use crate::error::ConfigError;
use crate::tensor_parallel::VocabPartition;

impl TransformerConfig {
    /// Model FLOPs of one training step (forward and backward) over `batch` sequences of
    /// `seq` tokens, on one model replica (all TP ranks together):
    ///
    /// `6·T·( l·( h·(q + 2·g·d) + q·h + 2·s·q + m·h·f ) + h·V )`
    ///
    /// with `T = batch·seq` tokens, `h` hidden, `l` layers, `q` the query heads' width
    /// ([`query_width`](Self::query_width), `h` unless `kv_channels` is set), `g·d` the
    /// key/value width (query groups × head dimension; `q` without GQA), `f` the FFN width, `m` its GEMMs (2 for
    /// GELU, 3 for SwiGLU) and `V` the padded vocabulary (the logits actually computed). The
    /// four terms of a layer are the QKV projection, the output projection, the attention
    /// core (`QKᵀ` and `PV`, `2·s·q` per token each counted as `s·q` multiply-adds) and the
    /// MLP; the last is the output layer. For GPT (`q = g·d = h`, `f = 4h`, `m = 2`) this is
    /// `72·T·l·h²·(1 + s/(6h) + V/(12·l·h))`.
    ///
    /// An MoE layer counts its active FLOPs, as Megatron does for MoE models: in place of the
    /// MLP's `m·h·f`, the router's `h·E` and `k` experts' `m·h·f_e` per token, plus the shared
    /// expert's `m·h·f_s` (`E` experts, `k` a token, widths `f_e` and `f_s`).
    pub fn training_flops(&self, batch: usize, seq: usize) -> Result<f64, ConfigError> {
        let vocab = VocabPartition::new(self.vocab_size, self.make_vocab_size_divisible_by, 1, 0)?;
        let h = self.hidden_size as f64;
        let kv = (self.query_groups() * self.head_dim()) as f64;
        let q = self.query_width() as f64;
        let f = self.ffn_hidden_size as f64;
        let s = seq as f64;
        let mlp_gemms = match self.activation {
            Activation::Gelu | Activation::GeluTanh => 2.0,
            Activation::SwiGlu => 3.0,
        };
        let attention = h * (q + 2.0 * kv) + q * h + 2.0 * s * q;
        let dense_mlp = mlp_gemms * h * f;
        let moe_mlp = self.moe.as_ref().map(|moe| {
            let expert = moe.ffn_hidden_size.map_or(f, |w| w as f64);
            let shared = moe.shared_expert_ffn_hidden_size.unwrap_or(0) as f64;
            h * moe.num_experts as f64 + mlp_gemms * h * (moe.top_k as f64 * expert + shared)
        });
        let layers: f64 = (0..self.num_layers)
            .map(|i| match (&self.moe, moe_mlp) {
                (Some(moe), Some(mlp)) if moe.is_moe_layer(i) => attention + mlp,
                _ => attention + dense_mlp,
            })
            .sum();
        let tokens = (batch * seq) as f64;
        Ok(6.0 * tokens * (layers + h * vocab.padded_size as f64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Megatron's closed form for GPT (`ffn = 4h`, plain multi-head attention).
    fn megatron(b: f64, s: f64, l: f64, h: f64, v: f64) -> f64 {
        72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h))
    }

    #[test]
    fn gpt_equals_megatrons_formula() {
        for (config, seq) in [
            (TransformerConfig::gpt2_124m(), 1024),
            (TransformerConfig::gpt2_350m(), 1024),
            (TransformerConfig::gpt_1_3b(), 2048),
        ] {
            let flops = config.training_flops(8, seq).unwrap();
            let v = 50_304.0; // 50 257 padded to a multiple of 128
            let (l, h) = (config.num_layers as f64, config.hidden_size as f64);
            let expected = megatron(8.0, seq as f64, l, h, v);
            assert!(
                (flops / expected - 1.0).abs() < 1e-12,
                "{flops} vs {expected}"
            );
        }
    }

    /// An MoE layer (every second one here) counts the router, top-k experts and the shared
    /// expert instead of the MLP.
    #[test]
    fn moe_layers_count_their_active_experts() {
        use crate::transformer::moe::MoeSettings;
        let dense =
            TransformerConfig::new(64, 4, 4, 256, 1000, 32).with_activation(Activation::SwiGlu);
        let moe = dense.clone().with_moe(Some(
            MoeSettings::new(8)
                .with_top_k(2)
                .with_ffn_hidden_size(Some(96))
                .with_shared_expert_ffn_hidden_size(Some(32))
                .with_layer_freq(2),
        ));
        let (h, tokens) = (64.0, 2.0 * 32.0);
        let per_layer_difference = h * 8.0 + 3.0 * h * (2.0 * 96.0 + 32.0) - 3.0 * h * 256.0;
        let want = dense.training_flops(2, 32).unwrap() + 6.0 * tokens * 2.0 * per_layer_difference;
        let got = moe.training_flops(2, 32).unwrap();
        assert!((got / want - 1.0).abs() < 1e-12, "{got} vs {want}");
    }

    #[test]
    fn gqa_and_swiglu_count_their_gemms() {
        // Llama-3.2-1B's shape: h = 2048, 32 heads of 64, 8 KV groups (KV width 512), f = 8192.
        let config = TransformerConfig::llama_1b();
        let (h, kv, f, s, l) = (2048.0, 512.0, 8192.0, 1024.0, 16.0);
        let layer = h * (h + 2.0 * kv) + h * h + 2.0 * s * h + 3.0 * h * f;
        let expected = 6.0 * 1024.0 * (l * layer + h * 128_256.0);
        let flops = config.training_flops(1, 1024).unwrap();
        assert!(
            (flops / expected - 1.0).abs() < 1e-12,
            "{flops} vs {expected}"
        );
    }
}
