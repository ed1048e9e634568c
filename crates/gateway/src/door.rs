//! The proxy door `/{provider}/{path…}`: an agent's HTTP call becomes one action.
//!
//! Why a door and not a library: agents are written in every language and already speak HTTP
//! through an SDK or curl. Pointing their base URL at backstop is the whole integration; from
//! then on one deterministic layer owns every retry. The door turns a request into an
//! [`ActionSpec`] and hands it to the engine; it makes no retry decision itself.
//!
//! What the door does, in order (each refusal is an RFC 9457 problem, see [`crate::problem`]):
//! 1. Authenticates the agent by its bearer token (401 otherwise; an operator token gets 403).
//! 2. Finds the provider from the first path segment (404 for one the policy does not name).
//! 3. Reads `X-Backstop-Task` (a task id; minted `task-…` if absent), `X-Backstop-Priority`
//!    (`interactive` | `normal` | `background`), `X-Backstop-Deadline` (RFC 3339) and
//!    `Prefer: wait=N` (RFC 7240, delay-seconds); a malformed one is a 400 naming the header.
//! 4. Resolves route template, request class and scopes through [`Policy::route`].
//! 5. Buffers the request body so every attempt resends the same bytes. Up to
//!    [`DoorConfig::max_buffered_body_bytes`] (default 1 MiB) the action may take as many
//!    attempts as its class allows. A larger body is still buffered, up to the hard cap
//!    [`DoorConfig::max_body_bytes`] (default 32 MiB; beyond it, 413), but the action is
//!    marked `single_attempt`: exactly one attempt, and the answer carries
//!    `Backstop-Single-Attempt: body-too-large` (and a warning is logged). Every buffered body,
//!    of either kind, is held under the shared cap [`DoorConfig::body_budget_bytes`] until its
//!    action lets go of it; one that does not fit is `503 body_budget_exhausted`, nothing sent
//!    (see [`crate::body_budget`]). The body is read only after step 1.
//! 6. Prepares the upstream headers: hop-by-hop headers removed (RFC 9110 §7.6.1: `Connection`
//!    and every header it names, `Keep-Alive`, `Proxy-*`, `TE`, `Trailer`, `Transfer-Encoding`,
//!    `Upgrade`), `Host` dropped (the client sets the provider's), the agent's `Authorization`
//!    and every `X-Backstop-*` header removed, the `wait` and `respond-async` preferences
//!    removed from `Prefer`, the provider credential injected under the policy's header and
//!    scheme. For writes the agent's key is read (under the provider's `idempotency_header`, or
//!    `Idempotency-Key` when the provider has none); without one the engine mints the key — in
//!    one place — and sends it on every attempt (SPEC §6). Reads carry no key: an agent's key
//!    header on a read is removed, not forwarded.
//!
//! `Prefer: respond-async` (RFC 7240 §4.1) answers `202 Accepted` with
//! `Location: /v1/actions/{id}` at once and runs the action in the background (see
//! [`crate::actions_api`]) — only when something runs for the request: a same-key resend that
//! runs nothing (a replay) is answered as without the preference. `Prefer: wait=N` caps the total waiting of the action; `wait=0`
//! still sends an attempt that needs no waiting.
//! 7. Answers with the engine's [`Execution`]: the provider's response (hop-by-hop headers
//!    removed, the body streamed through unbuffered — SSE arrives as produced; a non-2xx one
//!    with `x-should-retry: false`, set or overriding the provider's own, since the action ended
//!    with it), or a problem for a gateway-made outcome. Every answer carries
//!    `Backstop-Action-Id`, `Backstop-Attempts` and `Backstop-Task`.
//!
//! Header names are case-insensitive (RFC 9110 §5.1); values of the `X-Backstop-*` headers are
//! read as given, with surrounding whitespace ignored.

use std::time::Duration;

use axum::{
    body::Body,
    http::{header, HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode},
    response::{IntoResponse, Response},
};
use backstop_core::{
    clock::Clock,
    outcome::Outcome,
    pacing::Priority,
    policy::{Policy, Provider},
    reconcile::{mint_idempotency_key, validate_idempotency_key, ReconcileError},
    side_effect::SideEffect,
};
use backstop_store::audit::push_lower_hex;
use bytes::{Bytes, BytesMut};
use jiff::Timestamp;
use sha2::{Digest, Sha256};

pub use crate::body_budget::DoorConfig;

use crate::{
    action::{ActionReceipt, ActionSpec, Execution},
    auth::{AuthError, Role},
    body_budget::{BodyBudget, BodyError},
    engine::Submitted,
    problem::Problem,
    state::AppState,
    transport::AttemptRequest,
    wire::{connection_listed, is_hop_by_hop, strip_hop_by_hop, ProviderResponse, REPLAYED_HEADER},
};

/// The prefix of backstop's own request headers (`X-Backstop-Task`, …), lower case: read by
/// backstop, never forwarded to the provider.
pub const BACKSTOP_HEADER_PREFIX: &str = "x-backstop-";
/// `X-Backstop-Task`: the task (run) id.
pub const TASK_HEADER: &str = "x-backstop-task";
/// `X-Backstop-Priority`: `interactive`, `normal` or `background`.
pub const PRIORITY_HEADER: &str = "x-backstop-priority";
/// `X-Backstop-Deadline`: RFC 3339 instant after which nothing starts.
pub const DEADLINE_HEADER: &str = "x-backstop-deadline";
/// `Backstop-Action-Id` on every answer: the store's action id (0 when refused before being
/// recorded).
pub const ACTION_ID_HEADER: &str = "backstop-action-id";
/// `Backstop-Attempts` on every answer: attempts made for this action, one that could not
/// connect included (a problem body's `sent` says whether any may have reached the provider).
pub const ATTEMPTS_HEADER: &str = "backstop-attempts";
/// `Backstop-Task` on every answer: the task id used (echoed or minted).
pub const TASK_ECHO_HEADER: &str = "backstop-task";
/// `Backstop-Single-Attempt: body-too-large` when the body was too large to allow retries.
pub const SINGLE_ATTEMPT_HEADER: &str = "backstop-single-attempt";
/// `Backstop-Reconciled: true` on backstop's own `200` for a write found at the provider by
/// reconciliation (SPEC §6): the body is backstop's JSON (`outcome`, `provider_operation_id`,
/// …), not the provider's object, whose answer was lost. A provider's answer never carries it.
pub const RECONCILED_HEADER: &str = "backstop-reconciled";

/// `Idempotency-Key` (IETF draft-ietf-httpapi-idempotency-key-header): answered on every
/// response of a write with the key in effect.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// `Prefer` (RFC 7240).
const PREFER: HeaderName = HeaderName::from_static("prefer");

/// The answer headers as names, so setting them parses nothing.
const ACTION_ID: HeaderName = HeaderName::from_static(ACTION_ID_HEADER);
const ATTEMPTS: HeaderName = HeaderName::from_static(ATTEMPTS_HEADER);
const TASK_ECHO: HeaderName = HeaderName::from_static(TASK_ECHO_HEADER);
const SINGLE_ATTEMPT: HeaderName = HeaderName::from_static(SINGLE_ATTEMPT_HEADER);
const IDEMPOTENCY: HeaderName = HeaderName::from_static(IDEMPOTENCY_KEY);
/// `x-should-retry`, the retry hint the OpenAI and Anthropic SDKs obey before their own rules.
const SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");
/// The request headers backstop reads, as names, so looking them up parses nothing.
const TASK: HeaderName = HeaderName::from_static(TASK_HEADER);
const PRIORITY: HeaderName = HeaderName::from_static(PRIORITY_HEADER);
const DEADLINE: HeaderName = HeaderName::from_static(DEADLINE_HEADER);

/// Longest accepted `X-Backstop-Task`, in bytes.
pub const MAX_TASK_ID_BYTES: usize = 200;

/// The request's backstop headers, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackstopHeaders {
    /// `X-Backstop-Task`, if given.
    pub task_id: Option<String>,
    /// `X-Backstop-Priority` (default `normal`).
    pub priority: Priority,
    /// `X-Backstop-Deadline`.
    pub deadline: Option<Timestamp>,
    /// `Prefer: wait=N`.
    pub max_wait: Option<Duration>,
}

/// Parses the `X-Backstop-*` headers and `Prefer: wait=N`.
///
/// # Errors
/// A 400 [`Problem`] naming the first malformed header: a task id that is empty, longer than
/// [`MAX_TASK_ID_BYTES`] or not visible ASCII; a priority other than the three names; a
/// deadline that is not an RFC 3339 instant with an offset; a `wait` that is not
/// delay-seconds (RFC 7240 §4.3); or any of them given twice.
pub fn parse_backstop_headers(headers: &HeaderMap) -> Result<BackstopHeaders, Problem> {
    let task_id = task_header(headers)?;
    let priority = match single(headers, &PRIORITY, "X-Backstop-Priority")? {
        None => Priority::Normal,
        Some(value) => match value.to_ascii_lowercase().as_str() {
            "interactive" => Priority::Interactive,
            "normal" => Priority::Normal,
            "background" => Priority::Background,
            _ => {
                return Err(Problem::bad_header(
                    "X-Backstop-Priority",
                    format!(
                        "`{}` is not one of interactive, normal, background",
                        clip(value)
                    ),
                ))
            }
        },
    };
    let deadline = single(headers, &DEADLINE, "X-Backstop-Deadline")?
        .map(|value| {
            parse_instant(value)
                .map_err(|reason| Problem::bad_header("X-Backstop-Deadline", reason))
        })
        .transpose()?;
    let max_wait = prefer_wait(headers)?;
    Ok(BackstopHeaders {
        task_id,
        priority,
        deadline,
        max_wait,
    })
}

