//! Questions asked of a validated policy at run time: the route, class and scopes of a request,
//! and the rules to classify a provider's answer.

use std::collections::BTreeMap;

use serde::Serialize;

use super::classes::RequestClass;
use super::document::Policy;
use super::providers::Provider;
use super::reconcile::Reconcile;
use super::routes::{default_class, Route};
use super::scopes::Scope;
use super::templates::{match_segments, path_segments, template_for_path, Segment};
use crate::classify::{default_error_codes, ClassifyRules};
use crate::retry_after::RetryAfterOptions;
use crate::side_effect::{completion_route, SideEffect, COMPLETION_CLASS};

/// The answer of [`Policy::route`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RouteMatch {
    /// The provider.
    pub provider: String,
    /// Upper-case method.
    pub method: String,
    /// The route template: the configured one, or the path with ids replaced by `{id}`.
    pub template: String,
    /// Request class name.
    pub class: String,
    /// The class's `side_effect` (SPEC §4.2a): `none` makes a `POST` of this route run like a
    /// read.
    pub side_effect: SideEffect,
    /// Full scope names (`provider/scope`).
    pub scopes: Vec<String>,
    /// Whether the route coalesces identical in-flight reads.
    pub coalesce: bool,
    /// Stable payload fields for the fingerprint.
    pub fingerprint_fields: Vec<String>,
    /// Reconciliation lookup, if configured.
    pub reconcile: Option<Reconcile>,
    /// Template parameters bound by the path (configured routes only).
    pub params: BTreeMap<String, String>,
    /// Whether a configured route matched (false: SPEC §3 defaults by method).
    pub configured: bool,
}

/// [`Policy::route`] was asked about a provider the policy does not name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown provider `{0}`")]
pub struct UnknownProvider(pub String);

impl Policy {
    /// Decides route, class and scopes for a request (SPEC §3).
    ///
    /// `path` may carry a query string (ignored). The configured route with the most literal
    /// segments wins; without one, the class follows the method: GET/HEAD/OPTIONS → `read`;
    /// PUT/DELETE → `idempotent_write` only if the provider sets `idempotent_put_delete`, else
    /// `uncertain_write`; POST/PATCH (and any other method) → `idempotent_write` when the provider
    /// has an `idempotency_header`, else `uncertain_write` — except the completion routes of a
    /// provider with `dialect: openai` or `anthropic` (`POST /v1/chat/completions`,
    /// `/v1/messages`, … see [`completion_route`]), which are `llm_call` (`side_effect: none`).
    /// The template of an unmatched path has
    /// its ids (numbers, UUIDs, long hex or opaque tokens) replaced by `{id}` (see
    /// [`template_for_path`]), and its scopes are the provider's `default_scopes`.
    ///
    /// # Errors
    /// [`UnknownProvider`] when the policy has no such provider.
    pub fn route(
        &self,
        provider: &str,
        method: &str,
        path: &str,
    ) -> Result<RouteMatch, UnknownProvider> {
        let p = self.provider(provider)?;
        let method = method.trim().to_ascii_uppercase();
        let path = path.split(['?', '#']).next().unwrap_or("");
        Ok(match best_route(p, &method, path) {
            Some((route, params)) => self.configured_match(provider, method, route, params),
            None => self.default_match(provider, p, method, path),
        })
    }

    /// The provider named `name`.
    fn provider(&self, name: &str) -> Result<&Provider, UnknownProvider> {
        self.providers
            .get(name)
            .ok_or_else(|| UnknownProvider(name.to_owned()))
    }

    /// The answer for a request that `route` of `provider` matched, binding `params`.
    fn configured_match(
        &self,
        provider: &str,
        method: String,
        route: &Route,
        params: BTreeMap<String, String>,
    ) -> RouteMatch {
        RouteMatch {
            provider: provider.to_owned(),
            method,
            template: route.template.clone(),
            side_effect: self.side_effect_of(&route.class),
            class: route.class.clone(),
            scopes: route.scopes.clone(),
            coalesce: route.coalesce,
            fingerprint_fields: route.fingerprint_fields.clone(),
            reconcile: route.reconcile.clone(),
            params,
            configured: true,
        }
    }

