//! A TCP proxy in front of the test server that can stop forwarding without
//! closing anything: the peer a client talks to is still there (its kernel
//! acknowledges every packet) but never answers again, as a hung server, a
//! stuck pooler or a half-dead network path looks. Used to show that calls
//! on a connection whose peer stopped answering fail in bounded time, and
//! that dropping a handle returns, instead of waiting forever.

#![allow(dead_code, reason = "each test binary uses part of the support code")]

use std::collections::HashSet;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

/// How often a forwarding thread looks at the flags.
const POLL: Duration = Duration::from_millis(20);

/// A loopback proxy to one port (see the module docs).
pub struct StallProxy {
    port: u16,
    flags: Arc<Flags>,
    accept: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Flags {
    /// Forward nothing more, in either direction; keep every socket open.
    stalled: AtomicBool,
    /// The proxy is dropped: every thread ends, every socket closes.
    closed: AtomicBool,
    /// The connections (by the proxy's port towards the server, the
    /// `client_port` the server shows) to cut on the client's side only.
    cuts: Mutex<HashSet<u16>>,
    /// The server's sides of the cut connections, kept open (see
    /// [`StallProxy::cut_client_of`]).
    parked: Mutex<Vec<TcpStream>>,
}

impl StallProxy {
    /// Starts a proxy to `127.0.0.1:target`.
    ///
    /// # Panics
    /// When no loopback port can be bound.
    pub fn to(target: u16) -> Self {
        let listener =
            TcpListener::bind("127.0.0.1:0").expect("bind a loopback port for the proxy");
        let port = listener.local_addr().expect("the proxy's port").port();
        let flags = Arc::new(Flags::default());
        let theirs = Arc::clone(&flags);
        let accept = std::thread::Builder::new()
            .name("stall-proxy".into())
            .spawn(move || {
                for client in listener.incoming() {
                    if theirs.closed.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(client) = client else { continue };
                    let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
                        continue;
                    };
                    let Ok(towards) = server.local_addr().map(|a| a.port()) else {
                        continue;
                    };
                    let (Ok(client2), Ok(server2)) = (client.try_clone(), server.try_clone())
                    else {
                        continue;
                    };
                    for (from, to, server_side) in
                        [(client, server, false), (server2, client2, true)]
                    {
                        let flags = Arc::clone(&theirs);
                        std::thread::spawn(move || pump(from, to, server_side, towards, &flags));
                    }
                }
            })
            .expect("start the proxy thread");
        Self {
            port,
            flags,
            accept: Some(accept),
        }
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// From now on nothing is forwarded, and nothing is closed: every
    /// connection through the proxy hangs.
    pub fn stall(&self) {
        self.flags.stalled.store(true, Ordering::SeqCst);
    }

    /// Cuts the connection whose server session shows `client_port` (in
    /// `pg_stat_activity`) on the client's side only: the client finds its
    /// connection closed, while the server's side stays open and is never
    /// read or written again, as a network cut the server has not noticed
    /// looks (the session goes on with whatever it was sent).
    pub fn cut_client_of(&self, client_port: u16) {
        self.flags
            .cuts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(client_port);
    }
}

impl Drop for StallProxy {
    fn drop(&mut self) {
        self.flags.closed.store(true, Ordering::SeqCst);
        // Wakes the accept loop so that it sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

/// Copies `from` to `to` until either closes, the proxy stalls (then holds
/// both open, forwarding nothing), the connection is cut (then closes the
/// client's side and keeps the server's open) or the proxy is dropped.
/// `from_server` says which side `from` is; `towards` names the connection
/// (see [`StallProxy::cut_client_of`]).
fn pump(mut from: TcpStream, mut to: TcpStream, from_server: bool, towards: u16, flags: &Flags) {
    let _ = from.set_read_timeout(Some(POLL));
    let mut buf = [0u8; 16 * 1024];
    loop {
        if flags.closed.load(Ordering::SeqCst) {
            return;
        }
        let cut = flags
            .cuts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&towards);
        if cut {
            let (client, server) = if from_server { (to, from) } else { (from, to) };
            let _ = client.shutdown(Shutdown::Both);
            flags
                .parked
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(server);
            return;
        }
        if flags.stalled.load(Ordering::SeqCst) {
            std::thread::sleep(POLL);
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => {
                let _ = to.shutdown(Shutdown::Write);
                return;
            }
            // Read just as the proxy stalled: dropped, as a dead path would.
            Ok(_) if flags.stalled.load(Ordering::SeqCst) => {}
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return,
        }
    }
}
