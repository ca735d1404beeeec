//! A group's calls on GPU tensors: the host transport checks and pairs them, NCCL moves the
//! data (see [`crate::nccl`]).
//!
//! With collective checks on (the default), every rank first deposits the call's description
//! (operation, shape, dtype) on the host and collects everybody's: a mismatch is an error
//! naming each rank's call instead of a hang or garbage, and uneven shards are known before
//! NCCL runs. With checks off, calls go straight to NCCL and shards must be equal.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};

use burn::tensor::{DType, Shape, TensorData};
use burn_megatron_kernels::cuda::CudaGpu;

use super::ProcessGroup;
use crate::error::{DistError, DistResult};
use crate::flat_collective;
use crate::nccl::{Flat, GpuP2p, GpuTensor, NcclGroup, NcclId, PeerOp, primitive, tensor};
use crate::op::CollectiveOp;
use crate::shard::shard_range;
use crate::transport::Contribution;

impl ProcessGroup {
    /// This group's communicator on `gpu`, created by the first call that needs it.
    fn nccl(&self, gpu: &CudaGpu) -> DistResult<Arc<NcclGroup>> {
        let mut slot = self
            .inner
            .shared
            .nccl
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(group) = slot.as_ref() {
            if group.gpu() != gpu {
                return Err(DistError::InvalidArgument(format!(
                    "group '{}' communicates on {:?}; a tensor on {gpu:?} cannot join it",
                    self.name(),
                    group.gpu()
                )));
            }
            return Ok(group.clone());
        }
        let id = match self.rank() {
            0 => Some(TensorData::new(NcclId::new()?.to_bytes().to_vec(), [128])),
            _ => None,
        };
        let part = Contribution {
            op: CollectiveOp::CommInit,
            shape: vec![128],
            dtype: DType::U8,
            data: id,
        };
        let parts = self.deposit(part)?.collect()?;
        let bytes: [u8; 128] = parts[0]
            .data
            .as_ref()
            .and_then(|d| d.as_bytes().try_into().ok())
            .ok_or_else(|| DistError::Nccl("the NCCL id from group rank 0 is malformed".into()))?;
        let group = Arc::new(NcclGroup::new(
            gpu,
            NcclId::from_bytes(bytes),
            &self.inner.info,
            self.inner.transport.clone(),
        )?);
        *slot = Some(group.clone());
        Ok(group)
    }

    /// Numbers the call and, with checks on, matches it with every rank's: returns its
    /// sequence number and every rank's shape, in rank order.
    fn begin(&self, op: CollectiveOp, x: &GpuTensor) -> DistResult<(u64, Vec<Vec<usize>>)> {
        self.backward_failure()?;
        let shape = x.meta.shape().to_vec();
        if !self.inner.registry.check_collectives {
            let seq = self.next_seq();
            return Ok((seq, vec![shape; self.size()]));
        }
        let pending = self.deposit(Contribution {
            op,
            shape,
            dtype: x.dtype,
            data: None,
        })?;
        let parts = pending.collect()?;
        let info = &self.inner.info;
        let host = parts.iter().position(|p| p.data.is_some());
        if let (Some(q), false) = (host, matches!(op, CollectiveOp::Broadcast { .. })) {
            return Err(DistError::Mismatch {
                rank: info.global_rank,
                group: info.name.clone(),
                op: op.to_string(),
                seq: pending.seq,
                detail: format!(
                    "rank {} passed a tensor of a backend without NCCL; this rank's is on the GPU",
                    info.members[q]
                ),
            });
        }
        Ok((pending.seq, parts.into_iter().map(|p| p.shape).collect()))
    }

