//! `pretrain_gpt --fp8-format hybrid --fp8-recipe tensorwise`: the options reach the model,
//! a short run on CPU thread ranks (TP 2 × PP 2, FP8 emulated in f32) trains, and invalid
//! combinations are refused with the option's name.

use burn_megatron::ops::fp8::{AmaxComputeAlgo, Fp8Backward, Fp8Config, Fp8Format, Fp8Recipe};
use burn_megatron::training::{PretrainArgs, PretrainConfig, Silent, pretrain_on_threads};
use burn_megatron::transformer::Recompute;
use clap::Parser;

/// `pretrain_gpt`'s configuration from `args`, or the error's message.
pub(crate) fn config(args: &[&str]) -> Result<PretrainConfig, String> {
    PretrainArgs::try_parse_from(std::iter::once("pretrain_gpt").chain(args.iter().copied()))
        .map_err(|e| e.to_string())?
        .into_config()
        .map_err(|e| e.to_string())
}

#[test]
fn fp8_options_reach_the_model() {
    assert_eq!(config(&[]).unwrap().model().fp8, None);
    let c = config(&["--fp8-format", "hybrid"]).unwrap();
    assert_eq!(c.model().fp8, Some(Fp8Config::new()));
    let c = config(&[
        "--fp8-format",
        "e4m3",
        "--fp8-recipe",
        "delayed",
        "--fp8-margin",
        "-1",
        "--fp8-amax-history-len",
        "16",
        "--fp8-amax-compute-algo",
        "most_recent",
    ])
    .unwrap();
    let want = Fp8Config::new()
        .with_format(Fp8Format::E4M3)
        .with_recipe(Fp8Recipe::Delayed)
        .with_margin(-1)
        .with_amax_history_len(16)
        .with_amax_compute_algo(AmaxComputeAlgo::MostRecent);
    assert_eq!(c.fp8, Some(want.clone()));
    assert_eq!(c.model().fp8, Some(want));
    // The same from a TOML file's keys.
    let args =
        PretrainArgs::from_toml("fp8-format = \"hybrid\"\nfp8-recipe = \"delayed\"\n").unwrap();
    let c = args.into_config().unwrap();
    assert_eq!(c.fp8.map(|f| f.recipe), Some(Fp8Recipe::Delayed));
    let c = config(&["--fp8-format", "hybrid", "--fp8-recipe", "Blockwise"]).unwrap();
    assert_eq!(c.model().fp8.map(|f| f.recipe), Some(Fp8Recipe::Blockwise));
    for (value, backward) in [
        ("dgrad", Fp8Backward::Dgrad),
        ("wgrad", Fp8Backward::Wgrad),
        ("both", Fp8Backward::Both),
    ] {
        let c = config(&["--fp8-format", "hybrid", "--fp8-backward-bf16", value]).unwrap();
        assert_eq!(c.model().fp8.map(|f| f.backward), Some(backward));
    }
    let c = config(&["--fp8-format", "hybrid", "--tp-only-amax-red"]).unwrap();
    assert_eq!(c.model().fp8.map(|f| f.tp_only_amax_reduction), Some(true));
}

