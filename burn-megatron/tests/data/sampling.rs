//! GPT sampling: fixed-length samples, the shuffled concatenation, determinism and resume;
//! splits; blending.

use std::sync::Arc;

use burn_megatron::data::{
    BlendedDataset, DType, DataError, GptDataset, GptDatasetConfig, IndexedDataset,
    IndexedDatasetBuilder, SampleDataset, Split, blending_indices, parse_data_path, parse_split,
    samples_per_dataset, split_ranges,
};

use crate::TempDir;

/// `n` documents; document `d` has `(d · 7) % 13` tokens (some empty), token `k` of it is
/// `d · 100 + k`, so every token names its document and place.
fn documents(n: usize) -> Vec<Vec<i64>> {
    (0..n)
        .map(|d| (0..(d * 7) % 13).map(|k| (d * 100 + k) as i64).collect())
        .collect()
}

fn write(dir: &TempDir, name: &str, docs: &[Vec<i64>]) -> Arc<IndexedDataset> {
    let prefix = dir.join(name);
    let mut builder = IndexedDatasetBuilder::new(&prefix, DType::I32).unwrap();
    for doc in docs {
        builder.add_document(doc, &[doc.len()]).unwrap();
    }
    builder.finalize().unwrap();
    Arc::new(IndexedDataset::open(&prefix).unwrap())
}

fn all_samples(ds: &impl SampleDataset) -> Vec<Vec<i64>> {
    (0..ds.len()).map(|i| ds.sample(i).unwrap()).collect()
}

#[test]
fn samples_cut_the_shuffled_concatenation() {
    let dir = TempDir::new("cut");
    let docs = documents(30);
    let ds = write(&dir, "docs", &docs);
    let tokens_per_epoch: usize = docs.iter().map(Vec::len).sum();
    let seq_len = 8;
    // More samples than one epoch holds: three epochs are needed.
    let num_samples = 2 * tokens_per_epoch / seq_len + 5;
    let config = GptDatasetConfig::new(seq_len).with_random_seed(7);
    let gpt = GptDataset::new(ds, 0..30, num_samples, &config).unwrap();
    assert_eq!(gpt.num_epochs(), 3);
    assert!(gpt.len() >= num_samples);
    assert_eq!(gpt.len(), (3 * tokens_per_epoch - 1) / seq_len);

    // Every document once per epoch, in a shuffled order.
    let order = gpt.document_index();
    assert_eq!(order.len(), 90);
    for d in 0..30 {
        assert_eq!(order.iter().filter(|&&x| x == d).count(), 3, "document {d}");
    }
    assert_ne!(
        &order[..30],
        (0..30).collect::<Vec<_>>().as_slice(),
        "not shuffled"
    );

    // The shuffle index is a permutation, and not the identity.
    let mut shuffle = gpt.shuffle_index().to_vec();
    assert_ne!(shuffle, (0..gpt.len()).collect::<Vec<_>>());
    shuffle.sort();
    assert_eq!(shuffle, (0..gpt.len()).collect::<Vec<_>>());

    // Sample i is tokens k·seq_len ..= (k+1)·seq_len of the concatenation, k = shuffle[i].
    let concatenation: Vec<i64> = order.iter().flat_map(|&d| docs[d].clone()).collect();
    for i in 0..gpt.len() {
        let sample = gpt.sample(i).unwrap();
        assert_eq!(sample.len(), seq_len + 1, "sample {i}");
        let k = gpt.shuffle_index()[i];
        assert_eq!(
            sample,
            concatenation[k * seq_len..=(k + 1) * seq_len],
            "sample {i}"
        );
    }
    assert!(matches!(
        gpt.sample(gpt.len()),
        Err(DataError::IndexOutOfRange { what: "sample", .. })
    ));
}

#[test]
fn the_same_seed_gives_the_same_samples_and_another_seed_does_not() {
    let dir = TempDir::new("seed");
    let ds = write(&dir, "docs", &documents(40));
    let make = |seed| {
        GptDataset::new(
            ds.clone(),
            0..40,
            50,
            &GptDatasetConfig::new(5).with_random_seed(seed),
        )
        .unwrap()
    };
    let a = all_samples(&make(1));
    assert_eq!(a, all_samples(&make(1)));
    assert_ne!(a, all_samples(&make(2)));
}

