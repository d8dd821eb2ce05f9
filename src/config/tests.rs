use std::time::Duration;

use super::*;

fn parse(args: &[&str]) -> Result<Config, clap::Error> {
    Config::try_load_from(std::iter::once("chat-history-view").chain(args.iter().copied()))
}

#[test]
fn defaults_match_the_documented_values() {
    let config = parse(&[]).unwrap();
    assert_eq!(config.nats.subject, DEFAULT_SUBJECT);
    assert_eq!(config.store.collection, "agent_events");
    assert_eq!(config.store.thread_hint(), Some(DEFAULT_INDEX_HINT));
    assert_eq!(config.store.display_hint(), Some(DEFAULT_FILL_INDEX_HINT));
    assert_eq!(config.cache.max_bytes, DEFAULT_CACHE_MAX_BYTES);
    assert_eq!(config.cache.max_thread_bytes, 64 << 20);
    assert_eq!(config.bounds.store_timeout, Duration::from_millis(2000));
    assert_eq!(config.http.shutdown_delay, Duration::from_secs(5));
    assert_eq!(config.http.shutdown_drain, Duration::from_secs(5));
    assert_eq!(config.bounds.persist_lag, Duration::from_millis(2000));
    assert_eq!(config.nats.ping_interval, Duration::from_secs(4));
    assert_eq!(config.http.listen.port(), 8080);
    assert!(config.http.probe_listen.is_none());
    assert!(config.http.api_token.is_none());
    assert_eq!(config.shadow.sample, 0.01);
    assert_eq!(config.shadow.max_per_sec, 5);
    assert_eq!(config.shadow.clock_margin, Duration::from_millis(1000));
    assert_eq!(config.warm.snapshot, Duration::from_secs(60));
    assert_eq!(config.warm.max_threads, 10_000);
    assert_eq!(config.warm.bucket, "chat_history_view_warm");
    assert_eq!(config.warm.rate, 200);
    assert_eq!(config.warm.max_wait, Duration::from_secs(60));
    assert!(config.warm.enabled());
}

#[test]
fn zero_warm_threads_turn_the_hand_over_off() {
    let config = parse(&["--warm-max-threads", "0"]).unwrap();
    assert!(!config.warm.enabled());
}

