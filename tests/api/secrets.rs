//! Secrets from files, as Kubernetes mounts a Secret: the MongoDB URI from `HISTORY_VIEW_MONGODB_URI_FILE`, and the
//! API tokens from `HISTORY_VIEW_API_TOKEN_FILE`, rotated without a restart by swapping the volume's `..data`
//! symlink (never writing the file), as the kubelet does.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::helpers::{Api, BinaryApp, OneThread};
use test_support::process::temp_dir;
use test_support::wait::{eventually_within, when};

/// The time a rotation may take from the file's change (issue 37); the file is read every second.
const ROTATION: Duration = Duration::from_secs(5);

/// A Secret volume as the kubelet lays it out: `<dir>/<key>` is a link to `..data/<key>`, `..data` a link to a
/// timestamped directory holding the files. [`SecretVolume::update`] writes a new directory and swaps `..data`.
struct SecretVolume {
    dir: PathBuf,
    version: u32,
}

impl SecretVolume {
    fn new(files: &[(&str, &str)]) -> Self {
        let mut volume = Self {
            dir: temp_dir("secret-volume"),
            version: 0,
        };
        volume.update(files);
        for (key, _) in files {
            std::os::unix::fs::symlink(Path::new("..data").join(key), volume.dir.join(key))
                .unwrap();
        }
        volume
    }

    fn path(&self, key: &str) -> String {
        self.dir.join(key).to_str().unwrap().to_owned()
    }

    /// A new version of the files, made visible at once by renaming a new `..data` link over the old one.
    fn update(&mut self, files: &[(&str, &str)]) {
        self.version += 1;
        let version = format!("..2026_01_01_00_00_{:02}", self.version);
        std::fs::create_dir(self.dir.join(&version)).unwrap();
        for (key, content) in files {
            std::fs::write(self.dir.join(&version).join(key), content).unwrap();
        }
        let staged = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(&version, &staged).unwrap();
        std::fs::rename(&staged, self.dir.join("..data")).unwrap();
        if self.version > 1 {
            let old = format!("..2026_01_01_00_00_{:02}", self.version - 1);
            std::fs::remove_dir_all(self.dir.join(old)).unwrap();
        }
    }
}

async fn status_with(api: &Api, token: &str) -> u16 {
    let authorization = format!("Bearer {token}");
    api.get(
        "/v1/threads/t1/history",
        &[("authorization", authorization.as_str())],
    )
    .await
    .status
}

