//! The bearer tokens `/v1/*` accepts ([design 3.4](../../docs/design.md#3.4)): the one of `HISTORY_VIEW_API_TOKEN`,
//! or every line of `HISTORY_VIEW_API_TOKEN_FILE`, which is read again every second so that tokens rotate without a
//! restart. Each token is kept only as its SHA-256 digest, and a presented token's digest is looked up among them
//! (one probe: the digests already hide the tokens, so the lookup's timing shows nothing of a token). The file holds
//! at most [`MAX_FILE_BYTES`] and [`MAX_TOKENS`]: beyond either it is refused (at start, the start fails; later, the
//! last good set stays, with an ERROR). A file whose last line is not terminated may be one being written in place:
//! it is taken only once it has read the same for [`UNTERMINATED_SETTLE`], so that a prefix of a new token is never
//! accepted (a Secret made from a literal has no final newline: it still rotates, within the 5 s a rotation may
//! take).
//!
//! Chosen: polling the file by its path rather than watching it. Kubernetes updates a mounted Secret by swapping a
//! `..data` symlink to a new directory, never by writing the file, so a watch on the file sees nothing (and one on
//! the directory depends on the volume type); reading a small file once a second by path follows the link, costs
//! nothing measurable, and works alike for every way the file can be replaced.

use std::collections::HashSet;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::setting::Secret;

/// How often the token file is read again: a token added or removed takes effect within this (plus the read), well
/// within the 5 s a rotation may take.
pub const TOKEN_FILE_POLL: Duration = Duration::from_secs(1);

/// The largest token file taken: far above any real set (10,000 tokens of 64 characters are 650 KB), small enough that
/// reading it every second costs nothing.
pub const MAX_FILE_BYTES: u64 = 1 << 20;
/// The most tokens a file may hold.
pub const MAX_TOKENS: usize = 10_000;
/// How long a content whose last line is unterminated must read the same before it is taken.
pub const UNTERMINATED_SETTLE: Duration = Duration::from_secs(3);

/// While the token file stays unreadable or unusable, its warning repeats at most this often.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// One configured token, kept only as its SHA-256 digest: a presented token is hashed and its digest looked up, so
/// the timing shows neither the token's bytes nor its length.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TokenDigest([u8; 32]);

impl TokenDigest {
    pub fn new(token: &Secret) -> Self {
        Self(Sha256::digest(token.expose().as_bytes()).into())
    }
}

/// The tokens accepted now. Cloning is cheap: the clones share the set, which the file's watcher replaces.
#[derive(Clone)]
pub struct ApiTokens {
    /// Replaced whole by the watcher; read by every request. A std lock: never held across an `.await`.
    digests: Arc<RwLock<HashSet<TokenDigest>>>,
}

impl ApiTokens {
    pub fn new(tokens: &[Secret]) -> Self {
        Self {
            digests: Arc::new(RwLock::new(tokens.iter().map(TokenDigest::new).collect())),
        }
    }

    /// Whether `presented` is one of the tokens: its digest, looked up once, however many tokens there are.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let presented = TokenDigest(Sha256::digest(presented).into());
        let digests = self.digests.read().unwrap_or_else(PoisonError::into_inner);
        digests.contains(&presented)
    }

    /// Makes `tokens` the accepted set; returns whether it differs from the set before.
    fn replace(&self, tokens: &[Secret]) -> bool {
        let digests: HashSet<TokenDigest> = tokens.iter().map(TokenDigest::new).collect();
        let mut current = self.digests.write().unwrap_or_else(PoisonError::into_inner);
        let changed = *current != digests;
        *current = digests;
        changed
    }

    /// Reads `path` every [`TOKEN_FILE_POLL`] until `stop`, and makes its tokens the accepted set whenever its
    /// content changes to a usable one. The file was read at start (a bad one stopped the start), so this only
    /// follows rotations.
    pub async fn watch_file(self, path: PathBuf, stop: CancellationToken) {
        let mut file = TokenFile::new(self);
        loop {
            tokio::select! {
                biased;
                () = stop.cancelled() => return,
                () = tokio::time::sleep(TOKEN_FILE_POLL) => {}
            }
            let read = {
                let path = path.clone();
                // A read of a mounted file can block (a network volume): off the runtime's threads.
                tokio::task::spawn_blocking(move || read_bounded(&path)).await
            };
            let read = read.unwrap_or_else(|join| Err(std::io::Error::other(join)));
            file.apply(read, Instant::now());
        }
    }
}

