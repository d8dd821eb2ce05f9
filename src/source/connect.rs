//! The NATS connection: where it goes and how it logs in ([`NatsAccess`], built from the "NATS" settings), the
//! client connected with it ([`connect`]), and how its failures are told ([`ConnectionLog`]).
//!
//! Every file a setting names is read and checked once, at start, and what it holds is kept in memory: the client
//! would read TLS files again at each connect, and with retries on the first connect a missing or malformed file
//! would retry forever instead of stopping the start. So a rotated file takes a restart. Credentials in the URL
//! (`nats://user:password@host`, `nats://token@host`) are taken out of it and given to the client as a login: the
//! client ignores a URL's userinfo, and it then never sees them in an address it could log. No error or log line
//! holds a secret: errors name the setting (its flag; [`AccessError`]) and the file, never what it holds.

use std::collections::HashMap;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use async_nats::rustls::pki_types::pem::PemObject;
use async_nats::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use async_nats::rustls::{self, ClientConfig, RootCertStore};
use async_nats::{ClientError, ConnectErrorKind, ConnectOptions, Event, ServerAddr, ServerError};
use nkeys::{KeyPair, KeyPairType};

use super::settings::{NatsSettings, redact_userinfo};
use crate::setting::Secret;

/// The largest file a NATS setting may name: creds files, seeds and certificate chains are a few KiB, so a larger
/// one is the wrong file (or a device that never ends).
const MAX_FILE_BYTES: u64 = 1 << 20;

/// How often a connection failure of one kind is logged at most ([`ConnectionLog`]).
pub const FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(30);

/// A NATS setting that cannot be used: `flag` is its long flag (`nats-creds-file`), `reason` says why without
/// anything the setting or its file holds.
#[derive(Debug)]
pub struct AccessError {
    pub flag: &'static str,
    pub reason: String,
}

impl fmt::Display for AccessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid value for {}: {}",
            setting(self.flag),
            self.reason
        )
    }
}

impl std::error::Error for AccessError {}

/// `--flag (HISTORY_VIEW_FLAG)`: every NATS setting's variable is its flag in upper snake case with the prefix
/// (`src/config/tests.rs` pins that).
fn setting(flag: &str) -> String {
    format!(
        "--{flag} (HISTORY_VIEW_{})",
        flag.to_ascii_uppercase().replace('-', "_")
    )
}

fn error(flag: &'static str, reason: impl Into<String>) -> AccessError {
    AccessError {
        flag,
        reason: reason.into(),
    }
}

/// How the worker logs in to NATS: at most one method.
enum Login {
    Anonymous,
    UserAndPassword {
        user: String,
        password: Secret,
    },
    Token(Secret),
    /// A user NKey's seed (checked to be one).
    NKey(Secret),
    /// A creds file's user JWT and the key pair of its seed, which signs the server's nonce.
    Creds {
        jwt: String,
        key_pair: Arc<KeyPair>,
    },
}

impl Login {
    /// The method's name, for the start-up log line.
    fn name(&self) -> &'static str {
        match self {
            Login::Anonymous => "none",
            Login::UserAndPassword { .. } => "user and password",
            Login::Token(_) => "token",
            Login::NKey(_) => "nkey",
            Login::Creds { .. } => "creds file",
        }
    }
}

/// The NATS servers, the login and the TLS setup, checked and in memory: what the client is given.
pub struct NatsAccess {
    /// The servers of `--nats-url`, without the credentials their URLs held.
    servers: Vec<ServerAddr>,
    /// `--nats-url` with its credentials replaced by `***`, for messages.
    display: String,
    login: Login,
    /// The TLS setup built from the TLS files; `None`: TLS only as the URL (`tls://`) or the server asks for it,
    /// with the system's CA certificates.
    tls: Option<ClientConfig>,
}

