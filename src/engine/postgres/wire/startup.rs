//! Opening a session: the settings of a parsed `tokio_postgres::Config`
//! (hosts and Unix-socket directories, ports, user, password, database,
//! options, application name, connect timeout, TCP user timeout, keepalives,
//! target session attributes, random host order), the startup message, and authentication (cleartext, MD5,
//! SCRAM-SHA-256).
//!
//! **No TLS.** The crate connects without TLS, as the `NoTls` connector of
//! `tokio_postgres` the rest of the engine uses: `sslmode=prefer` (the
//! default) connects in the clear, `sslmode=require` is refused before
//! anything is sent, and SCRAM runs without channel binding (refused when the
//! settings require it).

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use postgres_protocol::authentication::{md5_hash, sasl};
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use tokio_postgres::Config;
use tokio_postgres::config::{ChannelBinding, Host, SslMode, TargetSessionAttrs};

use super::error::WireError;
use super::frame::{Framed, Socket};

/// The settings this client cannot honour, refused before connecting.
fn refuse_unsupported(config: &Config) -> Result<(), WireError> {
    match config.get_ssl_mode() {
        SslMode::Disable | SslMode::Prefer => {}
        _ => {
            return Err(WireError::config(
                "sslmode=require: TLS is not supported by this build (connect without TLS, \
                 or through a local TLS tunnel)",
            ));
        }
    }
    if config.get_ssl_negotiation() == tokio_postgres::config::SslNegotiation::Direct {
        return Err(WireError::config(
            "sslnegotiation=direct needs TLS, which this build does not support",
        ));
    }
    Ok(())
}

/// The hosts to try, in order, with their ports: each is a TCP host name or
/// address (`hostaddr` overriding `host`) or a Unix-socket directory.
fn targets(config: &Config) -> Result<Vec<(Host, u16)>, WireError> {
    let hosts = config.get_hosts();
    let addrs = config.get_hostaddrs();
    if hosts.is_empty() && addrs.is_empty() {
        return Err(WireError::config("both host and hostaddr are missing"));
    }
    if !hosts.is_empty() && !addrs.is_empty() && hosts.len() != addrs.len() {
        return Err(WireError::config(format!(
            "{} hosts but {} hostaddrs",
            hosts.len(),
            addrs.len()
        )));
    }
    let n = hosts.len().max(addrs.len());
    let ports = config.get_ports();
    if ports.len() > 1 && ports.len() != n {
        return Err(WireError::config(format!(
            "{} ports for {n} hosts",
            ports.len()
        )));
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
        let host = match (addrs.get(i), hosts.get(i)) {
            (Some(addr), _) => Host::Tcp(addr.to_string()),
            (None, Some(host)) => host.clone(),
            (None, None) => continue,
        };
        out.push((host, port));
    }
    if config.get_load_balance_hosts() == tokio_postgres::config::LoadBalanceHosts::Random {
        // Start at a host picked by the clock: spreads sessions, no RNG needed.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos() as usize);
        let len = out.len().max(1);
        out.rotate_left(nanos % len);
    }
    Ok(out)
}

/// Opens a session to the first host of `config` that accepts one; the
/// last host's error otherwise.
///
/// # Errors
/// [`WireError`]: settings this client cannot honour, no host reachable,
/// authentication refused, or the server's refusal of the session.
pub(super) fn open(config: &Config) -> Result<Framed, WireError> {
    refuse_unsupported(config)?;
    let user = match config.get_user() {
        Some(user) => user.to_owned(),
        None => whoami::username().map_err(|e| WireError::io(e.into()))?,
    };
    let mut last = None;
    for (host, port) in targets(config)? {
        match open_one(config, &user, &host, port) {
            Ok(framed) => return Ok(framed),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| WireError::config("no host to connect to")))
}

/// One host: the socket, then the session on it (the connect timeout bounds
/// each read and write until the session is ready).
fn open_one(config: &Config, user: &str, host: &Host, port: u16) -> Result<Framed, WireError> {
    let timeout = config.get_connect_timeout().copied();
    let socket = match host {
        Host::Tcp(name) => tcp(config, name, port, timeout)?,
        #[cfg(unix)]
        Host::Unix(dir) => {
            let path = dir.join(format!(".s.PGSQL.{port}"));
            Socket::Unix(std::os::unix::net::UnixStream::connect(&path).map_err(WireError::io)?)
        }
        #[cfg(not(unix))]
        Host::Unix(_) => return Err(WireError::config("Unix sockets need a Unix host")),
    };
    socket.set_timeout(timeout).map_err(WireError::io)?;
    let mut framed = Framed::new(socket);
    startup(&mut framed, config, user)?;
    authenticate(&mut framed, config, user)?;
    ready(&mut framed)?;
    check_session_attrs(&mut framed, config.get_target_session_attrs())?;
    framed.socket().set_timeout(None).map_err(WireError::io)?;
    Ok(framed)
}

