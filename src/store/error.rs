//! `StoreError`: why a store query failed, and the sorting of the driver's errors into its variants: a rejection
//! (the query itself is wrong, retrying cannot help), an outage (the store is unreachable or stalled, so coverage
//! ends), another failure, or a missing hinted index (retried without the hint, [`super::hint`]).

use std::time::Duration;

use mongodb::error::{Error as MongoError, ErrorKind};

/// Why a store query failed. A read never answers a partial history: it answers 503, or 507 for `TooLarge`, or
/// 500 for `Rejected`.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("the store did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the store query failed")]
    Query(#[source] MongoError),
    /// The store refused the query itself (a command error other than a missing index): retrying cannot help.
    #[error("the store rejected the query")]
    Rejected(#[source] MongoError),
    /// The thread's events exceed `HISTORY_VIEW_MAX_THREAD_BYTES`: the read stopped there rather than hold them.
    #[error(
        "the thread's events exceed the per-thread limit of {limit} bytes (HISTORY_VIEW_MAX_THREAD_BYTES)"
    )]
    TooLarge { limit: usize },
}

impl StoreError {
    /// The `kind` labels of `history_view_store_errors_total`.
    pub const KINDS: [&'static str; 4] = ["timeout", "unavailable", "failed", "rejected"];

    /// Its `kind` label; `None` for a thread over the per-thread limit (the store answered; counted by
    /// `history_view_thread_limit_exceeded_total`).
    pub fn kind(&self) -> Option<&'static str> {
        match self {
            StoreError::Timeout(_) => Some(Self::KINDS[0]),
            StoreError::Query(_) if self.is_outage() => Some(Self::KINDS[1]),
            StoreError::Query(_) => Some(Self::KINDS[2]),
            StoreError::Rejected(_) => Some(Self::KINDS[3]),
            StoreError::TooLarge { .. } => None,
        }
    }

    /// Whether the failure means the store is unreachable or stalled (so aihub's persister most likely could not
    /// write either), as opposed to a command the store answered with an error.
    ///
    /// Chosen: a timeout and every driver error other than a command or write error count as an outage.
    pub fn is_outage(&self) -> bool {
        match self {
            StoreError::Timeout(_) => true,
            StoreError::Query(error) => !matches!(
                error.kind.as_ref(),
                ErrorKind::Command(_) | ErrorKind::Write(_)
            ),
            StoreError::Rejected(_) | StoreError::TooLarge { .. } => false,
        }
    }

    /// Sorts a driver error: a command error whose code says the query itself is wrong is a rejection (a
    /// missing hinted index never gets here, it is retried without the hint); anything else, transient command
    /// errors such as `MaxTimeMSExpired` included, a failure that a later read may not meet.
    pub(super) fn from_driver(error: MongoError) -> Self {
        match error.kind.as_ref() {
            ErrorKind::Command(command) if is_rejection(command.code) => {
                StoreError::Rejected(error)
            }
            _ => StoreError::Query(error),
        }
    }

    /// Whether the store said that a hinted index does not exist.
    pub(super) fn is_missing_index(&self) -> bool {
        match self {
            StoreError::Query(error) | StoreError::Rejected(error) => is_missing_index(error),
            _ => false,
        }
    }
}

impl From<MongoError> for StoreError {
    fn from(error: MongoError) -> Self {
        StoreError::from_driver(error)
    }
}

/// Whether a command error code says the query cannot succeed as sent, whenever it is retried. Chosen: BadValue
/// (2), FailedToParse (9), TypeMismatch (14), InvalidOptions (72), InvalidNamespace (73), CommandNotSupportedOnView
/// (166) and InvalidPipelineOperator (168); every other code is treated as possibly transient.
fn is_rejection(code: i32) -> bool {
    matches!(code, 2 | 9 | 14 | 72 | 73 | 166 | 168)
}

