//! What a store URL says: where the data goes (host, port, database, role)
//! and how the connection is secured (`sslmode`, `sslrootcert`, as libpq
//! documents them: <https://www.postgresql.org/docs/current/libpq-ssl.html>).

use std::path::PathBuf;

use idem_store::StoreError;
use tokio_postgres::config::{Host, SslMode as DriverSslMode, TargetSessionAttrs};

/// `sslmode` of a store URL (libpq's names; `allow` is not supported).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// Plain TCP only.
    Disable,
    /// TLS when the server offers it, else plain; the default (libpq's).
    Prefer,
    /// TLS or nothing; the certificate is checked only when `sslrootcert` is
    /// given (then as with `verify-ca`).
    Require,
    /// TLS, with the server's certificate chain checked against the root
    /// certificates; the host name is not.
    VerifyCa,
    /// As `verify-ca`, and the certificate must name the host of the URL.
    VerifyFull,
}

impl SslMode {
    /// The URL spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    fn parse(value: &str) -> Result<SslMode, StoreError> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(StoreError::Config(format!(
                    "sslmode={other} in the PostgreSQL URL is not one of disable, prefer, require, \
                     verify-ca, verify-full"
                )));
            }
        })
    }
}

/// Where the root certificates that check the server's certificate come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootCerts {
    /// The platform's trust store (`sslrootcert=system`, or no `sslrootcert`
    /// with `verify-ca` / `verify-full`).
    System,
    /// A PEM file of one or more certificates (`sslrootcert=PATH`).
    File(PathBuf),
}

/// How much of the server's certificate is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verify {
    /// Nothing: the connection is encrypted, the peer not authenticated.
    Nothing,
    /// The chain up to a root certificate, not the host name.
    Chain,
    /// The chain and the host name.
    Full,
}

/// Where a PostgreSQL store URL points and how it connects. `Display` gives
/// `host:port[,host:port…]/database` (never the password).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Target {
    /// The host (several joined with `,`; a Unix socket directory as its path).
    pub host: String,
    /// The port (of the first host; 5432 when the URL gives none).
    pub port: u16,
    /// Every host with its port (`host:port`), in the URL's order: the order
    /// in which connections try them.
    pub addresses: Vec<String>,
    /// Whether a connection is kept only on a server that accepts writes
    /// (`target_session_attrs=read-write`, libpq's convention: after
    /// connecting, `SHOW transaction_read_only` must answer `off`, else the
    /// next host is tried). A URL naming several hosts gets it unless it says
    /// `target_session_attrs=any`: idem writes on every connection, and a
    /// standby would refuse every write.
    pub read_write: bool,
    /// The database.
    pub database: String,
    /// The role, when the URL names one.
    pub user: Option<String>,
    /// `sslmode` (default `prefer`).
    pub ssl_mode: SslMode,
    /// `sslrootcert`, when given.
    pub root_certs: Option<RootCerts>,
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addresses.join(","), self.database)
    }
}

impl Target {
    /// What `url` says; see [`parse`].
    ///
    /// # Errors
    /// As [`parse`].
    pub fn of_url(url: &str) -> Result<Target, StoreError> {
        parse(url).map(|(_, t)| t)
    }

    /// How much of the server's certificate is checked (libpq: `require`
    /// with a root certificate behaves as `verify-ca`).
    pub(crate) fn verify(&self) -> Verify {
        match (self.ssl_mode, &self.root_certs) {
            (SslMode::VerifyFull, _) => Verify::Full,
            (SslMode::VerifyCa, _) => Verify::Chain,
            (SslMode::Require | SslMode::Prefer, Some(_)) => Verify::Chain,
            _ => Verify::Nothing,
        }
    }

    /// `HOST:PORT` of every host, joined with `,` (for messages).
    pub fn address_list(&self) -> String {
        self.addresses.join(",")
    }

    /// `sslmode=…` and where the root certificates come from, for messages.
    pub fn tls_description(&self) -> String {
        let mut text = format!("sslmode={}", self.ssl_mode.as_str());
        if self.verify() != Verify::Nothing {
            match &self.root_certs {
                Some(RootCerts::File(p)) => {
                    text.push_str(&format!(", root certificates from {}", p.display()));
                }
                _ => text.push_str(", the platform's root certificates"),
            }
        }
        text
    }
}

