//! The JetStream calls the source makes, behind one seam ([`Api`]): list the streams, read a stream's state, create
//! an ephemeral pull consumer and read its state and deliveries, and (partitioned workers) create or update the
//! partitioned stream. [`NatsApi`] makes them on async-nats; the source's unit tests make them on a fake
//! (`src/source/tests.rs`). The values are plain: what the rules of [design 2.1.3](../../docs/design.md#2.1.3) read.

use std::future::Future;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::context::{
    CreateStreamError, CreateStreamErrorKind, GetStreamErrorKind, StreamsErrorKind,
};
use async_nats::jetstream::stream::{Config, Info};
use async_nats::jetstream::{self, Context, ErrorCode};
use bytes::Bytes;
use futures_util::StreamExt;

/// How long the server waits for the next pull request of an ephemeral consumer before removing it.
const INACTIVE_THRESHOLD: Duration = Duration::from_secs(60);
/// How often the server sends an idle heartbeat to a pull request; async-nats ends the pull after two missed ones
/// (nats-server requires at most half the request's expiry).
pub const HEARTBEAT: Duration = Duration::from_secs(2);
/// How long one pull request waits for messages.
const EXPIRES: Duration = Duration::from_secs(10);

/// A replica the leader has not heard from for this long does not count toward its quorum (nats-server's raft
/// heartbeat is 1 s).
pub const QUORUM_SILENCE: Duration = Duration::from_secs(3);

/// Why a JetStream call failed, as far as the source's rules care.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JsApiError {
    /// The stream does not exist.
    #[error("the stream does not exist")]
    NotFound,
    /// JetStream is not enabled on the server, or nothing answers its API.
    #[error("JetStream is not available: {0}")]
    Unavailable(String),
    /// The worker's NATS user may not make this call.
    #[error("permission denied: {0}")]
    Denied(String),
    /// Anything else (a timeout, a lost connection, a refused request).
    #[error("{0}")]
    Other(String),
}

/// A stream's state as one stream-info request saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamState {
    pub name: String,
    pub created: SystemTime,
    /// The leader of a replicated stream; `None` for one replica (its "leader" is the one server holding it, named
    /// anew at each restart of that server, which is no gap: it recovers the stream from its files before it
    /// accepts clients).
    pub leader: Option<String>,
    /// Whether the leader has heard from enough replicas lately to store anything: false for a replicated stream
    /// whose leader has heard from fewer than a majority (itself included) within [`QUORUM_SILENCE`]. A leader that
    /// lost its quorum goes on answering for up to about 10 s (nats-server's lost-quorum interval) while storing
    /// nothing.
    pub quorum: bool,
    /// The oldest sequence still held; one past `last_seq` when empty.
    pub first_seq: u64,
    pub last_seq: u64,
    /// The oldest message's time (the last message's when empty; the zero time as the epoch).
    pub first_time: SystemTime,
    /// Messages deleted between the first and the last (not counting what aged out from the front).
    pub deleted: u64,
    /// The deleted sequences themselves, when the reading asked for them ([`Api::stream_state_with_deleted`]).
    pub deleted_list: Option<Vec<u64>>,
    /// Messages and bytes it holds.
    pub messages: u64,
    pub bytes: u64,
    /// The largest message it may be asked to store: its `max_msg_size`, else the server's `max_payload`.
    pub max_message: u64,
    pub subjects: Vec<String>,
    /// Partitioned stream: its sources as it reports them.
    pub sources: Vec<SourceState>,
    /// Its configuration (limits, discard policy, sealed; partitioned: its sources and transform).
    pub config: Config,
}

/// A source of the partitioned stream, as the partitioned stream reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceState {
    pub name: String,
    /// Messages of the class stream not copied yet.
    pub lag: u64,
    /// Since the source was last heard from; `None` if never.
    pub active: Option<Duration>,
}

/// Where a new consumer starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Everything the stream holds.
    All,
    /// The first message stored at or after this moment (a worker start's replay).
    Time(SystemTime),
    /// This sequence on.
    Sequence(u64),
}

/// A consumer's state as one consumer-info request saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerState {
    /// Messages matching its filter not delivered yet.
    pub pending: u64,
    /// Its last delivered consumer sequence (the count of messages it delivered).
    pub delivered: u64,
}

