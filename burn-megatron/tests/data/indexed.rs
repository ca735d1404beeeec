//! Megatron's `.bin`/`.idx` files: exact bytes, round trips and every malformed case.

use burn_megatron::data::{
    DType, DataError, IndexedDataset, IndexedDatasetBuilder, data_file_path, index_file_path,
};

use crate::TempDir;

/// The tiny dataset of the layout test: two documents, the first of two sequences.
fn write_tiny(prefix: &std::path::Path) {
    let mut builder = IndexedDatasetBuilder::new(prefix, DType::U16).unwrap();
    builder.add_item(&[1, 2, 3]).unwrap();
    builder.add_item(&[500]).unwrap();
    builder.end_document();
    builder.add_document(&[4, 65535], &[2]).unwrap();
    builder.finalize().unwrap();
}

/// The bytes Megatron-Core's `IndexedDatasetBuilder(dtype=numpy.uint16)` writes for the tiny
/// dataset (`add_item([1, 2, 3]); add_item([500]); end_document(); add_document([4, 65535],
/// [2]); finalize(idx)`), spelled out from `_IndexWriter`: little-endian throughout.
fn megatron_tiny_idx() -> Vec<u8> {
    let mut idx = Vec::new();
    idx.extend_from_slice(b"MMIDIDX\x00\x00"); // _INDEX_HEADER
    idx.extend_from_slice(&1u64.to_le_bytes()); // version, struct.pack("<Q", 1)
    idx.push(8); // DType.uint16 = 8, struct.pack("<B", code)
    idx.extend_from_slice(&3u64.to_le_bytes()); // sequence count
    idx.extend_from_slice(&3u64.to_le_bytes()); // len(document_indices) = [0, 2, 3]
    for len in [3i32, 1, 2] {
        idx.extend_from_slice(&len.to_le_bytes()); // sequence lengths, int32
    }
    for ptr in [0i64, 6, 8] {
        idx.extend_from_slice(&ptr.to_le_bytes()); // sequence pointers in bytes, int64
    }
    for doc in [0i64, 2, 3] {
        idx.extend_from_slice(&doc.to_le_bytes()); // document indices, int64
    }
    idx
}

fn megatron_tiny_bin() -> Vec<u8> {
    [1u16, 2, 3, 500, 4, 65535]
        .iter()
        .flat_map(|t| t.to_le_bytes())
        .collect()
}

#[test]
fn writes_megatrons_exact_bytes() {
    let dir = TempDir::new("layout");
    let prefix = dir.join("tiny");
    write_tiny(&prefix);
    assert_eq!(
        std::fs::read(index_file_path(&prefix)).unwrap(),
        megatron_tiny_idx()
    );
    assert_eq!(
        std::fs::read(data_file_path(&prefix)).unwrap(),
        megatron_tiny_bin()
    );
}

#[test]
fn reads_megatrons_bytes() {
    let dir = TempDir::new("read-megatron");
    let prefix = dir.join("megatron");
    std::fs::write(index_file_path(&prefix), megatron_tiny_idx()).unwrap();
    std::fs::write(data_file_path(&prefix), megatron_tiny_bin()).unwrap();
    let ds = IndexedDataset::open(&prefix).unwrap();
    assert_eq!(ds.dtype(), DType::U16);
    assert_eq!(ds.len(), 3);
    assert_eq!(ds.num_documents(), 2);
    assert_eq!(ds.sequence_lengths().collect::<Vec<_>>(), [3, 1, 2]);
    assert_eq!(ds.document_indices().collect::<Vec<_>>(), [0, 2, 3]);
    assert_eq!(ds.document_sequences(0).unwrap(), 0..2);
    assert_eq!(ds.get(0).unwrap(), [1, 2, 3]);
    assert_eq!(ds.get(1).unwrap(), [500]);
    assert_eq!(ds.get(2).unwrap(), [4, 65535]);
    assert_eq!(ds.get_range(0, 1, 2).unwrap(), [2, 3]);
    assert_eq!(ds.sequence_pointer(2).unwrap(), 8);
    assert_eq!(ds.sequence_mode(0).unwrap(), None);
}

