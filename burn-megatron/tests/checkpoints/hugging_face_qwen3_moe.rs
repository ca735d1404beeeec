//! Hugging Face import of Qwen3-MoE (`Qwen3MoeForCausalLM`): a tiny checkpoint in
//! transformers' layout (per-expert `mlp.experts.j.{gate,up,down}_proj`, the router
//! `mlp.gate`, `self_attn.q_norm` / `k_norm`, random values) is written here with its
//! `config.json`; a transformers-style forward pass from plain Burn ops (RMSNorm of each query
//! and key head before RoPE; softmax over all experts, top-k, renormalised only with
//! `norm_topk_prob`; every expert run densely) gives the reference logits. Imported at TP 1 and
//! TP 2 × EP 2 on thread ranks, our logits equal it (f32, 1e-5 relative), with heads as wide as
//! hidden / heads and twice as wide (Qwen3's `head_dim`, our `kv_channels`); at TP 2 × PP 2 the
//! loss is the one-rank loss; the export writes the same tensors and configuration back;
//! options we lack are errors naming them.

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::activation::{silu, softmax};
use burn::tensor::{Tensor, TensorData};
use burn_megatron::checkpointing::hugging_face::{HfConfig, HfFamily};
use burn_megatron::transformer::moe::RouterScoreFunction;

use super::hugging_face::{Hf, Named, decoder_reference, hf_linear, hf_tensors};
use super::hugging_face_mixtral::{imported_logits, imported_loss, noise, write_checkpoint};
use crate::{B, assert_close, data_values, scratch, tolerance};

const EXPERTS: usize = 4;
const TOP_K: usize = 2;
const HIDDEN: usize = 16;
/// The dense layers' MLP width (`intermediate_size`).
const FFN: usize = 20;
/// Each expert's width (`moe_intermediate_size`).
const MOE_FFN: usize = 12;
const LAYERS: usize = 2;
const VOCAB: usize = 50;

/// A tiny Qwen3-MoE's `config.json` (GQA: 4 heads of `head_dim` in 2 groups; 4 experts, top
/// 2), its layers `dense` with a dense MLP.
fn config_json(norm_topk_prob: bool, dense: &[usize], head_dim: usize) -> serde_json::Value {
    serde_json::json!({
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "moe_intermediate_size": MOE_FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "max_position_embeddings": 16,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
        "attention_bias": false,
        "use_sliding_window": false,
        "sliding_window": null,
        "max_window_layers": LAYERS,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "norm_topk_prob": norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "output_router_logits": false,
        "router_aux_loss_coef": 0.001,
        "torch_dtype": "float32",
    })
}