/// One message a consumer delivered.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub subject: async_nats::Subject,
    pub payload: Bytes,
    /// The message's headers as stored (a publisher's `traceparent` among them), if it had any.
    pub headers: Option<async_nats::HeaderMap>,
    pub stream_seq: u64,
    /// Counts the consumer's deliveries: a number skipped is a delivery lost on the way.
    pub consumer_seq: u64,
    /// Messages matching the filter still after it when it was delivered.
    pub pending: u64,
    /// When the server stored it, as an event's `arrived` ([`crate::decode::ViewEvent::arrived`]).
    pub arrived: u32,
}

/// The JetStream calls of the source.
pub trait Api: Clone + Send + Sync + 'static {
    type Consumer: Consumer;

    /// The names of every stream of the account.
    fn stream_names(&self) -> impl Future<Output = Result<Vec<String>, JsApiError>> + Send;

    /// One stream's state.
    fn stream_state(
        &self,
        name: &str,
    ) -> impl Future<Output = Result<StreamState, JsApiError>> + Send;

    /// One stream's state with the list of its deleted sequences (the server sends it whole).
    fn stream_state_with_deleted(
        &self,
        name: &str,
    ) -> impl Future<Output = Result<StreamState, JsApiError>> + Send;

    /// The names of the streams whose subjects overlap `subject`.
    fn streams_capturing(
        &self,
        subject: &str,
    ) -> impl Future<Output = Result<Vec<String>, JsApiError>> + Send;

    /// An ephemeral pull consumer of `stream` on `filters`, acknowledging nothing, from `start`.
    fn create_consumer(
        &self,
        stream: &str,
        filters: Vec<String>,
        start: Start,
    ) -> impl Future<Output = Result<Self::Consumer, JsApiError>> + Send;

    /// Creates a stream (the partitioned one).
    fn create_stream(
        &self,
        config: Config,
    ) -> impl Future<Output = Result<StreamState, JsApiError>> + Send;

    /// Updates a stream's configuration (the partitioned stream's sources).
    fn update_stream(
        &self,
        config: Config,
    ) -> impl Future<Output = Result<StreamState, JsApiError>> + Send;
}

/// A consumer made by [`Api::create_consumer`].
pub trait Consumer: Send + 'static {
    /// Its state now.
    fn state(&mut self) -> impl Future<Output = Result<ConsumerState, JsApiError>> + Send;

    /// The next delivery; an error or `None` ends the consumer (a missed heartbeat, a lost connection, a deleted
    /// stream).
    fn next(&mut self) -> impl Future<Output = Option<Result<Delivery, JsApiError>>> + Send;
}

/// [`Api`] on async-nats.
#[derive(Clone)]
pub struct NatsApi {
    context: Context,
    client: async_nats::Client,
}

impl NatsApi {
    pub fn new(client: async_nats::Client) -> Self {
        Self {
            context: jetstream::new(client.clone()),
            client,
        }
    }

    /// The stream's info, with its deleted sequences if asked.
    async fn info(&self, name: &str, deleted: bool) -> Result<StreamState, JsApiError> {
        let stream = self
            .context
            .get_stream_no_info(name)
            .await
            .map_err(|e| match e.kind() {
                GetStreamErrorKind::JetStream(js) => classify(js.error_code(), &js),
                _ => classify_text(&e),
            })?;
        let info = if deleted {
            stream
                .info_builder()
                .with_deleted(true)
                .fetch()
                .await
                .map_err(|e| classify_text(&e))?
                .info
        } else {
            stream.get_info().await.map_err(|e| classify_text(&e))?
        };
        let mut state = state_of(&info);
        if state.max_message == 0 {
            state.max_message =
                u64::try_from(self.client.server_info().max_payload).unwrap_or(u64::MAX);
        }
        Ok(state)
    }
}

/// A page of `$JS.API.STREAM.NAMES`.
#[derive(serde::Deserialize)]
struct NamesPage {
    #[serde(default)]
    total: usize,
    #[serde(default)]
    streams: Option<Vec<String>>,
}

/// An async-nats pull consumer and its message stream (opened on the first [`Consumer::next`]).
pub struct NatsConsumer {
    consumer: jetstream::consumer::Consumer<pull::Config>,
    messages: Option<pull::Stream>,
}

