//! Which transformer layers each pipeline stage holds.

use core::ops::Range;

use crate::error::PipelineError;

/// The division of a model's layers among the pipeline's virtual stages (`pp · v` of them;
/// `pp` without interleaving). Megatron's `get_num_layers_to_build` and
/// `decoder_first/last_pipeline_num_layers`, as a value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageSplit {
    counts: Vec<usize>,
}

impl StageSplit {
    /// `num_layers` layers split evenly over `stages` stages.
    pub fn even(num_layers: usize, stages: usize) -> Result<Self, PipelineError> {
        if stages == 0 || !num_layers.is_multiple_of(stages) {
            return Err(PipelineError::LayersNotDivisible {
                layers: num_layers,
                stages,
            });
        }
        Ok(Self {
            counts: vec![num_layers / stages; stages],
        })
    }

    /// Explicit layer counts, one per stage in stage order (virtual stage `c · pp + r` is
    /// chunk `c` of pipeline rank `r`). A stage may hold no layers (say, a last stage that
    /// holds only the output layer and the loss).
    pub fn explicit(
        counts: Vec<usize>,
        stages: usize,
        num_layers: usize,
    ) -> Result<Self, PipelineError> {
        if counts.len() != stages || counts.iter().sum::<usize>() != num_layers {
            return Err(PipelineError::LayerCounts {
                counts,
                stages,
                layers: num_layers,
            });
        }
        Ok(Self { counts })
    }

    /// Megatron's division of `num_layers` over `pp` pipeline ranks of `virtual_stages` model
    /// chunks each (`get_num_layers_to_build` with `--decoder-first-pipeline-num-layers` and
    /// `--decoder-last-pipeline-num-layers`): `first` layers on the first rank and `last` on
    /// the last where given, the rest evenly over the other ranks; then each rank's layers over
    /// its chunks (virtual stage `c · pp + r` is chunk `c` of rank `r`), the earlier chunks
    /// taking one more where they do not divide. Megatron requires them to divide; allowing a
    /// remainder is what lets a 32-layer model run 9, 9, 9 and 5 layers a rank interleaved.
    ///
    /// Why: the last stage also runs the output layer and the loss. Llama-3 8B's output layer
    /// (vocabulary 128 256) costs about two of its transformer layers, so with an even split
    /// the last rank does a quarter more work than the others at PP = 4 and every rank waits
    /// for it; fewer layers there balance the pipeline.
    pub fn pipeline(
        num_layers: usize,
        pp: usize,
        virtual_stages: usize,
        first: Option<usize>,
        last: Option<usize>,
    ) -> Result<Self, PipelineError> {
        let uneven = |problem: String| PipelineError::UnevenStages {
            layers: num_layers,
            pp,
            first,
            last,
            problem,
        };
        if pp == 0 || virtual_stages == 0 {
            return Err(uneven(
                "PP and the virtual stages per rank must be at least 1".into(),
            ));
        }
        if (first.is_some() || last.is_some()) && pp < 2 {
            return Err(uneven(
                "first- and last-stage layer counts need --pipeline-model-parallel-size of at \
                 least 2"
                    .into(),
            ));
        }
        let given = first.unwrap_or(0) + last.unwrap_or(0);
        if given > num_layers {
            return Err(uneven(format!(
                "they hold {given} layers, more than the model has"
            )));
        }
        let middle_ranks = pp - usize::from(first.is_some()) - usize::from(last.is_some());
        let rest = num_layers - given;
        let middle = match middle_ranks {
            0 if rest > 0 => {
                return Err(uneven(format!(
                    "at PP = {pp} they must add up to the {num_layers} layers ({rest} left over)"
                )));
            }
            0 => 0,
            n if !rest.is_multiple_of(n) => {
                return Err(match (first, last) {
                    (None, None) => PipelineError::LayersNotDivisible {
                        layers: num_layers,
                        stages: pp,
                    },
                    _ => uneven(format!(
                        "the other {n} ranks would share {rest} layers unevenly: choose counts \
                         that leave a multiple of {n}"
                    )),
                });
            }
            n => rest / n,
        };
        if middle == 0 && middle_ranks > 0 {
            return Err(uneven(format!(
                "the {middle_ranks} rank(s) between would hold no layers: give them some"
            )));
        }
        let rank_layers = |rank: usize| match (rank, first, last) {
            (0, Some(first), _) => first,
            (r, _, Some(last)) if r + 1 == pp => last,
            _ => middle,
        };
        let mut counts = vec![0; pp * virtual_stages];
        for rank in 0..pp {
            let layers = rank_layers(rank);
            let (base, extra) = (layers / virtual_stages, layers % virtual_stages);
            for chunk in 0..virtual_stages {
                counts[chunk * pp + rank] = base + usize::from(chunk < extra);
            }
        }
        Ok(Self { counts })
    }

