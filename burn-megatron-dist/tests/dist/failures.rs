//! A launch never hangs: failed, finished, slow and mismatched ranks all produce errors that
//! name the group, the operation and the ranks involved.

use std::time::{Duration, Instant};

use burn_megatron_dist::{DistError, LaunchConfig, ReduceOp, launch};

use crate::{B, iota, tensor};

fn config(n: usize, timeout_ms: u64) -> LaunchConfig {
    LaunchConfig::new(n).with_timeout(Duration::from_millis(timeout_ms))
}

#[test]
fn a_rank_that_returns_an_error_releases_the_others() {
    let started = Instant::now();
    let err = launch(config(4, 30_000), |ctx| {
        if ctx.rank() == 1 {
            return Err(DistError::InvalidArgument("rank 1 gave up".into()));
        }
        ctx.world()
            .all_reduce(tensor::<B, 1>(vec![1.0], [1]), ReduceOp::Sum)?;
        Ok(())
    })
    .unwrap_err();
    // Released at once, long before the 30 s timeout.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(err.rank, 1);
    assert_eq!(err.message, "rank 1 gave up");
    assert_eq!(err.failures.len(), 4);
    for (rank, message) in &err.failures[..] {
        if *rank != 1 {
            assert!(
                message.contains(
                    "all_reduce(sum) on group 'world' aborted because rank 1 failed: rank 1 gave up"
                ),
                "rank {rank}: {message}"
            );
        }
    }
}

/// The others are released at once by the panic, naming the panicking rank and its message,
/// not by the 30 s collective timeout.
#[test]
fn a_rank_that_panics_releases_the_others() {
    let started = Instant::now();
    let err = launch(config(3, 30_000), |ctx| {
        if ctx.rank() == 2 {
            panic!("out of memory on rank 2");
        }
        ctx.world().barrier()
    })
    .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "released after {:?}: by the timeout, not by the panic",
        started.elapsed()
    );
    assert_eq!(err.rank, 2);
    assert!(
        err.message.contains("panicked: out of memory on rank 2"),
        "{}",
        err.message
    );
    assert_eq!(err.failures.len(), 3, "{:?}", err.failures);
    for (rank, message) in &err.failures[..2] {
        assert!(
            message.contains("barrier")
                && message.contains("aborted because rank 2 failed")
                && message.contains("out of memory on rank 2")
                && !message.contains("timed out"),
            "rank {rank}: {message}"
        );
    }
}

#[test]
fn a_rank_that_finishes_early_fails_the_collective_it_skipped() {
    let started = Instant::now();
    let err = launch(config(2, 30_000), |ctx| {
        if ctx.rank() == 0 {
            ctx.world().all_gather(tensor::<B, 1>(vec![1.0], [1]), 0)?;
        }
        Ok::<_, DistError>(())
    })
    .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(err.rank, 0);
    assert!(
        err.message.contains("rank 0: all_gather(dim=0) #0 on group 'world' cannot complete: ranks [1] finished without joining it"),
        "{}",
        err.message
    );
}

#[test]
fn a_slow_rank_times_out_the_others_naming_it() {
    let timeout = Duration::from_millis(500);
    let started = Instant::now();
    let err = launch(LaunchConfig::new(3).with_timeout(timeout), |ctx| {
        if ctx.rank() == 2 {
            std::thread::sleep(Duration::from_secs(3));
            return Ok(());
        }
        ctx.world()
            .all_reduce(tensor::<B, 1>(vec![1.0], [1]), ReduceOp::Max)?;
        Ok::<_, DistError>(())
    })
    .unwrap_err();
    let first = err.failures.iter().find(|(r, _)| *r == 0).unwrap();
    assert!(
        first.1.contains(
            "all_reduce(max) #0 on group 'world' timed out after 500ms: ranks [2] did not arrive"
        ),
        "{}",
        first.1
    );
    // Everyone is released soon after the slow rank's sleep, not after some larger limit.
    assert!(started.elapsed() < Duration::from_secs(8));
}

#[test]
fn recv_without_a_sender_times_out_naming_the_source() {
    let err = launch(config(2, 300), |ctx| {
        if ctx.rank() == 1 {
            let _ = ctx.world().recv::<B, 1>(0, &Default::default())?;
        } else {
            std::thread::sleep(Duration::from_millis(1500));
        }
        Ok::<_, DistError>(())
    })
    .unwrap_err();
    assert_eq!(err.rank, 1);
    assert!(err.message.contains("recv(src=0)"), "{}", err.message);
    assert!(
        err.message.contains("ranks [0] did not arrive"),
        "{}",
        err.message
    );
}

#[test]
fn ranks_calling_different_collectives_get_a_mismatch() {
    let err = launch(config(2, 10_000), |ctx| {
        let x = tensor::<B, 1>(vec![1.0, 2.0], [2]);
        match ctx.rank() {
            0 => ctx.world().all_reduce(x, ReduceOp::Sum)?,
            _ => ctx.world().all_gather(x, 0)?,
        };
        Ok::<_, DistError>(())
    })
    .unwrap_err();
    assert!(
        err.message.contains("mismatched across ranks"),
        "{}",
        err.message
    );
    assert!(
        err.message
            .contains("rank 0: all_reduce(sum) [2] F32; rank 1: all_gather(dim=0) [2] F32"),
        "{}",
        err.message
    );
}

#[test]
fn ranks_passing_different_shapes_get_a_mismatch() {
    let err = launch(config(2, 10_000), |ctx| {
        let x = iota::<B, 2>([2, 1 + ctx.rank()], 1.0, 0.0);
        ctx.world().all_reduce(x, ReduceOp::Sum)?;
        Ok::<_, DistError>(())
    })
    .unwrap_err();
    assert!(
        err.message
            .contains("rank 0: all_reduce(sum) [2, 1] F32; rank 1: all_reduce(sum) [2, 2] F32"),
        "{}",
        err.message
    );
}

#[test]
fn invalid_arguments_are_errors_not_panics() {
    let errors = crate::run(2, |ctx| {
        let g = ctx.world();
        let x = || tensor::<B, 1>(vec![1.0, 2.0, 3.0], [3]);
        Ok([
            g.all_gather(x(), 1).unwrap_err().to_string(),
            g.reduce_scatter(tensor::<B, 1>(vec![1.0], [1]), 0, ReduceOp::Sum)
                .unwrap_err()
                .to_string(),
            g.send(x(), 5).unwrap_err().to_string(),
            g.send(x(), g.rank()).unwrap_err().to_string(),
            ctx.new_group("odd", &[0, 7]).unwrap_err().to_string(),
        ])
    });
    let [dim, shard, peer, own, group] = &errors[0];
    assert_eq!(
        dim,
        "all_gather: dimension 1 is out of range for a tensor of rank 1"
    );
    assert!(
        shard.contains("length 1 cannot be sharded over 2 ranks"),
        "{shard}"
    );
    assert!(
        peer.contains("send destination 5 is not a valid peer"),
        "{peer}"
    );
    assert!(
        own.contains("send destination 0 is not a valid peer of rank 0"),
        "{own}"
    );
    assert_eq!(group, "group 'odd': rank 7 is outside the world of 2 ranks");
}
