//! The streaming handlers: [`Handler::Stream`] (a token stream, or one answer for a body that
//! says `"stream": false`) and [`Handler::Completion`] (LLM completions in the OpenAI
//! chat-completions and Anthropic messages shapes, as their official SDKs parse them).
//!
//! [`Handler::Stream`]: crate::Handler::Stream
//! [`Handler::Completion`]: crate::Handler::Completion

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, StatusCode};
use serde_json::{json, Value};

use crate::clock::Now;
use crate::compiled::{MAX_INTERVAL_MS, MAX_STREAM_EVENTS};
use crate::config::CompletionApi;
use crate::reply::{invalid_request, json_reply, Action};

/// [`Handler::Stream`](crate::Handler::Stream): `events` tokens (or the query's `n`), spaced
/// `interval_ms` apart (or the query's `interval_ms`), for the attempt at `index`.
pub(crate) fn stream(
    query: &BTreeMap<String, String>,
    body: &Bytes,
    events: u32,
    interval_ms: u64,
    index: usize,
) -> Action {
    let (events, interval_ms) = match stream_pace(query, events, interval_ms) {
        Ok(pace) => pace,
        Err(reason) => return invalid_request(&reason),
    };
    let stream_id = format!("chatcmpl-{}", index + 1);
    if !body.is_empty() {
        match serde_json::from_slice::<Value>(body) {
            Ok(value) if value.get("stream") == Some(&Value::Bool(false)) => {
                return unstreamed(&stream_id, events);
            }
            Ok(_) => {}
            Err(_) => return invalid_request("request body is not valid JSON"),
        }
    }
    let chunks = (0..events)
        .map(|i| {
            let chunk = json!({
                "id": stream_id,
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": token(i)}}],
            });
            sse(None, &chunk)
        })
        .chain([Bytes::from_static(b"data: [DONE]\n\n")])
        .collect();
    event_stream(chunks, interval_ms)
}

/// The number of events and their spacing: the handler's, or the query's `n` and
/// `interval_ms` when given; why not, when the query's are not within bounds.
fn stream_pace(
    query: &BTreeMap<String, String>,
    events: u32,
    interval_ms: u64,
) -> Result<(u32, u64), String> {
    let events = match query.get("n").map(|n| n.parse::<u32>()) {
        None => events,
        Some(Ok(n)) if n <= MAX_STREAM_EVENTS => n,
        Some(_) => {
            return Err(format!(
                "query n must be an integer in 0..={MAX_STREAM_EVENTS}"
            ))
        }
    };
    let interval_ms = match query.get("interval_ms").map(|n| n.parse::<u64>()) {
        None => interval_ms,
        Some(Ok(ms)) if ms <= MAX_INTERVAL_MS => ms,
        Some(_) => {
            return Err(format!(
                "query interval_ms must be an integer in 0..={MAX_INTERVAL_MS}"
            ))
        }
    };
    Ok((events, interval_ms))
}

/// The stream's tokens as one chat completion, for a body that says `"stream": false`.
fn unstreamed(stream_id: &str, events: u32) -> Action {
    let text: String = (0..events).map(token).collect();
    ok_json(&json!({
        "id": stream_id,
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
    }))
}

/// Output token `i` of every fake completion.
fn token(i: u32) -> String {
    format!("token-{i} ")
}

/// One server-sent event: an optional `event:` line and one `data:` line of JSON.
fn sse(event: Option<&str>, data: &Value) -> Bytes {
    Bytes::from(match event {
        Some(name) => format!("event: {name}\ndata: {data}\n\n"),
        None => format!("data: {data}\n\n"),
    })
}

/// A 200 `text/event-stream` of `chunks`, `interval_ms` apart.
fn event_stream(chunks: Vec<Bytes>, interval_ms: u64) -> Action {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Action::Stream {
        headers,
        chunks,
        interval: Duration::from_millis(interval_ms),
    }
}

/// A 200 answer with `body` as JSON.
fn ok_json(body: &Value) -> Action {
    Action::Reply(json_reply(StatusCode::OK, Bytes::from(body.to_string())))
}

fn concat(parts: &[Bytes]) -> Bytes {
    Bytes::from(parts.concat())
}

/// What every form of one fake completion says.
struct Completion<'a> {
    model: &'a str,
    input_tokens: usize,
    events: u32,
    /// The attempt's number, in the completion's id.
    seq: usize,
    /// When it was made, in seconds since the epoch.
    created: i64,
}

impl Completion<'_> {
    /// The whole text: every token.
    fn text(&self) -> String {
        (0..self.events).map(token).collect()
    }
}