#[test]
fn bad_values_fail_naming_the_flag_and_the_variable() {
    for (args, setting) in [
        (
            &["--cache-max-bytes", "lots"][..],
            "--cache-max-bytes (HISTORY_VIEW_CACHE_MAX_BYTES)",
        ),
        (
            &["--store-timeout-ms", "0"][..],
            "--store-timeout-ms (HISTORY_VIEW_STORE_TIMEOUT_MS)",
        ),
        (
            &["--store-timeout-ms", "2 fortnights"][..],
            "HISTORY_VIEW_STORE_TIMEOUT_MS",
        ),
        (
            &["--listen", "nowhere"][..],
            "--listen (HISTORY_VIEW_LISTEN)",
        ),
        (
            &["--probe-listen", "nowhere"][..],
            "--probe-listen (HISTORY_VIEW_PROBE_LISTEN)",
        ),
        (
            &["--mongodb-uri", "postgres://x"][..],
            "--mongodb-uri (HISTORY_VIEW_MONGODB_URI)",
        ),
        (
            &["--nats-url", "nats://a b"][..],
            "--nats-url (HISTORY_VIEW_NATS_URL)",
        ),
        (
            &["--log-format", "xml"][..],
            "--log-format (HISTORY_VIEW_LOG_FORMAT)",
        ),
        (&["--source", "kafka"][..], "--source (HISTORY_VIEW_SOURCE)"),
        (
            &["--shadow-sample", "1.5"][..],
            "HISTORY_VIEW_SHADOW_SAMPLE",
        ),
        (
            &["--shadow-sample", "NaN"][..],
            "HISTORY_VIEW_SHADOW_SAMPLE",
        ),
        (
            &["--shadow-max-per-sec", "0"][..],
            "HISTORY_VIEW_SHADOW_MAX_PER_SEC",
        ),
        (
            &["--shadow-clock-margin-ms", "60001"][..],
            "HISTORY_VIEW_SHADOW_CLOCK_MARGIN_MS",
        ),
        (&["--subject", "agent..x"][..], "HISTORY_VIEW_SUBJECT"),
        (&["--persist-lag-ms=-1"][..], "HISTORY_VIEW_PERSIST_LAG_MS"),
        (
            &["--persist-lag-ms", "2d"][..],
            "HISTORY_VIEW_PERSIST_LAG_MS",
        ),
        (
            &["--max-thread-bytes", "1KiB"][..],
            "HISTORY_VIEW_MAX_THREAD_BYTES",
        ),
        (
            &["--nats-ping-interval-secs", "0"][..],
            "--nats-ping-interval-secs (HISTORY_VIEW_NATS_PING_INTERVAL_SECS)",
        ),
        // The old spelling of a flag is an alias; an error names the setting by its name.
        (
            &["--nats-ping-interval", "0"][..],
            "--nats-ping-interval-secs (HISTORY_VIEW_NATS_PING_INTERVAL_SECS)",
        ),
        (
            &["--http-idle-timeout", "0s"][..],
            "HISTORY_VIEW_HTTP_IDLE_TIMEOUT_SECS",
        ),
        (
            &["--nats-subscription-capacity", "0"][..],
            "HISTORY_VIEW_NATS_SUBSCRIPTION_CAPACITY",
        ),
        (
            &["--warm-bucket", "hot.set"][..],
            "--warm-bucket (HISTORY_VIEW_WARM_BUCKET)",
        ),
        (&["--warm-rate", "0"][..], "HISTORY_VIEW_WARM_RATE"),
        (
            &["--warm-max-threads", "many"][..],
            "HISTORY_VIEW_WARM_MAX_THREADS",
        ),
        (&["--warm-max-secs", "0"][..], "HISTORY_VIEW_WARM_MAX_SECS"),
        (
            &["--warm-snapshot-secs", "0"][..],
            "HISTORY_VIEW_WARM_SNAPSHOT_SECS",
        ),
    ] {
        let error = parse(args).unwrap_err();
        // A refused value, not an unknown flag (whose message names the flag too).
        assert!(
            matches!(
                error.kind(),
                ErrorKind::ValueValidation | ErrorKind::InvalidValue
            ),
            "{error}"
        );
        assert!(error.to_string().contains(setting), "{args:?}: {error}");
    }
}

#[test]
fn durations_take_units_and_plain_numbers_keep_the_variables_unit() {
    let config = parse(&[
        "--store-timeout-ms",
        "2s",
        "--persist-lag-ms",
        "1500",
        "--cache-idle-secs",
        "5m",
        "--http-header-timeout-secs",
        "2000ms",
        "--jetstream-replay-secs",
        "30",
        "--shadow-clock-margin-ms",
        "0",
    ])
    .unwrap();
    assert_eq!(config.bounds.store_timeout, Duration::from_secs(2));
    assert_eq!(config.bounds.persist_lag, Duration::from_millis(1500));
    assert_eq!(config.cache.idle, Duration::from_secs(300));
    assert_eq!(config.http.header_timeout, Duration::from_secs(2));
    assert_eq!(config.jetstream.replay, Some(Duration::from_secs(30)));
    assert_eq!(config.shadow.clock_margin, Duration::ZERO);
    // The old spellings of the three flags whose names did not match their variables still work.
    let old = parse(&[
        "--nats-ping-interval",
        "7",
        "--http-header-timeout",
        "3",
        "--http-idle-timeout",
        "1m",
    ])
    .unwrap();
    assert_eq!(old.nats.ping_interval, Duration::from_secs(7));
    assert_eq!(old.http.header_timeout, Duration::from_secs(3));
    assert_eq!(old.http.idle_timeout, Duration::from_secs(60));
}

