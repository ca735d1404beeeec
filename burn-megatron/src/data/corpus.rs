//! A small corpus that the project generates, so training runs with no download.

use std::path::Path;

use super::preprocess::document_prefix;
use super::rng::SplitMix64;
use super::{ByteTokenizer, DType, DataError, IndexedDatasetBuilder, PreprocessSummary, Tokenizer};

const NAMES: [&str; 12] = [
    "Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "John", "Margaret", "Claude",
    "Hedy", "Ken",
];
const VERBS: [&str; 10] = [
    "reads", "writes", "builds", "tests", "draws", "finds", "keeps", "sends", "sorts", "counts",
];
const ADJECTIVES: [&str; 10] = [
    "small", "large", "red", "quiet", "old", "new", "bright", "careful", "simple", "strange",
];
const NOUNS: [&str; 12] = [
    "book", "machine", "garden", "letter", "river", "table", "program", "lamp", "map", "bridge",
    "clock", "song",
];
const PLACES: [&str; 8] = [
    "near the river",
    "in the garden",
    "at the station",
    "under the bridge",
    "by the window",
    "in the library",
    "on the hill",
    "at the market",
];

/// `num_documents` short documents of English-like sentences and small sums, generated from
/// `seed` (the same seed, the same text, on every machine). The text has structure a small
/// GPT learns within minutes (a grammar, agreement of names across a document, exact sums),
/// so a falling loss shows that training works. It is not natural language.
pub fn default_corpus(num_documents: usize, seed: u64) -> Vec<String> {
    let mut rng = SplitMix64::new(seed);
    (0..num_documents)
        .map(|_| {
            let name = pick(&mut rng, &NAMES);
            let sentences = 2 + rng.below(3);
            let mut text = String::new();
            for s in 0..sentences {
                let opening = if s == 0 { "" } else { "Then " };
                text.push_str(&format!(
                    "{opening}{name} {} the {} {} {}. ",
                    pick(&mut rng, &VERBS),
                    pick(&mut rng, &ADJECTIVES),
                    pick(&mut rng, &NOUNS),
                    pick(&mut rng, &PLACES),
                ));
            }
            let (a, b) = (rng.below(50), rng.below(50));
            text.push_str(&format!(
                "{name} counts {a} and {b}: {a} plus {b} is {}.",
                a + b
            ));
            text
        })
        .collect()
}

fn pick(rng: &mut SplitMix64, items: &[&'static str]) -> &'static str {
    items[rng.below(items.len() as u64) as usize]
}

/// Writes [`default_corpus`] as a byte-tokenized indexed dataset with end-of-document tokens:
/// `{output_prefix}_text_document.bin/.idx`, as `preprocess_data` would.
pub fn write_default_corpus(
    output_prefix: &Path,
    num_documents: usize,
    seed: u64,
) -> Result<PreprocessSummary, DataError> {
    let tokenizer = ByteTokenizer;
    let prefix = document_prefix(output_prefix, "text");
    let dtype = DType::optimal(tokenizer.vocab_size());
    let mut builder = IndexedDatasetBuilder::new(&prefix, dtype)?;
    let mut tokens = 0;
    for text in default_corpus(num_documents, seed) {
        let mut ids = tokenizer.encode(&text)?;
        ids.push(tokenizer.eod());
        tokens += ids.len();
        builder.add_document(&ids, &[ids.len()])?;
    }
    builder.finalize()?;
    Ok(PreprocessSummary {
        prefix,
        documents: num_documents,
        tokens,
        dtype,
    })
}
