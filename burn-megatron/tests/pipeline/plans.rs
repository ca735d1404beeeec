//! Plan invariants for PP ∈ {1, 2, 4, 8}, V ∈ {1, 2, 4}, M ∈ {8, 32}, every schedule.

use std::collections::HashMap;

use burn_megatron::pipeline_parallel::schedules::{interleaved_warmup, one_f_one_b_warmup};
use burn_megatron::pipeline_parallel::{
    Compute, Direction, Payload, PipelineError, Plan, Schedule, Step,
};

const SCHEDULES: [Schedule; 4] = [
    Schedule::NoPipelining,
    Schedule::GPipe,
    Schedule::OneFOneB,
    Schedule::Interleaved,
];

/// Every valid plan of the grid (training and forward-only), checking that the invalid
/// combinations are errors.
fn plans() -> Vec<Plan> {
    let mut plans = Vec::new();
    for pp in [1, 2, 4, 8] {
        for v in [1, 2, 4] {
            for m in [8, 32] {
                for schedule in SCHEDULES {
                    let valid = match schedule {
                        Schedule::Interleaved => pp >= 2,
                        _ => v == 1,
                    };
                    for forward_only in [false, true] {
                        let plan = if forward_only {
                            schedule.plan_forward_only(pp, v, m)
                        } else {
                            schedule.plan(pp, v, m)
                        };
                        match (valid, plan) {
                            (true, Ok(plan)) => plans.push(plan),
                            (false, Err(PipelineError::VirtualStages { .. })) => {}
                            (valid, plan) => {
                                panic!("{schedule} PP={pp} V={v} M={m}: valid={valid}, {plan:?}")
                            }
                        }
                    }
                }
            }
        }
    }
    plans
}

fn name(plan: &Plan) -> String {
    format!(
        "{} PP={} V={} M={} forward_only={}",
        plan.schedule, plan.pp, plan.virtual_size, plan.microbatches, plan.forward_only
    )
}

#[test]
fn every_forward_precedes_its_backward_and_the_counts_balance() {
    for plan in plans() {
        for rank in 0..plan.pp {
            let mut forwards: HashMap<Compute, usize> = HashMap::new();
            let mut backwards: HashMap<Compute, usize> = HashMap::new();
            for step in plan.steps(rank) {
                match step {
                    Step::Forward(c) => *forwards.entry(*c).or_default() += 1,
                    Step::Backward(c) => {
                        assert_eq!(
                            forwards.get(c),
                            Some(&1),
                            "{} rank {rank}: backward {c:?} before its forward",
                            name(&plan)
                        );
                        *backwards.entry(*c).or_default() += 1;
                    }
                    Step::Exchange(_) => {}
                }
            }
            let all = plan.microbatches * plan.virtual_size;
            assert_eq!(forwards.len(), all, "{} rank {rank}", name(&plan));
            assert!(forwards.values().all(|&n| n == 1), "{}", name(&plan));
            let backward_count = if plan.forward_only { 0 } else { all };
            assert_eq!(backwards.len(), backward_count, "{}", name(&plan));
            assert!(backwards.values().all(|&n| n == 1), "{}", name(&plan));
        }
    }
}

#[test]
fn each_send_matches_a_receive_on_the_neighbour_in_order() {
    for plan in plans() {
        let pp = plan.pp;
        // Per (from, to, payload): the (microbatch, virtual stage of the producer) sequence.
        let mut sent: HashMap<(usize, usize, Payload), Vec<(usize, usize)>> = HashMap::new();
        let mut received: HashMap<(usize, usize, Payload), Vec<(usize, usize)>> = HashMap::new();
        for rank in 0..pp {
            for step in plan.steps(rank) {
                let Step::Exchange(transfers) = step else {
                    continue;
                };
                for t in transfers {
                    let stage = t.chunk * pp + rank;
                    match t.direction {
                        Direction::Send => {
                            let to = match t.payload {
                                Payload::Activation => stage + 1,
                                Payload::Gradient => stage - 1,
                            };
                            assert_eq!(t.peer, to % pp, "{}", name(&plan));
                            sent.entry((rank, t.peer, t.payload))
                                .or_default()
                                .push((t.microbatch, stage));
                        }
                        Direction::Recv => {
                            let from = match t.payload {
                                Payload::Activation => stage - 1,
                                Payload::Gradient => stage + 1,
                            };
                            assert_eq!(t.peer, from % pp, "{}", name(&plan));
                            received
                                .entry((t.peer, rank, t.payload))
                                .or_default()
                                .push((t.microbatch, from));
                        }
                    }
                }
            }
        }
        assert_eq!(sent, received, "{}", name(&plan));
        let stages = pp * plan.virtual_size;
        let activations: usize = sent
            .iter()
            .filter(|(k, _)| k.2 == Payload::Activation)
            .map(|(_, v)| v.len())
            .sum();
        assert_eq!(
            activations,
            plan.microbatches * (stages - 1),
            "{}",
            name(&plan)
        );
    }
}

/// The n-th message from rank `a` to rank `b` of a payload, seen from one side.
type Message = (usize, usize, Payload, Direction, usize);

