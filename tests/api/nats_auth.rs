//! A NATS that requires a login and TLS, for real (issue 37): nats-server verifying client certificates with an
//! NKey user, a token, a user and password, and operator mode with a creds file. Each worker (the built binary)
//! becomes ready and serves from memory a history it received live through its authorized connection; credentials
//! in the URL work as well as the files. A wrong login keeps the worker unready with one WARN per kind (address
//! redacted) however often the client retries. Settings that cannot be used stop the start with exit status 2,
//! naming the setting, never the secret. Certificates (rcgen) and NKeys (nkeys) are made by the tests; the operator,
//! account and user JWTs by PyPI's `nats-jwt` in the tools' venv.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use async_nats::ConnectOptions;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use test_support::process::temp_dir;
use test_support::servers::{MongoServer, NatsServer, python};
use test_support::wait::{eventually_within, when};

use crate::helpers::{BinaryApp, TestStore, metric, publish_rows, unique, user_row};
use crate::scene::{now_ns, read_until_cache};

/// Marks every secret the tests write, so that any output showing one is caught.
const SECRET: &str = "s3cret-MARK-5d1";

/// The files a test writes (certificates, keys, seeds, creds), removed at its end.
struct Files(PathBuf);

impl Files {
    fn new() -> Self {
        Self(temp_dir("nats-auth"))
    }