impl fmt::Debug for NatsAccess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsAccess")
            .field("servers", &self.display)
            .field("login", &self.login.name())
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl NatsAccess {
    /// Reads and checks every NATS setting that names a file, and the URL's credentials.
    ///
    /// # Errors
    /// The first setting that cannot be used: an address that is no NATS server, two login methods, half of a
    /// pair (a user without a password file, a certificate without its key), a file missing, unreadable, empty or
    /// not what the setting needs.
    pub fn from_settings(settings: &NatsSettings) -> Result<Self, AccessError> {
        let (servers, url_login) =
            parse_servers(settings.url.expose()).map_err(|reason| error("nats-url", reason))?;
        let creds = given(&settings.creds_file);
        let nkey = given(&settings.nkey_seed_file);
        let token = given(&settings.token_file);
        let user = settings.user.as_deref().filter(|user| !user.is_empty());
        let password = given(&settings.password_file);

        // The pairs first, then the count of methods, so that a half pair is named as such.
        match (user, password) {
            (Some(_), None) => {
                return Err(error(
                    "nats-user",
                    format!("needs {} too", setting("nats-password-file")),
                ));
            }
            (None, Some(_)) => {
                return Err(error(
                    "nats-password-file",
                    format!("needs {} too", setting("nats-user")),
                ));
            }
            _ => {}
        }
        let methods: Vec<&'static str> = [
            (url_login.is_some(), "nats-url"),
            (creds.is_some(), "nats-creds-file"),
            (nkey.is_some(), "nats-nkey-seed-file"),
            (token.is_some(), "nats-token-file"),
            (user.is_some(), "nats-user"),
        ]
        .into_iter()
        .filter_map(|(set, flag)| set.then_some(flag))
        .collect();
        if let [first, second, ..] = methods[..] {
            let what = |flag: &str| match flag {
                "nats-url" => format!("credentials in {}", setting(flag)),
                "nats-user" => format!("{} with a password file", setting(flag)),
                _ => setting(flag),
            };
            return Err(error(
                second,
                format!(
                    "{} is a second way to log in to NATS, after {}: set one",
                    what(second),
                    what(first)
                ),
            ));
        }

        let login = if let Some(login) = url_login {
            login
        } else if let Some(path) = creds {
            read_creds(path)?
        } else if let Some(path) = nkey {
            read_seed(path)?
        } else if let Some(path) = token {
            Login::Token(Secret::new(read_line("nats-token-file", path, "token")?))
        } else if let (Some(user), Some(path)) = (user, password) {
            Login::UserAndPassword {
                user: user.to_owned(),
                password: Secret::new(read_line("nats-password-file", path, "password")?),
            }
        } else {
            Login::Anonymous
        };
        Ok(Self {
            servers,
            display: redact_userinfo(settings.url.expose()),
            login,
            tls: tls_config(settings)?,
        })
    }

    /// Whether TLS is required whatever the URL says: any TLS setting requires it.
    fn requires_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// `options` with the login and the TLS setup.
    pub fn apply(&self, options: ConnectOptions) -> ConnectOptions {
        let options = match &self.login {
            Login::Anonymous => options,
            Login::UserAndPassword { user, password } => {
                options.user_and_password(user.clone(), password.expose().to_owned())
            }
            Login::Token(token) => options.token(token.expose().to_owned()),
            Login::NKey(seed) => options.nkey(seed.expose().to_owned()),
            Login::Creds { jwt, key_pair } => {
                let key_pair = Arc::clone(key_pair);
                // What `ConnectOptions::credentials` does with a creds file's text, from the key pair checked here.
                options.jwt(jwt.clone(), move |nonce| {
                    let key_pair = Arc::clone(&key_pair);
                    async move { key_pair.sign(&nonce).map_err(async_nats::AuthError::new) }
                })
            }
        };
        match &self.tls {
            Some(config) => options.require_tls(true).tls_client_config(config.clone()),
            None => options,
        }
    }

    /// The servers to connect to, without credentials.
    pub fn servers(&self) -> Vec<ServerAddr> {
        self.servers.clone()
    }

    /// `--nats-url` with its credentials replaced by `***`.
    pub fn display(&self) -> &str {
        &self.display
    }

    /// Who a creds file logs in as, from its user JWT's claims (public keys, no secret): `user <key> of account
    /// <key>`. The server refuses a revoked user, an unknown or expired account, with the same bare "authorization
    /// violation" as a wrong login; the keys tell the operator what to look up (`nsc describe user`, the account's
    /// revocations). `None` for other logins and unreadable claims.
    pub fn login_identity(&self) -> Option<String> {
        let Login::Creds { jwt, .. } = &self.login else {
            return None;
        };
        let claims = jwt_claims(jwt)?;
        let user = claims.get("sub")?.as_str()?;
        // Signed with an account's signing key, the account is named apart from the issuer.
        let account = claims
            .pointer("/nats/issuer_account")
            .and_then(serde_json::Value::as_str)
            .or_else(|| claims.get("iss")?.as_str())?;
        Some(format!("user {user} of account {account}"))
    }
}