#[test]
fn a_restart_resumes_at_the_exact_sample() {
    let dir = TempDir::new("resume");
    let ds = write(&dir, "docs", &documents(40));
    let config = GptDatasetConfig::new(6).with_random_seed(99);
    let first = GptDataset::new(ds.clone(), 0..40, 60, &config).unwrap();
    let consumed = 23;
    let before: Vec<Vec<i64>> = (0..first.len()).map(|i| first.sample(i).unwrap()).collect();
    drop(first);
    // "Restart": reopen the files, rebuild the dataset, read from the consumed position.
    let reopened = Arc::new(IndexedDataset::open(dir.join("docs")).unwrap());
    let second = GptDataset::new(reopened, 0..40, 60, &config).unwrap();
    let after: Vec<Vec<i64>> = (consumed..second.len())
        .map(|i| second.sample(i).unwrap())
        .collect();
    assert_eq!(after, before[consumed..]);
}

#[test]
fn a_short_final_epoch_is_shuffled_apart() {
    let dir = TempDir::new("final-epoch");
    let docs = documents(30);
    let ds = write(&dir, "docs", &docs);
    let tokens_per_epoch: usize = docs.iter().map(Vec::len).sum();
    let seq_len = 4;
    let per_epoch = (tokens_per_epoch - 1) / seq_len;
    // Two epochs, the second needed for only a few samples: Megatron's separate_final_epoch.
    let gpt = GptDataset::new(ds, 0..30, per_epoch + 3, &GptDatasetConfig::new(seq_len)).unwrap();
    assert_eq!(gpt.num_epochs(), 2);
    let order = gpt.document_index();
    let mut last: Vec<usize> = order[30..].to_vec();
    last.sort();
    assert_eq!(
        last,
        (0..30).collect::<Vec<_>>(),
        "the last epoch is whole, apart"
    );
    // The first samples come from the first epoch only.
    let before_last = (tokens_per_epoch - 1) / seq_len;
    assert!(
        gpt.shuffle_index()[..before_last]
            .iter()
            .all(|&k| k < before_last)
    );
}

#[test]
fn sampling_a_range_of_documents_uses_only_them() {
    let dir = TempDir::new("range");
    let docs = documents(30);
    let ds = write(&dir, "docs", &docs);
    let gpt = GptDataset::new(ds, 10..20, 20, &GptDatasetConfig::new(3)).unwrap();
    for sample in all_samples(&gpt) {
        for token in sample {
            let document = token / 100;
            assert!((10..20).contains(&document), "token {token}");
        }
    }
}

#[test]
fn bad_sampling_settings_are_errors() {
    let dir = TempDir::new("bad-sampling");
    let ds = write(&dir, "docs", &documents(10));
    let err = GptDataset::new(ds.clone(), 0..10, 5, &GptDatasetConfig::new(0)).unwrap_err();
    assert!(matches!(err, DataError::Invalid(_)), "{err}");
    let err = GptDataset::new(ds.clone(), 5..11, 5, &GptDatasetConfig::new(4)).unwrap_err();
    assert!(matches!(err, DataError::Invalid(_)), "{err}");
    // Document 0 is empty: nothing to sample.
    let err = GptDataset::new(ds, 0..1, 5, &GptDatasetConfig::new(4)).unwrap_err();
    assert!(err.to_string().contains("no tokens"), "{err}");
}