/// The token file's bytes, at most [`MAX_FILE_BYTES`] + 1 of them (one more tells it is too large) whatever its
/// size.
///
/// # Errors
/// The file cannot be read.
pub fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Why a token file's content is not taken: the reason (never the content), and whether the file is beyond its
/// bounds ([`MAX_FILE_BYTES`], [`MAX_TOKENS`]), which the watcher logs at ERROR rather than WARN.
#[derive(Debug, PartialEq, Eq)]
pub struct Refused {
    pub reason: String,
    pub beyond_bounds: bool,
}

impl Refused {
    fn unusable(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            beyond_bounds: false,
        }
    }

    fn beyond_bounds(reason: String) -> Self {
        Self {
            reason,
            beyond_bounds: true,
        }
    }
}

/// Whether a token file's bytes are more than it may hold.
fn too_large(bytes: &[u8]) -> bool {
    bytes.len() as u64 > MAX_FILE_BYTES
}

/// The tokens of a token file's bytes (as [`read_bounded`] gives them): at start and at every change alike.
///
/// # Errors
/// [`Refused`]: too large, not UTF-8, or as [`parse`] says.
pub fn tokens_of(bytes: &[u8]) -> Result<Vec<Secret>, Refused> {
    if too_large(bytes) {
        return Err(Refused::beyond_bounds(format!(
            "is larger than {MAX_FILE_BYTES} bytes"
        )));
    }
    let text = std::str::from_utf8(bytes).map_err(|_| Refused::unusable("is not UTF-8 text"))?;
    parse(text)
}

/// The tokens of a token file's text: one a line; blank lines and whitespace around a token are ignored.
///
/// # Errors
/// No token at all, more than [`MAX_TOKENS`], or a line that is no token (printable ASCII without whitespace); the
/// message gives the line's number, never its text.
fn parse(text: &str) -> Result<Vec<Secret>, Refused> {
    let mut tokens = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let token = line.trim();
        if token.is_empty() {
            continue;
        }
        if tokens.len() == MAX_TOKENS {
            return Err(Refused::beyond_bounds(format!(
                "holds more than {MAX_TOKENS} tokens"
            )));
        }
        check(token)
            .map_err(|reason| Refused::unusable(format!("line {}: {reason}", number + 1)))?;
        tokens.push(Secret::new(token));
    }
    if tokens.is_empty() {
        return Err(Refused::unusable("holds no token (one a line)"));
    }
    Ok(tokens)
}

/// A token must be printable ASCII without whitespace: anything else could never be presented in an
/// `Authorization` header as it is, and would refuse every request rather than fail at start.
pub fn check(token: &str) -> Result<(), String> {
    if token.is_empty() {
        Err("must not be empty".into())
    } else if token
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || !c.is_ascii())
    {
        Err("must be printable ASCII without whitespace".into())
    } else {
        Ok(())
    }
}

/// What the watcher knows of the token file between two reads.
struct TokenFile {
    tokens: ApiTokens,
    /// The SHA-256 of the content last read, usable or not: an unchanged file is not parsed again.
    content: Option<[u8; 32]>,
    /// Why the file is unusable now, and when that was last logged; `None` while the file is fine.
    failing: Option<(String, Instant)>,
    /// The SHA-256 of a content read with its last line unterminated, and when it was first read so: taken once it
    /// has read the same for [`UNTERMINATED_SETTLE`].
    unterminated: Option<([u8; 32], Instant)>,
}

impl TokenFile {
    fn new(tokens: ApiTokens) -> Self {
        Self {
            tokens,
            content: None,
            failing: None,
            unterminated: None,
        }
    }