/// Connects to NATS as `access` says, with the settings' name, capacity and pings, retrying the first connect (a
/// NATS that comes up later is picked up; readiness reports it meanwhile). `on_event` gets every connection event.
///
/// # Errors
/// The client refuses its options (not expected: the addresses were checked).
pub async fn connect<F>(
    settings: &NatsSettings,
    access: &NatsAccess,
    on_event: F,
) -> Result<async_nats::Client, async_nats::ConnectError>
where
    F: Fn(Event) + Send + Sync + 'static,
{
    tracing::info!(
        nats_address = %access.display(),
        login = access.login.name(),
        tls = if access.requires_tls() { "required" } else { "as the URL or server asks" },
        "connecting to NATS"
    );
    let options = ConnectOptions::new()
        .name("chat-history-view")
        .retry_on_initial_connect()
        .subscription_capacity(settings.subscription_capacity)
        // The default (60 s) left a frozen server or a half-open link unnoticed for about three minutes.
        .ping_interval(settings.ping_interval)
        .event_callback(move |event| {
            on_event(event);
            std::future::ready(())
        });
    access.apply(options).connect(access.servers()).await
}

/// A setting naming a file, unless unset or empty (a chart renders an unset value as an empty string).
fn given(path: &Option<PathBuf>) -> Option<&Path> {
    path.as_deref().filter(|path| !path.as_os_str().is_empty())
}

/// The servers of `--nats-url`: one URL or several separated by commas, each `nats://` or `tls://` (or a bare
/// `host:port`), with the credentials they hold taken out. Every URL must hold the same credentials or none: the
/// client logs in one way to whichever server it reaches.
///
/// # Errors
/// A reason that never echoes the value.
fn parse_servers(value: &str) -> Result<(Vec<ServerAddr>, Option<Login>), String> {
    let mut servers = Vec::new();
    let mut logins: Vec<Option<UrlLogin>> = Vec::new();
    for part in value.split(',').map(str::trim) {
        let not_an_address = || {
            "holds something that is not a NATS server address (nats://host:port or tls://host:port; several \
             separated by commas)"
                .to_owned()
        };
        if part.is_empty() {
            return Err(not_an_address());
        }
        let text = if part.contains("://") {
            part.to_owned()
        } else {
            format!("nats://{part}")
        };
        let mut url = url::Url::parse(&text).map_err(|_| not_an_address())?;
        if !matches!(url.scheme(), "nats" | "tls") {
            return Err(
                "must be a nats:// or tls:// address (the worker's client has no WebSocket support)".to_owned(),
            );
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(not_an_address());
        }
        // The URL parser drops an empty password (`user:@host`), which would make the user a token.
        let userinfo = text
            .split_once("://")
            .and_then(|(_, rest)| rest.split('/').next())
            .and_then(|authority| authority.rsplit_once('@'))
            .map(|(userinfo, _)| userinfo);
        if userinfo.is_some_and(|userinfo| userinfo.ends_with(':')) {
            return Err("the URL's password is empty".to_owned());
        }
        logins.push(url_login(&url)?);
        url.set_username("").map_err(|()| not_an_address())?;
        url.set_password(None).map_err(|()| not_an_address())?;
        servers.push(ServerAddr::from_url(url).map_err(|_| not_an_address())?);
    }
    if logins.windows(2).any(|pair| pair[0] != pair[1]) {
        return Err(
            "its URLs hold different credentials: give every URL the same credentials, or none"
                .to_owned(),
        );
    }
    let login = logins
        .into_iter()
        .next()
        .flatten()
        .map(|login| match login {
            UrlLogin::Token(token) => Login::Token(Secret::new(token)),
            UrlLogin::UserAndPassword(user, password) => Login::UserAndPassword {
                user,
                password: Secret::new(password),
            },
        });
    Ok((servers, login))
}