/// Waits until a read with `token` answers `status`, within the rotation's bound (scaled) of `since`.
async fn until_status(api: &Api, token: &str, status: u16, since: Instant) {
    eventually_within(
        &format!("a read with {token} answering {status} after the file's change"),
        ROTATION.saturating_sub(since.elapsed()),
        || async move {
            let answered = status_with(api, token).await;
            when(answered == status, || format!("{answered}"))
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_rotate_through_the_mounted_file_without_a_restart() {
    const OLD: &str = "tok-old-5e1f0c";
    const NEW: &str = "tok-new-93ab27";
    let OneThread {
        mongo,
        nats,
        database,
    } = OneThread::start("secrets").await;
    // Both secrets from the volume: the URI with a trailing newline, as `kubectl create secret --from-file` keeps it.
    let uri = format!("{}\n", mongo.uri());
    let mut volume =
        SecretVolume::new(&[("mongodb-uri", &uri), ("api-tokens", &format!("{OLD}\n"))]);
    let app = BinaryApp::start(&[
        ("HISTORY_VIEW_NATS_URL", nats.url()),
        ("HISTORY_VIEW_MONGODB_URI_FILE", volume.path("mongodb-uri")),
        ("HISTORY_VIEW_MONGODB_DATABASE", database),
        ("HISTORY_VIEW_API_TOKEN_FILE", volume.path("api-tokens")),
        // Rendered empty by a chart beside the files: unset.
        ("HISTORY_VIEW_API_TOKEN", String::new()),
        ("HISTORY_VIEW_MONGODB_URI", String::new()),
    ])
    .await;
    app.wait_ready().await;
    assert_eq!(status_with(&app.api, OLD).await, 200);
    assert_eq!(status_with(&app.api, NEW).await, 401);
    assert_eq!(app.api.history("t1", "").await.status, 401);

    // The new token is added beside the old one: both are accepted.
    let mut tokens = format!("{OLD}\n\n  {NEW}  \n");
    volume.update(&[("mongodb-uri", &uri), ("api-tokens", &tokens)]);
    until_status(&app.api, NEW, 200, Instant::now()).await;
    assert_eq!(status_with(&app.api, OLD).await, 200);

    // The old one is removed: refused.
    tokens = format!("{NEW}\n");
    volume.update(&[("mongodb-uri", &uri), ("api-tokens", &tokens)]);
    until_status(&app.api, OLD, 401, Instant::now()).await;
    assert_eq!(status_with(&app.api, NEW).await, 200);

    // An empty file, then none at all: the last good tokens stay, and each cause is logged once, without a token.
    let unusable = "HISTORY_VIEW_API_TOKEN_FILE is unusable";
    volume.update(&[("mongodb-uri", &uri), ("api-tokens", "")]);
    wait_log(&app, unusable, 1).await;
    std::fs::remove_file(volume.dir.join("..data").join("api-tokens")).unwrap();
    wait_log(&app, unusable, 2).await;
    assert_eq!(status_with(&app.api, NEW).await, 200);
    assert_eq!(status_with(&app.api, OLD).await, 401);
    let logged = app.log_lines(unusable);
    assert!(logged[0].contains("holds no token"), "{logged:?}");
    assert!(logged[1].contains("not found"), "{logged:?}");
    for line in app.log_lines("") {
        assert!(
            !line.contains(OLD) && !line.contains(NEW),
            "a token logged: {line}"
        );
    }
}

/// Waits until the worker has logged `needle` at least `count` times.
async fn wait_log(app: &BinaryApp, needle: &str, count: usize) {
    eventually_within(
        &format!("{needle:?} logged {count} times"),
        Duration::from_secs(30),
        || {
            let lines = app.log_lines(needle);
            let logged = when(lines.len() >= count, || format!("{lines:?}"));
            async move { logged }
        },
    )
    .await;
}

/// The token file's bounds through the binary: a file of more than 10,000 tokens or more than 1 MiB stops the start
/// naming the setting; one that grows beyond them later is refused with an ERROR while the last good tokens stay;
/// and a file written in place (truncated, then written a piece at a time) never lets a prefix of a token in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_file_beyond_its_bounds_or_half_written_is_never_taken() {
    const GOOD: &str = "tok-good-7d21c9";
    const NEW: &str = "tok-new-written-in-place";
    let OneThread {
        mongo,
        nats,
        database,
    } = OneThread::start("token-bounds").await;
    let dir = temp_dir("token-bounds");
    let file = dir.join("api-tokens");
    let env = |file: &Path| {
        vec![
            ("HISTORY_VIEW_NATS_URL", nats.url()),
            ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
            ("HISTORY_VIEW_MONGODB_DATABASE", database.clone()),
            (
                "HISTORY_VIEW_API_TOKEN_FILE",
                file.to_str().unwrap().to_owned(),
            ),
        ]
    };
    let many: String = (0..=10_000).map(|i| format!("tok-{i}\n")).collect();
    let large = format!("{}\n", "x".repeat(1 << 20));
    for (content, why) in [
        (&many, "more than 10000 tokens"),
        (&large, "is larger than"),
    ] {
        std::fs::write(&file, content).unwrap();
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_chat-history-view"))
            .envs(env(&file).iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .expect("run the binary");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success(),
            "started with a token file that {why}"
        );
        assert!(
            stderr.contains("HISTORY_VIEW_API_TOKEN_FILE") && stderr.contains(why),
            "{stderr}"
        );
    }

    std::fs::write(&file, format!("{GOOD}\n")).unwrap();
    let app = BinaryApp::start(&env(&file)).await;
    app.wait_ready().await;
    assert_eq!(status_with(&app.api, GOOD).await, 200);
    std::fs::write(&file, &many).unwrap();
    wait_log(&app, "beyond its bounds", 1).await;
    assert!(
        app.log_lines("beyond its bounds")[0].contains("\"ERROR\"")
            || app.log_lines("beyond its bounds")[0].contains("ERROR")
    );
    assert_eq!(status_with(&app.api, GOOD).await, 200);
    assert_eq!(status_with(&app.api, "tok-0").await, 401);

    // Written in place, a piece at a time, more slowly than the file is polled: no prefix is ever accepted.
    let mut written = format!("{GOOD}\n");
    for piece in NEW.as_bytes().chunks(6) {
        written.push_str(std::str::from_utf8(piece).unwrap());
        std::fs::write(&file, &written).unwrap();
        // The scenario: a writer slower than the file is polled (every second), so each prefix sits there for a
        // poll; nothing marks a poll, and a prefix must stay refused however long it sits.
        tokio::time::sleep(Duration::from_millis(1_300)).await;
        let prefix = written.lines().last().unwrap();
        if prefix != NEW {
            assert_eq!(
                status_with(&app.api, prefix).await,
                401,
                "the prefix {prefix} was taken"
            );
        }
    }
    std::fs::write(&file, format!("{written}\n")).unwrap();
    until_status(&app.api, NEW, 200, Instant::now()).await;
}
