//! The collective test bodies, generic over the backend: they run on CPU thread ranks,
//! CPU process ranks (TCP), and on the GPU over NCCL with thread or process ranks.
//!
//! Every case checks this rank's own results against values computed from the rank numbers,
//! so a rank in its own process can tell pass from fail without seeing the others.

use burn::tensor::{DType, Tensor, TensorData};
use burn_megatron_dist::{DistBackend, DistError, ParallelSizes, RankContext, ReduceOp};

/// Why a case failed on this rank: a collective's error, or a wrong result.
#[derive(Debug)]
pub struct SuiteError {
    /// The case.
    pub case: &'static str,
    /// What went wrong.
    pub message: String,
}

impl std::fmt::Display for SuiteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.case, self.message)
    }
}

fn wrong(case: &'static str, message: String) -> SuiteError {
    SuiteError { case, message }
}

impl std::error::Error for SuiteError {}

type CaseResult = Result<(), SuiteError>;
type Case<S> = (&'static str, fn(&S) -> CaseResult);

/// The cases, by name; each takes the rank's context, its device and the extra dtype tried.
pub struct Suite<'a, Bk: DistBackend> {
    ctx: &'a RankContext,
    device: &'a Bk::Device,
    /// A dtype besides f32 that collectives must keep (f64 on CPU, bf16/f16 on GPU).
    other_dtype: DType,
    /// Whether shards may be uneven (not with NCCL and collective checks off).
    uneven: bool,
}

fn expect(case: &'static str, got: Vec<f32>, want: Vec<f32>) -> CaseResult {
    if got == want {
        Ok(())
    } else {
        Err(wrong(case, format!("got {got:?}, want {want:?}")))
    }
}

impl<'a, Bk: DistBackend> Suite<'a, Bk> {
    /// The suite for this rank.
    pub fn new(ctx: &'a RankContext, device: &'a Bk::Device, other_dtype: DType) -> Self {
        Self {
            ctx,
            device,
            other_dtype,
            uneven: true,
        }
    }

    /// Leaves out uneven shards (for NCCL with collective checks off, which needs them equal).
    pub fn equal_shards_only(mut self) -> Self {
        self.uneven = false;
        self
    }

    /// Runs every case; returns how many ran.
    pub fn run(&self) -> Result<usize, SuiteError> {
        let cases: [Case<Self>; 10] = [
            ("all_reduce", Self::all_reduce),
            ("tp_groups", Self::tp_groups),
            ("all_gather", Self::all_gather),
            ("reduce_scatter", Self::reduce_scatter),
            ("broadcast_barrier", Self::broadcast_barrier),
            ("all_to_all", Self::all_to_all),
            ("send_recv_ring", Self::send_recv_ring),
            ("async_in_order", Self::async_in_order),
            ("keeps_dtype", Self::keeps_dtype),
            ("bit_identical", Self::bit_identical),
        ];
        for (_, case) in &cases {
            case(self)?;
        }
        Ok(cases.len())
    }

    fn n(&self) -> usize {
        self.ctx.world_size()
    }

    fn r(&self) -> usize {
        self.ctx.rank()
    }

    fn iota<const D: usize>(&self, shape: [usize; D], scale: f32, offset: f32) -> Tensor<Bk, D> {
        let count: usize = shape.iter().product();
        let values = (0..count).map(|i| i as f32 * scale + offset).collect();
        Tensor::from_data(TensorData::new(values, shape), self.device)
    }

