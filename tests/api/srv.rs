//! `mongodb+srv://` URIs: the worker resolves the store's SRV record through the system's resolver configuration,
//! starts even when that fails (readiness names the store), and keeps trying until it resolves.
//!
//! The resolution that succeeds is real: the worker runs in a mount namespace of its own (`unshare`, as root) whose
//! `/etc/resolv.conf` names a DNS responder of the test's, on a loopback address of its own, which answers the SRV
//! record with the Mongo-wire server's port and the host's A record with 127.0.0.1.

use std::ffi::OsString;
use std::net::{Ipv4Addr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::helpers::{Api, BinaryApp, TestStore, chunk_row, turns, unique, user_row};
use test_support::servers::{MongoServer, NatsServer};
use test_support::wait::{eventually, when};

/// The SRV name of the URI and the host its record names (which must share the URI's parent domain).
const SRV_HOST: &str = "db.chv.test";
const STORE_HOST: &str = "mongo.chv.test";

/// A DNS responder on UDP port 53 of `address`. Until `answering` is set it answers every query SERVFAIL; then
/// the SRV record of [`SRV_HOST`] (pointing at `STORE_HOST:port`), the A record of [`STORE_HOST`], no TXT
/// record, and NXDOMAIN for anything else.
struct Responder {
    answering: Arc<AtomicBool>,
    srv_queries: Arc<AtomicU64>,
}

impl Responder {
    fn start(address: Ipv4Addr, store_port: u16) -> Self {
        let socket = UdpSocket::bind((address, 53))
            .expect("bind UDP port 53 on a loopback address (needs root)");
        let answering = Arc::new(AtomicBool::new(false));
        let srv_queries = Arc::new(AtomicU64::new(0));
        let (on, count) = (Arc::clone(&answering), Arc::clone(&srv_queries));
        std::thread::spawn(move || {
            let mut buffer = [0u8; 1500];
            while let Ok((len, peer)) = socket.recv_from(&mut buffer) {
                if let Some(reply) = respond(
                    &buffer[..len],
                    on.load(Ordering::SeqCst),
                    store_port,
                    &count,
                ) {
                    let _ = socket.send_to(&reply, peer);
                }
            }
        });
        Self {
            answering,
            srv_queries,
        }
    }
}

const TYPE_A: u16 = 1;
const TYPE_SRV: u16 = 33;
const SERVFAIL: u8 = 2;
const NXDOMAIN: u8 = 3;

/// The reply to one DNS query (RFC 1035 4.1), or nothing for a packet that is not one.
fn respond(
    query: &[u8],
    answering: bool,
    store_port: u16,
    srv_queries: &AtomicU64,
) -> Option<Vec<u8>> {
    if query.len() < 12 || query[2] & 0x80 != 0 {
        return None;
    }
    let mut at = 12;
    let mut labels = Vec::new();
    loop {
        let len = usize::from(*query.get(at)?);
        at += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(query.get(at..at + len)?).to_ascii_lowercase());
        at += len;
    }
    let qtype = u16::from_be_bytes([*query.get(at)?, *query.get(at + 1)?]);
    let question = query.get(12..at + 4)?;
    let name = labels.join(".");
    let srv_name = format!("_mongodb._tcp.{SRV_HOST}");
    if name == srv_name {
        srv_queries.fetch_add(1, Ordering::SeqCst);
    }
    let (rcode, answer): (u8, Option<(u16, Vec<u8>)>) = if !answering {
        (SERVFAIL, None)
    } else if name == srv_name && qtype == TYPE_SRV {
        let mut data = vec![0, 0, 0, 0];
        data.extend_from_slice(&store_port.to_be_bytes());
        for label in STORE_HOST.split('.') {
            data.push(label.len() as u8);
            data.extend_from_slice(label.as_bytes());
        }
        data.push(0);
        (0, Some((TYPE_SRV, data)))
    } else if name == STORE_HOST && qtype == TYPE_A {
        (0, Some((TYPE_A, vec![127, 0, 0, 1])))
    } else if name == srv_name || name == SRV_HOST || name == STORE_HOST {
        (0, None) // the name exists, without a record of this type (the TXT and AAAA queries)
    } else {
        (NXDOMAIN, None)
    };
    let mut reply = query[..2].to_vec();
    reply.push(0x84 | (query[2] & 0x01)); // a response, authoritative, recursion desired as asked
    reply.push(0x80 | rcode); // recursion available
    reply.extend_from_slice(&[0, 1, 0, u8::from(answer.is_some()), 0, 0, 0, 0]);
    reply.extend_from_slice(question);
    if let Some((kind, data)) = answer {
        reply.extend_from_slice(&[0xC0, 12]); // the question's name
        reply.extend_from_slice(&kind.to_be_bytes());
        reply.extend_from_slice(&[0, 1, 0, 0, 0, 30]); // class IN, TTL 30 s
        reply.extend_from_slice(&(data.len() as u16).to_be_bytes());
        reply.extend_from_slice(&data);
    }
    Some(reply)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_srv_uri_that_does_not_resolve_yet_leaves_the_worker_up_until_it_does() {
    let nats = NatsServer::start();
    let mongo = MongoServer::start();
    let database = unique("srv");
    let thread = "t-srv";
    TestStore::connect(&mongo.uri(), &database)
        .await
        .insert_rows(&[
            user_row(thread, "d1", "e1", 1, "Q"),
            chunk_row(thread, "d1", "A", "e2", 2, "answer"),
        ])
        .await;

    // A loopback address of this test's own, so parallel runs do not share port 53.
    let pid = std::process::id();
    let address = Ipv4Addr::new(127, 53, (pid >> 8) as u8, pid as u8 | 1);
    let responder = Responder::start(address, mongo.port());
    let dir = std::env::temp_dir().join(format!("chv-srv-{pid}"));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let resolv_conf = dir.join("resolv.conf");
    std::fs::write(
        &resolv_conf,
        format!("nameserver {address}\noptions timeout:1 attempts:1\n"),
    )
    .expect("write resolv.conf");

    // The worker in a mount namespace whose /etc/resolv.conf is the one above.
    let wrapper: Vec<OsString> = vec![
        "--mount".into(),
        "--propagation".into(),
        "private".into(),
        "sh".into(),
        "-c".into(),
        r#"mount --bind "$0" /etc/resolv.conf && exec "$1""#.into(),
        resolv_conf.clone().into(),
        env!("CARGO_BIN_EXE_chat-history-view").into(),
    ];
    let app = BinaryApp::start_command(
        "unshare".into(),
        wrapper,
        &[
            ("HISTORY_VIEW_NATS_URL", nats.url()),
            (
                "HISTORY_VIEW_MONGODB_URI",
                format!("mongodb+srv://{SRV_HOST}/?tls=false"),
            ),
            ("HISTORY_VIEW_MONGODB_DATABASE", database.clone()),
            ("HISTORY_VIEW_STORE_TIMEOUT_MS", "1000".into()),
        ],
    )
    .await;

    // Started although the store's address does not resolve: alive, not ready, the store named.
    assert_eq!(app.api.get("/healthz", &[]).await.status, 200);
    let not_ready = app.api.get("/readyz", &[]).await;
    assert_eq!(not_ready.status, 503, "{}", not_ready.body);
    assert_eq!(
        not_ready.json()["checks"]["store"]["ok"],
        false,
        "{}",
        not_ready.body
    );
    let read = app.api.history(thread, "").await;
    assert_eq!(read.status, 503, "{}", read.body);
    assert_eq!(read.json()["error"]["code"], "store_unavailable");
    // It keeps trying.
    let asked = responder.srv_queries.load(Ordering::SeqCst);
    let queries = &responder.srv_queries;
    eventually("the SRV record asked for again", || {
        let now = queries.load(Ordering::SeqCst);
        let again = when(now >= asked + 2, || {
            format!("{} queries since", now - asked)
        });
        async move { again }
    })
    .await;

    // Once the name resolves, the worker becomes ready by itself and reads the store behind the SRV record.
    responder.answering.store(true, Ordering::SeqCst);
    app.wait_ready().await;
    let read = Api::new(app.api.address.clone()).history(thread, "").await;
    assert_eq!(read.status, 200, "{}", read.body);
    assert_eq!(
        read.json()["messages"],
        turns(&[("user", "Q"), ("assistant", "answer")])
    );
    let _ = std::fs::remove_dir_all(&dir);
}