#[test]
fn invalid_fp8_options_are_refused() {
    for (args, needle) in [
        (
            &["--fp8-recipe", "delayed"][..],
            "--fp8-recipe takes effect with --fp8-format",
        ),
        (
            &["--fp8-margin", "1"][..],
            "--fp8-margin takes effect with --fp8-format",
        ),
        (&["--fp8-format", "e5m2"][..], "--fp8-format \"e5m2\""),
        (
            &["--fp8-backward-bf16", "both"][..],
            "--fp8-backward-bf16 takes effect with --fp8-format",
        ),
        (
            &["--fp8-format", "hybrid", "--fp8-backward-bf16", "fprop"][..],
            "--fp8-backward-bf16 \"fprop\": use dgrad, wgrad or both",
        ),
        (
            &["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"][..],
            "MXFP8 needs Blackwell",
        ),
        (
            &[
                "--fp8-format",
                "hybrid",
                "--fp8-recipe",
                "blockwise",
                "--fp8-amax-compute-algo",
                "max",
            ][..],
            "apply to --fp8-recipe delayed only (blockwise scaling",
        ),
        (
            &["--fp8-format", "hybrid", "--fp8-amax-history-len", "8"][..],
            "apply to --fp8-recipe delayed only",
        ),
        (
            &[
                "--fp8-format",
                "hybrid",
                "--fp8-recipe",
                "delayed",
                "--fp8-amax-history-len",
                "0",
            ][..],
            "--fp8-amax-history-len must be at least 1",
        ),
        (
            &[
                "--fp8-format",
                "hybrid",
                "--fp8-recipe",
                "delayed",
                "--fp8-amax-compute-algo",
                "avg",
            ][..],
            "--fp8-amax-compute-algo \"avg\"",
        ),
    ] {
        let error = config(args).unwrap_err();
        assert!(error.contains(needle), "{args:?}: {error}");
    }
    // Delayed scaling would see a moved-on scale in a recomputed forward pass.
    let c = config(&[
        "--fp8-format",
        "hybrid",
        "--fp8-recipe",
        "delayed",
        "--recompute-granularity",
        "full",
    ])
    .unwrap();
    assert_eq!(c.recompute, Recompute::Full);
    let error = c.check(c.world_size()).unwrap_err().to_string();
    assert!(
        error.contains("--fp8-recipe delayed with full recomputation"),
        "{error}"
    );
}

/// `--fp8-recipe blockwise` with a side of an FP8 GEMM that is not whole blocks of 128 is
/// refused before the model is built, naming the side; a layout whose sides are all whole
/// blocks passes.
#[test]
fn blockwise_sizes_that_are_not_whole_blocks_are_refused_at_start() {
    let base = [
        "--fp8-format",
        "hybrid",
        "--fp8-recipe",
        "blockwise",
        "--num-attention-heads",
        "4",
        "--micro-batch-size",
        "1",
        "--tensor-model-parallel-size",
        "2",
    ];
    let checked = |more: &[&str]| {
        let args: Vec<&str> = base.iter().chain(more).copied().collect();
        let c = config(&args).unwrap();
        c.check(c.world_size())
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let whole = [
        "--hidden-size",
        "256",
        "--ffn-hidden-size",
        "512",
        "--seq-length",
        "128",
    ];
    assert_eq!(checked(&whole), Ok(()));
    for (args, needle) in [
        (
            [
                "--hidden-size",
                "192",
                "--ffn-hidden-size",
                "512",
                "--seq-length",
                "128",
            ],
            "--hidden-size is 192",
        ),
        (
            [
                "--hidden-size",
                "256",
                "--ffn-hidden-size",
                "640",
                "--seq-length",
                "128",
            ],
            "(--ffn-hidden-size / TP) is 320",
        ),
        (
            [
                "--hidden-size",
                "256",
                "--ffn-hidden-size",
                "512",
                "--seq-length",
                "64",
            ],
            "per CP rank (--micro-batch-size × --seq-length / CP) is 64",
        ),
    ] {
        let error = checked(&args).unwrap_err();
        assert!(
            error.contains(needle) && error.contains("not a multiple of 128"),
            "{args:?}: {error}"
        );
    }
    // Tensorwise scaling takes these sizes.
    let c = config(&["--fp8-format", "hybrid", "--hidden-size", "192"]).unwrap();
    assert!(c.check(c.world_size()).is_ok());
}

/// Six steps of a tiny GPT in FP8 (hybrid, tensorwise) on TP 2 × PP 2: every loss finite,
/// the last ones below the first.
#[test]
fn pretrain_gpt_in_fp8_trains() {
    let mut c = config(&[
        "--fp8-format",
        "hybrid",
        "--fp8-recipe",
        "tensorwise",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        "8",
        "--lr",
        "1e-2",
        "--lr-warmup-iters",
        "1",
        "--eval-interval",
        "0",
        "--no-save",
    ])
    .unwrap();
    c.default_corpus_documents = 200;
    c.split = "90,10,0".into();
    let summary = pretrain_on_threads(&c, &Silent).unwrap_or_else(|e| panic!("{e}"));
    let losses = summary.losses();
    assert_eq!(losses.len(), 8);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    let last = (losses[6] + losses[7]) / 2.0;
    assert!(last < losses[0] - 0.3, "the loss does not fall: {losses:?}");
}
