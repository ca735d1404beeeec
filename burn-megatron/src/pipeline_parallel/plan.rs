//! A schedule as data: per pipeline rank, the list of forward, backward and exchange steps an
//! executor runs, with its simulated timeline and bubble.

use core::fmt::{self, Write};

use super::schedules::schedule::Schedule;
use crate::error::PipelineError;

/// A forward or backward pass of one microbatch through one model chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Compute {
    /// The microbatch, `0..microbatches`.
    pub microbatch: usize,
    /// This rank's model chunk (`0..v`); chunk `c` of pipeline rank `r` is virtual stage
    /// `c · pp + r`.
    pub chunk: usize,
}

/// What travels between stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Payload {
    /// A stage's output, forward to the next stage.
    Activation,
    /// The gradient of a stage's input, back to the previous stage.
    Gradient,
}

/// Whether a transfer leaves or reaches this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// This rank sends.
    Send,
    /// This rank receives.
    Recv,
}

/// One send or receive of an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Transfer {
    /// Send or receive.
    pub direction: Direction,
    /// Activation or gradient.
    pub payload: Payload,
    /// The other pipeline rank.
    pub peer: usize,
    /// The microbatch.
    pub microbatch: usize,
    /// This rank's chunk that produced (send) or will consume (receive) the tensor.
    pub chunk: usize,
}

/// One step of a rank's plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Forward pass of a microbatch through a chunk.
    Forward(Compute),
    /// Backward pass of a microbatch through a chunk.
    Backward(Compute),
    /// Sends and receives posted together as one batched exchange
    /// ([`batch_isend_irecv`](burn_megatron_dist::p2p::batch_isend_irecv)), such as Megatron's
    /// `send_forward_recv_backward`.
    Exchange(Vec<Transfer>),
}

/// Every pipeline rank's steps for one training (or evaluation) step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The schedule it was made from.
    pub schedule: Schedule,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// Model chunks per rank.
    pub virtual_size: usize,
    /// Microbatches per step.
    pub microbatches: usize,
    /// Whether it only runs forward passes (evaluation).
    pub forward_only: bool,
    /// Per pipeline rank, its steps in order.
    pub ranks: Vec<Vec<Step>>,
}

impl Plan {
    /// A plan from each rank's order of forward and backward passes, in units (a pass, or
    /// a steady-state forward-backward pair of the interleaved schedule): the receives a
    /// unit needs are posted just before it, the sends of its results just after it, and the
    /// transfers between two units form one exchange. A pair's two sends and the next pair's
    /// two receives in one exchange is Megatron's `send_forward_backward_recv_forward_backward`;
    /// with a send after each pass instead, two ranks of an interleaved pipeline could each
    /// wait, in a send, for a receive the other posts only later (the test
    /// `plans_complete_when_sends_wait_for_their_receives` finds that case).
    pub(crate) fn from_compute_order(
        schedule: Schedule,
        pp: usize,
        virtual_size: usize,
        microbatches: usize,
        forward_only: bool,
        orders: Vec<Vec<Vec<(bool, Compute)>>>,
    ) -> Self {
        let stages = pp * virtual_size;
        let ranks = orders
            .into_iter()
            .enumerate()
            .map(|(rank, units)| {
                let stage = |chunk: usize| chunk * pp + rank;
                let transfer = |direction, payload, peer_stage: usize, c: Compute| Transfer {
                    direction,
                    payload,
                    peer: peer_stage % pp,
                    microbatch: c.microbatch,
                    chunk: c.chunk,
                };
                // A pass's receive (before it) and send (after it).
                let io = |forward: bool, c: Compute| {
                    let s = stage(c.chunk);
                    if forward {
                        (
                            (s > 0)
                                .then(|| transfer(Direction::Recv, Payload::Activation, s - 1, c)),
                            (s + 1 < stages)
                                .then(|| transfer(Direction::Send, Payload::Activation, s + 1, c)),
                        )
                    } else {
                        (
                            (s + 1 < stages)
                                .then(|| transfer(Direction::Recv, Payload::Gradient, s + 1, c)),
                            (s > 0).then(|| transfer(Direction::Send, Payload::Gradient, s - 1, c)),
                        )
                    }
                };
                let mut steps = Vec::new();
                let mut pending: Vec<Transfer> = Vec::new();
                for unit in units {
                    pending.extend(unit.iter().filter_map(|&(f, c)| io(f, c).0));
                    if !pending.is_empty() {
                        steps.push(Step::Exchange(std::mem::take(&mut pending)));
                    }
                    for &(forward, c) in &unit {
                        steps.push(if forward {
                            Step::Forward(c)
                        } else {
                            Step::Backward(c)
                        });
                    }
                    pending.extend(unit.iter().filter_map(|&(f, c)| io(f, c).1));
                }
                if !pending.is_empty() {
                    steps.push(Step::Exchange(pending));
                }
                steps
            })
            .collect();
        Self {
            schedule,
            pp,
            virtual_size,
            microbatches,
            forward_only,
            ranks,
        }
    }

    /// The steps of pipeline rank `rank`.
    pub fn steps(&self, rank: usize) -> &[Step] {
        &self.ranks[rank]
    }

    /// The largest number of microbatches whose activations a rank keeps at once (forwards
    /// done whose backward has not run), per rank.
    pub fn max_in_flight(&self) -> Vec<usize> {
        self.ranks
            .iter()
            .map(|steps| {
                let (mut live, mut max) = (0usize, 0usize);
                for step in steps {
                    match step {
                        Step::Forward(_) if !self.forward_only => live += 1,
                        Step::Backward(_) => live -= 1,
                        _ => {}
                    }
                    max = max.max(live);
                }
                max
            })
            .collect()
    }