#[test]
fn help_reads_as_grouped_sections_without_rustdoc_syntax() {
    let help = Config::command().render_long_help().to_string();
    let headings: Vec<&str> = help
        .lines()
        .filter(|line| line.ends_with(':') && !line.starts_with(' '))
        .collect();
    assert_eq!(
        headings,
        [
            "Options:",
            "NATS:",
            "JetStream and partitions:",
            "MongoDB:",
            "Cache:",
            "Warm-up:",
            "HTTP:",
            "Shadow checks:",
            "Logging:",
            "Tracing:"
        ]
    );
    for rustdoc in ["[`", "`]", "crate::", "](", "Self::"] {
        assert!(!help.contains(rustdoc), "--help shows {rustdoc:?}");
    }
    // Every setting has a heading: none is left among the plain options.
    let command = Config::command();
    for arg in command
        .get_arguments()
        .filter(|arg| arg.get_env().is_some())
    {
        assert!(arg.get_help_heading().is_some(), "{:?}", arg.get_id());
    }
}

#[test]
fn bad_secrets_fail_naming_the_setting_without_their_value() {
    for (args, setting) in [
        (
            &["--mongodb-uri", "postgres://u:hunter2@x"][..],
            "--mongodb-uri",
        ),
        (&["--nats-url", "nats://u:hunter2@a b"][..], "--nats-url"),
        (&["--api-token", "hunter2\n"][..], "--api-token"),
        (&["--api-token", "hunter2 x"][..], "--api-token"),
        (&["--api-token", ""][..], "--api-token"),
    ] {
        let message = parse(args).unwrap_err().to_string();
        assert!(message.contains(setting), "{message}");
        assert!(!message.contains("hunter2"), "{message}");
    }
}

#[test]
fn nats_login_and_tls_files_are_checked_at_load_naming_the_setting() {
    for (args, setting) in [
        (
            &["--nats-creds-file", "/no/such/chv.creds"][..],
            "--nats-creds-file (HISTORY_VIEW_NATS_CREDS_FILE)",
        ),
        (
            &["--nats-user", "u"][..],
            "--nats-user (HISTORY_VIEW_NATS_USER)",
        ),
        (
            &["--nats-tls-key-file", "/x"][..],
            "--nats-tls-key-file (HISTORY_VIEW_NATS_TLS_KEY_FILE)",
        ),
        (
            &["--nats-url", "nats://hunter2@h", "--nats-token-file", "/x"][..],
            "--nats-token-file (HISTORY_VIEW_NATS_TOKEN_FILE)",
        ),
    ] {
        let error = parse(args).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::ValueValidation, "{error}");
        let message = error.to_string();
        assert!(message.contains(setting), "{args:?}: {message}");
        assert!(!message.contains("hunter2"), "{message}");
    }
    // Empty values count as unset (a chart renders unset values as empty strings).
    let config = parse(&["--nats-creds-file=", "--nats-user=", "--nats-tls-ca-file="]).unwrap();
    assert!(config.nats.check_access().is_ok());
}

#[test]
fn secrets_are_redacted_in_debug_output() {
    let config = parse(&["--api-token", "s3cret", "--mongodb-uri", "mongodb://u:pw@h"]).unwrap();
    let debug = format!("{config:?}");
    assert!(
        !debug.contains("s3cret") && !debug.contains("pw@h"),
        "{debug}"
    );
}

#[test]
fn a_zero_persist_lag_is_allowed() {
    assert_eq!(
        parse(&["--persist-lag-ms", "0"])
            .unwrap()
            .bounds
            .persist_lag,
        Duration::ZERO
    );
}

#[test]
fn the_jetstream_source_is_opt_in_and_replays_past_the_bound_by_default() {
    let core = parse(&[]).unwrap();
    assert_eq!(core.nats.source, Source::Core);
    let js = parse(&["--source", "jetstream", "--persist-lag-ms", "1500"]).unwrap();
    assert_eq!(js.nats.source, Source::JetStream);
    let settings = js.jetstream.settings(&js.nats.subject, js.bounds);
    assert_eq!(settings.replay, Duration::from_millis(4_500));
    assert_eq!(settings.streams, "agent_*_stream");
    let explicit = parse(&["--jetstream-replay-secs", "0"]).unwrap();
    assert_eq!(
        explicit
            .jetstream
            .settings("agent.>", explicit.bounds)
            .replay,
        Duration::ZERO
    );
}

