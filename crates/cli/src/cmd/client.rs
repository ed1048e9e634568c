//! The small blocking HTTP client of the commands that talk to a running gateway
//! (`backstop escalations`, `backstop scopes`), and their table printer.
//!
//! Plain `http://` only: reach a remote gateway through a TLS-terminating proxy or an SSH tunnel
//! to its loopback port (this build has no TLS client). Every failure is one sentence for a
//! one-line stderr message: an unreachable gateway names the URL; a problem answer (RFC 9457)
//! gives its status, name and detail; an answer that is neither JSON nor a backstop problem
//! document, or JSON without the members the gateway documents for that route (another server
//! at that URL), says that the URL does not look like a backstop gateway and names the path
//! that was expected.

use std::time::Duration;

use backstop_gateway::problem::TYPE_PREFIX;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Where the gateway is when neither `--url` nor `BACKSTOP_URL` says otherwise.
pub const DEFAULT_URL: &str = "http://127.0.0.1:8080";

/// The gateway's base URL: `--url`, else `BACKSTOP_URL`, else [`DEFAULT_URL`]; trailing `/`
/// removed.
///
/// # Errors
/// A sentence when the URL is not `http://`.
pub fn base_url(flag: Option<String>) -> Result<String, String> {
    let base = flag
        .or_else(|| std::env::var("BACKSTOP_URL").ok().filter(|u| !u.is_empty()))
        .unwrap_or_else(|| DEFAULT_URL.to_owned());
    let base = base.trim_end_matches('/').to_owned();
    if !base.starts_with("http://") {
        return Err(format!(
            "--url {base}: only http:// URLs are supported (reach a remote gateway through a TLS-terminating proxy or a tunnel)"
        ));
    }
    Ok(base)
}

/// A gateway at `base`, called with a bearer token.
pub struct Client {
    base: String,
    token: String,
}

impl Client {
    /// A client of the gateway at `base` (from [`base_url`]) sending `Authorization: Bearer
    /// token`.
    pub fn new(base: String, token: String) -> Client {
        Client { base, token }
    }

    fn agent() -> ureq::Agent {
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into()
    }

    /// `GET base+path`, the JSON answer.
    ///
    /// # Errors
    /// A sentence: unreachable gateway, timeout (30 s), an answer that does not look like a
    /// backstop gateway's (non-JSON success, or an error without a backstop problem document),
    /// or the problem.
    pub fn get(&self, path: &str) -> Result<Value, String> {
        self.get_answer(path)?.into_result()
    }

    /// `GET base+path`: the JSON answer, or `None` when the gateway answers with the backstop
    /// problem `not_found` (e.g. `escalation_not_found` for an id that does not exist).
    ///
    /// # Errors
    /// As [`Client::get`], for every other answer.
    pub fn get_unless(&self, path: &str, not_found: &str) -> Result<Option<Value>, String> {
        match self.get_answer(path)? {
            Answer::Problem { ref name, .. } if name == not_found => Ok(None),
            answer => answer.into_result().map(Some),
        }
    }

    fn get_answer(&self, path: &str) -> Result<Answer, String> {
        let url = format!("{}{path}", self.base);
        let response = Self::agent()
            .get(&url)
            .header("Authorization", &format!("Bearer {}", self.token))
            .header("Accept", "application/json")
            .call();
        self.answer("GET", path, response)
    }

    /// `POST base+path` with a JSON body: the JSON answer, or the whole problem document when
    /// the gateway answers with the backstop problem `name` (e.g. `request_not_held`, which
    /// says what was recorded).
    ///
    /// # Errors
    /// As [`Client::get`], for every other answer.
    pub fn post_unless(&self, path: &str, body: &Value, name: &str) -> Result<Posted, String> {
        let url = format!("{}{path}", self.base);
        let response = Self::agent()
            .post(&url)
            .header("Authorization", &format!("Bearer {}", self.token))
            .header("Accept", "application/json")
            .content_type("application/json")
            .send(body.to_string().as_bytes());
        match self.answer("POST", path, response)? {
            Answer::Problem {
                name: ref got,
                ref document,
                ..
            } if got == name => Ok(Posted::Problem(document.clone())),
            answer => answer.into_result().map(Posted::Value),
        }
    }

