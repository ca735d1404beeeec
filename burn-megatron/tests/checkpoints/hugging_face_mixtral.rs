//! Hugging Face import of Mixtral (`MixtralForCausalLM`): a tiny Mixtral-format checkpoint
//! (per-expert `block_sparse_moe` tensors, random values) is written here with its
//! `config.json`; a transformers-style forward pass from plain Burn ops (softmax over all
//! experts, top-k, the k weights renormalised, every expert run densely and combined) gives
//! the reference logits. Imported at TP 1, EP 2, TP 2 and TP 2 × EP 2 on thread ranks, our
//! logits equal it (f32, 1e-5 relative), and at PP 2 (with EP 2 or TP 2) the loss is the
//! one-rank loss; the export (gathered over TP and EP) writes the same
//! tensors back; transformers 5's fused expert tensors import to the same logits; options we
//! lack are errors naming them.

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::activation::{silu, softmax};
use burn::tensor::{Tensor, TensorData};
use burn_megatron::checkpointing::hugging_face::{HfCheckpoint, HfConfig, HfFamily, export_model};
use burn_megatron::pipeline_parallel::{Schedule, Stage, StageSplit, forward_backward};
use burn_megatron_dist::ParallelSizes;

use super::hugging_face::{Hf, Named, decoder_reference, hf_linear, hf_tensors, tokens};
use crate::{AD, B, BoxError, assert_close, data_values, microbatches, run, scratch, tolerance};

const EXPERTS: usize = 4;
const TOP_K: usize = 2;
const HIDDEN: usize = 16;
const FFN: usize = 12;
const LAYERS: usize = 2;
const VOCAB: usize = 50;

/// A tiny Mixtral's `config.json` (GQA: 4 heads in 2 groups; 4 experts, top 2).
fn config_json() -> serde_json::Value {
    serde_json::json!({
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "max_position_embeddings": 16,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
        "sliding_window": null,
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "output_router_logits": false,
        "router_aux_loss_coef": 0.02,
        "router_jitter_noise": 0.0,
        "torch_dtype": "float32",
    })
}