#[test]
fn round_trips_every_integer_dtype() {
    let dir = TempDir::new("round-trip");
    let cases: [(DType, Vec<i64>); 6] = [
        (DType::U8, vec![0, 7, 255]),
        (DType::I8, vec![-128, 0, 127]),
        (DType::I16, vec![-32768, 5, 32767]),
        (DType::U16, vec![0, 256, 65535]),
        (DType::I32, vec![i32::MIN as i64, 1, i32::MAX as i64]),
        (DType::I64, vec![i64::MIN, 2, i64::MAX]),
    ];
    for (dtype, tokens) in cases {
        let prefix = dir.join(&format!("rt_{dtype}"));
        let mut builder = IndexedDatasetBuilder::new(&prefix, dtype).unwrap();
        let docs: Vec<Vec<i64>> = (0..20)
            .map(|d| (0..d % 7).map(|k| tokens[(d + k) % tokens.len()]).collect())
            .collect();
        for doc in &docs {
            builder.add_document(doc, &[doc.len()]).unwrap();
        }
        builder.finalize().unwrap();
        let ds = IndexedDataset::open(&prefix).unwrap();
        assert_eq!(ds.dtype(), dtype);
        assert_eq!(ds.len(), docs.len());
        assert_eq!(ds.num_documents(), docs.len());
        for (i, doc) in docs.iter().enumerate() {
            assert_eq!(&ds.get(i).unwrap(), doc, "{dtype} sequence {i}");
        }
        let bin_len = std::fs::metadata(data_file_path(&prefix)).unwrap().len();
        let tokens: usize = docs.iter().map(Vec::len).sum();
        assert_eq!(bin_len as usize, tokens * dtype.size());
    }
}

#[test]
fn sequence_modes_round_trip() {
    let dir = TempDir::new("modes");
    let prefix = dir.join("modes");
    let mut builder = IndexedDatasetBuilder::new(&prefix, DType::I32)
        .unwrap()
        .with_modes();
    builder.add_item_with_mode(&[1, 2], 3).unwrap();
    builder.add_item_with_mode(&[9], -1).unwrap();
    builder.end_document();
    builder.finalize().unwrap();
    let ds = IndexedDataset::open(&prefix).unwrap();
    assert_eq!(ds.sequence_mode(0).unwrap(), Some(3));
    assert_eq!(ds.sequence_mode(1).unwrap(), Some(-1));
    let idx = std::fs::read(index_file_path(&prefix)).unwrap();
    assert_eq!(idx.len(), 34 + 2 * 12 + 2 * 8 + 2);
}

#[test]
fn a_token_outside_the_dtype_is_an_error_and_writes_nothing() {
    let dir = TempDir::new("token-dtype");
    let prefix = dir.join("narrow");
    let mut builder = IndexedDatasetBuilder::new(&prefix, DType::U8).unwrap();
    let err = builder.add_item(&[1, 256]).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::TokenDType {
                value: 256,
                dtype: DType::U8,
                ..
            }
        ),
        "{err}"
    );
    let err = builder.add_item(&[-1]).unwrap_err();
    assert!(
        matches!(err, DataError::TokenDType { value: -1, .. }),
        "{err}"
    );
    builder.add_item(&[5]).unwrap();
    builder.finalize().unwrap();
    let ds = IndexedDataset::open(&prefix).unwrap();
    assert_eq!(ds.len(), 1);
    assert_eq!(ds.get(0).unwrap(), [5]);
}

#[test]
fn reads_out_of_range_are_errors() {
    let dir = TempDir::new("oob-reads");
    let prefix = dir.join("tiny");
    write_tiny(&prefix);
    let ds = IndexedDataset::open(&prefix).unwrap();
    assert!(matches!(
        ds.get(3),
        Err(DataError::IndexOutOfRange {
            what: "sequence",
            index: 3,
            len: 3
        })
    ));
    assert!(matches!(
        ds.get_range(0, 2, 2),
        Err(DataError::IndexOutOfRange { .. })
    ));
    assert!(matches!(
        ds.get_range(0, usize::MAX, 2),
        Err(DataError::IndexOutOfRange { .. })
    ));
    assert!(matches!(
        ds.document_sequences(2),
        Err(DataError::IndexOutOfRange { .. })
    ));
}

/// Writes `idx` (and the tiny `.bin`) and opens them.
fn open_with(
    dir: &TempDir,
    name: &str,
    idx: &[u8],
    bin: &[u8],
) -> Result<IndexedDataset, DataError> {
    let prefix = dir.join(name);
    std::fs::write(index_file_path(&prefix), idx).unwrap();
    std::fs::write(data_file_path(&prefix), bin).unwrap();
    IndexedDataset::open(&prefix)
}

