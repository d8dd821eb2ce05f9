//! What the store side of one cache entry is doing: one state ([`Work`]) owned by [`StoreSide`], and the outcome
//! of each store job handed to the readers that waited for it ([`Outcome`]), never inferred by them.
//!
//! At most one store job runs per entry: a hydration (on a read, or the background re-read) or a fill. A reader
//! that needs the store calls [`StoreSide::begin_hydration`]: it either starts a hydration (and gets the job's
//! [`Ticket`], which it must run) or joins the job in flight (and gets a [`Waiter`] for its outcome). A live marker
//! on a display the view has not read calls [`StoreSide::want_fill`]: a fill is queued now if nothing runs, or
//! follows the job in flight.
//!
//! ```text
//!            begin_hydration               finish
//!   Idle ───────────────────▶ Hydrating ──────────▶ Idle, or FillQueued if a fill was wanted meanwhile
//!     │ want_fill
//!     ▼          fill_reading               finish
//!   FillQueued ──────────────▶ Filling ────────────▶ Idle, or FillQueued if a fill was wanted meanwhile
//! ```
//!
//! A ticket dropped unfinished (its reader went away, the fill queue was full, the service stops) returns the
//! entry to `Idle`, and its waiters look at the view again. A fill wanted meanwhile is dropped with it, which is
//! safe: the view keeps the display as uncovered, so it is not complete, and its next read hydrates.
//!
//! Lock: one std mutex over the state, held only for a transition: never across an `.await` and never while taking
//! another lock (it is the last in the entry's lock order, see [`super::entry`]).

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use tokio::sync::watch;

/// How a store job ended, as its waiters learn it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A hydration read the store and merged it: its waiters answer from the view as it is now, complete or not
    /// (within the persister-lag bound it stays partial; reading the store again would answer the same).
    Hydrated,
    /// The store failed, no hydration slot freed in time, or the thread is too large: waiters fail too, instead
    /// of queueing one store timeout after another.
    Failed,
    /// A fill ended (or had nothing to do), or a job was dropped unfinished: waiters look at the view again.
    LookAgain,
}

/// The store side's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Work {
    /// No store job: a reader that needs the store starts a hydration.
    Idle,
    /// A hydration runs; `fill_after`: a live marker asked for a fill meanwhile.
    Hydrating { fill_after: bool },
    /// A fill waits in the fill queue and has not read which displays to fill: a display uncovered now is
    /// picked up by it.
    FillQueued,
    /// A fill has read which displays to fill; a display uncovered now needs another fill (`fill_after`).
    Filling { fill_after: bool },
}

struct State {
    work: Work,
    /// The outcome channel of the job in `work`; `None` while idle.
    done: Option<watch::Receiver<Option<Outcome>>>,
    /// A background re-read is scheduled (its timer runs): a view deferred again does not schedule another.
    reread_scheduled: bool,
}

/// The store side of one entry. Its state is shared with the entry's [`Ticket`]s, which may wait in the fill
/// queue apart from the entry; it is allocated when first needed (most entries streamed in live never need it).
pub struct StoreSide {
    state: OnceLock<Arc<Mutex<State>>>,
}

/// What [`StoreSide::begin_hydration`] gave the caller.
pub enum Begin {
    /// The caller runs the hydration and finishes the ticket.
    Run(Ticket),
    /// A job runs: the caller waits for its outcome.
    Wait(Waiter),
}

/// The right and the duty to run the entry's one store job: [`Ticket::finish`] hands waiters the outcome.
pub struct Ticket {
    state: Arc<Mutex<State>>,
    /// `None` once finished.
    done: Option<watch::Sender<Option<Outcome>>>,
}

/// A wait for the outcome of the job in flight when it was made.
pub struct Waiter(watch::Receiver<Option<Outcome>>);

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // Every transition is a few plain assignments: a panic cannot leave a torn state.
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

impl StoreSide {
    pub fn new() -> Self {
        Self {
            state: OnceLock::new(),
        }
    }

    /// The state, allocated with the entry's first store job or question about one.
    fn state(&self) -> &Arc<Mutex<State>> {
        self.state.get_or_init(|| {
            Arc::new(Mutex::new(State {
                work: Work::Idle,
                done: None,
                reread_scheduled: false,
            }))
        })
    }

    /// Starts a hydration if no store job runs, otherwise joins the one that does.
    pub fn begin_hydration(&self) -> Begin {
        let mut state = lock(self.state());
        match &state.done {
            Some(done) => Begin::Wait(Waiter(done.clone())),
            None => Begin::Run(start(
                self.state(),
                &mut state,
                Work::Hydrating { fill_after: false },
            )),
        }
    }

    /// A live marker landed on a display the view has not read. Returns a fill's ticket for the caller to queue
    /// when no store job runs; otherwise the job in flight is followed by a fill (or, a fill not started yet, picks
    /// the display up itself).
    pub fn want_fill(&self) -> Option<Ticket> {
        let mut state = lock(self.state());
        match state.work {
            Work::Idle => Some(start(self.state(), &mut state, Work::FillQueued)),
            Work::Hydrating { .. } => {
                state.work = Work::Hydrating { fill_after: true };
                None
            }
            Work::FillQueued => None,
            Work::Filling { .. } => {
                state.work = Work::Filling { fill_after: true };
                None
            }
        }
    }

    /// Whether a re-read may be scheduled now (none is); the caller schedules it and calls
    /// [`StoreSide::reread_due`] when its timer fires.
    pub fn schedule_reread(&self) -> bool {
        !std::mem::replace(&mut lock(self.state()).reread_scheduled, true)
    }

    /// The re-read's timer fired: a view deferred from now on may schedule another.
    pub fn reread_due(&self) {
        lock(self.state()).reread_scheduled = false;
    }

