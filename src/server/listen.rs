//! The HTTP/1.1 accept loop: the axum router served over hyper with the limits `axum::serve`
//! lacks. A connection must deliver each request's headers within the header timeout (which also
//! closes idle keep-alive and silent connections), at most `max_connections` are open at once
//! (more wait in the kernel's backlog, so /health keeps answering instead of the process running
//! out of file descriptors), and shutdown stops accepting, then gives open connections a deadline.

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// The connection limits (`lily serve` flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_connections: usize,
    /// Time to receive a request's headers, counted from when the connection starts waiting for
    /// them (a new connection, or an idle keep-alive one).
    pub header_timeout: Duration,
    /// How long open connections may finish after shutdown begins.
    pub shutdown_deadline: Duration,
}

/// Serves `app` on `listener` until `shutdown` completes, then drains open connections for at
/// most `limits.shutdown_deadline`.
pub async fn serve(listener: TcpListener, app: Router, limits: Limits, shutdown: impl Future<Output = ()>) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break,
            },
            _ = &mut shutdown => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: wait, go on.
                    eprintln!("lily: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).keep_alive(true);
        let conn = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(slot);
        });
    }
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(limits.shutdown_deadline) => eprintln!("lily: shutdown deadline passed; closing the connections still open"),
    }
}