/// Whether the store rejected the hint itself: MongoDB and SecantusDB answer a hint naming no index with BadValue
/// (code 2) "hint ... does not correspond to an existing index", other servers with IndexNotFound (27), and a server
/// that does not know the option at all names the `hint` field. All mean: retry without the hint.
fn is_missing_index(error: &MongoError) -> bool {
    match error.kind.as_ref() {
        ErrorKind::Command(command) => {
            command.code == 27
                || command.code_name == "IndexNotFound"
                || command.message.to_ascii_lowercase().contains("hint")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use mongodb::bson::{doc, from_document};
    use mongodb::error::CommandError;

    use super::*;

    /// The driver's error for a command the store answered with `code`, `code_name` and `message`.
    fn command(code: i32, code_name: &str, message: &str) -> MongoError {
        let command: CommandError =
            from_document(doc! {"code": code, "codeName": code_name, "errmsg": message}).unwrap();
        MongoError::from(ErrorKind::Command(command))
    }

    /// The driver's error for a connection that broke.
    fn io() -> MongoError {
        let broken = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        MongoError::from(ErrorKind::Io(Arc::new(broken)))
    }

    #[test]
    fn a_command_error_whose_code_says_the_query_is_wrong_is_a_rejection() {
        for (code, name) in [
            (2, "BadValue"),
            (9, "FailedToParse"),
            (14, "TypeMismatch"),
            (72, "InvalidOptions"),
            (73, "InvalidNamespace"),
            (166, "CommandNotSupportedOnView"),
            (168, "InvalidPipelineOperator"),
        ] {
            let error = StoreError::from(command(code, name, "no"));
            assert!(matches!(error, StoreError::Rejected(_)), "{name}");
            assert_eq!(error.kind(), Some("rejected"), "{name}");
            assert!(!error.is_outage(), "{name}");
        }
    }

    #[test]
    fn other_command_errors_are_failures_and_a_broken_connection_an_outage() {
        // MaxTimeMSExpired, NotWritablePrimary, InterruptedAtShutdown: a later read may not meet them.
        for (code, name) in [
            (50, "MaxTimeMSExpired"),
            (10107, "NotWritablePrimary"),
            (11600, "InterruptedAtShutdown"),
        ] {
            let error = StoreError::from(command(code, name, "try again"));
            assert!(matches!(error, StoreError::Query(_)), "{name}");
            assert_eq!(error.kind(), Some("failed"), "{name}");
            assert!(!error.is_outage(), "{name}");
        }
        let broken = StoreError::from(io());
        assert!(matches!(broken, StoreError::Query(_)));
        assert_eq!(broken.kind(), Some("unavailable"));
        assert!(broken.is_outage());
    }

    #[test]
    fn a_timeout_is_an_outage_and_a_thread_over_the_limit_no_store_error_at_all() {
        let timeout = StoreError::Timeout(Duration::from_secs(2));
        assert_eq!(timeout.kind(), Some("timeout"));
        assert!(timeout.is_outage());
        let too_large = StoreError::TooLarge { limit: 1 << 20 };
        assert_eq!(too_large.kind(), None);
        assert!(!too_large.is_outage());
        assert!(!too_large.is_missing_index());
        // Every kind a query can report is a preset label of history_view_store_errors_total.
        for error in [
            timeout,
            StoreError::from(io()),
            StoreError::from(command(50, "", "")),
        ] {
            assert!(StoreError::KINDS.contains(&error.kind().unwrap()));
        }
    }

    #[test]
    fn a_missing_hinted_index_is_known_by_its_code_name_or_message() {
        for (code, name, message) in [
            (27, "", "whatever"),
            (0, "IndexNotFound", "whatever"),
            (
                2,
                "BadValue",
                "error processing query: hint provided does not correspond to an existing index",
            ),
            (9, "FailedToParse", "unknown field: 'HINT'"),
        ] {
            let error = StoreError::from(command(code, name, message));
            assert!(error.is_missing_index(), "{code} {name} {message}");
        }
        for (code, name, message) in [
            (2, "BadValue", "$in needs an array"),
            (50, "MaxTimeMSExpired", "operation exceeded time limit"),
        ] {
            let error = StoreError::from(command(code, name, message));
            assert!(!error.is_missing_index(), "{code} {name} {message}");
        }
        assert!(!StoreError::from(io()).is_missing_index());
        assert!(!StoreError::Timeout(Duration::from_secs(1)).is_missing_index());
    }
}