/// Checks `--nats-url` as [`NatsAccess::from_settings`] reads it; the reason never echoes the value.
pub(crate) fn check_url(value: &str) -> Result<(), String> {
    parse_servers(value).map(|_| ())
}

/// The credentials of one URL, percent-decoded.
#[derive(PartialEq, Eq)]
enum UrlLogin {
    /// `nats://token@host`.
    Token(String),
    /// `nats://user:password@host`.
    UserAndPassword(String, String),
}

fn url_login(url: &url::Url) -> Result<Option<UrlLogin>, String> {
    let decode = |part: &str, what: &str| {
        percent_encoding::percent_decode_str(part)
            .decode_utf8()
            .map(|text| text.into_owned())
            .map_err(|_| format!("the URL's {what} is not UTF-8 once percent-decoded"))
    };
    match (url.username(), url.password()) {
        ("", None) => Ok(None),
        ("", Some(_)) => {
            Err("the URL holds a password without a user (user:password@host)".to_owned())
        }
        (token, None) => Ok(Some(UrlLogin::Token(decode(token, "token")?))),
        (_, Some("")) => Err("the URL's password is empty".to_owned()),
        (user, Some(password)) => Ok(Some(UrlLogin::UserAndPassword(
            decode(user, "user")?,
            decode(password, "password")?,
        ))),
    }
}

/// The bytes of the file `flag` names, at most [`MAX_FILE_BYTES`].
fn read_file(flag: &'static str, path: &Path) -> Result<Vec<u8>, AccessError> {
    let cannot =
        |cause: std::io::Error| error(flag, format!("cannot read {}: {cause}", path.display()));
    let file = std::fs::File::open(path).map_err(cannot)?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(cannot)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(error(
            flag,
            format!(
                "{} is larger than 1 MiB: not the file this setting needs",
                path.display()
            ),
        ));
    }
    Ok(bytes)
}

/// The text of the file `flag` names.
fn read_text(flag: &'static str, path: &Path) -> Result<String, AccessError> {
    String::from_utf8(read_file(flag, path)?)
        .map_err(|_| error(flag, format!("{} is not UTF-8 text", path.display())))
}

/// A one-line secret (a token, a password): the file's text without its trailing line break.
fn read_line(flag: &'static str, path: &Path, what: &str) -> Result<String, AccessError> {
    let text = read_text(flag, path)?;
    let line = text.trim_end_matches(['\n', '\r']);
    if line.is_empty() {
        Err(error(
            flag,
            format!("{} is empty: it must hold the {what}", path.display()),
        ))
    } else if line.contains(['\n', '\r']) {
        Err(error(
            flag,
            format!(
                "{} holds more than one line: it must hold only the {what}",
                path.display()
            ),
        ))
    } else {
        Ok(line.to_owned())
    }
}

/// A user's NKey seed from `--nats-nkey-seed-file`: one line, `SU…`.
fn read_seed(path: &Path) -> Result<Login, AccessError> {
    let flag = "nats-nkey-seed-file";
    let text = read_text(flag, path)?;
    let seed = text.trim();
    user_key_pair(seed).map_err(|reason| error(flag, format!("{}: {reason}", path.display())))?;
    Ok(Login::NKey(Secret::new(seed)))
}

