//! Deadlines on the rendezvous's sockets.
//!
//! A process that dies has its connections closed by the kernel, and its peers see it at
//! once. A host that dies, hangs or drops off the network sends nothing: without deadlines a
//! read would wait forever. So every connection gets
//!
//! - read and write timeouts where something is expected soon (a call's answer), and
//! - TCP keepalive, and on Linux a bound on unacknowledged data (`TCP_USER_TIMEOUT`), where a
//!   connection may rightly stay silent for long (a lifeline, an idle pooled connection, a
//!   call the server holds while peers arrive): the kernel then finds a dead peer by itself.

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// How long past the timeout a call's answer may take: the server holds a collective for up to
/// the timeout, then answers (with the parts, or with the error naming who did not arrive).
pub(super) const ANSWER_SLACK: Duration = Duration::from_secs(3);
/// Keepalive probes sent before a silent peer is declared dead.
const PROBES: u32 = 3;

/// Marks `stream` dead when its peer has not answered for about half of `within` (keepalive
/// probes when idle; unacknowledged data when sending).
pub(super) fn detect_dead_peer(stream: &TcpStream, within: Duration) -> io::Result<()> {
    set(stream, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    // First probe after one interval of silence, then PROBES more: about (1 + PROBES)
    // intervals in all, whole seconds for the kernel.
    let interval = (within.as_secs() / (2 * (1 + PROBES as u64))).clamp(1, 60) as libc::c_int;
    #[cfg(target_os = "linux")]
    {
        set(stream, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, interval)?;
        set(stream, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, interval)?;
        set(
            stream,
            libc::IPPROTO_TCP,
            libc::TCP_KEEPCNT,
            PROBES as libc::c_int,
        )?;
        let unacked = (interval as u32 * (1 + PROBES)).saturating_mul(1000);
        set(
            stream,
            libc::IPPROTO_TCP,
            libc::TCP_USER_TIMEOUT,
            unacked as libc::c_int,
        )?;
    }
    #[cfg(not(target_os = "linux"))]
    let _ = interval;
    Ok(())
}

fn set(
    stream: &TcpStream,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: a valid socket, and a pointer to an int that outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    match rc {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Read and write timeouts of `deadline` (zero is no timeout for the OS: at least 1 ms).
pub(super) fn set_deadlines(stream: &TcpStream, deadline: Duration) -> io::Result<()> {
    let deadline = Some(deadline.max(Duration::from_millis(1)));
    stream.set_read_timeout(deadline)?;
    stream.set_write_timeout(deadline)
}

/// Whether `error` is a read or write that ran past its timeout.
pub(super) fn timed_out(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// One attempt to connect to `address` (each of its resolved addresses in turn), waiting at
/// most until `deadline` (the OS's own connect timeout is minutes).
pub(super) fn connect(address: &str, deadline: Instant) -> io::Result<TcpStream> {
    let addresses: Vec<SocketAddr> = address.to_socket_addrs()?.collect();
    let mut last = io::Error::new(
        io::ErrorKind::NotFound,
        format!("{address} resolves to no address"),
    );
    for socket_address in addresses {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "connection timed out",
            ));
        }
        match TcpStream::connect_timeout(&socket_address, left) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = e,
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn get(stream: &TcpStream, level: libc::c_int, name: libc::c_int) -> libc::c_int {
        let mut value: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: a valid socket, and pointers to an int and its length.
        let rc = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                level,
                name,
                (&mut value as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        value
    }

    #[test]
    fn keepalive_is_scaled_to_the_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        assert_eq!(get(&stream, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 0);
        detect_dead_peer(&stream, Duration::from_secs(24)).unwrap();
        assert_ne!(get(&stream, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 0);
        #[cfg(target_os = "linux")]
        {
            assert_eq!(get(&stream, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 3);
            assert_eq!(get(&stream, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 3);
            assert_eq!(get(&stream, libc::IPPROTO_TCP, libc::TCP_KEEPCNT), 3);
            assert_eq!(
                get(&stream, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT),
                12_000
            );
        }
        // Short timeouts probe every second; long ones at most every minute.
        detect_dead_peer(&stream, Duration::from_millis(300)).unwrap();
        #[cfg(target_os = "linux")]
        assert_eq!(get(&stream, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 1);
        detect_dead_peer(&stream, Duration::from_secs(100_000)).unwrap();
        #[cfg(target_os = "linux")]
        assert_eq!(get(&stream, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 60);
    }

    #[test]
    fn a_connect_attempt_ends_by_its_deadline() {
        // Nothing listens on a port just released: refused at once, well before the deadline.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let start = Instant::now();
        let error = connect(
            &format!("127.0.0.1:{port}"),
            start + Duration::from_secs(30),
        )
        .unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::ConnectionRefused);
        assert!(start.elapsed() < Duration::from_secs(5));
        // A deadline already past fails without trying.
        let error = connect(&format!("127.0.0.1:{port}"), Instant::now()).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
    }
}
