//! What every component's settings share: the [`Secret`] type and the value parsers (durations with units, byte
//! sizes, bounded numbers, names). Each component declares its own settings as a clap `Args` group beside its code
//! and parses its values with these, so a bad value fails at start naming the setting (`config.rs` adds the
//! environment variable to clap's message). A leaf: it depends on nothing in the crate.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A setting that must not appear in logs or `Debug` output (the Mongo URI, the API token, the NATS URL).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret([redacted])")
    }
}

/// Keeps a secret setting as given; it is checked after parsing so that clap never echoes it.
pub fn secret(value: &str) -> Result<Secret, std::convert::Infallible> {
    Ok(Secret::new(value))
}

/// A file's path, as given; an empty one counts as unset (see [`unset_if_empty`]).
pub fn path(value: &str) -> Result<PathBuf, std::convert::Infallible> {
    Ok(PathBuf::from(value))
}

/// Makes an empty path unset: a Kubernetes chart renders a variable it has no value for as `""`, and clap keeps
/// an empty variable as an empty value.
pub fn unset_if_empty(path: &mut Option<PathBuf>) {
    if path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
        *path = None;
    }
}

/// Reads a file holding a secret (a mounted Secret's key), as UTF-8 text.
///
/// # Errors
/// The file cannot be read or is not UTF-8: the message names the path and the cause, never the content.
pub fn read_secret_file(path: &Path) -> Result<String, String> {
    let bytes =
        std::fs::read(path).map_err(|error| format!("cannot read {}: {error}", path.display()))?;
    String::from_utf8(bytes).map_err(|_| format!("{} is not UTF-8 text", path.display()))
}

/// The unit of a duration setting given as a plain number: the unit its variable's name ends with.
#[derive(Debug, Clone, Copy)]
pub enum Unit {
    Secs,
    Millis,
}

/// A duration: a plain number in `unit` (the variables keep their `_SECS` and `_MS` names, and deployments pin
/// plain numbers), or a number with a unit (`30s`, `5m`, `2000ms`, `1h 30m`), from `min` to `max`.
pub fn duration(value: &str, unit: Unit, min: Duration, max: Duration) -> Result<Duration, String> {
    let value = value.trim();
    let parsed = match value.parse::<u64>() {
        Ok(n) => match unit {
            Unit::Secs => Duration::from_secs(n),
            Unit::Millis => Duration::from_millis(n),
        },
        Err(_) => humantime::parse_duration(value).map_err(|_| {
            let plain = match unit {
                Unit::Secs => "seconds",
                Unit::Millis => "milliseconds",
            };
            format!("must be a duration: a whole number of {plain}, or a number with a unit (30s, 5m, 2000ms)")
        })?,
    };
    if parsed < min {
        Err(match min {
            Duration::ZERO => unreachable!("no duration is below zero"),
            min if min == Duration::from_nanos(1) => "must be greater than 0".to_owned(),
            min => format!("must be at least {}", humantime::format_duration(min)),
        })
    } else if parsed > max {
        Err(format!(
            "must be at most {}",
            humantime::format_duration(max)
        ))
    } else {
        Ok(parsed)
    }
}

/// The least positive duration: the lower bound of a duration that must be greater than 0.
pub const POSITIVE: Duration = Duration::from_nanos(1);

/// A day: the upper bound of a duration for which more is a typo, not a setting.
pub const DAY: Duration = Duration::from_secs(86_400);

/// A whole number greater than 0.
pub fn positive(value: &str) -> Result<u64, String> {
    match value.trim().parse::<u64>() {
        Ok(0) => Err("must be greater than 0".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("must be a whole number: {e}")),
    }
}

/// A whole number from 1 to `max`.
pub fn count(value: &str, max: u64) -> Result<u64, String> {
    match positive(value)? {
        n if n > max => Err(format!("must be at most {max}")),
        n => Ok(n),
    }
}

/// A byte size: digits with an optional binary (KiB, MiB, GiB) or decimal (KB, MB, GB) suffix.
pub fn bytes(value: &str) -> Result<u64, String> {
    let value = value.trim();
    let split = value
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(value.len());
    let (digits, unit) = value.split_at(split);
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" | "ki" => 1 << 10,
        "mib" | "mi" => 1 << 20,
        "gib" | "gi" => 1 << 30,
        "kb" | "k" => 1_000,
        "mb" | "m" => 1_000_000,
        "gb" | "g" => 1_000_000_000,
        other => {
            return Err(format!(
                "unknown unit `{other}` (use KiB, MiB, GiB, KB, MB or GB)"
            ));
        }
    };
    let number = positive(digits)?;
    number
        .checked_mul(multiplier)
        .ok_or_else(|| "is too large".to_owned())
}

/// A name of a database or collection: non-empty, without `/ \ . space " $`.
pub fn name(value: &str) -> Result<String, String> {
    if value.is_empty() || value.contains(['/', '\\', '.', ' ', '"', '$', '\0']) {
        Err("must be a non-empty name without / \\ . space \" $".into())
    } else {
        Ok(value.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(value: &str) -> Result<Duration, String> {
        duration(value, Unit::Secs, POSITIVE, DAY)
    }

    #[test]
    fn durations_take_their_unit_or_one_of_their_own() {
        assert_eq!(secs("30"), Ok(Duration::from_secs(30)));
        assert_eq!(secs(" 30s "), Ok(Duration::from_secs(30)));
        assert_eq!(secs("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(secs("1h 30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(secs("2000ms"), Ok(Duration::from_secs(2)));
        let millis = |v| duration(v, Unit::Millis, Duration::ZERO, DAY);
        assert_eq!(millis("2000"), Ok(Duration::from_secs(2)));
        assert_eq!(millis("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(millis("0"), Ok(Duration::ZERO));
    }

    #[test]
    fn durations_out_of_range_or_unreadable_say_why() {
        assert_eq!(secs("0"), Err("must be greater than 0".into()));
        assert_eq!(secs("0s"), Err("must be greater than 0".into()));
        assert_eq!(secs("86401"), Err("must be at most 1day".into()));
        assert_eq!(secs("2d"), Err("must be at most 1day".into()));
        for bad in ["", "-1", "1.5", "5 parsecs", "s", "30 s x"] {
            let error = secs(bad).unwrap_err();
            assert!(error.starts_with("must be a duration"), "{bad:?}: {error}");
        }
        let at_least = duration("1ms", Unit::Millis, Duration::from_millis(5), DAY);
        assert_eq!(at_least, Err("must be at least 5ms".into()));
    }

    #[test]
    fn byte_sizes_accept_units() {
        assert_eq!(bytes("1024"), Ok(1024));
        assert_eq!(bytes("64MiB"), Ok(64 << 20));
        assert_eq!(bytes("2 GB"), Ok(2_000_000_000));
        assert!(bytes("0").is_err());
        assert!(bytes("5 parsecs").is_err());
        assert_eq!(bytes("99999999999GiB"), Err("is too large".into()));
    }

    #[test]
    fn counts_are_bounded() {
        assert_eq!(count("5", 5), Ok(5));
        assert_eq!(count("6", 5), Err("must be at most 5".into()));
        assert_eq!(count("0", 5), Err("must be greater than 0".into()));
    }
}
