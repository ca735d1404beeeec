//! Generation: prompts in, new tokens out, with the KV cache ([`generate`]) or by re-running
//! the whole forward pass for every token ([`generate_without_cache`], the reference).

use burn::module::Module;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use burn_megatron_dist::ProcessGroup;
use burn_megatron_dist::mapping::gather_from_tensor_parallel_region;

use super::decode::{embed_cached, layers_cached};
use super::device_step::DeviceStep;
use super::kv_cache::KvCache;
use super::sampling::Sampling;
use crate::backend::{ModelBackend, StepGraph};
use crate::error::{ConfigError, DeviceError, IdKind, InputError, Result, read_data};
use crate::models::GptModel;

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationConfig {
    /// The most tokens generated per prompt.
    pub max_new_tokens: usize,
    /// Tokens that end a prompt's generation (the stop token is kept in the output).
    pub stop_tokens: Vec<i64>,
    /// How each token is picked.
    pub sampling: Sampling,
}

impl GenerationConfig {
    /// Greedy generation of at most `max_new_tokens` tokens, without stop tokens.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            stop_tokens: Vec::new(),
            sampling: Sampling::Greedy,
        }
    }

    /// The same, stopping at any of `stop_tokens`.
    pub fn with_stop_tokens(self, stop_tokens: Vec<i64>) -> Self {
        Self {
            stop_tokens,
            ..self
        }
    }

    /// The same, picking tokens with `sampling`.
    pub fn with_sampling(self, sampling: Sampling) -> Self {
        Self { sampling, ..self }
    }
}

/// Why a prompt's generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced a stop token.
    Stop,
    /// It produced `max_new_tokens` tokens.
    MaxNewTokens,
    /// Prompt and new tokens filled the model's maximum sequence length.
    MaxSequenceLength,
}

/// One prompt's generated tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generated {
    /// The new tokens (not the prompt), the stop token included.
    pub tokens: Vec<i64>,
    /// Why generation ended.
    pub finish: FinishReason,
}

/// Generates a continuation of every prompt with `model` (a whole model, this rank's part
/// over its TP group: every rank of the group calls this with the same prompts and gets the
/// same tokens).
///
/// The prompts form one batch, padded on the left (see [`KvCache`]): a prefill pass over
/// all prompt tokens, then one pass per new token, each attending to the cache. A prompt
/// whose generation ended keeps riding along (its tokens are ignored) until all have ended.
/// The model runs without dropout; pass a backend without autodiff (the inner backend).
///
/// Errors: an empty prompt ([`InputError::EmptyPrompt`]), a prompt longer than the model's
/// maximum sequence ([`InputError::SequenceTooLong`]), a token outside the vocabulary
/// ([`InputError::IdOutOfRange`]), invalid sampling parameters or a model built with
/// sequence parallelism or as a pipeline stage ([`ConfigError`]: see
/// [`generate_pipelined`]).
///
/// # Shapes
/// - prompts: `batch` token lists of lengths `1..=max_sequence_length`
/// - output: `batch` lists of `0..=max_new_tokens` tokens
pub fn generate<B: ModelBackend>(
    model: &GptModel<B>,
    prompts: &[Vec<i64>],
    config: &GenerationConfig,
) -> Result<Vec<Generated>> {
    run_generation(model, None, prompts, config)
}

/// [`generate`] over a pipeline: `model` is this rank's stage (and TP part), `pp` the
/// pipeline group, whose rank `i` holds stage `i`. Every step, the first stage embeds the new
/// tokens, each stage runs its layers against its own layers' cache and sends the activations
/// on, the last stage picks the tokens, and a broadcast over `pp` gives them to every stage:
/// every rank of the pipeline and TP groups returns the same tokens.
///
/// The tokens travel as f32: exact for vocabularies below 2²⁴.
pub fn generate_pipelined<B: ModelBackend>(
    model: &GptModel<B>,
    pp: &ProcessGroup,
    prompts: &[Vec<i64>],
    config: &GenerationConfig,
) -> Result<Vec<Generated>> {
    run_generation(model, Some(pp), prompts, config)
}

