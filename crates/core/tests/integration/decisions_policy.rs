//! Policy file loading and validation (SPEC §3).

use backstop_core::policy::{Policy, PolicyError, ReconcileBy, TokenRef};
use backstop_core::quota::Dialect;

const SEED: &str = "\
request_classes:
  read:             { max_attempts: 4, max_wait_seconds: 90,  retry_statuses: [408, 429, 500, 502, 503, 504] }
  idempotent_write: { max_attempts: 3, max_wait_seconds: 120, retry_statuses: [408, 429, 502, 503, 504] }
  uncertain_write:  { max_attempts: 1, max_wait_seconds: 0,   retry_statuses: [] }
shared_scope:
  max_delayed_requests: 25
  max_concurrent_requests: 2
";

fn errors(src: &str) -> Vec<PolicyError> {
    match Policy::from_yaml_str(src, "p.yaml") {
        Ok(_) => panic!("expected the policy to be rejected:\n{src}"),
        Err(e) => e.0,
    }
}

/// The single error of `src`, as `(line, column, message)`.
fn one_error(src: &str) -> (u64, u64, String) {
    let errors = errors(src);
    assert_eq!(
        errors.len(),
        1,
        "expected exactly one error, got {errors:#?}"
    );
    let e = &errors[0];
    (e.line, e.column, e.message.clone())
}

#[test]
fn seed_fragment_loads_unchanged() {
    let policy = Policy::from_yaml_str(SEED, "seed.yaml").expect("the seed must load");
    let read = &policy.request_classes["read"];
    assert_eq!(read.max_attempts, 4);
    assert_eq!(read.max_wait.as_secs(), 90);
    assert_eq!(read.retry_statuses, vec![408, 429, 500, 502, 503, 504]);
    let write = &policy.request_classes["idempotent_write"];
    assert_eq!((write.max_attempts, write.max_wait.as_secs()), (3, 120));
    assert_eq!(write.retry_statuses, vec![408, 429, 502, 503, 504]);
    let uncertain = &policy.request_classes["uncertain_write"];
    assert_eq!(uncertain.max_attempts, 1);
    assert!(uncertain.max_wait.is_zero());
    assert!(uncertain.retry_statuses.is_empty());
    assert_eq!(policy.shared_scope.max_delayed_requests, 25);
    assert_eq!(policy.shared_scope.max_concurrent_requests, 2);
    // Defaults for everything the seed leaves out.
    assert_eq!(policy.backoff.base.as_secs(), 1);
    assert_eq!(policy.backoff.max.as_secs(), 60);
    assert_eq!(policy.backoff.min_delay.as_secs(), 1);
    assert_eq!(policy.backoff.retry_after_ceiling.as_secs(), 86_400);
    assert_eq!(policy.breaker.threshold, 3);
    assert_eq!(policy.breaker.forget_after.as_secs(), 86_400);
    assert_eq!(policy.retry_quota.capacity, 500);
    assert_eq!(policy.retry_quota.retry_cost, 5);
    assert_eq!(policy.retry_quota.timeout_cost, 10);
    assert_eq!(policy.retry_quota.success_refund, 1);
}

#[test]
fn shipped_example_is_valid() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/backstop.yaml");
    let policy = Policy::load(path).unwrap_or_else(|e| panic!("{e}"));
    let billing = &policy.providers["billing-api"];
    assert_eq!(
        billing.idempotency_header.as_deref(),
        Some("Idempotency-Key")
    );
    let transfers = billing
        .routes
        .iter()
        .find(|r| r.template == "/v1/transfers" && r.method == "POST")
        .expect("transfer route");
    let reconcile = transfers.reconcile.as_ref().expect("reconcile");
    assert_eq!(reconcile.by, ReconcileBy::ExternalReference);
    assert_eq!(reconcile.lookup_path, "/v1/transfers?reference={ref}");
    assert_eq!(
        transfers.scopes,
        vec!["billing-api/account", "billing-api/transfers"]
    );
    assert_eq!(policy.providers["openai"].dialect, Dialect::Openai);
    assert_eq!(
        policy.agents["invoice-agent"],
        TokenRef::Env("BACKSTOP_AGENT_INVOICE_TOKEN".into())
    );
    assert!(policy.request_classes.contains_key("batch_read"));
}

const PROVIDER: &str = "\
providers:
  shop:
    base_url: https://shop.example.com
    PROVIDER_EXTRA
    scopes:
      account: { limit: 100, window_seconds: 60 }
    routes:
      \"GET /v1/orders/{id}\": { class: read }
      \"POST /v1/orders/{order_id}/refunds\": { class: uncertain_write, scopes: [account] }
      \"GET /v1/exports\": { class: read, coalesce: true }
