//! Checks of single values that several sections share: names and JSON pointers.

use super::diagnostics::Ctx;
use super::raw::S;

pub(super) fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
}

/// Whether `s` is a JSON pointer (RFC 6901 §3): empty, or `/` followed by reference tokens in
/// which `~` appears only as `~0` or `~1`.
///
/// ```
/// use backstop_core::policy::is_json_pointer;
/// assert!(is_json_pointer("/error/code"));
/// assert!(!is_json_pointer("error/code"));
/// assert!(!is_json_pointer("/error/~2"));
/// ```
pub fn is_json_pointer(s: &str) -> bool {
    if s.is_empty() {
        return true;
    }
    if !s.starts_with('/') {
        return false;
    }
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '~' && !matches!(chars.next(), Some('0' | '1')) {
            return false;
        }
    }
    true
}

pub(super) fn check_pointer(ctx: &mut Ctx, v: &Option<S<String>>, path: &str) -> Option<String> {
    let s = v.as_ref()?;
    if !is_json_pointer(&s.value) {
        ctx.err(
            &s.referenced,
            format!(
                "{path}: `{}` is not a JSON pointer (RFC 6901: empty, or `/` followed by tokens, `~` only as `~0`/`~1`)",
                s.value
            ),
        );
        return None;
    }
    Some(s.value.clone())
}

/// Every JSON pointer of the list `v` (absent: none), each checked at `path`; a pointer that is
/// not one is reported and left out.
pub(super) fn check_pointers(
    ctx: &mut Ctx,
    v: &Option<S<Vec<S<String>>>>,
    path: &str,
) -> Vec<String> {
    v.as_ref()
        .map(|list| {
            list.value
                .iter()
                .filter_map(|f| check_pointer(ctx, &Some(f.clone()), path))
                .collect()
        })
        .unwrap_or_default()
}
