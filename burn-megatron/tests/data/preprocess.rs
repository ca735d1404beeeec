//! Tokenizers, the preprocessing of JSONL and the default corpus.

use std::sync::Arc;

use burn_megatron::data::{
    ByteTokenizer, DType, DataError, GptDataset, GptDatasetConfig, IndexedDataset,
    PreprocessConfig, SampleDataset, Tokenizer, default_corpus, preprocess_jsonl,
    write_default_corpus,
};

use crate::TempDir;

#[test]
fn the_byte_tokenizer_round_trips_utf8() {
    let text = "Grüße, 世界! \n";
    let ids = ByteTokenizer.encode(text).unwrap();
    assert_eq!(ids.len(), text.len());
    assert!(ids.iter().all(|&id| (0..256).contains(&id)));
    assert_eq!(ids[0], b'G' as i64);
    assert_eq!(ByteTokenizer.decode(&ids).unwrap(), text);
    assert_eq!(ByteTokenizer.vocab_size(), 257);
    assert_eq!(
        ByteTokenizer
            .decode(&[b'a' as i64, ByteTokenizer::EOD])
            .unwrap(),
        "a\n"
    );
    assert!(matches!(
        ByteTokenizer.decode(&[257]),
        Err(DataError::Tokenizer(_))
    ));
}

#[test]
fn preprocessing_jsonl_writes_documents_with_end_of_document_tokens() {
    let dir = TempDir::new("preprocess");
    let input = dir.join("docs.jsonl");
    std::fs::write(
        &input,
        "{\"text\": \"ab\", \"id\": 1}\n\n{\"text\": \"\\u00e9\"}\n{\"text\": \"\"}\n",
    )
    .unwrap();
    let summary = preprocess_jsonl(
        &input,
        &dir.join("out"),
        &ByteTokenizer,
        &PreprocessConfig::new(),
    )
    .unwrap();
    assert!(summary.prefix.ends_with("out_text_document"));
    assert_eq!(summary.documents, 3);
    assert_eq!(summary.tokens, 3 + 3 + 1);
    assert_eq!(summary.dtype, DType::U16);
    let ds = IndexedDataset::open(&summary.prefix).unwrap();
    assert_eq!(ds.dtype(), DType::U16);
    assert_eq!(ds.num_documents(), 3);
    assert_eq!(ds.get(0).unwrap(), [97, 98, 256]);
    assert_eq!(ds.get(1).unwrap(), [0xc3, 0xa9, 256]);
    assert_eq!(ds.get(2).unwrap(), [256]);

    // Without end-of-document tokens, and another key.
    std::fs::write(&input, "{\"content\": \"xyz\"}\n").unwrap();
    let config = PreprocessConfig::new()
        .with_json_key("content".into())
        .with_append_eod(false);
    let summary = preprocess_jsonl(&input, &dir.join("raw"), &ByteTokenizer, &config).unwrap();
    assert!(summary.prefix.ends_with("raw_content_document"));
    let ds = IndexedDataset::open(&summary.prefix).unwrap();
    assert_eq!(ds.get(0).unwrap(), [120, 121, 122]);
}

#[test]
fn bad_jsonl_lines_are_errors_naming_the_line() {
    let dir = TempDir::new("bad-jsonl");
    let input = dir.join("bad.jsonl");
    for (content, line, needle) in [
        ("{\"text\": \"a\"}\nnot json\n", 2, "not JSON"),
        ("{\"body\": \"a\"}\n", 1, "no \"text\" field"),
        ("{\"text\": \"a\"}\n\n{\"text\": 5}\n", 3, "not a string"),
    ] {
        std::fs::write(&input, content).unwrap();
        let err = preprocess_jsonl(
            &input,
            &dir.join("o"),
            &ByteTokenizer,
            &PreprocessConfig::new(),
        )
        .unwrap_err();
        assert!(
            matches!(&err, DataError::BadInput { line: l, problem, .. } if *l == line && problem.contains(needle)),
            "{err:?}"
        );
        assert!(
            err.to_string().contains(&format!("bad.jsonl:{line}")),
            "{err}"
        );
    }
    let err = preprocess_jsonl(
        &dir.join("absent.jsonl"),
        &dir.join("o"),
        &ByteTokenizer,
        &PreprocessConfig::new(),
    )
    .unwrap_err();
    assert!(matches!(err, DataError::Io { .. }), "{err:?}");
}