#[test]
fn bad_jetstream_settings_fail_at_start_naming_the_setting() {
    for (flag, value) in [
        ("--source", "kafka"),
        ("--jetstream-streams", "agent.*"),
        ("--jetstream-streams", ""),
        ("--jetstream-replay-secs", "86401"),
    ] {
        let error = parse(&[flag, value]).unwrap_err().to_string();
        assert!(error.contains(flag), "{flag}={value}: {error}");
    }
}

#[test]
fn partitioned_workers_are_jetstream_workers_with_peers_and_a_partition() {
    let peers = [
        "--source",
        "jetstream",
        "--peer-url",
        "http://chv-{partition}.h:8080",
    ];
    let args = |extra: &[&'static str]| {
        peers
            .iter()
            .chain(["--partitions", "3"].iter())
            .chain(extra)
            .copied()
            .collect::<Vec<_>>()
    };
    let config = parse(&args(&["--partition", "2"])).unwrap();
    let partitioning = config.jetstream.partitioning().unwrap();
    assert_eq!((partitioning.partitions, partitioning.partition), (3, 2));
    assert_eq!(partitioning.prefix, "chv");
    let (_, stream) = config
        .jetstream
        .settings(&config.nats.subject, config.bounds)
        .partitioned
        .unwrap();
    assert_eq!(stream.name, "CHAT_HISTORY_VIEW");
    assert_eq!(stream.max_age, Duration::from_secs(300));
    assert!(stream.create && stream.max_bytes.is_none());
    assert!(parse(&[]).unwrap().jetstream.partitioning().is_none());

    // The partition from a StatefulSet pod's host name.
    let mut from_host =
        Config::try_parse_from(std::iter::once("chat-history-view").chain(args(&[]))).unwrap();
    from_host.resolve_partition(Some("chv-1".into())).unwrap();
    assert_eq!(from_host.jetstream.partitioning().unwrap().partition, 1);
    let mut no_ordinal = from_host.clone();
    no_ordinal.jetstream.partition = None;
    let (setting, _) = no_ordinal
        .resolve_partition(Some("worker".into()))
        .unwrap_err();
    assert_eq!(setting, "partition");

    for (args, setting) in [
        (args(&["--partition", "3"]), "HISTORY_VIEW_PARTITION"),
        (
            vec![
                "--partitions",
                "2",
                "--partition",
                "0",
                "--peer-url",
                "http://p{partition}:1",
            ],
            "HISTORY_VIEW_PARTITIONS",
        ),
        (
            vec![
                "--source",
                "jetstream",
                "--partitions",
                "2",
                "--partition",
                "0",
            ],
            "HISTORY_VIEW_PEER_URL",
        ),
        (vec!["--partition", "1"], "HISTORY_VIEW_PARTITION"),
        (
            vec!["--peer-url", "http://no-placeholder:8080"],
            "--peer-url",
        ),
        (
            vec!["--peer-url", "https://p{partition}:8080"],
            "--peer-url",
        ),
        (vec!["--partitions", "0"], "--partitions"),
        (
            vec!["--jetstream-subject-prefix", "a.b"],
            "--jetstream-subject-prefix",
        ),
        (vec!["--jetstream-stream", "A*"], "--jetstream-stream"),
        (vec!["--jetstream-replicas", "6"], "--jetstream-replicas"),
        (
            vec!["--jetstream-max-bytes", "lots"],
            "--jetstream-max-bytes",
        ),
    ] {
        let error = parse(&args).unwrap_err().to_string();
        assert!(error.contains(setting), "{args:?}: {error}");
    }
}

