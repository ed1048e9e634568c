//! Reading the text of a policy into the raw document: the pre-scan for blank files and YAML
//! tags, deserialization with key paths, and backstop's wording of the YAML library's errors.

use serde_saphyr::Location;

use super::diagnostics::{PolicyError, PolicyErrors};
use super::raw::{RawPolicy, FAILED_MAP_KEYS, REFUSED_SECRET_KEYS};

/// Every explicit YAML tag in `src` (`!include`, `!!binary`, `!env`, …), each a positioned
/// error: a policy uses none, and a tag ignored or decoded behind the reader's back would change
/// what a value means (`store: !include /etc/passwd` taken as a path, base64 taken as text).
/// Syntax errors are left to the deserializer, which reports them with their own position.
fn explicit_tags(src: &str, file: &str) -> Vec<PolicyError> {
    use serde_saphyr::granit_parser::{Event, Parser};
    let mut found = Vec::new();
    for parsed in Parser::new_from_str(src) {
        let Ok((event, span)) = parsed else {
            break;
        };
        let tag = match event {
            Event::Scalar(_, _, _, tag)
            | Event::SequenceStart(_, _, tag)
            | Event::MappingStart(_, _, tag) => tag,
            _ => None,
        };
        if let Some(tag) = tag {
            let at = span.tag_start.unwrap_or(span.start);
            found.push(PolicyError {
                file: file.to_owned(),
                line: u64::try_from(at.line()).unwrap_or(u64::MAX),
                column: u64::try_from(at.col() + 1).unwrap_or(u64::MAX),
                message: format!(
                    "the YAML tag `{}` is not allowed in a policy: write the value itself (no tags, includes or encodings)",
                    tag.original()
                ),
            });
        }
    }
    found
}

/// Deserializes the raw document; `file` names it in errors.
///
/// # Errors
/// One [`PolicyError`] for the first YAML error (syntax, unknown key, wrong type, a number
/// that is not finite), at its line and column, its message led by the key path of the value
/// it concerns (`providers.fake.routes."GET /v1/x".coalesce: invalid boolean`) — without one
/// when the error concerns the document as a whole.
///
/// The path comes from `serde_path_to_error`, which tracks struct fields and sequence
/// indexes. Two things are mended: the `value` level that every [`Spanned`](serde_saphyr::Spanned) adds (its
/// internal view is a struct with a `value` field) is dropped, and the keys of
/// [`SpannedMap`](super::raw::SpannedMap)s, which the tracker cannot capture because they are read as [`Spanned`](serde_saphyr::Spanned)
/// strings, are filled in from [`FAILED_MAP_KEYS`].
pub(super) fn read_raw(src: &str, file: &str) -> Result<RawPolicy, PolicyErrors> {
    let tags = explicit_tags(src, file);
    if !tags.is_empty() {
        return Err(PolicyErrors(tags));
    }
    FAILED_MAP_KEYS.with(|keys| keys.borrow_mut().clear());
    let mut at = None;
    let raw = serde_saphyr::with_deserializer_from_str(src, |de| {
        serde_path_to_error::deserialize::<_, RawPolicy>(de).map_err(|e| {
            at = Some(key_path(e.path()));
            e.into_inner()
        })
    });
    let failed_keys = FAILED_MAP_KEYS.with(|keys| std::mem::take(&mut *keys.borrow_mut()));
    raw.map_err(|e| {
        let at = at.and_then(|segments| {
            let mut keys = failed_keys.into_iter().rev();
            let mut path = String::new();
            for segment in segments {
                match segment {
                    PathSegment::Field(name) => push_key(&mut path, &name),
                    PathSegment::MapKey => push_key(&mut path, &keys.next()?),
                    PathSegment::Index(index) => path.push_str(&format!("[{index}]")),
                }
            }
            (!path.is_empty()).then_some(path)
        });
        let (line, column) = e
            .location()
            .map(|l| (l.line(), l.column()))
            .unwrap_or((0, 0));
        let message = match at {
            Some(at) => format!("{at}: {}", yaml_message(&e)),
            None => yaml_message(&e),
        };
        PolicyErrors(vec![PolicyError {
            file: file.to_owned(),
            line,
            column,
            message,
        }])
    })
}

