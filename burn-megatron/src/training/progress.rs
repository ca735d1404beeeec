//! A console observer: a progress bar redrawn in place on a terminal, and a log line per
//! report (Megatron's `training_log` format), so the loss can be read as it falls.
//!
//! An iteration's line gives two losses: `loss`, the iteration's own (one global batch), and
//! `lm loss`, the mean over the iterations since the previous line
//! ([`IterationReport::lm_loss`], Megatron's `lm loss`).

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

use super::observer::{EvalReport, IterationReport, RunStart, TrainingObserver};

/// Width of the bar in characters.
const BAR: usize = 30;

/// Prints a run's progress to standard error: a bar on a terminal (one line rewritten), and
/// a line every `print_every` iterations, for evaluations and for checkpoints.
#[derive(Debug)]
pub struct ConsoleProgress {
    print_every: u64,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    started: Instant,
    first: u64,
    total: u64,
    tokens: u64,
    first_loss: Option<f64>,
    bar_shown: bool,
}

impl ConsoleProgress {
    /// Prints a log line every `print_every` reported iterations (at least 1).
    pub fn new(print_every: u64) -> Self {
        Self {
            print_every: print_every.max(1),
            state: Mutex::new(State {
                started: Instant::now(),
                first: 0,
                total: 0,
                tokens: 0,
                first_loss: None,
                bar_shown: false,
            }),
        }
    }

    fn line(state: &mut State, text: &str) {
        let mut err = std::io::stderr().lock();
        if state.bar_shown {
            let _ = write!(err, "\r\x1b[2K");
            state.bar_shown = false;
        }
        let _ = writeln!(err, "{text}");
    }
}

impl TrainingObserver for ConsoleProgress {
    fn on_setup(&self, step: &str) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        Self::line(&mut state, &format!("start-up: {step}"));
    }

    fn on_start(&self, start: &RunStart) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.started = Instant::now();
        state.first = start.first_iteration;
        state.total = start.train_iters;
        let resumed = match &start.resumed_from {
            Some(dir) => format!(", resumed from {}", dir.display()),
            None => String::new(),
        };
        Self::line(
            &mut state,
            &format!(
                "training a GPT of {:.2} M parameters on {} ranks (TP = {}, PP = {}{}{}), {} \
                 microbatches per step, iterations {}..{}{resumed}, after {:.1} s of start-up\ndata: {}",
                start.parameters / 1e6,
                start.world_size,
                start.tp,
                start.pp,
                match start.cp {
                    1 => String::new(),
                    cp => format!(", CP = {cp}"),
                },
                match start.virtual_pipeline_size {
                    1 => String::new(),
                    v => format!(" with {v} chunks a rank, interleaved 1F1B"),
                },
                start.num_microbatches,
                start.first_iteration,
                start.train_iters,
                start.startup_seconds,
                start.data
            ),
        );
    }

    fn on_iteration(&self, r: &IterationReport) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.tokens += r.tokens;
        state.first_loss.get_or_insert(r.loss);
        let total = state.total;
        if (r.iteration - state.first).is_multiple_of(self.print_every) || r.iteration == total {
            Self::line(
                &mut state,
                &format!(
                    " iteration {:>6}/{:<6} | consumed samples {:>8} | lr {:.3e} | loss {:.4} | \
                     lm loss {:.4} | grad norm {:.3} | {:.0} tokens/s | {:.2} TFLOP/s per device | MFU {:.1}%{}{}{}",
                    r.iteration,
                    total,
                    r.consumed_samples,
                    r.lr,
                    r.loss,
                    r.lm_loss,
                    r.grad_norm,
                    r.tokens_per_second(),
                    r.flops_per_device() / 1e12,
                    100.0 * r.mfu,
                    r.loss_scale
                        .map(|scale| format!(" | loss scale {scale:.1}"))
                        .unwrap_or_default(),
                    r.max_memory_bytes
                        .map(|b| format!(
                            " | memory {:.2} GiB{} (largest rank)",
                            b / (1u64 << 30) as f64,
                            r.peak_memory_bytes
                                .map(|p| format!(", peak {:.2}", p / (1u64 << 30) as f64))
                                .unwrap_or_default()
                        ))
                        .unwrap_or_default(),
                    r.moe
                        .map(|m| format!(
                            " | load_balancing_loss {:.4e} | z_loss {:.4e} | expert load \
                             min/max {:.2}/{:.2}{}",
                            m.load_balancing_loss,
                            m.z_loss,
                            m.expert_load_min,
                            m.expert_load_max,
                            m.dropped_assignments
                                .map(|d| format!(
                                    " | dropped {d:.0} of {:.0} assignments ({:.1}%)",
                                    m.assignments,
                                    100.0 * d / m.assignments.max(1.0)
                                ))
                                .unwrap_or_default()
                        ))
                        .unwrap_or_default()
                ),
            );
        }
        let stderr = std::io::stderr();
        if stderr.is_terminal() {
            let done = (r.iteration - state.first) as f64;
            let todo = (state.total - state.first).max(1) as f64;
            let filled = ((done / todo) * BAR as f64).round() as usize;
            let elapsed = state.started.elapsed().as_secs_f64();
            let eta = elapsed / done.max(1.0) * (todo - done);
            let mut err = stderr.lock();
            let _ = write!(
                err,
                "\r\x1b[2K[{}{}] {}/{} loss {:.4} | {:.0} tokens/s | {:.0}s, {:.0}s left",
                "#".repeat(filled.min(BAR)),
                "-".repeat(BAR - filled.min(BAR)),
                r.iteration,
                state.total,
                r.loss,
                state.tokens as f64 / elapsed.max(1e-9),
                elapsed,
                eta
            );
            let _ = err.flush();
            state.bar_shown = true;
        }
    }

    fn on_evaluation(&self, r: &EvalReport) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        Self::line(
            &mut state,
            &format!(
                " validation loss at iteration {} | loss {:.4} | perplexity {:.3}",
                r.iteration,
                r.loss,
                r.perplexity()
            ),
        );
    }

    fn on_checkpoint(&self, iteration: u64, dir: &Path) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        Self::line(
            &mut state,
            &format!(
                " saved checkpoint at iteration {iteration} to {}",
                dir.display()
            ),
        );
    }

    fn on_finish(&self) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let elapsed = state.started.elapsed().as_secs_f64();
        let tokens = state.tokens;
        Self::line(
            &mut state,
            &format!(
                "done: {tokens} tokens in {elapsed:.1}s ({:.0} tokens/s)",
                tokens as f64 / elapsed.max(1e-9)
            ),
        );
    }

    fn on_profile(&self, rank: usize, steps: std::ops::RangeInclusive<u64>, table: &str) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut text = format!(
            "profile of rank {rank}, iterations {} to {}:",
            steps.start(),
            steps.end()
        );
        for line in table.lines() {
            text.push_str(&format!("\n  rank {rank} | {line}"));
        }
        Self::line(&mut state, &text);
    }
}
