//! The socket and its framing: frontend messages are encoded into one
//! buffer and written together ([`Framed::flush`]), backend messages are
//! read from a buffered socket one at a time ([`Framed::next`]).

use std::io::{Read, Write};
use std::net::TcpStream;
#[cfg(unix)]
use std::os::unix::net::UnixStream;
use std::time::Duration;

use bytes::BytesMut;
use postgres_protocol::message::backend::{Header, Message};

use super::error::WireError;

/// How much one read from the socket takes at most.
const READ_CHUNK: usize = 16 * 1024;

/// The longest message of a kind that is always short (every kind but those
/// [`may_be_long`]): as `libpq`, a longer one is taken for a corrupt stream.
const SHORT_MESSAGE: usize = 30_000;

/// The longest message of any kind: a row of the engine is far smaller, and
/// the server's own limit on one value is 1 GB.
pub(super) const LONG_MESSAGE: usize = 1 << 30;

/// Whether a message of kind `tag` may be long: rows and their description,
/// a statement's parameter types, the server's reports, copy data and
/// notifications.
fn may_be_long(tag: u8) -> bool {
    matches!(tag, b'D' | b'T' | b't' | b'E' | b'N' | b'A' | b'd' | b'V')
}

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
    /// A message is parsed once it is read whole; until then the buffer grows
    /// only with what arrived, never by what its header claims (a corrupt
    /// length would otherwise have the client reserve gigabytes at once),
    /// and a length beyond what its kind may have is refused at its header.
    ///
    /// # Errors
    /// The socket failed, the server closed it, or sent a malformed message;
    /// or no byte came within the socket's read bound ([`WireError::is_quiet`]:
    /// what was read so far is kept, and the next call goes on).
    pub(super) fn next(&mut self) -> Result<Message, WireError> {
        loop {
            if let Some(message) = self.parse()? {
                return Ok(message);
            }
            let n = loop {
                match self.socket.read(&mut self.chunk) {
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    // The socket's read bound passed (see `Socket::set_timeout`).
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) =>
                    {
                        return Err(WireError::quiet());
                    }
                    other => break other.map_err(WireError::io)?,
                }
            };
            if n == 0 {
                return Err(WireError::closed());
            }
            self.incoming.extend_from_slice(&self.chunk[..n]);
        }
    }

    /// The first message of what was read, once it is there whole.
    fn parse(&mut self) -> Result<Option<Message>, WireError> {
        let header = match Header::parse(&self.incoming) {
            Ok(Some(header)) => header,
            Ok(None) => return Ok(None),
            Err(e) => return Err(WireError::protocol(format!("a malformed message: {e}"))),
        };
        // `Header::parse` refused a length below 4 (and so any beyond 2 GiB).
        let len = usize::try_from(header.len()).unwrap_or(usize::MAX);
        let limit = if may_be_long(header.tag()) {
            LONG_MESSAGE
        } else {
            SHORT_MESSAGE
        };
        if len > limit {
            return Err(WireError::protocol(format!(
                "a message of kind {:?} claims {len} bytes, more than its kind may have ({limit}): a corrupt stream",
                char::from(header.tag())
            )));
        }
        if self.incoming.len() <= len {
            return Ok(None);
        }
        Message::parse(&mut self.incoming)
            .map_err(|e| WireError::protocol(format!("a malformed message: {e}")))
    }

    /// How many bytes the incoming buffer holds room for.
    #[cfg(test)]
    pub(super) fn buffered_capacity(&self) -> usize {
        self.incoming.capacity()
    }
}
