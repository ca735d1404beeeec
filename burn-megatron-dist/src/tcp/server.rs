//! The rendezvous server, in rank 0's process.
//!
//! It holds a [`ThreadWorld`] and runs each request on it for the calling rank, so processes
//! get the same matching, checks and errors as threads. It also follows each rank's lifeline
//! (see [`super`]) and its calls, so that rank 0 knows when every rank has ended, or that one
//! has gone silent without ending.

use std::io::{self, BufReader, BufWriter};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::frame::{Request, Response, decode_part, encode_part, read_frame, write_frame};
use super::socket::{ANSWER_SLACK, detect_dead_peer};
use crate::error::{DistError, DistResult};
use crate::threads::ThreadWorld;
use crate::transport::Transport;

/// The rendezvous server.
#[derive(Debug)]
pub(crate) struct TcpServer {
    world: Arc<ThreadWorld>,
    timeout: Duration,
    ranks: Mutex<Ranks>,
    changed: Condvar,
}

/// What the server knows of each rank's process.
#[derive(Debug)]
struct Ranks {
    /// Whether its lifeline is connected (a second process with the same rank is refused).
    joined: Vec<bool>,
    /// Whether it has ended (reported, or its lifeline closed).
    ended: Vec<bool>,
    /// Its calls in progress (a call the server holds is bounded by the timeout).
    busy: Vec<u32>,
    /// When its last call ended.
    last_seen: Vec<Instant>,
}

