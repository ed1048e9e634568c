//! The raw, span-carrying document: what the YAML deserializer reads before validation, each
//! value with its line and column.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_saphyr::Spanned;

std::thread_local! {
    /// The keys of the [`SpannedMap`] entries whose value failed to deserialize, innermost
    /// first: the names a failing value's key path holds where `serde_path_to_error` sees only
    /// a key it could not capture (a [`Spanned`] key). Emptied by [`read_raw`].
    pub(super) static FAILED_MAP_KEYS: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A YAML mapping read with the position of each key, in file order.
pub(super) struct SpannedMap<V>(pub(super) Vec<(Spanned<String>, V)>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for SpannedMap<V> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MapVisitor<V>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for MapVisitor<V> {
            type Value = SpannedMap<V>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a mapping")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut entries = Vec::new();
                while let Some(key) = map.next_key::<Spanned<String>>()? {
                    match map.next_value() {
                        Ok(value) => entries.push((key, value)),
                        Err(e) => {
                            FAILED_MAP_KEYS.with(|keys| keys.borrow_mut().push(key.value));
                            return Err(e);
                        }
                    }
                }
                Ok(SpannedMap(entries))
            }
        }
        deserializer.deserialize_map(MapVisitor(PhantomData))
    }
}

pub(super) type S<T> = Spanned<T>;
/// A key that would hold a secret in clear: read only to be refused with its own message
/// ([`Ctx::trap`](super::diagnostics::Ctx::trap)). Its name is one of [`REFUSED_SECRET_KEYS`].
pub(super) type Trap = Option<S<IgnoredAny>>;

/// The names of every [`Trap`] field: keys that would hold a secret in clear, refused
/// wherever they appear. They are not settings, so the list of keys an unknown key's message
/// says are expected leaves them out (see `PolicyMessages` in `parse.rs`); no setting may be named like one.
pub(super) const REFUSED_SECRET_KEYS: [&str; 5] =
    ["secret", "value", "token", "api_key", "password"];

/// A number as written in the file, read permissively so that validation — not the YAML
/// library — reports a wrong sign, size or type together with the key path
/// (`breaker.threshold: expected a non-negative integer, got -3`).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Num {
    Int(i128),
    Float(f64),
    /// Not a number: the scalar as written (a string or a boolean).
    Other(String),
}

