//! The NATS settings' reading and checking: URL credentials, one login, the files (missing, empty, malformed),
//! and TLS pairs. Files are written to a temp dir of each test; certificates are
//! made here (rcgen), seeds with nkeys.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use super::files::jwt_valid_at;
use super::*;

/// The NATS settings alone, parsed as the command parses them.
#[derive(Parser)]
struct Args {
    #[command(flatten)]
    nats: NatsSettings,
}

const SECRET: &str = "s3cret-VALUE-91";

/// A temp dir of the test's own, removed at the end.
struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("chv-connect-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    /// Writes `contents` to `name` and returns its path as a setting's value.
    fn file(&self, name: &str, contents: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, contents).unwrap();
        path.display().to_string()
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn settings(args: &[&str]) -> NatsSettings {
    Args::try_parse_from(std::iter::once("chat-history-view").chain(args.iter().copied()))
        .unwrap()
        .nats
}

fn access(args: &[&str]) -> Result<NatsAccess, AccessError> {
    NatsAccess::from_settings(&settings(args))
}

/// The error's message, checked to name `flag` with its variable and to hold no secret.
fn refused(args: &[&str], flag: &str) -> String {
    let error = access(args).expect_err("refused");
    let message = error.to_string();
    assert_eq!(error.flag, flag, "{message}");
    let variable = format!(
        "HISTORY_VIEW_{}",
        flag.to_ascii_uppercase().replace('-', "_")
    );
    assert!(
        message.contains(&format!("--{flag} ({variable})")),
        "{message}"
    );
    assert!(!message.contains(SECRET), "{message}");
    message
}

fn user_seed() -> String {
    nkeys::KeyPair::new_user().seed().unwrap()
}

fn creds(jwt: &str, seed: &str) -> String {
    format!(
        "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\n\
         -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
    )
}

#[test]
fn credentials_in_the_url_become_the_login_and_leave_the_address() {
    let access = access(&["--nats-url", "nats://us%40er:pa%3Ass@127.0.0.1:4222"]).unwrap();
    match &access.login {
        Login::UserAndPassword { user, password } => {
            assert_eq!(user, "us@er");
            assert_eq!(password.expose(), "pa:ss");
        }
        other => panic!("{}", other.name()),
    }
    assert_eq!(access.servers()[0].as_url_str(), "nats://127.0.0.1:4222");
    assert_eq!(access.display(), "nats://***@127.0.0.1:4222");

    let access =
        super::NatsAccess::from_settings(&settings(&["--nats-url", "tls://tok%2Fen@h:4443"]))
            .unwrap();
    match &access.login {
        Login::Token(token) => assert_eq!(token.expose(), "tok/en"),
        other => panic!("{}", other.name()),
    }
    assert!(access.servers()[0].tls_required());
    let debug = format!("{access:?}");
    assert!(
        !debug.contains("tok/en") && !debug.contains("tok%2Fen"),
        "{debug}"
    );
}

#[test]
fn several_urls_are_servers_of_one_login() {
    let access = access(&[
        "--nats-url",
        "nats://u:pw@a:4222, nats://u:pw@b:4223,c:4224",
    ]);
    // Different credentials (here: none on the third) cannot be one login.
    let message = access.expect_err("refused").to_string();
    assert!(message.contains("different credentials"), "{message}");
    assert!(!message.contains("pw"), "{message}");

    let access =
        super::NatsAccess::from_settings(&settings(&["--nats-url", "nats://a:4222,b:4223"]))
            .unwrap();
    let servers: Vec<String> = access
        .servers()
        .iter()
        .map(|s| s.as_url_str().to_owned())
        .collect();
    assert_eq!(servers, ["nats://a:4222", "nats://b:4223"]);
    assert!(matches!(access.login, Login::Anonymous));
}

#[test]
fn urls_that_cannot_log_in_are_refused_without_echoing_them() {
    for url in [
        format!("nats://:{SECRET}@h:4222"),
        format!("nats://{SECRET}:@h:4222"),
        format!("ws://u:{SECRET}@h:4222"),
        format!("nats://u:{SECRET}@h:4222,"),
        format!("nats://u:{SECRET}@a b"),
        "http://h".to_owned(),
    ] {
        refused(&["--nats-url", &url], "nats-url");
    }
}

#[test]
fn two_ways_to_log_in_are_refused_naming_both() {
    let dir = Dir::new("two");
    let token = dir.file("token", SECRET);
    let seed = dir.file("seed", &user_seed());
    let message = refused(
        &["--nats-nkey-seed-file", &seed, "--nats-token-file", &token],
        "nats-token-file",
    );
    assert!(
        message.contains("HISTORY_VIEW_NATS_NKEY_SEED_FILE"),
        "{message}"
    );
    let message = refused(
        &[
            "--nats-url",
            &format!("nats://{SECRET}@h"),
            "--nats-creds-file",
            "/nowhere",
        ],
        "nats-creds-file",
    );
    assert!(message.contains("credentials in --nats-url"), "{message}");
    let password = dir.file("password", SECRET);
    refused(
        &[
            "--nats-token-file",
            &token,
            "--nats-user",
            "u",
            "--nats-password-file",
            &password,
        ],
        "nats-user",
    );
}

#[test]
fn half_a_pair_is_refused_naming_the_missing_half() {
    let message = refused(&["--nats-user", "u"], "nats-user");
    assert!(
        message.contains("HISTORY_VIEW_NATS_PASSWORD_FILE"),
        "{message}"
    );
    refused(&["--nats-password-file", "/x"], "nats-password-file");
    let message = refused(&["--nats-tls-cert-file", "/x"], "nats-tls-cert-file");
    assert!(
        message.contains("HISTORY_VIEW_NATS_TLS_KEY_FILE"),
        "{message}"
    );
    refused(&["--nats-tls-key-file", "/x"], "nats-tls-key-file");
}

#[test]
fn empty_values_count_as_unset() {
    let empty = [
        "--nats-creds-file=",
        "--nats-nkey-seed-file=",
        "--nats-token-file=",
        "--nats-user=",
        "--nats-password-file=",
        "--nats-tls-ca-file=",
        "--nats-tls-cert-file=",
        "--nats-tls-key-file=",
    ];
    let access = access(&empty).unwrap();
    assert!(matches!(access.login, Login::Anonymous));
    assert!(access.tls.is_none());
}

#[test]
fn a_missing_or_unreadable_file_is_named_with_its_path() {
    let message = refused(&["--nats-token-file", "/no/such/token"], "nats-token-file");
    assert!(message.contains("/no/such/token"), "{message}");
    let dir = Dir::new("unreadable");
    // A directory cannot be read as a file.
    refused(
        &["--nats-creds-file", &dir.0.display().to_string()],
        "nats-creds-file",
    );
    refused(
        &["--nats-tls-ca-file", "/no/such/ca.pem"],
        "nats-tls-ca-file",
    );
}

#[test]
fn a_token_or_password_file_holds_one_line() {
    let dir = Dir::new("token");
    let access = access(&[
        "--nats-token-file",
        &dir.file("token", &format!("{SECRET}\r\n")),
    ])
    .unwrap();
    match &access.login {
        Login::Token(token) => assert_eq!(token.expose(), SECRET),
        other => panic!("{}", other.name()),
    }
    let access = super::NatsAccess::from_settings(&settings(&[
        "--nats-user",
        "u",
        "--nats-password-file",
        &dir.file("password", &format!("{SECRET}\n")),
    ]))
    .unwrap();
    match &access.login {
        Login::UserAndPassword { user, password } => {
            assert_eq!((user.as_str(), password.expose()), ("u", SECRET));
        }
        other => panic!("{}", other.name()),
    }
    refused(
        &["--nats-token-file", &dir.file("empty", "\n")],
        "nats-token-file",
    );
    let message = refused(
        &[
            "--nats-token-file",
            &dir.file("two", &format!("{SECRET}\n{SECRET}\n")),
        ],
        "nats-token-file",
    );
    assert!(message.contains("more than one line"), "{message}");
    std::fs::write(dir.0.join("binary"), [0xff, 0xfe, b'x']).unwrap();
    refused(
        &[
            "--nats-user",
            "u",
            "--nats-password-file",
            &dir.0.join("binary").display().to_string(),
        ],
        "nats-password-file",
    );
}

#[test]
fn an_nkey_seed_file_holds_a_users_seed() {
    let dir = Dir::new("seed");
    let seed = user_seed();
    let access = access(&[
        "--nats-nkey-seed-file",
        &dir.file("seed", &format!("{seed}\n")),
    ])
    .unwrap();
    match &access.login {
        Login::NKey(held) => assert_eq!(held.expose(), seed),
        other => panic!("{}", other.name()),
    }
    let account = nkeys::KeyPair::new_account().seed().unwrap();
    let message = refused(
        &["--nats-nkey-seed-file", &dir.file("account", &account)],
        "nats-nkey-seed-file",
    );
    assert!(message.contains("not a user's"), "{message}");
    assert!(!message.contains(&account), "{message}");
    let broken = format!("SU{}", &seed[2..seed.len() - 1]);
    let message = refused(
        &["--nats-nkey-seed-file", &dir.file("broken", &broken)],
        "nats-nkey-seed-file",
    );
    assert!(!message.contains(&broken), "{message}");
}

#[test]
fn a_creds_file_holds_a_jwt_and_a_users_seed() {
    let dir = Dir::new("creds");
    let seed = user_seed();
    let jwt = "eyJhbGciOiJlZDI1NTE5In0.eyJzdWIiOiJVIn0.c2ln";
    let access = access(&["--nats-creds-file", &dir.file("ok", &creds(jwt, &seed))]).unwrap();
    match &access.login {
        Login::Creds {
            jwt: held,
            key_pair,
        } => {
            assert_eq!(held, jwt);
            assert_eq!(key_pair.seed().unwrap(), seed);
        }
        other => panic!("{}", other.name()),
    }
    // Without blank lines between the blocks, as some tools write it.
    let compact = format!(
        "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\
         -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
    );
    access_ok(&["--nats-creds-file", &dir.file("compact", &compact)]);

    for (name, contents, says) in [
        (
            "seed-only",
            format!("-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"),
            "no user JWT",
        ),
        (
            "jwt-only",
            format!("-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n"),
            "no NKey seed",
        ),
        (
            "bad-seed",
            creds(jwt, &seed[..seed.len() - 3]),
            "no valid NKey seed",
        ),
        ("empty", String::new(), "no user JWT"),
        (
            "pem",
            "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n".to_owned(),
            "no user JWT",
        ),
    ] {
        let message = refused(
            &["--nats-creds-file", &dir.file(name, &contents)],
            "nats-creds-file",
        );
        assert!(message.contains(says), "{name}: {message}");
        assert!(!message.contains(&seed[2..20]), "{name}: {message}");
    }
}

fn access_ok(args: &[&str]) -> NatsAccess {
    access(args).unwrap_or_else(|error| panic!("{error}"))
}

#[test]
fn tls_files_are_read_into_one_setup_that_requires_tls() {
    let dir = Dir::new("tls");
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let other = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let cert = dir.file("cert.pem", &certified.cert.pem());
    let key = dir.file("key.pem", &certified.key_pair.serialize_pem());
    let other_key = dir.file("other-key.pem", &other.key_pair.serialize_pem());

    let access = access_ok(&["--nats-tls-ca-file", &cert]);
    assert!(access.requires_tls());
    let access = access_ok(&[
        "--nats-tls-ca-file",
        &cert,
        "--nats-tls-cert-file",
        &cert,
        "--nats-tls-key-file",
        &key,
    ]);
    assert!(access.requires_tls());
    // A client certificate alone verifies the server with the system's CA certificates.
    assert!(
        access_ok(&["--nats-tls-cert-file", &cert, "--nats-tls-key-file", &key]).requires_tls()
    );
    // No TLS setting: TLS as the URL says.
    assert!(!access_ok(&["--nats-url", "tls://h:4222"]).requires_tls());

    let message = refused(
        &[
            "--nats-tls-cert-file",
            &cert,
            "--nats-tls-key-file",
            &other_key,
        ],
        "nats-tls-key-file",
    );
    assert!(
        message.contains("not the key of the certificate"),
        "{message}"
    );
    let message = refused(&["--nats-tls-ca-file", &key], "nats-tls-ca-file");
    assert!(message.contains("no PEM certificate"), "{message}");
    let message = refused(
        &["--nats-tls-cert-file", &cert, "--nats-tls-key-file", &cert],
        "nats-tls-key-file",
    );
    assert!(message.contains("no PEM private key"), "{message}");
    let broken = dir.file(
        "broken.pem",
        "-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----\n",
    );
    refused(&["--nats-tls-ca-file", &broken], "nats-tls-ca-file");
    let garbage = dir.file(
        "garbage.pem",
        "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
    );
    let message = refused(&["--nats-tls-ca-file", &garbage], "nats-tls-ca-file");
    assert!(message.contains("cannot be a CA"), "{message}");
    // The key's text is never shown, whatever is wrong.
    let key_text = certified.key_pair.serialize_pem();
    let body = key_text.lines().nth(1).unwrap();
    assert!(!message.contains(body));
}

/// A JWT with `claims` as its payload (header and signature are not read here).
fn jwt_with(claims: &str) -> String {
    use base64::Engine as _;
    let encode = |text: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(text);
    format!(
        "{}.{}.sig",
        encode(r#"{"typ":"JWT","alg":"ed25519-nkey"}"#),
        encode(claims)
    )
}

#[test]
fn a_user_jwt_expired_or_not_yet_valid_is_refused_naming_the_instant() {
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let expired = jwt_valid_at(&jwt_with(r#"{"exp":1700000000}"#), now).unwrap_err();
    assert!(
        expired.contains("expired at 2023-11-14T22:13:20Z")
            && expired.contains("now 2027-01-15T08:00:00Z"),
        "{expired}"
    );
    let later = jwt_valid_at(&jwt_with(r#"{"nbf":1900000000}"#), now).unwrap_err();
    assert!(
        later.contains("not valid before 2030-03-17T17:46:40Z"),
        "{later}"
    );
    // Valid now, without either claim, or unreadable: left to the server.
    for claims in [
        r#"{"exp":1900000000,"nbf":1700000000}"#,
        r#"{"sub":"U"}"#,
        r#"{"exp":0}"#,
    ] {
        assert_eq!(jwt_valid_at(&jwt_with(claims), now), Ok(()), "{claims}");
    }
    assert_eq!(jwt_valid_at("not.a-jwt.at-all", now), Ok(()));
}
