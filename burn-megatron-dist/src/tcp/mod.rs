//! Ranks as processes: the rendezvous runs in rank 0's process and the others reach it over
//! TCP at `MASTER_ADDR:MASTER_PORT`.
//!
//! The server ([`server`]) holds a [`ThreadWorld`](crate::threads::ThreadWorld) and runs each
//! request on it for the calling rank, so processes get the same matching, checks and errors
//! as threads. Every process also keeps a *lifeline* connection open for as long as it lives:
//! if it closes before the rank reported how it ended, the rank crashed or was killed, and its
//! peers are released with that news.
//!
//! Nothing waits forever on a peer: frames are bounded ([`frame`]), every socket has deadlines
//! or keepalive ([`socket`]), a rank fails within the timeout when rank 0's process is dead,
//! hung or unreachable ([`client`]), and rank 0 stops waiting for ranks that went silent.

mod client;
mod frame;
mod server;
mod socket;

pub(crate) use client::TcpTransport;
pub(crate) use server::TcpServer;
