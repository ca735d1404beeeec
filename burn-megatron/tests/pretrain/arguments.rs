//! Options from the command line and a TOML file, and the errors of bad ones: each names
//! the option and what would be valid, before any rank starts.

use burn_megatron::optimizer::LrDecayStyle;
use burn_megatron::pipeline_parallel::Schedule;
use burn_megatron::training::{PretrainArgs, PretrainConfig, Silent, pretrain_on_threads};
use clap::Parser;

use crate::scratch;

fn parse(args: &[&str]) -> PretrainArgs {
    PretrainArgs::try_parse_from(std::iter::once("pretrain_gpt").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

fn config(args: &[&str]) -> PretrainConfig {
    parse(args).into_config().unwrap()
}

fn error(config: &PretrainConfig) -> String {
    config.check(config.world_size()).unwrap_err().to_string()
}

#[test]
fn no_options_is_the_embedded_default_run() {
    let c = config(&[]);
    assert_eq!(
        (c.tensor_model_parallel_size, c.pipeline_model_parallel_size),
        (2, 2)
    );
    assert!(c.data_path.is_empty() && c.save.is_none() && c.load.is_none());
    let layout = c.check(4).unwrap();
    assert_eq!(layout.num_microbatches, 4);
}

#[test]
fn megatron_option_names() {
    let c = config(&[
        "--num-layers",
        "8",
        "--hidden-size",
        "128",
        "--num-attention-heads",
        "8",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "12",
        "--tensor-model-parallel-size",
        "4",
        "--pipeline-model-parallel-size",
        "1",
        "--sequence-parallel",
        "--lr",
        "0.001",
        "--min-lr",
        "0.0001",
        "--lr-warmup-iters",
        "5",
        "--lr-decay-style",
        "linear",
        "--train-iters",
        "50",
        "--eval-interval",
        "10",
        "--eval-iters",
        "3",
        "--save",
        "ck",
        "--save-interval",
        "20",
        "--load",
        "ck",
        "--data-path",
        "0.3",
        "a_text_document",
        "0.7",
        "b_text_document",
        "--split",
        "98,2,0",
        "--seed",
        "7",
    ]);
    assert_eq!(
        (c.num_layers, c.hidden_size, c.num_attention_heads),
        (8, 128, 8)
    );
    assert_eq!(
        (c.seq_length, c.micro_batch_size, c.global_batch_size),
        (32, 2, 12)
    );
    assert_eq!(
        (c.tensor_model_parallel_size, c.pipeline_model_parallel_size),
        (4, 1)
    );
    assert!(c.sequence_parallel);
    assert_eq!((c.lr, c.min_lr, c.lr_warmup_iters), (0.001, 0.0001, 5));
    assert_eq!(c.lr_decay_style, LrDecayStyle::Linear);
    assert_eq!((c.train_iters, c.eval_interval, c.eval_iters), (50, 10, 3));
    assert_eq!(c.save.as_deref(), Some(std::path::Path::new("ck")));
    assert_eq!(c.save_interval, Some(20));
    assert_eq!(c.load.as_deref(), Some(std::path::Path::new("ck")));
    assert_eq!(
        c.data_path,
        ["0.3", "a_text_document", "0.7", "b_text_document"]
    );
    assert_eq!((c.split.as_str(), c.seed), ("98,2,0", 7));
    assert_eq!(c.check(4).unwrap().num_microbatches, 6);
}

#[test]
fn toml_file_under_the_command_line() {
    let dir = scratch("toml");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("run.toml");
    std::fs::write(
        &file,
        "num-layers = 6\nhidden-size = 96\ntrain-iters = 30\nsequence-parallel = true\n\
         lr-decay-style = \"constant\"\ndata-path = [\"x_text_document\"]\n",
    )
    .unwrap();
    let c = config(&["--config", file.to_str().unwrap(), "--train-iters", "40"]);
    assert_eq!((c.num_layers, c.hidden_size), (6, 96));
    assert_eq!(c.train_iters, 40, "the command line wins");
    assert!(c.sequence_parallel);
    assert_eq!(c.lr_decay_style, LrDecayStyle::Constant);
    assert_eq!(c.data_path, ["x_text_document"]);

    std::fs::write(&file, "num-layer = 6\n").unwrap();
    let e = parse(&["--config", file.to_str().unwrap()])
        .into_config()
        .unwrap_err()
        .to_string();
    assert!(e.contains("num-layer") && e.contains("run.toml"), "{e}");
    std::fs::write(&file, "num-layers = \"six\"\n").unwrap();
    let e = parse(&["--config", file.to_str().unwrap()])
        .into_config()
        .unwrap_err()
        .to_string();
    assert!(e.contains("num-layers"), "{e}");
    let e = parse(&["--config", dir.join("missing.toml").to_str().unwrap()])
        .into_config()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("missing.toml") && e.contains("cannot read"),
        "{e}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// The Llama options (Megatron's names) reach the model's configuration, and their mistakes
/// are errors naming the option.
#[test]
fn llama_options_are_megatrons() {
    use burn_megatron::transformer::{Activation, Normalization, PositionEmbedding, Recompute};
    let c = config(&[
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--norm-epsilon",
        "1e-6",
        "--qk-layernorm",
        "--kv-channels",
        "32",
        "--position-embedding-type",
        "rope",
        "--rotary-base",
        "500000",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
        "--no-save",
    ]);
    let m = c.model();
    assert_eq!(m.activation, Activation::SwiGlu);
    assert_eq!(m.normalization, Normalization::RmsNorm);
    assert_eq!(m.norm_epsilon, 1e-6);
    assert!(m.qk_layernorm, "--qk-layernorm");
    assert_eq!(
        (m.kv_channels, m.head_dim()),
        (Some(32), 32),
        "--kv-channels"
    );
    assert!(
        !config(&[]).model().qk_layernorm,
        "QK-norm is off by default"
    );
    assert_eq!(
        m.position_embedding,
        PositionEmbedding::Rope { base: 500_000.0 }
    );
    assert_eq!(m.num_query_groups, Some(2));
    assert!(!m.tie_embeddings && !m.add_bias_linear);
    assert_eq!(m.recompute, Recompute::Full);
    // Megatron's SwiGLU width: 4h · 2/3, down to a multiple of 64 (h = 64 here).
    assert_eq!(m.ffn_hidden_size, 128);
    assert!(c.no_save);
    c.check(4).unwrap();
    assert_eq!(
        config(&["--recompute-activations"]).model().recompute,
        Recompute::Selective
    );
    let m = config(&[]).model();
    assert_eq!(
        (
            m.activation,
            m.normalization,
            m.position_embedding,
            m.recompute
        ),
        (
            Activation::Gelu,
            Normalization::LayerNorm,
            PositionEmbedding::Learned,
            Recompute::None
        )
    );
    assert!(m.tie_embeddings && m.add_bias_linear && m.num_query_groups.is_none());

    let into_error = |args: &[&str]| parse(args).into_config().unwrap_err().to_string();
    for (args, says) in [
        (
            &["--normalization", "batchnorm"][..],
            "LayerNorm or RMSNorm",
        ),
        (
            &["--position-embedding-type", "alibi"],
            "learned_absolute or rope",
        ),
        (&["--rotary-base", "1000"], "--position-embedding-type rope"),
        (
            &["--position-embedding-type", "rope", "--rotary-base", "NaN"],
            "--rotary-base",
        ),
        (&["--num-query-groups", "2"], "--group-query-attention"),
        (&["--recompute-granularity", "most"], "selective or full"),
        (&["--recompute-method", "uniform"], "full only"),
        (
            &[
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "some",
            ],
            "use uniform or block",
        ),
        (&["--recompute-num-layers", "2"], "full only"),
    ] {
        let e = into_error(args);
        assert!(e.contains(says), "{args:?}: {e}");
    }
    let e = error(&config(&[
        "--group-query-attention",
        "--num-query-groups",
        "3",
    ]));
    assert!(e.contains("3"), "{e}");
    let e = error(&config(&["--no-save", "--save", "x"]));
    assert!(e.contains("--no-save"), "{e}");
}

/// The presets under examples/configs parse, and each is a valid run at its layout: the 7-8B
/// ones of issue 31, the long-sequence 1B Llama of issue 35 and the MoE models of issue 34.
#[test]
fn preset_files_are_valid_runs() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/configs");
    let mut presets = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let c = config(&["--config", path.to_str().unwrap()]);
        let layout = c
            .check(c.world_size())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let name = path.file_name().unwrap().to_str().unwrap();
        let (layers, hidden) = match name {
            "llama_1b_long.toml" | "mixtral_1b_moe.toml" | "deepseek_moe_1b.toml" => (16, 2048),
            _ => (32, 4096),
        };
        assert!(
            c.num_layers == layers && c.hidden_size == hidden,
            "{}",
            path.display()
        );
        assert!(layout.num_microbatches >= 1);
        presets += 1;
    }
    assert_eq!(
        presets, 5,
        "llama3_8b.toml, gpt3_6.7b.toml, llama_1b_long.toml, mixtral_1b_moe.toml and \
         deepseek_moe_1b.toml"
    );
    let llama = config(&["--config", dir.join("llama3_8b.toml").to_str().unwrap()]).model();
    assert_eq!(
        (
            llama.query_groups(),
            llama.ffn_hidden_size,
            llama.vocab_size
        ),
        (8, 14_336, 128_256)
    );
    assert!(!llama.tie_embeddings);
}

#[test]
fn bad_options_are_clear_errors() {
    assert!(PretrainArgs::try_parse_from(["pretrain_gpt", "--num-layers", "x"]).is_err());
    assert!(PretrainArgs::try_parse_from(["pretrain_gpt", "--no-such-option"]).is_err());

    let e = error(&config(&["--global-batch-size", "10"]));
    assert!(
        e.contains("--global-batch-size (10) must be divisible by --micro-batch-size (4)"),
        "{e}"
    );
    let e = error(&config(&["--tensor-model-parallel-size", "3"]));
    assert!(
        e.contains("attention heads (4) must be divisible by TP (3)")
            && e.contains("valid TP sizes are 1, 2, 4"),
        "{e}"
    );
    let e = error(&config(&["--num-layers", "3"]));
    assert!(e.contains("--num-layers (3)") && e.contains("(2)"), "{e}");
    let e = error(&config(&["--seq-length", "15", "--sequence-parallel"]));
    assert!(e.contains("divisible by TP (2)"), "{e}");
    let e = error(&config(&["--tp-comm-overlap"]));
    assert!(
        e.contains("--tp-comm-overlap") && e.contains("add --sequence-parallel"),
        "{e}"
    );
    let e = error(&config(&[
        "--tp-comm-overlap",
        "--sequence-parallel",
        "--fp8-format",
        "hybrid",
    ]));
    assert!(
        e.contains("--tp-comm-overlap does not run the FP8 layers"),
        "{e}"
    );
    let e = error(&config(&["--lr-warmup-iters", "100"]));
    assert!(
        e.contains("--lr-decay-iters (100") && e.contains("--lr-warmup-iters (100)"),
        "{e}"
    );
    let e = error(&config(&["--min-lr", "1", "--lr", "0.1"]));
    assert!(e.contains("min_lr"), "{e}");
    let e = error(&config(&["--save-interval", "5"]));
    assert!(e.contains("--save-interval needs --save"), "{e}");
    let e = error(&config(&["--split", "a,b"]));
    assert!(e.contains("--split"), "{e}");
    let e = error(&config(&["--data-path", "0.5", "a", "b"]));
    assert!(e.contains("pairs of `weight prefix`"), "{e}");
    let e = error(&config(&["--vocab-size", "100"]));
    assert!(e.contains("--vocab-size (100)"), "{e}");
    let e = parse(&["--lr-decay-style", "exponential"])
        .into_config()
        .unwrap_err()
        .to_string();
    assert!(e.contains("constant, linear or cosine"), "{e}");
    let e = config(&[]).check(8).unwrap_err().to_string();
    assert!(e.contains("--data-parallel-size is 1"), "{e}");
    let dp = config(&["--data-parallel-size", "2", "--use-distributed-optimizer"]);
    assert_eq!(dp.world_size(), 8);
    assert!(dp.use_distributed_optimizer);
    assert!(!dp.overlap_grad_reduce);
    assert!(config(&["--overlap-grad-reduce"]).overlap_grad_reduce);
    assert!(dp.collective_checks, "on by default");
    assert!(!config(&["--collective-checks", "false"]).collective_checks);
    assert_eq!(dp.check(8).unwrap().dp, 2);
    let saved = config(&["--data-parallel-size", "2", "--save", "x", "--async-save"]);
    assert_eq!(saved.check(8).unwrap().dp, 2);
    assert!(saved.async_save);

    // The launcher refuses before starting ranks, and a missing dataset is named.
    let e = pretrain_on_threads(&config(&["--global-batch-size", "6"]), &Silent)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--global-batch-size (6)"), "{e}");
    let e = pretrain_on_threads(&config(&["--data-path", "/nonexistent/x"]), &Silent)
        .unwrap_err()
        .to_string();
    assert!(e.contains("/nonexistent/x"), "{e}");
}

/// Every out-of-range setting is an error naming its option and the valid range, NaN and
/// infinity included, whichever optimizer the run steps (Burn's AdamW at the default layout,
/// the flat one with `--use-distributed-optimizer`), before any rank starts.
#[test]
fn out_of_range_settings_name_the_option_and_the_range() {
    for (args, option, range) in [
        (&["--adam-beta1", "1"][..], "--adam-beta1", "[0, 1)"),
        (&["--adam-beta1=-0.1"], "--adam-beta1", "[0, 1)"),
        (&["--adam-beta1", "NaN"], "--adam-beta1", "[0, 1)"),
        (&["--adam-beta2", "1.5"], "--adam-beta2", "[0, 1)"),
        (&["--adam-beta2", "NaN"], "--adam-beta2", "[0, 1)"),
        (&["--adam-eps", "0"], "--adam-eps", "positive and finite"),
        (&["--adam-eps=-1e-8"], "--adam-eps", "positive and finite"),
        (&["--adam-eps", "NaN"], "--adam-eps", "positive and finite"),
        (&["--adam-eps", "inf"], "--adam-eps", "positive and finite"),
        (
            &["--weight-decay=-0.01"],
            "--weight-decay",
            "finite and at least 0",
        ),
        (
            &["--weight-decay", "NaN"],
            "--weight-decay",
            "finite and at least 0",
        ),
        (
            &["--weight-decay", "inf"],
            "--weight-decay",
            "finite and at least 0",
        ),
        (
            &["--init-method-std", "0"],
            "--init-method-std",
            "positive and finite",
        ),
        (
            &["--init-method-std=-0.02"],
            "--init-method-std",
            "positive and finite",
        ),
        (
            &["--init-method-std", "NaN"],
            "--init-method-std",
            "positive and finite",
        ),
        (
            &["--init-method-std", "inf"],
            "--init-method-std",
            "positive and finite",
        ),
        (&["--norm-epsilon", "0"], "norm_epsilon", "must be positive"),
        (
            &["--norm-epsilon", "NaN"],
            "--norm-epsilon",
            "positive and finite",
        ),
        (
            &["--norm-epsilon", "inf"],
            "--norm-epsilon",
            "positive and finite",
        ),
        (&["--clip-grad", "0"], "--clip-grad", "positive and finite"),
        (
            &["--clip-grad", "NaN"],
            "--clip-grad",
            "positive and finite",
        ),
        (&["--lr", "NaN"], "--lr", "finite, non-negative"),
        (&["--lr=-1"], "--lr", "finite, non-negative"),
        (&["--min-lr", "NaN"], "--min-lr", "finite, non-negative"),
        (&["--hidden-dropout", "NaN"], "hidden_dropout", "[0, 1)"),
        (&["--attention-dropout", "1"], "attention_dropout", "[0, 1)"),
        (
            &["--peak-tflops", "0"],
            "--peak-tflops",
            "positive and finite",
        ),
        (
            &["--peak-tflops", "NaN"],
            "--peak-tflops",
            "positive and finite",
        ),
        (
            &["--gpu-memory-gib", "NaN"],
            "--gpu-memory-gib",
            "positive and finite",
        ),
    ] {
        for distributed in [false, true] {
            let mut all = args.to_vec();
            if distributed {
                all.push("--use-distributed-optimizer");
            }
            let e = error(&config(&all));
            assert!(e.contains(option) && e.contains(range), "{all:?}: {e}");
        }
    }
    // The launcher refuses before any rank starts, whatever the path.
    let e = pretrain_on_threads(&config(&["--adam-eps", "NaN"]), &Silent)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--adam-eps"), "{e}");
    let e = pretrain_on_threads(&config(&["--learner", "--init-method-std", "0"]), &Silent)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--init-method-std"), "{e}");
}

/// A NaN RoPE base, norm epsilon or initialisation, given to the model's configuration by a
/// library user (no command line), fails the model's one validation; so does a NaN AdamW
/// setting given to the optimizer's configuration: every path (the loops, the Learner, the
/// benchmarks, a user's own loop) builds through these.
#[test]
fn library_configurations_refuse_nan_settings() {
    use burn_megatron::optimizer::{DistributedAdamWConfig, FlatAdamWConfig};
    use burn_megatron::transformer::{PositionEmbedding, TransformerConfig};

    let model = || TransformerConfig::new(16, 2, 4, 64, 50, 8);
    model().validate(1, 0).expect("the base model is valid");
    for (name, bad, says) in [
        (
            "rope base",
            model().with_position_embedding(PositionEmbedding::Rope { base: f64::NAN }),
            "--rotary-base",
        ),
        (
            "rope base inf",
            model().with_position_embedding(PositionEmbedding::Rope {
                base: f64::INFINITY,
            }),
            "--rotary-base",
        ),
        (
            "norm epsilon",
            model().with_norm_epsilon(f64::NAN),
            "--norm-epsilon",
        ),
        (
            "init std",
            model().with_init_std(f64::NAN),
            "--init-method-std",
        ),
    ] {
        let e = model_error(&bad);
        assert!(
            e.contains(says) && (e.contains("NaN") || e.contains("inf")),
            "{name}: {e}"
        );
    }
    FlatAdamWConfig::new()
        .validate()
        .expect("the defaults are valid");
    for (bad, says) in [
        (FlatAdamWConfig::new().with_beta_1(f64::NAN), "--adam-beta1"),
        (FlatAdamWConfig::new().with_beta_2(1.0), "--adam-beta2"),
        (FlatAdamWConfig::new().with_epsilon(0.0), "--adam-eps"),
        (
            FlatAdamWConfig::new().with_weight_decay(f64::NAN),
            "--weight-decay",
        ),
    ] {
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains(says), "{e}");
        let e = DistributedAdamWConfig::new()
            .with_adam(bad)
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{e}");
    }
    let e = DistributedAdamWConfig::new()
        .with_clip_grad(Some(f64::NAN))
        .validate()
        .unwrap_err()
        .to_string();
    assert!(e.contains("--clip-grad"), "{e}");
}