/// `X-Backstop-Task`, if given.
///
/// # Errors
/// A 400 [`Problem`] for a task id that is empty, longer than [`MAX_TASK_ID_BYTES`], not
/// visible ASCII, or given twice.
fn task_header(headers: &HeaderMap) -> Result<Option<String>, Problem> {
    single(headers, &TASK, "X-Backstop-Task")?
        .map(|value| {
            if value.is_empty() || value.len() > MAX_TASK_ID_BYTES {
                return Err(Problem::bad_header(
                    "X-Backstop-Task",
                    format!("a task id must be 1 to {MAX_TASK_ID_BYTES} characters"),
                ));
            }
            if !value.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(Problem::bad_header(
                    "X-Backstop-Task",
                    "a task id must be visible ASCII without spaces",
                ));
            }
            Ok(value.to_owned())
        })
        .transpose()
}

/// The latest instant accepted where one is given (`X-Backstop-Deadline`, the `deadline` of
/// `POST /v1/actions`): `9999-12-30T22:00:00Z`, 253402207200000 ms since the epoch, the latest
/// the store keeps (it keeps milliseconds within jiff's range, which ends at
/// `9999-12-30T22:00:00.999999999Z`). A later one would be accepted here and then fail in the
/// store, so it is refused at once.
pub const LATEST_INSTANT: &str = "9999-12-30T22:00:00Z";

/// [`LATEST_INSTANT`] in milliseconds since the Unix epoch.
const LATEST_INSTANT_MS: i64 = 253_402_207_200_000;

/// Reads an RFC 3339 instant (`2026-01-01T12:00:00Z`, `…+01:00`). Fractional seconds beyond
/// nanoseconds (more than 9 digits) are truncated to nanoseconds, the precision backstop keeps.
/// Instants are accepted from `-009999-01-02T01:59:59Z` (jiff's range) to [`LATEST_INSTANT`]
/// (the store's); a later one, such as `9999-12-30T22:00:00.001Z` or `9999-12-31T23:59:59Z`,
/// is refused saying so.
///
/// # Errors
/// A sentence quoting the value (clipped to 64 characters) and the reason.
pub fn parse_instant(text: &str) -> Result<Timestamp, String> {
    let text = text.trim();
    let truncated = truncate_fraction(text);
    let at = truncated.parse::<Timestamp>().map_err(|e| {
        format!(
            "`{}` is not an RFC 3339 instant like 2026-01-01T12:00:00Z that backstop can represent (up to {LATEST_INSTANT}): {e}",
            clip(text)
        )
    })?;
    check_offset(text)?;
    let latest = Timestamp::from_millisecond(LATEST_INSTANT_MS).unwrap_or(Timestamp::MAX);
    if at > latest {
        return Err(format!(
            "`{}` is later than {LATEST_INSTANT}, the latest instant backstop accepts",
            clip(text)
        ));
    }
    Ok(at)
}

/// Checks the offset of an instant jiff has read: RFC 3339 §5.6 allows `Z` (any case) or
/// `±HH:MM` with hours 00–23 and minutes 00–59. jiff reads wider offsets (up to `±25:59:59`,
/// with seconds or without the colon), which RFC 3339 does not allow.
///
/// # Errors
/// A sentence quoting the value (clipped) and saying what an offset may be.
fn check_offset(text: &str) -> Result<(), String> {
    if text.ends_with(['Z', 'z']) {
        return Ok(());
    }
    let reason = |why: &str| {
        format!(
            "`{}` {why}; an RFC 3339 offset is `Z` or `+HH:MM`/`-HH:MM` with hours 00–23 and minutes 00–59",
            clip(text)
        )
    };
    let offset = text
        .len()
        .checked_sub(6)
        .and_then(|start| text.get(start..))
        .map(str::as_bytes);
    match offset {
        Some([b'+' | b'-', h1, h2, b':', m1, m2])
            if [h1, h2, m1, m2].iter().all(|b| b.is_ascii_digit()) =>
        {
            let hours = (h1 - b'0') * 10 + (h2 - b'0');
            let minutes = (m1 - b'0') * 10 + (m2 - b'0');
            if hours > 23 {
                Err(reason(&format!("has an offset of {hours} hours")))
            } else if minutes > 59 {
                Err(reason(&format!("has an offset with {minutes} minutes")))
            } else {
                Ok(())
            }
        }
        _ => Err(reason("does not end in an RFC 3339 offset")),
    }
}

/// `…:SS.ffffffffffff…` with the fraction cut to 9 digits; other text unchanged.
fn truncate_fraction(text: &str) -> std::borrow::Cow<'_, str> {
    let Some(dot) = text.find('.') else {
        return text.into();
    };
    let digits = text[dot + 1..]
        .bytes()
        .take_while(u8::is_ascii_digit)
        .count();
    if digits <= 9 {
        return text.into();
    }
    format!("{}{}", &text[..dot + 10], &text[dot + 1 + digits..]).into()
}

/// One header value as trimmed text; two instances or non-text bytes are errors.
fn single<'a>(
    headers: &'a HeaderMap,
    name: &HeaderName,
    display: &str,
) -> Result<Option<&'a str>, Problem> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(Problem::bad_header(display, "given more than once"));
    }
    let text = value
        .to_str()
        .map_err(|_| Problem::bad_header(display, "the value is not visible ASCII text"))?;
    Ok(Some(text.trim()))
}

fn clip(value: &str) -> String {
    value.chars().take(64).collect()
}

/// The largest `Prefer: wait=N` read, in seconds (`u64::MAX`). Any wait longer than a route's
/// class budget (`max_wait_seconds`) behaves as that budget; a larger number is refused as too
/// large, naming this maximum.
pub const MAX_PREFER_WAIT_SECONDS: u64 = u64::MAX;

/// The `wait` preference of all `Prefer` headers (RFC 7240 §2: comma-separated preferences,
/// `token [= value]` with optional `;` parameters; names are case-insensitive).
fn prefer_wait(headers: &HeaderMap) -> Result<Option<Duration>, Problem> {
    let mut wait = None;
    for value in headers.get_all(PREFER) {
        let text = value
            .to_str()
            .map_err(|_| Problem::bad_header("Prefer", "the value is not visible ASCII text"))?;
        for preference in text.split(',') {
            let head = preference.split(';').next().unwrap_or("").trim();
            let (name, value) = match head.split_once('=') {
                Some((n, v)) => (n.trim(), Some(v.trim().trim_matches('"'))),
                None => (head, None),
            };
            if !name.eq_ignore_ascii_case("wait") {
                continue;
            }
            let seconds = match value {
                Some(v) if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) => {
                    v.parse::<u64>().map_err(|_| {
                        Problem::bad_header(
                            "Prefer",
                            format!(
                                "`wait={}` is too large: at most {MAX_PREFER_WAIT_SECONDS} seconds (a wait beyond the route's own wait budget changes nothing)",
                                clip(v)
                            ),
                        )
                    })?
                }
                _ => {
                    return Err(Problem::bad_header(
                        "Prefer",
                        "`wait` must be a whole number of seconds, like `wait=30` (RFC 7240 §4.3)",
                    ))
                }
            };
            if wait.is_some() {
                return Err(Problem::bad_header("Prefer", "`wait` given more than once"));
            }
            wait = Some(Duration::from_secs(seconds));
        }
    }
    Ok(wait)
}

/// Whether any `Prefer` header asks for `respond-async` (RFC 7240 §4.1).
pub fn prefers_respond_async(headers: &HeaderMap) -> bool {
    headers
        .get_all(PREFER)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| {
            p.split([';', '='])
                .next()
                .unwrap_or("")
                .trim()
                .eq_ignore_ascii_case("respond-async")
        })
}

/// The `Prefer` header without the `wait` and `respond-async` preferences (which is backstop's), or `None` when
/// nothing is left to forward.
fn forwarded_prefer(headers: &HeaderMap) -> Option<HeaderValue> {
    let kept: Vec<&str> = headers
        .get_all(PREFER)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .filter(|p| {
            let name = p.split([';', '=']).next().unwrap_or("").trim();
            !name.eq_ignore_ascii_case("wait") && !name.eq_ignore_ascii_case("respond-async")
        })
        .collect();
    if kept.is_empty() {
        None
    } else {
        HeaderValue::from_str(&kept.join(", ")).ok()
    }
}

/// A task id for a request that names none (`task-` and 32 lower-case hex digits): a UUID
/// version 7 (RFC 9562 §5.7), whose first 48 bits are the Unix time in milliseconds and whose
/// remaining 74 variable bits are random (the `uuid` crate keeps the ids of one process in
/// ascending order within a millisecond). Time-ordered ids put each new task's row at the end
/// of the store's task index, where random ids would dirty a different page of it for every
/// request sent without `X-Backstop-Task`.
pub fn mint_id(prefix: &str) -> String {
    let uuid = uuid::Uuid::now_v7();
    let mut id = String::with_capacity(prefix.len() + 32);
    id.push_str(prefix);
    push_lower_hex(&mut id, uuid.as_bytes());
    id
}

/// The SHA-256 of an empty payload, as lower-case hex: the digest of every bodiless request.
const EMPTY_SHA256_HEX: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// The SHA-256 of `bytes` as 64 lower-case hex digits (the payload and target digests).
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    if bytes.is_empty() {
        return EMPTY_SHA256_HEX.to_owned();
    }
    let mut hex = String::with_capacity(64);
    push_lower_hex(&mut hex, &Sha256::digest(bytes));
    hex
}