/// The key pair of a user's seed; the reason never holds the seed.
fn user_key_pair(seed: &str) -> Result<KeyPair, &'static str> {
    let key_pair = KeyPair::from_seed(seed)
        .map_err(|_| "holds no valid NKey seed (a line starting with SU, as nsc writes it)")?;
    if key_pair.key_pair_type() == KeyPairType::User {
        Ok(key_pair)
    } else {
        Err("holds an NKey seed that is not a user's (a user's seed starts with SU)")
    }
}

/// A creds file: its user JWT and the key pair of its seed.
fn read_creds(path: &Path) -> Result<Login, AccessError> {
    let flag = "nats-creds-file";
    let text = read_text(flag, path)?;
    let (jwt, key_pair) = parse_creds(&text)
        .map_err(|reason| error(flag, format!("{}: {reason}", path.display())))?;
    jwt_valid_at(&jwt, SystemTime::now())
        .map_err(|reason| error(flag, format!("{}: {reason}", path.display())))?;
    Ok(Login::Creds {
        jwt,
        key_pair: Arc::new(key_pair),
    })
}

/// Reads a creds file as the client does: its first two decorated blocks (a `---…---` line, one line of JWT or
/// seed characters, a `---…---` line) are the user JWT and the user's seed.
///
/// # Errors
/// What is missing or wrong, never what the file holds.
fn parse_creds(text: &str) -> Result<(String, KeyPair), &'static str> {
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    let fence = |line: &str| line.len() >= 6 && line.starts_with("---") && line.ends_with("---");
    let content = |line: &str| {
        !line.is_empty()
            && line
                .chars()
                .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | '='))
    };
    let mut blocks = Vec::new();
    let mut at = 0;
    while at + 2 < lines.len() {
        if fence(lines[at]) && content(lines[at + 1]) && fence(lines[at + 2]) {
            blocks.push(lines[at + 1]);
            at += 3;
        } else {
            at += 1;
        }
    }
    let jwt = blocks
        .first()
        .filter(|jwt| jwt.split('.').count() == 3 && jwt.split('.').all(|part| !part.is_empty()))
        .ok_or("holds no user JWT (-----BEGIN NATS USER JWT----- and a JWT on the next line)")?;
    let seed = blocks
        .get(1)
        .ok_or("holds no NKey seed after its JWT (-----BEGIN USER NKEY SEED----- and the seed)")?;
    Ok(((*jwt).to_owned(), user_key_pair(seed)?))
}

/// Whether a user JWT is valid at `now` by its own claims: not expired (`exp`) and not before its start (`nbf`),
/// both seconds since the epoch. The server would refuse it as a plain "authorization violation"; said here, at start,
/// the operator reads which. A claim that cannot be read is left to the server (its signature is its to check).
///
/// # Errors
/// When it expired or is not valid yet, with the instant (a JWT's claims are no secret).
fn jwt_valid_at(jwt: &str, now: SystemTime) -> Result<(), String> {
    let Some(claims) = jwt_claims(jwt) else {
        return Ok(());
    };
    let now_secs = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let at = |claim: &str| {
        claims
            .get(claim)
            .and_then(serde_json::Value::as_u64)
            .filter(|t| *t > 0)
    };
    if let Some(expires) = at("exp").filter(|expires| *expires <= now_secs) {
        return Err(format!(
            "its user JWT expired at {} (now {}): issue the worker a new one",
            utc(expires),
            utc(now_secs)
        ));
    }
    if let Some(start) = at("nbf").filter(|start| *start > now_secs) {
        return Err(format!(
            "its user JWT is not valid before {} (now {}): the clocks disagree, or it was issued for later",
            utc(start),
            utc(now_secs)
        ));
    }
    Ok(())
}

/// A JWT's claims, unverified (the server checks the signature); `None` when they cannot be read.
fn jwt_claims(jwt: &str) -> Option<serde_json::Value> {
    use base64::Engine as _;
    let payload = jwt.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Seconds since the epoch as an RFC 3339 UTC instant.
fn utc(secs: u64) -> String {
    match time::OffsetDateTime::from_unix_timestamp(i64::try_from(secs).unwrap_or(i64::MAX)) {
        Ok(at) => format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
            at.year(),
            u8::from(at.month()),
            at.day(),
            at.hour(),
            at.minute(),
            at.second()
        ),
        Err(_) => format!("{secs} s after the epoch"),
    }
}