/// One level of a key path as `serde_path_to_error` reports it.
enum PathSegment {
    /// A struct field (a setting's name).
    Field(String),
    /// A key the tracker could not read (the key of a [`SpannedMap`](super::raw::SpannedMap) entry).
    MapKey,
    /// A sequence index.
    Index(usize),
}

/// The levels of `path` without the `value` level each [`Spanned`](serde_saphyr::Spanned) adds. No raw type has a
/// setting named `value` whose value can fail (`value` is a [`Trap`](super::raw::Trap), read as anything), and
/// names chosen in the file are [`PathSegment::MapKey`]s, so no real level is lost.
fn key_path(path: &serde_path_to_error::Path) -> Vec<PathSegment> {
    path.iter()
        .filter_map(|segment| match segment {
            serde_path_to_error::Segment::Map { key } if key == "value" => None,
            serde_path_to_error::Segment::Map { key } => Some(PathSegment::Field(key.clone())),
            serde_path_to_error::Segment::Seq { index } => Some(PathSegment::Index(*index)),
            serde_path_to_error::Segment::Enum { variant } => {
                Some(PathSegment::Field(variant.clone()))
            }
            serde_path_to_error::Segment::Unknown => Some(PathSegment::MapKey),
        })
        .collect()
}

/// Appends `.key` to `path` (no dot at the start), quoting a key that is not a plain name
/// the way validation messages do (`routes."GET /v1/x"`).
fn push_key(path: &mut String, key: &str) {
    if !path.is_empty() {
        path.push('.');
    }
    let plain = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if plain {
        path.push_str(key);
    } else {
        path.push('"');
        path.push_str(key);
        path.push('"');
    }
}

/// Whether `src` holds no YAML content: only whitespace, comments and a byte-order mark.
pub(super) fn is_blank_yaml(src: &str) -> bool {
    src.trim_start_matches('\u{feff}').lines().all(|line| {
        let line = line.trim();
        line.is_empty() || line.starts_with('#')
    })
}

/// Location wording of the YAML library, suppressed: the position is reported once, in
/// structured form, as the `FILE:LINE:COL` prefix.
struct NoLocationSuffix;

impl serde_saphyr::Localizer for NoLocationSuffix {
    fn attach_location<'a>(
        &self,
        base: std::borrow::Cow<'a, str>,
        _loc: Location,
    ) -> std::borrow::Cow<'a, str> {
        base
    }

    fn alias_used_at(&self, _used: Location) -> String {
        String::new()
    }

    fn alias_defined_at(&self, defined: Location) -> String {
        format!(
            " (the value comes from the anchor at {}:{})",
            defined.line(),
            defined.column()
        )
    }
}

/// The YAML library's end-user wording, with backstop's own text for duplicate keys, and
/// without the refused secret keys among the keys an unknown key's message lists as expected.
struct PolicyMessages;

impl serde_saphyr::MessageFormatter for PolicyMessages {
    fn localizer(&self) -> &dyn serde_saphyr::Localizer {
        &NoLocationSuffix
    }

    fn format_message<'a>(&self, err: &'a serde_saphyr::Error) -> std::borrow::Cow<'a, str> {
        match err {
            serde_saphyr::Error::DuplicateMappingKey { key: Some(key), .. } => {
                format!("duplicate key `{key}` (each key may appear once per mapping)").into()
            }
            serde_saphyr::Error::DuplicateMappingKey { key: None, .. } => {
                "duplicate key (each key may appear once per mapping)".into()
            }
            // The raw types list the refused secret keys as fields (to refuse them by name);
            // they are not among the keys a mapping expects.
            serde_saphyr::Error::SerdeUnknownField {
                field, expected, ..
            } => {
                let expected: Vec<&str> = expected
                    .iter()
                    .copied()
                    .filter(|name| !REFUSED_SECRET_KEYS.contains(name))
                    .collect();
                format!(
                    "unknown field `{field}`, expected one of {}",
                    expected.join(", ")
                )
                .into()
            }
            other => serde_saphyr::UserMessageFormatter.format_message(other),
        }
    }
}

/// The message of a YAML error without any position (the caller reports the library's
/// structured [`Location`] instead) and without the library's configuration advice.
fn yaml_message(e: &serde_saphyr::Error) -> String {
    let mut options = serde_saphyr::RenderOptions::new(&PolicyMessages);
    options.snippets = serde_saphyr::SnippetMode::Off;
    e.render_with_options(options)
}
