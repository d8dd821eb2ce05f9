//! The index hints ([design 2b](../../docs/design.md#2b)): both hydration stages name the thread index, a fill the
//! display index; when the store says a hinted index does not exist, the query runs again without it, that is
//! logged once per process and index and counted, and the hint is not named again for [`MISSING_INDEX_RECHECK`].
//!
//! One lock, `IndexHint::missing_until`, a std mutex taken alone and never held across an `.await`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::{StoreError, StoreMetrics};

/// How long a hinted index found missing is not named again: queries run unhinted meanwhile, then the hint is
/// tried again (the index may have been built since).
const MISSING_INDEX_RECHECK: Duration = Duration::from_secs(300);

/// One configured hint, whether its missing index was already logged (once per process and index), and until
/// when it is known to be missing.
pub(super) struct IndexHint {
    name: Option<String>,
    missing_logged: AtomicBool,
    missing_until: std::sync::Mutex<Option<Instant>>,
}

impl IndexHint {
    pub(super) fn new(name: Option<String>) -> Self {
        Self {
            name,
            missing_logged: AtomicBool::new(false),
            missing_until: std::sync::Mutex::new(None),
        }
    }

    /// The hint to name now: none while the index is known to be missing.
    fn current(&self) -> Option<&str> {
        let missing = self
            .missing_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some_and(|until| Instant::now() < until);
        if missing { None } else { self.name.as_deref() }
    }

    fn found_missing(&self) {
        *self
            .missing_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(Instant::now() + MISSING_INDEX_RECHECK);
    }

    /// Runs `run` with this hint (unless its index was found missing within the last few minutes); if the store
    /// rejects the hint because the index is missing, runs it again without one and remembers that (counted in
    /// `history_view_index_hint_fallbacks_total`, logged once per process).
    pub(super) async fn with_fallback<'a, T, F, Fut>(
        &'a self,
        metrics: &StoreMetrics,
        run: F,
    ) -> Result<T, StoreError>
    where
        F: Fn(Option<&'a str>) -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let name = self.current();
        match run(name).await {
            Err(error) if name.is_some() && error.is_missing_index() => {
                metrics.index_hint_fallback();
                self.found_missing();
                if !self.missing_logged.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        index = name.unwrap_or_default(),
                        recheck_secs = MISSING_INDEX_RECHECK.as_secs(),
                        "The hinted index does not exist; history reads fall back to unhinted queries and will be \
                         slower (the hint is tried again every few minutes)"
                    );
                }
                run(None).await
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use mongodb::bson::{doc, from_document};
    use mongodb::error::{CommandError, Error as MongoError, ErrorKind};

    use super::*;
    use crate::metrics::{Exposition, registered};

    /// The store's metric set on a registry of its own.
    struct Metrics {
        store: StoreMetrics,
        exposition: Exposition,
    }

    impl Metrics {
        fn new() -> Self {
            let (store, exposition) = registered(StoreMetrics::register);
            Self { store, exposition }
        }

        fn render(&self) -> String {
            self.exposition.render()
        }
    }

    fn missing_index() -> StoreError {
        let message = "hint provided does not correspond to an existing index";
        let command: CommandError =
            from_document(doc! {"code": 2, "codeName": "BadValue", "errmsg": message}).unwrap();
        StoreError::from(MongoError::from(ErrorKind::Command(command)))
    }

    fn fallbacks(metrics: &Metrics) -> String {
        metrics
            .render()
            .lines()
            .find(|line| line.starts_with("history_view_index_hint_fallbacks_total "))
            .unwrap()
            .to_owned()
    }

    #[tokio::test(start_paused = true)]
    async fn a_missing_index_runs_the_query_again_unhinted_and_is_not_named_for_five_minutes() {
        let metrics = Metrics::new();
        let hint = IndexHint::new(Some("thread_index".to_owned()));
        let named = Mutex::new(Vec::new());
        let run = |name: Option<&str>| {
            named.lock().unwrap().push(name.map(str::to_owned));
            let hinted = name.is_some();
            async move { if hinted { Err(missing_index()) } else { Ok(7) } }
        };
        assert_eq!(hint.with_fallback(&metrics.store, run).await.unwrap(), 7);
        assert_eq!(
            *named.lock().unwrap(),
            [Some("thread_index".to_owned()), None]
        );
        assert_eq!(
            fallbacks(&metrics),
            "history_view_index_hint_fallbacks_total 1"
        );
        // Known missing: unhinted at once, until the recheck is due; then the hint is tried again.
        assert_eq!(hint.current(), None);
        tokio::time::advance(MISSING_INDEX_RECHECK - Duration::from_millis(1)).await;
        assert_eq!(hint.current(), None);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(hint.current(), Some("thread_index"));
    }

    #[tokio::test]
    async fn other_errors_and_an_unhinted_query_are_not_run_again() {
        let metrics = Metrics::new();
        let runs = Mutex::new(0);
        let timeout = |_: Option<&str>| {
            *runs.lock().unwrap() += 1;
            async { Err::<(), _>(StoreError::Timeout(Duration::from_secs(1))) }
        };
        let hinted = IndexHint::new(Some("thread_index".to_owned()));
        assert!(matches!(
            hinted.with_fallback(&metrics.store, timeout).await,
            Err(StoreError::Timeout(_))
        ));
        assert_eq!(hinted.current(), Some("thread_index"));
        // No hint configured: a missing-index answer cannot be about a hint, so it is the query's error.
        let unhinted = IndexHint::new(None);
        let missing = |_: Option<&str>| {
            *runs.lock().unwrap() += 1;
            async { Err::<(), _>(missing_index()) }
        };
        assert!(
            unhinted
                .with_fallback(&metrics.store, missing)
                .await
                .is_err()
        );
        assert_eq!(*runs.lock().unwrap(), 2);
        assert_eq!(
            fallbacks(&metrics),
            "history_view_index_hint_fallbacks_total 0"
        );
    }
}