    /// Layers of pipeline rank `rank` (over all its chunks).
    pub fn rank_layers(&self, rank: usize, pp: usize) -> usize {
        self.counts.iter().skip(rank).step_by(pp).sum()
    }

    /// The number of stages.
    pub fn num_stages(&self) -> usize {
        self.counts.len()
    }

    /// Layers per stage.
    pub fn counts(&self) -> &[usize] {
        &self.counts
    }

    /// Virtual stage `index` (`0..num_stages()`).
    pub fn stage(&self, index: usize) -> Stage {
        let start = self.counts[..index].iter().sum();
        Stage {
            index,
            num_stages: self.counts.len(),
            layers: start..start + self.counts[index],
        }
    }
}

/// One (virtual) stage of a pipeline: its place and the global indices of its layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    /// Its index among the stages.
    pub index: usize,
    /// Stages in the pipeline.
    pub num_stages: usize,
    /// The global indices of the transformer layers it holds.
    pub layers: Range<usize>,
}

impl Stage {
    /// The whole model as a single stage.
    pub fn whole(num_layers: usize) -> Self {
        Self {
            index: 0,
            num_stages: 1,
            layers: 0..num_layers,
        }
    }

    /// Whether it holds the embedding (Megatron's `pre_process`).
    pub fn is_first(&self) -> bool {
        self.index == 0
    }

    /// Whether it holds the final norm, the output layer and the loss (Megatron's
    /// `post_process`).
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.num_stages
    }

    /// The path in the whole model of a parameter at `path` in this stage's module: its
    /// layers are numbered from `layers.start` (`block.layers.1.mlp.fc1.weight` of a stage
    /// starting at layer 4 is `block.layers.5.mlp.fc1.weight`); other paths are unchanged.
    pub fn global_path(&self, path: &str) -> String {
        let Some(rest) = path.strip_prefix("block.layers.") else {
            return path.to_string();
        };
        match rest.split_once('.') {
            Some((index, tail)) => match index.parse::<usize>() {
                Ok(index) => format!("block.layers.{}.{tail}", index + self.layers.start),
                Err(_) => path.to_string(),
            },
            None => path.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Megatron's rule, and the remainder of a rank's layers on its earlier chunks.
    #[test]
    fn pipeline_split_follows_megatrons_first_and_last_counts() {
        let split = |pp, v, first, last| StageSplit::pipeline(32, pp, v, first, last);
        assert_eq!(
            split(4, 1, None, None).unwrap(),
            StageSplit::even(32, 4).unwrap()
        );
        assert_eq!(
            split(4, 2, None, None).unwrap(),
            StageSplit::even(32, 8).unwrap()
        );
        assert_eq!(split(4, 1, None, Some(5)).unwrap().counts(), [9, 9, 9, 5]);
        assert_eq!(
            split(4, 1, Some(6), Some(8)).unwrap().counts(),
            [6, 9, 9, 8]
        );
        assert_eq!(split(2, 1, Some(20), Some(12)).unwrap().counts(), [20, 12]);
        assert_eq!(split(2, 1, None, Some(0)).unwrap().counts(), [32, 0]);
        // Chunk c of rank r is virtual stage c · pp + r: 9 = 3 + 2 + 2 + 2, 5 = 2 + 1 + 1 + 1.
        let interleaved = split(4, 4, None, Some(5)).unwrap();
        assert_eq!(
            interleaved.counts(),
            [3, 3, 3, 2, 2, 2, 2, 1, 2, 2, 2, 1, 2, 2, 2, 1]
        );
        assert_eq!(
            (0..4)
                .map(|r| interleaved.rank_layers(r, 4))
                .collect::<Vec<_>>(),
            [9, 9, 9, 5]
        );
        assert_eq!(interleaved.stage(15).layers, 31..32);

        for (pp, v, first, last, want) in [
            (1, 1, None, Some(4), "at least 2"),
            (4, 1, None, Some(6), "share 26 layers unevenly"),
            (
                2,
                1,
                Some(20),
                Some(10),
                "add up to the 32 layers (2 left over)",
            ),
            (4, 1, Some(20), Some(20), "more than the model has"),
            (3, 1, None, None, "do not split evenly over 3"),
            (0, 1, None, None, "at least 1"),
            (
                3,
                1,
                Some(32),
                Some(0),
                "the 1 rank(s) between would hold no layers",
            ),
        ] {
            let err = split(pp, v, first, last).unwrap_err().to_string();
            assert!(err.contains(want), "PP {pp} {first:?} {last:?}: {err}");
        }
    }
}