    /// The sentence for an answer that no backstop gateway gives: `BASE does not look like a
    /// backstop gateway: METHOD PATH answered WHAT`.
    pub fn not_backstop(&self, method: &str, path: &str, what: &str) -> String {
        format!(
            "{} does not look like a backstop gateway: {method} {path} answered {what}",
            self.base
        )
    }

    /// A success answer of `method path` read as `T`, the shape the gateway documents for that
    /// route (its required members present, with their types).
    ///
    /// # Errors
    /// [`Client::not_backstop`] with `JSON that is not WHAT (REASON)`, the reason being serde's
    /// (e.g. ``missing field `escalations` ``).
    pub fn shaped<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        value: &Value,
        what: &str,
    ) -> Result<T, String> {
        T::deserialize(value)
            .map_err(|e| self.not_backstop(method, path, &format!("JSON that is not {what} ({e})")))
    }

    fn answer(
        &self,
        method: &str,
        path: &str,
        response: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<Answer, String> {
        let url = format!("{}{path}", self.base);
        let mut response = response.map_err(|e| match e {
            ureq::Error::Io(io) => format!("cannot reach the gateway at {}: {io}", self.base),
            ureq::Error::ConnectionFailed | ureq::Error::HostNotFound => {
                format!("cannot reach the gateway at {}: {e}", self.base)
            }
            ureq::Error::Timeout(_) => {
                format!("the gateway at {} did not answer in time ({e})", self.base)
            }
            other => format!("{url}: {other}"),
        })?;
        let status = response.status().as_u16();
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|e| format!("{url}: HTTP {status}: cannot read the answer: {e}"))?;
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let not_backstop = |what: String| self.not_backstop(method, path, &what);
        if (200..300).contains(&status) {
            if value.is_null() {
                return Err(not_backstop(format!(
                    "HTTP {status} with a body that is not JSON"
                )));
            }
            return Ok(Answer::Value(value));
        }
        let Some(name) = value["type"]
            .as_str()
            .and_then(|t| t.strip_prefix(TYPE_PREFIX))
        else {
            return Err(not_backstop(format!(
                "HTTP {status} without a backstop problem document (is --url the gateway's \
                 base URL, without a path?)"
            )));
        };
        let detail = value["detail"]
            .as_str()
            .or_else(|| value["title"].as_str())
            .unwrap_or("no detail in the problem document");
        Ok(Answer::Problem {
            status,
            name: name.to_owned(),
            detail: detail.to_owned(),
            document: value.clone(),
        })
    }
}

/// A gateway's answer: a JSON success, or a backstop problem.
enum Answer {
    Value(Value),
    Problem {
        status: u16,
        name: String,
        detail: String,
        /// The whole problem document.
        document: Value,
    },
}

/// What [`Client::post_unless`] got: the JSON success, or the named problem's document.
pub enum Posted {
    /// A success answer.
    Value(Value),
    /// The problem document the caller asked to read itself.
    Problem(Value),
}

impl Answer {
    /// The value, or the problem as one sentence `HTTP STATUS NAME: DETAIL`.
    fn into_result(self) -> Result<Value, String> {
        match self {
            Answer::Value(value) => Ok(value),
            Answer::Problem {
                status,
                name,
                detail,
                ..
            } => Err(format!("HTTP {status} {name}: {detail}")),
        }
    }
}

/// One table cell: a string as is, `null` as `-`, anything else as JSON.
pub fn cell(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => "-".to_owned(),
        other => other.to_string(),
    }
}

/// A table with a header of `columns` (title, JSON member) and one row per object of `rows`,
/// columns padded to width, two spaces apart, no trailing spaces.
pub fn table(columns: &[(&str, &str)], rows: &[Value]) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|row| columns.iter().map(|(_, key)| cell(&row[*key])).collect())
        .collect();
    let mut widths: Vec<usize> = columns.iter().map(|(title, _)| title.len()).collect();
    for row in &rows {
        for (width, text) in widths.iter_mut().zip(row) {
            *width = (*width).max(text.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &[String]| {
        let text: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(text.join("  ").trim_end());
        out.push('\n');
    };
    let titles: Vec<String> = columns.iter().map(|(t, _)| (*t).to_owned()).collect();
    line(&titles);
    for row in &rows {
        line(row);
    }
    out
}
