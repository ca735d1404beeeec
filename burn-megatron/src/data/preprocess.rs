//! JSONL to Megatron's `.bin`/`.idx` (Megatron's `tools/preprocess_data.py`), the library side
//! of the `preprocess_data` example.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use burn::config::Config;

use super::{DType, DataError, IndexedDatasetBuilder, Tokenizer};

/// What [`preprocess_jsonl`] reads and writes.
#[derive(Config, Debug, PartialEq)]
pub struct PreprocessConfig {
    /// The JSON field holding each document's text (`--json-keys`).
    #[config(default = "\"text\".to_string()")]
    pub json_key: String,
    /// Append the tokenizer's end-of-document token to every document (`--append-eod`).
    #[config(default = true)]
    pub append_eod: bool,
}

/// What [`preprocess_jsonl`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessSummary {
    /// The dataset's prefix, `{output_prefix}_{json_key}_document` as Megatron names it: give
    /// it to `--data-path`.
    pub prefix: PathBuf,
    /// Documents written (one sequence each).
    pub documents: usize,
    /// Tokens written, end-of-document tokens included.
    pub tokens: usize,
    /// The dtype of the tokens.
    pub dtype: DType,
}

/// The prefix Megatron's `preprocess_data.py` writes for `json_key`:
/// `{output_prefix}_{json_key}_document`.
pub fn document_prefix(output_prefix: &Path, json_key: &str) -> PathBuf {
    let mut s = output_prefix.as_os_str().to_os_string();
    s.push(format!("_{json_key}_document"));
    PathBuf::from(s)
}

/// Tokenizes every line of the JSONL file `input` (a JSON object with a string field
/// `config.json_key`; blank lines are skipped) into one document, and writes
/// `{output_prefix}_{json_key}_document.bin/.idx` in [`DType::optimal`] for the tokenizer's
/// vocabulary.
pub fn preprocess_jsonl(
    input: &Path,
    output_prefix: &Path,
    tokenizer: &dyn Tokenizer,
    config: &PreprocessConfig,
) -> Result<PreprocessSummary, DataError> {
    let file = File::open(input).map_err(|e| DataError::io(input, "open", e))?;
    preprocess_lines(
        BufReader::new(file),
        input,
        output_prefix,
        tokenizer,
        config,
    )
}

/// [`preprocess_jsonl`] on any reader; `input_name` names it in errors.
pub fn preprocess_lines(
    reader: impl BufRead,
    input_name: &Path,
    output_prefix: &Path,
    tokenizer: &dyn Tokenizer,
    config: &PreprocessConfig,
) -> Result<PreprocessSummary, DataError> {
    let prefix = document_prefix(output_prefix, &config.json_key);
    let dtype = DType::optimal(tokenizer.vocab_size());
    let mut builder = IndexedDatasetBuilder::new(&prefix, dtype)?;
    let mut tokens = 0;
    for (n, line) in reader.lines().enumerate() {
        let bad = |problem: String| DataError::BadInput {
            path: input_name.to_path_buf(),
            line: n + 1,
            problem,
        };
        let line = line.map_err(|e| DataError::io(input_name, "read", e))?;
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| bad(format!("not JSON: {e}")))?;
        let text = value
            .get(&config.json_key)
            .ok_or_else(|| bad(format!("no {:?} field", config.json_key)))?
            .as_str()
            .ok_or_else(|| bad(format!("the {:?} field is not a string", config.json_key)))?;
        let mut ids = tokenizer.encode(text)?;
        if config.append_eod {
            ids.push(tokenizer.eod());
        }
        tokens += ids.len();
        builder.add_document(&ids, &[ids.len()])?;
    }
    let documents = builder.num_documents();
    builder.finalize()?;
    Ok(PreprocessSummary {
        prefix,
        documents,
        tokens,
        dtype,
    })
}
