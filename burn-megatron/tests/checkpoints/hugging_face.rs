//! Hugging Face interop: a tiny GPT-2 and a tiny Llama exported with transformers' names and
//! layouts, checked against a hand-written transformers-style forward pass that reads the
//! exported file (the independent reference for the name and layout mapping: a round trip
//! alone cannot catch a wrong QKV order), then imported at TP = 1, TP = 2 and PP = 2: logits,
//! loss and gradients equal the original model's (f32, 1e-5 relative).

use std::collections::HashMap;
use std::path::Path;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::checkpointing::hugging_face::{HfCheckpoint, HfConfig, export_model};
use burn_megatron::transformer::{Activation, PositionEmbedding, TransformerConfig};

use crate::{
    B, BoxError, assert_close, assert_same_step, build, data_values, merge, microbatches, run,
    scratch, step, tiny_gpt, tiny_llama, tolerance,
};

type Step = (f64, std::collections::BTreeMap<String, TensorData>);

/// A tensor of a safetensors file: shape and f32 values.
pub(crate) type Named = (Vec<usize>, Vec<f32>);

fn gpt2() -> TransformerConfig {
    tiny_gpt().with_activation(Activation::GeluTanh)
}

/// Fixed `[2, 8]` tokens.
pub(crate) fn tokens<Bk: Backend>(vocab: usize) -> Tensor<Bk, 2, Int> {
    let ids: Vec<i64> = (0..16).map(|i| ((i * 7 + 3) % vocab) as i64).collect();
    Tensor::from_data(TensorData::new(ids, [2, 8]), &Default::default())
}

/// Adds deterministic noise to every parameter: norms and biases start at 1 and 0, which
/// would hide a swapped scale/shift or a misplaced bias.
struct Perturb(u64);