/// Normalizes a request path (no query) as RFC 3986 §6.2.2 says, so that spellings of one
/// resource match one route (and its scopes and pacing): percent-encoded unreserved
/// characters (`A-Z a-z 0-9 - . _ ~`) are decoded (`%6C` → `l`), other percent-encodings get
/// upper-case hex digits (`%2f` → `%2F`), bytes outside ASCII sent as is are percent-encoded
/// (`é` → `%C3%A9`, RFC 3987 §3.1), and the dot segments `.` and `..` are removed
/// (§5.2.4, after decoding, so `%2E%2E` is one too). Empty segments (`//`) and a trailing `/`
/// are kept as written. The result is what is matched and forwarded.
///
/// # Errors
/// A 400 `bad_request` [`Problem`]: a `%` not followed by two hex digits, or a `..` that would
/// climb above the root (`/v1/../../x`) — such a path names nothing below the gateway.
pub fn normalize_path(path: &str) -> Result<String, Problem> {
    // Already normal (the usual path): no percent-encoding and no dot segment to remove.
    if path.is_ascii() && !path.contains('%') && !path.split('/').any(|s| s == "." || s == "..") {
        return Ok(if path.starts_with('/') {
            path.to_owned()
        } else {
            let mut normal = String::with_capacity(path.len() + 1);
            normal.push('/');
            normal.push_str(path);
            normal
        });
    }
    let mut segments: Vec<String> = Vec::new();
    let raw: Vec<&str> = path.strip_prefix('/').unwrap_or(path).split('/').collect();
    let last = raw.len().saturating_sub(1);
    for (i, segment) in raw.iter().enumerate() {
        let segment = percent_normalize(segment).ok_or_else(|| {
            Problem::bad_request(format!(
                "path `{}`: a `%` must be followed by two hex digits (RFC 3986 §2.1)",
                clip(path)
            ))
        })?;
        match segment.as_str() {
            "." | ".." => {
                if segment == ".." && segments.pop().is_none() {
                    return Err(Problem::bad_request(format!(
                        "path `{}`: `..` climbs above the root; nothing was sent",
                        clip(path)
                    )));
                }
                // `/a/.` and `/a/b/..` end in a directory: keep the trailing slash.
                if i == last {
                    segments.push(String::new());
                }
            }
            _ => segments.push(segment),
        }
    }
    Ok(format!("/{}", segments.join("/")))
}

/// One segment with unreserved percent-encodings decoded, the others upper-cased, and bytes
/// outside ASCII (a client that sent `é` as is) percent-encoded as a URL carries them (RFC 3987
/// §3.1: `%C3%A9`); `None` for a malformed `%`.
fn percent_normalize(segment: &str) -> Option<String> {
    if segment.is_ascii() && !segment.contains('%') {
        return Some(segment.to_owned());
    }
    let bytes = segment.as_bytes();
    let mut out = String::with_capacity(segment.len());
    let mut i = 0;
    while i < bytes.len() {
        if !bytes[i].is_ascii() {
            out.push_str(&format!("%{:02X}", bytes[i]));
            i += 1;
            continue;
        }
        if bytes[i] != b'%' {
            out.push(char::from(bytes[i]));
            i += 1;
            continue;
        }
        let hex = segment.get(i + 1..i + 3)?;
        let byte = u8::from_str_radix(hex, 16).ok()?;
        if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
        i += 3;
    }
    Some(out)
}

/// Splits `/provider/rest?query` into the provider name and `/rest?query`.
fn split_provider(path_and_query: &str) -> Option<(&str, String)> {
    let trimmed = path_and_query.strip_prefix('/')?;
    let (provider, rest) = match trimmed.find(['/', '?']) {
        Some(i) => (&trimmed[..i], &trimmed[i..]),
        None => (trimmed, ""),
    };
    if provider.is_empty() {
        return None;
    }
    let rest = if rest.starts_with('/') {
        rest.to_owned()
    } else {
        format!("/{rest}")
    };
    Some((provider, rest))
}

/// [`split_provider`] of a normalized path (no query) and its query: the provider name and
/// `/rest?query`, built in one allocation.
fn split_provider_query<'a>(path: &'a str, query: Option<&str>) -> Option<(&'a str, String)> {
    let trimmed = path.strip_prefix('/')?;
    let (provider, rest) = trimmed.split_at(trimmed.find('/').unwrap_or(trimmed.len()));
    if provider.is_empty() {
        return None;
    }
    let rest = if rest.is_empty() { "/" } else { rest };
    let mut out = String::with_capacity(rest.len() + query.map_or(0, |q| q.len() + 1));
    out.push_str(rest);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    Some((provider, out))
}

/// Reads the whole body, at most [`DoorConfig::max_body_bytes`], under the shared `budget` of
/// buffered bodies (a `declared` `Content-Length` is taken from it before anything is read);
/// `true` when it is larger than the retry buffer. The bytes hold their part of the budget
/// until the action lets go of its last copy.
///
/// # Errors
/// A [`Problem`] from [`body_problem`]: 413 past the hard cap, 503 `body_budget_exhausted`
/// when the budget has no room, 400 for a body that could not be read.
async fn read_body(
    budget: &BodyBudget,
    body: Body,
    declared: Option<u64>,
    config: DoorConfig,
) -> Result<(Bytes, bool), Problem> {
    let held = budget
        .read(body, declared, config.max_body_bytes)
        .await
        .map_err(|error| body_problem(error, || body_too_large(config)))?;
    let large = held.len() > config.max_buffered_body_bytes;
    Ok((held.into_bytes(), large))
}

/// The request's `Content-Length`, when it has a valid one.
pub(crate) fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
}

/// The problem for a body not read whole: `too_large` for one past the request's own limit,
/// 413 for one larger than the whole budget, `503 body_budget_exhausted` (`Retry-After: 1`,
/// `x-should-retry: true`) for one the budget has no room for now, 400 for one that could not
/// be read.
pub(crate) fn body_problem(error: BodyError, too_large: impl FnOnce() -> Problem) -> Problem {
    match error {
        BodyError::TooLarge { .. } => too_large(),
        BodyError::LargerThanBudget { total } => Problem::larger_than_body_budget(total),
        BodyError::Exhausted {
            wanted,
            held,
            total,
        } => Problem::body_budget_exhausted(wanted, held, total),
        BodyError::Unreadable(e) => {
            Problem::bad_request(format!("the request body could not be read: {e}"))
        }
    }
}

pub(crate) fn body_too_large(config: DoorConfig) -> Problem {
    let mut problem = Problem::bad_request(format!(
        "the request body is larger than backstop's hard cap of {} bytes; nothing was sent",
        config.max_body_bytes
    ));
    problem.status = StatusCode::PAYLOAD_TOO_LARGE;
    problem.name = "body_too_large".into();
    problem.title = "Request body too large".into();
    problem
}

/// Whether requests of this method are safe (RFC 9110 §9.2.1): no idempotency key is set.
pub(crate) fn is_safe(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

/// Builds the upstream headers from the agent's (see the module docs). Returns them and the
/// idempotency key used, if any. A request of a `side_effect: none` class (an LLM completion)
/// has no key of backstop's: an idempotency header the agent sent is forwarded as it is.
fn upstream_headers(
    incoming: &HeaderMap,
    method: &Method,
    side_effect: SideEffect,
    provider: &Provider,
    credential: Option<&crate::secrets::CredentialHeader>,
) -> Result<(HeaderMap, Option<String>), Problem> {
    // One pass over the agent's headers keeps what goes upstream: not the hop-by-hop ones,
    // `Host` (the client sets the provider's), the agent's credentials, the framing the client
    // redoes, backstop's own headers, or `Prefer` (forwarded below without backstop's
    // preferences).
    let listed = connection_listed(incoming);
    let forwarded = |name: &HeaderName| {
        !(is_hop_by_hop(name)
            || *name == header::HOST
            || *name == header::AUTHORIZATION
            || *name == header::CONTENT_LENGTH
            || *name == header::EXPECT
            || *name == PREFER
            || name.as_str().starts_with(BACKSTOP_HEADER_PREFIX)
            || listed.contains(name))
    };
    let mut headers = owned_values(incoming, forwarded);
    if let Some(prefer) = forwarded_prefer(incoming) {
        headers.insert(PREFER, prefer);
    }
    if let Some(credential) = credential {
        headers.insert(credential.name.clone(), credential.value.clone());
    }
    let mut key = None;
    if is_safe(method) {
        // Reads carry no idempotency key: the agent's is not forwarded either.
        if let Ok(name) = HeaderName::from_bytes(key_header(Some(provider)).as_bytes()) {
            headers.remove(name);
        }
    } else if side_effect == SideEffect::None {
        // Nothing to deduplicate for backstop: the provider may still use the agent's key.
    } else {
        // A missing key is minted by the engine (one place), never here.
        let name = key_header(Some(provider));
        let header_name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
            Problem::bad_request(format!(
                "the provider's idempotency header `{name}` is not a valid header name"
            ))
        })?;
        // Checked here, before any action exists, so a bad key is the agent's malformed
        // header (400 `bad_header`), never a recorded action refused later.
        if let Some(value) = single(incoming, &header_name, name)? {
            key = Some(checked_idempotency_key(name, value)?.to_owned());
        }
        if provider.idempotency_header.is_none() {
            // Not the provider's header: keep it to ourselves.
            headers.remove(header_name);
        }
    }
    Ok((headers, key))
}

/// The header an agent's idempotency key arrives under: the provider's idempotency header, or
/// the IETF draft's `Idempotency-Key` when the provider has none (backstop's own idempotency)
/// or is not known.
pub(crate) fn key_header(provider: Option<&Provider>) -> &str {
    provider
        .and_then(|p| p.idempotency_header.as_deref())
        .unwrap_or("Idempotency-Key")
}