impl TcpServer {
    /// Listens on `listener` in the background. `timeout` bounds every wait of a collective,
    /// and sets how soon a silent or unreachable peer is given up on.
    pub fn start(listener: TcpListener, size: usize, timeout: Duration) -> Arc<Self> {
        let server = Arc::new(Self {
            world: Arc::new(ThreadWorld::new(size, timeout)),
            timeout,
            ranks: Mutex::new(Ranks {
                joined: vec![false; size],
                ended: vec![false; size],
                busy: vec![0; size],
                last_seen: vec![Instant::now(); size],
            }),
            changed: Condvar::new(),
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

    fn lock(&self) -> MutexGuard<'_, Ranks> {
        self.ranks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Blocks until every rank has ended, or fails naming the ranks that have neither ended
    /// nor called the rendezvous for the timeout (plus a margin) since rank 0 began waiting
    /// or since their last call: a process that hangs outside any collective, or whose host
    /// stopped answering, must not keep rank 0 (and the job) up forever.
    pub fn wait_all_ended(&self) -> DistResult<()> {
        let started = Instant::now();
        let quiet_limit = self.timeout.saturating_add(ANSWER_SLACK);
        let mut ranks = self.lock();
        loop {
            let now = Instant::now();
            let mut silent = Vec::new();
            let mut next_check = now + quiet_limit;
            for rank in 0..ranks.ended.len() {
                if ranks.ended[rank] || ranks.busy[rank] > 0 {
                    continue;
                }
                let due = ranks.last_seen[rank].max(started) + quiet_limit;
                if due <= now {
                    silent.push(rank);
                } else {
                    next_check = next_check.min(due);
                }
            }
            if ranks.ended.iter().all(|&e| e) {
                return Ok(());
            }
            if !silent.is_empty() {
                return Err(DistError::Rendezvous(format!(
                    "rank 0 finished, but ranks {silent:?} have neither ended nor called the \
                     rendezvous for {quiet_limit:?}: they hang outside any collective, or \
                     their host stopped answering; rank 0 stops serving the rendezvous"
                )));
            }
            ranks = self
                .changed
                .wait_timeout(ranks, next_check - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Admits `rank`'s lifeline.
    fn join(&self, rank: usize, size: usize) -> DistResult<()> {
        let world = self.world.size();
        if size != world || rank >= world {
            return Err(DistError::Rendezvous(format!(
                "rank {rank} of a world of {size} ranks reached the rendezvous of a world of \
                 {world}: are WORLD_SIZE and MASTER_PORT the same for every rank?"
            )));
        }
        let mut ranks = self.lock();
        if std::mem::replace(&mut ranks.joined[rank], true) {
            return Err(DistError::Rendezvous(format!(
                "rank {rank} joined the rendezvous twice: two processes have RANK={rank}, or \
                 one of an earlier run is still alive"
            )));
        }
        Ok(())
    }

    fn end(&self, rank: usize) -> bool {
        let mut ranks = self.lock();
        let first = !std::mem::replace(&mut ranks.ended[rank], true);
        self.changed.notify_all();
        first
    }

    /// Counts a call of `rank` in (`starting`) or out.
    fn seen(&self, rank: usize, starting: bool) {
        let mut ranks = self.lock();
        let Some(busy) = ranks.busy.get_mut(rank) else {
            return;
        };
        match starting {
            true => *busy += 1,
            false => {
                *busy = busy.saturating_sub(1);
                ranks.last_seen[rank] = Instant::now();
                self.changed.notify_all();
            }
        }
    }

    fn serve(&self, stream: TcpStream) {
        let peer = stream
            .peer_addr()
            .map_or_else(|_| "an unknown peer".to_string(), |a| a.to_string());
        // Request connections may idle for long (pooled) and a lifeline idles for the whole
        // run: keepalive finds their dead hosts. Answers must be taken within the deadline.
        let configured = stream
            .set_nodelay(true)
            .and_then(|_| detect_dead_peer(&stream, self.timeout))
            .and_then(|_| {
                stream.set_write_timeout(Some(self.timeout.saturating_add(ANSWER_SLACK)))
            });
        let Ok(reader) = configured.and_then(|_| stream.try_clone()) else {
            return;
        };
        let (mut reader, mut writer) = (BufReader::new(reader), BufWriter::new(stream));
        loop {
            let (request, payload) = match read_frame::<Request>(&mut reader) {
                Ok(frame) => frame,
                Err(e) => {
                    if e.kind() == io::ErrorKind::InvalidData {
                        eprintln!(
                            "burn-megatron rendezvous: closed the connection from {peer}: {e}"
                        );
                    }
                    return;
                }
            };
            if let Request::Lifeline { rank, size } = request {
                return self.follow_lifeline(rank, size, reader, writer);
            }
            let rank = request.rank();
            self.seen(rank, true);
            let mut out = Vec::new();
            let response = self
                .handle(request, &payload, &mut out)
                .unwrap_or_else(Response::Error);
            self.seen(rank, false);
            if write_frame(&mut writer, &response, &out).is_err() {
                return;
            }
        }
    }

    /// Answers a lifeline, then holds it until the process ends: if that happens before the
    /// rank reported how it ended, the rank crashed or was killed (or its host went down, which
    /// keepalive finds), and its peers are released with that news.
    fn follow_lifeline(
        &self,
        rank: usize,
        size: usize,
        mut reader: BufReader<TcpStream>,
        mut writer: BufWriter<TcpStream>,
    ) {
        let joined = self.join(rank, size);
        let answer = match &joined {
            Ok(()) => Response::Done,
            Err(e) => Response::Error(e.clone()),
        };
        let _ = write_frame(&mut writer, &answer, &[]);
        if joined.is_err() {
            return;
        }
        let _ = io::copy(&mut reader, &mut io::sink());
        if self.end(rank) {
            let reason = format!(
                "the process of rank {rank} ended without reporting how: it crashed or was \
                 killed, or its host stopped answering"
            );
            self.world.fail(rank, reason);
        }
    }

    fn handle(&self, request: Request, payload: &[u8], out: &mut Vec<u8>) -> DistResult<Response> {
        let world = self.world.as_ref();
        let mut payload = payload;
        let malformed = |e: io::Error| DistError::Rendezvous(format!("malformed request: {e}"));
        let in_world = |rank: usize| {
            (rank < world.size())
                .then_some(rank)
                .ok_or_else(|| DistError::Rendezvous(format!("no rank {rank} in this world")))
        };
        Ok(match request {
            Request::Lifeline { .. } => unreachable!("handled by serve"),
            Request::Fail { rank, reason } => {
                world.fail(in_world(rank)?, reason);
                self.end(rank);
                Response::Done
            }
            Request::Exit { rank } => {
                world.exit(in_world(rank)?);
                self.end(rank);
                Response::Done
            }
            Request::Status { .. } => Response::Status(world.status()?),
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
