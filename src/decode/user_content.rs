//! User content ([contract 5.5](../../docs/contract.md#5.5)): the last ChatMessage of a user message, validated as
//! llama-index's `ChatMessage.model_validate` would, and the OpenAI parts aihub makes of its blocks.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::Value;

use super::{ErrorType, ImageUrl, InputAudio, Part, UserContent};

/// llama-index `MessageRole` values; `ChatMessage.role` must be one of them when present.
const MESSAGE_ROLES: [&str; 8] = [
    "system",
    "developer",
    "user",
    "assistant",
    "function",
    "tool",
    "chatbot",
    "model",
];

pub(super) fn user_content(messages: Option<&Value>) -> UserContent {
    let mut unsupported_audio = Vec::new();
    let parts = user_parts(messages, &mut unsupported_audio);
    UserContent {
        unsupported_audio,
        parts,
    }
}

fn user_parts(
    messages: Option<&Value>,
    unsupported_audio: &mut Vec<Box<str>>,
) -> Result<Vec<Part>, ErrorType> {
    use ErrorType::{TypeError, ValidationError, ValueError};
    let Some(Value::Array(messages)) = messages else {
        return Err(ValueError);
    };
    let Some(last) = messages.last() else {
        return Err(ValueError);
    };
    let Value::Object(last) = last else {
        return Err(TypeError);
    };
    let Some(Value::Array(blocks)) = last.get("blocks") else {
        return Err(TypeError);
    };
    let mut kept = Vec::with_capacity(blocks.len());
    for block in blocks {
        let Value::Object(block) = block else {
            return Err(TypeError);
        };
        if let Some("text" | "image" | "audio") = block.get("block_type").and_then(Value::as_str) {
            kept.push(block);
        }
    }

    // ChatMessage.model_validate: role and additional_kwargs, then every kept block.
    // Chosen: `role` is validated against llama-index's MessageRole enum (as model_validate does) but its value
    // is otherwise ignored: the last message is always a user turn.
    match last.get("role") {
        None => {}
        Some(Value::String(role)) if MESSAGE_ROLES.contains(&role.as_str()) => {}
        Some(_) => return Err(ValidationError),
    }
    if !matches!(last.get("additional_kwargs"), None | Some(Value::Object(_))) {
        return Err(ValidationError);
    }
    let blocks = kept
        .into_iter()
        .map(Block::validate)
        .collect::<Result<Vec<_>, _>>()?;

    let mut parts = Vec::new();
    for block in blocks {
        match block {
            Block::Text(text) if !text.is_empty() => parts.push(Part::Text { text }),
            Block::Text(_) => {}
            Block::Image(Some(url)) => parts.push(Part::ImageUrl {
                image_url: ImageUrl { url },
            }),
            // Inline images (bytes or path, no url) cannot be given back to a client: dropped silently.
            Block::Image(None) => {}
            Block::Audio { data, format } => match (format.as_deref(), data) {
                (Some(f @ ("wav" | "mp3")), Some(data)) => parts.push(Part::InputAudio {
                    input_audio: InputAudio {
                        data,
                        format: f.to_owned(),
                    },
                }),
                (Some("wav" | "mp3"), None) => {}
                (_, Some(_)) => {
                    // str(format) in aihub: a missing format renders as Python's "None".
                    unsupported_audio.push(format.as_deref().unwrap_or("None").into());
                }
                (_, None) => {}
            },
        }
    }
    if parts.is_empty() {
        return Err(ValueError);
    }
    Ok(parts)
}

/// A content block after validation, holding only what history emits.
enum Block {
    Text(String),
    /// The normalised url, if any.
    Image(Option<String>),
    /// `data`: base64 text of non-empty audio bytes; `format`: as given, or guessed from the bytes when absent.
    Audio {
        data: Option<String>,
        format: Option<String>,
    },
}