/// The headers of `incoming` that `forwarded` keeps, in order, their values copied into one
/// buffer of their own.
///
/// hyper hands out header values as slices of the connection's read buffer (8 KB and more),
/// and a slice keeps the whole buffer alive. An action holds its upstream headers for as long
/// as it waits — an hour, for a delayed one — so values borrowed from that buffer would pin
/// 8 KB per waiting action (measured in BENCHMARKS.md, "The action's future, and memory per
/// delayed action in the whole process"). One allocation of the values' own length holds them
/// instead.
fn owned_values(incoming: &HeaderMap, forwarded: impl Fn(&HeaderName) -> bool) -> HeaderMap {
    let (mut count, mut length) = (0, 0);
    for (name, value) in incoming {
        if forwarded(name) {
            count += 1;
            length += value.len();
        }
    }
    let mut buffer = BytesMut::with_capacity(length);
    for (name, value) in incoming {
        if forwarded(name) {
            buffer.extend_from_slice(value.as_bytes());
        }
    }
    let buffer = buffer.freeze();
    // Room for the `Prefer` and the credential added next.
    let mut headers = HeaderMap::with_capacity(count + 2);
    let mut start = 0;
    for (name, value) in incoming {
        if !forwarded(name) {
            continue;
        }
        let end = start + value.len();
        // The bytes are a valid value's, so this cannot fail; the borrowed value is kept if it
        // ever did.
        let mut copy = HeaderValue::from_maybe_shared(buffer.slice(start..end))
            .unwrap_or_else(|_| value.clone());
        copy.set_sensitive(value.is_sensitive());
        headers.append(name.clone(), copy);
        start = end;
    }
    headers
}

/// An agent's idempotency key given under the header `header`, checked by
/// [`validate_idempotency_key`] (IETF Idempotency-Key draft: 1 to
/// [`MAX_IDEMPOTENCY_KEY_LEN`](backstop_core::reconcile::MAX_IDEMPOTENCY_KEY_LEN) bytes of
/// printable ASCII; one pair of surrounding double quotes removed). Returns the key as it will be
/// stored and sent.
///
/// # Errors
/// 400 `bad_header` naming `header` and the rule the key breaks (the key itself is not echoed).
pub fn checked_idempotency_key<'a>(header: &str, value: &'a str) -> Result<&'a str, Problem> {
    validate_idempotency_key(value).map_err(|e| match e {
        ReconcileError::InvalidIdempotencyKey { reason } => {
            Problem::bad_header(header, format!("not a usable idempotency key: {reason}"))
        }
        other => Problem::bad_header(header, other),
    })
}

/// The receipt headers; `Backstop-Task` names the receipt's task when it has one (an action
/// recorded before, possibly in another task), else `task_id`, the request's.
fn receipt_headers(response: &mut Response, receipt: &ActionReceipt, task_id: &str, single: bool) {
    let task_id = receipt.task.as_deref().unwrap_or(task_id);
    let headers = response.headers_mut();
    headers.insert(ACTION_ID, HeaderValue::from(receipt.action_id));
    headers.insert(ATTEMPTS, HeaderValue::from(receipt.attempts));
    if let Some(key) = receipt
        .idempotency_key
        .as_deref()
        .and_then(|k| HeaderValue::from_str(k).ok())
    {
        headers.insert(IDEMPOTENCY, key);
    }
    // An empty task id is none: a drain answer whose task header was malformed.
    if let Some(task) = HeaderValue::from_str(task_id)
        .ok()
        .filter(|_| !task_id.is_empty())
    {
        headers.insert(TASK_ECHO, task);
    }
    if single {
        headers.insert(SINGLE_ATTEMPT, HeaderValue::from_static("body-too-large"));
    }
}

/// A door refusal before any action exists: the problem with `Backstop-Action-Id: 0` and
/// `Backstop-Attempts: 0`.
pub fn refusal(problem: Problem) -> Response {
    let mut response = problem.into_response();
    let headers = response.headers_mut();
    headers.insert(ACTION_ID, HeaderValue::from(0u32));
    headers.insert(ATTEMPTS, HeaderValue::from(0u32));
    response
}

/// The `503 shutting_down` of a proxy-door request that arrives while the gateway drains,
/// answered before authentication and before the engine sees it: nothing was recorded or sent
/// (`sent: false`, `Retry-After: 1`, `x-should-retry: true`). Like the engine's answer to a
/// request that reaches it after it stopped, it names what identifies the request: the task —
/// `Backstop-Task` and `task`, the `X-Backstop-Task` given or one minted as the door mints one —
/// and for a write its key — `Idempotency-Key` and `idempotency_key`, the agent's key (under the
/// provider's idempotency header) or one minted to send the request again with. No action
/// exists: `Backstop-Action-Id: 0`, `Backstop-Attempts: 0` and no `action_id` member, as for the
/// door's other refusals. A task or key header the door would refuse as malformed is not
/// echoed, and nothing is minted in its place.
pub fn draining(policy: &Policy, method: &Method, path: &str, headers: &HeaderMap) -> Response {
    let task = match task_header(headers) {
        Ok(Some(task)) => Some(task),
        Ok(None) => Some(mint_id("task-")),
        Err(_) => None,
    };
    let provider_path = split_provider(path);
    // A call of a `side_effect: none` class (an LLM completion) has no key of backstop's.
    let side_effect_free = provider_path.as_ref().is_some_and(|(name, rest)| {
        policy
            .route(name, method.as_str(), rest)
            .is_ok_and(|route| route.side_effect == SideEffect::None)
    });
    let key = if is_safe(method) || side_effect_free {
        None
    } else {
        let provider = provider_path.and_then(|(name, _)| policy.providers.get(name));
        let name = key_header(provider);
        match HeaderName::from_bytes(name.as_bytes()) {
            Ok(header_name) => match single(headers, &header_name, name) {
                Ok(Some(value)) => checked_idempotency_key(name, value).ok().map(str::to_owned),
                Ok(None) => Some(mint_key()),
                Err(_) => None,
            },
            Err(_) => None,
        }
    };
    draining_answer(task, key)
}

/// The drain's `503 shutting_down` naming `task` (`Backstop-Task` and `task`) and `key`
/// (`Idempotency-Key` and `idempotency_key`) when given, with `Backstop-Action-Id: 0`,
/// `Backstop-Attempts: 0` and no `action_id`: no action exists. Shared by the proxy door
/// ([`draining`]) and the action API ([`crate::actions_api::draining`]).
pub fn draining_answer(task: Option<String>, key: Option<String>) -> Response {
    let mut problem = Problem::shutting_down();
    if let Some(task) = &task {
        problem = problem.with_extension("task", task.as_str().into());
    }
    if let Some(key) = &key {
        problem = problem.with_extension("idempotency_key", key.as_str().into());
    }
    let mut response = problem.into_response();
    let receipt = ActionReceipt {
        action_id: 0,
        attempts: 0,
        idempotency_key: key,
        provider_operation_id: None,
        task: None,
    };
    receipt_headers(
        &mut response,
        &receipt,
        task.as_deref().unwrap_or(""),
        false,
    );
    response
}

/// A key minted for a write answered before anything was recorded, to send it again with.
pub fn mint_key() -> String {
    mint_idempotency_key(*uuid::Uuid::now_v7().as_bytes())
}

/// The proxy door handler: the fallback of the router in [`crate::server`], which each
/// connection also calls directly, under the same edge layer, for a path whose first segment
/// names a provider.
///
/// The door's own time (request in → hand-over to the engine, and the engine's answer →
/// response head out) is observed as `backstop_gateway_overhead_seconds` for every call that
/// reaches the engine synchronously; refusals and `respond-async` submissions are not.
pub async fn proxy(state: std::sync::Arc<AppState>, request: Request<Body>) -> Response {
    let arrived = tokio::time::Instant::now();
    if !state.accepting() {
        let (method, path) = (request.method(), request.uri().path());
        return draining(&state.policy, method, path, request.headers());
    }
    let respond_async = prefers_respond_async(request.headers());
    match prepare(&state, request).await {
        Err(problem) => refusal(problem),
        Ok(spec) if respond_async => submit_async(&state, spec).await,
        Ok(spec) => {
            let before_engine = arrived.elapsed();
            execute(&state, spec, before_engine).await
        }
    }
}

/// Authenticates the caller and turns its request into an [`ActionSpec`]; every refusal is
/// logged at INFO ([`Problem::log_refusal`]), with the agent once it is known.
async fn prepare(state: &AppState, request: Request<Body>) -> Result<ActionSpec, Problem> {
    let refused = |agent: Option<&str>, problem: Problem| {
        problem.log_refusal("door", agent, &state.metrics);
        problem
    };
    let caller = state
        .auth
        .authenticate(request.headers())
        .map_err(|e| refused(None, Problem::from(e)))?;
    if caller.role != Role::Agent {
        return Err(refused(
            None,
            Problem::forbidden(format!(
                "`{}` is an operator; the proxy door takes agent tokens only",
                caller.name
            )),
        ));
    }
    let agent = caller.name;
    prepare_as(state, &agent, request)
        .await
        .map_err(|problem| refused(Some(&agent), problem))
}

/// [`prepare`] for the authenticated `agent`.
async fn prepare_as(
    state: &AppState,
    agent: &str,
    request: Request<Body>,
) -> Result<ActionSpec, Problem> {
    let (parts, body) = request.into_parts();
    let declared = declared_length(&parts.headers);
    if declared.is_some_and(|length| length > state.door.max_body_bytes as u64) {
        return Err(body_too_large(state.door));
    }
    let path_and_query = parts
        .uri
        .path_and_query()
        .map(|pq| pq.as_str())
        .unwrap_or("/");
    let backstop = parse_backstop_headers(&parts.headers)?;
    let (body, single_attempt) = read_body(&state.body_budget, body, declared, state.door).await?;
    build_spec(
        state,
        agent.to_owned(),
        parts.method,
        path_and_query,
        &parts.headers,
        body,
        single_attempt,
        backstop,
    )
}