    /// The answer for a request to `path` (without query) that no route of `provider` (`p`)
    /// matched: an LLM completion route's class, else the SPEC §3 default class of `method`.
    fn default_match(
        &self,
        provider: &str,
        p: &Provider,
        method: String,
        path: &str,
    ) -> RouteMatch {
        let class = match completion_route(p.dialect, &method, path) {
            Some(_) => COMPLETION_CLASS,
            None => default_class(
                &method,
                p.idempotent_put_delete,
                p.idempotency_header.is_some(),
            ),
        };
        RouteMatch {
            provider: provider.to_owned(),
            side_effect: self.side_effect_of(class),
            class: class.to_owned(),
            method,
            template: template_for_path(path),
            scopes: p.default_scopes.clone(),
            coalesce: false,
            fingerprint_fields: Vec::new(),
            reconcile: None,
            params: BTreeMap::new(),
            configured: false,
        }
    }

    /// The rules to classify a response of `provider` for a request of `class` (SPEC §2):
    /// the class's `retry_statuses`; the provider's error-code pointer, its `error_codes` over
    /// [`default_error_codes`], hint policy, dialect and body pointers; and the Retry-After
    /// limits of `backoff` (`min_delay_seconds`, `retry_after_ceiling_seconds`).
    ///
    /// # Errors
    /// [`UnknownProvider`] when the policy has no such provider.
    pub fn classify_rules(
        &self,
        provider: &str,
        class: &RequestClass,
    ) -> Result<ClassifyRules, UnknownProvider> {
        let p = self.provider(provider)?;
        let mut error_codes = default_error_codes();
        error_codes.extend(p.error_codes.iter().map(|(k, v)| (k.clone(), *v)));
        Ok(ClassifyRules {
            retry_statuses: class.retry_statuses.clone(),
            error_code_pointer: p.error_code_pointer.clone(),
            error_codes,
            honour_hints: p.honour_hints,
            dialect: p.dialect,
            retry_after: RetryAfterOptions {
                min_delay: self.backoff.min_delay,
                ceiling: self.backoff.retry_after_ceiling,
            },
            retry_delay_pointers: p.retry_delay_pointers.clone(),
            quota_id_pointers: p.quota_id_pointers.clone(),
            resets_in_seconds_pointers: p.resets_in_seconds_pointers.clone(),
        })
    }

    /// The `side_effect` of class `class` ([`SideEffect::Write`] for a class the policy does
    /// not hold, which validation never lets a route name).
    pub fn side_effect_of(&self, class: &str) -> SideEffect {
        self.request_classes
            .get(class)
            .map_or(SideEffect::Write, |c| c.side_effect)
    }

    /// Every scope of every provider, by full name.
    pub fn scopes(&self) -> impl Iterator<Item = &Scope> {
        self.providers.values().flat_map(|p| p.scopes.values())
    }
}

/// The route of `p` for `method` (upper case) that matches `path` (without query) with the most
/// literal segments (the first of those in file order), with the parameters it binds.
fn best_route<'a>(
    p: &'a Provider,
    method: &str,
    path: &str,
) -> Option<(&'a Route, BTreeMap<String, String>)> {
    let segments = path_segments(path);
    let mut best: Option<(&Route, usize, BTreeMap<String, String>)> = None;
    for route in p.routes.iter().filter(|r| r.method == method) {
        if let Some(params) = match_segments(&route.segments, &segments) {
            let literals = route
                .segments
                .iter()
                .filter(|s| matches!(s, Segment::Literal(_)))
                .count();
            if best.as_ref().is_none_or(|(_, l, _)| literals > *l) {
                best = Some((route, literals, params));
            }
        }
    }
    best.map(|(route, _, params)| (route, params))
}