/// Issue 37: a manifest that sets HISTORY_VIEW_PARTITION to nothing (the chart did, from a pod label Kubernetes
/// 1.25 to 1.27 lack) made start-up fail; the empty value now counts as unset, so the host name's ordinal decides.
/// clap gives an empty variable to the value parser exactly as it gives an empty flag value, so `--partition=`
/// takes the variable's path without touching the process environment other tests read.
#[test]
fn an_empty_partition_counts_as_unset() {
    let partitioned = |host: &str| {
        let mut config = Config::try_parse_from([
            "chat-history-view",
            "--source",
            "jetstream",
            "--peer-url",
            "http://chv-{partition}.h:8080",
            "--partitions",
            "3",
            "--partition=",
        ])
        .unwrap();
        assert_eq!(config.jetstream.given_partition(), None);
        config
            .resolve_partition(Some(host.into()))
            .map(|()| config.jetstream.partitioning().unwrap().partition)
    };
    assert_eq!(partitioned("chv-chat-history-view-2"), Ok(2));
    assert_eq!(partitioned("worker").unwrap_err().0, "partition");

    // One partition: empty is as good as unset, and whitespace only is empty.
    for empty in ["--partition=", "--partition= "] {
        let config = parse(&[empty]).unwrap();
        assert_eq!(config.jetstream.given_partition(), None);
        assert!(config.jetstream.partitioning().is_none());
    }
    // A value that is not empty is still checked.
    let error = parse(&["--partition=x"]).unwrap_err().to_string();
    assert!(error.contains("HISTORY_VIEW_PARTITION"), "{error}");
}

#[test]
fn srv_uris_are_accepted() {
    let config = parse(&[
        "--mongodb-uri",
        "mongodb+srv://cluster.example.org/?tls=false",
    ])
    .unwrap();
    assert!(config.store.uri.expose().starts_with("mongodb+srv://"));
}

#[test]
fn an_empty_index_hint_disables_it() {
    assert_eq!(
        parse(&["--mongodb-index-hint", ""])
            .unwrap()
            .store
            .thread_hint(),
        None
    );
}

