//! The files the NATS settings name, read once at start within [`MAX_FILE_BYTES`]: token, password and seed lines,
//! creds files (their user JWT checked for its validity window) and the TLS certificates and key.

use super::*;

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
pub(super) fn read_line(
    flag: &'static str,
    path: &Path,
    what: &str,
) -> Result<String, AccessError> {
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
pub(super) fn read_seed(path: &Path) -> Result<Login, AccessError> {
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
pub(super) fn read_creds(path: &Path) -> Result<Login, AccessError> {
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
pub(super) fn jwt_valid_at(jwt: &str, now: SystemTime) -> Result<(), String> {
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
pub(super) fn jwt_claims(jwt: &str) -> Option<serde_json::Value> {
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
pub(super) fn tls_config(settings: &NatsSettings) -> Result<Option<ClientConfig>, AccessError> {
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