impl Block {
    fn validate(block: &serde_json::Map<String, Value>) -> Result<Block, ErrorType> {
        let optional_text = |name: &str| match block.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(_) => Err(ErrorType::ValidationError),
        };
        match block.get("block_type").and_then(Value::as_str) {
            Some("text") => match block.get("text") {
                Some(Value::String(text)) => Ok(Block::Text(text.clone())),
                _ => Err(ErrorType::ValidationError),
            },
            Some("image") => {
                bytes_field(block.get("image"))?;
                // Chosen: `path` is accepted as any string; llama-index's FilePath would also require the file to
                // exist on the aihub host, which cannot be checked from here.
                optional_text("path")?;
                optional_text("image_mimetype")?;
                optional_text("detail")?;
                Ok(Block::Image(url_field(block.get("url"))?))
            }
            Some("audio") => {
                let audio = bytes_field(block.get("audio"))?;
                optional_text("path")?;
                url_field(block.get("url"))?;
                let mut format = optional_text("format")?.map(str::to_owned);
                let data = match audio {
                    Some(bytes) if !bytes.is_empty() => {
                        // llama-index keeps audio base64-encoded: bytes that already are strict base64 stay as
                        // they are, anything else is encoded. The format is guessed from the decoded bytes when
                        // none was given.
                        let (data, decoded) = match strict_base64_decode(&bytes) {
                            Some(decoded) => {
                                (String::from_utf8_lossy(&bytes).into_owned(), decoded)
                            }
                            None => (BASE64.encode(&bytes), bytes),
                        };
                        if format.as_deref().is_none_or(str::is_empty) {
                            format = guess_audio_format(&decoded).map(str::to_owned);
                        }
                        Some(data)
                    }
                    _ => None,
                };
                Ok(Block::Audio { data, format })
            }
            // Only text, image and audio blocks are kept before validation.
            _ => Err(ErrorType::ValidationError),
        }
    }
}

/// A pydantic `bytes | None` field after aihub's legacy normalisation: a list of ints 0..=255 (bools excluded)
/// becomes bytes; a string becomes its UTF-8 bytes (pydantic's lax mode); anything else fails validation.
fn bytes_field(value: Option<&Value>) -> Result<Option<Vec<u8>>, ErrorType> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_bytes().to_vec())),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                Value::Number(n) => n.as_u64().and_then(|b| u8::try_from(b).ok()),
                _ => None,
            })
            .collect::<Option<Vec<u8>>>()
            .map(Some)
            .ok_or(ErrorType::ValidationError),
        Some(_) => Err(ErrorType::ValidationError),
    }
}

/// An image or audio `url`: a string is parsed as pydantic's `AnyUrl` does (pydantic-core uses the `url` crate, so
/// `Url`'s serialisation is the normalised form); an unparsable string or a non-string fails validation.
fn url_field(value: Option<&Value>) -> Result<Option<String>, ErrorType> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => url::Url::parse(s)
            .map(|u| Some(String::from(u)))
            .map_err(|_| ErrorType::ValidationError),
        Some(_) => Err(ErrorType::ValidationError),
    }
}

/// Python's `base64.b64decode(data, validate=True)`: only the standard alphabet with at most two trailing `=`,
/// and complete quads (a `=` where a quad has fewer than two characters is ignored, as binascii does).
/// Returns `None` where Python raises.
fn strict_base64_decode(data: &[u8]) -> Option<Vec<u8>> {
    let body_len = data.iter().rposition(|&b| b != b'=').map_or(0, |i| i + 1);
    let padding = data.len() - body_len;
    if padding > 2
        || !data[..body_len]
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/')
    {
        return None;
    }
    match body_len % 4 {
        0 => {}
        // binascii needs the quad completed by padding.
        2 if padding == 2 => {}
        3 if padding >= 1 => {}
        _ => return None,
    }
    // binascii also accepts non-zero trailing bits, which the default engines reject.
    const LENIENT: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_allow_trailing_bits(true)
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::RequireNone),
    );
    LENIENT.decode(&data[..body_len]).ok()
}