#[test]
fn truncated_index_files_are_errors_at_every_cut() {
    let dir = TempDir::new("truncated");
    let idx = megatron_tiny_idx();
    let bin = megatron_tiny_bin();
    // Every cut: inside the magic, the version, the dtype, the counts, each array.
    for cut in 0..idx.len() {
        let err = open_with(&dir, &format!("cut{cut}"), &idx[..cut], &bin).unwrap_err();
        let name = format!("cut{cut}.idx");
        match &err {
            DataError::Truncated {
                path,
                len,
                needed,
                what,
            } => {
                assert!(path.ends_with(&name), "{err}");
                assert_eq!(*len, cut as u64);
                assert!(needed.end > cut as u64, "{err}");
                let expected = match cut {
                    0..34 => "header",
                    34..46 => "sequence lengths",
                    46..70 => "sequence pointers",
                    _ => "document indices",
                };
                assert_eq!(*what, expected, "cut at {cut}");
            }
            other => panic!("cut at {cut}: expected Truncated, got {other:?}"),
        }
        assert!(err.to_string().contains(&name), "{err}");
    }
}

#[test]
fn truncated_data_files_are_errors() {
    let dir = TempDir::new("truncated-bin");
    let idx = megatron_tiny_idx();
    let bin = megatron_tiny_bin();
    for cut in [0, 1, 5, 11] {
        let err = open_with(&dir, &format!("bin{cut}"), &idx, &bin[..cut]).unwrap_err();
        assert!(
            matches!(&err, DataError::SequenceOutOfRange { path, bin_len, .. }
                if path.ends_with(format!("bin{cut}.bin")) && *bin_len == cut as u64),
            "cut at {cut}: {err:?}"
        );
    }
}

#[test]
fn wrong_magic_is_an_error() {
    let dir = TempDir::new("magic");
    let mut idx = megatron_tiny_idx();
    idx[0] = b'X';
    let err = open_with(&dir, "magic", &idx, &megatron_tiny_bin()).unwrap_err();
    assert!(
        matches!(&err, DataError::BadMagic { found, .. } if found[0] == b'X'),
        "{err:?}"
    );
    assert!(err.to_string().contains("magic.idx"), "{err}");
    // A short file that is not a prefix of the magic is also a wrong magic.
    let err = open_with(&dir, "short", b"PK\x03", &[]).unwrap_err();
    assert!(matches!(err, DataError::BadMagic { .. }), "{err:?}");
}

#[test]
fn wrong_version_is_an_error() {
    let dir = TempDir::new("version");
    let mut idx = megatron_tiny_idx();
    idx[9] = 2;
    let err = open_with(&dir, "v2", &idx, &megatron_tiny_bin()).unwrap_err();
    assert!(
        matches!(err, DataError::BadVersion { version: 2, .. }),
        "{err:?}"
    );
}

#[test]
fn unknown_dtype_codes_are_errors() {
    let dir = TempDir::new("dtype");
    for code in [0u8, 9, 255] {
        let mut idx = megatron_tiny_idx();
        idx[17] = code;
        let err = open_with(&dir, &format!("code{code}"), &idx, &megatron_tiny_bin()).unwrap_err();
        assert!(
            matches!(err, DataError::UnknownDType { code: c, .. } if c == code),
            "{err:?}"
        );
    }
}

/// Overwrites 8 bytes of `idx` at `at` with `value`.
fn patch_i64(idx: &mut [u8], at: usize, value: i64) {
    idx[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

#[test]
fn pointers_and_lengths_past_the_data_file_are_errors() {
    let dir = TempDir::new("pointers");
    let bin = megatron_tiny_bin();
    // Pointers start at 34 + 4 · 3 = 46; sequence 2's pointer is at 62.
    for (name, pointer) in [
        ("past", 12i64),
        ("edge", 9),
        ("negative", -2),
        ("huge", i64::MAX),
    ] {
        let mut idx = megatron_tiny_idx();
        patch_i64(&mut idx, 62, pointer);
        let err = open_with(&dir, name, &idx, &bin).unwrap_err();
        assert!(
            matches!(err, DataError::SequenceOutOfRange { sequence: 2, pointer: p, .. } if p == pointer),
            "{name}: {err:?}"
        );
    }
    // A length that runs past the end: sequence 0 (at 34) with 7 tokens.
    let mut idx = megatron_tiny_idx();
    idx[34..38].copy_from_slice(&7i32.to_le_bytes());
    let err = open_with(&dir, "long", &idx, &bin).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::SequenceOutOfRange {
                sequence: 0,
                length: 7,
                ..
            }
        ),
        "{err:?}"
    );
    // A negative length.
    idx[34..38].copy_from_slice(&(-1i32).to_le_bytes());
    let err = open_with(&dir, "negative-len", &idx, &bin).unwrap_err();
    assert!(
        matches!(err, DataError::SequenceOutOfRange { length: -1, .. }),
        "{err:?}"
    );
}