fn run_generation<B: ModelBackend>(
    model: &GptModel<B>,
    pp: Option<&ProcessGroup>,
    prompts: &[Vec<i64>],
    config: &GenerationConfig,
) -> Result<Vec<Generated>> {
    check(model, pp, prompts, config)?;
    let mut rows: Vec<Row> = prompts.iter().map(|p| Row::new(p.len())).collect();
    if prompts.is_empty() || !finish_all(model, &mut rows, config) {
        return Ok(rows.into_iter().map(Row::into_generated).collect());
    }
    let device = model.devices().into_iter().next().unwrap_or_default();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let pads: Vec<usize> = prompts.iter().map(|p| longest - p.len()).collect();
    // The last token a row picks is never fed back.
    let fed = rows
        .iter()
        .map(|row| row.room(model, config).saturating_sub(1))
        .max()
        .unwrap_or(0);
    let mut cache = KvCache::with_capacity(model.layers().len(), pads.clone(), longest + fed);
    let padded: Vec<i64> = prompts
        .iter()
        .zip(&pads)
        .flat_map(|(p, &pad)| std::iter::repeat_n(0, pad).chain(p.iter().copied()))
        .collect();
    let mut tokens = Some(Tensor::<B, 2, Int>::from_data(
        TensorData::new(padded, [prompts.len(), longest]),
        &device,
    ));
    // After the prefill, a whole model decodes with its step's inputs on the device.
    let mut decode: Option<DeviceDecode<B>> = None;
    for step in 0.. {
        let picks = match (&mut decode, tokens.take()) {
            (Some(decode), _) => decode.step(model, &mut cache, config, step, &device)?,
            (None, Some(tokens)) => self::step(model, pp, tokens, &mut cache, step, config)?,
            (None, None) => unreachable!("the tokens of every eager step are set"),
        };
        let mut next = Vec::with_capacity(rows.len());
        for (row, &token) in rows.iter_mut().zip(&picks) {
            if row.finish.is_none() {
                row.push(token, model, config);
            }
            next.push(*row.tokens.last().unwrap_or(&0));
        }
        if rows.iter().all(|row| row.finish.is_some()) {
            break;
        }
        match &mut decode {
            Some(decode) => decode.last = next,
            None if pp.is_none_or(|pp| pp.size() == 1) => {
                let state = DeviceStep::new(model, &cache, next.clone(), &device)?;
                decode = Some(DeviceDecode::new(config, state, next));
            }
            None => {
                tokens = Some(Tensor::from_data(
                    TensorData::new(next, [rows.len(), 1]),
                    &device,
                ))
            }
        }
    }
    Ok(rows.into_iter().map(Row::into_generated).collect())
}

/// One pass of the next columns `tokens` (`[batch, new]`, read by the first stage only)
/// through the model or pipeline, the `step`-th of the generation: the token picked for every
/// row (of finished rows, any), the same on every rank. The last stage picks on the device
/// ([`Sampling::pick`]); the one read back to the host is the `[batch]` picked ids.
fn step<B: ModelBackend>(
    model: &GptModel<B>,
    pp: Option<&ProcessGroup>,
    tokens: Tensor<B, 2, Int>,
    cache: &mut KvCache<B>,
    step: usize,
    config: &GenerationConfig,
) -> Result<Vec<i64>> {
    let stage = model.stage().clone();
    let device = tokens.device();
    let batch = tokens.dims()[0];
    let x = match pp {
        Some(pp) if !stage.is_first() => pp.recv::<B, 3>(stage.index - 1, &device)?,
        _ => embed_cached(model, tokens, cache)?,
    };
    let new = x.dims()[1];
    let x = layers_cached(model, x, cache)?;
    let picks = if stage.is_last() {
        pick(model, config, model.head(x.narrow(1, new - 1, 1))?, step)?
    } else {
        if let Some(pp) = pp {
            pp.send(x, stage.index + 1)?;
        }
        // Replaced by the last stage's picks in the broadcast.
        Tensor::zeros([batch], &device)
    };
    let Some(pp) = pp.filter(|pp| pp.size() > 1) else {
        return read_tokens(model, picks);
    };
    let picked = pp.broadcast(picks.cast(FloatDType::F32), pp.size() - 1)?;
    let picked = read_data(picked, || {
        "the tokens the last pipeline stage picked".to_string()
    })
    .map_err(|e| e.on_rank(pp.global_rank()))?;
    Ok(f32_values(picked, "the picked tokens")?
        .into_iter()
        .map(|t| t as i64)
        .collect())
}