/// A TCP connection to one of `name`'s addresses (the first that answers),
/// without Nagle's delay (a pipeline is written whole), with keepalives as
/// configured.
fn tcp(
    config: &Config,
    name: &str,
    port: u16,
    timeout: Option<Duration>,
) -> Result<Socket, WireError> {
    let addrs: Vec<SocketAddr> = (name, port)
        .to_socket_addrs()
        .map_err(WireError::io)?
        .collect();
    let mut last = None;
    for addr in addrs {
        let stream = match timeout {
            Some(timeout) => TcpStream::connect_timeout(&addr, timeout),
            None => TcpStream::connect(addr),
        };
        match stream {
            Ok(stream) => {
                stream.set_nodelay(true).map_err(WireError::io)?;
                #[cfg(any(target_os = "linux", target_os = "android"))]
                if let Some(timeout) = config.get_tcp_user_timeout() {
                    socket2::SockRef::from(&stream)
                        .set_tcp_user_timeout(Some(*timeout))
                        .map_err(WireError::io)?;
                }
                if config.get_keepalives() {
                    let mut keepalive =
                        socket2::TcpKeepalive::new().with_time(config.get_keepalives_idle());
                    if let Some(interval) = config.get_keepalives_interval() {
                        keepalive = keepalive.with_interval(interval);
                    }
                    #[cfg(not(any(target_os = "windows", target_os = "openbsd")))]
                    if let Some(retries) = config.get_keepalives_retries() {
                        keepalive = keepalive.with_retries(retries);
                    }
                    socket2::SockRef::from(&stream)
                        .set_tcp_keepalive(&keepalive)
                        .map_err(WireError::io)?;
                }
                return Ok(Socket::Tcp(stream));
            }
            Err(e) => last = Some(e),
        }
    }
    Err(WireError::io(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "could not resolve any addresses",
        )
    })))
}

fn startup(framed: &mut Framed, config: &Config, user: &str) -> Result<(), WireError> {
    let mut params = vec![("client_encoding", "UTF8"), ("user", user)];
    if let Some(dbname) = config.get_dbname() {
        params.push(("database", dbname));
    }
    if let Some(options) = config.get_options() {
        params.push(("options", options));
    }
    if let Some(name) = config.get_application_name() {
        params.push(("application_name", name));
    }
    frontend::startup_message(params, &mut framed.out)
        .map_err(|e| WireError::config(format!("a startup parameter: {e}")))?;
    framed.flush()
}

/// The password, required once the server asks for one.
fn password(config: &Config) -> Result<&[u8], WireError> {
    config
        .get_password()
        .ok_or_else(|| WireError::config("the server asks for a password and none is set"))
}

fn no_channel_binding_required(config: &Config) -> Result<(), WireError> {
    if config.get_channel_binding() == ChannelBinding::Require {
        return Err(WireError::config(
            "channel_binding=require needs TLS, which this build does not support",
        ));
    }
    Ok(())
}