    fn all_reduce(&self) -> CaseResult {
        const CASE: &str = "all_reduce";
        let (n, r) = (self.n(), self.r());
        let x = || self.iota([2, 3], 1.0, 10.0 * r as f32);
        let ranks_sum: f32 = (0..n).map(|q| 10.0 * q as f32).sum();
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let got = values(self.ctx.world().all_reduce(x(), op).map_err(dist(CASE))?);
            let want: Vec<f32> = (0..6)
                .map(|i| {
                    let base = i as f32;
                    match op {
                        ReduceOp::Sum => n as f32 * base + ranks_sum,
                        ReduceOp::Avg => base + ranks_sum / n as f32,
                        ReduceOp::Max => base + 10.0 * (n - 1) as f32,
                        ReduceOp::Min => base,
                    }
                })
                .collect();
            // Every element, none missing, none NaN: `!(diff <= tol)` fails on NaN where
            // `diff > tol` would pass it.
            let close = |g: f32, w: f32| (g - w).abs() <= 1e-5 * w.abs().max(1.0);
            if got.len() != want.len() || got.iter().zip(&want).any(|(&g, &w)| !close(g, w)) {
                return Err(wrong(CASE, format!("{op}: got {got:?}, want {want:?}")));
            }
        }
        Ok(())
    }

    /// Each rank all-reduces its rank number over its TP group (TP = 2 where the world is
    /// even): the sum of the two ranks of the pair.
    fn tp_groups(&self) -> CaseResult {
        const CASE: &str = "tp_groups";
        let tp = if self.n().is_multiple_of(2) { 2 } else { 1 };
        let state = self
            .ctx
            .parallel_state(ParallelSizes::default().with_tp(tp))
            .map_err(dist(CASE))?;
        let x = self.iota([1], 0.0, self.r() as f32);
        let got = values(
            state
                .tp()
                .all_reduce(x, ReduceOp::Sum)
                .map_err(dist(CASE))?,
        );
        let first = self.r() - self.r() % tp;
        expect(CASE, got, vec![(first..first + tp).sum::<usize>() as f32])
    }

    fn all_gather(&self) -> CaseResult {
        const CASE: &str = "all_gather";
        let (n, r) = (self.n(), self.r() as f32);
        let g = self.ctx.world();
        let d0 = g
            .all_gather(self.iota([1, 2], 1.0, 100.0 * r), 0)
            .map_err(dist(CASE))?;
        let d1 = g
            .all_gather(self.iota([2, 1], 1.0, 100.0 * r), 1)
            .map_err(dist(CASE))?;
        // The last rank holds a shorter shard.
        let short = |q: usize| self.uneven && q + 1 == n && n > 1;
        let len = if short(self.r()) { 1 } else { 2 };
        let uneven = g
            .all_gather(self.iota([len], 1.0, 100.0 * r), 0)
            .map_err(dist(CASE))?;
        let shape = (d0.dims(), d1.dims());
        if shape != ([n, 2], [2, n]) {
            return Err(wrong(CASE, format!("shapes {shape:?}")));
        }
        let base = |q: usize| 100.0 * q as f32;
        expect(
            CASE,
            values(d0),
            (0..n).flat_map(|q| [base(q), base(q) + 1.0]).collect(),
        )?;
        let want_d1 = (0..2).flat_map(|row| (0..n).map(move |q| base(q) + row as f32));
        expect(CASE, values(d1), want_d1.collect())?;
        let want_uneven = (0..n).flat_map(|q| {
            let len = if short(q) { 1 } else { 2 };
            (0..len).map(move |i| base(q) + i as f32)
        });
        expect(CASE, values(uneven), want_uneven.collect())
    }

    fn reduce_scatter(&self) -> CaseResult {
        const CASE: &str = "reduce_scatter";
        let (n, r) = (self.n(), self.r());
        let x = || self.iota([2, 8], 1.0, r as f32);
        let sum = self.ctx.world().reduce_scatter(x(), 1, ReduceOp::Sum);
        let avg = self.ctx.world().reduce_scatter(x(), 1, ReduceOp::Avg);
        let (sum, avg) = (sum.map_err(dist(CASE))?, avg.map_err(dist(CASE))?);
        let w = 8 / n;
        if sum.dims() != [2, w] {
            return Err(wrong(CASE, format!("shape {:?}", sum.dims())));
        }
        let offsets: f32 = (0..n).map(|q| q as f32).sum();
        let mine: Vec<f32> = (0..2)
            .flat_map(|row| (0..w).map(move |c| (row * 8 + r * w + c) as f32))
            .collect();
        expect(
            CASE,
            values(sum),
            mine.iter().map(|v| n as f32 * v + offsets).collect(),
        )?;
        expect(
            CASE,
            values(avg),
            mine.iter().map(|v| v + offsets / n as f32).collect(),
        )
    }

    fn broadcast_barrier(&self) -> CaseResult {
        const CASE: &str = "broadcast_barrier";
        let root = self.n() / 2;
        let g = self.ctx.world();
        g.barrier().map_err(dist(CASE))?;
        let mine = self.iota([2, 2], 1.0, 10.0 * self.r() as f32);
        let got = g.broadcast(mine, root).map_err(dist(CASE))?;
        g.barrier().map_err(dist(CASE))?;
        let base = 10.0 * root as f32;
        expect(
            CASE,
            values(got),
            vec![base, base + 1.0, base + 2.0, base + 3.0],
        )
    }

    fn all_to_all(&self) -> CaseResult {
        const CASE: &str = "all_to_all";
        let (n, r) = (self.n(), self.r());
        // Row j of rank r's [n, 2] tensor is meant for rank j.
        let x = self.iota([n, 2], 1.0, 100.0 * r as f32);
        let y = self.ctx.world().all_to_all(x, 0, 1).map_err(dist(CASE))?;
        if y.dims() != [1, 2 * n] {
            return Err(wrong(CASE, format!("shape {:?}", y.dims())));
        }
        let want = (0..n).flat_map(|src| {
            let base = 100.0 * src as f32 + 2.0 * r as f32;
            [base, base + 1.0]
        });
        expect(CASE, values(y), want.collect())
    }

    fn send_recv_ring(&self) -> CaseResult {
        const CASE: &str = "send_recv_ring";
        let (n, r) = (self.n(), self.r());
        if n == 1 {
            return Ok(());
        }
        let g = self.ctx.world();
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        g.send(self.iota([1], 0.0, r as f32), next)
            .map_err(dist(CASE))?;
        let a: Tensor<Bk, 1> = g.recv(prev, self.device).map_err(dist(CASE))?;
        // Non-blocking pairs, posted in the order a pipeline schedule posts them.
        let recv = g.irecv::<Bk, 1>(next, self.device).map_err(dist(CASE))?;
        let send = g.isend(self.iota([2], 1.0 - 10.0 * r as f32, 10.0 * r as f32), prev);
        send.map_err(dist(CASE))?.wait().map_err(dist(CASE))?;
        let b = recv.wait().map_err(dist(CASE))?;
        expect(CASE, values(a), vec![prev as f32])?;
        expect(CASE, values(b), vec![10.0 * next as f32, 1.0])
    }

    /// Collectives on several groups, started before any is waited on and waited on out of
    /// order, pair up by order per group.
    fn async_in_order(&self) -> CaseResult {
        const CASE: &str = "async_in_order";
        let (n, r) = (self.n(), self.r());
        let tp = if n.is_multiple_of(2) { 2 } else { 1 };
        let state = self
            .ctx
            .parallel_state(ParallelSizes::default().with_tp(tp))
            .map_err(dist(CASE))?;
        let x = |v: f32| self.iota([1], 0.0, v);
        let first = state.tp().all_reduce_async(x(r as f32), ReduceOp::Sum);
        let on_dp = state.dp().all_gather_async(x(r as f32), 0);
        let second = state
            .tp()
            .all_reduce_async(x(100.0 * r as f32), ReduceOp::Max);
        let (first, on_dp, second) = (
            first.map_err(dist(CASE))?,
            on_dp.map_err(dist(CASE))?,
            second.map_err(dist(CASE))?,
        );
        let second = values(second.wait().map_err(dist(CASE))?);
        let on_dp = values(on_dp.wait().map_err(dist(CASE))?);
        let first = values(first.wait().map_err(dist(CASE))?);
        let pair = r - r % tp;
        expect(CASE, first, vec![(pair..pair + tp).sum::<usize>() as f32])?;
        expect(
            CASE,
            on_dp,
            (r % tp..n).step_by(tp).map(|q| q as f32).collect(),
        )?;
        expect(CASE, second, vec![100.0 * (pair + tp - 1) as f32])
    }

    /// Collectives keep the tensor's dtype, not the device's default.
    fn keeps_dtype(&self) -> CaseResult {
        const CASE: &str = "keeps_dtype";
        let n = self.n() as f32;
        let x = Tensor::<Bk, 1>::from_data(TensorData::new(vec![1.5f32, 2.5], [2]), self.device)
            .cast(self.other_dtype);
        let y = self
            .ctx
            .world()
            .all_reduce(x, ReduceOp::Sum)
            .map_err(dist(CASE))?;
        let z = self
            .ctx
            .world()
            .all_gather(y.clone(), 0)
            .map_err(dist(CASE))?;
        if (y.dtype(), z.dtype()) != (self.other_dtype, self.other_dtype) {
            let got = (y.dtype(), z.dtype());
            return Err(wrong(CASE, format!("dtypes {got:?}")));
        }
        let want = (0..self.n()).flat_map(|_| [1.5 * n, 2.5 * n]);
        expect(CASE, values(z), want.collect())
    }

    fn bit_identical(&self) -> CaseResult {
        const CASE: &str = "bit_identical";
        let r = self.r() as f32;
        let x = self.iota([64], 0.1 + r * 0.37, 1.0 / (1.0 + r));
        let sum = self
            .ctx
            .world()
            .all_reduce(x, ReduceOp::Sum)
            .map_err(dist(CASE))?;
        // Everybody's bits against rank 0's.
        let theirs = self
            .ctx
            .world()
            .broadcast(sum.clone(), 0)
            .map_err(dist(CASE))?;
        let bits = |t: Tensor<Bk, 1>| values(t).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let (mine, theirs) = (bits(sum), bits(theirs));
        if mine != theirs {
            return Err(wrong(CASE, "sums differ from rank 0's".into()));
        }
        Ok(())
    }
}

fn dist(case: &'static str) -> impl Fn(DistError) -> SuiteError {
    move |e| wrong(case, e.to_string())
}

/// The tensor's values as f32.
pub fn values<Bk: DistBackend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec().unwrap()
}