impl Api for NatsApi {
    type Consumer = NatsConsumer;

    async fn stream_names(&self) -> Result<Vec<String>, JsApiError> {
        let mut names = self.context.stream_names();
        let mut all = Vec::new();
        while let Some(name) = names.next().await {
            all.push(name.map_err(|error| {
                // The listing wraps the request's error: a request nothing answers is JetStream off.
                let source = std::error::Error::source(&error)
                    .and_then(|e| e.downcast_ref::<async_nats::jetstream::context::RequestError>());
                match (error.kind(), source.map(|e| e.kind())) {
                    (StreamsErrorKind::NoResponders, _)
                    | (_, Some(StreamsErrorKind::NoResponders)) => {
                        JsApiError::Unavailable(error.to_string())
                    }
                    _ => classify_text(&error),
                }
            })?);
        }
        Ok(all)
    }

    async fn stream_state(&self, name: &str) -> Result<StreamState, JsApiError> {
        self.info(name, false).await
    }

    async fn stream_state_with_deleted(&self, name: &str) -> Result<StreamState, JsApiError> {
        self.info(name, true).await
    }

    async fn streams_capturing(&self, subject: &str) -> Result<Vec<String>, JsApiError> {
        let mut names = Vec::new();
        loop {
            let page: jetstream::response::Response<NamesPage> = self
                .context
                .request(
                    "STREAM.NAMES",
                    &serde_json::json!({ "subject": subject, "offset": names.len() }),
                )
                .await
                .map_err(|e| classify_text(&e))?;
            let page = match page {
                jetstream::response::Response::Ok(page) => page,
                jetstream::response::Response::Err { error } => {
                    return Err(classify(error.error_code(), &error));
                }
            };
            let streams = page.streams.unwrap_or_default();
            if streams.is_empty() {
                return Ok(names);
            }
            names.extend(streams);
            if names.len() >= page.total {
                return Ok(names);
            }
        }
    }

    async fn create_consumer(
        &self,
        stream: &str,
        filters: Vec<String>,
        start: Start,
    ) -> Result<NatsConsumer, JsApiError> {
        let deliver_policy = match start {
            Start::All => DeliverPolicy::All,
            Start::Time(at) => DeliverPolicy::ByStartTime {
                start_time: at.into(),
            },
            Start::Sequence(start_sequence) => DeliverPolicy::ByStartSequence { start_sequence },
        };
        let stream = self
            .context
            .get_stream_no_info(stream)
            .await
            .map_err(|e| classify_text(&e))?;
        let consumer = stream
            .create_consumer(pull::Config {
                deliver_policy,
                ack_policy: AckPolicy::None,
                filter_subjects: filters,
                inactive_threshold: INACTIVE_THRESHOLD,
                memory_storage: true,
                ..pull::Config::default()
            })
            .await
            .map_err(|e| classify_text(&e))?;
        Ok(NatsConsumer {
            consumer,
            messages: None,
        })
    }

    async fn create_stream(&self, config: Config) -> Result<StreamState, JsApiError> {
        let stream = self
            .context
            .create_stream(config)
            .await
            .map_err(stream_write_error)?;
        Ok(state_of(stream.cached_info()))
    }

    async fn update_stream(&self, config: Config) -> Result<StreamState, JsApiError> {
        let info = self
            .context
            .update_stream(config)
            .await
            .map_err(stream_write_error)?;
        Ok(state_of(&info))
    }
}

impl Consumer for NatsConsumer {
    async fn state(&mut self) -> Result<ConsumerState, JsApiError> {
        let info = self.consumer.info().await.map_err(|e| classify_text(&e))?;
        Ok(ConsumerState {
            pending: info.num_pending,
            delivered: info.delivered.consumer_sequence,
        })
    }