";

fn provider(extra: &str) -> Policy {
    let src = PROVIDER.replace("PROVIDER_EXTRA", extra);
    Policy::from_yaml_str(&src, "p.yaml").unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn default_classes_by_method() {
    // (provider config, method, expected class)
    let table = [
        ("dialect: generic", "GET", "read"),
        ("dialect: generic", "HEAD", "read"),
        ("dialect: generic", "OPTIONS", "read"),
        ("dialect: generic", "PUT", "uncertain_write"),
        ("dialect: generic", "DELETE", "uncertain_write"),
        ("idempotent_put_delete: true", "PUT", "idempotent_write"),
        ("idempotent_put_delete: true", "DELETE", "idempotent_write"),
        ("idempotent_put_delete: true", "POST", "uncertain_write"),
        ("dialect: generic", "POST", "uncertain_write"),
        ("dialect: generic", "PATCH", "uncertain_write"),
        (
            "idempotency_header: Idempotency-Key",
            "POST",
            "idempotent_write",
        ),
        (
            "idempotency_header: Idempotency-Key",
            "PATCH",
            "idempotent_write",
        ),
        (
            "idempotency_header: Idempotency-Key",
            "PUT",
            "uncertain_write",
        ),
        ("idempotency_header: Idempotency-Key", "GET", "read"),
    ];
    for (extra, method, expected) in table {
        let policy = provider(extra);
        let m = policy
            .route("shop", method, "/v2/carts/123/items")
            .expect("known provider");
        assert!(!m.configured);
        assert_eq!(m.class, expected, "{extra} / {method}");
        assert_eq!(m.template, "/v2/carts/{id}/items");
        assert_eq!(m.scopes, vec!["shop/account"]);
    }
}

#[test]
fn configured_routes_match_templates() {
    let policy = provider("dialect: generic");
    let m = policy
        .route("shop", "get", "/v1/orders/ord_123?expand=items")
        .expect("known provider");
    assert!(m.configured);
    assert_eq!(m.template, "/v1/orders/{id}");
    assert_eq!(m.params["id"], "ord_123");
    assert_eq!(m.class, "read");
    let m = policy
        .route("shop", "POST", "/v1/orders/77/refunds")
        .expect("known provider");
    assert_eq!(
        (m.class.as_str(), m.template.as_str()),
        ("uncertain_write", "/v1/orders/{order_id}/refunds")
    );
    assert!(
        policy
            .route("shop", "GET", "/v1/exports")
            .expect("known")
            .coalesce
    );
    assert!(policy.route("nope", "GET", "/").is_err());
}

#[test]
fn yaml_syntax_error_has_position() {
    let (line, column, message) = one_error("request_classes:\n  read: {max_attempts: 4\n");
    assert_eq!((line, column), (2, 9));
    assert!(message.contains("unclosed"), "{message}");
}

#[test]
fn unknown_key_is_rejected_with_position() {
    let (line, column, message) = one_error(&format!("{SEED}backof:\n  base_seconds: 2\n"));
    assert_eq!((line, column), (8, 1));
    assert!(message.contains("unknown field `backof`"), "{message}");

    let (line, column, message) = one_error(
        "providers:\n  a:\n    base_url: https://a.example\n    scopes:\n      s: { limit: 5, windw_seconds: 1 }\n",
    );
    assert_eq!(line, 5);
    assert!(column > 10);
    assert!(message.contains("windw_seconds"), "{message}");
}

#[test]
fn wrong_type_is_rejected_with_position() {
    let (line, column, message) = one_error("request_classes:\n  read:\n    max_attempts: four\n");
    assert_eq!((line, column), (3, 19));
    assert!(
        message.contains("u32") || message.contains("integer"),
        "{message}"
    );
}

#[test]
fn bad_route_templates_are_rejected() {
    let src = "\
providers:
  a:
    base_url: https://a.example
    routes:
      \"GET v1/items\": { class: read }
      \"FETCH /v1/items\": { class: read }
      \"get /v1/items\": { class: read }
      \"GET /v1/items/{id\": { class: read }
      \"GET /v1/{a}/{a}\": { class: read }
      \"GET /v1//x\": { class: read }
      \"GET /v1/items?x=1\": { class: read }
";
    let errors = errors(src);
    let lines: Vec<u64> = errors.iter().map(|e| e.line).collect();
    // Every key is malformed (FETCH is an extension token backstop does not route).
    assert_eq!(lines, vec![5, 6, 7, 8, 9, 10, 11], "{errors:#?}");
    assert!(errors.iter().all(|e| e.column == 7));
    assert!(errors[0].message.contains("must start with `/`"));
    assert!(errors[1]
        .message
        .contains("`FETCH` is not a method backstop routes"));
    assert!(errors[2]
        .message
        .contains("upper-case HTTP method: write `GET`"));
    assert!(errors[3].message.contains("braces"));
    assert!(errors[4].message.contains("twice"));
}

#[test]
fn route_methods_are_the_seven_backstop_routes() {
    let src = "\
providers:
  a:
    base_url: https://a.example
    routes:
      \"FOO /v1/items\": { class: read }
      \"TRACE /v1/items\": { class: read }
      \"CONNECT /v1/items\": { class: read }
";
    let errors = errors(src);
    let places: Vec<(u64, u64)> = errors.iter().map(|e| (e.line, e.column)).collect();
    assert_eq!(places, vec![(5, 7), (6, 7), (7, 7)], "{errors:#?}");
    assert_eq!(
        errors[0].message,
        "providers.a.routes.\"FOO /v1/items\": `FOO` is not a method backstop routes (one of: GET, HEAD, OPTIONS, POST, PUT, PATCH, DELETE)"
    );
    let mut routes = String::new();
    for method in ["GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE"] {
        routes.push_str(&format!(
            "      \"{method} /v1/items\": {{ class: uncertain_write }}\n"
        ));
    }
    let src = format!("providers:\n  a:\n    base_url: https://a.example\n    routes:\n{routes}");
    assert!(
        Policy::from_yaml_str(&src, "p.yaml").is_ok(),
        "the seven methods are accepted"
    );
}

#[test]
fn unknown_class_and_scope_references_are_all_reported() {
    let src = "\
providers:
  a:
    base_url: https://a.example
    scopes:
      account: { limit: 10 }
    routes:
      \"GET /v1/items\": { class: reed, scopes: [account] }
      \"POST /v1/items\": { class: uncertain_write, scopes: [acount] }
";
    let errors = errors(src);
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert_eq!((errors[0].line, errors[0].column), (7, 33));
    assert!(errors[0].message.contains("unknown request class `reed`"));
    assert_eq!(errors[1].line, 8);
    assert!(errors[1].message.contains("unknown scope `acount`"));
    assert!(errors[1].message.contains("account"));
}

#[test]
fn literal_secrets_are_rejected_without_echoing_them() {
    let src = "\
agents:
  bot: { token: s3cr3t-agent-token }
providers:
  a:
    base_url: https://user:hunter2@a.example
    credential:
      secret: sk-live-abcdef
";
    let errors = errors(src);
    assert_eq!(errors.len(), 3, "{errors:#?}");
    assert_eq!((errors[0].line, errors[0].column), (2, 17));
    assert!(errors.iter().all(|e| e.message.contains("literal secret")));
    let all = errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    for secret in ["s3cr3t-agent-token", "hunter2", "sk-live-abcdef"] {
        assert!(!all.contains(secret), "error output leaks {secret}: {all}");
    }
}

#[test]
fn out_of_range_values_are_all_reported_in_file_order() {
    let src = "\
request_classes:
  read: { max_attempts: 0 }
breaker:
  threshold: 0
providers:
  a:
    base_url: ftp://a.example
    dialect: klingon
    scopes:
      s: { limit: 10, headroom: 1.5, reserve_interactive: 1 }
";
    let errors = errors(src);
    let positions: Vec<(u64, u64)> = errors.iter().map(|e| (e.line, e.column)).collect();
    assert_eq!(
        positions,
        vec![(2, 25), (4, 14), (7, 15), (8, 14), (10, 33), (10, 59)],
        "{errors:#?}"
    );
    assert!(errors[4].message.contains("headroom: must be in (0, 1]"));
    let shown = errors[0].to_string();
    assert_eq!(
        shown,
        "p.yaml:2:25: request_classes.read.max_attempts: must be at least 1"
    );
}

#[test]
fn reconcile_needs_a_lookup_with_its_placeholder() {
    let src = "\
providers:
  a:
    base_url: https://a.example
    routes:
      \"POST /v1/payments\":
        class: uncertain_write
        reconcile:
          by: external_reference
          lookup: \"GET /v1/payments?reference={id}\"
          external_reference_pointer: /reference
      \"POST /v1/refunds\":
        reconcile:
          by: idempotency_key
          lookup: \"GET /v1/refunds?key={key}\"
";
    let errors = errors(src);
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert_eq!(errors[0].line, 9);
    assert!(errors[0].message.contains("{ref}"));
    assert_eq!(errors[1].line, 13);
    assert!(errors[1].message.contains("idempotency_header"));
}

#[test]
fn missing_file_is_an_error_without_position() {
    let e = Policy::load("/nonexistent/backstop.yaml").expect_err("no file");
    assert_eq!(e.0.len(), 1);
    assert_eq!(e.0[0].line, 0);
    assert!(e
        .to_string()
        .starts_with("/nonexistent/backstop.yaml: cannot read"));
}

#[test]
fn unrepresentable_pacing_is_rejected() {
    let (line, column, message) = one_error(
        "providers:\n  a:\n    base_url: https://a.example\n    scopes:\n      s: { limit: 1, window_seconds: 4.0e9, headroom: 1.0e-10 }\n",
    );
    assert_eq!((line, column), (5, 19));
    assert!(
        message.contains("not a representable interval"),
        "{message}"
    );
}

#[test]
fn classify_rules_come_from_class_provider_and_backoff() {
    use backstop_core::classify::{classify, Disposition, Observed, ResponseView};

    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/backstop.yaml");
    let policy = Policy::load(path).unwrap_or_else(|e| panic!("{e}"));
    let read = &policy.request_classes["read"];
    let rules = policy
        .classify_rules("billing-api", read)
        .expect("provider");
    assert_eq!(rules.retry_statuses, vec![408, 429, 500, 502, 503, 504]);
    assert_eq!(rules.error_code_pointer.as_deref(), Some("/error/code"));
    assert_eq!(
        rules.error_codes["daily_limit_reached"],
        Disposition::QuotaExhausted
    );
    assert_eq!(rules.dialect, Dialect::Ietf);
    assert_eq!(rules.retry_after.ceiling.as_secs(), 86_400);
    assert!(policy.classify_rules("nope", read).is_err());

    // The provider's code mapping decides the disposition of a real response.
    let headers = http::HeaderMap::new();
    let body = br#"{"error": {"code": "daily_limit_reached"}}"#;
    let now: jiff::Timestamp = "2026-03-01T12:00:00Z".parse().expect("timestamp");
    let signal = classify(
        &Observed::Response(ResponseView {
            status: 429,
            headers: &headers,
            body: Some(body),
        }),
        &rules,
        now,
    );
    // Without the mapping a 429 is `rate_limited`; the provider says this one is a daily quota.
    assert_eq!(signal.disposition, Disposition::QuotaExhausted);
    assert_eq!(signal.error_code.as_deref(), Some("daily_limit_reached"));
}

#[test]
fn idempotent_write_post_without_an_idempotency_header_is_an_error() {
    let src = "\
agents:
  bot: { token_env: BOT_TOKEN }
providers:
  a:
    base_url: https://a.example
    scopes:
      account: { limit: 10 }
    routes:
      \"POST /v1/items\": { class: idempotent_write }
      \"PATCH /v1/items/{id}\": { class: idempotent_write }
      \"PUT /v1/items/{id}\": { class: idempotent_write }
      \"GET /v1/items\": { class: idempotent_write }
operators:
  ops: { token_env: OPS_TOKEN }
";
    let errors = errors(src);
    let lines: Vec<u64> = errors.iter().map(|e| e.line).collect();
    assert_eq!(lines, vec![9, 10, 11], "{errors:#?}");
    assert_eq!(errors[0].column, 34);
    assert!(errors[0].message.contains("no `idempotency_header`"));
    assert!(errors[0].message.contains("would not be deduplicated"));
    assert!(errors[2].message.contains("idempotent_put_delete"));
    // With the header, the same routes are fine.
    let with_header = src.replace(
        "    scopes:",
        "    idempotency_header: Idempotency-Key\n    scopes:",
    );
    let policy = Policy::from_yaml_str(&with_header, "p.yaml").unwrap_or_else(|e| panic!("{e}"));
    assert!(policy.warnings.is_empty(), "{:?}", policy.warnings);
}

#[test]
fn idempotent_put_delete_without_a_header_is_only_a_warning() {
    let src = "\
agents:
  bot: { token_env: BOT_TOKEN }
providers:
  a:
    base_url: https://a.example
    idempotent_put_delete: true
    scopes:
      account: { limit: 10 }
    routes:
      \"PUT /v1/items/{id}\": { class: idempotent_write }
      \"DELETE /v1/items/{id}\": { class: idempotent_write }
operators:
  ops: { token_env: OPS_TOKEN }
";
    let policy = Policy::from_yaml_str(src, "p.yaml").unwrap_or_else(|e| panic!("{e}"));
    let at: Vec<(u64, u64)> = policy.warnings.iter().map(|w| (w.line, w.column)).collect();
    assert_eq!(at, vec![(10, 38), (11, 41)], "{:#?}", policy.warnings);
    assert!(policy.warnings[0]
        .message
        .contains("idempotent PUT contract"));
}

#[test]
fn no_agents_and_a_provider_without_scopes_are_warnings() {
    let src = "\
providers:
  a:
    base_url: https://a.example
";
    let policy = Policy::from_yaml_str(src, "p.yaml").unwrap_or_else(|e| panic!("{e}"));
    let warnings: Vec<(u64, u64, &str)> = policy
        .warnings
        .iter()
        .map(|w| (w.line, w.column, w.message.as_str()))
        .collect();
    assert_eq!(warnings.len(), 3, "{warnings:#?}");
    assert_eq!((warnings[0].0, warnings[0].1), (1, 1));
    assert!(warnings[0].2.contains("no agent can call the gateway"));
    // Every way an agent's token can be given is named.
    assert!(
        warnings[0]
            .2
            .ends_with("(add `agents:` with a token_env, token_file or token_sha256 per agent)"),
        "{}",
        warnings[0].2
    );
    // Calls can be escalated, and no operator could decide them.
    assert_eq!((warnings[1].0, warnings[1].1), (1, 1));
    assert!(
        warnings[1].2.starts_with(
            "operators: none configured, but calls through these providers can be escalated"
        ),
        "{}",
        warnings[1].2
    );
    assert_eq!((warnings[2].0, warnings[2].1), (2, 3));
    assert!(warnings[2].2.starts_with("providers.a: no scopes"));
}

#[test]
fn a_class_says_whether_it_has_a_side_effect() {
    use backstop_core::side_effect::SideEffect;
    let policy = Policy::from_yaml_str(
        "request_classes:\n  chat: { max_attempts: 2, max_wait_seconds: 30, side_effect: none }\n  post: { max_attempts: 1, max_wait_seconds: 0 }\n",
        "p.yaml",
    )
    .expect("loads");
    assert_eq!(policy.request_classes["chat"].side_effect, SideEffect::None);
    assert_eq!(
        policy.request_classes["post"].side_effect,
        SideEffect::Write
    );
    assert_eq!(policy.request_classes["read"].side_effect, SideEffect::None);
    assert_eq!(
        policy.request_classes["llm_call"].side_effect,
        SideEffect::None
    );
    assert_eq!(
        policy.request_classes["uncertain_write"].side_effect,
        SideEffect::Write
    );
    let (line, column, message) = one_error(
        "request_classes:\n  chat: { max_attempts: 2, max_wait_seconds: 30, side_effect: maybe }\n",
    );
    assert_eq!((line, column), (2, 63), "{message}");
    assert!(
        message.contains(
            "request_classes.chat.side_effect: unknown value `maybe` (one of none, write)"
        ),
        "{message}"
    );
}

#[test]
fn completion_routes_of_llm_dialects_are_side_effect_free_unless_listed() {
    use backstop_core::side_effect::SideEffect;
    let src = "\
providers:
  openai:
    base_url: https://api.openai.com
    dialect: openai
    routes:
      \"POST /v1/embeddings\": { class: uncertain_write }
  anthropic:
    base_url: https://api.anthropic.com
    dialect: anthropic
  plain:
    base_url: https://plain.example.com
";
    let policy = Policy::from_yaml_str(src, "p.yaml").expect("loads");
    let chat = policy
        .route("openai", "POST", "/v1/chat/completions?x=1")
        .unwrap();
    assert_eq!(
        (chat.class.as_str(), chat.side_effect),
        ("llm_call", SideEffect::None)
    );
    let messages = policy.route("anthropic", "POST", "/v1/messages").unwrap();
    assert_eq!(
        (messages.class.as_str(), messages.side_effect),
        ("llm_call", SideEffect::None)
    );
    // The policy's own route wins.
    let embeddings = policy.route("openai", "POST", "/v1/embeddings").unwrap();
    assert_eq!(
        (embeddings.class.as_str(), embeddings.side_effect),
        ("uncertain_write", SideEffect::Write)
    );
    // A provider of another dialect keeps the SPEC §3 default.
    let plain = policy
        .route("plain", "POST", "/v1/chat/completions")
        .unwrap();
    assert_eq!(
        (plain.class.as_str(), plain.side_effect),
        ("uncertain_write", SideEffect::Write)
    );
    // Files and stored responses change state.
    let files = policy.route("openai", "POST", "/v1/files").unwrap();
    assert_eq!(files.side_effect, SideEffect::Write);
}
