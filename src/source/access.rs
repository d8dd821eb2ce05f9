//! Where the NATS connection goes and how it logs in ([`NatsAccess`], built from the "NATS" settings, and the
//! settings' checks at start): pure reading and checking, no client.
//!
//! Every file a setting names is read and checked once, at start, and what it holds is kept in memory: the client
//! would read TLS files again at each connect, and with retries on the first connect a missing or malformed file
//! would retry forever instead of stopping the start. So a rotated file takes a restart. Credentials in the URL
//! (`nats://user:password@host`, `nats://token@host`) are taken out of it and given to the client as a login: the
//! client ignores a URL's userinfo, and it then never sees them in an address it could log. No error or log line
//! holds a secret: errors name the setting (its flag; [`AccessError`]) and the file, never what it holds.

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use async_nats::rustls::pki_types::pem::PemObject;
use async_nats::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use async_nats::rustls::{self, ClientConfig, RootCertStore};
use async_nats::{ConnectOptions, ServerAddr};
use nkeys::{KeyPair, KeyPairType};

use super::settings::{NatsSettings, redact_userinfo};
use crate::setting::Secret;
use files::{jwt_claims, read_creds, read_line, read_seed, tls_config};

mod files;

/// The largest file a NATS setting may name: creds files, seeds and certificate chains are a few KiB, so a larger
/// one is the wrong file (or a device that never ends).
const MAX_FILE_BYTES: u64 = 1 << 20;

impl NatsSettings {
    /// Checks the URL after parsing, so that an error never echoes it.
    pub(crate) fn check_url(&self) -> Result<(), String> {
        check_url(self.url.expose())
    }

    /// Reads and checks every file the settings name, and that they go together (one way to log in, a
    /// certificate with its key); the error names the setting by its long flag.
    pub(crate) fn check_access(&self) -> Result<(), AccessError> {
        NatsAccess::from_settings(self).map(|_| ())
    }
}

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
    pub fn requires_tls(&self) -> bool {
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

    /// How it logs in, for the log: the kind of login, never what it holds.
    pub fn login_name(&self) -> &'static str {
        self.login.name()
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

#[cfg(test)]
mod tests;