/// `n` deterministic values in `[center - scale/2, center + scale/2)`.
pub(crate) fn noise(seed: u64, n: usize, center: f32, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = (seed * 1_000_003 + i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            center + ((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

/// The per-expert tensors transformers 4 (and `save_pretrained`) writes, random: norms around
/// 1, weights uniform, the router's larger so that no two of a token's scores are close.
fn mixtral_tensors() -> BTreeMap<String, Named> {
    let mut out = BTreeMap::new();
    let mut add = |name: String, shape: Vec<usize>, center: f32, scale: f32| {
        let seed = out.len() as u64 + 1;
        let values = noise(seed, shape.iter().product(), center, scale);
        out.insert(name, (shape, values));
    };
    let (h, f) = (HIDDEN, FFN);
    add("model.embed_tokens.weight".into(), vec![VOCAB, h], 0.0, 1.0);
    add("model.norm.weight".into(), vec![h], 1.0, 0.4);
    add("lm_head.weight".into(), vec![VOCAB, h], 0.0, 0.5);
    for i in 0..LAYERS {
        let l = |name: &str| format!("model.layers.{i}.{name}");
        add(l("input_layernorm.weight"), vec![h], 1.0, 0.4);
        add(l("post_attention_layernorm.weight"), vec![h], 1.0, 0.4);
        add(l("self_attn.q_proj.weight"), vec![h, h], 0.0, 0.5);
        add(l("self_attn.k_proj.weight"), vec![h / 2, h], 0.0, 0.5);
        add(l("self_attn.v_proj.weight"), vec![h / 2, h], 0.0, 0.5);
        add(l("self_attn.o_proj.weight"), vec![h, h], 0.0, 0.5);
        add(
            l("block_sparse_moe.gate.weight"),
            vec![EXPERTS, h],
            0.0,
            2.0,
        );
        for j in 0..EXPERTS {
            let e = |w: &str| l(&format!("block_sparse_moe.experts.{j}.{w}.weight"));
            add(e("w1"), vec![f, h], 0.0, 0.5);
            add(e("w3"), vec![f, h], 0.0, 0.5);
            add(e("w2"), vec![h, f], 0.0, 0.5);
        }
    }
    out
}

/// Writes `tensors` (f32) and `config` to `dir`.
pub(crate) fn write_checkpoint(
    dir: &Path,
    tensors: &BTreeMap<String, Named>,
    config: &serde_json::Value,
) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, (shape, values))| {
            let b = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (name.clone(), shape.clone(), b)
        })
        .collect();
    let views = bytes.iter().map(|(name, shape, b)| {
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
            .unwrap();
        (name.clone(), view)
    });
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// Mixtral's sparse MoE block as transformers computes it: router logits `x Wᵀ`, softmax over
/// all experts, the top-k, their weights divided by their sum; here every expert runs on every
/// token (`w2(silu(w1 x) · w3 x)`) and a dense `[tokens, experts]` matrix of the weights (zero
/// off the top-k) combines them.
fn sparse_moe_block(hf: &Hf, i: usize, h: Tensor<B, 3>) -> Tensor<B, 3> {
    let [b, s, hidden] = h.dims();
    let tokens = b * s;
    let x = h.reshape([tokens, hidden]);
    let block = format!("model.layers.{i}.block_sparse_moe");
    let (experts, k) = (hf.n("num_local_experts"), hf.n("num_experts_per_tok"));
    let probs = softmax(hf_linear(hf, x.clone(), &format!("{block}.gate.weight")), 1);
    let probs = data_values(&probs.into_data());
    let mut combine = vec![0f32; tokens * experts];
    for t in 0..tokens {
        let row = &probs[t * experts..(t + 1) * experts];
        let mut order: Vec<usize> = (0..experts).collect();
        order.sort_by(|&a, &c| row[c].total_cmp(&row[a]));
        let sum: f64 = order[..k].iter().map(|&e| row[e]).sum();
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
        let w = |name: &str| format!("{block}.experts.{e}.{name}.weight");
        let gated = silu(hf_linear(hf, x.clone(), &w("w1"))) * hf_linear(hf, x.clone(), &w("w3"));
        out = out + hf_linear(hf, gated, &w("w2")) * combine.clone().narrow(1, e, 1);
    }
    out.reshape([b, s, hidden])
}

/// `dir` imported at TP × EP (DP = EP) on thread ranks: the full logits `[2, 8, vocab]` of
/// rank 0 (every rank runs the same tokens). Exported to `export` when given.
pub(crate) fn imported_logits(dir: &Path, tp: usize, ep: usize, export: Option<&Path>) -> Vec<f64> {
    let mut out = run(tp * ep, |ctx| {
        let hf = HfCheckpoint::open(dir)?;
        let config = hf.config().clone();
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(tp).with_ep(ep))?;
        let stage = Stage::whole(config.num_layers);
        let device = Default::default();
        let model = config.init_gpt_stage_with_ep::<B>(state.tp(), state.ep(), &stage, &device)?;
        let model = hf.load_model(model)?;
        let local = model.try_forward(tokens(config.vocab_size))?;
        let full = state
            .tp()
            .all_gather(local, 2)?
            .narrow(2, 0, config.vocab_size);
        if let Some(export) = export {
            export_model(&model, &config, export)?;
        }
        Ok::<_, BoxError>(data_values(&full.into_data()))
    });
    out.swap_remove(0)
}

#[test]
fn mixtral_imports_at_any_tp_and_ep_and_exports_back() {
    let dir = scratch("hf-mixtral");
    let tensors = mixtral_tensors();
    write_checkpoint(&dir, &tensors, &config_json());

    let hf = HfConfig::read(&dir).unwrap();
    assert_eq!(hf.family, HfFamily::Mixtral);
    let moe = hf.config.moe.as_ref().expect("a Mixtral has MoE layers");
    assert_eq!((moe.num_experts, moe.top_k), (EXPERTS, TOP_K));
    assert!(
        moe.pre_softmax && moe.normalize_top_k,
        "Mixtral's softmax over all experts, top-k, renormalised"
    );
    assert_eq!(
        moe.aux_loss_coeff, 0.0,
        "no router loss without output_router_logits"
    );
    assert_eq!(moe.moe_layers(LAYERS), vec![0, 1]);

    let want = decoder_reference(&dir, sparse_moe_block);
    for (tp, ep) in [(1, 1), (1, 2), (2, 1), (2, 2)] {
        let export = dir.join(format!("export-tp{tp}-ep{ep}"));
        let got = imported_logits(&dir, tp, ep, (tp * ep > 1).then_some(export.as_path()));
        assert_close(
            &format!("Mixtral imported at TP = {tp}, EP = {ep}: logits vs the reference"),
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
                "TP = {tp}, EP = {ep}: the export's tensor names"
            );
            for (name, tensor) in &tensors {
                assert!(
                    exported[name] == *tensor,
                    "TP = {tp}, EP = {ep}: exported {name} differs from the imported one"
                );
            }
            let again = HfConfig::read(&export).unwrap();
            assert_eq!(again.family, HfFamily::Mixtral);
            assert_eq!(
                format!("{:?}", again.config.moe),
                format!("{:?}", hf.config.moe)
            );
        }
    }
}

