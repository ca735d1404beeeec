//! The rendezvous's wire format: requests, answers, and the frames that carry them.
//!
//! A frame is a JSON header and a binary payload (the tensors' bytes), each preceded by its
//! length. Lengths come from the wire, so they are bounded: a peer that is not a burn-megatron
//! rendezvous (a port scanner, another service on `MASTER_PORT`) or a corrupted stream must
//! give an error, not an allocation of whatever 8 bytes happened to say.

use std::io::{self, Read, Write};

use burn::tensor::{DType, TensorData};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::DistError;
use crate::op::CollectiveOp;
use crate::transport::{Contribution, GroupInfo, WorldStatus};

/// The largest JSON header a frame may announce. Headers hold shapes, group names and error
/// messages: kilobytes.
pub(super) const MAX_HEADER_BYTES: u64 = 64 << 20;
/// The largest payload a frame may announce: every part of one host collective (CPU tensors),
/// far above what a rendezvous over TCP is used for.
pub(super) const MAX_PAYLOAD_BYTES: u64 = 64 << 30;
/// A block is read in pieces of at most this size, so that memory grows only as bytes arrive.
const READ_PIECE: usize = 64 << 20;

#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Request {
    /// The first request of a process: the server answers, then holds the connection until
    /// the process ends.
    Lifeline {
        rank: usize,
        size: usize,
    },
    Fail {
        rank: usize,
        reason: String,
    },
    Exit {
        rank: usize,
    },
    Status {
        rank: usize,
    },
    Deposit {
        group: GroupInfo,
        seq: u64,
        part: PartHeader,
    },
    Collect {
        group: GroupInfo,
        seq: u64,
        op: String,
    },
    Send {
        group: GroupInfo,
        dst: usize,
        message: PartHeader,
    },
    Recv {
        group: GroupInfo,
        src: usize,
        seq: u64,
    },
}

impl Request {
    /// The global rank that makes the request.
    pub fn rank(&self) -> usize {
        match self {
            Self::Lifeline { rank, .. }
            | Self::Fail { rank, .. }
            | Self::Exit { rank }
            | Self::Status { rank } => *rank,
            Self::Deposit { group, .. }
            | Self::Collect { group, .. }
            | Self::Send { group, .. }
            | Self::Recv { group, .. } => group.global_rank,
        }
    }

