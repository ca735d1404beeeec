//! `pretrain_gpt`'s loop on CPU thread ranks: every layout's losses equal a single rank's
//! plain training (written here from the model's pieces, not through the loop); a resumed
//! run continues with the uninterrupted run's losses; options from the command line and
//! TOML, and the errors of bad ones.

mod arguments;
mod context_parallel;
mod equivalence;
mod learner;
mod nan_check;
mod planner;
mod resume;

use std::path::PathBuf;

use burn_megatron::training::{PretrainConfig, PretrainSummary, Silent, pretrain_on_threads};
pub use burn_megatron_testing::{assert_close, run, tolerance};

/// A tiny run on the default corpus: 4 layers of width 16, sequences of 16 tokens, 4
/// microbatches of 2 samples per step, 4 steps with an evaluation after steps 2 and 4, at
/// TP × PP.
pub fn tiny_run(tp: usize, pp: usize) -> PretrainConfig {
    PretrainConfig::new()
        .with_num_layers(4)
        .with_hidden_size(16)
        .with_num_attention_heads(4)
        .with_seq_length(16)
        .with_micro_batch_size(2)
        .with_global_batch_size(8)
        .with_train_iters(4)
        .with_lr(1e-2)
        .with_min_lr(1e-3)
        .with_lr_warmup_iters(1)
        .with_clip_grad(0.5)
        .with_eval_interval(2)
        .with_eval_iters(1)
        .with_default_corpus_documents(300)
        .with_split("90,10,0".into())
        .with_tensor_model_parallel_size(tp)
        .with_pipeline_model_parallel_size(pp)
}

/// Runs `config` on its thread ranks, silently.
pub fn train(config: &PretrainConfig) -> PretrainSummary {
    pretrain_on_threads(config, &Silent).unwrap_or_else(|e| panic!("pretraining failed: {e}"))
}

/// A fresh directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bm-pretrain-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