/// Parses a `postgres://` / `postgresql://` URL: the driver's configuration
/// (with `sslmode` reduced to what the driver knows, `sslrootcert` taken out,
/// and `target_session_attrs=read-write` when the URL names several hosts and
/// no `target_session_attrs`) and the [`Target`].
///
/// # Errors
/// [`StoreError::Config`] when the URL does not parse, names no host or no
/// database (PostgreSQL would otherwise pick the role's own database), gives an
/// unknown `sslmode`, or `sslrootcert=system` with a mode weaker than
/// `verify-full` (libpq refuses that too).
pub fn parse(url: &str) -> Result<(tokio_postgres::Config, Target), StoreError> {
    let url = encode_userinfo(url);
    let url = url.as_str();
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let mut ssl_mode = None;
    let mut root_certs = None;
    let mut session_attrs_given = false;
    let mut kept = Vec::new();
    for pair in query.into_iter().flat_map(|q| q.split('&')) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_encoding::percent_decode_str(value)
            .decode_utf8()
            .map_err(|e| StoreError::Config(format!("invalid PostgreSQL URL: {key}: {e}")))?;
        match key {
            "sslmode" => ssl_mode = Some(SslMode::parse(&value)?),
            "sslrootcert" if value == "system" => root_certs = Some(RootCerts::System),
            "sslrootcert" => root_certs = Some(RootCerts::File(PathBuf::from(value.as_ref()))),
            "target_session_attrs" => {
                session_attrs_given = true;
                kept.push(pair);
            }
            _ => kept.push(pair),
        }
    }
    let ssl_mode = match (ssl_mode, &root_certs) {
        (None, Some(RootCerts::System)) => SslMode::VerifyFull,
        (Some(m), Some(RootCerts::System)) if m != SslMode::VerifyFull => {
            return Err(StoreError::Config(format!(
                "sslrootcert=system needs sslmode=verify-full (or no sslmode), not sslmode={}",
                m.as_str()
            )));
        }
        (m, _) => m.unwrap_or(SslMode::Prefer),
    };
    let driver_url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    let mut cfg: tokio_postgres::Config = driver_url
        .parse()
        .map_err(|e| StoreError::Config(format!("invalid PostgreSQL URL: {e}")))?;
    cfg.ssl_mode(match ssl_mode {
        SslMode::Disable => DriverSslMode::Disable,
        SslMode::Prefer => DriverSslMode::Prefer,
        _ => DriverSslMode::Require,
    });
    let hosts: Vec<String> = cfg
        .get_hosts()
        .iter()
        .map(|h| match h {
            Host::Tcp(name) => name.clone(),
            #[cfg(unix)]
            Host::Unix(path) => path.display().to_string(),
        })
        .collect();
    // Whatever the URL's shape, no part of a password reaches a host name
    // (which is logged and named in errors).
    if hosts.iter().any(|h| h.contains('@')) {
        return Err(StoreError::Config(
            "a host of the PostgreSQL URL contains '@': write '@' in the user name or password \
             as %40"
                .into(),
        ));
    }
    if hosts.is_empty() {
        return Err(StoreError::Config(
            "the PostgreSQL URL names no host: postgres://USER@HOST:PORT/DATABASE".into(),
        ));
    }
    let database = match cfg.get_dbname() {
        Some(db) if !db.is_empty() => db.to_owned(),
        _ => {
            return Err(StoreError::Config(format!(
                "the PostgreSQL URL names no database: add it after the host \
                 (postgres://USER@{}:{}/DATABASE); PostgreSQL would otherwise use the \
                 database named after the role",
                hosts.join(","),
                cfg.get_ports().first().copied().unwrap_or(5432)
            )));
        }
    };
    if hosts.len() > 1 && !session_attrs_given {
        cfg.target_session_attrs(TargetSessionAttrs::ReadWrite);
    }
    // The driver's rule: one port for every host, or one port per host.
    let ports = cfg.get_ports();
    let addresses = hosts
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let port = match ports.len() {
                0 => 5432,
                1 => ports[0],
                _ => ports.get(i).copied().unwrap_or(5432),
            };
            format!("{h}:{port}")
        })
        .collect();
    let target = Target {
        host: hosts.join(","),
        port: cfg.get_ports().first().copied().unwrap_or(5432),
        addresses,
        read_write: cfg.get_target_session_attrs() == TargetSessionAttrs::ReadWrite,
        database,
        user: cfg.get_user().map(str::to_owned),
        ssl_mode,
        root_certs,
    };
    Ok((cfg, target))
}