/// The decode steps of a whole model after the prefill: [`DeviceStep`]s, the first run as it
/// is (compiling and tuning its kernels), the second captured as a graph where the backend
/// has them (our CUDA backend; greedy picks; not with `BM_CUDA_GRAPHS=0`) and the rest
/// replays of it: one launch a step, the picks read back. Under tensor parallelism the graph
/// holds the step's NCCL collectives (captured on the compute stream), and every TP rank
/// captures and replays the same step.
struct DeviceDecode<B: ModelBackend> {
    /// The step's inputs (with a graph: the buffers it reads and advances, kept alive).
    state: Option<DeviceStep<B>>,
    /// The captured step and the buffer it writes the picks to.
    graph: Option<(StepGraph, Tensor<B, 1, Int>)>,
    /// Whether the next step may be captured.
    capture: bool,
    /// The tokens fed next, as the host knows them (to rebuild `state` if a capture fails).
    last: Vec<i64>,
}

impl<B: ModelBackend> DeviceDecode<B> {
    fn new(config: &GenerationConfig, state: DeviceStep<B>, last: Vec<i64>) -> Self {
        let capture = matches!(config.sampling, Sampling::Greedy)
            && std::env::var("BM_CUDA_GRAPHS").map_or(true, |v| v != "0");
        Self {
            state: Some(state),
            graph: None,
            capture,
            last,
        }
    }

    /// The `step`-th step's picks (`step` ≥ 1).
    fn step(
        &mut self,
        model: &GptModel<B>,
        cache: &mut KvCache<B>,
        config: &GenerationConfig,
        step: usize,
        device: &B::Device,
    ) -> Result<Vec<i64>> {
        if self.graph.is_none() && self.capture && step >= 2 {
            self.capture = false;
            self.try_capture(model, cache, config, step, device)?;
        }
        if let Some((graph, picks)) = &self.graph {
            cache.reserve(1, model.max_sequence_length())?;
            graph.replay();
            // Under tensor parallelism the graph holds the step's NCCL collectives: the TP
            // group's watchdog follows the replay as one.
            model.tp().watch_replay("the decode step's CUDA graph")?;
            cache.advance_all();
            return read_tokens(model, picks.clone());
        }
        let state = self.state.take().ok_or_else(|| {
            ConfigError::Invalid("the decode step's inputs were lost by a failed step".into())
        })?;
        let (state, picks) = state.run(model, cache, |logits| pick(model, config, logits, step))?;
        cache.advance_all();
        self.state = Some(state);
        read_tokens(model, picks)
    }

    /// Captures the next step as a graph (not running it). If the backend has no graphs or
    /// the capture fails (said once on stderr), the step's inputs are rebuilt from the host's
    /// view and decoding goes on without one; a KV cache not updated in place is an error.
    fn try_capture(
        &mut self,
        model: &GptModel<B>,
        cache: &mut KvCache<B>,
        config: &GenerationConfig,
        step: usize,
        device: &B::Device,
    ) -> Result<()> {
        let Some(state) = self.state.take() else {
            return Ok(());
        };
        let layers = model.layers().len();
        let cache_addresses = |cache: &KvCache<B>| {
            (0..layers)
                .map(|i| cache.layer(i).addresses())
                .collect::<Vec<_>>()
        };
        let (inputs, buffers) = (state.addresses(), cache_addresses(cache));
        match B::graph_begin(device) {
            Ok(true) => {}
            Ok(false) => {
                self.state = Some(state);
                return Ok(());
            }
            Err(reason) => {
                eprintln!("generate: decoding without a CUDA graph: {reason}");
                self.state = Some(state);
                return Ok(());
            }
        }
        let ran = state.run(model, cache, |logits| pick(model, config, logits, step));
        let ended = B::graph_end(device);
        if cache_addresses(cache) != buffers {
            return Err(ConfigError::Invalid(
                "the KV cache was copied, not written in place, while its decode step was \
                 captured as a CUDA graph: run with BM_CUDA_GRAPHS=0"
                    .into(),
            )
            .into());
        }
        let failure = match (ran, ended) {
            (Ok((state, picks)), Ok(graph)) if state.addresses() == inputs => {
                self.state = Some(state);
                self.graph = Some((graph, picks));
                return Ok(());
            }
            (Ok(_), Ok(_)) => "the step's inputs were copied, not advanced in place".to_string(),
            (Err(e), _) => format!("{e}"),
            (_, Err(reason)) => reason,
        };
        eprintln!("generate: decoding without a CUDA graph: {failure}");
        // The captured step did not run: its inputs are rebuilt as the host knows them.
        self.state = Some(DeviceStep::new(model, cache, self.last.clone(), device)?);
        Ok(())
    }
}