impl<'de> Deserialize<'de> for Num {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct NumVisitor;
        impl Visitor<'_> for NumVisitor {
            type Value = Num;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_i64<E>(self, v: i64) -> Result<Num, E> {
                Ok(Num::Int(v.into()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Num, E> {
                Ok(Num::Int(v.into()))
            }
            fn visit_i128<E>(self, v: i128) -> Result<Num, E> {
                Ok(Num::Int(v))
            }
            fn visit_u128<E>(self, v: u128) -> Result<Num, E> {
                Ok(i128::try_from(v).map_or(Num::Float(v as f64), Num::Int))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Num, E> {
                Ok(Num::Float(v))
            }
            fn visit_bool<E>(self, v: bool) -> Result<Num, E> {
                Ok(Num::Other(v.to_string()))
            }
            fn visit_str<E>(self, v: &str) -> Result<Num, E> {
                Ok(Num::Other(format!("{v:?}")))
            }
        }
        deserializer.deserialize_any(NumVisitor)
    }
}

impl fmt::Display for Num {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Num::Int(i) => write!(f, "{i}"),
            Num::Float(x) => write!(f, "{x}"),
            Num::Other(text) => f.write_str(text),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicy {
    pub(super) store: Option<S<String>>,
    pub(super) listen: Option<S<String>>,
    pub(super) request_classes: Option<SpannedMap<S<RawClass>>>,
    pub(super) shared_scope: Option<S<RawSharedScope>>,
    pub(super) backoff: Option<S<RawBackoff>>,
    pub(super) breaker: Option<S<RawBreaker>>,
    pub(super) retry_quota: Option<S<RawRetryQuota>>,
    pub(super) agents: Option<SpannedMap<S<RawPrincipal>>>,
    pub(super) operators: Option<SpannedMap<S<RawPrincipal>>>,
    pub(super) providers: Option<SpannedMap<S<RawProvider>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawClass {
    pub(super) max_attempts: Option<S<Num>>,
    pub(super) max_wait_seconds: Option<S<Num>>,
    pub(super) retry_statuses: Option<S<Vec<S<Num>>>>,
    pub(super) side_effect: Option<S<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSharedScope {
    pub(super) max_delayed_requests: Option<S<Num>>,
    pub(super) max_concurrent_requests: Option<S<Num>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBackoff {
    pub(super) base_seconds: Option<S<Num>>,
    pub(super) max_seconds: Option<S<Num>>,
    pub(super) min_delay_seconds: Option<S<Num>>,
    pub(super) retry_after_ceiling_seconds: Option<S<Num>>,
    pub(super) boundary_spread_seconds: Option<S<Num>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBreaker {
    pub(super) threshold: Option<S<Num>>,
    pub(super) forget_after_seconds: Option<S<Num>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRetryQuota {
    pub(super) capacity: Option<S<Num>>,
    pub(super) retry_cost: Option<S<Num>>,
    pub(super) timeout_cost: Option<S<Num>>,
    pub(super) success_refund: Option<S<Num>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPrincipal {
    pub(super) token_env: Option<S<String>>,
    pub(super) token_file: Option<S<String>>,
    pub(super) token_sha256: Option<S<String>>,
    pub(super) token: Trap,
    pub(super) secret: Trap,
    pub(super) password: Trap,
    pub(super) api_key: Trap,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCredential {
    pub(super) secret_env: Option<S<String>>,
    pub(super) secret_file: Option<S<String>>,
    pub(super) header: Option<S<String>>,
    pub(super) scheme: Option<S<String>>,
    pub(super) secret: Trap,
    pub(super) value: Trap,
    pub(super) token: Trap,
    pub(super) api_key: Trap,
    pub(super) password: Trap,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawProvider {
    pub(super) base_url: Option<S<String>>,
    pub(super) credential: Option<S<RawCredential>>,
    pub(super) dialect: Option<S<String>>,
    pub(super) idempotency_header: Option<S<String>>,
    pub(super) idempotent_put_delete: Option<S<bool>>,
    pub(super) error_code_pointer: Option<S<String>>,
    pub(super) error_codes: Option<SpannedMap<S<String>>>,
    pub(super) retry_delay_pointers: Option<S<Vec<S<String>>>>,
    pub(super) quota_id_pointers: Option<S<Vec<S<String>>>>,
    pub(super) resets_in_seconds_pointers: Option<S<Vec<S<String>>>>,
    pub(super) honour_hints: Option<S<bool>>,
    pub(super) scopes: Option<SpannedMap<S<RawScope>>>,
    pub(super) default_scopes: Option<S<Vec<S<String>>>>,
    pub(super) routes: Option<SpannedMap<S<RawRoute>>>,
    pub(super) secret: Trap,
    pub(super) token: Trap,
    pub(super) api_key: Trap,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawScope {
    pub(super) limit: Option<S<Num>>,
    pub(super) window_seconds: Option<S<Num>>,
    pub(super) headroom: Option<S<Num>>,
    pub(super) reserve_interactive: Option<S<Num>>,
    pub(super) max_delayed_requests: Option<S<Num>>,
    pub(super) max_concurrent_requests: Option<S<Num>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    pub(super) class: Option<S<String>>,
    pub(super) scopes: Option<S<Vec<S<String>>>>,
    pub(super) coalesce: Option<S<bool>>,
    pub(super) fingerprint_fields: Option<S<Vec<S<String>>>>,
    pub(super) reconcile: Option<S<RawReconcile>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawReconcile {
    pub(super) by: Option<S<String>>,
    pub(super) lookup: Option<S<String>>,
    pub(super) external_reference_pointer: Option<S<String>>,
    pub(super) found_pointer: Option<S<String>>,
    pub(super) operation_id_pointer: Option<S<String>>,
}