/// Answers the server's authentication requests until it accepts (or
/// refuses: its error, e.g. SQLSTATE `28P01` for a wrong password).
fn authenticate(framed: &mut Framed, config: &Config, user: &str) -> Result<(), WireError> {
    match framed.next()? {
        Message::AuthenticationOk => {
            no_channel_binding_required(config)?;
            return Ok(());
        }
        Message::AuthenticationCleartextPassword => {
            no_channel_binding_required(config)?;
            frontend::password_message(password(config)?, &mut framed.out)
                .map_err(|e| WireError::config(format!("the password: {e}")))?;
        }
        Message::AuthenticationMd5Password(body) => {
            no_channel_binding_required(config)?;
            let hash = md5_hash(user.as_bytes(), password(config)?, body.salt());
            frontend::password_message(hash.as_bytes(), &mut framed.out)
                .map_err(|e| WireError::config(format!("the password: {e}")))?;
        }
        Message::AuthenticationSasl(body) => {
            use fallible_iterator::FallibleIterator;
            let mut mechanisms = body.mechanisms();
            let mut scram = false;
            while let Some(mechanism) = mechanisms.next().map_err(WireError::io)? {
                scram |= mechanism == sasl::SCRAM_SHA_256;
            }
            if !scram {
                return Err(WireError::config(
                    "the server offers no SASL mechanism this client supports (SCRAM-SHA-256)",
                ));
            }
            no_channel_binding_required(config)?;
            return scram_sha_256(framed, password(config)?);
        }
        Message::ErrorResponse(body) => return Err(WireError::from_response(&body)),
        _ => {
            return Err(WireError::config(
                "the server asks for an authentication method this client does not support",
            ));
        }
    }
    framed.flush()?;
    match framed.next()? {
        Message::AuthenticationOk => Ok(()),
        Message::ErrorResponse(body) => Err(WireError::from_response(&body)),
        _ => Err(WireError::protocol("unexpected reply to a password")),
    }
}

/// SCRAM-SHA-256 without channel binding (no TLS).
fn scram_sha_256(framed: &mut Framed, password: &[u8]) -> Result<(), WireError> {
    let mut scram = sasl::ScramSha256::new(password, sasl::ChannelBinding::unsupported());
    frontend::sasl_initial_response(sasl::SCRAM_SHA_256, scram.message(), &mut framed.out)
        .map_err(WireError::io)?;
    framed.flush()?;
    match framed.next()? {
        Message::AuthenticationSaslContinue(body) => {
            scram.update(body.data()).map_err(WireError::io)?;
        }
        Message::ErrorResponse(body) => return Err(WireError::from_response(&body)),
        _ => return Err(WireError::protocol("unexpected SASL message")),
    }
    frontend::sasl_response(scram.message(), &mut framed.out).map_err(WireError::io)?;
    framed.flush()?;
    match framed.next()? {
        Message::AuthenticationSaslFinal(body) => {
            scram.finish(body.data()).map_err(WireError::io)?;
        }
        Message::ErrorResponse(body) => return Err(WireError::from_response(&body)),
        _ => return Err(WireError::protocol("unexpected SASL message")),
    }
    match framed.next()? {
        Message::AuthenticationOk => Ok(()),
        Message::ErrorResponse(body) => Err(WireError::from_response(&body)),
        _ => Err(WireError::protocol("unexpected message after SASL")),
    }
}

/// Reads the session's parameters and key up to its first `ReadyForQuery`.
fn ready(framed: &mut Framed) -> Result<(), WireError> {
    loop {
        match framed.next()? {
            Message::ReadyForQuery(_) => return Ok(()),
            Message::ErrorResponse(body) => return Err(WireError::from_response(&body)),
            Message::BackendKeyData(_)
            | Message::ParameterStatus(_)
            | Message::NoticeResponse(_) => {}
            _ => return Err(WireError::protocol("unexpected message during startup")),
        }
    }
}

/// Whether the session is what `target_session_attrs` asks for (read-write
/// or read-only); an error moves on to the next host.
fn check_session_attrs(framed: &mut Framed, attrs: TargetSessionAttrs) -> Result<(), WireError> {
    let want_read_only = match attrs {
        TargetSessionAttrs::ReadWrite => false,
        TargetSessionAttrs::ReadOnly => true,
        _ => return Ok(()),
    };
    frontend::query("SHOW transaction_read_only", &mut framed.out).map_err(WireError::io)?;
    framed.flush()?;
    let mut read_only = None;
    let mut error = None;
    loop {
        match framed.next()? {
            Message::DataRow(body) => {
                use fallible_iterator::FallibleIterator;
                let buffer = body.buffer();
                let mut ranges = body.ranges();
                if let Ok(Some(Some(range))) = ranges.next() {
                    read_only = Some(buffer.get(range) == Some(b"on".as_slice()));
                }
            }
            Message::ErrorResponse(body) => error = Some(WireError::from_response(&body)),
            Message::ReadyForQuery(_) => break,
            _ => {}
        }
    }
    if let Some(error) = error {
        return Err(error);
    }
    if read_only == Some(want_read_only) {
        Ok(())
    } else {
        Err(WireError::config(format!(
            "the server's session is not {} (target_session_attrs)",
            if want_read_only {
                "read-only"
            } else {
                "read-write"
            }
        )))
    }
}
