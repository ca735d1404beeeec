//! Ranks as processes: the rendezvous runs in rank 0's process and the others reach it over
//! TCP at `MASTER_ADDR:MASTER_PORT`.
//!
//! The server holds a [`ThreadWorld`] and runs each request on it for the calling rank, so
//! processes get the same matching, checks and errors as threads. Every process also keeps a
//! *lifeline* connection open for as long as it lives: if it closes before the rank reported
//! how it ended, the rank crashed or was killed, and its peers are released with that news.

use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use burn::tensor::{DType, TensorData};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{DistError, DistResult};
use crate::op::CollectiveOp;
use crate::threads::ThreadWorld;
use crate::transport::{Contribution, GroupInfo, Transport, WorldStatus};

#[derive(Debug, Serialize, Deserialize)]
enum Request {
    Lifeline {
        rank: usize,
    },
    Fail {
        rank: usize,
        reason: String,
    },
    Exit {
        rank: usize,
    },
    Status,
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

#[derive(Debug, Serialize, Deserialize)]
enum Response {
    Done,
    Status(WorldStatus),
    Parts(Vec<PartHeader>),
    Error(DistError),
}

/// A tensor's description; its bytes travel after the frame's header.
#[derive(Debug, Serialize, Deserialize)]
struct DataHeader {
    shape: Vec<usize>,
    dtype: DType,
    bytes: usize,
}

#[derive(Debug, Serialize, Deserialize)]
struct PartHeader {
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

fn encode_part(part: &Contribution, payload: &mut Vec<u8>) -> PartHeader {
    PartHeader {
        op: part.op,
        shape: part.shape.clone(),
        dtype: part.dtype,
        data: part.data.as_ref().map(|d| encode_data(d, payload)),
    }
}

fn decode_part(header: PartHeader, payload: &mut &[u8]) -> io::Result<Contribution> {
    Ok(Contribution {
        op: header.op,
        shape: header.shape,
        dtype: header.dtype,
        data: header.data.map(|d| decode_data(d, payload)).transpose()?,
    })
}

/// A frame: a JSON header and a binary payload, each preceded by its length.
fn write_frame(stream: &mut impl Write, header: &impl Serialize, payload: &[u8]) -> io::Result<()> {
    let header = serde_json::to_vec(header)?;
    stream.write_all(&(header.len() as u64).to_le_bytes())?;
    stream.write_all(&header)?;
    stream.write_all(&(payload.len() as u64).to_le_bytes())?;
    stream.write_all(payload)?;
    stream.flush()
}

fn read_frame<T: DeserializeOwned>(stream: &mut impl Read) -> io::Result<(T, Vec<u8>)> {
    let mut read_block = || -> io::Result<Vec<u8>> {
        let mut len = [0u8; 8];
        stream.read_exact(&mut len)?;
        let mut block = vec![0u8; u64::from_le_bytes(len) as usize];
        stream.read_exact(&mut block)?;
        Ok(block)
    };
    let header = serde_json::from_slice(&read_block()?)?;
    Ok((header, read_block()?))
}

/// The rendezvous server, in rank 0's process.
#[derive(Debug)]
pub(crate) struct TcpServer {
    world: Arc<ThreadWorld>,
    /// Per rank: whether it has ended (reported, or its lifeline closed).
    ended: Mutex<Vec<bool>>,
    all_ended: Condvar,
}

impl TcpServer {
    /// Listens on `listener` in the background.
    pub fn start(listener: TcpListener, size: usize, timeout: Duration) -> Arc<Self> {
        let server = Arc::new(Self {
            world: Arc::new(ThreadWorld::new(size, timeout)),
            ended: Mutex::new(vec![false; size]),
            all_ended: Condvar::new(),
        });
        let accepting = server.clone();
        std::thread::Builder::new()
            .name("bm-rendezvous".into())
            .spawn(move || {
                for stream in listener.incoming().flatten() {
                    let server = accepting.clone();
                    std::thread::spawn(move || server.serve(stream));
                }
            })
            .expect("spawning the rendezvous thread");
        server
    }