/// Each row's pick from the last stage's rank-local logits `[batch, 1, padded_vocab / tp]`.
fn pick<B: ModelBackend>(
    model: &GptModel<B>,
    config: &GenerationConfig,
    logits: Tensor<B, 3>,
    step: usize,
) -> Result<Tensor<B, 1, Int>> {
    Ok(config
        .sampling
        .pick(gathered_logits(model, logits)?, 0, step))
}

/// [`generate`] without a cache: each prompt alone, the whole forward pass
/// ([`GptModel::try_forward`]) rerun over prompt and tokens so far for every new token. The
/// reference the cached path is tested against; quadratic in the length.
pub fn generate_without_cache<B: ModelBackend>(
    model: &GptModel<B>,
    prompts: &[Vec<i64>],
    config: &GenerationConfig,
) -> Result<Vec<Generated>> {
    check(model, None, prompts, config)?;
    let device = model.devices().into_iter().next().unwrap_or_default();
    let mut out = Vec::with_capacity(prompts.len());
    for (i, prompt) in prompts.iter().enumerate() {
        let mut row = vec![Row::new(prompt.len())];
        let mut sequence = prompt.clone();
        while finish_all(model, &mut row, config) {
            let len = sequence.len();
            let tokens = Tensor::<B, 2, Int>::from_data(
                TensorData::new(sequence.clone(), [1, len]),
                &device,
            );
            let logits = model.try_forward(tokens)?.narrow(1, len - 1, 1);
            let logits = gathered_logits(model, logits)?;
            let picked = config.sampling.pick(logits, i, row[0].tokens.len());
            let token = read_tokens(model, picked)?[0];
            row[0].push(token, model, config);
            sequence.push(token);
        }
        out.push(row.remove(0).into_generated());
    }
    Ok(out)
}

/// The errors [`generate`] documents, before any work.
fn check<B: ModelBackend>(
    model: &GptModel<B>,
    pp: Option<&ProcessGroup>,
    prompts: &[Vec<i64>],
    config: &GenerationConfig,
) -> Result<()> {
    config.sampling.validate()?;
    if model.sequence_parallel() {
        return Err(ConfigError::Invalid(
            "generation runs a model built without sequence parallelism: build it with \
             sequence_parallel = false (the parameters are the same)"
                .into(),
        )
        .into());
    }
    let stage = model.stage();
    let (pp_size, pp_rank) = pp.map_or((1, 0), |pp| (pp.size(), pp.rank()));
    if stage.num_stages != pp_size || stage.index != pp_rank {
        return Err(ConfigError::Invalid(format!(
            "the model is pipeline stage {} of {}, the rank is {pp_rank} of a pipeline of \
             {pp_size}: run a whole model with generate, a stage with generate_pipelined over \
             the pipeline group whose rank i holds stage i",
            stage.index, stage.num_stages
        ))
        .into());
    }
    let (max, vocab_size) = (model.max_sequence_length(), model.vocab().vocab_size);
    for (index, prompt) in prompts.iter().enumerate() {
        if prompt.is_empty() {
            return Err(InputError::EmptyPrompt { index }.into());
        }
        if prompt.len() > max {
            return Err(InputError::SequenceTooLong {
                len: prompt.len(),
                max,
            }
            .into());
        }
        if let Some(&id) = prompt
            .iter()
            .find(|&&id| !IdKind::Token.accepts(id, vocab_size))
        {
            return Err(InputError::IdOutOfRange {
                kind: IdKind::Token,
                id,
                vocab_size,
            }
            .into());
        }
    }
    Ok(())
}