/// Turns one call into an [`ActionSpec`] (shared by the proxy door and `POST /v1/actions`):
/// `path_and_query` is `/{provider}/{rest}`; `headers` are the agent's (backstop's own and
/// hop-by-hop headers are removed, the provider credential injected); `body` is the whole
/// payload, `single_attempt` when it exceeded the retry buffer.
///
/// # Errors
/// A [`Problem`]: 404 for an unknown provider or a path without one, 424 when the provider's
/// credential is unavailable, 400 `bad_header` for an idempotency key header that is given twice
/// or breaks [`checked_idempotency_key`]'s rules.
#[allow(clippy::too_many_arguments)]
pub(crate) fn build_spec(
    state: &AppState,
    agent: String,
    method: Method,
    path_and_query: &str,
    incoming: &HeaderMap,
    body: Bytes,
    single_attempt: bool,
    backstop: BackstopHeaders,
) -> Result<ActionSpec, Problem> {
    let (path, query) = match path_and_query.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (path_and_query, None),
    };
    let normalized = normalize_path(path)?;
    let Target {
        provider_name,
        provider,
        route,
        rest,
    } = resolve_target(state, &method, &normalized, query)?;
    let (headers, idempotency_key) = upstream_headers(
        incoming,
        &method,
        route.side_effect,
        provider,
        state.credentials.get(provider_name),
    )?;
    let task_given = backstop.task_id.is_some();
    let task_id = backstop.task_id.unwrap_or_else(|| mint_id("task-"));
    if single_attempt {
        tracing::warn!(
            provider = provider_name,
            route = %route.template,
            task = %task_id,
            body_bytes = body.len(),
            limit_bytes = state.door.max_buffered_body_bytes,
            "door: body larger than the retry buffer; exactly one attempt"
        );
    }
    let payload_digest = sha256_hex(&body);
    // The concrete target as sent (normalized path and query): the agent's key binds it (SPEC
    // §6). Only an agent-supplied key can be reused, so only then is it computed and stored.
    let target_digest = idempotency_key
        .as_ref()
        .map(|_| sha256_hex(rest.as_bytes()));
    let mut url = String::with_capacity(provider.base_url.len() + rest.len());
    url.push_str(&provider.base_url);
    url.push_str(&rest);
    // Only a write that would be kept at rest is looked through (reads never are kept).
    let kept = route.side_effect == SideEffect::Write && !is_safe(&method) && !single_attempt;
    let holds_secret = kept && holds_secret(state, provider_name, &url, &headers);
    Ok(ActionSpec {
        task_id,
        task_given,
        agent,
        priority: backstop.priority,
        deadline: backstop.deadline,
        max_wait: backstop.max_wait,
        route,
        request: AttemptRequest {
            method,
            url,
            headers,
            body,
        },
        single_attempt,
        idempotency_key,
        payload_digest,
        target_digest,
        desired_outcome: None,
        resumed: false,
        holds_secret,
    })
}

/// Where a call goes: its provider, the route it matched and the path and query sent.
struct Target<'a> {
    provider_name: &'a str,
    provider: &'a Provider,
    route: backstop_core::policy::RouteMatch,
    /// The path below the provider's root, with the query.
    rest: String,
}

/// Resolves the `normalized` path (`/{provider}/{rest}`) and `query` of a call to its target.
///
/// # Errors
/// 404 for a path without a usable provider name, 404 `unknown_provider` for a provider the
/// policy does not have, 424 when its credential is unavailable, and the refusal of a `%2F`
/// that would change the route ([`encoded_slash_keeps_the_route`]).
fn resolve_target<'a>(
    state: &'a AppState,
    method: &Method,
    normalized: &'a str,
    query: Option<&str>,
) -> Result<Target<'a>, Problem> {
    let (provider_name, rest) =
        split_provider_query(normalized, query).ok_or_else(|| Problem::not_found(normalized))?;
    let policy: &Policy = &state.policy;
    if backstop_core::policy::check_provider_name(provider_name).is_err() {
        return Err(Problem::not_found(normalized));
    }
    let provider = policy
        .providers
        .get(provider_name)
        .ok_or_else(|| Problem::unknown_provider(provider_name))?;
    if state.credentials.unavailable().contains_key(provider_name) {
        return Err(Problem::credential_unavailable(provider_name));
    }
    let route = policy
        .route(provider_name, method.as_str(), &rest)
        .map_err(|_| Problem::unknown_provider(provider_name))?;
    if normalized.contains("%2F") {
        encoded_slash_keeps_the_route(policy, method.as_str(), normalized, &route)?;
    }
    Ok(Target {
        provider_name,
        provider,
        route,
        rest,
    })
}

/// Whether the `url` or a header sent to `provider_name` (other than its injected credential)
/// holds a known secret.
fn holds_secret(state: &AppState, provider_name: &str, url: &str, headers: &HeaderMap) -> bool {
    let credential = state.credentials.get(provider_name).map(|c| &c.name);
    state.secrets.holds(url)
        || headers.iter().any(|(name, value)| {
            Some(name) != credential && value.to_str().is_ok_and(|v| state.secrets.holds(v))
        })
}

/// An encoded slash (`%2F`) is data inside one segment and is forwarded as written, but only
/// when reading it as a `/` would not reach another provider or route: some servers decode it
/// before routing, and the route decides scopes and pacing.
///
/// # Errors
/// A 400 `bad_request` naming the path when the decoded reading matches another provider,
/// route, class or scopes (or climbs above the root).
fn encoded_slash_keeps_the_route(
    policy: &Policy,
    method: &str,
    normalized: &str,
    route: &backstop_core::policy::RouteMatch,
) -> Result<(), Problem> {
    // What a reading reaches, named for the refusal: a configured route, or none.
    let reach = |r: &backstop_core::policy::RouteMatch| {
        if r.configured {
            format!(
                "route `{} {}` of provider `{}`",
                method, r.template, r.provider
            )
        } else {
            format!("no configured route of provider `{}`", r.provider)
        }
    };
    let refused = |decoded_reaches: &str| {
        Problem::bad_request(format!(
            "path `{}`: an encoded `/` (%2F) here is ambiguous: as written it reaches {}, decoded it would reach {decoded_reaches}; send the path with plain `/` or without %2F",
            clip(normalized),
            reach(route),
        ))
    };
    let decoded = normalize_path(&normalized.replace("%2F", "/"))
        .map_err(|_| refused("a path above the root"))?;
    let Some((provider, rest)) = split_provider(&decoded) else {
        return Err(refused("no provider"));
    };
    let Ok(other) = policy.route(provider, method, &rest) else {
        return Err(refused(&format!(
            "`{provider}`, which is not a provider here"
        )));
    };
    let key = |r: &backstop_core::policy::RouteMatch| {
        (
            r.provider.clone(),
            r.configured,
            if r.configured {
                r.template.clone()
            } else {
                String::new()
            },
            r.class.clone(),
            r.scopes.clone(),
        )
    };
    if key(&other) == key(route) {
        Ok(())
    } else {
        Err(refused(&reach(&other)))
    }
}

/// `Prefer: respond-async`: starts the action in the background and answers `202 Accepted`
/// with `Location: /v1/actions/{id}` and `Preference-Applied: respond-async` (RFC 7240 §3), the
/// JSON body `{id, task, state, location}` and the receipt headers. `state` is `accepted` when
/// this request runs the action — a new one, or one recorded before under its key that it takes
/// over (a write reopened, or recorded and never sent), whose earlier attempts
/// `Backstop-Attempts` counts — and `joined` when it joined the action already running under
/// its key (nothing new runs; that action's outcome is its outcome). `task` is the action's own
/// task. A request that runs nothing is answered as without the preference: a refusal before
/// the action was recorded, and every other answer about the action found under its key — a
/// finished action's outcome replayed (a `429` with the `Retry-After` left before the instant
/// its answer named), a write the SPEC §6 rule settled or escalated, `409` for an action
/// unfinished but not running.
pub(crate) async fn submit_async(state: &AppState, spec: ActionSpec) -> Response {
    let Some(engine) = state.executor.engine() else {
        let problem = Problem::not_supported("`Prefer: respond-async`");
        problem.log_refusal("door", Some(&spec.agent), &state.metrics);
        return refusal(problem);
    };
    let task_id = spec.task_id.clone();
    let single = spec.single_attempt;
    let agent = spec.agent.clone();
    match engine.submit(spec).await {
        Ok(Submitted { receipt, joined }) => {
            let id = receipt.action_id;
            let location = format!("/v1/actions/{id}");
            let body = serde_json::json!({
                "id": id,
                "task": receipt.task.as_deref().unwrap_or(&task_id),
                "state": if joined { "joined" } else { "accepted" },
                "location": location,
            });
            let mut response = (StatusCode::ACCEPTED, axum::Json(body)).into_response();
            let headers = response.headers_mut();
            if let Ok(value) = HeaderValue::from_str(&location) {
                headers.insert(header::LOCATION, value);
            }
            headers.insert(
                "preference-applied",
                HeaderValue::from_static("respond-async"),
            );
            receipt_headers(&mut response, &receipt, &task_id, single);
            response
        }
        Err(execution) => {
            // Refused before it was recorded (a cancelled task, a payload backstop cannot
            // send): logged as a synchronous call's gateway outcome is. A reused key was
            // logged where it was found, a store failure as an ERROR.
            if let Execution::Outcome {
                outcome, detail, ..
            } = &execution
            {
                tracing::info!(
                    %agent, task = %task_id, %outcome, %detail,
                    "door: action not accepted"
                );
            }
            render(state, execution, &task_id, single)
        }
    }
}