/// The audio formats `filetype.guess` (used by llama-index) recognises that matter here.
///
/// Chosen: wav and mp3 (the supported ones) plus ogg and flac for the warning's `audio_format`; anything else is
/// reported as "None".
fn guess_audio_format(bytes: &[u8]) -> Option<&'static str> {
    match bytes {
        [
            b'R',
            b'I',
            b'F',
            b'F',
            _,
            _,
            _,
            _,
            b'W',
            b'A',
            b'V',
            b'E',
            ..,
        ] => Some("wav"),
        [b'I', b'D', b'3', ..] | [0xFF, 0xFB | 0xF3 | 0xF2, ..] => Some("mp3"),
        [b'O', b'g', b'g', b'S', ..] => Some("ogg"),
        [b'f', b'L', b'a', b'C', ..] => Some("flac"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::decode::testing::{body, key, payload};
    use crate::decode::{Body, USER_AGENT};

    /// The content decoded from a `UserAgent` user message payload.
    fn user_message(payload_json: Value) -> UserContent {
        match body(payload(key(USER_AGENT, "UserMessageEvent"), payload_json)) {
            Body::UserMessage(content) => *content,
            other => panic!("not a user message: {other:?}"),
        }
    }

    fn audio(value: Value, format: Value) -> Value {
        json!({"_parent_event_names": ["UserMessageEvent"], "created_at": 1, "messages": [
            {"role": "user", "blocks": [{"block_type": "audio", "audio": value, "format": format}]}]})
    }

    #[test]
    fn legacy_int_list_audio_is_base64_encoded() {
        let bytes: Vec<u8> = b"encoded-audio".to_vec();
        let content = user_message(audio(json!(bytes), json!("wav")));
        assert_eq!(
            content.parts,
            Ok(vec![Part::InputAudio {
                input_audio: InputAudio {
                    data: "ZW5jb2RlZC1hdWRpbw==".into(),
                    format: "wav".into()
                }
            }])
        );
    }

    #[test]
    fn audio_that_already_is_base64_is_kept() {
        let content = user_message(audio(json!("ZW5jb2RlZC1hdWRpbw=="), json!("mp3")));
        assert_eq!(
            content.parts,
            Ok(vec![Part::InputAudio {
                input_audio: InputAudio {
                    data: "ZW5jb2RlZC1hdWRpbw==".into(),
                    format: "mp3".into()
                }
            }])
        );
    }

    #[test]
    fn boolean_byte_lists_fail_validation() {
        let content = user_message(audio(json!([true, false]), json!("wav")));
        assert_eq!(content.parts, Err(ErrorType::ValidationError));
    }

    #[test]
    fn unsupported_audio_is_reported_and_a_missing_format_is_guessed() {
        let content = user_message(audio(json!("abc"), json!("ogg")));
        assert_eq!(content.unsupported_audio, vec!["ogg".into()]);
        assert_eq!(content.parts, Err(ErrorType::ValueError));

        let wav: Vec<u8> = b"RIFF\0\0\0\0WAVEfmt ".to_vec();
        let content = user_message(audio(json!(wav), Value::Null));
        assert!(
            matches!(&content.parts.unwrap()[0], Part::InputAudio { input_audio } if input_audio.format == "wav")
        );
    }

    #[test]
    fn strict_base64_matches_python_validate_true() {
        assert!(strict_base64_decode(b"ZW5jb2RlZC1hdWRpbw==").is_some());
        assert!(strict_base64_decode(b"abcd").is_some());
        assert!(strict_base64_decode(b"").is_some());
        assert!(strict_base64_decode(b"abc=").is_some());
        assert!(strict_base64_decode(b"ab==").is_some());
        assert!(strict_base64_decode(b"abc").is_none());
        assert!(strict_base64_decode(b"ab=").is_none());
        assert!(strict_base64_decode(b"a===").is_none());
        assert!(strict_base64_decode(b"encoded-audio").is_none());
        assert!(strict_base64_decode(b"ab cd").is_none());
        assert!(strict_base64_decode(b"abcde").is_none());
    }

    #[test]
    fn image_urls_are_normalised_and_invalid_ones_fail() {
        let msg = |url: Value| {
            json!({"_parent_event_names": ["UserMessageEvent"], "created_at": 1, "messages": [
                {"role": "user", "blocks": [{"block_type": "image", "url": url}, {"block_type": "text", "text": "t"}]}]})
        };
        let c = user_message(msg(json!("HTTPS://Example.COM")));
        assert_eq!(
            c.parts.unwrap()[0],
            Part::ImageUrl {
                image_url: ImageUrl {
                    url: "https://example.com/".into()
                }
            }
        );
        let c = user_message(msg(json!("not a url")));
        assert_eq!(c.parts, Err(ErrorType::ValidationError));
    }

    #[test]
    fn user_message_raw_checks_raise_the_contract_error_types() {
        let cases = [
            (json!([]), ErrorType::ValueError),
            (json!(null), ErrorType::ValueError),
            (json!(["x"]), ErrorType::TypeError),
            (json!([{"role": "user"}]), ErrorType::TypeError),
            (
                json!([{"role": "user", "blocks": ["x"]}]),
                ErrorType::TypeError,
            ),
            (
                json!([{"role": "user", "blocks": [{"block_type": "text", "text": 1}]}]),
                ErrorType::ValidationError,
            ),
            (
                json!([{"role": "wizard", "blocks": [{"block_type": "text", "text": "a"}]}]),
                ErrorType::ValidationError,
            ),
            (
                json!([{"role": "user", "blocks": [{"block_type": "document", "x": 1}]}]),
                ErrorType::ValueError,
            ),
        ];
        for (messages, expected) in cases {
            let c = user_message(
                json!({"_parent_event_names": ["UserMessageEvent"], "created_at": 1, "messages": messages}),
            );
            assert_eq!(c.parts, Err(expected), "{messages}");
        }
    }
}