/// Marks the rows that cannot take another token as finished (`max_new_tokens` 0, or a full
/// sequence); whether any row is still going.
fn finish_all<B: ModelBackend>(
    model: &GptModel<B>,
    rows: &mut [Row],
    config: &GenerationConfig,
) -> bool {
    for row in rows.iter_mut() {
        if row.finish.is_none() {
            row.finish = row.limit(model, config);
        }
    }
    rows.iter().any(|row| row.finish.is_none())
}

/// One prompt's progress.
struct Row {
    prompt_len: usize,
    tokens: Vec<i64>,
    finish: Option<FinishReason>,
}

impl Row {
    fn new(prompt_len: usize) -> Self {
        Self {
            prompt_len,
            tokens: Vec::new(),
            finish: None,
        }
    }

    /// Why the row can take no more tokens, if it cannot.
    fn limit<B: ModelBackend>(
        &self,
        model: &GptModel<B>,
        config: &GenerationConfig,
    ) -> Option<FinishReason> {
        if self.tokens.len() >= config.max_new_tokens {
            Some(FinishReason::MaxNewTokens)
        } else if self.prompt_len + self.tokens.len() >= model.max_sequence_length() {
            Some(FinishReason::MaxSequenceLength)
        } else {
            None
        }
    }

    /// The most tokens the row can still take: `max_new_tokens` and the model's maximum
    /// sequence length bound it.
    fn room<B: ModelBackend>(&self, model: &GptModel<B>, config: &GenerationConfig) -> usize {
        config
            .max_new_tokens
            .min(model.max_sequence_length().saturating_sub(self.prompt_len))
            .saturating_sub(self.tokens.len())
    }

    fn push<B: ModelBackend>(
        &mut self,
        token: i64,
        model: &GptModel<B>,
        config: &GenerationConfig,
    ) {
        self.tokens.push(token);
        self.finish = if config.stop_tokens.contains(&token) {
            Some(FinishReason::Stop)
        } else {
            self.limit(model, config)
        };
    }

    fn into_generated(self) -> Generated {
        Generated {
            tokens: self.tokens,
            finish: self.finish.unwrap_or(FinishReason::MaxNewTokens),
        }
    }
}

/// Rank-local logits `[batch, 1, padded_vocab / tp]` → every row's logits over the real
/// vocabulary, `[batch, vocab_size]` (padding dropped), gathered over TP: the same on every
/// rank, on the device.
fn gathered_logits<B: ModelBackend>(
    model: &GptModel<B>,
    logits: Tensor<B, 3>,
) -> Result<Tensor<B, 2>> {
    let [batch, _, _] = logits.dims();
    let vocab_size = model.vocab().vocab_size;
    let full = gather_from_tensor_parallel_region(logits, model.tp())?;
    Ok(full.narrow(2, 0, vocab_size).reshape([batch, vocab_size]))
}

/// The picked ids `[batch]` read back to the host: the one read of a decode step.
fn read_tokens<B: ModelBackend>(model: &GptModel<B>, picks: Tensor<B, 1, Int>) -> Result<Vec<i64>> {
    let data = read_data(picks, || "the picked tokens".to_string())
        .map_err(|e| e.on_rank(model.tp().global_rank()))?;
    data.convert::<i64>().to_vec::<i64>().map_err(|e| {
        DeviceError {
            rank: None,
            what: "the picked tokens".to_string(),
            message: format!("{e:?}"),
        }
        .into()
    })
}

/// `data` as f32 values (`what` names it in the error, which a dtype without an f32
/// conversion would be).
fn f32_values(data: TensorData, what: &str) -> Result<Vec<f32>> {
    data.convert::<f32>().to_vec::<f32>().map_err(|e| {
        DeviceError {
            rank: None,
            what: what.to_string(),
            message: format!("{e:?}"),
        }
        .into()
    })
}
