//! Megatron's `tools/preprocess_data.py` for burn-megatron: JSONL (one document a line, its text
//! in a field) to an indexed dataset `{output_prefix}_{key}_document.bin/.idx` that Megatron
//! and `burn_megatron::data` both read.
//!
//!     # bytes as tokens (vocabulary 257), an end-of-document token after each document
//!     cargo run --release --example preprocess_data -- --input docs.jsonl --output-prefix data/docs
//!     # a Hugging Face tokenizer.json (build with --features tokenizers)
//!     cargo run --release --features tokenizers --example preprocess_data -- \
//!         --input docs.jsonl --output-prefix data/docs --tokenizer-model tokenizer.json
//!     # the project's generated corpus, no input needed
//!     cargo run --release --example preprocess_data -- --default-corpus 2000 --output-prefix data/corpus

use std::path::PathBuf;
use std::process::ExitCode;

use burn_megatron::data::{
    ByteTokenizer, DataError, PreprocessConfig, PreprocessSummary, Tokenizer, preprocess_jsonl,
    write_default_corpus,
};
use clap::Parser;

/// Tokenize JSONL into Megatron's indexed dataset (.bin/.idx).
#[derive(Parser, Debug)]
#[command(about)]
struct Args {
    /// The JSONL file: one JSON object a line, the document's text in the `--json-keys` field.
    #[arg(long, required_unless_present = "default_corpus")]
    input: Option<PathBuf>,
    /// Output prefix: writes `{prefix}_{key}_document.bin` and `.idx` (Megatron's naming).
    #[arg(long)]
    output_prefix: PathBuf,
    /// The JSON field holding the text.
    #[arg(long, default_value = "text")]
    json_keys: String,
    /// A Hugging Face `tokenizer.json`; without it, the byte-level tokenizer (ids 0-255 are
    /// bytes, 256 ends a document). Needs the `tokenizers` feature.
    #[arg(long)]
    tokenizer_model: Option<PathBuf>,
    /// The end-of-document token of the Hugging Face tokenizer (default: the first of
    /// <|endoftext|>, </s>, <|end_of_text|>, <eos> it has).
    #[arg(long)]
    eod_token: Option<String>,
    /// Do not append the end-of-document token to each document (Megatron appends it only
    /// with --append-eod; we append it unless told not to).
    #[arg(long)]
    no_append_eod: bool,
    /// Write the project's generated corpus of this many documents (byte-level tokens)
    /// instead of reading --input.
    #[arg(long)]
    default_corpus: Option<usize>,
    /// Seed of the generated corpus.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
}

fn tokenizer(args: &Args) -> Result<Box<dyn Tokenizer>, DataError> {
    match &args.tokenizer_model {
        None => Ok(Box::new(ByteTokenizer)),
        #[cfg(feature = "tokenizers")]
        Some(path) => Ok(Box::new(burn_megatron::data::HfTokenizer::from_file(
            path,
            args.eod_token.as_deref(),
        )?)),
        #[cfg(not(feature = "tokenizers"))]
        Some(path) => Err(DataError::Tokenizer(format!(
            "{}: Hugging Face tokenizers need a build with `--features tokenizers`",
            path.display()
        ))),
    }
}

fn run(args: &Args) -> Result<PreprocessSummary, DataError> {
    if let Some(parent) = args
        .output_prefix
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
    {
        std::fs::create_dir_all(parent).map_err(|e| DataError::Io {
            path: parent.to_path_buf(),
            operation: "create the directory",
            message: e.to_string(),
        })?;
    }
    if let Some(documents) = args.default_corpus {
        return write_default_corpus(&args.output_prefix, documents, args.seed);
    }
    let input = args.input.as_ref().expect("clap requires --input");
    let config = PreprocessConfig::new()
        .with_json_key(args.json_keys.clone())
        .with_append_eod(!args.no_append_eod);
    preprocess_jsonl(
        input,
        &args.output_prefix,
        tokenizer(args)?.as_ref(),
        &config,
    )
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(summary) => {
            println!(
                "wrote {} documents, {} tokens ({}): --data-path {}",
                summary.documents,
                summary.tokens,
                summary.dtype,
                summary.prefix.display()
            );
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("preprocess_data: {err}");
            ExitCode::FAILURE
        }
    }
}