/// Deployments set these environment variables (and flags): a rename here breaks them. Each flag is its variable's
/// name without the prefix, in kebab case; the three flags that were spelled otherwise keep their old spelling as an
/// alias.
#[test]
fn setting_names_are_pinned() {
    let mut pinned = [
        "HISTORY_VIEW_NATS_URL",
        "HISTORY_VIEW_NATS_CREDS_FILE",
        "HISTORY_VIEW_NATS_NKEY_SEED_FILE",
        "HISTORY_VIEW_NATS_TOKEN_FILE",
        "HISTORY_VIEW_NATS_USER",
        "HISTORY_VIEW_NATS_PASSWORD_FILE",
        "HISTORY_VIEW_NATS_TLS_CA_FILE",
        "HISTORY_VIEW_NATS_TLS_CERT_FILE",
        "HISTORY_VIEW_NATS_TLS_KEY_FILE",
        "HISTORY_VIEW_SOURCE",
        "HISTORY_VIEW_JETSTREAM_STREAMS",
        "HISTORY_VIEW_JETSTREAM_REPLAY_SECS",
        "HISTORY_VIEW_JETSTREAM_WITNESS",
        "HISTORY_VIEW_PARTITIONS",
        "HISTORY_VIEW_PARTITION",
        "HISTORY_VIEW_JETSTREAM_STREAM",
        "HISTORY_VIEW_JETSTREAM_CREATE_STREAM",
        "HISTORY_VIEW_JETSTREAM_SUBJECT_PREFIX",
        "HISTORY_VIEW_JETSTREAM_MAX_AGE_SECS",
        "HISTORY_VIEW_JETSTREAM_MAX_BYTES",
        "HISTORY_VIEW_JETSTREAM_REPLICAS",
        "HISTORY_VIEW_PEER_URL",
        "HISTORY_VIEW_SUBJECT",
        "HISTORY_VIEW_NATS_SUBSCRIPTION_CAPACITY",
        "HISTORY_VIEW_NATS_PING_INTERVAL_SECS",
        "HISTORY_VIEW_MONGODB_URI",
        "HISTORY_VIEW_MONGODB_URI_FILE",
        "HISTORY_VIEW_MONGODB_DATABASE",
        "HISTORY_VIEW_MONGODB_COLLECTION",
        "HISTORY_VIEW_MONGODB_INDEX_HINT",
        "HISTORY_VIEW_MONGODB_FILL_INDEX_HINT",
        "HISTORY_VIEW_LISTEN",
        "HISTORY_VIEW_PROBE_LISTEN",
        "HISTORY_VIEW_CACHE_MAX_BYTES",
        "HISTORY_VIEW_CACHE_IDLE_SECS",
        "HISTORY_VIEW_STORE_TIMEOUT_MS",
        "HISTORY_VIEW_MAX_CONCURRENT_HYDRATIONS",
        "HISTORY_VIEW_MAX_THREAD_BYTES",
        "HISTORY_VIEW_WARM_SNAPSHOT_SECS",
        "HISTORY_VIEW_WARM_MAX_THREADS",
        "HISTORY_VIEW_WARM_BUCKET",
        "HISTORY_VIEW_WARM_RATE",
        "HISTORY_VIEW_WARM_MAX_SECS",
        "HISTORY_VIEW_PERSIST_LAG_MS",
        "HISTORY_VIEW_SHADOW_SAMPLE",
        "HISTORY_VIEW_SHADOW_MAX_PER_SEC",
        "HISTORY_VIEW_SHADOW_CLOCK_MARGIN_MS",
        "HISTORY_VIEW_HTTP_MAX_CONNECTIONS",
        "HISTORY_VIEW_HTTP_MAX_IN_FLIGHT",
        "HISTORY_VIEW_HTTP_MAX_WAITING",
        "HISTORY_VIEW_HTTP_MAX_STREAMS",
        "HISTORY_VIEW_HTTP_HEADER_TIMEOUT_SECS",
        "HISTORY_VIEW_HTTP_IDLE_TIMEOUT_SECS",
        "HISTORY_VIEW_SHUTDOWN_DELAY_SECS",
        "HISTORY_VIEW_SHUTDOWN_DRAIN_SECS",
        "HISTORY_VIEW_API_TOKEN",
        "HISTORY_VIEW_API_TOKEN_FILE",
        "HISTORY_VIEW_INSPECTOR",
        "HISTORY_VIEW_LOG_FORMAT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
        "OTEL_SDK_DISABLED",
    ];
    let command = Config::command();
    let mut settings: Vec<String> = Vec::new();
    for arg in command.get_arguments() {
        let Some(env) = arg.get_env() else { continue };
        let env = env.to_string_lossy().into_owned();
        // The OpenTelemetry settings keep their standard names, and their flags the whole name.
        let flag = env
            .strip_prefix("HISTORY_VIEW_")
            .or_else(|| env.starts_with("OTEL_").then_some(env.as_str()))
            .unwrap()
            .to_ascii_lowercase()
            .replace('_', "-");
        assert_eq!(arg.get_long(), Some(flag.as_str()), "{env}");
        settings.push(env);
    }
    settings.sort();
    pinned.sort_unstable();
    assert_eq!(settings, pinned);

    let aliases: Vec<(&str, Vec<&str>)> = command
        .get_arguments()
        .filter_map(|arg| Some((arg.get_long()?, arg.get_all_aliases()?)))
        .collect();
    assert_eq!(
        aliases,
        [
            ("nats-ping-interval-secs", vec!["nats-ping-interval"]),
            ("http-header-timeout-secs", vec!["http-header-timeout"]),
            ("http-idle-timeout-secs", vec!["http-idle-timeout"]),
        ]
    );
}

/// Each setting with a heading, its flag and its default, as `--help` shows them.
fn settings() -> Vec<(String, String, String, Option<String>)> {
    Config::command()
        .get_arguments()
        .filter_map(|arg| {
            let env = arg.get_env()?.to_string_lossy().into_owned();
            let default = arg
                .get_default_values()
                .first()
                .map(|v| v.to_string_lossy().into_owned());
            Some((
                arg.get_help_heading()?.to_owned(),
                env,
                format!("--{}", arg.get_long()?),
                default,
            ))
        })
        .collect()
}

fn read(path: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
}