fn model_error(config: &burn_megatron::transformer::TransformerConfig) -> String {
    config.validate(1, 0).unwrap_err().to_string()
}

/// `--check-for-nan-in-loss-and-grad` is on by default, `false` turns it off, on the
/// command line and in a TOML file.
#[test]
fn the_nan_check_option_is_on_by_default() {
    assert!(config(&[]).check_for_nan_in_loss_and_grad);
    assert!(config(&["--check-for-nan-in-loss-and-grad"]).check_for_nan_in_loss_and_grad);
    assert!(!config(&["--check-for-nan-in-loss-and-grad", "false"]).check_for_nan_in_loss_and_grad);
    let file = PretrainArgs::from_toml("check-for-nan-in-loss-and-grad = false\n").unwrap();
    assert_eq!(file.check_for_nan_in_loss_and_grad, Some(false));
}

/// `--num-layers-per-virtual-pipeline-stage`: `num_layers / (PP × it)` chunks a rank and the
/// interleaved schedule (one chunk: 1F1B); what it needs is checked before any rank starts.
#[test]
fn virtual_pipeline_stages_are_megatrons_option() {
    // 8 layers at TP = 2 × PP = 2, 4 microbatches a step.
    let base = ["--num-layers", "8", "--global-batch-size", "16"];
    let with = |extra: &[&str]| config(&[&base[..], extra].concat());
    let c = with(&["--num-layers-per-virtual-pipeline-stage", "2"]);
    assert_eq!(c.num_layers_per_virtual_pipeline_stage, Some(2));
    let layout = c.check(4).unwrap();
    assert_eq!(layout.virtual_pipeline_size, 2);
    assert_eq!(layout.schedule(), Schedule::Interleaved);
    let one_chunk = with(&["--num-layers-per-virtual-pipeline-stage", "4"])
        .check(4)
        .unwrap();
    assert_eq!(
        (one_chunk.virtual_pipeline_size, one_chunk.schedule()),
        (1, Schedule::OneFOneB)
    );
    assert_eq!(config(&[]).check(4).unwrap().schedule(), Schedule::OneFOneB);

    for (extra, want) in [
        (
            &["--num-layers-per-virtual-pipeline-stage", "3"][..],
            "must divide the layers of each pipeline rank (8 / 2 = 4)",
        ),
        (
            &["--num-layers-per-virtual-pipeline-stage", "0"][..],
            "must divide",
        ),
        (
            &[
                "--num-layers-per-virtual-pipeline-stage",
                "2",
                "--pipeline-model-parallel-size",
                "1",
            ][..],
            "at least 2 (got 1)",
        ),
        (
            &[
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--micro-batch-size",
                "16",
            ][..],
            "microbatches per step (1 =",
        ),
        (
            &[
                "--num-layers-per-virtual-pipeline-stage",
                "2",
                "--overlap-grad-reduce",
            ][..],
            "--overlap-grad-reduce with --num-layers-per-virtual-pipeline-stage is not supported",
        ),
    ] {
        let e = error(&with(extra));
        assert!(e.contains(want), "{extra:?}: {e}");
    }
    // Burn's Learner runs 1F1B.
    let e = error(&with(&[
        "--num-layers-per-virtual-pipeline-stage",
        "2",
        "--learner",
    ]));
    assert!(e.contains("--learner runs 1F1B"), "{e}");
}