/// [`Handler::Completion`](crate::Handler::Completion): one JSON answer, or the stream when the
/// body says `"stream": true`.
pub(crate) fn completion(
    api: CompletionApi,
    body: &Bytes,
    events: u32,
    interval_ms: u64,
    index: usize,
    now: Now,
) -> Action {
    let Ok(Value::Object(request)) = serde_json::from_slice::<Value>(body) else {
        return invalid_request("request body must be a JSON object");
    };
    let streamed = request.get("stream") == Some(&Value::Bool(true));
    let completion = Completion {
        model: request
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or("fake-model"),
        input_tokens: body.len().div_ceil(4),
        events,
        seq: index + 1,
        created: now.wall.as_second(),
    };
    match (api, streamed) {
        (CompletionApi::Openai, false) => openai_message(&completion),
        (CompletionApi::Openai, true) => openai_stream(&completion, interval_ms),
        (CompletionApi::Anthropic, false) => anthropic_message(&completion),
        (CompletionApi::Anthropic, true) => anthropic_stream(&completion, interval_ms),
    }
}

/// An OpenAI chat completion, whole.
fn openai_message(c: &Completion<'_>) -> Action {
    ok_json(&json!({
        "id": format!("chatcmpl-{}", c.seq),
        "object": "chat.completion",
        "created": c.created,
        "model": c.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": c.text()},
            "finish_reason": "stop",
        }],
        "usage": {
            "prompt_tokens": c.input_tokens,
            "completion_tokens": c.events,
            "total_tokens": c.input_tokens + c.events as usize,
        },
    }))
}

/// An OpenAI chat completion as chunks: one per token (the first with the role), then the
/// finish and `[DONE]` together.
fn openai_stream(c: &Completion<'_>, interval_ms: u64) -> Action {
    let id = format!("chatcmpl-{}", c.seq);
    let chunk = |delta: Value, finish: Value| {
        sse(
            None,
            &json!({
                "id": id,
                "object": "chat.completion.chunk",
                "created": c.created,
                "model": c.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }),
        )
    };
    let chunks = (0..c.events)
        .map(|i| {
            let delta = if i == 0 {
                json!({"role": "assistant", "content": token(i)})
            } else {
                json!({"content": token(i)})
            };
            chunk(delta, Value::Null)
        })
        .chain([concat(&[
            chunk(json!({}), json!("stop")),
            Bytes::from_static(b"data: [DONE]\n\n"),
        ])])
        .collect();
    event_stream(chunks, interval_ms)
}

/// An Anthropic message, whole.
fn anthropic_message(c: &Completion<'_>) -> Action {
    ok_json(&json!({
        "id": format!("msg_fake{}", c.seq),
        "type": "message",
        "role": "assistant",
        "model": c.model,
        "content": [{"type": "text", "text": c.text()}],
        "stop_reason": "end_turn",
        "stop_sequence": null,
        "usage": {"input_tokens": c.input_tokens, "output_tokens": c.events},
    }))
}

/// An Anthropic message as events: the opening with the first token, one delta per token,
/// the closing events after the last (with the opening when there is no token).
fn anthropic_stream(c: &Completion<'_>, interval_ms: u64) -> Action {
    let opening = anthropic_opening(c);
    let closing = anthropic_closing(c.events);
    let mut chunks: Vec<Bytes> = (0..c.events)
        .map(|i| {
            sse(
                Some("content_block_delta"),
                &json!({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": token(i)}}),
            )
        })
        .collect();
    match chunks.first_mut() {
        Some(first) => *first = concat(&[opening, first.clone()]),
        None => chunks.push(opening),
    }
    match chunks.len() {
        // No token: the opening and the closing events go together.
        1 if c.events == 0 => chunks[0] = concat(&[chunks[0].clone(), closing]),
        _ => chunks.push(closing),
    }
    event_stream(chunks, interval_ms)
}

/// `message_start` and `content_block_start`.
fn anthropic_opening(c: &Completion<'_>) -> Bytes {
    concat(&[
        sse(
            Some("message_start"),
            &json!({"type": "message_start", "message": {
                "id": format!("msg_fake{}", c.seq),
                "type": "message",
                "role": "assistant",
                "model": c.model,
                "content": [],
                "stop_reason": null,
                "stop_sequence": null,
                "usage": {"input_tokens": c.input_tokens, "output_tokens": 0},
            }}),
        ),
        sse(
            Some("content_block_start"),
            &json!({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}),
        ),
    ])
}

/// `content_block_stop`, `message_delta` (with the `events` output tokens) and `message_stop`.
fn anthropic_closing(events: u32) -> Bytes {
    concat(&[
        sse(
            Some("content_block_stop"),
            &json!({"type": "content_block_stop", "index": 0}),
        ),
        sse(
            Some("message_delta"),
            &json!({"type": "message_delta",
                    "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                    "usage": {"output_tokens": events}}),
        ),
        sse(Some("message_stop"), &json!({"type": "message_stop"})),
    ])
}