/// Design section 4 lists every setting under its `--help` heading, in the same order, with its flag and its
/// default (a setting without a default says in words what happens, never a literal).
#[test]
fn design_section_4_lists_the_settings_as_help_does() {
    let design = read("docs/design.md");
    let section =
        &design[design.find("<a id=\"4\"></a>").unwrap()..design.find("<a id=\"5\"></a>").unwrap()];
    let mut heading = String::new();
    let mut listed = Vec::new();
    for line in section.lines() {
        if let Some(h) = line.strip_prefix("**").and_then(|l| l.strip_suffix("**")) {
            heading = h.to_owned();
        }
        let cells: Vec<&str> = line.split(" | ").collect();
        let Some(env) = ["HISTORY_VIEW_", "OTEL_"].iter().find_map(|prefix| {
            let name = cells[0].strip_prefix(&format!("| `{prefix}"))?;
            Some(format!("{prefix}{}", name.trim_end_matches('`')))
        }) else {
            continue;
        };
        listed.push((
            heading.clone(),
            env,
            cells[1].trim_matches('`').to_owned(),
            cells[2].to_owned(),
        ));
    }
    let settings = settings();
    assert_eq!(listed.len(), settings.len(), "{listed:#?}");
    for ((heading, env, flag, default), (h, e, f, d)) in settings.iter().zip(&listed) {
        assert_eq!((heading, env, flag), (h, e, f));
        match default {
            Some(default) => assert_eq!(d, &format!("`{default}`"), "{env}"),
            None => assert!(
                !d.starts_with('`'),
                "{env} has no default, the design says {d}"
            ),
        }
    }
}

/// Every variable the README names is a setting, and every default it states is the setting's.
#[test]
fn the_readme_names_real_settings_and_their_defaults() {
    let readme = read("README.md");
    let settings = settings();
    let find = |env: &str| settings.iter().find(|(_, e, _, _)| e == env);
    let named = regex::Regex::new(r"HISTORY_VIEW_[A-Z_]*[A-Z]").unwrap();
    let mut found = 0;
    for name in named.find_iter(&readme) {
        assert!(
            find(name.as_str()).is_some(),
            "the README names {}, which is no setting",
            name.as_str()
        );
        found += 1;
    }
    assert!(found > 20, "{found}");
    let stated = regex::Regex::new(
        r"`(HISTORY_VIEW_[A-Z_]+)`\)?,?\s+\(?default ([0-9][0-9.]*(?:\s?[KMG]i?B)?)",
    )
    .unwrap();
    let mut checked = 0;
    for c in stated.captures_iter(&readme) {
        let (_, _, _, default) = find(&c[1]).unwrap();
        assert_eq!(
            default.as_deref(),
            Some(c[2].replace(' ', "").as_str()),
            "{}",
            &c[1]
        );
        checked += 1;
    }
    assert!(checked > 10, "{checked}");
}

/// A file of its own in the temp dir, holding `content`.
fn secret_file(name: &str, content: &str) -> std::path::PathBuf {
    let dir = test_support::process::temp_dir("config");
    let path = dir.join(name);
    std::fs::write(&path, content).unwrap();
    path
}

#[test]
fn the_mongodb_uri_comes_from_its_file_without_surrounding_whitespace() {
    let path = secret_file("uri", "  mongodb://user:pw@db:27017/?tls=true\n");
    let config = parse(&["--mongodb-uri-file", path.to_str().unwrap()]).unwrap();
    assert_eq!(
        config.store.uri.expose(),
        "mongodb://user:pw@db:27017/?tls=true"
    );
    // An empty value counts as unset, for the file and for its twin beside it.
    let config = parse(&["--mongodb-uri-file", ""]).unwrap();
    assert_eq!(config.store.uri.expose(), "mongodb://127.0.0.1:27017");
    let config = parse(&[
        "--mongodb-uri",
        "",
        "--mongodb-uri-file",
        path.to_str().unwrap(),
    ])
    .unwrap();
    assert!(
        config
            .store
            .uri
            .expose()
            .starts_with("mongodb://user:pw@db")
    );
}