/// `--decoder-first-pipeline-num-layers`, `--decoder-last-pipeline-num-layers` and
/// `--num-virtual-stages-per-pipeline-rank` (Megatron's names) give the layout's split; what
/// they cannot split is refused before any rank starts.
#[test]
fn uneven_pipeline_stages_are_megatrons_options() {
    // 32 layers at TP = 2 × PP = 4 (8 ranks), 8 microbatches a step.
    let base = ["--num-layers", "32", "--pipeline-model-parallel-size", "4"];
    let with =
        |extra: &[&str]| config(&[&base[..], &["--global-batch-size", "32"], extra].concat());
    let c = with(&["--decoder-last-pipeline-num-layers", "5"]);
    assert_eq!(c.decoder_last_pipeline_num_layers, Some(5));
    let layout = c.check(8).unwrap();
    assert_eq!(layout.split.counts(), [9, 9, 9, 5]);
    assert_eq!(layout.schedule(), Schedule::OneFOneB);
    let interleaved = with(&[
        "--decoder-last-pipeline-num-layers",
        "5",
        "--num-virtual-stages-per-pipeline-rank",
        "4",
    ])
    .check(8)
    .unwrap();
    assert_eq!(interleaved.virtual_pipeline_size, 4);
    assert_eq!(interleaved.schedule(), Schedule::Interleaved);
    assert_eq!(
        (0..4)
            .map(|r| interleaved.split.rank_layers(r, 4))
            .collect::<Vec<_>>(),
        [9, 9, 9, 5]
    );
    // Without the options: the even split, as before.
    assert_eq!(with(&[]).check(8).unwrap().split.counts(), [8; 4]);
    let file = PretrainArgs::from_toml("decoder-first-pipeline-num-layers = 6\n").unwrap();
    assert_eq!(file.decoder_first_pipeline_num_layers, Some(6));

    for (extra, want) in [
        (
            &["--decoder-last-pipeline-num-layers", "6"][..],
            "the other 3 ranks would share 26 layers unevenly",
        ),
        (
            &[
                "--decoder-last-pipeline-num-layers",
                "5",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
            ][..],
            "give the chunks a rank holds with --num-virtual-stages-per-pipeline-rank",
        ),
        (
            &[
                "--num-virtual-stages-per-pipeline-rank",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "4",
            ][..],
            "both set the chunks a rank holds",
        ),
        (
            &["--decoder-first-pipeline-num-layers", "40"][..],
            "more than the model has",
        ),
        (
            &["--decoder-last-pipeline-num-layers", "5", "--learner"][..],
            "--learner splits the layers evenly",
        ),
    ] {
        let e = error(&with(extra));
        assert!(e.contains(want), "{extra:?}: {e}");
    }
    let one_stage = config(&[
        "--num-layers",
        "4",
        "--pipeline-model-parallel-size",
        "1",
        "--decoder-last-pipeline-num-layers",
        "1",
    ]);
    assert!(error(&one_stage).contains("at least 2"));
}

