//! Prints the timelines of the pipeline schedules: which microbatch each rank works on at each
//! moment, and the bubble (idle time over busy time). No model runs: a schedule is a plan.
//!
//!     cargo run --example pipeline_timeline -- --pp 4 --microbatches 8

use burn_megatron::pipeline_parallel::Schedule;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut pp = 4;
    let mut microbatches = 8;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || -> Result<usize, Box<dyn std::error::Error>> {
            Ok(args.next().ok_or(format!("{arg} needs a value"))?.parse()?)
        };
        match arg.as_str() {
            "--pp" => pp = value()?,
            "--microbatches" => microbatches = value()?,
            _ => return Err(format!("unknown argument {arg}; use --pp N --microbatches N").into()),
        }
    }
    // ANCHOR: timelines
    // (schedule, virtual stages per rank)
    for (schedule, chunks) in [
        (Schedule::GPipe, 1),
        (Schedule::OneFOneB, 1),
        (Schedule::Interleaved, 2),
    ] {
        let plan = schedule.plan(pp, chunks, microbatches)?;
        println!("{}\n", plan.render_timeline()?);
    }
    // ANCHOR_END: timelines
    Ok(())
}