    /// Runs `op` over NCCL on `x` (a tensor of rank `D`).
    pub(crate) fn nccl_call<const D: usize>(
        &self,
        op: CollectiveOp,
        x: GpuTensor,
        gpu: &CudaGpu,
    ) -> DistResult<GpuTensor> {
        let nccl = self.nccl(gpu)?;
        if let CollectiveOp::Send { dst } = op {
            let header = Contribution {
                op,
                shape: x.meta.shape().to_vec(),
                dtype: x.dtype,
                data: None,
            };
            self.inner.transport.send(&self.inner.info, dst, header)?;
            let mut sends = vec![None; self.size()];
            sends[dst] = Some(x.clone());
            let seq = self.next_p2p_seq();
            nccl.exchange(seq, op.to_string(), sends, vec![None; self.size()])?;
            return Ok(x);
        }
        let (seq, shapes) = self.begin(op, &x)?;
        let (name, n, me) = (op.to_string(), self.size(), self.rank());
        let x = tensor::<D>(x);
        let out = match op {
            CollectiveOp::AllReduce(red) => {
                let shape = x.shape();
                tensor::<D>(nccl.collective(seq, name, primitive(x), Flat::AllReduce(red))?)
                    .reshape(shape)
            }
            CollectiveOp::Broadcast { root } => {
                let shape = x.shape();
                tensor::<D>(nccl.collective(seq, name, primitive(x), Flat::Broadcast(root))?)
                    .reshape(shape)
            }
            CollectiveOp::AllGather { dim } => {
                let lens: Vec<usize> = shapes.iter().map(|s| s[dim]).collect();
                let longest = *lens.iter().max().expect("a group has ranks");
                if lens.iter().all(|&l| l == longest) {
                    // Equal parts: NCCL concatenates the buffers as they are.
                    let part = x.dims();
                    let flat = nccl.collective(seq, name, primitive(x), Flat::AllGather)?;
                    return Ok(primitive(flat_collective::gathered_along(
                        tensor::<1>(flat),
                        part,
                        n,
                        dim,
                    )));
                }
                // Uneven parts: gather along the first dimension, every part padded to the
                // longest.
                let moved = x.swap_dims(0, dim);
                let mut rows = moved.dims();
                let mine = rows[0];
                let padded = match mine < longest {
                    true => {
                        rows[0] = longest - mine;
                        let pad =
                            burn::tensor::Tensor::zeros(rows, (&moved.device(), moved.dtype()));
                        burn::tensor::Tensor::cat(vec![moved, pad], 0)
                    }
                    false => moved,
                };
                let mut shape = padded.dims();
                shape[0] = longest * n;
                let gathered = nccl.collective(seq, name, primitive(padded), Flat::AllGather)?;
                let gathered = tensor::<D>(gathered).reshape(shape);
                let gathered = match lens.iter().all(|&l| l == longest) {
                    true => gathered,
                    false => {
                        let parts =
                            (0..n).map(|q| gathered.clone().narrow(0, q * longest, lens[q]));
                        burn::tensor::Tensor::cat(parts.collect(), 0)
                    }
                };
                gathered.swap_dims(0, dim)
            }
            CollectiveOp::ReduceScatter { dim, op: red } => {
                let dims = x.dims();
                if dims[dim].is_multiple_of(n) {
                    // Even shards: each rank's is one piece of the rank-major buffer.
                    let flat = flat_collective::rank_major(x, n, dim);
                    let part =
                        nccl.collective(seq, name, primitive(flat), Flat::ReduceScatter(red))?;
                    let shape = flat_collective::scattered_shape(dims, n, dim);
                    return Ok(primitive(tensor::<1>(part).reshape(shape)));
                }
                // Uneven shards: reduce shards padded to the longest, then keep this rank's
                // length.
                let moved = x.swap_dims(0, dim);
                let mut rows = moved.dims();
                let len = rows[0];
                let chunk = len.div_ceil(n);
                let mine = shard_range(len, n, me)?;
                let padded = match chunk * n > len {
                    true => {
                        rows[0] = chunk * n - len;
                        let pad =
                            burn::tensor::Tensor::zeros(rows, (&moved.device(), moved.dtype()));
                        burn::tensor::Tensor::cat(vec![moved, pad], 0)
                    }
                    false => moved,
                };
                let mut shape = padded.dims();
                shape[0] = chunk;
                let part =
                    nccl.collective(seq, name, primitive(padded), Flat::ReduceScatter(red))?;
                tensor::<D>(part)
                    .reshape(shape)
                    .narrow(0, 0, mine.len())
                    .swap_dims(0, dim)
            }
            CollectiveOp::AllToAll {
                split_dim,
                concat_dim,
            } => {
                let dims = x.dims();
                let mut sends = Vec::with_capacity(n);
                for q in 0..n {
                    let range = shard_range(dims[split_dim], n, q)?;
                    sends.push(Some(primitive(x.clone().narrow(
                        split_dim,
                        range.start,
                        range.len(),
                    ))));
                }
                let mut recv_shapes = Vec::with_capacity(n);
                for theirs in &shapes {
                    let mut shape = theirs.clone();
                    shape[split_dim] = shard_range(theirs[split_dim], n, me)?.len();
                    recv_shapes.push(shape);
                }
                let recvs = recv_shapes
                    .iter()
                    .map(|s| Some((s.iter().product(), x.dtype())))
                    .collect();
                let received = nccl.exchange(seq, name, sends, recvs)?;
                let parts = received.into_iter().zip(recv_shapes).map(|(t, shape)| {
                    tensor::<D>(t.expect("received from every rank")).reshape(Shape::from(shape))
                });
                burn::tensor::Tensor::cat(parts.collect(), concat_dim)
            }
            CollectiveOp::Barrier | CollectiveOp::CommInit | CollectiveOp::Send { .. } => {
                unreachable!("not a data collective")
            }
        };
        Ok(primitive(out))
    }