/// The TLS setup of the TLS settings: `None` without any; with any, TLS is required. Without a CA file the system's
/// CA certificates verify the server.
fn tls_config(settings: &NatsSettings) -> Result<Option<ClientConfig>, AccessError> {
    let ca = given(&settings.tls_ca_file);
    let cert = given(&settings.tls_cert_file);
    let key = given(&settings.tls_key_file);
    let client = match (cert, key) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (Some(_), None) => {
            return Err(error(
                "nats-tls-cert-file",
                format!("needs {} too", setting("nats-tls-key-file")),
            ));
        }
        (None, Some(_)) => {
            return Err(error(
                "nats-tls-key-file",
                format!("needs {} too", setting("nats-tls-cert-file")),
            ));
        }
        (None, None) => None,
    };
    if ca.is_none() && client.is_none() {
        return Ok(None);
    }
    let roots = match ca {
        Some(path) => ca_roots(path)?,
        None => system_roots(),
    };
    let builder =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|_| {
                error(
                    "nats-tls-ca-file",
                    "TLS cannot be set up with this build's cryptography",
                )
            })?
            .with_root_certificates(roots);
    let config = match client {
        Some((cert, key)) => {
            let chain = certificates("nats-tls-cert-file", cert)?;
            let key_der = private_key(key)?;
            builder.with_client_auth_cert(chain, key_der).map_err(|_| {
                error(
                    "nats-tls-key-file",
                    format!(
                        "{} is not the key of the certificate in {}, or a kind of key TLS cannot use",
                        key.display(),
                        setting("nats-tls-cert-file")
                    ),
                )
            })?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(Some(config))
}

/// The CA certificates of `--nats-tls-ca-file`, each a trust anchor.
fn ca_roots(path: &Path) -> Result<RootCertStore, AccessError> {
    let flag = "nats-tls-ca-file";
    let mut roots = RootCertStore::empty();
    for certificate in certificates(flag, path)? {
        roots.add(certificate).map_err(|_| {
            error(
                flag,
                format!(
                    "{} holds a certificate that cannot be a CA (not a readable X.509 certificate)",
                    path.display()
                ),
            )
        })?;
    }
    Ok(roots)
}

/// The system's CA certificates (those it has that can be read; none is an empty set, and the server's
/// certificate will not verify).
fn system_roots() -> RootCertStore {
    let mut roots = RootCertStore::empty();
    roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    roots
}

/// The PEM certificates of the file `flag` names: at least one.
fn certificates(
    flag: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, AccessError> {
    let bytes = read_file(flag, path)?;
    let certificates = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| {
            error(
                flag,
                format!("{} is not a readable PEM file", path.display()),
            )
        })?;
    if certificates.is_empty() {
        return Err(error(
            flag,
            format!(
                "{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
                path.display()
            ),
        ));
    }
    Ok(certificates)
}

/// The PEM private key of `--nats-tls-key-file` (PKCS#8, PKCS#1 or SEC1).
fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, AccessError> {
    let flag = "nats-tls-key-file";
    let bytes = read_file(flag, path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|cause| {
        let reason = match cause {
            rustls::pki_types::pem::Error::NoItemsFound => {
                "holds no PEM private key (-----BEGIN PRIVATE KEY-----)"
            }
            _ => "is not a readable PEM file",
        };
        error(flag, format!("{} {reason}", path.display()))
    })
}

/// The kind of a connection failure, for its log line and its rate limit: one of a closed set (the client's
/// connect error kinds, and server errors); `None` for an event that is no failure.
pub fn failure_kind(event: &Event) -> Option<&'static str> {
    const CONNECT_ERRORS: [(ConnectErrorKind, &str); 8] = [
        (
            ConnectErrorKind::AuthorizationViolation,
            "authorization_violation",
        ),
        (ConnectErrorKind::Authentication, "authentication"),
        (ConnectErrorKind::Tls, "tls"),
        (ConnectErrorKind::Io, "io"),
        (ConnectErrorKind::TimedOut, "timed_out"),
        (ConnectErrorKind::Dns, "dns"),
        (ConnectErrorKind::ServerParse, "server_parse"),
        (ConnectErrorKind::MaxReconnects, "max_reconnects"),
    ];
    match event {
        Event::Disconnected => Some("disconnected"),
        // A failed connect attempt: the client sends its error as text, its kind's `Display` and, after `: `, its
        // cause (the vendored client's: vendor/async-nats/PATCH.md).
        Event::ClientError(ClientError::Other(text)) => Some(
            CONNECT_ERRORS
                .iter()
                .find(|(kind, _)| {
                    let kind = kind.to_string();
                    text.strip_prefix(kind.as_str())
                        .is_some_and(|rest| rest.is_empty() || rest.starts_with(": "))
                })
                .map_or("client_error", |(_, name)| name),
        ),
        Event::ClientError(ClientError::MaxReconnects) => Some("max_reconnects"),
        Event::ClientError(_) => Some("client_error"),
        Event::ServerError(ServerError::AuthorizationViolation) => Some("authorization_violation"),
        Event::ServerError(_) => Some("server_error"),
        Event::Connected
        | Event::Closed
        | Event::LameDuckMode
        | Event::Draining
        | Event::SlowConsumer(_) => None,
    }
}