    #[cfg(test)]
    fn work(&self) -> Work {
        lock(self.state()).work
    }
}

/// Moves an idle side into `work` with a new outcome channel.
fn start(shared: &Arc<Mutex<State>>, state: &mut State, work: Work) -> Ticket {
    debug_assert!(state.done.is_none(), "one store job at a time");
    let (done, waiters) = watch::channel(None);
    state.work = work;
    state.done = Some(waiters);
    Ticket {
        state: Arc::clone(shared),
        done: Some(done),
    }
}

impl Ticket {
    /// The fill has read which displays it fills: a display uncovered from now on needs a fill of its own.
    pub fn fill_reading(&self) {
        let mut state = lock(&self.state);
        if state.work == Work::FillQueued {
            state.work = Work::Filling { fill_after: false };
        }
    }

    /// Ends the job and hands `outcome` to its waiters. Returns the ticket of the fill wanted meanwhile, for the
    /// caller to queue (none after a failure: the view is partial, its next read hydrates).
    pub fn finish(mut self, outcome: Outcome) -> Option<Ticket> {
        let done = self.done.take()?;
        let mut state = lock(&self.state);
        let fill_after = matches!(
            state.work,
            Work::Hydrating { fill_after: true } | Work::Filling { fill_after: true }
        );
        state.work = Work::Idle;
        state.done = None;
        // Err: nobody waited; nothing to tell.
        let _ = done.send(Some(outcome));
        (fill_after && outcome != Outcome::Failed)
            .then(|| start(&self.state, &mut state, Work::FillQueued))
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.done.take().is_some() {
            // Unfinished: the side is free again and the waiters, their sender gone, look again.
            let mut state = lock(&self.state);
            state.work = Work::Idle;
            state.done = None;
        }
    }
}

impl Waiter {
    /// The job's outcome; `LookAgain` if it was dropped unfinished.
    pub async fn outcome(mut self) -> Outcome {
        match self.0.wait_for(Option::is_some).await {
            Ok(outcome) => outcome.unwrap_or(Outcome::LookAgain),
            Err(_) => Outcome::LookAgain,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(begin: Begin) -> Ticket {
        match begin {
            Begin::Run(ticket) => ticket,
            Begin::Wait(_) => panic!("expected to run the job"),
        }
    }

    fn wait(begin: Begin) -> Waiter {
        match begin {
            Begin::Wait(waiter) => waiter,
            Begin::Run(_) => panic!("expected to wait"),
        }
    }

    #[tokio::test]
    async fn readers_after_the_first_wait_for_its_hydration_and_get_its_outcome() {
        let side = StoreSide::new();
        let ticket = run(side.begin_hydration());
        let waiters = [wait(side.begin_hydration()), wait(side.begin_hydration())];
        assert_eq!(ticket.finish(Outcome::Failed).map(|_| ()), None);
        for waiter in waiters {
            assert_eq!(waiter.outcome().await, Outcome::Failed);
        }
        assert_eq!(side.work(), Work::Idle);
        // The next reader starts a job of its own.
        run(side.begin_hydration());
    }

    #[tokio::test]
    async fn a_ticket_dropped_unfinished_frees_the_side_and_its_waiters_look_again() {
        let side = StoreSide::new();
        let ticket = run(side.begin_hydration());
        let waiter = wait(side.begin_hydration());
        assert!(side.want_fill().is_none());
        drop(ticket);
        assert_eq!(waiter.outcome().await, Outcome::LookAgain);
        assert_eq!(side.work(), Work::Idle, "the wanted fill went with it");
    }

    #[tokio::test]
    async fn a_fill_wanted_during_a_hydration_follows_it_and_readers_wait_for_the_fill() {
        let side = StoreSide::new();
        let hydration = run(side.begin_hydration());
        assert!(side.want_fill().is_none());
        let fill = hydration
            .finish(Outcome::Hydrated)
            .expect("the wanted fill is queued");
        assert_eq!(side.work(), Work::FillQueued);
        let waiter = wait(side.begin_hydration());
        assert!(fill.finish(Outcome::LookAgain).is_none());
        assert_eq!(waiter.outcome().await, Outcome::LookAgain);
        assert_eq!(side.work(), Work::Idle);
    }

    #[test]
    fn a_queued_fill_takes_new_displays_with_it_but_a_reading_fill_is_followed_by_another() {
        let side = StoreSide::new();
        let fill = side.want_fill().expect("idle: queued now");
        assert!(side.want_fill().is_none());
        assert_eq!(side.work(), Work::FillQueued);
        let fill = fill.finish(Outcome::LookAgain);
        assert!(
            fill.is_none(),
            "nothing was wanted after it had read its displays"
        );

        let fill = side.want_fill().expect("idle again");
        fill.fill_reading();
        assert!(side.want_fill().is_none());
        assert_eq!(side.work(), Work::Filling { fill_after: true });
        let next = fill.finish(Outcome::LookAgain).expect("a second fill");
        assert_eq!(side.work(), Work::FillQueued);
        drop(next);
        assert_eq!(side.work(), Work::Idle);
    }

    #[test]
    fn no_fill_follows_a_failed_job() {
        let side = StoreSide::new();
        let hydration = run(side.begin_hydration());
        assert!(side.want_fill().is_none());
        assert!(hydration.finish(Outcome::Failed).is_none());
        assert_eq!(side.work(), Work::Idle);
    }

    #[test]
    fn one_reread_is_scheduled_at_a_time() {
        let side = StoreSide::new();
        assert!(side.schedule_reread());
        assert!(!side.schedule_reread());
        side.reread_due();
        assert!(side.schedule_reread());
    }
}