/// transformers 5 keeps a Mixtral's experts fused (`mlp.experts.gate_up_proj` `[E, 2F, H]`,
/// `mlp.experts.down_proj` `[E, H, F]`, the router `mlp.gate`) and can save them so
/// (`save_original_format=False`): that form imports to the same logits.
#[test]
fn mixtral_fused_experts_of_transformers_5_import() {
    let dir = scratch("hf-mixtral-fused");
    let tensors = mixtral_tensors();
    write_checkpoint(&dir, &tensors, &config_json());
    let want = decoder_reference(&dir, sparse_moe_block);

    let mut fused = BTreeMap::new();
    for (name, tensor) in &tensors {
        if !name.contains(".block_sparse_moe.") {
            fused.insert(name.clone(), tensor.clone());
        }
    }
    for i in 0..LAYERS {
        let old = |name: &str| &tensors[&format!("model.layers.{i}.block_sparse_moe.{name}")];
        let new = |name: &str| format!("model.layers.{i}.mlp.{name}");
        fused.insert(new("gate.weight"), old("gate.weight").clone());
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for j in 0..EXPERTS {
            let w = |n: &str| &old(&format!("experts.{j}.{n}.weight")).1;
            gate_up.extend_from_slice(w("w1"));
            gate_up.extend_from_slice(w("w3"));
            down.extend_from_slice(w("w2"));
        }
        fused.insert(
            new("experts.gate_up_proj"),
            (vec![EXPERTS, 2 * FFN, HIDDEN], gate_up),
        );
        fused.insert(new("experts.down_proj"), (vec![EXPERTS, HIDDEN, FFN], down));
    }
    let fused_dir = dir.join("fused");
    write_checkpoint(&fused_dir, &fused, &config_json());
    for (tp, ep) in [(1, 1), (2, 2)] {
        assert_close(
            &format!("fused experts imported at TP = {tp}, EP = {ep}: logits"),
            &imported_logits(&fused_dir, tp, ep, None),
            &want,
            tolerance::F32,
        );
    }
}

/// The mean loss of 1F1B over 4 microbatches of `dir` imported at TP × PP × EP (DP = EP,
/// every DP rank on the same microbatches), from the last stage.
pub(crate) fn imported_loss(dir: &Path, tp: usize, pp: usize, ep: usize) -> f64 {
    let out = run(tp * pp * ep, |ctx| {
        let hf = HfCheckpoint::open(dir)?;
        let config = hf.config().clone();
        let sizes = ParallelSizes::default().with_tp(tp).with_pp(pp).with_ep(ep);
        let state = ctx.parallel_state(sizes)?;
        let stage = StageSplit::even(config.num_layers, pp)?.stage(state.pp_rank());
        let device = Default::default();
        let chunk = config.init_gpt_stage_with_ep::<AD>(state.tp(), state.ep(), &stage, &device)?;
        let chunk = hf.load_model(chunk)?;
        let batches = microbatches(0, 4, config.vocab_size);
        let step = forward_backward(Schedule::OneFOneB, &state, &[chunk], &batches)?;
        Ok::<_, BoxError>(step.loss.map(|l| l.into_scalar() as f64))
    });
    out.into_iter()
        .flatten()
        .next()
        .expect("the last stage reports the loss")
}