/// The tensors transformers writes, random: norms around 1, weights uniform, the router's
/// larger so that no two of a token's scores are close.
fn qwen3_moe_tensors(dense: &[usize], head_dim: usize) -> BTreeMap<String, Named> {
    let mut out = BTreeMap::new();
    let mut add = |name: String, shape: Vec<usize>, center: f32, scale: f32| {
        let seed = out.len() as u64 + 1;
        let values = noise(seed, shape.iter().product(), center, scale);
        out.insert(name, (shape, values));
    };
    let h = HIDDEN;
    let (q, kv) = (4 * head_dim, 2 * head_dim);
    add("model.embed_tokens.weight".into(), vec![VOCAB, h], 0.0, 1.0);
    add("model.norm.weight".into(), vec![h], 1.0, 0.4);
    add("lm_head.weight".into(), vec![VOCAB, h], 0.0, 0.5);
    for i in 0..LAYERS {
        let l = |name: &str| format!("model.layers.{i}.{name}");
        add(l("input_layernorm.weight"), vec![h], 1.0, 0.4);
        add(l("post_attention_layernorm.weight"), vec![h], 1.0, 0.4);
        add(l("self_attn.q_proj.weight"), vec![q, h], 0.0, 0.5);
        add(l("self_attn.k_proj.weight"), vec![kv, h], 0.0, 0.5);
        add(l("self_attn.v_proj.weight"), vec![kv, h], 0.0, 0.5);
        add(l("self_attn.o_proj.weight"), vec![h, q], 0.0, 0.5);
        add(l("self_attn.q_norm.weight"), vec![head_dim], 1.0, 0.8);
        add(l("self_attn.k_norm.weight"), vec![head_dim], 1.0, 0.8);
        let mlp = |f: usize, add: &mut dyn FnMut(String, Vec<usize>, f32, f32), at: &str| {
            add(format!("{at}.gate_proj.weight"), vec![f, h], 0.0, 0.5);
            add(format!("{at}.up_proj.weight"), vec![f, h], 0.0, 0.5);
            add(format!("{at}.down_proj.weight"), vec![h, f], 0.0, 0.5);
        };
        if dense.contains(&i) {
            mlp(FFN, &mut add, &l("mlp"));
        } else {
            add(l("mlp.gate.weight"), vec![EXPERTS, h], 0.0, 2.0);
            for j in 0..EXPERTS {
                mlp(MOE_FFN, &mut add, &l(&format!("mlp.experts.{j}")));
            }
        }
    }
    out
}

/// `down(silu(gate x) · up x)` of the SwiGLU MLP under `at`.
fn swiglu_mlp(hf: &Hf, at: &str, x: Tensor<B, 2>) -> Tensor<B, 2> {
    let w = |name: &str| format!("{at}.{name}_proj.weight");
    let gated = silu(hf_linear(hf, x.clone(), &w("gate"))) * hf_linear(hf, x, &w("up"));
    hf_linear(hf, gated, &w("down"))
}

/// Qwen3-MoE's MLP as transformers computes it: a dense SwiGLU MLP in the layers of
/// `mlp_only_layers`; elsewhere router logits `x Wᵀ`, softmax over all experts, the top-k,
/// their weights divided by their sum only with `norm_topk_prob`, every expert run on every
/// token and a dense `[tokens, experts]` matrix of the weights (zero off the top-k) combining
/// them.
fn qwen3_moe_mlp(hf: &Hf, i: usize, h: Tensor<B, 3>) -> Tensor<B, 3> {
    let [b, s, hidden] = h.dims();
    let tokens = b * s;
    let x = h.reshape([tokens, hidden]);
    let mlp = format!("model.layers.{i}.mlp");
    let dense = hf.1["mlp_only_layers"].as_array().unwrap();
    if dense.iter().any(|l| l.as_u64() == Some(i as u64)) {
        return swiglu_mlp(hf, &mlp, x).reshape([b, s, hidden]);
    }
    let (experts, k) = (hf.n("num_experts"), hf.n("num_experts_per_tok"));
    let normalise = hf.1["norm_topk_prob"].as_bool().unwrap();
    let probs = softmax(hf_linear(hf, x.clone(), &format!("{mlp}.gate.weight")), 1);
    let probs = data_values(&probs.into_data());
    let mut combine = vec![0f32; tokens * experts];
    for t in 0..tokens {
        let row = &probs[t * experts..(t + 1) * experts];
        let mut order: Vec<usize> = (0..experts).collect();
        order.sort_by(|&a, &c| row[c].total_cmp(&row[a]));
        let sum: f64 = match normalise {
            true => order[..k].iter().map(|&e| row[e]).sum(),
            false => 1.0,
        };
        for &e in &order[..k] {
            combine[t * experts + e] = (row[e] / sum) as f32;
        }
    }
    let combine = Tensor::<B, 2>::from_data(
        TensorData::new(combine, [tokens, experts]),
        &Default::default(),
    );
    let mut out = Tensor::<B, 2>::zeros([tokens, hidden], &Default::default());
    for e in 0..experts {
        let expert = swiglu_mlp(hf, &format!("{mlp}.experts.{e}"), x.clone());
        out = out + expert * combine.clone().narrow(1, e, 1);
    }
    out.reshape([b, s, hidden])
}