#[test]
fn splits_parse_like_megatron_and_partition_the_documents() {
    let split = parse_split("969,30,1").unwrap();
    assert!((split[0] - 0.969).abs() < 1e-12 && (split[2] - 0.001).abs() < 1e-12);
    assert_eq!(parse_split("99,1").unwrap(), [0.99, 0.01, 0.0]);
    assert_eq!(parse_split("1").unwrap(), [1.0, 0.0, 0.0]);
    for bad in ["", "1,2,3,4", "a,1", "-1,2", "0,0,0"] {
        assert!(
            matches!(parse_split(bad), Err(DataError::Invalid(_))),
            "{bad:?}"
        );
    }
    for n in [0, 1, 2, 7, 100, 1001, 123_457] {
        for s in ["969,30,1", "98,2,0", "1,1,1", "0,1,0", "5,0,5"] {
            let ranges = split_ranges(&parse_split(s).unwrap(), n);
            assert_eq!(ranges[0].start, 0, "{s} of {n}");
            assert_eq!(ranges[0].end, ranges[1].start, "{s} of {n}");
            assert_eq!(ranges[1].end, ranges[2].start, "{s} of {n}");
            assert_eq!(ranges[2].end, n, "{s} of {n}");
        }
    }
    // Megatron's rounding: 1000 documents at 969,30,1 are 969, 30 and 1.
    let ranges = split_ranges(&parse_split("969,30,1").unwrap(), 1000);
    assert_eq!(ranges, [0..969, 969..999, 999..1000]);
    assert_eq!(Split::Valid.index(), 1);
}

#[test]
fn blending_tracks_the_weights_within_one_sample() {
    for weights in [
        vec![0.3, 0.7],
        vec![0.5, 0.25, 0.25],
        vec![0.1, 0.6, 0.2, 0.1],
    ] {
        let (datasets, samples) = blending_indices(&weights, 2000);
        let mut taken = vec![0usize; weights.len()];
        for (n, (&d, &s)) in datasets.iter().zip(&samples).enumerate() {
            assert_eq!(s, taken[d], "each dataset's samples are taken in order");
            taken[d] += 1;
            for (w, t) in weights.iter().zip(&taken) {
                let share = w * (n + 1) as f64;
                assert!(
                    (*t as f64 - share).abs() <= 1.0,
                    "{weights:?} after {}: {taken:?}",
                    n + 1
                );
            }
        }
    }
}

#[test]
fn a_blended_dataset_serves_each_datasets_samples_in_proportion() {
    let dir = TempDir::new("blend");
    let a = write(&dir, "a", &documents(20));
    // Dataset b: the same shapes, tokens offset so they are told apart.
    let b_docs: Vec<Vec<i64>> = documents(20)
        .into_iter()
        .map(|d| d.into_iter().map(|t| t + 1_000_000).collect())
        .collect();
    let b = write(&dir, "b", &b_docs);
    let size = 300;
    let weights = [1.0, 3.0];
    let per_dataset = samples_per_dataset(&[0.25, 0.75], size, 0.005);
    let config = GptDatasetConfig::new(4).with_random_seed(5);
    let datasets = vec![
        GptDataset::new(a, 0..20, per_dataset[0], &config).unwrap(),
        GptDataset::new(b, 0..20, per_dataset[1], &config).unwrap(),
    ];
    let expected_b: Vec<Vec<i64>> = all_samples(&datasets[1]);
    let blend = BlendedDataset::new(datasets, &weights, size).unwrap();
    assert_eq!(blend.len(), size);
    assert_eq!(blend.weights(), [0.25, 0.75]);
    let samples = all_samples(&blend);
    let from_b: Vec<&Vec<i64>> = samples.iter().filter(|s| s[0] >= 1_000_000).collect();
    assert!(
        (from_b.len() as f64 - 225.0).abs() <= 1.0,
        "{}",
        from_b.len()
    );
    // Dataset b's samples come in its own order.
    for (got, want) in from_b.iter().zip(&expected_b) {
        assert_eq!(*got, want);
    }
    // A dataset too small for its share is an error.
    let ds = write(&dir, "small", &documents(5));
    let small = GptDataset::new(ds, 0..5, 3, &config).unwrap();
    let err = BlendedDataset::new(vec![small], &[1.0], 10_000).unwrap_err();
    assert!(err.to_string().contains("samples_per_dataset"), "{err}");
}

#[test]
fn data_paths_parse_like_megatron() {
    let words = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
    let blend = parse_data_path(&words("0.3 a_text_document 0.7 b_text_document")).unwrap();
    assert_eq!(blend.len(), 2);
    assert_eq!(blend[1].0, 0.7);
    assert!(blend[1].1.ends_with("b_text_document"));
    assert_eq!(parse_data_path(&words("x y")).unwrap()[1].0, 1.0);
    assert!(parse_data_path(&words("0.3 a 0.7")).is_err());
    assert!(parse_data_path(&[]).is_err());
}