async fn execute(state: &AppState, spec: ActionSpec, before_engine: Duration) -> Response {
    let task_id = spec.task_id.clone();
    let single = spec.single_attempt;
    let provider = spec.route.provider.clone();
    let template = spec.route.template.clone();
    let class = spec.route.class.clone();
    let method = spec.route.method.clone();
    let agent = spec.agent.clone();
    let execution = state.executor.execute(spec).await;
    let answered = tokio::time::Instant::now();
    let receipt = execution.receipt();
    // A passed-through answer is the common case and is already in the audit chain: `debug`.
    // Gateway outcomes and refusals are decisions a demanding user wants explained: `info`.
    match &execution {
        Execution::Response { response, .. } => tracing::debug!(
            %agent, %provider, %method, route = %template, %class, task = %task_id,
            action_id = receipt.action_id, attempts = receipt.attempts,
            status = response.status().as_u16(),
            "door: provider response passed through"
        ),
        Execution::Outcome {
            outcome, detail, ..
        } => tracing::info!(
            %agent, %provider, %method, route = %template, %class, task = %task_id,
            action_id = receipt.action_id, attempts = receipt.attempts,
            %outcome, %detail,
            "door: action ended with a gateway outcome"
        ),
        Execution::InFlight { .. } => tracing::info!(
            %agent, %provider, %method, route = %template, task = %task_id,
            action_id = receipt.action_id,
            "door: layered retry refused, the key's action is in flight"
        ),
    }
    let response = render(state, execution, &task_id, single);
    state
        .metrics
        .observe_overhead((before_engine + answered.elapsed()).as_secs_f64());
    response
}

/// Renders an [`Execution`] for the agent: the provider's response; for a write found at the
/// provider by reconciliation, `200` JSON `{outcome: "succeeded", reconciled: true,
/// provider_operation_id (string or null), idempotency_key, action_id, detail, context}`; or a
/// problem. Every answer carries the receipt headers and, for a write, `Idempotency-Key` (also
/// `idempotency_key` in problem bodies). The provider's operation id is the receipt's: known from
/// the lookup that found the write, even while the store cannot record it yet. A same-key
/// resend answered with its write's stored outcome carries `Idempotent-Replayed: true`, as a
/// replayed provider response does.
pub(crate) fn render(
    state: &AppState,
    execution: Execution,
    task_id: &str,
    single: bool,
) -> Response {
    let replayed = execution.is_replayed_outcome();
    // An action recorded before (a same-key resend) is answered with its own task.
    let own_task = execution.receipt().task.clone();
    let task_id = own_task.as_deref().unwrap_or(task_id);
    match execution {
        Execution::Response {
            receipt,
            mut response,
        } => {
            strip_hop_by_hop(response.headers_mut());
            no_second_retry(&mut response);
            let mut response = response.into_response();
            response.extensions_mut().insert(ProviderResponse);
            receipt_headers(&mut response, &receipt, task_id, single);
            response
        }
        Execution::Outcome {
            receipt,
            outcome,
            context,
            detail,
        } => {
            let mut response = if outcome == Outcome::Succeeded {
                let body = serde_json::json!({
                    "outcome": outcome.as_str(),
                    "reconciled": true,
                    "provider_operation_id": receipt.provider_operation_id,
                    "detail": detail,
                    "context": context,
                    "action_id": receipt.action_id,
                    "idempotency_key": receipt.idempotency_key,
                });
                let mut response = (StatusCode::OK, axum::Json(body)).into_response();
                response
                    .headers_mut()
                    .insert(RECONCILED_HEADER, HeaderValue::from_static("true"));
                response
            } else {
                let mut problem =
                    Problem::from_outcome(outcome, &context, detail, state.clock.now())
                        .with_extension("action_id", receipt.action_id.into())
                        .with_extension("task", task_id.into());
                if let Some(key) = &receipt.idempotency_key {
                    problem = problem.with_extension("idempotency_key", key.clone().into());
                }
                problem.into_response()
            };
            receipt_headers(&mut response, &receipt, task_id, single);
            if replayed {
                response
                    .headers_mut()
                    .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
            }
            response
        }
        Execution::InFlight { receipt } => {
            let mut response =
                Problem::key_in_flight(receipt.action_id, receipt.idempotency_key.as_deref())
                    .with_extension("task", task_id.into())
                    .into_response();
            receipt_headers(&mut response, &receipt, task_id, single);
            response
        }
    }
}

/// `x-should-retry: false` on a provider's non-2xx answer passed on — set, or overriding the
/// provider's own `true`: the action ended with it, so backstop decided that no further attempt
/// follows, and a client's own retry would be a second retry layer (SPEC §11). An answer
/// backstop made itself ([`crate::problem::OwnAnswer`]: an engine-made problem, such as a stop's
/// `503 shutting_down` for a read) keeps the hint it was made with, also in a copy shared
/// between coalesced reads or joined calls.
fn no_second_retry(response: &mut Response) {
    if response.status().is_success()
        || response
            .extensions()
            .get::<crate::problem::OwnAnswer>()
            .is_some()
    {
        return;
    }
    let headers = response.headers_mut();
    headers.insert(SHOULD_RETRY, HeaderValue::from_static("false"));
    headers.insert(
        crate::problem::STRIPE_SHOULD_RETRY,
        HeaderValue::from_static("false"),
    );
}

