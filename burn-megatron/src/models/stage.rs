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