    /// Writes `contents` to `name`; returns its absolute path.
    fn write(&self, name: &str, contents: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, contents).expect("write a test file");
        path.display().to_string()
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A MongoDB-wire server with aihub's indexes in a database of the test's own.
async fn store() -> (MongoServer, String) {
    let mongo = MongoServer::start();
    let database = unique("natsauth");
    TestStore::connect(&mongo.uri(), &database)
        .await
        .create_aihub_indexes()
        .await;
    (mongo, database)
}

/// A worker against `url` with `login` (its NATS settings), the store and a persister-lag bound of 0 (the test
/// publishes only live events).
async fn worker(
    url: String,
    login: &[(&'static str, String)],
    mongo: &MongoServer,
    database: &str,
) -> BinaryApp {
    let mut env = vec![
        ("HISTORY_VIEW_NATS_URL", url),
        ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
        ("HISTORY_VIEW_MONGODB_DATABASE", database.to_owned()),
        ("HISTORY_VIEW_PERSIST_LAG_MS", "0".to_owned()),
        ("HISTORY_VIEW_SHADOW_SAMPLE", "0".to_owned()),
    ];
    env.extend(login.iter().cloned());
    BinaryApp::start(&env).await
}

/// Becomes ready, and serves from memory a user message `publisher` published after that: the live path runs
/// through the worker's authorized connection (the store holds nothing).
async fn serves_live(app: &BinaryApp, publisher: &async_nats::Client) {
    app.wait_ready().await;
    let thread = unique("secured");
    let text = format!("hello over a secured NATS {thread}");
    publish_rows(
        publisher,
        &[user_row(&thread, "d1", "e1", now_ns(0), &text)],
    )
    .await;
    app.api.wait_for_events(1).await;
    let reply = read_until_cache(&app.api, &thread, "").await;
    assert!(reply.body.contains(&text), "{}", reply.body);
}

/// A CA, and a server and a client certificate it signed (the server's for 127.0.0.1): paths of the PEM files.
struct Certificates {
    ca: String,
    server_cert: String,
    server_key: String,
    client_cert: String,
    client_key: String,
}

fn certificates(files: &Files) -> Certificates {
    let ca_key = KeyPair::generate().expect("a CA key");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.distinguished_name
        .push(DnType::CommonName, "chat-history-view test CA");
    let ca = ca.self_signed(&ca_key).expect("the CA certificate");
    let signed = |names: Vec<String>, usage: ExtendedKeyUsagePurpose, name: &str| {
        let key = KeyPair::generate().expect("a key");
        let mut params = CertificateParams::new(names).expect("parameters");
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![usage];
        let cert = params
            .signed_by(&key, &ca, &ca_key)
            .expect("a signed certificate");
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = signed(
        vec!["127.0.0.1".to_owned(), "localhost".to_owned()],
        ExtendedKeyUsagePurpose::ServerAuth,
        "nats-server",
    );
    let (client_cert, client_key) = signed(
        Vec::new(),
        ExtendedKeyUsagePurpose::ClientAuth,
        "chat-history-view",
    );
    Certificates {
        ca: files.write("ca.pem", &ca.pem()),
        server_cert: files.write("server-cert.pem", &server_cert),
        server_key: files.write("server-key.pem", &server_key),
        client_cert: files.write("client-cert.pem", &client_cert),
        client_key: files.write("client-key.pem", &client_key),
    }
}

/// nats-server's configuration value for `text`: a JSON string is a quoted string it reads.
fn quoted(text: &str) -> String {
    serde_json::to_string(text).expect("a string")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_client_certificates_and_an_nkey_user() {
    let files = Files::new();
    let tls = certificates(&files);
    let worker_user = nkeys::KeyPair::new_user();
    let publisher_user = nkeys::KeyPair::new_user();
    let nats = NatsServer::start_with_config(&format!(
        "tls {{ cert_file: {}, key_file: {}, ca_file: {}, verify: true }}\n\
         authorization {{ users = [ {{ nkey: {} }}, {{ nkey: {} }} ] }}\n",
        quoted(&tls.server_cert),
        quoted(&tls.server_key),
        quoted(&tls.ca),
        quoted(&worker_user.public_key()),
        quoted(&publisher_user.public_key()),
    ));
    let (mongo, database) = store().await;
    let publisher = ConnectOptions::new()
        .nkey(publisher_user.seed().expect("a seed"))
        .add_root_certificates(tls.ca.clone().into())
        .add_client_certificate(
            tls.client_cert.clone().into(),
            tls.client_key.clone().into(),
        )
        .require_tls(true)
        .connect(nats.url())
        .await
        .expect("the publisher connects with its certificate and NKey");
    let seed = files.write(
        "seed",
        &format!("{}\n", worker_user.seed().expect("a seed")),
    );
    let mut login = vec![
        ("HISTORY_VIEW_NATS_NKEY_SEED_FILE", seed),
        ("HISTORY_VIEW_NATS_TLS_CA_FILE", tls.ca.clone()),
        ("HISTORY_VIEW_NATS_TLS_CERT_FILE", tls.client_cert.clone()),
        ("HISTORY_VIEW_NATS_TLS_KEY_FILE", tls.client_key.clone()),
    ];
    // A nats:// URL: the TLS settings require TLS all the same.
    let app = worker(nats.url(), &login, &mongo, &database).await;
    serves_live(&app, &publisher).await;
    drop(app);

    // Without its client certificate the server refuses the worker: unready, one WARN of kind tls or io.
    login.retain(|(name, _)| {
        !name.starts_with("HISTORY_VIEW_NATS_TLS_CERT")
            && !name.starts_with("HISTORY_VIEW_NATS_TLS_KEY")
    });
    let refused = worker(nats.url(), &login, &mongo, &database).await;
    let lines = failures_after_retries(&refused, "client_error", 3).await;
    assert!(
        lines
            .iter()
            .all(|line| line.contains(r#""kind":"tls""#) || line.contains(r#""kind":"io""#)),
        "{lines:#?}"
    );
    drop(refused);

    // A CA that did not sign the server's certificate (another CA of the same name: `BadSignature`): kind tls, and the
    // WARN line says why at the default level (the client reported it as an I/O error, its cause only at DEBUG).
    let other = Files::new();
    let stranger = certificates(&other);
    let mut wrong_ca = login.clone();
    wrong_ca.retain(|(name, _)| *name != "HISTORY_VIEW_NATS_TLS_CA_FILE");
    wrong_ca.push(("HISTORY_VIEW_NATS_TLS_CA_FILE", stranger.ca.clone()));
    wrong_ca.push(("HISTORY_VIEW_NATS_TLS_CERT_FILE", tls.client_cert.clone()));
    wrong_ca.push(("HISTORY_VIEW_NATS_TLS_KEY_FILE", tls.client_key.clone()));
    let untrusted = worker(nats.url(), &wrong_ca, &mongo, &database).await;
    let lines = failures_after_retries(&untrusted, "client_error", 2).await;
    assert!(
        lines
            .iter()
            .all(|line| line.contains(r#""kind":"tls""#)
                && line.contains("invalid peer certificate")),
        "{lines:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_from_a_file_or_in_the_url() {
    let token = format!("tok/en+{SECRET}");
    let nats =
        NatsServer::start_with_config(&format!("authorization {{ token: {} }}\n", quoted(&token)));
    let (mongo, database) = store().await;
    let publisher = ConnectOptions::new()
        .token(token.clone())
        .connect(nats.url())
        .await
        .expect("the publisher connects with the token");
    let files = Files::new();
    let from_file = vec![
        (
            "HISTORY_VIEW_NATS_TOKEN_FILE",
            files.write("token", &format!("{token}\n")),
        ),
        // Empty values count as unset, as a chart renders them.
        ("HISTORY_VIEW_NATS_CREDS_FILE", String::new()),
        ("HISTORY_VIEW_NATS_USER", String::new()),
        ("HISTORY_VIEW_NATS_TLS_CA_FILE", String::new()),
    ];
    let app = worker(nats.url(), &from_file, &mongo, &database).await;
    serves_live(&app, &publisher).await;
    drop(app);

    // In the URL, percent-encoded: it used to be ignored (authorization violation forever).
    let encoded = token.replace('/', "%2F").replace('+', "%2B");
    let in_url = nats.url().replace("nats://", &format!("nats://{encoded}@"));
    let app = worker(in_url, &[], &mongo, &database).await;
    serves_live(&app, &publisher).await;
    drop(app);

    // A wrong token: unready, one WARN per kind with the address redacted, whatever the number of retries.
    let wrong = nats
        .url()
        .replace("nats://", &format!("nats://wrong-{SECRET}@"));
    let refused = worker(wrong, &[], &mongo, &database).await;
    let lines = failures_after_retries(&refused, "client_error", 5).await;
    let address = format!(
        r#""nats_address":"nats://***@127.0.0.1:{}""#,
        nats.address().port()
    );
    for line in &lines {
        assert!(line.contains(r#""level":"WARN""#), "{line}");
        assert!(
            line.contains(r#""kind":"authorization_violation""#),
            "{line}"
        );
        assert!(line.contains(&address), "{line}");
    }
    let log = refused.log_lines("");
    assert!(log.iter().all(|line| !line.contains(SECRET)), "{log:#?}");
    // The client's own per-event INFO lines are gone: the worker's WARN replaces them.
    assert!(
        log.iter().all(|line| !line.contains("\"event: ")),
        "{log:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_and_password_from_a_file_or_in_the_url() {
    let password = format!("p@ss:w/rd-{SECRET}");
    let nats = NatsServer::start_with_config(&format!(
        "authorization {{ users = [ {{ user: chv, password: {} }} ] }}\n",
        quoted(&password)
    ));
    let (mongo, database) = store().await;
    let publisher = ConnectOptions::new()
        .user_and_password("chv".to_owned(), password.clone())
        .connect(nats.url())
        .await
        .expect("the publisher logs in");
    let files = Files::new();
    let from_files = vec![
        ("HISTORY_VIEW_NATS_USER", "chv".to_owned()),
        (
            "HISTORY_VIEW_NATS_PASSWORD_FILE",
            files.write("password", &password),
        ),
    ];
    let app = worker(nats.url(), &from_files, &mongo, &database).await;
    serves_live(&app, &publisher).await;
    drop(app);

    let encoded = password
        .replace('@', "%40")
        .replace(':', "%3A")
        .replace('/', "%2F");
    let in_url = nats
        .url()
        .replace("nats://", &format!("nats://chv:{encoded}@"));
    let app = worker(in_url, &[], &mongo, &database).await;
    serves_live(&app, &publisher).await;
    let log = app.log_lines("");
    assert!(log.iter().all(|line| !line.contains(SECRET)), "{log:#?}");
}

/// Makes an operator, an account and two users with `nats-jwt` (the tools' venv): the operator's JWT, the account's
/// public key and JWT (which revokes the second user), and each user's creds file and public key.
const MAKE_JWTS: &str = r#"
import base64
import json
from datetime import datetime, timedelta
from nats_jwt.nkeys_ext import create_account_pair, create_operator_pair, create_user_pair
from nats_jwt.v2.account_claims import AccountClaims
from nats_jwt.v2.operator_claims import OperatorClaims
from nats_jwt.v2.user_claims import UserClaims

def creds(user, name):
    jwt = UserClaims(user.public_key.decode(), name).encode(account)
    return ("-----BEGIN NATS USER JWT-----\n" + jwt + "\n------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        "-----BEGIN USER NKEY SEED-----\n" + user.seed.decode() + "\n------END USER NKEY SEED------\n")

operator, account = create_operator_pair(), create_account_pair()
user, revoked = create_user_pair(), create_user_pair()
def b64(data):
    return base64.urlsafe_b64encode(data).decode().rstrip("=")

def revoking(account_jwt, user_key):
    # The account's JWT again with a revocation of every JWT of `user_key` issued before a minute from now (nats-jwt
    # does not write its revocations out), signed by the operator.
    header, payload, _ = account_jwt.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["nats"]["revocations"] = {user_key: int((datetime.now() + timedelta(minutes=1)).timestamp())}
    signed = header + "." + b64(json.dumps(claims).encode())
    return signed + "." + b64(operator.sign(signed.encode()))

account_jwt = revoking(AccountClaims(account.public_key.decode(), "aihub").encode(operator), revoked.public_key.decode())
print(json.dumps({
    "operator": OperatorClaims(operator.public_key.decode(), "chv-test").encode(operator),
    "account": account.public_key.decode(),
    "account_jwt": account_jwt,
    "creds": creds(user, "chat-history-view"),
    "revoked_creds": creds(revoked, "revoked"),
    "revoked_user": revoked.public_key.decode(),
}))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_creds_file_against_nats_in_operator_mode() {
    let output = std::process::Command::new(python())
        .args(["-c", MAKE_JWTS])
        .output()
        .expect("run the tools' python");
    assert!(
        output.status.success(),
        "nats-jwt (scripts/services.sh install puts it in the tools' venv): {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let made: serde_json::Value = serde_json::from_slice(&output.stdout).expect("the JWTs as JSON");
    let text = |key: &str| made[key].as_str().expect("a string").to_owned();
    let nats = NatsServer::start_with_config(&format!(
        "operator: {}\nresolver: MEMORY\nresolver_preload: {{ {}: {} }}\n",
        quoted(&text("operator")),
        text("account"),
        quoted(&text("account_jwt")),
    ));
    let files = Files::new();
    let creds = files.write("chv.creds", &text("creds"));
    let (mongo, database) = store().await;
    let publisher = ConnectOptions::new()
        .credentials_file(&creds)
        .await
        .expect("the creds file")
        .connect(nats.url())
        .await
        .expect("the publisher logs in with the creds file");
    let app = worker(
        nats.url(),
        &[("HISTORY_VIEW_NATS_CREDS_FILE", creds.clone())],
        &mongo,
        &database,
    )
    .await;
    serves_live(&app, &publisher).await;

    // Without a login the operator-mode server refuses the worker.
    drop(app);
    let refused = worker(nats.url(), &[], &mongo, &database).await;
    let lines = failures_after_retries(&refused, "client_error", 3).await;
    assert!(
        lines
            .iter()
            .all(|line| line.contains(r#""kind":"authorization_violation""#)),
        "{lines:#?}"
    );
    drop(refused);

    // A user its account revoked: the server says only "authorization violation", so the line names the user and
    // the account to look up.
    let revoked = files.write("revoked.creds", &text("revoked_creds"));
    let refused = worker(
        nats.url(),
        &[("HISTORY_VIEW_NATS_CREDS_FILE", revoked)],
        &mongo,
        &database,
    )
    .await;
    let lines = failures_after_retries(&refused, "client_error", 3).await;
    let login = format!(
        r#""login":"user {} of account {}""#,
        text("revoked_user"),
        text("account")
    );
    assert!(
        lines.iter().all(|line| {
            line.contains(r#""kind":"authorization_violation""#) && line.contains(&login)
        }),
        "{lines:#?}"
    );
}

/// Waits until the worker has seen `retries` connection events `event` (failed attempts, its NATS refusing it),
/// checks it is not ready, and returns its WARN lines `cannot connect to NATS`: one per kind per 30 s at most,
/// however many attempts (the count allowed grows with the time the test took, so a slow machine cannot fail it).
async fn failures_after_retries(app: &BinaryApp, event: &str, retries: u64) -> Vec<String> {
    let started = Instant::now();
    let series = &format!(r#"history_view_nats_connection_events_total{{event="{event}"}}"#);
    eventually_within(
        &format!("{retries} {event} events"),
        Duration::from_secs(60),
        || async move {
            let seen = metric(&app.api.metrics().await, series);
            when(seen >= retries as f64, || {
                format!("{seen}; the log:\n{}", app.log_lines("").join("\n"))
            })
        },
    )
    .await;
    assert_eq!(app.api.get("/readyz", &[]).await.status, 503);
    let lines = app.log_lines("cannot connect to NATS");
    let kinds: std::collections::BTreeSet<&str> = lines
        .iter()
        .filter_map(|line| line.split(r#""kind":""#).nth(1)?.split('"').next())
        .collect();
    let allowed = kinds.len() * (1 + (started.elapsed().as_secs() / 30) as usize + 1);
    assert!(
        !lines.is_empty(),
        "no WARN line:\n{}",
        app.log_lines("").join("\n")
    );
    assert!(
        lines.len() <= allowed,
        "{} lines for {retries} attempts:\n{lines:#?}",
        lines.len()
    );
    for line in &lines {
        assert!(line.contains(r#""level":"WARN""#), "{line}");
        assert!(line.contains(r#""nats_address":"nats://"#), "{line}");
    }
    lines
}

/// The binary with `env` only, run to its end: (exit status, stderr).
fn start_refused(env: &[(&str, String)]) -> (Option<i32>, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_chat-history-view"))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs(env.iter().map(|(name, value)| (*name, value.as_str())))
        .env("HISTORY_VIEW_LISTEN", "127.0.0.1:0")
        .output()
        .expect("run the binary");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.code(), all)
}

#[test]
fn settings_that_cannot_be_used_stop_the_start_naming_the_setting_not_the_secret() {
    let files = Files::new();
    let seed = nkeys::KeyPair::new_user().seed().expect("a seed");
    let secret_seed = files.write("seed", &seed);
    let secret_token = files.write("token", SECRET);
    let pem_with_secret = files.write(
        "ca.pem",
        &format!("-----BEGIN CERTIFICATE-----\n{SECRET}{SECRET}\n-----END CERTIFICATE-----\n"),
    );
    let bad_seed = files.write("bad-seed", &format!("SU{SECRET}"));
    let creds_without_seed = files.write(
        "no-seed.creds",
        &format!(
            "-----BEGIN NATS USER JWT-----\neyJ{SECRET}.eyJ.sig\n------END NATS USER JWT------\n"
        ),
    );
    // A user JWT that expired, and one not valid yet: the start says which (the server would only say
    // "authorization violation").
    let creds_with = |name: &str, claims: &str| {
        use base64::Engine as _;
        let encode = |text: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(text);
        let jwt = format!(
            "{}.{}.sig",
            encode(r#"{"typ":"JWT","alg":"ed25519-nkey"}"#),
            encode(claims)
        );
        let seed = nkeys::KeyPair::new_user().seed().expect("a seed");
        files.write(
            name,
            &format!(
                "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
                 -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
            ),
        )
    };
    for (creds, says) in [
        (
            creds_with("expired.creds", r#"{"exp":1700000000}"#),
            "expired at 2023-11-14T22:13:20Z",
        ),
        (
            creds_with("later.creds", r#"{"nbf":4100000000}"#),
            "not valid before 2099-12-03T",
        ),
    ] {
        let (status, output) = start_refused(&[("HISTORY_VIEW_NATS_CREDS_FILE", creds)]);
        assert_eq!(status, Some(2), "{output}");
        assert!(
            output.contains("HISTORY_VIEW_NATS_CREDS_FILE") && output.contains(says),
            "{output}"
        );
    }
    let cases: Vec<(Vec<(&str, String)>, &str)> = vec![
        (
            vec![(
                "HISTORY_VIEW_NATS_CREDS_FILE",
                "/no/such/chv.creds".to_owned(),
            )],
            "HISTORY_VIEW_NATS_CREDS_FILE",
        ),
        (
            vec![("HISTORY_VIEW_NATS_TLS_CA_FILE", pem_with_secret)],
            "HISTORY_VIEW_NATS_TLS_CA_FILE",
        ),
        (
            vec![("HISTORY_VIEW_NATS_NKEY_SEED_FILE", bad_seed)],
            "HISTORY_VIEW_NATS_NKEY_SEED_FILE",
        ),
        (
            vec![("HISTORY_VIEW_NATS_CREDS_FILE", creds_without_seed)],
            "HISTORY_VIEW_NATS_CREDS_FILE",
        ),
        (
            vec![
                (
                    "HISTORY_VIEW_NATS_URL",
                    format!("nats://{SECRET}@127.0.0.1:4222"),
                ),
                ("HISTORY_VIEW_NATS_TOKEN_FILE", secret_token.clone()),
            ],
            "HISTORY_VIEW_NATS_TOKEN_FILE",
        ),
        (
            vec![
                ("HISTORY_VIEW_NATS_NKEY_SEED_FILE", secret_seed),
                ("HISTORY_VIEW_NATS_TOKEN_FILE", secret_token),
            ],
            "HISTORY_VIEW_NATS_TOKEN_FILE",
        ),
        (
            vec![(
                "HISTORY_VIEW_NATS_TLS_CERT_FILE",
                files.write("cert.pem", "x"),
            )],
            "HISTORY_VIEW_NATS_TLS_KEY_FILE",
        ),
    ];
    for (env, named) in cases {
        let (status, output) = start_refused(&env);
        assert_eq!(status, Some(2), "{env:?}: {output}");
        assert!(
            output.contains(named),
            "{env:?} should name {named}: {output}"
        );
        assert!(
            !output.contains(SECRET),
            "{env:?} shows the secret: {output}"
        );
        assert!(
            !output.contains(&seed[2..]),
            "{env:?} shows the seed: {output}"
        );
    }
}
