//! Partial reads: a checkpoint saved at PP = 1 loaded at PP = 4 reads, on each rank, only the
//! blocks of the file that hold its layers (memory-mapped, each block checked against its own
//! CRC-32); so a corrupt byte is found by the rank that reads it, naming the file and bytes.
//! Metadata without block checksums is still read, each file checked whole.

use std::fs;
use std::path::Path;

use burn_megatron::checkpointing::{Checkpoint, Checkpointer, TrainingState};
use burn_megatron::tensor_parallel::gather_full_params;

use crate::{build, run, scratch, tiny_gpt};

const BLOCK: usize = 256;

/// Loads the latest checkpoint under `root` at PP = `pp`: each rank's bytes checked, or its
/// error.
fn load_at_pp(root: &Path, pp: usize) -> Vec<Result<u64, String>> {
    let config = tiny_gpt();
    run(pp, |ctx| {
        let (_, chunks) = build(&ctx, &config, 1, pp)?;
        let checkpoint = Checkpoint::open_latest(root)?;
        let loaded = checkpoint.load_model(chunks.into_iter().next().unwrap());
        Ok(loaded
            .map(|_| checkpoint.bytes_checked())
            .map_err(|e| e.to_string()))
    })
}

#[test]
fn each_pipeline_rank_reads_only_the_blocks_of_its_layers() {
    let config = tiny_gpt();
    let root = scratch("partial");
    run(1, |ctx| {
        let (state, chunks) = build(&ctx, &config, 1, 1)?;
        Checkpointer::new(&root).with_checksum_block(BLOCK).save(
            &state,
            &config,
            &chunks,
            None,
            &TrainingState::default(),
        )?;
        Ok(())
    });
    let file = root.join("iter_0000000/model_tp0_pp0.safetensors");
    let size = fs::metadata(&file).unwrap().len();

    // One rank needs everything, and checks every byte.
    assert_eq!(load_at_pp(&root, 1), vec![Ok(size)]);
    // Four stages: each reads its layers, the header and the blocks around them.
    let read: Vec<u64> = load_at_pp(&root, 4)
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    for (stage, &bytes) in read.iter().enumerate() {
        assert!(
            bytes < size / 2,
            "stage {stage} read {bytes} of {size} bytes"
        );
    }
    assert!(
        read.iter().sum::<u64>() >= size,
        "together the stages read the file"
    );

    // Metadata without block checksums (as written before they existed): every file a rank
    // opens is checked whole.
    let meta = root.join("iter_0000000/metadata.json");
    let original_meta = fs::read_to_string(&meta).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&original_meta).unwrap();
    for entry in json["files"].as_object_mut().unwrap().values_mut() {
        let entry = entry.as_object_mut().unwrap();
        entry.remove("block_bytes");
        entry.remove("block_crc32");
    }
    fs::write(&meta, serde_json::to_string(&json).unwrap()).unwrap();
    assert_eq!(load_at_pp(&root, 4), vec![Ok(size); 4]);
    fs::write(&meta, original_meta).unwrap();

    // A flipped byte inside the last layer's fc1 weight: only the last stage reads it.
    let bytes = fs::read(&file).unwrap();
    let header = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let key = "model/block.layers.3.mlp.fc1.weight";
    let data = header.tensor(key).unwrap().data();
    let at = data.as_ptr() as usize - bytes.as_ptr() as usize + data.len() / 2;
    let mut corrupt = bytes.clone();
    corrupt[at] ^= 0x10;
    fs::write(&file, &corrupt).unwrap();
    let results = load_at_pp(&root, 4);
    assert!(results[..3].iter().all(Result::is_ok), "{results:?}");
    let err = results[3].as_ref().unwrap_err();
    let block = at / BLOCK * BLOCK;
    assert!(
        err.contains("model_tp0_pp0.safetensors")
            && err.contains(&format!(
                "corrupt: CRC-32 of bytes {block}..{}",
                block + BLOCK
            )),
        "{err}"
    );
    fs::remove_dir_all(root).unwrap();
}

/// A tensor large enough to be read by several threads, each a band of its rows (the
/// embedding: 140 004 padded rows of 16 f32, 9 MB), saved at TP 2 and loaded at TP 1 into a
/// model drawn from another seed, equals the TP 1 model bit for bit.
#[test]
fn a_tensor_read_in_bands_by_several_threads_loads_exactly() {
    let mut config = tiny_gpt();
    config.vocab_size = 140_001;
    let root = scratch("bands");
    run(2, |ctx| {
        let (state, chunks) = build(&ctx, &config, 2, 1)?;
        Checkpointer::new(&root).save(&state, &config, &chunks, None, &TrainingState::default())?;
        Ok(())
    });
    run(1, |ctx| {
        let (state, want) = build(&ctx, &config, 1, 1)?;
        let mut other = config.clone();
        other.seed += 1;
        let (_, template) = build(&ctx, &other, 1, 1)?;
        let template = template.into_iter().next().unwrap();
        let drawn = gather_full_params(&template, state.tp())?;
        let loaded = Checkpoint::open_latest(&root)?.load_model(template)?;
        let want = gather_full_params(&want[0], state.tp())?;
        let got = gather_full_params(&loaded, state.tp())?;
        assert_ne!(drawn, want, "the template starts from other values");
        assert_eq!(got.len(), want.len());
        for ((path, got), (want_path, want)) in got.iter().zip(&want) {
            assert_eq!(path, want_path);
            assert_eq!(got.as_bytes(), want.as_bytes(), "{path}");
        }
        Ok(())
    });
}