#[test]
fn the_api_tokens_come_from_their_file_one_a_line() {
    let path = secret_file("tokens", "\nold-token\n  new-token  \n\n");
    let config = parse(&["--api-token-file", path.to_str().unwrap()]).unwrap();
    let tokens: Vec<String> = config
        .http
        .tokens()
        .unwrap()
        .iter()
        .map(|t| t.expose().to_owned())
        .collect();
    assert_eq!(tokens, ["old-token", "new-token"]);
    // An empty token beside the file is unset; without either, no token is required.
    let config = parse(&[
        "--api-token",
        "",
        "--api-token-file",
        path.to_str().unwrap(),
    ])
    .unwrap();
    assert_eq!(config.http.tokens().map(|t| t.len()), Some(2));
    assert!(
        parse(&["--api-token-file", ""])
            .unwrap()
            .http
            .tokens()
            .is_none()
    );
    // The single token still works.
    let config = parse(&["--api-token", "s3cret"]).unwrap();
    assert_eq!(config.http.tokens().map(|t| t.len()), Some(1));
}

#[test]
fn a_setting_and_its_file_both_set_fail_naming_both() {
    let uri = secret_file("uri", "mongodb://db:27017\n");
    let tokens = secret_file("tokens", "t\n");
    for (args, names) in [
        (
            vec![
                "--mongodb-uri",
                "mongodb://other:27017",
                "--mongodb-uri-file",
                uri.to_str().unwrap(),
            ],
            [
                "--mongodb-uri (HISTORY_VIEW_MONGODB_URI)",
                "--mongodb-uri-file (HISTORY_VIEW_MONGODB_URI_FILE)",
            ],
        ),
        (
            vec![
                "--api-token",
                "s3cret",
                "--api-token-file",
                tokens.to_str().unwrap(),
            ],
            [
                "--api-token (HISTORY_VIEW_API_TOKEN)",
                "--api-token-file (HISTORY_VIEW_API_TOKEN_FILE)",
            ],
        ),
    ] {
        let error = parse(&args).unwrap_err().to_string();
        for name in names {
            assert!(error.contains(name), "{args:?}: {error}");
        }
        assert!(
            !error.contains("s3cret") && !error.contains("other:27017"),
            "{error}"
        );
    }
}

#[test]
fn a_missing_empty_or_bad_secret_file_fails_at_start_naming_the_setting_not_the_content() {
    let missing = std::env::temp_dir().join("chv-no-such-secret-file");
    let cases = [
        (
            "--mongodb-uri-file",
            missing.clone(),
            "--mongodb-uri-file (HISTORY_VIEW_MONGODB_URI_FILE)",
            "No such file",
        ),
        (
            "--mongodb-uri-file",
            secret_file("empty-uri", " \n"),
            "HISTORY_VIEW_MONGODB_URI_FILE",
            "is empty",
        ),
        (
            "--mongodb-uri-file",
            secret_file("bad-uri", "postgres://user:hunter2@db\n"),
            "HISTORY_VIEW_MONGODB_URI_FILE",
            "must start with mongodb://",
        ),
        (
            "--api-token-file",
            missing,
            "--api-token-file (HISTORY_VIEW_API_TOKEN_FILE)",
            "No such file",
        ),
        (
            "--api-token-file",
            secret_file("empty-tokens", "\n\n"),
            "HISTORY_VIEW_API_TOKEN_FILE",
            "holds no token",
        ),
        (
            "--api-token-file",
            secret_file("bad-tokens", "good\nhunter2 with spaces\n"),
            "HISTORY_VIEW_API_TOKEN_FILE",
            "line 2: must be printable ASCII without whitespace",
        ),
    ];
    for (flag, path, setting, reason) in cases {
        let error = parse(&[flag, path.to_str().unwrap()]).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::ValueValidation, "{error}");
        let error = error.to_string();
        assert!(error.contains(setting), "{error}");
        assert!(error.contains(reason), "{error}");
        assert!(!error.contains("hunter2"), "{error}");
    }
}
