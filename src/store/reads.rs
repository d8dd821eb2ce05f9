//! The [`StoreReads`] the [`Store`] implements: the two stages of a hydration, a fill, a shadow check's rows and
//! explain's row metadata, each one bounded, counted and traced query ([`Store::query`]) built by `query.rs`.

use super::*;

impl StoreReads for Store {
    async fn visible_displays(
        &self,
        thread_id: &str,
        hydration: Hydration,
        bounds: Bounds,
    ) -> Result<VisibleDisplays, StoreError> {
        self.query(
            QueryKind::Markers(hydration),
            bounds.deadline,
            self.inner
                .thread_hint
                .with_fallback(&self.inner.metrics, |hint| {
                    self.find_displays(thread_id, hydration, hint, bounds)
                }),
        )
        .await
    }

    async fn display_events(
        &self,
        thread_id: &str,
        displays: &[String],
        hydration: Hydration,
        bounds: Bounds,
    ) -> Result<Vec<ViewEvent>, StoreError> {
        self.stage_two(hydration, thread_id, displays, bounds, |event, _| event)
            .await
    }

    async fn stored_rows(
        &self,
        thread_id: &str,
        displays: &[String],
        bounds: Bounds,
    ) -> Result<Vec<StoredRow>, StoreError> {
        self.stage_two(
            Hydration::Shadow,
            thread_id,
            displays,
            bounds,
            |event, id| StoredRow {
                event,
                persisted_ms: id.map(|id| id.timestamp().timestamp_millis()),
            },
        )
        .await
    }

    async fn fill_events(
        &self,
        wanted: &[(&str, &[Box<str>])],
        bounds: Bounds,
    ) -> Result<Vec<ViewEvent>, StoreError> {
        let threads: Vec<&str> = wanted.iter().map(|(thread, _)| *thread).collect();
        let displays: Vec<Bson> = wanted
            .iter()
            .flat_map(|(_, displays)| displays.iter().map(|d| Bson::from(&**d)))
            .collect();
        self.events_query(
            QueryKind::Fill,
            fill_filter(&threads, &displays),
            bounds,
            |event, _| event,
        )
        .await
    }

    /// Every row of `thread_id` without its payload: its delivery key, `created_at`, and what the decoder's family filter
    /// makes of it. One query on the hydration index (its first field is `thread_id`), on the main pool, within
    /// `bounds` like a hydration (each row counts its key's bytes against the per-thread limit).
    async fn row_metadata(
        &self,
        thread_id: &str,
        bounds: Bounds,
    ) -> Result<Vec<RowMeta>, StoreError> {
        self.query(QueryKind::Explain, bounds.deadline, async {
            let clients = self.clients().await?;
            self.inner
                .thread_hint
                .with_fallback(&self.inner.metrics, |hint| {
                    find_row_metadata(&clients.collection, thread_id, hint, bounds)
                })
                .await
        })
        .await
    }
}

impl Clients {
    /// The collection through the client a query runs on: the shadow checks' (when on), the fills', or the main one.
    pub(super) fn for_query(&self, shadow: bool, fill: bool) -> &Collection<RawDocumentBuf> {
        match (&self.shadow_collection, fill) {
            (Some(collection), _) if shadow => collection,
            _ if shadow || fill => &self.fill_collection,
            _ => &self.collection,
        }
    }
}

impl Store {
    /// Stage 2 of `thread_id` over `displays` for `hydration`, each row kept as `keep` makes it.
    async fn stage_two<T>(
        &self,
        hydration: Hydration,
        thread_id: &str,
        displays: &[String],
        bounds: Bounds,
        keep: fn(ViewEvent, Option<ObjectId>) -> T,
    ) -> Result<Vec<T>, StoreError> {
        let displays: Vec<Bson> = displays.iter().map(|d| Bson::from(d.as_str())).collect();
        self.events_query(
            QueryKind::Events(hydration),
            events_filter(thread_id, &displays),
            bounds,
            keep,
        )
        .await
    }

    /// Stage 2 (sorted, the hydration index, the main pool), a shadow check's stage 2 (sorted, its own pool) or a
    /// fill (unsorted, the display index, the fills' own pool): the rows `filter` selects, within `bounds`, recorded
    /// as `kind`, each kept as `keep` makes it.
    async fn events_query<T>(
        &self,
        kind: QueryKind,
        filter: Document,
        bounds: Bounds,
        keep: fn(ViewEvent, Option<ObjectId>) -> T,
    ) -> Result<Vec<T>, StoreError> {
        let fill = kind == QueryKind::Fill;
        let shadow = kind == QueryKind::Events(Hydration::Shadow);
        let hint = if fill {
            &self.inner.display_hint
        } else {
            &self.inner.thread_hint
        };
        self.query(kind, bounds.deadline, async {
            let clients = self.clients().await?;
            let collection = clients.for_query(shadow, fill);
            hint.with_fallback(&self.inner.metrics, |hint| {
                let sort = (!fill).then(events_sort);
                self.find_events(collection, filter.clone(), sort, hint, bounds, keep)
            })
            .await
        })
        .await
    }
}
