//! What bounds one store query: the read's deadline, sent to the store as the query's `maxTimeMS`, and a budget of
//! bytes its rows may hold before it stops with [`StoreError::TooLarge`] (`HISTORY_VIEW_MAX_THREAD_BYTES`), so a
//! huge thread fails in bounded memory instead of being held whole.

use std::time::Duration;

use tokio::time::Instant;

use super::StoreError;

/// What bounds one query: the read's deadline (its `maxTimeMS` is the time left) and the bytes of compact events
/// (or displays, for stage 1) it may hold before it stops with [`StoreError::TooLarge`].
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub deadline: Instant,
    pub budget: usize,
}

impl Bounds {
    /// The query's `maxTimeMS`: the read's time left (at least a millisecond, which the store reads as a limit;
    /// zero would mean none).
    pub fn max_time(&self) -> Duration {
        self.deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    }

    /// A count of the bytes a query's rows hold, against this budget.
    pub(super) fn spend(&self) -> Spent {
        Spent {
            bytes: 0,
            budget: self.budget,
        }
    }
}

/// The bytes a query's rows held so far, and its budget.
pub(super) struct Spent {
    bytes: usize,
    budget: usize,
}

impl Spent {
    /// Counts a row of `bytes`.
    ///
    /// # Errors
    /// [`StoreError::TooLarge`], naming the budget, once the rows hold more than it (exactly the budget is allowed).
    pub(super) fn add(&mut self, bytes: usize) -> Result<(), StoreError> {
        self.bytes += bytes;
        if self.bytes > self.budget {
            return Err(StoreError::TooLarge { limit: self.budget });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn max_time_is_the_time_left_and_never_zero() {
        let bounds = Bounds {
            deadline: Instant::now() + Duration::from_millis(2_500),
            budget: 0,
        };
        assert_eq!(bounds.max_time(), Duration::from_millis(2_500));
        tokio::time::advance(Duration::from_millis(2_000)).await;
        assert_eq!(bounds.max_time(), Duration::from_millis(500));
        // At and past the deadline: one millisecond, since a maxTimeMS of zero would mean no limit at all.
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(bounds.max_time(), Duration::from_millis(1));
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(bounds.max_time(), Duration::from_millis(1));
    }

    #[test]
    fn rows_may_fill_the_budget_exactly_and_one_byte_more_is_too_large() {
        let bounds = Bounds {
            deadline: Instant::now(),
            budget: 100,
        };
        let mut spent = bounds.spend();
        assert!(spent.add(60).is_ok());
        assert!(spent.add(40).is_ok());
        assert!(matches!(
            spent.add(1),
            Err(StoreError::TooLarge { limit: 100 })
        ));
        let mut spent = bounds.spend();
        assert!(matches!(
            spent.add(101),
            Err(StoreError::TooLarge { limit: 100 })
        ));
        let nothing = Bounds {
            deadline: Instant::now(),
            budget: 0,
        };
        assert!(nothing.spend().add(0).is_ok());
        assert!(nothing.spend().add(1).is_err());
    }
}