#[test]
fn inconsistent_counts_are_errors() {
    let dir = TempDir::new("counts");
    let bin = megatron_tiny_bin();
    // A sequence count larger than the file holds: a truncation of the arrays.
    let mut idx = megatron_tiny_idx();
    patch_i64(&mut idx, 18, 1 << 40);
    let err = open_with(&dir, "many-seqs", &idx, &bin).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::Truncated {
                what: "sequence lengths",
                ..
            }
        ),
        "{err:?}"
    );
    // u64::MAX sequences must not overflow the size computation.
    patch_i64(&mut idx, 18, -1);
    let err = open_with(&dir, "max-seqs", &idx, &bin).unwrap_err();
    assert!(matches!(err, DataError::Truncated { .. }), "{err:?}");
    // A document count of zero.
    let mut idx = megatron_tiny_idx();
    patch_i64(&mut idx, 26, 0);
    let err = open_with(&dir, "no-docs", &idx, &bin).unwrap_err();
    assert!(
        matches!(err, DataError::InconsistentIndex { .. }),
        "{err:?}"
    );
    // Document indices (at 34 + 12 · 3 = 70) that do not end at the sequence count.
    let mut idx = megatron_tiny_idx();
    patch_i64(&mut idx, 86, 2);
    let err = open_with(&dir, "last-doc", &idx, &bin).unwrap_err();
    assert!(
        matches!(&err, DataError::InconsistentIndex { problem, .. } if problem.contains("last document index")),
        "{err:?}"
    );
    // ... that decrease, or do not start at 0.
    let mut idx = megatron_tiny_idx();
    patch_i64(&mut idx, 78, 4);
    let err = open_with(&dir, "decreasing", &idx, &bin).unwrap_err();
    assert!(
        matches!(err, DataError::InconsistentIndex { .. }),
        "{err:?}"
    );
    let mut idx = megatron_tiny_idx();
    patch_i64(&mut idx, 70, 1);
    let err = open_with(&dir, "first-doc", &idx, &bin).unwrap_err();
    assert!(
        matches!(err, DataError::InconsistentIndex { .. }),
        "{err:?}"
    );
    // Stray bytes after the document indices (neither none nor one mode per sequence).
    let mut idx = megatron_tiny_idx();
    idx.extend_from_slice(&[0, 0]);
    let err = open_with(&dir, "trailing", &idx, &bin).unwrap_err();
    assert!(
        matches!(err, DataError::InconsistentIndex { .. }),
        "{err:?}"
    );
}

#[test]
fn missing_files_are_io_errors_naming_the_file() {
    let dir = TempDir::new("missing");
    let err = IndexedDataset::open(dir.join("nothing")).unwrap_err();
    assert!(
        matches!(&err, DataError::Io { path, .. } if path.ends_with("nothing.idx")),
        "{err:?}"
    );
    // The error converts into the crate's error.
    let err: burn_megatron::Error = err.into();
    assert!(err.to_string().contains("nothing.idx"), "{err}");
}

#[test]
fn a_float_dataset_opens_but_gives_no_tokens() {
    let dir = TempDir::new("float");
    let mut idx = megatron_tiny_idx();
    idx[17] = DType::F32.code();
    // Pointers for 4-byte items: 0, 12, 16; the .bin needs 24 bytes.
    patch_i64(&mut idx, 54, 12);
    patch_i64(&mut idx, 62, 16);
    let ds = open_with(&dir, "float", &idx, &[0u8; 24]).unwrap();
    assert!(matches!(
        ds.get(0),
        Err(DataError::TokenDType {
            dtype: DType::F32,
            ..
        })
    ));
}