    /// What the request is for, in errors.
    pub fn describe(&self) -> String {
        match self {
            Self::Lifeline { .. } => "joining".into(),
            Self::Fail { .. } => "reporting its failure".into(),
            Self::Exit { .. } => "reporting its exit".into(),
            Self::Status { .. } => "asking for the world's status".into(),
            Self::Deposit {
                group, seq, part, ..
            } => format!("{} #{seq} on group '{}' (deposit)", part.op, group.name),
            Self::Collect { group, seq, op } => format!("{op} #{seq} on group '{}'", group.name),
            Self::Send { group, dst, .. } => format!("send(dst={dst}) on group '{}'", group.name),
            Self::Recv { group, src, seq } => {
                format!("recv(src={src}) #{seq} on group '{}'", group.name)
            }
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Response {
    Done,
    Status(WorldStatus),
    Parts(Vec<PartHeader>),
    Error(DistError),
}

/// A tensor's description; its bytes travel after the frame's header.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct DataHeader {
    shape: Vec<usize>,
    dtype: DType,
    bytes: usize,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct PartHeader {
    op: CollectiveOp,
    shape: Vec<usize>,
    dtype: DType,
    data: Option<DataHeader>,
}

fn encode_data(data: &TensorData, payload: &mut Vec<u8>) -> DataHeader {
    let bytes = data.as_bytes();
    payload.extend_from_slice(bytes);
    DataHeader {
        shape: data.shape.to_vec(),
        dtype: data.dtype,
        bytes: bytes.len(),
    }
}

fn decode_data(header: DataHeader, payload: &mut &[u8]) -> io::Result<TensorData> {
    if payload.len() < header.bytes {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "short payload"));
    }
    let (bytes, rest) = payload.split_at(header.bytes);
    *payload = rest;
    Ok(TensorData::from_bytes_vec(
        bytes.to_vec(),
        header.shape,
        header.dtype,
    ))
}

/// Describes `part` and appends its bytes to `payload`.
pub(super) fn encode_part(part: &Contribution, payload: &mut Vec<u8>) -> PartHeader {
    PartHeader {
        op: part.op,
        shape: part.shape.clone(),
        dtype: part.dtype,
        data: part.data.as_ref().map(|d| encode_data(d, payload)),
    }
}

/// The part `header` describes, its bytes taken from the front of `payload`.
pub(super) fn decode_part(header: PartHeader, payload: &mut &[u8]) -> io::Result<Contribution> {
    Ok(Contribution {
        op: header.op,
        shape: header.shape,
        dtype: header.dtype,
        data: header.data.map(|d| decode_data(d, payload)).transpose()?,
    })
}

/// Writes one frame.
pub(super) fn write_frame(
    stream: &mut impl Write,
    header: &impl Serialize,
    payload: &[u8],
) -> io::Result<()> {
    let header = serde_json::to_vec(header)?;
    stream.write_all(&(header.len() as u64).to_le_bytes())?;
    stream.write_all(&header)?;
    stream.write_all(&(payload.len() as u64).to_le_bytes())?;
    stream.write_all(payload)?;
    stream.flush()
}

/// Reads one frame; a length past the maximum is an `InvalidData` error.
pub(super) fn read_frame<T: DeserializeOwned>(stream: &mut impl Read) -> io::Result<(T, Vec<u8>)> {
    let header = read_block(stream, "header", MAX_HEADER_BYTES)?;
    let header = serde_json::from_slice(&header)?;
    Ok((header, read_block(stream, "payload", MAX_PAYLOAD_BYTES)?))
}

fn read_block(stream: &mut impl Read, what: &str, max: u64) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    stream.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "a frame announced a {what} of {len} bytes, more than the {max} a frame may \
                 carry: the peer is not a burn-megatron rendezvous of this version, or the \
                 stream is corrupted"
            ),
        ));
    }
    let len = len as usize;
    let mut block = Vec::new();
    while block.len() < len {
        let start = block.len();
        block.resize(start + (len - start).min(READ_PIECE), 0);
        stream.read_exact(&mut block[start..])?;
    }
    Ok(block)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let mut wire = Vec::new();
        write_frame(&mut wire, &Request::Status { rank: 3 }, &[1, 2, 3]).unwrap();
        let (request, payload) = read_frame::<Request>(&mut wire.as_slice()).unwrap();
        assert!(
            matches!(request, Request::Status { rank: 3 }),
            "{request:?}"
        );
        assert_eq!(payload, [1, 2, 3]);
    }

    /// A length past the maximum is refused before anything is allocated (without the bound,
    /// `vec![0; 2^62]` aborts the process).
    #[test]
    fn oversized_lengths_are_errors() {
        let huge = (1u64 << 62).to_le_bytes();
        let error = read_frame::<Request>(&mut huge.as_slice()).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
        assert!(
            error
                .to_string()
                .contains("a header of 4611686018427387904 bytes")
        );

        let mut wire = Vec::new();
        write_frame(&mut wire, &Request::Status { rank: 0 }, &[]).unwrap();
        let payload_len = wire.len() - 8;
        wire[payload_len..].copy_from_slice(&(MAX_PAYLOAD_BYTES + 1).to_le_bytes());
        let error = read_frame::<Request>(&mut wire.as_slice()).unwrap_err();
        assert!(error.to_string().contains("a payload of"), "{error}");
    }

    /// A length within the maximum but with fewer bytes behind it ends at the stream's end,
    /// having allocated only what arrived (one piece).
    #[test]
    fn a_short_stream_is_an_error() {
        let mut wire = (MAX_HEADER_BYTES).to_le_bytes().to_vec();
        wire.extend_from_slice(b"{}");
        let error = read_frame::<Request>(&mut wire.as_slice()).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::UnexpectedEof);
    }
}
