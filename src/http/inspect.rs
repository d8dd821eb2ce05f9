//! `GET /v1/threads/{thread_id}/history/explain` ([design 3.3](../../docs/design.md#3.3)): every event of the thread
//! with its fate, from the same read as the history (the read core, [`super::read`]: same routing, source and
//! completeness) joined with the stored rows' metadata (one scan shared by the explains asking meanwhile, within the
//! explain share of the store-read slots: [`crate::cache::RowScan`]); and `GET /inspect/threads/{thread_id}`, the inspector page
//! that shows it beside the live feed.

use std::sync::LazyLock;

use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use sha2::{Digest, Sha256};

use super::read::{Read, ThreadRequest, read, respond};
use super::{ApiError, AppState};
use crate::cache::etag_of;
use crate::explain::{ViewFates, explain as join};
use crate::thread_id::ThreadId;

/// The inspector page: one HTML file, no build step.
const INSPECTOR_PAGE: &str = include_str!("inspector.html");

/// The inspector page's `Content-Security-Policy`, computed once from the embedded page: its own `<script>` and
/// `<style>` are allowed by their SHA-256 hashes, so no other inline script or style runs (an injected one, were
/// text ever to reach the page as markup, is blocked), and the page connects to this worker only. Hashes do not
/// cover attributes, so the page has no `style=` or `on…=` attribute (a unit test holds it to that).
static INSPECTOR_CSP: LazyLock<HeaderValue> = LazyLock::new(|| {
    let policy = format!(
        "default-src 'none'; script-src {}; style-src {}; connect-src 'self'; img-src 'self' data:; \
         base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        source_list(&inline_hashes(INSPECTOR_PAGE, "script")),
        source_list(&inline_hashes(INSPECTOR_PAGE, "style")),
    );
    // The policy is ASCII (keywords and base64); were it not, nothing inline would run rather than anything.
    HeaderValue::from_str(&policy).unwrap_or(HeaderValue::from_static("default-src 'none'"))
});

/// The CSP hash source (`'sha256-<base64>'`) of each `<tag>` element of `page`, in order: the SHA-256 of the text
/// between `<tag>` and `</tag>`, exactly as a browser hashes an inline element's content. Only attribute-less
/// opening tags are taken, as the page writes them.
fn inline_hashes(page: &str, tag: &str) -> Vec<String> {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    let mut hashes = Vec::new();
    let mut rest = page;
    while let Some(start) = rest.find(&open) {
        let body = &rest[start + open.len()..];
        let Some(end) = body.find(&close) else { break };
        let digest = Sha256::digest(&body.as_bytes()[..end]);
        hashes.push(format!(
            "'sha256-{}'",
            base64::engine::general_purpose::STANDARD.encode(digest)
        ));
        rest = &body[end + close.len()..];
    }
    hashes
}

/// A CSP source list of `hashes`; `'none'` when there are none.
fn source_list(hashes: &[String]) -> String {
    if hashes.is_empty() {
        "'none'".to_owned()
    } else {
        hashes.join(" ")
    }
}

/// `GET /v1/threads/{thread_id}/history/explain`.
pub async fn explain(
    State(state): State<AppState>,
    request: ThreadRequest,
) -> Result<Response, ApiError> {
    let primary = request.identity()?;
    request.refuse_run_wait("explain")?;
    match read::<ViewFates>(&state, &request, primary.as_ref(), None).await? {
        Read::Forwarded(response) => Ok(response),
        Read::Answered { answer, .. } => {
            let thread = request.thread.as_str();
            let rows = state
                .views
                .row_metadata(thread)
                .await
                .map_err(|error| ApiError::from_read(error, thread))?;
            let explanation = join(thread, &answer.body, &rows.rows);
            // Serialising strings, numbers and maps of them cannot fail.
            let body = Bytes::from(serde_json::to_vec(&explanation).unwrap_or_default());
            let etag = etag_of(&body);
            let mut response = respond(&answer, &etag, body, None, &request.headers);
            response
                .headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            Ok(response)
        }
    }
}

/// `GET /inspect/threads/{thread_id}`: the inspector page when `HISTORY_VIEW_INSPECTOR` allows it; 404 otherwise.
/// The page holds no data: its script reads the feed and `explain` through the API (with the token typed into
/// it, when one is set).
pub async fn inspector(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    if !state.inspector {
        return Err(ApiError::NotFound);
    }
    let Path(raw_id) = path.map_err(|_| ApiError::InvalidThreadId("is not valid UTF-8"))?;
    ThreadId::parse(raw_id)?;
    let headers = [
        (
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        ),
        (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
        (header::CONTENT_SECURITY_POLICY, INSPECTOR_CSP.clone()),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
        (
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ),
    ];
    Ok((headers, INSPECTOR_PAGE).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inspector_policy_allows_the_page_own_script_and_style_by_hash_and_no_other_inline_code()
    {
        let policy = INSPECTOR_CSP.to_str().expect("an ASCII policy");
        assert!(!policy.contains("unsafe-inline"), "{policy}");
        let scripts = inline_hashes(INSPECTOR_PAGE, "script");
        let styles = inline_hashes(INSPECTOR_PAGE, "style");
        assert_eq!(
            (scripts.len(), styles.len()),
            (1, 1),
            "one script, one style"
        );
        assert!(
            policy.contains(&format!("script-src {};", scripts[0])),
            "{policy}"
        );
        assert!(
            policy.contains(&format!("style-src {};", styles[0])),
            "{policy}"
        );
        // Every script and style element is one the hashes cover (no attributes on their tags) ...
        assert_eq!(INSPECTOR_PAGE.matches("<script").count(), 1);
        assert_eq!(INSPECTOR_PAGE.matches("<style").count(), 1);
        // ... and the markup has no attribute a hash cannot cover: `style=` or an event handler (`onclick=`, …).
        let (markup, _) = INSPECTOR_PAGE.split_once("<script>").expect("a script");
        for attribute in markup.split(|c: char| c.is_ascii_whitespace()) {
            let name = attribute.split_once('=').map_or("", |(name, _)| name);
            assert!(
                name != "style" && !name.starts_with("on"),
                "an attribute hashes do not cover: {attribute}"
            );
        }
    }

    #[test]
    fn an_inline_hash_is_the_sha256_of_the_element_text() {
        // The digest of "alert(1)" as browsers report it in a CSP violation.
        assert_eq!(
            inline_hashes("<p><script>alert(1)</script><script>", "script"),
            ["'sha256-bhHHL3z2vDgxUt0W3dWQOrprscmda2Y5pLsLg4GF+pI='"]
        );
        assert!(inline_hashes("<style>", "style").is_empty());
        assert_eq!(source_list(&[]), "'none'");
    }
}