/// Over NCCL a send completes only once its receive is posted. Running each exchange as one
/// group that completes when every op's counterpart is posted, no plan waits for ever.
#[test]
fn plans_complete_when_sends_wait_for_their_receives() {
    for plan in plans() {
        let pp = plan.pp;
        // Where each op's counterpart is: the n-th message a→b (per payload) pairs up.
        let mut position: HashMap<Message, usize> = HashMap::new();
        let mut counters: HashMap<(usize, usize, Payload, Direction), usize> = HashMap::new();
        let mut ops: Vec<Vec<Vec<Message>>> = vec![];
        for rank in 0..pp {
            let mut per_step = Vec::new();
            for (index, step) in plan.steps(rank).iter().enumerate() {
                let mut keys = Vec::new();
                if let Step::Exchange(transfers) = step {
                    for t in transfers {
                        let (a, b) = match t.direction {
                            Direction::Send => (rank, t.peer),
                            Direction::Recv => (t.peer, rank),
                        };
                        let n = counters.entry((a, b, t.payload, t.direction)).or_default();
                        let key = (a, b, t.payload, t.direction, *n);
                        *n += 1;
                        position.insert(key, index);
                        keys.push(key);
                    }
                }
                per_step.push(keys);
            }
            ops.push(per_step);
        }
        let mut at = vec![0usize; pp];
        loop {
            let mut progress = false;
            for rank in 0..pp {
                while at[rank] < ops[rank].len() {
                    let complete = ops[rank][at[rank]].iter().all(|&(a, b, p, d, n)| {
                        let other = match d {
                            Direction::Send => Direction::Recv,
                            Direction::Recv => Direction::Send,
                        };
                        let peer = if d == Direction::Send { b } else { a };
                        let there = position[&(a, b, p, other, n)];
                        at[peer] >= there
                    });
                    if !complete {
                        break;
                    }
                    at[rank] += 1;
                    progress = true;
                }
            }
            if (0..pp).all(|r| at[r] == ops[r].len()) {
                break;
            }
            assert!(progress, "{} deadlocks at steps {at:?}", name(&plan));
        }
    }
}

#[test]
fn warmup_forwards_follow_megatrons_formula() {
    for plan in plans().into_iter().filter(|p| !p.forward_only) {
        let (pp, v, m) = (plan.pp, plan.virtual_size, plan.microbatches);
        for rank in 0..pp {
            let warmup = match plan.schedule {
                Schedule::OneFOneB => (pp - rank - 1).min(m),
                Schedule::Interleaved => (2 * (pp - rank - 1) + (v - 1) * pp).min(v * m),
                Schedule::GPipe => m,
                Schedule::NoPipelining => 0,
            };
            match plan.schedule {
                Schedule::OneFOneB => assert_eq!(warmup, one_f_one_b_warmup(pp, rank, m)),
                Schedule::Interleaved => assert_eq!(warmup, interleaved_warmup(pp, rank, v, m)),
                _ => {}
            }
            let before_first_backward = plan
                .steps(rank)
                .iter()
                .take_while(|s| !matches!(s, Step::Backward(_)))
                .filter(|s| matches!(s, Step::Forward(_)))
                .count();
            // The steady state starts with one more forward, if there is a steady state.
            let steady = usize::from(warmup < v * m);
            assert_eq!(
                before_first_backward,
                warmup + steady,
                "{} rank {rank}",
                name(&plan)
            );
        }
    }
}

#[test]
fn the_bubble_of_1f1b_and_interleaved_is_pp_minus_1_over_v_m() {
    for plan in plans().into_iter().filter(|p| !p.forward_only) {
        if !matches!(plan.schedule, Schedule::OneFOneB | Schedule::Interleaved) {
            continue;
        }
        let (pp, v, m) = (plan.pp, plan.virtual_size, plan.microbatches);
        let expected = (pp - 1) as f64 / (v * m) as f64;
        let got = plan.bubble_fraction().unwrap();
        assert!(
            (got - expected).abs() < 1e-12,
            "{}: bubble {got}, expected {expected}",
            name(&plan)
        );
    }
}

#[test]
fn under_1f1b_a_rank_holds_at_most_pp_minus_rank_microbatches() {
    for plan in plans().into_iter().filter(|p| !p.forward_only) {
        if plan.schedule == Schedule::OneFOneB {
            for (rank, live) in plan.max_in_flight().into_iter().enumerate() {
                assert_eq!(
                    live,
                    (plan.pp - rank).min(plan.microbatches),
                    "{}",
                    name(&plan)
                );
            }
        }
        if plan.schedule == Schedule::GPipe {
            assert!(plan.max_in_flight().iter().all(|&l| l == plan.microbatches));
        }
    }
}

#[test]
fn interleaving_needs_microbatches_divisible_by_pp() {
    let err = Schedule::Interleaved.plan(4, 2, 6).unwrap_err();
    assert!(matches!(
        err,
        PipelineError::MicrobatchesNotDivisible {
            microbatches: 6,
            pp: 4
        }
    ));
    assert!(
        err.to_string().contains("use a multiple of 4, such as 8"),
        "{err}"
    );
    assert!(matches!(
        Schedule::OneFOneB.plan(2, 1, 0),
        Err(PipelineError::NoMicrobatches)
    ));
}

#[test]
fn timelines_show_the_bubble() {
    let one_f_one_b = Schedule::OneFOneB.plan(4, 1, 8).unwrap();
    let text = one_f_one_b.render_timeline().unwrap();
    println!("{text}");
    assert!(
        text.starts_with("1F1B: PP=4 V=1 microbatches=8, bubble 0.375"),
        "{text}"
    );
    assert_eq!(text.lines().count(), 5);
    assert!(
        text.contains("rank  0 | F0 F1 F2 F3 .  .  .  .  .  .  B0=== F4 B1==="),
        "{text}"
    );
    assert!(
        text.contains("rank  3 | .  .  .  F0 B0=== F1 B1==="),
        "{text}"
    );
    let interleaved = Schedule::Interleaved.plan(4, 2, 8).unwrap();
    let text = interleaved.render_timeline().unwrap();
    println!("{text}");
    assert!(text.contains("bubble 0.188"), "{text}");
    println!(
        "{}",
        Schedule::GPipe
            .plan(4, 1, 8)
            .unwrap()
            .render_timeline()
            .unwrap()
    );
}
