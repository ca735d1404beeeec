//! Tokenizers for preprocessing: the built-in byte-level one, and Hugging Face `tokenizer.json`
//! files with the `tokenizers` feature.

use super::DataError;

/// Text to token ids, with an end-of-document token that preprocessing appends to every
/// document (Megatron's `--append-eod`), so samples that cross documents mark the boundary.
pub trait Tokenizer {
    /// The token ids of `text`.
    fn encode(&self, text: &str) -> Result<Vec<i64>, DataError>;

    /// Token ids back to text.
    fn decode(&self, ids: &[i64]) -> Result<String, DataError>;

    /// Tokens in the vocabulary: every id is in `0..vocab_size()`.
    fn vocab_size(&self) -> usize;

    /// The end-of-document token.
    fn eod(&self) -> i64;
}

/// Bytes as tokens: ids 0 to 255 are the UTF-8 bytes of the text, 256 ends a document
/// (vocabulary 257). It needs no file, so the default corpus trains with no download.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// The end-of-document token.
    pub const EOD: i64 = 256;
    /// 256 bytes and the end-of-document token.
    pub const VOCAB_SIZE: usize = 257;
}

impl Tokenizer for ByteTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<i64>, DataError> {
        Ok(text.bytes().map(i64::from).collect())
    }

    /// The bytes' text (invalid UTF-8 replaced by `�`); an end-of-document token is a newline.
    fn decode(&self, ids: &[i64]) -> Result<String, DataError> {
        let mut bytes = Vec::with_capacity(ids.len());
        for &id in ids {
            match u8::try_from(id) {
                Ok(b) => bytes.push(b),
                Err(_) if id == Self::EOD => bytes.push(b'\n'),
                Err(_) => {
                    return Err(DataError::Tokenizer(format!(
                        "id {id} is outside the byte tokenizer's vocabulary of {}",
                        Self::VOCAB_SIZE
                    )));
                }
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn vocab_size(&self) -> usize {
        Self::VOCAB_SIZE
    }

    fn eod(&self) -> i64 {
        Self::EOD
    }
}

/// A Hugging Face tokenizer from its `tokenizer.json` (Megatron's `HuggingFaceTokenizer`),
/// through the `tokenizers` crate.
#[cfg(feature = "tokenizers")]
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    eod: i64,
}

#[cfg(feature = "tokenizers")]
impl HfTokenizer {
    /// End-of-document tokens tried, in order, when none is named.
    pub const EOD_CANDIDATES: [&'static str; 4] =
        ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"];

    /// Loads `tokenizer.json`; the end-of-document token is `eod_token`, or else the first of
    /// [`EOD_CANDIDATES`](Self::EOD_CANDIDATES) in the vocabulary.
    pub fn from_file(
        path: impl AsRef<std::path::Path>,
        eod_token: Option<&str>,
    ) -> Result<Self, DataError> {
        let path = path.as_ref();
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| DataError::Tokenizer(format!("{}: {e}", path.display())))?;
        let names: Vec<&str> = match eod_token {
            Some(name) => vec![name],
            None => Self::EOD_CANDIDATES.to_vec(),
        };
        let eod = names
            .iter()
            .find_map(|name| inner.token_to_id(name))
            .ok_or_else(|| {
                DataError::Tokenizer(format!(
                    "{}: no end-of-document token among {names:?}; name it (--eod-token)",
                    path.display()
                ))
            })?;
        Ok(HfTokenizer {
            inner,
            eod: eod as i64,
        })
    }
}

#[cfg(feature = "tokenizers")]
impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<i64>, DataError> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| DataError::Tokenizer(e.to_string()))?;
        Ok(encoding.get_ids().iter().map(|&id| id as i64).collect())
    }

    fn decode(&self, ids: &[i64]) -> Result<String, DataError> {
        let ids = ids
            .iter()
            .map(|&id| u32::try_from(id))
            .collect::<Result<Vec<u32>, _>>()
            .map_err(|e| DataError::Tokenizer(format!("a negative or too large id: {e}")))?;
        self.inner
            .decode(&ids, false)
            .map_err(|e| DataError::Tokenizer(e.to_string()))
    }

    fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    fn eod(&self) -> i64 {
        self.eod
    }
}