#[test]
fn the_default_corpus_is_deterministic_and_samples() {
    let a = default_corpus(50, 3);
    assert_eq!(a, default_corpus(50, 3));
    assert_ne!(a, default_corpus(50, 4));
    assert_eq!(a.len(), 50);
    // Each document ends with an exact sum.
    for doc in &a {
        let tail = doc.rsplit(": ").next().unwrap();
        let words: Vec<&str> = tail.trim_end_matches('.').split(' ').collect();
        let (x, y, z): (u64, u64, u64) = (
            words[0].parse().unwrap(),
            words[2].parse().unwrap(),
            words[4].parse().unwrap(),
        );
        assert_eq!(x + y, z, "{doc}");
    }

    let dir = TempDir::new("corpus");
    let summary = write_default_corpus(&dir.join("corpus"), 200, 1).unwrap();
    let ds = Arc::new(IndexedDataset::open(&summary.prefix).unwrap());
    assert_eq!(ds.num_documents(), 200);
    assert_eq!(ds.sequence_lengths().sum::<usize>(), summary.tokens);
    let first = ds.get(0).unwrap();
    assert_eq!(*first.last().unwrap(), ByteTokenizer::EOD);
    let text = ByteTokenizer.decode(&first[..first.len() - 1]).unwrap();
    assert_eq!(text, default_corpus(200, 1)[0]);
    let gpt = GptDataset::new(ds, 0..200, 100, &GptDatasetConfig::new(64)).unwrap();
    assert_eq!(gpt.sample(99).unwrap().len(), 65);
}

/// A word-level `tokenizer.json` of five tokens, split on whitespace (the pre-tokenizer runs
/// the `tokenizers` crate's regex engine).
#[cfg(feature = "tokenizers")]
const TINY_TOKENIZER_JSON: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [],
  "normalizer": null,
  "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null,
  "decoder": null,
  "model": {
    "type": "WordLevel",
    "vocab": {"<unk>": 0, "hello": 1, "world": 2, "!": 3, "<|endoftext|>": 4},
    "unk_token": "<unk>"
  }
}"#;

#[cfg(feature = "tokenizers")]
#[test]
fn preprocessing_with_a_hugging_face_tokenizer() {
    use burn_megatron::data::HfTokenizer;
    let dir = TempDir::new("hf");
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, TINY_TOKENIZER_JSON).unwrap();
    let tokenizer = HfTokenizer::from_file(&path, None).unwrap();
    assert_eq!((tokenizer.vocab_size(), tokenizer.eod()), (5, 4));
    assert_eq!(tokenizer.encode("hello world!").unwrap(), [1, 2, 3]);
    let input = dir.join("docs.jsonl");
    std::fs::write(
        &input,
        "{\"text\": \"hello world!\"}\n{\"text\": \"world other\"}\n",
    )
    .unwrap();
    let summary = preprocess_jsonl(
        &input,
        &dir.join("hf"),
        &tokenizer,
        &PreprocessConfig::new(),
    )
    .unwrap();
    let ds = IndexedDataset::open(&summary.prefix).unwrap();
    assert_eq!(ds.get(0).unwrap(), [1, 2, 3, 4]);
    assert_eq!(ds.get(1).unwrap(), [2, 0, 4]);
    // A missing end-of-document token, and a file that is not a tokenizer, are errors.
    assert!(matches!(
        HfTokenizer::from_file(&path, Some("</s>")),
        Err(DataError::Tokenizer(_))
    ));
    assert!(matches!(
        HfTokenizer::from_file(&input, None),
        Err(DataError::Tokenizer(_))
    ));
}