impl<Bk: Backend> ModuleMapper<Bk> for Perturb {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<Bk, D>>) -> Param<Tensor<Bk, D>> {
        self.0 += 1;
        let seed = self.0;
        param.map(|t| {
            let require_grad = t.is_require_grad();
            let shape = t.shape();
            let values: Vec<f32> = t
                .into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .unwrap()
                .into_iter()
                .enumerate()
                .map(|(i, v)| {
                    let h = (seed * 1_000_003 + i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    v + ((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
                })
                .collect();
            let new = Tensor::from_data(TensorData::new(values, shape), &Default::default());
            if require_grad {
                new.require_grad()
            } else {
                new
            }
        })
    }
}

/// The original model (TP = 1, perturbed): exported to `dir`; its logits `[2, 8, vocab]` and
/// its step.
fn original(config: &TransformerConfig, dir: &Path) -> (Vec<f64>, Step) {
    let mut out = run(1, |ctx| {
        let (state, chunks) = build(&ctx, config, 1, 1)?;
        let model = chunks.into_iter().next().unwrap().map(&mut Perturb(0));
        let logits = model
            .try_forward(tokens(config.vocab_size))?
            .narrow(2, 0, config.vocab_size);
        export_model(&model, config, dir)?;
        let outcome = step(&state, &[model], &microbatches(0, 4, config.vocab_size))?.0;
        Ok((data_values(&logits.into_data()), outcome))
    });
    let (logits, outcome) = out.pop().unwrap();
    (logits, merge(vec![outcome]))
}

/// Imports `dir` at TP × PP: the full logits (PP = 1 only) and the step. At PP = 1 the
/// imported model is exported again to `dir/re-export-tp{tp}`.
fn imported(dir: &Path, tp: usize, pp: usize) -> (Option<Vec<f64>>, Step) {
    let out = run(tp * pp, |ctx| {
        let hf = HfCheckpoint::open(dir)?;
        let config = hf.config().clone();
        let vocab = config.vocab_size;
        let (state, chunks) = build(&ctx, &config, tp, pp)?;
        let chunks = chunks
            .into_iter()
            .map(|c| hf.load_model(c))
            .collect::<Result<Vec<_>, _>>()?;
        let logits = if pp == 1 {
            let local = chunks[0].try_forward(tokens(vocab))?.inner();
            let full = state.tp().all_gather(local, 2)?.narrow(2, 0, vocab);
            export_model(&chunks[0], &config, &dir.join(format!("re-export-tp{tp}")))?;
            Some(data_values(&full.into_data()))
        } else {
            None
        };
        let outcome = step(&state, &chunks, &microbatches(0, 4, vocab))?.0;
        Ok::<_, BoxError>((logits, outcome))
    });
    let logits = out.iter().find_map(|(l, _)| l.clone());
    (logits, merge(out.into_iter().map(|(_, o)| o).collect()))
}

fn round_trip(name: &str, config: TransformerConfig, reference: fn(&Path) -> Vec<f64>) {
    let dir = scratch(&format!("hf-{name}"));
    let (logits, want) = original(&config, &dir);
    assert_close(
        &format!("{name}: transformers-style reference forward of the exported file"),
        &reference(&dir),
        &logits,
        tolerance::F32,
    );
    for (tp, pp) in [(1, 1), (2, 1), (1, 2)] {
        let what = format!("{name} imported at TP = {tp}, PP = {pp}");
        let (got_logits, got) = imported(&dir, tp, pp);
        if let Some(got_logits) = got_logits {
            assert_close(
                &format!("{what}: logits"),
                &got_logits,
                &logits,
                tolerance::F32,
            );
        }
        assert_same_step(&what, &got, &want);
        if pp == 1 {
            let weights = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
            let again = dir.join(format!("re-export-tp{tp}"));
            assert!(
                weights(&dir) == weights(&again),
                "{what}: exported again, the weights are not bit-identical"
            );
        }
    }
}

#[test]
fn gpt2_exports_to_transformers_layout_and_imports_at_any_layout() {
    round_trip("gpt2", gpt2(), gpt2_reference);
}

#[test]
fn llama_exports_to_transformers_layout_and_imports_at_any_layout() {
    round_trip("llama", tiny_llama(), llama_reference);
}

#[test]
fn tied_llama_exports_without_lm_head_and_imports_at_any_layout() {
    let config = tiny_llama().with_tie_embeddings(true);
    round_trip("llama-tied", config, llama_reference);
}

/// The tensors of `dir/model.safetensors` by name.
pub(crate) fn hf_tensors(dir: &Path) -> HashMap<String, Named> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

/// Reads HF-named tensors for the reference forward passes.
pub(crate) struct Hf(pub HashMap<String, Named>, pub serde_json::Value);

impl Hf {
    pub fn open(dir: &Path) -> Self {
        let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
        Self(hf_tensors(dir), serde_json::from_str(&config).unwrap())
    }
    pub fn get<const D: usize>(&self, name: &str) -> Tensor<B, D> {
        let (shape, values) = self
            .0
            .get(name)
            .unwrap_or_else(|| panic!("no tensor {name}"));
        Tensor::from_data(
            TensorData::new(values.clone(), shape.clone()),
            &Default::default(),
        )
    }
    pub fn n(&self, key: &str) -> usize {
        self.1[key].as_u64().unwrap() as usize
    }
    fn f(&self, key: &str) -> f64 {
        self.1[key].as_f64().unwrap()
    }
}

/// `[1, 1, s, s]`: 0 on and below the diagonal, a large negative number above.
fn causal_mask(s: usize) -> Tensor<B, 4> {
    let values: Vec<f32> = (0..s * s)
        .map(|i| if i % s > i / s { -1e9 } else { 0.0 })
        .collect();
    Tensor::from_data(TensorData::new(values, [1, 1, s, s]), &Default::default())
}

/// Softmax attention of `[b, heads, s, d]` queries, keys and values, causal.
fn attend(q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Tensor<B, 4> {
    let [_, _, s, d] = q.dims();
    let scores = q.matmul(k.swap_dims(2, 3)) / (d as f64).sqrt() + causal_mask(s);
    softmax(scores, 3).matmul(v)
}

/// A GPT-2 forward pass as transformers' `GPT2LMHeadModel` computes it, from the HF-named
/// tensors: Conv1D `x @ W + b`, `c_attn` split into `q | k | v`, `gelu_new`, `ln_f`, the
/// output tied to `wte`. Logits `[2, 8, vocab]`.
fn gpt2_reference(dir: &Path) -> Vec<f64> {
    let hf = Hf::open(dir);
    let (hidden, heads, eps) = (hf.n("n_embd"), hf.n("n_head"), hf.f("layer_norm_epsilon"));
    let head_dim = hidden / heads;
    let tokens = tokens::<B>(hf.n("vocab_size"));
    let [b, s] = tokens.dims();
    let t = |name: &str| format!("transformer.{name}");
    let layer_norm = |x: Tensor<B, 3>, name: &str| {
        let centred = x.clone() - x.mean_dim(2);
        let var = centred.clone().powi_scalar(2).mean_dim(2);
        centred / (var + eps).sqrt() * hf.get::<1>(&t(&format!("{name}.weight"))).unsqueeze()
            + hf.get::<1>(&t(&format!("{name}.bias"))).unsqueeze()
    };
    let conv1d = |x: Tensor<B, 3>, name: &str| {
        x.matmul(hf.get::<2>(&t(&format!("{name}.weight"))).unsqueeze())
            + hf.get::<1>(&t(&format!("{name}.bias"))).unsqueeze()
    };
    let gelu_new = |x: Tensor<B, 3>| {
        let inner =
            (x.clone() + x.clone().powi_scalar(3) * 0.044715) * (2.0 / std::f64::consts::PI).sqrt();
        x * 0.5 * (inner.tanh() + 1.0)
    };
    let wte = hf.get::<2>(&t("wte.weight"));
    let mut x = wte
        .clone()
        .select(0, tokens.reshape([b * s]))
        .reshape([b, s, hidden])
        + hf.get::<2>(&t("wpe.weight")).narrow(0, 0, s).unsqueeze();
    for i in 0..hf.n("n_layer") {
        let h = |name: &str| format!("h.{i}.{name}");
        let qkv = conv1d(layer_norm(x.clone(), &h("ln_1")), &h("attn.c_attn"));
        let split = |part: usize| {
            qkv.clone()
                .narrow(2, part * hidden, hidden)
                .reshape([b, s, heads, head_dim])
                .swap_dims(1, 2)
        };
        let context = attend(split(0), split(1), split(2))
            .swap_dims(1, 2)
            .reshape([b, s, hidden]);
        x = x + conv1d(context, &h("attn.c_proj"));
        let up = gelu_new(conv1d(layer_norm(x.clone(), &h("ln_2")), &h("mlp.c_fc")));
        x = x + conv1d(up, &h("mlp.c_proj"));
    }
    let logits = layer_norm(x, "ln_f").matmul(wte.transpose().unsqueeze());
    data_values(&logits.into_data())
}

/// A Llama forward pass as transformers' `LlamaForCausalLM` computes it, from the HF-named
/// tensors: `nn.Linear` `x @ Wᵀ`, RMSNorm, rotate-half RoPE, key/value heads repeated for
/// their query groups, SwiGLU, an untied `lm_head`. Logits `[2, 8, vocab]`.
fn llama_reference(dir: &Path) -> Vec<f64> {
    decoder_reference(dir, |hf, i, h| {
        let l = |name: &str| format!("model.layers.{i}.mlp.{name}");
        let gated = silu(hf_linear(hf, h.clone(), &l("gate_proj.weight")))
            * hf_linear(hf, h, &l("up_proj.weight"));
        hf_linear(hf, gated, &l("down_proj.weight"))
    })
}

/// `x @ Wᵀ` with transformers' `nn.Linear` weight `name` (`[out, in]`).
pub(crate) fn hf_linear<const D: usize>(hf: &Hf, x: Tensor<B, D>, name: &str) -> Tensor<B, D> {
    x.matmul(hf.get::<2>(name).transpose().unsqueeze())
}

/// The forward pass of a Llama-shaped transformers model (Llama, Mixtral, Qwen3-MoE) from its
/// HF-named tensors, with `mlp(hf, layer, normed)` the MLP of each layer (`[b, s, hidden]` in
/// and out). Where the file has `self_attn.q_norm` / `k_norm` (Qwen3), each query and key
/// head is RMS-normalised over its `head_dim` before RoPE. Logits `[2, 8, vocab]`.
pub(crate) fn decoder_reference(
    dir: &Path,
    mlp: impl Fn(&Hf, usize, Tensor<B, 3>) -> Tensor<B, 3>,
) -> Vec<f64> {
    let hf = Hf::open(dir);
    let (hidden, heads, groups) = (
        hf.n("hidden_size"),
        hf.n("num_attention_heads"),
        hf.n("num_key_value_heads"),
    );
    let (eps, theta) = (hf.f("rms_norm_eps"), hf.f("rope_theta"));
    // Qwen3's heads may be wider than hidden / heads.
    let head_dim = hf.1["head_dim"]
        .as_u64()
        .map_or(hidden / heads, |d| d as usize);
    let tokens = tokens::<B>(hf.n("vocab_size"));
    let [b, s] = tokens.dims();
    let linear = |x: Tensor<B, 3>, name: &str| x.matmul(hf.get::<2>(name).transpose().unsqueeze());
    let rms_norm = |x: Tensor<B, 3>, name: &str| {
        let ms = x.clone().powi_scalar(2).mean_dim(2);
        x / (ms + eps).sqrt() * hf.get::<1>(name).unsqueeze()
    };
    // cos/sin `[1, 1, s, head_dim]`: position p, frequency theta^(-2i / head_dim), repeated
    // for both halves.
    let half = head_dim / 2;
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for p in 0..s {
        for j in 0..head_dim {
            let angle = p as f64 * theta.powf(-2.0 * (j % half) as f64 / head_dim as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    let table = |v: Vec<f32>| -> Tensor<B, 4> {
        Tensor::from_data(TensorData::new(v, [1, 1, s, head_dim]), &Default::default())
    };
    let (cos, sin) = (table(cos), table(sin));
    let rotate_half = |x: Tensor<B, 4>| {
        Tensor::cat(
            vec![x.clone().narrow(3, half, half).neg(), x.narrow(3, 0, half)],
            3,
        )
    };
    let rope = |x: Tensor<B, 4>| x.clone() * cos.clone() + rotate_half(x) * sin.clone();
    // `[b, heads, s, head_dim]`, each head's vector normalised, as Qwen3's q_norm / k_norm.
    let head_norm = |x: Tensor<B, 4>, name: &str| match hf.0.contains_key(name) {
        true => {
            let ms = x.clone().powi_scalar(2).mean_dim(3);
            x / (ms + eps).sqrt() * hf.get::<1>(name).unsqueeze()
        }
        false => x,
    };
    let repeat_kv = |x: Tensor<B, 4>| {
        let per_group = heads / groups;
        Tensor::cat(
            (0..heads)
                .map(|h| x.clone().narrow(1, h / per_group, 1))
                .collect(),
            1,
        )
    };
    let mut x = hf
        .get::<2>("model.embed_tokens.weight")
        .select(0, tokens.reshape([b * s]))
        .reshape([b, s, hidden]);
    for i in 0..hf.n("num_hidden_layers") {
        let l = |name: &str| format!("model.layers.{i}.{name}");
        let h = rms_norm(x.clone(), &l("input_layernorm.weight"));
        let project = |name: &str, n: usize| {
            linear(h.clone(), &l(name))
                .reshape([b, s, n, head_dim])
                .swap_dims(1, 2)
        };
        let q = project("self_attn.q_proj.weight", heads);
        let k = project("self_attn.k_proj.weight", groups);
        let q = rope(head_norm(q, &l("self_attn.q_norm.weight")));
        let k = rope(head_norm(k, &l("self_attn.k_norm.weight")));
        let v = project("self_attn.v_proj.weight", groups);
        let context = attend(q, repeat_kv(k), repeat_kv(v))
            .swap_dims(1, 2)
            .reshape([b, s, heads * head_dim]);
        x = x + linear(context, &l("self_attn.o_proj.weight"));
        let h = rms_norm(x.clone(), &l("post_attention_layernorm.weight"));
        x = x + mlp(&hf, i, h);
    }
    // A tied Llama's file has no lm_head: transformers reuses the token embeddings.
    let head = match hf.0.contains_key("lm_head.weight") {
        true => "lm_head.weight",
        false => "model.embed_tokens.weight",
    };
    let logits = linear(rms_norm(x, "model.norm.weight"), head);
    data_values(&logits.into_data())
}

/// Rewrites `dir/model.safetensors` through `edit` (name → tensor, `None` drops it).
pub(crate) fn rewrite(dir: &Path, edit: impl Fn(&str, Named) -> Option<Named>) {
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = hf_tensors(dir)
        .into_iter()
        .filter_map(|(name, t)| {
            let (shape, values) = edit(&name, t)?;
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            Some((name, shape, bytes))
        })
        .collect();
    let views = tensors.iter().map(|(name, shape, bytes)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                .unwrap();
        (name.clone(), view)
    });
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// The error of importing `dir` into a TP = 1 model.
fn import_error(dir: &Path) -> String {
    run(1, |ctx| {
        let hf = HfCheckpoint::open(dir)?;
        let (_, chunks) = build(&ctx, hf.config(), 1, 1)?;
        let chunk = chunks.into_iter().next().unwrap();
        Ok(hf.load_model(chunk).map(|_| ()).unwrap_err().to_string())
    })
    .pop()
    .unwrap()
}

#[test]
fn broken_transformers_checkpoints_are_refused_naming_file_and_tensor() {
    let dir = scratch("hf-broken");
    original(&gpt2(), &dir);
    let weights = dir.join("model.safetensors").display().to_string();

    let qkv = "transformer.h.1.attn.c_attn.weight";
    rewrite(&dir, |name, t| (name != qkv).then_some(t));
    let error = import_error(&dir);
    assert!(
        error.contains(&weights) && error.contains(&format!("tensor {qkv} is missing")),
        "{error}"
    );

    original(&gpt2(), &dir);
    rewrite(&dir, |name, (shape, values)| {
        Some(if name == "transformer.wte.weight" {
            (vec![shape[0] - 1, shape[1]], values[shape[1]..].to_vec())
        } else {
            (shape, values)
        })
    });
    let error = import_error(&dir);
    assert!(
        error.contains(&weights)
            && error.contains(
                "tensor transformer.wte.weight has shape [49, 16], the model needs [50, 16]"
            ),
        "{error}"
    );

    let file = dir.join("config.json");
    let text = r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 50,
        "rope_scaling": {"type": "linear", "factor": 2.0}}"#;
    let error = HfConfig::parse(text, &file).unwrap_err().to_string();
    assert!(
        error.contains(&file.display().to_string())
            && error.contains("unsupported option rope_scaling"),
        "{error}"
    );
    let default_rope = text.replace(
        r#""type": "linear", "factor": 2.0"#,
        r#""rope_type": "default", "rope_theta": 500000.0"#,
    );
    let rope = HfConfig::parse(&default_rope, &file)
        .unwrap()
        .config
        .position_embedding;
    assert_eq!(rope, PositionEmbedding::Rope { base: 500_000.0 });
    let error = HfConfig::parse(r#"{"model_type": "gpt2", "n_embd": 16}"#, &file)
        .unwrap_err()
        .to_string();
    assert!(error.contains("key n_layer is missing"), "{error}");
}

/// The weights split over two files listed in `model.safetensors.index.json`, as transformers
/// saves large models, import to the same logits.
#[test]
fn sharded_transformers_checkpoints_import() {
    let dir = scratch("hf-sharded");
    let (logits, _) = original(&tiny_llama(), &dir);
    let tensors = hf_tensors(&dir);
    let mut weight_map = serde_json::Map::new();
    let mut shards: [Vec<(String, Named)>; 2] = Default::default();
    for (i, (name, tensor)) in tensors.into_iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i % 2 + 1);
        weight_map.insert(name.clone(), file.into());
        shards[i % 2].push((name, tensor));
    }
    for (i, shard) in shards.iter().enumerate() {
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = shard
            .iter()
            .map(|(n, (s, v))| {
                (
                    n.clone(),
                    s.clone(),
                    v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                )
            })
            .collect();
        let views = bytes.iter().map(|(n, s, b)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .unwrap();
            (n.clone(), view)
        });
        let file = dir.join(format!("model-{:05}-of-00002.safetensors", i + 1));
        safetensors::serialize_to_file(views, None, &file).unwrap();
    }
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let (got, _) = imported(&dir, 2, 1);
    assert_close(
        "sharded files, TP = 2: logits",
        &got.unwrap(),
        &logits,
        tolerance::F32,
    );
}

/// A bf16 file (as most Hugging Face checkpoints are) imports to the same model as the f32
/// file of the same, bf16-rounded, values.
#[test]
fn bf16_transformers_checkpoints_import() {
    let dir = scratch("hf-bf16");
    original(&gpt2(), &dir);
    // bf16 is the upper half of an f32: truncating the f32 bits gives the same number.
    let bf16 = |v: f32| f32::from_bits(v.to_bits() & 0xFFFF_0000);
    rewrite(&dir, |_, (shape, values)| {
        Some((shape, values.into_iter().map(bf16).collect()))
    });
    let (want, _) = imported(&dir, 1, 1);
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = hf_tensors(&dir)
        .into_iter()
        .map(|(name, (shape, values))| {
            let bytes = values
                .iter()
                .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                .collect();
            (name, shape, bytes)
        })
        .collect();
    let views = tensors.iter().map(|(name, shape, bytes)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape.clone(), bytes)
                .unwrap();
        (name.clone(), view)
    });
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let (got, _) = imported(&dir, 2, 1);
    assert_close(
        "bf16 file at TP = 2 vs the f32 file: logits",
        &got.unwrap(),
        &want.unwrap(),
        tolerance::F32,
    );
}