    /// Blocks until every rank has ended.
    pub fn wait_all_ended(&self) {
        let mut ended = self.ended.lock().unwrap_or_else(PoisonError::into_inner);
        while !ended.iter().all(|&e| e) {
            ended = self
                .all_ended
                .wait(ended)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn end(&self, rank: usize) -> bool {
        let mut ended = self.ended.lock().unwrap_or_else(PoisonError::into_inner);
        let first = !std::mem::replace(&mut ended[rank], true);
        self.all_ended.notify_all();
        first
    }

    fn serve(&self, stream: TcpStream) {
        let _ = stream.set_nodelay(true);
        let Ok(reader) = stream.try_clone() else {
            return;
        };
        let (mut reader, mut writer) = (BufReader::new(reader), BufWriter::new(stream));
        while let Ok((request, payload)) = read_frame::<Request>(&mut reader) {
            if let Request::Lifeline { rank } = request {
                // Holds until the process ends; only its closing matters.
                let _ = io::copy(&mut reader, &mut io::sink());
                if rank < self.world.size() && self.end(rank) {
                    let reason = format!(
                        "the process of rank {rank} ended without reporting how: it crashed \
                         or was killed"
                    );
                    self.world.fail(rank, reason);
                }
                return;
            }
            let mut out = Vec::new();
            let response = self
                .handle(request, &payload, &mut out)
                .unwrap_or_else(Response::Error);
            if write_frame(&mut writer, &response, &out).is_err() {
                return;
            }
        }
    }

    fn handle(&self, request: Request, payload: &[u8], out: &mut Vec<u8>) -> DistResult<Response> {
        let world = self.world.as_ref();
        let mut payload = payload;
        let malformed = |e: io::Error| DistError::Rendezvous(format!("malformed request: {e}"));
        Ok(match request {
            Request::Lifeline { .. } => unreachable!("handled by serve"),
            Request::Fail { rank, reason } => {
                world.fail(rank, reason);
                self.end(rank);
                Response::Done
            }
            Request::Exit { rank } => {
                world.exit(rank);
                self.end(rank);
                Response::Done
            }
            Request::Status => Response::Status(world.status()?),
            Request::Deposit { group, seq, part } => {
                let part = decode_part(part, &mut payload).map_err(malformed)?;
                world.deposit(&group, seq, part)?;
                Response::Done
            }
            Request::Collect { group, seq, op } => {
                let parts = world.collect(&group, seq, &op)?;
                Response::Parts(parts.iter().map(|p| encode_part(p, out)).collect())
            }
            Request::Send {
                group,
                dst,
                message,
            } => {
                let message = decode_part(message, &mut payload).map_err(malformed)?;
                world.send(&group, dst, message)?;
                Response::Done
            }
            Request::Recv { group, src, seq } => {
                let message = world.recv(&group, src, seq)?;
                Response::Parts(vec![encode_part(&message, out)])
            }
        })
    }
}

/// A rank's side of the TCP rendezvous.
#[derive(Debug)]
pub(crate) struct TcpTransport {
    address: String,
    rank: usize,
    size: usize,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    timeout: Duration,
    /// Idle connections; a call that finds none opens another, so a blocking call never
    /// holds up another thread's call.
    idle: Mutex<Vec<TcpStream>>,
    _lifeline: TcpStream,
}

impl TcpTransport {
    /// Connects `rank` to the server at `address`, retrying until `connect_timeout` passes
    /// (the server's process may start later than this one).
    pub fn connect(
        address: &str,
        rank: usize,
        size: usize,
        timeout: Duration,
        connect_timeout: Duration,
    ) -> DistResult<Self> {
        let deadline = Instant::now() + connect_timeout;
        let mut lifeline = loop {
            match TcpStream::connect(address) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() >= deadline => {
                    return Err(DistError::Rendezvous(format!(
                        "rank {rank}: cannot reach the rendezvous of rank 0 at {address} \
                         within {connect_timeout:?}: {e}"
                    )));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        write_frame(&mut lifeline, &Request::Lifeline { rank }, &[])
            .map_err(|e| DistError::Rendezvous(format!("rank {rank}: {address}: {e}")))?;
        Ok(Self {
            address: address.to_string(),
            rank,
            size,
            timeout,
            idle: Mutex::default(),
            _lifeline: lifeline,
        })
    }

    fn call(&self, request: &Request, payload: &[u8]) -> DistResult<(Response, Vec<u8>)> {
        let lost = |e: io::Error| {
            DistError::Rendezvous(format!(
                "rank {}: lost the rendezvous at {} (in rank 0's process): {e}",
                self.rank, self.address
            ))
        };
        let idle = self
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let mut stream = match idle {
            Some(stream) => stream,
            None => {
                let stream = TcpStream::connect(&self.address).map_err(lost)?;
                let _ = stream.set_nodelay(true);
                stream
            }
        };
        write_frame(&mut BufWriter::new(&mut stream), request, payload).map_err(lost)?;
        let (response, payload) = read_frame::<Response>(&mut stream).map_err(lost)?;
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(stream);
        match response {
            Response::Error(error) => Err(error),
            response => Ok((response, payload)),
        }
    }

    fn unexpected(&self, response: Response) -> DistError {
        DistError::Rendezvous(format!(
            "rank {}: unexpected answer from the rendezvous: {response:?}",
            self.rank
        ))
    }
}

impl Transport for TcpTransport {
    fn size(&self) -> usize {
        self.size
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn fail(&self, rank: usize, reason: String) {
        // Best effort: if the server is gone, the lifeline tells the others.
        let _ = self.call(&Request::Fail { rank, reason }, &[]);
    }

    fn exit(&self, rank: usize) {
        let _ = self.call(&Request::Exit { rank }, &[]);
    }

    fn status(&self) -> DistResult<WorldStatus> {
        match self.call(&Request::Status, &[])?.0 {
            Response::Status(status) => Ok(status),
            other => Err(self.unexpected(other)),
        }
    }

    fn deposit(&self, group: &GroupInfo, seq: u64, part: Contribution) -> DistResult<()> {
        let mut payload = Vec::new();
        let part = encode_part(&part, &mut payload);
        let request = Request::Deposit {
            group: group.clone(),
            seq,
            part,
        };
        self.call(&request, &payload).map(|_| ())
    }

    fn collect(&self, group: &GroupInfo, seq: u64, op: &str) -> DistResult<Vec<Contribution>> {
        let request = Request::Collect {
            group: group.clone(),
            seq,
            op: op.to_string(),
        };
        match self.call(&request, &[])? {
            (Response::Parts(parts), payload) => {
                let mut payload = payload.as_slice();
                parts
                    .into_iter()
                    .map(|p| decode_part(p, &mut payload))
                    .collect::<io::Result<_>>()
                    .map_err(|e| DistError::Rendezvous(format!("malformed answer: {e}")))
            }
            (other, _) => Err(self.unexpected(other)),
        }
    }

    fn send(&self, group: &GroupInfo, dst: usize, message: Contribution) -> DistResult<()> {
        let mut payload = Vec::new();
        let message = encode_part(&message, &mut payload);
        let request = Request::Send {
            group: group.clone(),
            dst,
            message,
        };
        self.call(&request, &payload).map(|_| ())
    }

    fn recv(&self, group: &GroupInfo, src: usize, seq: u64) -> DistResult<Contribution> {
        let request = Request::Recv {
            group: group.clone(),
            src,
            seq,
        };
        match self.call(&request, &[])? {
            (Response::Parts(mut parts), payload) if parts.len() == 1 => {
                decode_part(parts.remove(0), &mut payload.as_slice())
                    .map_err(|e| DistError::Rendezvous(format!("malformed answer: {e}")))
            }
            (other, _) => Err(self.unexpected(other)),
        }
    }
}