/// The connection events' log lines. A failure (a connect attempt that failed, a lost connection, a server error)
/// is a WARN with the server address (credentials redacted) and its kind ([`failure_kind`]); the client retries
/// without end (every few seconds), so each kind is logged at most once per [`FAILURE_LOG_INTERVAL`]: the first
/// at once, later ones with how many of that kind went unlogged since (`suppressed`).
/// `history_view_nats_connection_events_total` still counts every event. Other events are INFO lines.
#[derive(Debug)]
pub struct ConnectionLog {
    /// `--nats-url` with its credentials replaced by `***`.
    address: String,
    /// [`NatsAccess::login_identity`], named on an authorization violation.
    login: Option<String>,
    /// Per failure kind: when it was last logged, and how many of it went unlogged since.
    kinds: HashMap<&'static str, (Instant, u64)>,
}

impl ConnectionLog {
    pub fn new(address: String, login: Option<String>) -> Self {
        Self {
            address,
            login,
            kinds: HashMap::new(),
        }
    }

    /// Logs `event`, which happened at `now`; `possible_loss`: whether it means events may have been missed.
    pub fn log(&mut self, event: &Event, possible_loss: bool, now: Instant) {
        let Some(kind) = failure_kind(event) else {
            tracing::info!(nats_address = %self.address, event = %event, possible_loss, "NATS connection event");
            return;
        };
        if let Some(suppressed) = self.allow(kind, now) {
            let message = match event {
                Event::Disconnected => "the NATS connection was lost",
                Event::ServerError(_) => "NATS server error",
                _ => "cannot connect to NATS",
            };
            // The server gives no reason: a wrong login, a user revoked by its account, an account unknown to its
            // resolver or expired all read alike.
            let login = (kind == "authorization_violation")
                .then_some(self.login.as_deref())
                .flatten();
            tracing::warn!(
                nats_address = %self.address,
                kind,
                error = %event,
                login,
                possible_loss,
                suppressed,
                "{message}"
            );
        }
    }

    /// Whether a failure of `kind` at `now` is logged: `Some(n)` with the `n` of its kind not logged since the
    /// last one that was, `None` (and counted) within [`FAILURE_LOG_INTERVAL`] of that one.
    fn allow(&mut self, kind: &'static str, now: Instant) -> Option<u64> {
        match self.kinds.get_mut(kind) {
            Some((last, suppressed))
                if now.saturating_duration_since(*last) < FAILURE_LOG_INTERVAL =>
            {
                *suppressed += 1;
                None
            }
            Some((last, suppressed)) => {
                *last = now;
                Some(std::mem::take(suppressed))
            }
            None => {
                self.kinds.insert(kind, (now, 0));
                Some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests;