/// Writes the checkpoint, imports it at TP 1 and TP 2 × EP 2 against the reference, and
/// checks the export of the TP 2 × EP 2 model (tensors and configuration).
fn check_import_and_export(name: &str, norm_topk_prob: bool, dense: &[usize], head_dim: usize) {
    let dir = scratch(name);
    let tensors = qwen3_moe_tensors(dense, head_dim);
    write_checkpoint(
        &dir,
        &tensors,
        &config_json(norm_topk_prob, dense, head_dim),
    );

    let hf = HfConfig::read(&dir).unwrap();
    assert_eq!(hf.family, HfFamily::Qwen3Moe);
    assert!(hf.config.qk_layernorm, "Qwen3-MoE normalises q and k heads");
    assert_eq!(hf.config.head_dim(), head_dim);
    let moe = hf.config.moe.as_ref().expect("a Qwen3-MoE has MoE layers");
    assert_eq!(
        (moe.num_experts, moe.top_k, moe.ffn_hidden_size),
        (EXPERTS, TOP_K, Some(MOE_FFN))
    );
    assert_eq!(moe.score_function, RouterScoreFunction::Softmax);
    assert!(
        moe.pre_softmax && moe.normalize_top_k == norm_topk_prob,
        "{name}: softmax over all experts, top-k, renormalised only with norm_topk_prob"
    );
    let sparse: Vec<usize> = (0..LAYERS).filter(|l| !dense.contains(l)).collect();
    assert_eq!(moe.moe_layers(LAYERS), sparse);

    let want = decoder_reference(&dir, qwen3_moe_mlp);
    for (tp, ep) in [(1, 1), (2, 2)] {
        let export = dir.join(format!("export-tp{tp}-ep{ep}"));
        let got = imported_logits(&dir, tp, ep, (tp * ep > 1).then_some(export.as_path()));
        assert_close(
            &format!("{name} imported at TP = {tp}, EP = {ep}: logits vs the reference"),
            &got,
            &want,
            tolerance::F32,
        );
        if tp * ep > 1 {
            let exported = hf_tensors(&export);
            let mut names: Vec<_> = exported.keys().cloned().collect();
            names.sort();
            assert_eq!(
                names,
                tensors.keys().cloned().collect::<Vec<_>>(),
                "{name}: the export's tensor names"
            );
            for (tensor, values) in &tensors {
                assert!(
                    exported[tensor] == *values,
                    "{name}: exported {tensor} differs from the imported one"
                );
            }
            let again = HfConfig::read(&export).unwrap();
            assert_eq!(again.family, HfFamily::Qwen3Moe);
            assert!(again.config.qk_layernorm);
            assert_eq!(
                format!("{:?}", again.config.moe),
                format!("{:?}", hf.config.moe)
            );
        }
    }
}

/// Qwen3-30B-A3B's shape in small: heads twice as wide as hidden / heads (8 against 4: our
/// `kv_channels`), `norm_topk_prob: false` (the top-k of the softmax over all experts, not
/// renormalised), every layer sparse.
#[test]
fn qwen3_moe_imports_at_any_tp_and_ep_and_exports_back() {
    check_import_and_export("hf-qwen3-moe", false, &[], 8);
}

/// `norm_topk_prob: true`, layer 0 dense (`mlp_only_layers`, with `intermediate_size`), heads
/// of hidden / heads.
#[test]
fn qwen3_moe_with_renormalised_weights_and_a_dense_layer_imports() {
    check_import_and_export("hf-qwen3-moe-dense0", true, &[0], 4);
}