    /// Receives over NCCL what group rank `src` sent (its header came through the host).
    pub(crate) fn nccl_recv(
        &self,
        src: usize,
        shape: Vec<usize>,
        dtype: DType,
        gpu: &CudaGpu,
    ) -> DistResult<GpuTensor> {
        let nccl = self.nccl(gpu)?;
        let mut recvs = vec![None; self.size()];
        recvs[src] = Some((shape.iter().product(), dtype));
        let seq = self.next_p2p_seq();
        let op = format!("recv(src={src})");
        let received = nccl.exchange(seq, op, vec![None; self.size()], recvs)?;
        let flat = received.into_iter().nth(src).flatten().expect("received");
        Ok(burn_cubecl::ops::reshape(flat, shape.into()))
    }

    /// Runs a batch of sends and receives ([`crate::p2p::batch_isend_irecv`]) as one NCCL
    /// group on the group's stream; returns the received tensors in the order of the
    /// receives.
    ///
    /// With collective checks on, each send first posts its header (shape, dtype) to its peer
    /// through the host, and each receive compares the header it gets with the shape and
    /// dtype it expects (a mismatch is an error naming both, before NCCL runs); posting never
    /// blocks, so headers cannot deadlock either. With checks off, no header is sent: the
    /// shapes are known in advance, and a batched send must meet a batched receive.
    pub(crate) fn nccl_batch(&self, ops: Vec<GpuP2p>, gpu: &CudaGpu) -> DistResult<Vec<GpuTensor>> {
        self.backward_failure()?;
        for op in &ops {
            let (peer, what) = match op {
                GpuP2p::Send { peer, .. } => (*peer, "send destination"),
                GpuP2p::Recv { peer, .. } => (*peer, "recv source"),
            };
            self.check_peer(peer, what)?;
        }
        let nccl = self.nccl(gpu)?;
        let info = &self.inner.info;
        if self.inner.registry.check_collectives {
            for op in &ops {
                if let GpuP2p::Send { tensor, peer } = op {
                    let header = Contribution {
                        op: CollectiveOp::Send { dst: *peer },
                        shape: tensor.meta.shape().to_vec(),
                        dtype: tensor.dtype,
                        data: None,
                    };
                    self.inner.transport.send(info, *peer, header)?;
                }
            }
            for op in &ops {
                if let GpuP2p::Recv { peer, shape, dtype } = op {
                    let seq = self.inner.shared.receives.fetch_add(1, Ordering::Relaxed);
                    let header = self.inner.transport.recv(info, *peer, seq)?;
                    if header.data.is_some() || header.shape != *shape || header.dtype != *dtype {
                        let sent = match header.data.is_some() {
                            true => "a tensor through the host (a backend without NCCL)",
                            false => "it over NCCL",
                        };
                        return Err(DistError::Mismatch {
                            rank: info.global_rank,
                            group: info.name.clone(),
                            op: format!("batch_isend_irecv: recv(src={peer})"),
                            seq,
                            detail: format!(
                                "expected {shape:?} {dtype:?}, rank {} sent {:?} {:?}, {sent}",
                                info.members[*peer], header.shape, header.dtype
                            ),
                        });
                    }
                }
            }
        }
        let mut name = String::from("batch_isend_irecv(");
        let mut shapes = Vec::new();
        let mut peer_ops = Vec::with_capacity(ops.len());
        for (i, op) in ops.into_iter().enumerate() {
            if i > 0 {
                name.push_str(", ");
            }
            match op {
                GpuP2p::Send { tensor, peer } => {
                    name.push_str(&format!("send(dst={peer})"));
                    peer_ops.push(PeerOp::Send { tensor, peer });
                }
                GpuP2p::Recv { peer, shape, dtype } => {
                    name.push_str(&format!("recv(src={peer})"));
                    let count = shape.iter().product();
                    shapes.push(shape);
                    peer_ops.push(PeerOp::Recv { peer, count, dtype });
                }
            }
        }
        name.push(')');
        let seq = self.next_p2p_seq();
        let received = nccl.point_to_point(seq, name, peer_ops)?;
        Ok(received
            .into_iter()
            .zip(shapes)
            .map(|(flat, shape)| burn_cubecl::ops::reshape(flat, shape.into()))
            .collect())
    }

    /// The group's communicator, if a GPU collective has created it.
    pub(super) fn existing_nccl(&self) -> Option<Arc<NcclGroup>> {
        self.inner
            .shared
            .nccl
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The error the group's NCCL watchdog ended a collective with, if any, without waiting.
    pub(crate) fn nccl_failure(&self) -> DistResult<()> {
        self.existing_nccl().map_or(Ok(()), |nccl| nccl.failure())
    }

    /// Waits until every GPU collective this rank started on the group has ended, or returns
    /// the error that ended one (the watchdog's timeout, a peer that failed).
    pub(crate) fn nccl_synchronize(&self) -> DistResult<()> {
        self.existing_nccl()
            .map_or(Ok(()), |nccl| nccl.synchronize())
    }
}
