//! `Proxy`: a TCP proxy between the worker and a server, which a test cuts (every connection closed, new ones
//! refused) and restores, to make a lost link deterministic.

use std::net::SocketAddr;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy; it stops with the test's runtime.
pub struct Proxy {
    address: SocketAddr,
    open: watch::Sender<bool>,
}

impl Proxy {
    /// Listens on a free local port and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy bind");
        let address = listener.local_addr().expect("proxy address");
        let (open, watch) = watch::channel(true);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if !*watch.borrow() {
                    // Cut: refuse by closing at once.
                    drop(client);
                    continue;
                }
                tokio::spawn(forward(client, upstream, watch.clone()));
            }
        });
        Self { address, open }
    }

    /// The proxy's address as a NATS URL.
    pub fn nats_url(&self) -> String {
        format!("nats://{}", self.address)
    }

    /// Closes every connection through the proxy and refuses new ones until [`Proxy::restore`].
    pub fn cut(&self) {
        self.open.send_replace(false);
    }

    /// Lets connections through again.
    pub fn restore(&self) {
        self.open.send_replace(true);
    }
}

/// Copies bytes both ways until either side closes or the proxy is cut.
async fn forward(mut client: TcpStream, upstream: SocketAddr, mut open: watch::Receiver<bool>) {
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        _ = open.wait_for(|open| !*open) => {}
    }
    // Either way the link is gone; close both ends now.
    let _ = client.shutdown().await;
    let _ = server.shutdown().await;
}