    async fn next(&mut self) -> Option<Result<Delivery, JsApiError>> {
        if self.messages.is_none() {
            match self
                .consumer
                .stream()
                .heartbeat(HEARTBEAT)
                .expires(EXPIRES)
                .messages()
                .await
            {
                Ok(messages) => self.messages = Some(messages),
                Err(error) => return Some(Err(classify_text(&error))),
            }
        }
        let message = match self.messages.as_mut()?.next().await? {
            Ok(message) => message,
            Err(error) => return Some(Err(classify_text(&error))),
        };
        let info = match message.info() {
            Ok(info) => (
                info.stream_sequence,
                info.consumer_sequence,
                info.pending,
                crate::decode::arrival(info.published.into()),
            ),
            Err(error) => return Some(Err(JsApiError::Other(error.to_string()))),
        };
        let message = message.message;
        Some(Ok(Delivery {
            subject: message.subject,
            payload: message.payload,
            headers: message.headers,
            stream_seq: info.0,
            consumer_seq: info.1,
            pending: info.2,
            arrived: info.3,
        }))
    }
}

/// The plain state of a stream-info answer.
fn state_of(info: &Info) -> StreamState {
    let first_time = if info.state.messages > 0 {
        info.state.first_timestamp
    } else {
        info.state.last_timestamp
    };
    StreamState {
        name: info.config.name.clone(),
        created: wall(info.created),
        leader: leader(info),
        quorum: has_quorum(info),
        first_seq: info.state.first_sequence,
        last_seq: info.state.last_sequence,
        first_time: wall(first_time),
        deleted: info.state.deleted_count.unwrap_or(0),
        deleted_list: info.state.deleted.clone(),
        messages: info.state.messages,
        bytes: info.state.bytes,
        max_message: u64::try_from(info.config.max_message_size).unwrap_or(0),
        subjects: info.config.subjects.clone(),
        sources: info
            .sources
            .iter()
            .map(|source| SourceState {
                name: source.name.clone(),
                lag: source.lag,
                active: source.active,
            })
            .collect(),
        config: info.config.clone(),
    }
}

/// The leader of a replicated stream (see [`StreamState::leader`]).
fn leader(info: &Info) -> Option<String> {
    if info.config.num_replicas <= 1 {
        return None;
    }
    info.cluster
        .as_ref()
        .and_then(|cluster| cluster.leader.clone())
}

/// Whether the leader of a replicated stream heard from a majority of its replicas (itself included) lately.
fn has_quorum(info: &Info) -> bool {
    let replicas = info.config.num_replicas;
    if replicas <= 1 {
        return true;
    }
    let Some(cluster) = info.cluster.as_ref() else {
        return true;
    };
    let heard = cluster
        .replicas
        .iter()
        .filter(|peer| !peer.offline && peer.active < QUORUM_SILENCE)
        .count();
    (1 + heard) * 2 > replicas
}

/// A server timestamp on the wall clock; the zero time of an empty stream (year 1) as the epoch.
pub fn wall(at: time::OffsetDateTime) -> SystemTime {
    if at.unix_timestamp() <= 0 {
        SystemTime::UNIX_EPOCH
    } else {
        at.into()
    }
}

/// A refused stream create or update (async-nats reports both as a `CreateStreamError`).
fn stream_write_error(error: CreateStreamError) -> JsApiError {
    match error.kind() {
        CreateStreamErrorKind::JetStream(js) => classify(js.error_code(), &js),
        _ => classify_text(&error),
    }
}

/// A JetStream API error by its code.
fn classify(code: ErrorCode, error: &impl std::fmt::Display) -> JsApiError {
    match code {
        ErrorCode::STREAM_NOT_FOUND => JsApiError::NotFound,
        ErrorCode::JETSTREAM_NOT_ENABLED | ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT => {
            JsApiError::Unavailable(error.to_string())
        }
        _ => classify_text(error),
    }
}

/// Any other error by what it says (its chain included): no responders ("requested JetStream resource does not
/// exist") is JetStream off (nothing serves `$JS.API`), a permissions
/// violation is a refusal.
fn classify_text(error: &impl std::fmt::Display) -> JsApiError {
    let text = error.to_string();
    let lower = text.to_ascii_lowercase();
    if lower.contains("no responders")
        || lower.contains("not enabled")
        || lower.contains("resource does not exist")
    {
        JsApiError::Unavailable(text)
    } else if lower.contains("permission") || lower.contains("authorization") {
        JsApiError::Denied(text)
    } else if lower.contains("stream not found") {
        JsApiError::NotFound
    } else {
        JsApiError::Other(text)
    }
}
