//! `Proxy`: a TCP proxy between the worker and a server, which a test cuts (every connection closed, new ones
//! refused), leaves half-open (bytes vanish, nothing is closed) and restores, to make a lost link deterministic.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does with the bytes of its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    /// Forwards both ways.
    Open,
    /// Closes every connection and refuses new ones.
    Cut,
    /// Keeps every connection open and accepts new ones, but forwards nothing: what a NAT or a node's connection
    /// tracking that dropped its state does to a link.
    HalfOpen,
}

/// A running proxy; it stops with the test's runtime.
pub struct Proxy {
    address: SocketAddr,
    link: watch::Sender<Link>,
}

impl Proxy {
    /// Listens on a free local port and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy bind");
        let address = listener.local_addr().expect("proxy address");
        let (link, watch) = watch::channel(Link::Open);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                match *watch.borrow() {
                    // Cut: refuse by closing at once.
                    Link::Cut => drop(client),
                    Link::HalfOpen => drop(tokio::spawn(swallow(client, watch.clone()))),
                    Link::Open => drop(tokio::spawn(forward(client, upstream, watch.clone()))),
                }
            }
        });
        Self { address, link }
    }

    /// The proxy's address as a NATS URL.
    pub fn nats_url(&self) -> String {
        format!("nats://{}", self.address)
    }

    /// Closes every connection through the proxy and refuses new ones until [`Proxy::restore`].
    pub fn cut(&self) {
        self.link.send_replace(Link::Cut);
    }

    /// From now on bytes vanish both ways on every connection, old and new, and nothing is closed. The
    /// connections open now stay dead after [`Proxy::restore`], as a link whose state was dropped does.
    pub fn half_open(&self) {
        self.link.send_replace(Link::HalfOpen);
    }

    /// Lets new connections through again.
    pub fn restore(&self) {
        self.link.send_replace(Link::Open);
    }
}

/// Copies bytes both ways until either side closes or the link changes: a cut closes both ends, a half-open link
/// swallows the client's bytes from then on and keeps the server's end open but silent.
async fn forward(mut client: TcpStream, upstream: SocketAddr, mut link: watch::Receiver<Link>) {
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    let changed = tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => Link::Cut,
        changed = link.wait_for(|link| *link != Link::Open) => changed.map_or(Link::Cut, |link| *link),
    };
    if changed == Link::HalfOpen {
        // Held open until the client closes or the proxy is cut.
        swallow(client, link).await;
        drop(server);
        return;
    }
    // The link is gone; close both ends now.
    let _ = client.shutdown().await;
    let _ = server.shutdown().await;
}

/// Reads and drops the client's bytes until it closes or the proxy is cut; writes nothing.
async fn swallow(mut client: TcpStream, mut link: watch::Receiver<Link>) {
    let mut sink = vec![0u8; 16 * 1024];
    loop {
        tokio::select! {
            read = client.read(&mut sink) => if matches!(read, Ok(0) | Err(_)) { return },
            _ = link.wait_for(|link| *link == Link::Cut) => return,
        }
    }
}

/// A TCP balancer in front of workers, as a Service's endpoints are to clients: each new connection goes to the
/// worker routed to when it is accepted ([`Balancer::route_to`]), and an established one stays with its worker
/// until either side closes it (as kube-proxy's connection tracking keeps established flows when an endpoint is
/// removed).
pub struct Balancer {
    address: SocketAddr,
    upstream: watch::Sender<SocketAddr>,
}

impl Balancer {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("balancer bind");
        let address = listener.local_addr().expect("balancer address");
        let (upstream, routed) = watch::channel(upstream);
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let to = *routed.borrow();
                tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        Self { address, upstream }
    }

    /// The balancer's address as an HTTP base URL.
    pub fn http_url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// New connections go to `upstream` from now on.
    pub fn route_to(&self, upstream: SocketAddr) {
        self.upstream.send_replace(upstream);
    }
}