/// Each pipeline stage imports its layers' q/k norms and experts: the loss at TP 2 × PP 2
/// (1F1B's backward through the QK-norm) is the one-rank loss.
#[test]
fn qwen3_moe_imports_across_pipeline_stages() {
    let dir = scratch("hf-qwen3-moe-pp");
    write_checkpoint(
        &dir,
        &qwen3_moe_tensors(&[], 8),
        &config_json(false, &[], 8),
    );
    assert_close(
        "Qwen3-MoE imported at TP = 2, PP = 2: loss",
        &[imported_loss(&dir, 2, 2, 1)],
        &[imported_loss(&dir, 1, 1, 1)],
        tolerance::F32,
    );
}

#[test]
fn qwen3_moe_options_we_lack_are_errors_naming_them() {
    let file = Path::new("/tmp/qwen3/config.json");
    let parse = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut json = config_json(false, &[], 8);
        edit(&mut json);
        HfConfig::parse(&json.to_string(), file)
    };
    let error = |edit: &dyn Fn(&mut serde_json::Value)| parse(edit).unwrap_err().to_string();

    let e = error(&|j| j["use_sliding_window"] = true.into());
    assert!(
        e.contains("/tmp/qwen3/config.json") && e.contains("use_sliding_window"),
        "{e}"
    );
    let e = error(&|j| j["decoder_sparse_step"] = 0.into());
    assert!(e.contains("decoder_sparse_step = 0"), "{e}");
    let e = error(&|j| j["mlp_only_layers"] = serde_json::json!([0, 1]));
    assert!(e.contains("leave no MoE layer"), "{e}");
    let e = error(&|j| j["attention_bias"] = true.into());
    assert!(e.contains("unsupported option attention_bias"), "{e}");
    let e = error(&|j| j["num_experts_per_tok"] = 5.into());
    assert!(
        e.contains("num_experts_per_tok") && e.contains("top_k (5)"),
        "{e}"
    );
    let e = error(&|j| j["model_type"] = "olmoe".into());
    assert!(e.contains("\"olmoe\"") && e.contains("k_norm"), "{e}");

    // transformers 5 writes the experts' count as `num_local_experts` (found on the device
    // machine: read as the default 128, the router's shape then refused).
    let v5 = parse(&|j| {
        let n = j["num_experts"].take();
        j.as_object_mut().unwrap().remove("num_experts");
        j["num_local_experts"] = n;
    })
    .unwrap();
    assert_eq!(v5.config.moe.unwrap().num_experts, EXPERTS);

    // transformers' rule: with decoder_sparse_step 2, layer 1 is sparse and layer 0 dense.
    let every_other = parse(&|j| j["decoder_sparse_step"] = 2.into()).unwrap();
    assert_eq!(every_other.config.moe.unwrap().moe_layers(LAYERS), vec![1]);
    let with_router_loss = parse(&|j| j["output_router_logits"] = true.into()).unwrap();
    assert_eq!(with_router_loss.config.moe.unwrap().aux_loss_coeff, 0.001);

    // Only a Qwen3-MoE's routing exports as one; QK-norm without MoE has no export.
    let config = parse(&|_| {}).unwrap().config;
    let moe = config.moe.clone().unwrap();
    let sigmoid = config.clone().with_moe(Some(
        moe.clone()
            .with_score_function(RouterScoreFunction::Sigmoid),
    ));
    let e = HfConfig::to_json(&sigmoid).unwrap_err();
    assert!(e.contains("a Qwen3-MoE has softmax router scores"), "{e}");
    let e = HfConfig::to_json(&config.clone().with_moe(None)).unwrap_err();
    assert!(e.contains("QK-norm without MoE"), "{e}");
    // Megatron's default routing, the softmax over the k chosen logits, is norm_topk_prob.
    let megatron = config.with_moe(Some(
        moe.with_pre_softmax(false).with_normalize_top_k(false),
    ));
    assert_eq!(
        HfConfig::to_json(&megatron).unwrap()["norm_topk_prob"],
        true
    );
}