/// `--recompute-method uniform|block --recompute-num-layers N` reach the model; 0 layers is an
/// error naming the option.
#[test]
fn recompute_methods_are_megatrons() {
    use burn_megatron::transformer::Recompute;
    let full = |method: &str, n: &str| {
        config(&[
            "--recompute-granularity",
            "full",
            "--recompute-method",
            method,
            "--recompute-num-layers",
            n,
        ])
        .model()
        .recompute
    };
    assert_eq!(full("uniform", "1"), Recompute::Full);
    assert_eq!(full("uniform", "2"), Recompute::FullUniform { layers: 2 });
    assert_eq!(full("block", "1"), Recompute::FullBlock { layers: 1 });
    let zero = config(&[
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        "0",
    ]);
    let e = error(&zero);
    assert!(e.contains("--recompute-num-layers 0"), "{e}");
}

/// `--overlap-param-gather` (Megatron's name) turns on the distributed optimizer's bucketed
/// parameter gather, and, as in Megatron, is refused without `--use-distributed-optimizer`.
#[test]
fn overlap_param_gather_needs_the_distributed_optimizer() {
    let dp = ["--data-parallel-size", "2", "--use-distributed-optimizer"];
    assert!(!config(&dp).overlap_param_gather, "off by default");
    assert!(
        !config(&dp)
            .distributed_adamw()
            .data_parallel
            .overlap_param_gather
    );
    let on = config(&[&dp[..], &["--overlap-param-gather"]].concat());
    assert!(on.overlap_param_gather);
    assert!(on.distributed_adamw().data_parallel.overlap_param_gather);
    assert_eq!(on.check(on.world_size()).unwrap().dp, 2);
    let off = config(&["--overlap-param-gather", "false"]);
    assert!(!off.overlap_param_gather);
    let e = error(&config(&[
        "--data-parallel-size",
        "2",
        "--overlap-param-gather",
    ]));
    assert!(
        e.contains("--overlap-param-gather") && e.contains("add --use-distributed-optimizer"),
        "{e}"
    );
}

/// `--no-gradient-accumulation-fusion` (Megatron's name) turns the weight-gradient GEMMs'
/// accumulation into the hook's buffer off; it is on by default.
#[test]
fn gradient_accumulation_fusion_is_on_unless_refused() {
    let on = config(&["--overlap-grad-reduce"]);
    assert!(on.gradient_accumulation_fusion);
    assert!(
        on.distributed_adamw()
            .data_parallel
            .gradient_accumulation_fusion
    );
    let off = config(&["--overlap-grad-reduce", "--no-gradient-accumulation-fusion"]);
    assert!(!off.gradient_accumulation_fusion);
    assert!(
        !off.distributed_adamw()
            .data_parallel
            .gradient_accumulation_fusion
    );
}
