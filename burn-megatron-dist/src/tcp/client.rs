//! A rank's side of the TCP rendezvous.
//!
//! Every wait on rank 0's process has a deadline: joining (a refused connection is retried
//! only while rank 0 may still be starting; a master that does not answer fails within the
//! timeout) and every call (its answer may take the timeout, which the server spends waiting
//! for peers, and a little more). A rendezvous once lost stays lost: later calls (the report
//! of this rank's failure, the status read for the root cause) fail at once instead of each
//! waiting out its own deadline on a dead or hung master.

use std::io::{self, BufWriter};
use std::net::TcpStream;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use super::frame::{Request, Response, decode_part, encode_part, read_frame, write_frame};
use super::socket::{self, ANSWER_SLACK, detect_dead_peer, set_deadlines, timed_out};
use crate::error::{DistError, DistResult};
use crate::transport::{Contribution, GroupInfo, Transport, WorldStatus};

/// A rank's side of the TCP rendezvous.
#[derive(Debug)]
pub(crate) struct TcpTransport {
    address: String,
    rank: usize,
    size: usize,
    timeout: Duration,
    /// Idle connections; a call that finds none opens another, so a blocking call never
    /// holds up another thread's call.
    idle: Mutex<Vec<TcpStream>>,
    /// The error that lost the rendezvous, returned by every later call.
    lost: OnceLock<DistError>,
    _lifeline: TcpStream,
}

impl TcpTransport {
    /// Connects `rank` to the server at `address`. A refused connection (nothing listens
    /// yet: rank 0's process may start later than this one) is retried for `start_wait`; an
    /// unanswered or unreachable one until `timeout` (or `start_wait`, if longer) has passed.
    /// Then the server must answer the lifeline within `timeout`.
    pub fn connect(
        address: &str,
        rank: usize,
        size: usize,
        timeout: Duration,
        start_wait: Duration,
    ) -> DistResult<Self> {
        let started = Instant::now();
        let unanswered_until = started + timeout.max(start_wait);
        let unanswered = |error: &io::Error| {
            matches!(
                error.kind(),
                io::ErrorKind::TimedOut
                    | io::ErrorKind::WouldBlock
                    | io::ErrorKind::HostUnreachable
                    | io::ErrorKind::NetworkUnreachable
            )
        };
        let mut last_error: Option<io::Error> = None;
        let mut lifeline = loop {
            if let Some(error) = &last_error {
                std::thread::sleep(Duration::from_millis(50));
                let now = Instant::now();
                let waited = now - started;
                if unanswered(error) && now >= unanswered_until {
                    return Err(DistError::Rendezvous(format!(
                        "rank {rank}: rank 0's rendezvous at {address} did not answer within \
                         {waited:.1?}: {error}; rank 0's host is down or unreachable"
                    )));
                }
                if !unanswered(error) && (waited >= start_wait || now >= unanswered_until) {
                    return Err(DistError::Rendezvous(format!(
                        "rank {rank}: cannot reach rank 0's rendezvous at {address} (tried for \
                         {waited:.1?}): {error}; is rank 0 running, and are MASTER_ADDR and \
                         MASTER_PORT right?"
                    )));
                }
            }
            match socket::connect(address, unanswered_until) {
                Ok(stream) => break stream,
                Err(error) => last_error = Some(error),
            }
        };
        let joined = lifeline
            .set_nodelay(true)
            .and_then(|_| detect_dead_peer(&lifeline, timeout))
            .and_then(|_| set_deadlines(&lifeline, timeout))
            .and_then(|_| write_frame(&mut lifeline, &Request::Lifeline { rank, size }, &[]))
            .and_then(|_| read_frame::<Response>(&mut lifeline));
        match joined {
            Ok((Response::Done, _)) => {}
            Ok((Response::Error(error), _)) => return Err(error),
            Ok((other, _)) => {
                return Err(DistError::Rendezvous(format!(
                    "rank {rank}: rank 0's rendezvous at {address} answered the join with \
                     {other:?}"
                )));
            }
            Err(e) if timed_out(&e) => {
                return Err(DistError::Rendezvous(format!(
                    "rank {rank}: rank 0's rendezvous at {address} accepted the connection but \
                     did not answer within {timeout:?}: rank 0's process hangs, or another \
                     program listens on MASTER_PORT"
                )));
            }
            Err(e) => {
                return Err(DistError::Rendezvous(format!(
                    "rank {rank}: joining rank 0's rendezvous at {address}: {e}"
                )));
            }
        }
        Ok(Self {
            address: address.to_string(),
            rank,
            size,
            timeout,
            idle: Mutex::default(),
            lost: OnceLock::new(),
            _lifeline: lifeline,
        })
    }

    /// A new connection for calls, with the deadline of an answer.
    fn open(&self) -> io::Result<TcpStream> {
        let stream = socket::connect(&self.address, Instant::now() + self.timeout)?;
        stream.set_nodelay(true)?;
        detect_dead_peer(&stream, self.timeout)?;
        set_deadlines(&stream, self.timeout.saturating_add(ANSWER_SLACK))?;
        Ok(stream)
    }

    fn call(&self, request: &Request, payload: &[u8]) -> DistResult<(Response, Vec<u8>)> {
        if let Some(lost) = self.lost.get() {
            return Err(lost.clone());
        }
        let idle = self
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let mut stream = match idle {
            Some(stream) => stream,
            None => self.open().map_err(|e| self.lose(request, e))?,
        };
        write_frame(&mut BufWriter::new(&mut stream), request, payload)
            .map_err(|e| self.lose(request, e))?;
        let (response, payload) =
            read_frame::<Response>(&mut stream).map_err(|e| self.lose(request, e))?;
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(stream);
        match response {
            Response::Error(error) => Err(error),
            response => Ok((response, payload)),
        }
    }

    /// Records that the rendezvous is lost (`error` in `request`), and returns the error.
    fn lose(&self, request: &Request, error: io::Error) -> DistError {
        let (rank, address, what) = (self.rank, &self.address, request.describe());
        let message = if timed_out(&error) {
            format!(
                "rank {rank}: rank 0's rendezvous at {address} did not answer {what} within \
                 {:?}: rank 0's process hangs, or its host stopped answering",
                self.timeout.saturating_add(ANSWER_SLACK)
            )
        } else {
            format!(
                "rank {rank}: lost rank 0's rendezvous at {address} in {what}: {error}; rank \
                 0's process crashed or was killed, or its host went down"
            )
        };
        self.lost
            .get_or_init(|| DistError::Rendezvous(message))
            .clone()
    }

    fn malformed(&self, error: io::Error) -> DistError {
        DistError::Rendezvous(format!(
            "rank {}: malformed answer from the rendezvous at {}: {error}",
            self.rank, self.address
        ))
    }

    fn unexpected(&self, response: Response) -> DistError {
        DistError::Rendezvous(format!(
            "rank {}: unexpected answer from the rendezvous at {}: {response:?}",
            self.rank, self.address
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
        match self.call(&Request::Status { rank: self.rank }, &[])?.0 {
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
                    .map_err(|e| self.malformed(e))
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
                decode_part(parts.remove(0), &mut payload.as_slice()).map_err(|e| self.malformed(e))
            }
            (other, _) => Err(self.unexpected(other)),
        }
    }
}
