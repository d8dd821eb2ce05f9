//! Waiting on state, never on time: [`eventually`] polls a probe until it reports the state a test waits for, and
//! fails at its limit naming what it waited for and the last state it saw. Every limit goes through [`scaled`], so
//! a slow machine raises them all with one setting, `TEST_TIME_SCALE` (a factor, default 1; for example
//! `TEST_TIME_SCALE=3 make test`). A limit only bounds how long a broken test takes to fail: a passing test never
//! waits it out.

use std::future::Future;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long [`eventually`] waits unless told otherwise (before scaling).
pub const LIMIT: Duration = Duration::from_secs(20);

/// The factor every limit is multiplied by: `TEST_TIME_SCALE` (a positive number), 1 when unset.
///
/// # Panics
/// On a value that is not a positive number, naming the setting.
pub fn time_scale() -> f64 {
    static SCALE: OnceLock<f64> = OnceLock::new();
    *SCALE.get_or_init(|| match std::env::var("TEST_TIME_SCALE") {
        Err(_) => 1.0,
        Ok(raw) => match raw.trim().parse::<f64>() {
            Ok(scale) if scale.is_finite() && scale > 0.0 => scale,
            _ => panic!("TEST_TIME_SCALE must be a positive number, not {raw:?}"),
        },
    })
}

/// `limit` times [`time_scale`].
pub fn scaled(limit: Duration) -> Duration {
    limit.mul_f64(time_scale())
}

/// Polls `probe` until it answers `Ok`, and returns that value. `Err(state)` says what the probe saw instead; the
/// last one is in the failure message. Polls every 10 ms at first, backing off to every 100 ms.
///
/// # Panics
/// When the probe has not answered `Ok` within [`LIMIT`], scaled.
pub async fn eventually<T, F, Fut>(what: &str, probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    eventually_within(what, LIMIT, probe).await
}

/// [`eventually`] with a limit of its own (scaled).
///
/// # Panics
/// When the probe has not answered `Ok` within `limit`, scaled.
pub async fn eventually_within<T, F, Fut>(what: &str, limit: Duration, probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    poll_within(limit, probe).await.unwrap_or_else(|state| {
        panic!("{what}: not within {:?}; last seen: {state}", scaled(limit))
    })
}

/// [`eventually_within`] for a caller that handles the limit itself: `Err` with the last state the probe saw when
/// it has not answered `Ok` within `limit`, scaled (a process that has not exited, say, where that is an answer).
pub async fn poll_within<T, F, Fut>(limit: Duration, mut probe: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let limit = scaled(limit);
    let started = Instant::now();
    let mut pause = Duration::from_millis(10);
    loop {
        match probe().await {
            Ok(value) => return Ok(value),
            Err(state) if started.elapsed() >= limit => return Err(state),
            Err(_) => {}
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// `future`'s output, or a failure naming `what` when it has not finished within `limit`, scaled: a bound on a
/// wait that is a future of its own (a child's next line, a task's end) rather than a state to poll.
///
/// # Panics
/// When `future` has not finished within `limit`, scaled.
pub async fn within<F: Future>(what: &str, limit: Duration, future: F) -> F::Output {
    let limit = scaled(limit);
    tokio::time::timeout(limit, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {limit:?}"))
}

/// `Ok(())` when `condition` holds, else `Err(state())`: a probe's answer for a plain condition.
pub fn when(condition: bool, state: impl FnOnce() -> String) -> Result<(), String> {
    if condition { Ok(()) } else { Err(state()) }
}