    /// Takes one read of the file: a changed, usable content becomes the accepted set; an unreadable or unusable
    /// one keeps the last good set and is logged at WARN (when it begins or its cause changes, then every
    /// [`WARN_EVERY`]), never with the content.
    fn apply(&mut self, read: std::io::Result<Vec<u8>>, now: Instant) {
        let refused = match read {
            Err(error) => Refused::unusable(format!("cannot be read: {}", error.kind())),
            Ok(bytes) => {
                let digest: [u8; 32] = Sha256::digest(&bytes).into();
                if self.content == Some(digest) && self.failing.is_none() {
                    return;
                }
                if !bytes.is_empty() && !bytes.ends_with(b"\n") && !too_large(&bytes) {
                    // Its last line may be a token still being written in place: taken once it stays the same.
                    match self.unterminated {
                        Some((seen, since)) if seen == digest => {
                            if now < since + UNTERMINATED_SETTLE {
                                return;
                            }
                        }
                        _ => {
                            self.unterminated = Some((digest, now));
                            return;
                        }
                    }
                }
                self.unterminated = None;
                self.content = Some(digest);
                match tokens_of(&bytes) {
                    Ok(tokens) => {
                        if self.tokens.replace(&tokens) || self.failing.is_some() {
                            tracing::info!(
                                tokens = tokens.len(),
                                "API tokens read again from HISTORY_VIEW_API_TOKEN_FILE"
                            );
                        }
                        self.failing = None;
                        return;
                    }
                    Err(refused) => refused,
                }
            }
        };
        let Refused {
            reason,
            beyond_bounds,
        } = refused;
        let repeat = match &self.failing {
            Some((previous, logged)) => *previous != reason || now >= *logged + WARN_EVERY,
            None => true,
        };
        if repeat {
            if beyond_bounds {
                tracing::error!(
                    reason = %reason,
                    "HISTORY_VIEW_API_TOKEN_FILE is beyond its bounds; keeping the tokens read last"
                );
            } else {
                tracing::warn!(
                    reason = %reason,
                    "HISTORY_VIEW_API_TOKEN_FILE is unusable; keeping the tokens read last"
                );
            }
            self.failing = Some((reason, now));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secrets(tokens: &[&str]) -> Vec<Secret> {
        tokens.iter().map(|t| Secret::new(*t)).collect()
    }

    #[test]
    fn a_token_file_holds_one_token_a_line_around_blank_lines_and_whitespace() {
        let tokens = parse("\n  old-token \r\n\n\tnew-token\n").unwrap();
        assert_eq!(tokens, secrets(&["old-token", "new-token"]));
        assert_eq!(parse("only").unwrap(), secrets(&["only"]));
        let reason = |text: &str| parse(text).map_err(|refused| refused.reason);
        assert_eq!(reason(""), Err("holds no token (one a line)".into()));
        assert_eq!(reason(" \n\n"), Err("holds no token (one a line)".into()));
        // The line's number, never its text.
        let error = reason("good\nsecret with space\n").unwrap_err();
        assert_eq!(error, "line 2: must be printable ASCII without whitespace");
        assert!(parse("caf\u{e9}").is_err());
    }

    #[test]
    fn every_token_of_the_set_is_accepted_and_nothing_else() {
        let tokens = ApiTokens::new(&secrets(&["alpha", "beta"]));
        assert!(tokens.matches(b"alpha"));
        assert!(tokens.matches(b"beta"));
        for refused in [&b"alph"[..], b"alphabeta", b"", b"gamma"] {
            assert!(!tokens.matches(refused));
        }
        assert!(!ApiTokens::new(&[]).matches(b""));
    }

    #[test]
    fn a_changed_file_replaces_the_set_and_a_broken_one_keeps_the_last_good_set() {
        let tokens = ApiTokens::new(&secrets(&["old"]));
        let mut file = TokenFile::new(tokens.clone());
        let start = Instant::now();

        // The new token is added beside the old one, then the old one is removed.
        file.apply(Ok(b"old\nnew\n".to_vec()), start);
        assert!(tokens.matches(b"old") && tokens.matches(b"new"));
        file.apply(Ok(b"new\n".to_vec()), start);
        assert!(!tokens.matches(b"old") && tokens.matches(b"new"));

        // Gone, empty, or holding no usable token: the last good set stays, and the failure is remembered.
        let missing = std::io::Error::from(std::io::ErrorKind::NotFound);
        file.apply(Err(missing), start);
        assert!(tokens.matches(b"new"));
        assert!(
            file.failing
                .as_ref()
                .is_some_and(|(r, _)| r.contains("not found"))
        );
        file.apply(Ok(Vec::new()), start);
        assert!(tokens.matches(b"new"));
        file.apply(Ok(b"bad token\n".to_vec()), start);
        assert!(tokens.matches(b"new"));
        assert_eq!(
            file.failing.as_ref().map(|(r, _)| r.as_str()),
            Some("line 1: must be printable ASCII without whitespace")
        );

        // Fixed: the file's tokens again, and no failure.
        file.apply(Ok(b"newer\n".to_vec()), start);
        assert!(!tokens.matches(b"new") && tokens.matches(b"newer"));
        assert!(file.failing.is_none());
    }

    #[test]
    fn a_file_being_written_in_place_is_taken_only_once_its_last_line_is_done() {
        let tokens = ApiTokens::new(&secrets(&["old"]));
        let mut file = TokenFile::new(tokens.clone());
        let start = Instant::now();
        // A writer that truncates and writes: a read sees a prefix of the new token.
        file.apply(Ok(b"old\nne".to_vec()), start);
        assert!(!tokens.matches(b"ne") && tokens.matches(b"old"));
        // The next read sees more of it: still changing, still not taken.
        file.apply(Ok(b"old\nnewto".to_vec()), start + Duration::from_secs(2));
        assert!(!tokens.matches(b"newto"));
        // Terminated: taken at once.
        file.apply(Ok(b"old\nnewtoken\n".to_vec()), start);
        assert!(tokens.matches(b"newtoken") && !tokens.matches(b"newto"));
        // A last line left unterminated for good (a Secret made from a literal) is taken once it stayed the same.
        file.apply(Ok(b"rotated".to_vec()), start);
        file.apply(Ok(b"rotated".to_vec()), start + Duration::from_secs(2));
        assert!(!tokens.matches(b"rotated"));
        file.apply(Ok(b"rotated".to_vec()), start + UNTERMINATED_SETTLE);
        assert!(tokens.matches(b"rotated") && !tokens.matches(b"newtoken"));
    }

    #[test]
    fn a_file_beyond_its_bounds_is_refused_and_the_last_good_set_kept() {
        let tokens = ApiTokens::new(&secrets(&["kept"]));
        let mut file = TokenFile::new(tokens.clone());
        let start = Instant::now();
        let many: String = (0..=MAX_TOKENS).map(|i| format!("t{i}\n")).collect();
        file.apply(Ok(many.into_bytes()), start);
        assert!(tokens.matches(b"kept") && !tokens.matches(b"t0"));
        assert_eq!(
            file.failing.as_ref().map(|(r, _)| r.as_str()),
            Some("holds more than 10000 tokens")
        );
        let exactly: String = (0..MAX_TOKENS).map(|i| format!("t{i}\n")).collect();
        file.apply(Ok(exactly.into_bytes()), start);
        assert!(tokens.matches(b"t0") && tokens.matches(b"t9999") && file.failing.is_none());
        let mut large = vec![b'x'; usize::try_from(MAX_FILE_BYTES).unwrap()];
        large.extend_from_slice(b"\n");
        file.apply(Ok(large), start);
        assert!(tokens.matches(b"t0"));
        assert!(
            file.failing
                .as_ref()
                .is_some_and(|(r, _)| r.starts_with("is larger than"))
        );
    }

    #[test]
    fn a_lasting_failure_is_logged_again_only_after_a_while() {
        let mut file = TokenFile::new(ApiTokens::new(&secrets(&["t"])));
        let start = Instant::now();
        let gone = || Err(std::io::Error::from(std::io::ErrorKind::NotFound));
        file.apply(gone(), start);
        let first = file.failing.as_ref().map(|(_, at)| *at);
        assert_eq!(first, Some(start));
        // The same cause a second later is not logged again: the instant it was logged stays.
        file.apply(gone(), start + Duration::from_secs(1));
        assert_eq!(file.failing.as_ref().map(|(_, at)| *at), first);
        // A minute on, it is.
        let later = start + WARN_EVERY;
        file.apply(gone(), later);
        assert_eq!(file.failing.as_ref().map(|(_, at)| *at), Some(later));
        // Another cause is logged at once.
        let sooner = later + Duration::from_secs(1);
        file.apply(Ok(Vec::new()), sooner);
        assert_eq!(file.failing.as_ref().map(|(_, at)| *at), Some(sooner));
    }
}