    /// Runs the plan on a clock where a forward pass of a chunk takes `forward` units, a
    /// backward pass `backward` units and communication none; each pass starts when its rank
    /// is free and its input has arrived. Fails if some rank could never go on (a receive
    /// without its send).
    pub fn simulate(&self, forward: u64, backward: u64) -> Result<Timeline, PipelineError> {
        let stages = self.pp * self.virtual_size;
        // When each (payload, microbatch, producing virtual stage)'s tensor is sent.
        let mut sent = std::collections::HashMap::<(Payload, usize, usize), u64>::new();
        let mut at = vec![0usize; self.pp];
        let mut clock = vec![0u64; self.pp];
        let mut slots: Vec<Vec<Slot>> = vec![Vec::new(); self.pp];
        loop {
            let mut progress = false;
            for rank in 0..self.pp {
                while let Some(step) = self.ranks[rank].get(at[rank]) {
                    match step {
                        Step::Exchange(transfers) => {
                            // Sends are buffered: they leave when the rank gets here.
                            for t in transfers.iter().filter(|t| t.direction == Direction::Send) {
                                let s = t.chunk * self.pp + rank;
                                sent.insert((t.payload, t.microbatch, s), clock[rank]);
                            }
                        }
                        Step::Forward(c) | Step::Backward(c) => {
                            let is_forward = matches!(step, Step::Forward(_));
                            // A pass waits for its own input only.
                            let s = c.chunk * self.pp + rank;
                            let input = if is_forward {
                                (s > 0).then(|| (Payload::Activation, c.microbatch, s - 1))
                            } else {
                                (s + 1 < stages).then(|| (Payload::Gradient, c.microbatch, s + 1))
                            };
                            let arrival = match input.map(|key| sent.get(&key)) {
                                None => 0,
                                Some(Some(&time)) => time,
                                Some(None) => break,
                            };
                            let start = clock[rank].max(arrival);
                            let length = if is_forward { forward } else { backward };
                            slots[rank].push(Slot {
                                start,
                                length,
                                forward: is_forward,
                                compute: *c,
                            });
                            clock[rank] = start + length;
                        }
                    }
                    at[rank] += 1;
                    progress = true;
                }
            }
            if (0..self.pp).all(|r| at[r] == self.ranks[r].len()) {
                break;
            }
            if !progress {
                let stuck: Vec<usize> = (0..self.pp)
                    .filter(|&r| at[r] < self.ranks[r].len())
                    .collect();
                return Err(PipelineError::VirtualStages {
                    schedule: self.schedule.to_string(),
                    problem: format!(
                        "plan cannot complete: ranks {stuck:?} wait for tensors never sent"
                    ),
                });
            }
        }
        let busy = slots[0].iter().map(|s| s.length).sum();
        Ok(Timeline {
            makespan: clock.iter().copied().max().unwrap_or(0),
            busy,
            slots,
            virtual_size: self.virtual_size,
        })
    }

    /// The plan's bubble fraction with a backward pass twice as long as a forward pass: idle
    /// time over busy time per rank, Megatron's `(pp − 1) / (v · m)` for 1F1B and its
    /// interleaved form.
    pub fn bubble_fraction(&self) -> Result<f64, PipelineError> {
        Ok(self.simulate(1, 2)?.bubble_fraction())
    }

    /// The timeline (forward 1 unit, backward 2), one line per pipeline rank, for the eye:
    /// `F3` is a forward of microbatch 3, `B3==` its backward, `.` an idle unit; with virtual
    /// stages a letter names the chunk (`F3b`: chunk 1).
    pub fn render_timeline(&self) -> Result<String, PipelineError> {
        let timeline = self.simulate(1, 2)?;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{}: PP={} V={} microbatches={}, bubble {:.3}",
            self.schedule,
            self.pp,
            self.virtual_size,
            self.microbatches,
            timeline.bubble_fraction()
        );
        let _ = write!(out, "{timeline}");
        Ok(out)
    }
}

/// A pass placed on the simulated clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Start time.
    pub start: u64,
    /// Duration.
    pub length: u64,
    /// Forward (or backward).
    pub forward: bool,
    /// Which microbatch and chunk.
    pub compute: Compute,
}

/// A simulated run of a [`Plan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timeline {
    /// When the last rank finishes.
    pub makespan: u64,
    /// Compute time of one rank (every rank computes as much).
    pub busy: u64,
    /// Per rank, its passes in order.
    pub slots: Vec<Vec<Slot>>,
    virtual_size: usize,
}

impl Timeline {
    /// Idle time over compute time: `(makespan − busy) / busy`.
    pub fn bubble_fraction(&self) -> f64 {
        if self.busy == 0 {
            return 0.0;
        }
        (self.makespan - self.busy) as f64 / self.busy as f64
    }
}

impl fmt::Display for Timeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = if self.virtual_size > 1 { 4 } else { 3 };
        for (rank, slots) in self.slots.iter().enumerate() {
            let mut line = String::new();
            let mut time = 0;
            for slot in slots {
                for _ in time..slot.start {
                    line.push_str(&format!("{:<width$}", "."));
                }
                let mut label = format!(
                    "{}{}",
                    if slot.forward { 'F' } else { 'B' },
                    slot.compute.microbatch
                );
                if self.virtual_size > 1 {
                    label.push((b'a' + slot.compute.chunk as u8) as char);
                }
                let cells = width * slot.length as usize;
                let fill = if slot.forward { ' ' } else { '=' };
                while label.len() < cells - 1 {
                    label.push(fill);
                }
                line.push_str(&label);
                line.push(' ');
                time = slot.start + slot.length;
            }
            writeln!(f, "rank {rank:>2} | {}", line.trim_end())?;
        }
        Ok(())
    }
}