/// Pipeline stages import their own layers' experts: the loss at PP 2 (× EP 2, × TP 2) is the
/// one-rank loss.
#[test]
fn mixtral_imports_across_pipeline_stages() {
    let dir = scratch("hf-mixtral-pp");
    write_checkpoint(&dir, &mixtral_tensors(), &config_json());
    let want = imported_loss(&dir, 1, 1, 1);
    for (tp, pp, ep) in [(1, 2, 1), (1, 2, 2), (2, 2, 1)] {
        assert_close(
            &format!("Mixtral imported at TP = {tp}, PP = {pp}, EP = {ep}: loss"),
            &[imported_loss(&dir, tp, pp, ep)],
            &[want],
            tolerance::F32,
        );
    }
}

#[test]
fn mixtral_options_we_lack_are_errors_naming_them() {
    let file = Path::new("/tmp/mixtral/config.json");
    let parse = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut json = config_json();
        edit(&mut json);
        HfConfig::parse(&json.to_string(), file)
    };
    let error = |edit: &dyn Fn(&mut serde_json::Value)| parse(edit).unwrap_err().to_string();

    let e = error(&|j| j["sliding_window"] = 4.into());
    assert!(
        e.contains("/tmp/mixtral/config.json")
            && e.contains("unsupported option sliding_window = 4"),
        "{e}"
    );
    // A window as long as the longest sequence masks nothing.
    assert!(parse(&|j| j["sliding_window"] = 16.into()).is_ok());
    let e = error(&|j| j["router_jitter_noise"] = 0.01.into());
    assert!(
        e.contains("unsupported option router_jitter_noise = 0.01"),
        "{e}"
    );
    let e = error(&|j| j["rope_scaling"] = serde_json::json!({"type": "linear", "factor": 2.0}));
    assert!(e.contains("unsupported option rope_scaling"), "{e}");
    let e = error(&|j| j["num_experts_per_tok"] = 5.into());
    assert!(
        e.contains("num_experts_per_tok") && e.contains("top_k (5)"),
        "{e}"
    );
    let e = error(&|j| j["model_type"] = "olmoe".into());
    assert!(e.contains("\"olmoe\"") && e.contains("k_norm"), "{e}");

    // Top-1 (weight 1 after renormalisation) reads too: the router is pre-softmax.
    assert_eq!(
        parse(&|j| j["num_experts_per_tok"] = 1.into())
            .unwrap()
            .config
            .moe
            .unwrap()
            .top_k,
        1
    );
    let with_router_loss = parse(&|j| j["output_router_logits"] = true.into()).unwrap();
    assert_eq!(with_router_loss.config.moe.unwrap().aux_loss_coeff, 0.02);

    // An MoE model that no Mixtral describes is not exported.
    let config = parse(&|_| {}).unwrap().config;
    let moe = config.moe.clone().unwrap();
    let dense_layer = config.clone().with_moe(Some(
        moe.clone().with_layer_pattern(Some(vec![true, false])),
    ));
    let e = HfConfig::to_json(&dense_layer).unwrap_err();
    assert!(e.contains("an MoE layer in every layer"), "{e}");
    let unnormalised = config
        .clone()
        .with_moe(Some(moe.clone().with_normalize_top_k(false)));
    let e = HfConfig::to_json(&unnormalised).unwrap_err();
    assert!(e.contains("renormalised"), "{e}");
    let grouped = config.clone().with_moe(Some(
        moe.clone()
            .with_num_groups(Some(2))
            .with_group_top_k(Some(1)),
    ));
    let e = HfConfig::to_json(&grouped).unwrap_err();
    assert!(e.contains("group-limited"), "{e}");
    // Megatron's default routing, the softmax over the k chosen logits, is Mixtral's too.
    let megatron = config.with_moe(Some(
        moe.with_pre_softmax(false).with_normalize_top_k(false),
    ));
    assert_eq!(
        HfConfig::to_json(&megatron).unwrap()["model_type"],
        "mixtral"
    );
}