/// A duplicated `Authorization` header is a malformed request (400 `bad_header`), every other
/// [`AuthError`] a 401.
impl From<AuthError> for Problem {
    fn from(error: AuthError) -> Problem {
        match error {
            AuthError::Duplicate => Problem::bad_header(
                "Authorization",
                "given more than once, so the credentials are ambiguous; send exactly one",
            ),
            other => Problem::unauthorized(other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{end_to_end_pairs, header_pairs};

    #[test]
    fn a_completion_refused_while_draining_carries_no_minted_key_a_write_does() {
        let policy = Policy::from_yaml_str(
            "providers:\n  ai:\n    base_url: https://ai.example\n    dialect: openai\n",
            "p.yaml",
        )
        .unwrap();
        let chat = draining(
            &policy,
            &Method::POST,
            "/ai/v1/chat/completions",
            &HeaderMap::new(),
        );
        assert!(!chat.headers().contains_key(IDEMPOTENCY_KEY));
        let files = draining(&policy, &Method::POST, "/ai/v1/files", &HeaderMap::new());
        assert!(files.headers().contains_key(IDEMPOTENCY_KEY));
    }

    /// The upstream headers of a read with `incoming`, to a provider without an idempotency
    /// header or credential.
    fn forwarded_read_headers(incoming: &HeaderMap) -> HeaderMap {
        upstream_headers(
            incoming,
            &Method::GET,
            SideEffect::Write,
            &provider(None),
            None,
        )
        .unwrap()
        .0
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        map
    }

    #[test]
    fn provider_error_answers_passed_on_say_no_retry() {
        let provider = |status: u16, hint: Option<&str>| {
            let mut response = Response::new(Body::empty());
            *response.status_mut() = StatusCode::from_u16(status).unwrap();
            if let Some(hint) = hint {
                response
                    .headers_mut()
                    .insert("x-should-retry", HeaderValue::from_str(hint).unwrap());
            }
            no_second_retry(&mut response);
            response
                .headers()
                .get("x-should-retry")
                .map(|v| v.to_str().unwrap().to_owned())
        };
        for status in [400, 404, 409, 422, 429, 500, 503, 529] {
            assert_eq!(provider(status, None).as_deref(), Some("false"), "{status}");
            assert_eq!(
                provider(status, Some("true")).as_deref(),
                Some("false"),
                "{status}"
            );
        }
        // A success is the provider's, untouched.
        assert_eq!(provider(200, None), None);
        assert_eq!(provider(201, Some("true")).as_deref(), Some("true"));
        // Stripe's SDKs read their own header: the same decision.
        let mut passed = Response::new(Body::empty());
        *passed.status_mut() = StatusCode::CONFLICT;
        passed
            .headers_mut()
            .insert("stripe-should-retry", HeaderValue::from_static("true"));
        no_second_retry(&mut passed);
        assert_eq!(passed.headers()["stripe-should-retry"], "false");
        // backstop's own answer keeps the hint it was made with.
        let mut own = Problem::shutting_down().into_response();
        no_second_retry(&mut own);
        assert_eq!(own.headers()["x-should-retry"], "true");
        assert_eq!(own.headers()["stripe-should-retry"], "true");
    }

    #[test]
    fn backstop_headers_parse() {
        let parsed = parse_backstop_headers(&headers(&[
            ("X-Backstop-Task", " run-7 "),
            ("X-Backstop-Priority", "Interactive"),
            ("X-Backstop-Deadline", "2026-01-01T12:00:00+01:00"),
            ("Prefer", "return=minimal, wait=30"),
        ]))
        .unwrap();
        assert_eq!(parsed.task_id.as_deref(), Some("run-7"));
        assert_eq!(parsed.priority, Priority::Interactive);
        assert_eq!(
            parsed.deadline,
            Some("2026-01-01T11:00:00Z".parse().unwrap())
        );
        assert_eq!(parsed.max_wait, Some(Duration::from_secs(30)));
        let defaults = parse_backstop_headers(&HeaderMap::new()).unwrap();
        assert_eq!(defaults.priority, Priority::Normal);
        assert_eq!(defaults.task_id, None);
    }

    fn bad(pairs: &[(&str, &str)]) -> Problem {
        parse_backstop_headers(&headers(pairs)).unwrap_err()
    }

    #[test]
    fn malformed_headers_name_themselves() {
        for (pairs, header) in [
            (
                vec![("X-Backstop-Priority", "urgent")],
                "X-Backstop-Priority",
            ),
            (
                vec![("X-Backstop-Deadline", "tomorrow")],
                "X-Backstop-Deadline",
            ),
            (
                vec![("X-Backstop-Deadline", "2026-01-01 12:00")],
                "X-Backstop-Deadline",
            ),
            (vec![("Prefer", "wait=soon")], "Prefer"),
            (vec![("Prefer", "wait=-1")], "Prefer"),
            (vec![("Prefer", "wait")], "Prefer"),
            (vec![("Prefer", "wait=1"), ("Prefer", "wait=2")], "Prefer"),
            (vec![("X-Backstop-Task", "a b")], "X-Backstop-Task"),
            (
                vec![("X-Backstop-Task", "a"), ("X-Backstop-Task", "b")],
                "X-Backstop-Task",
            ),
        ] {
            let problem = bad(&pairs);
            assert_eq!(problem.status, StatusCode::BAD_REQUEST, "{pairs:?}");
            assert_eq!(problem.extensions["header"], header, "{pairs:?}");
            assert!(problem.detail.contains(header), "{}", problem.detail);
        }
        let long = "t".repeat(MAX_TASK_ID_BYTES + 1);
        assert_eq!(
            bad(&[("X-Backstop-Task", &long)]).extensions["header"],
            "X-Backstop-Task"
        );
    }

    #[test]
    fn deadlines_accept_what_can_be_represented_and_say_why_not() {
        let at = parse_instant("2026-01-01T12:00:00.123456789123Z").unwrap();
        assert_eq!(at, "2026-01-01T12:00:00.123456789Z".parse().unwrap());
        assert!(parse_instant("9999-12-30T22:00:00Z").is_ok());
        assert_eq!(
            parse_instant(LATEST_INSTANT).unwrap().as_millisecond(),
            LATEST_INSTANT_MS
        );
        let error = parse_instant("9999-12-31T23:59:59Z").unwrap_err();
        assert!(error.contains("9999-12-30T22:00:00Z"), "{error}");
        for later in [
            "9999-12-30T22:00:00.001Z",
            "9999-12-30T22:00:00.000000001Z",
            "9999-12-30T22:00:00.999999999Z",
        ] {
            let error = parse_instant(later).unwrap_err();
            assert!(
                error.contains("later than 9999-12-30T22:00:00Z"),
                "{later}: {error}"
            );
        }
        assert!(parse_instant("2026-01-01").is_err());
    }

    #[test]
    fn a_deadline_offset_outside_rfc_3339_is_refused_naming_the_offset() {
        for (text, why) in [
            ("2026-01-01T12:00:00+25:00", "has an offset of 25 hours"),
            ("2026-01-01T12:00:00-24:00", "has an offset of 24 hours"),
            (
                "2026-01-01T12:00:00+05:00:30",
                "does not end in an RFC 3339 offset",
            ),
            (
                "2026-01-01T12:00:00+0500",
                "does not end in an RFC 3339 offset",
            ),
        ] {
            let error = parse_instant(text).unwrap_err();
            assert!(error.contains(why), "{text}: {error}");
            assert!(error.contains("hours 00–23"), "{text}: {error}");
        }
        // Minutes past 59 are refused by the parser itself.
        assert!(parse_instant("2026-01-01T12:00:00+05:60").is_err());
        for ok in [
            "2026-01-01T12:00:00+23:59",
            "2026-01-01T12:00:00-23:00",
            "2026-01-01T12:00:00-00:00",
            "2026-01-01T12:00:00.5+01:00",
            "2026-01-01t12:00:00z",
        ] {
            assert!(parse_instant(ok).is_ok(), "{ok}");
        }
        let problem = parse_backstop_headers(&headers(&[(
            "X-Backstop-Deadline",
            "2026-01-01T12:00:00+25:00",
        )]))
        .unwrap_err();
        assert_eq!(problem.status, StatusCode::BAD_REQUEST);
        assert_eq!(problem.extensions["header"], "X-Backstop-Deadline");
        assert!(problem.detail.contains("25 hours"), "{}", problem.detail);
    }

    #[test]
    fn a_kept_response_lists_only_end_to_end_headers() {
        let answer = headers(&[
            ("connection", "keep-alive, x-secret-hop"),
            ("x-secret-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("content-type", "application/json"),
            ("x-request-id", "r-1"),
            ("x-request-id", "r-2"),
        ]);
        assert_eq!(
            end_to_end_pairs(&answer),
            vec![
                ("content-type".to_owned(), "application/json".to_owned()),
                ("x-request-id".to_owned(), "r-1".to_owned()),
                ("x-request-id".to_owned(), "r-2".to_owned()),
            ]
        );
        // Nothing to strip: the same pairs header_pairs gives.
        let plain = headers(&[("content-type", "text/plain"), ("etag", "\"v1\"")]);
        assert_eq!(end_to_end_pairs(&plain), header_pairs(&plain));
    }

    #[test]
    fn hop_by_hop_headers_are_removed() {
        let mut map = headers(&[
            ("Connection", "keep-alive, X-Private-Hop"),
            ("X-Private-Hop", "1"),
            ("Keep-Alive", "timeout=5"),
            ("Proxy-Authorization", "Basic x"),
            ("Proxy-Foo", "1"),
            ("TE", "trailers"),
            ("Trailer", "X-Checksum"),
            ("Transfer-Encoding", "chunked"),
            ("Upgrade", "websocket"),
            ("Content-Type", "application/json"),
            ("X-End-To-End", "kept"),
        ]);
        strip_hop_by_hop(&mut map);
        let mut left: Vec<&str> = map.keys().map(|k| k.as_str()).collect();
        left.sort();
        assert_eq!(left, ["content-type", "x-end-to-end"]);
    }

    fn provider(idempotency_header: Option<&str>) -> Provider {
        let header = idempotency_header
            .map(|h| format!("    idempotency_header: {h}\n"))
            .unwrap_or_default();
        let src = format!("providers:\n  p:\n    base_url: http://127.0.0.1:9\n{header}");
        Policy::from_yaml_str(&src, "p.yaml").unwrap().providers["p"].clone()
    }

    #[test]
    fn upstream_headers_swap_credentials_and_keep_keys() {
        let incoming = headers(&[
            ("Authorization", "Bearer agent-token"),
            ("Host", "127.0.0.1:8080"),
            ("X-Backstop-Task", "t1"),
            ("X-Backstop-Priority", "background"),
            ("Prefer", "wait=10, respond-async"),
            ("Content-Length", "5"),
            ("Idempotency-Key", "key-1"),
            ("Content-Type", "application/json"),
        ]);
        let mut credential_value = HeaderValue::from_static("Bearer provider-secret");
        credential_value.set_sensitive(true);
        let credential = crate::secrets::CredentialHeader {
            name: header::AUTHORIZATION,
            value: credential_value,
        };
        let p = provider(Some("Idempotency-Key"));
        let (out, key) = upstream_headers(
            &incoming,
            &Method::POST,
            SideEffect::Write,
            &p,
            Some(&credential),
        )
        .unwrap();
        assert_eq!(out["authorization"], "Bearer provider-secret");
        assert_eq!(out.get_all("authorization").iter().count(), 1);
        assert!(out.get("host").is_none());
        assert!(out.get("content-length").is_none());
        assert!(out.keys().all(|k| !k.as_str().starts_with("x-backstop-")));
        assert!(
            out.get("prefer").is_none(),
            "backstop's preferences stay here"
        );
        assert_eq!(out["idempotency-key"], "key-1");
        assert_eq!(key.as_deref(), Some("key-1"));

        // A write without a key: none here, the engine mints it; a read gets none.
        let bare = headers(&[("Authorization", "Bearer agent-token")]);
        let (out, key) =
            upstream_headers(&bare, &Method::POST, SideEffect::Write, &p, None).unwrap();
        assert_eq!(key, None);
        assert!(out.get("idempotency-key").is_none());
        assert!(out.get("authorization").is_none());
        let (out, key) =
            upstream_headers(&bare, &Method::GET, SideEffect::Write, &p, None).unwrap();
        assert_eq!(key, None);
        assert!(out.get("idempotency-key").is_none());
        // No idempotency header configured: the agent's `Idempotency-Key` is backstop's own and
        // is not forwarded.
        let (out, key) = upstream_headers(
            &incoming,
            &Method::POST,
            SideEffect::Write,
            &provider(None),
            None,
        )
        .unwrap();
        assert_eq!(key.as_deref(), Some("key-1"));
        assert!(out.get("idempotency-key").is_none());
    }

    #[test]
    fn unusable_idempotency_keys_are_the_agents_malformed_header() {
        for provider_header in [Some("Idempotency-Key"), Some("X-Idem"), None] {
            let p = provider(provider_header);
            let name = provider_header.unwrap_or("Idempotency-Key");
            for (value, reason) in [
                ("k".repeat(300), "300 bytes, at most 255 allowed"),
                ("k".repeat(70 * 1024), "71680 bytes, at most 255 allowed"),
                ("order\t7".to_owned(), "byte 6 is not printable ASCII"),
                ("\"\"".to_owned(), "must not be empty"),
                (String::new(), "must not be empty"),
            ] {
                let incoming = headers(&[(name, &value)]);
                let problem =
                    upstream_headers(&incoming, &Method::POST, SideEffect::Write, &p, None)
                        .unwrap_err();
                assert_eq!(problem.status, StatusCode::BAD_REQUEST);
                assert_eq!(problem.name, "bad_header", "{value:.20}");
                assert_eq!(problem.extensions["header"], name);
                assert!(problem.detail.contains(reason), "{}", problem.detail);
                assert!(!problem.detail.contains(&value) || value.is_empty());
                assert!(problem.extensions.get("action_id").is_none());
            }
            // The quoted form is the bare key, as the engine stores it.
            let (_, key) = upstream_headers(
                &headers(&[(name, "\"order-7\"")]),
                &Method::POST,
                SideEffect::Write,
                &p,
                None,
            )
            .unwrap();
            assert_eq!(key.as_deref(), Some("order-7"));
        }
    }

    #[test]
    fn a_wait_too_large_to_read_says_so_and_names_the_maximum() {
        let problem = bad(&[("Prefer", "wait=99999999999999999999999")]);
        assert_eq!(problem.extensions["header"], "Prefer");
        assert!(problem.detail.contains("too large"), "{}", problem.detail);
        assert!(
            problem.detail.contains(&u64::MAX.to_string()),
            "{}",
            problem.detail
        );
        assert!(
            !problem.detail.contains("whole number"),
            "{}",
            problem.detail
        );
        let most = format!("wait={}", u64::MAX);
        let parsed = parse_backstop_headers(&headers(&[("Prefer", &most)])).unwrap();
        assert_eq!(parsed.max_wait, Some(Duration::from_secs(u64::MAX)));
        let zeros =
            parse_backstop_headers(&headers(&[("Prefer", "wait=0000000000000000000000030")]));
        assert_eq!(zeros.unwrap().max_wait, Some(Duration::from_secs(30)));
    }

    #[test]
    fn provider_is_the_first_segment() {
        assert_eq!(
            split_provider("/billing/v1/transfers?x=1"),
            Some(("billing", "/v1/transfers?x=1".to_owned()))
        );
        assert_eq!(
            split_provider("/billing"),
            Some(("billing", "/".to_owned()))
        );
        assert_eq!(
            split_provider("/billing?x=1"),
            Some(("billing", "/?x=1".to_owned()))
        );
        assert_eq!(split_provider("/"), None);
    }

    #[test]
    fn paths_are_normalized_before_matching() {
        for (given, expected) in [
            ("/fake/v1/limited", "/fake/v1/limited"),
            ("/fake/v1/./limited", "/fake/v1/limited"),
            ("/fake/v1/%6cimited", "/fake/v1/limited"),
            ("/fake/v1/%6Cimited", "/fake/v1/limited"),
            ("/fake/v1/x/../limited", "/fake/v1/limited"),
            ("/fake/v1/x/%2e%2E/limited", "/fake/v1/limited"),
            ("/fake/v1/a%2fb", "/fake/v1/a%2Fb"),
            ("/fake/v1/a%20b", "/fake/v1/a%20b"),
            ("/fake/v1//limited/", "/fake/v1//limited/"),
            ("/fake/v1/limited/.", "/fake/v1/limited/"),
            ("/fake/v1/x/..", "/fake/v1/"),
            ("/%66ake/v1", "/fake/v1"),
            ("fake/v1", "/fake/v1"),
            ("/", "/"),
            ("", "/"),
            ("/fake/v1/.hidden/..x", "/fake/v1/.hidden/..x"),
            // Raw non-ASCII is percent-encoded, so both spellings match one route.
            ("/fake/v1/élément", "/fake/v1/%C3%A9l%C3%A9ment"),
            ("/fake/v1/%c3%a9l%C3%A9ment", "/fake/v1/%C3%A9l%C3%A9ment"),
            (
                "/fake/v1/élément%20x/./y",
                "/fake/v1/%C3%A9l%C3%A9ment%20x/y",
            ),
        ] {
            assert_eq!(normalize_path(given).unwrap(), expected, "{given}");
        }
        for bad in ["/fake/../../x", "/..", "/fake/%zz", "/fake/%4", "/fake/%"] {
            let problem = normalize_path(bad).unwrap_err();
            assert_eq!(problem.status, StatusCode::BAD_REQUEST, "{bad}");
            assert!(problem.detail.contains("path `"), "{}", problem.detail);
        }
    }

    #[test]
    fn minted_ids_differ_and_ascend() {
        let a = mint_id("task-");
        let b = mint_id("task-");
        assert_ne!(a, b);
        // Time-ordered (UUIDv7): a later id sorts after an earlier one, as text too.
        let ids: Vec<String> = (0..1000).map(|_| mint_id("task-")).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "{:?}", &ids[..3]);
        assert!(a < ids[0]);
        assert_eq!(a.len(), 5 + 32);
        let digits = a.strip_prefix("task-").unwrap();
        assert!(
            digits
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "{a}"
        );
    }

    #[test]
    fn digests_are_lower_case_sha256_hex() {
        for body in [&b""[..], b"a", b"{\"amount\":5}", &[0xffu8; 300][..]] {
            assert_eq!(sha256_hex(body), hex::encode(Sha256::digest(body)));
        }
    }

    #[test]
    fn provider_and_rest_split_the_same_with_or_without_a_query() {
        for path in [
            "/billing/v1/transfers",
            "/billing",
            "/billing/",
            "/",
            "//x",
            "/b//c",
        ] {
            for query in [None, Some(""), Some("x=1&y=%2F")] {
                let joined = match query {
                    Some(q) => format!("{path}?{q}"),
                    None => path.to_owned(),
                };
                assert_eq!(
                    split_provider_query(path, query),
                    split_provider(&joined),
                    "{joined}"
                );
            }
        }
    }

    #[test]
    fn upstream_headers_keep_repeated_values_and_drop_what_connection_names() {
        let incoming = headers(&[
            ("Connection", "X-Private-Hop"),
            ("X-Private-Hop", "1"),
            ("Accept", "application/json"),
            ("Accept", "text/plain"),
            ("Keep-Alive", "timeout=5"),
            ("Proxy-Foo", "1"),
            ("Expect", "100-continue"),
            ("Prefer", "return=minimal, wait=5"),
            ("X-Backstop-Deadline", "2026-01-01T00:00:00Z"),
            ("X-Request-Id", "r-1"),
        ]);
        let out = forwarded_read_headers(&incoming);
        let accept: Vec<&str> = out
            .get_all("accept")
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect();
        assert_eq!(accept, ["application/json", "text/plain"]);
        assert_eq!(out["prefer"], "return=minimal");
        assert_eq!(out["x-request-id"], "r-1");
        let mut left: Vec<&str> = out.keys().map(|k| k.as_str()).collect();
        left.sort();
        assert_eq!(left, ["accept", "prefer", "x-request-id"]);
    }

    #[test]
    fn upstream_header_values_do_not_keep_the_connections_read_buffer_alive() {
        // As hyper parses them: every value a slice of the connection's read buffer.
        let read_buffer = Bytes::from(
            "GET /p/x HTTP/1.1\r\naccept: application/json\r\nx-request-id: r-1\r\n\r\n".to_owned()
                + &" ".repeat(8000),
        );
        let slice = |text: &str| {
            let at = read_buffer
                .windows(text.len())
                .position(|w| w == text.as_bytes())
                .unwrap();
            HeaderValue::from_maybe_shared(read_buffer.slice(at..at + text.len())).unwrap()
        };
        let mut incoming = HeaderMap::new();
        incoming.append("accept", slice("application/json"));
        incoming.append("x-request-id", slice("r-1"));
        let mut secret = slice("r-1");
        secret.set_sensitive(true);
        incoming.append("x-api-token", secret);
        // An empty value and one with obs-text (RFC 9110 §5.5) come through as they were.
        incoming.append("x-empty", HeaderValue::from_static(""));
        incoming.append("x-latin", HeaderValue::from_bytes(b"caf\xe9").unwrap());
        let out = forwarded_read_headers(&incoming);
        assert_eq!(out["x-empty"], "");
        assert_eq!(out["x-latin"].as_bytes(), b"caf\xe9");
        let buffer = read_buffer.as_ptr_range();
        for (name, value) in &out {
            assert!(
                !buffer.contains(&value.as_bytes().as_ptr()),
                "`{name}` still points into the read buffer"
            );
        }
        assert_eq!(out["accept"], "application/json");
        assert_eq!(out["x-request-id"], "r-1");
        assert_eq!(out["x-api-token"], "r-1");
        assert!(out["x-api-token"].is_sensitive(), "sensitivity is kept");
        assert!(!out["accept"].is_sensitive());
    }

    #[tokio::test]
    async fn bodies_between_the_limits_get_one_attempt_and_beyond_the_cap_413() {
        let config = DoorConfig {
            max_buffered_body_bytes: 4,
            max_body_bytes: 8,
            ..DoorConfig::default()
        };
        let budget = BodyBudget::new(100);
        let (bytes, large) = read_body(&budget, Body::from("abcd"), None, config)
            .await
            .unwrap();
        assert_eq!((&bytes[..], large), (&b"abcd"[..], false));
        let (bytes, large) = read_body(&budget, Body::from("abcdef"), Some(6), config)
            .await
            .unwrap();
        assert_eq!((bytes.len(), large), (6, true));
        let problem = read_body(&budget, Body::from("abcdefghi"), None, config)
            .await
            .unwrap_err();
        assert_eq!(problem.status, StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[tokio::test]
    async fn a_body_the_budget_has_no_room_for_is_a_503_that_may_be_retried() {
        let budget = BodyBudget::new(10);
        let (held, _) = read_body(
            &budget,
            Body::from("abcdef"),
            Some(6),
            DoorConfig::default(),
        )
        .await
        .unwrap();
        let problem = read_body(
            &budget,
            Body::from("abcdef"),
            Some(6),
            DoorConfig::default(),
        )
        .await
        .unwrap_err();
        assert_eq!(problem.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(problem.name, "body_budget_exhausted");
        assert_eq!(problem.retry_after_seconds, Some(1));
        assert!(problem.should_retry);
        assert_eq!(problem.extensions["sent"], false);
        drop(held);
        assert!(read_body(
            &budget,
            Body::from("abcdef"),
            Some(6),
            DoorConfig::default()
        )
        .await
        .is_ok());
    }
}
