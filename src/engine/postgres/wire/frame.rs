//! The socket and its framing: frontend messages are encoded into one
//! buffer and written together ([`Framed::flush`]), backend messages are
//! read from a buffered socket one at a time ([`Framed::next`]).

use std::io::{Read, Write};
use std::net::TcpStream;
#[cfg(unix)]
use std::os::unix::net::UnixStream;
use std::time::Duration;

use bytes::BytesMut;
use postgres_protocol::message::backend::Message;

use super::error::WireError;

/// How much one read from the socket takes at most.
const READ_CHUNK: usize = 16 * 1024;

/// A connected socket: TCP, or a Unix-domain socket.
#[derive(Debug)]
pub(super) enum Socket {
    Tcp(TcpStream),
    #[cfg(unix)]
    Unix(UnixStream),
}

impl Socket {
    /// Bounds every read and write (`None`: no bound).
    pub(super) fn set_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        match self {
            Self::Tcp(s) => {
                s.set_read_timeout(timeout)?;
                s.set_write_timeout(timeout)
            }
            #[cfg(unix)]
            Self::Unix(s) => {
                s.set_read_timeout(timeout)?;
                s.set_write_timeout(timeout)
            }
        }
    }

    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            #[cfg(unix)]
            Self::Unix(s) => s.read(buf),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match self {
            Self::Tcp(s) => s.write_all(buf),
            #[cfg(unix)]
            Self::Unix(s) => s.write_all(buf),
        }
    }
}

/// A socket with its outgoing and incoming buffers.
pub(super) struct Framed {
    socket: Socket,
    /// Messages encoded and not yet written.
    pub(super) out: BytesMut,
    /// Bytes read and not yet parsed.
    incoming: BytesMut,
    chunk: Box<[u8]>,
}

impl Framed {
    pub(super) fn new(socket: Socket) -> Self {
        Self {
            socket,
            out: BytesMut::with_capacity(8 * 1024),
            incoming: BytesMut::with_capacity(READ_CHUNK),
            chunk: vec![0; READ_CHUNK].into_boxed_slice(),
        }
    }

    pub(super) fn socket(&self) -> &Socket {
        &self.socket
    }

    /// Writes every encoded message, in one write when the socket takes it.
    ///
    /// # Errors
    /// The socket failed (the connection is then unusable).
    pub(super) fn flush(&mut self) -> Result<(), WireError> {
        let written = self.socket.write_all(&self.out);
        self.out.clear();
        written.map_err(WireError::io)
    }

    /// The next message from the server, reading the socket as needed.
    ///
    /// # Errors
    /// The socket failed, the server closed it, or sent a malformed message.
    pub(super) fn next(&mut self) -> Result<Message, WireError> {
        loop {
            match Message::parse(&mut self.incoming) {
                Ok(Some(message)) => return Ok(message),
                Ok(None) => {}
                Err(e) => return Err(WireError::protocol(format!("a malformed message: {e}"))),
            }
            let n = loop {
                match self.socket.read(&mut self.chunk) {
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    other => break other.map_err(WireError::io)?,
                }
            };
            if n == 0 {
                return Err(WireError::closed());
            }
            self.incoming.extend_from_slice(&self.chunk[..n]);
        }
    }
}