/// Characters left as they are in an encoded user name or password (RFC
/// 3986 `unreserved`); every other byte is percent-encoded.
const USERINFO: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// `url` with its user name and password percent-encoded, so that the
/// driver, which ends the user information at the *first* `@`, reads them
/// whole: a password such as `s3cr@t`, `a:b` or `p/w?x` written unencoded
/// would otherwise leave its tail in the host name, which is logged.
///
/// The user information ends at the last `@` that is followed by a host
/// list and the database path (`HOST[:PORT][,…]/`), as in RFC 3986 the
/// authority's user information ends at its last `@`; an `@` in a query
/// value (`application_name=a@b`) is not taken for it. What is already
/// percent-encoded stays as it means (`%40` is `@`). A URL without
/// `scheme://` or without such an `@` is returned as it is.
fn encode_userinfo(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let is_host = |c: char| c.is_ascii_alphanumeric() || ".-_:,[]%".contains(c);
    let at = rest.rmatch_indices('@').map(|(i, _)| i).find(|&i| {
        let after = &rest[i + 1..];
        let host_len = after.find(|c: char| !is_host(c)).unwrap_or(after.len());
        host_len > 0 && after[host_len..].starts_with('/')
    });
    let Some(at) = at else {
        return url.to_owned();
    };
    let (userinfo, hosts) = (&rest[..at], &rest[at + 1..]);
    let encode = |part: &str| {
        let plain = percent_encoding::percent_decode_str(part).collect::<Vec<u8>>();
        percent_encoding::percent_encode(&plain, USERINFO).to_string()
    };
    let userinfo = match userinfo.split_once(':') {
        Some((user, password)) => format!("{}:{}", encode(user), encode(password)),
        None => encode(userinfo),
    };
    format!("{scheme}://{userinfo}@{hosts}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Passwords written unencoded with `@`, `:`, `/`, `?` or already
    /// encoded (`%40`): the driver gets the whole password, the host is the
    /// host, and nothing of the password is in the target's description.
    #[test]
    fn a_password_of_any_shape_stays_out_of_the_host() {
        for (url, password) in [
            ("postgres://u:s3cr@t@db.example:5433/app", "s3cr@t"),
            ("postgres://u:s3cr@t@db.example/app", "s3cr@t"),
            ("postgres://u:a:b@db.example/app", "a:b"),
            ("postgres://u:s3cr%40t@db.example/app", "s3cr@t"),
            (
                "postgres://u:p@ss:w0rd@db.example/app?sslmode=disable",
                "p@ss:w0rd",
            ),
            ("postgres://u:p/w?x@y@db.example/app", "p/w?x@y"),
            ("postgres://u:100%@db.example/app", "100%"),
            (
                "postgres://u:s3cr@t@db.example/app?application_name=a@b",
                "s3cr@t",
            ),
            ("postgres://u:s@t@h1:5432,h2:5433/app", "s@t"),
        ] {
            let (cfg, t) = parse(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(cfg.get_password(), Some(password.as_bytes()), "{url}");
            assert_eq!(t.user.as_deref(), Some("u"), "{url}");
            for shown in [t.to_string(), t.host.clone(), t.tls_description()] {
                assert!(
                    !shown.contains('@') && !shown.contains("s3cr"),
                    "{url}: {shown}"
                );
            }
        }
        let t = Target::of_url("postgres://u:s@t@h1:5432,h2:5433/app").unwrap();
        assert_eq!(t.host, "h1,h2");
        let (cfg, _) = parse("postgres://u@h/db?application_name=a@b").unwrap();
        assert_eq!(cfg.get_application_name(), Some("a@b"));
    }

    /// Several hosts: each with its own port (or the one port of all), and
    /// `target_session_attrs=read-write` unless the URL says otherwise.
    #[test]
    fn several_hosts_look_for_the_primary() {
        let (cfg, t) =
            parse("postgres://u@10.0.0.1:5433,10.0.0.2:5434/app?sslmode=disable").unwrap();
        assert_eq!(t.to_string(), "10.0.0.1:5433,10.0.0.2:5434/app");
        assert_eq!(t.address_list(), "10.0.0.1:5433,10.0.0.2:5434");
        assert!(t.read_write);
        assert_eq!(
            cfg.get_target_session_attrs(),
            TargetSessionAttrs::ReadWrite
        );
        let (cfg, t) = parse("postgres://u@a,b:6432/app?target_session_attrs=any").unwrap();
        assert_eq!(t.address_list(), "a:5432,b:6432");
        assert!(!t.read_write);
        assert_eq!(cfg.get_target_session_attrs(), TargetSessionAttrs::Any);
        let (_, t) = parse("postgres://u@a/app?target_session_attrs=read-write").unwrap();
        assert!(t.read_write);
        let (cfg, t) = parse("postgres://u@a:5433/app").unwrap();
        assert!(!t.read_write);
        assert_eq!(cfg.get_target_session_attrs(), TargetSessionAttrs::Any);
        assert_eq!(t.to_string(), "a:5433/app");
    }

    #[test]
    fn tls_parameters_are_read_and_taken_out() {
        let (cfg, t) = parse(
            "postgresql://u:secret@db.example:6432/app?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x",
        )
        .unwrap();
        assert_eq!(t.to_string(), "db.example:6432/app");
        assert_eq!(t.user.as_deref(), Some("u"));
        assert_eq!(t.ssl_mode, SslMode::VerifyFull);
        assert_eq!(t.root_certs, Some(RootCerts::File("/etc/ca.pem".into())));
        assert_eq!(t.verify(), Verify::Full);
        assert_eq!(cfg.get_ssl_mode(), DriverSslMode::Require);
        assert_eq!(cfg.get_application_name(), Some("x"));
        assert!(!t.tls_description().contains("secret"));
    }

    #[test]
    fn libpq_defaults_and_require_with_a_root_certificate() {
        let (cfg, t) = parse("postgres://u@h/db").unwrap();
        assert_eq!((t.ssl_mode, t.verify()), (SslMode::Prefer, Verify::Nothing));
        assert_eq!(cfg.get_ssl_mode(), DriverSslMode::Prefer);
        assert_eq!(t.port, 5432);
        let t = Target::of_url("postgres://u@h/db?sslmode=require&sslrootcert=/ca.pem").unwrap();
        assert_eq!(t.verify(), Verify::Chain);
        let t = Target::of_url("postgres://u@h/db?sslmode=require").unwrap();
        assert_eq!(t.verify(), Verify::Nothing);
        let t = Target::of_url("postgres://u@h/db?sslrootcert=system").unwrap();
        assert_eq!(t.ssl_mode, SslMode::VerifyFull);
    }

    #[test]
    fn refusals_say_what_is_wrong() {
        let e = Target::of_url("postgres://postgres@127.0.0.1:5432").unwrap_err();
        assert!(
            e.to_string().contains(
                "the PostgreSQL URL names no database: add it after the host (postgres://USER@127.0.0.1:5432/DATABASE)"
            ),
            "{e}"
        );
        assert!(matches!(e, StoreError::Config(_)));
        let e = Target::of_url("postgres://postgres@127.0.0.1:5432/").unwrap_err();
        assert!(e.to_string().contains("names no database"), "{e}");
        let e = Target::of_url("postgres://h/db?sslmode=allow").unwrap_err();
        assert!(
            e.to_string()
                .contains("sslmode=allow in the PostgreSQL URL is not one of disable, prefer"),
            "{e}"
        );
        let e = Target::of_url("postgres://h/db?sslmode=require&sslrootcert=system").unwrap_err();
        assert!(
            e.to_string()
                .contains("sslrootcert=system needs sslmode=verify-full"),
            "{e}"
        );
    }
}
