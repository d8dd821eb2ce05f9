//! Stop events ([contract 7](../../docs/contract.md#7)): the full answer of the last output message, validated as
//! core `Message` is, which the prefix rule compares with what streamed.

use serde_json::Value;

use super::ErrorType;

/// `output_messages` that is not a non-empty list gives an empty answer; otherwise its last element must validate
/// as core `Message` and its `content` is the concatenated text of its `contents` text items.
///
/// Chosen: `role` must be a string; `name`, `function_call_name`, `function_call_arguments_json`, `tool_call_id`
/// strings or null; `tool_calls` a list or null; each `contents` item an object whose `type` is `text` (with a
/// string `text`), `image` or `audio` (their other fields are not checked).
pub(super) fn full_answer(output_messages: Option<&Value>) -> Result<Box<str>, ErrorType> {
    let Some(Value::Array(messages)) = output_messages else {
        return Ok("".into());
    };
    let Some(last) = messages.last() else {
        return Ok("".into());
    };
    let invalid = ErrorType::ValidationError;
    let Value::Object(message) = last else {
        return Err(invalid);
    };
    if !matches!(message.get("role"), Some(Value::String(_))) {
        return Err(invalid);
    }
    for name in [
        "name",
        "function_call_name",
        "function_call_arguments_json",
        "tool_call_id",
    ] {
        if !matches!(
            message.get(name),
            None | Some(Value::Null | Value::String(_))
        ) {
            return Err(invalid);
        }
    }
    if !matches!(
        message.get("tool_calls"),
        None | Some(Value::Null | Value::Array(_))
    ) {
        return Err(invalid);
    }
    let mut content = String::new();
    match message.get("contents") {
        None | Some(Value::Null) => {}
        Some(Value::Array(items)) => {
            for item in items {
                let Value::Object(item) = item else {
                    return Err(invalid);
                };
                match item.get("type").and_then(Value::as_str) {
                    Some("text") => match item.get("text") {
                        Some(Value::String(text)) => content.push_str(text),
                        _ => return Err(invalid),
                    },
                    Some("image" | "audio") => {}
                    _ => return Err(invalid),
                }
            }
        }
        Some(_) => return Err(invalid),
    }
    Ok(content.into())
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::decode::Body;
    use crate::decode::testing::{body, key, payload};

    #[test]
    fn stop_answers_follow_the_core_message_rules() {
        let stop = |om: Value| {
            body(payload(
                key("P", "LLMStopEvent"),
                json!({"_parent_event_names": ["LLMStopEvent", "StopEvent"], "created_at": 1, "output_messages": om}),
            ))
        };
        assert_eq!(stop(json!(null)), Body::Stop(Ok("".into())));
        assert_eq!(stop(json!([])), Body::Stop(Ok("".into())));
        assert_eq!(
            stop(
                json!([{"role": "assistant", "contents": [{"type": "text", "text": "a"}, {"type": "image", "url": "u"},
                                                          {"type": "text", "text": "b"}], "content": "ignored"}])
            ),
            Body::Stop(Ok("ab".into()))
        );
        assert_eq!(
            stop(json!([{"role": "assistant", "contents": "invalid"}])),
            Body::Stop(Err(ErrorType::ValidationError))
        );
        assert_eq!(
            stop(json!([{"contents": []}])),
            Body::Stop(Err(ErrorType::ValidationError))
        );
    }
}
