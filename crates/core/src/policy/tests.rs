use std::time::Duration;

use super::raw::REFUSED_SECRET_KEYS;
use super::*;
use crate::pacing::MIN_WINDOW;

/// Every error of `src` as `LINE:COL: message`.
fn problems(src: &str) -> Vec<String> {
    Policy::from_yaml_str(src, "p.yaml")
        .expect_err("the policy is refused")
        .0
        .iter()
        .map(|e| format!("{}:{}: {}", e.line, e.column, e.message))
        .collect()
}

#[test]
fn an_explicit_yaml_tag_is_refused_with_its_line_and_column_never_ignored() {
    for (src, at, tag) in [
        ("store: !include /etc/passwd\n", "1:8", "!include"),
        (
            "providers: {}\nstore: !!binary aGVsbG8=\n",
            "2:8",
            "!!binary",
        ),
        ("agents:\n  a: { token_env: !env X }\n", "2:19", "!env"),
        ("store: !!str x.db\n", "1:8", "!!str"),
        ("agents: !!map { a: { token_env: X } }\n", "1:9", "!!map"),
    ] {
        let got = problems(src);
        assert_eq!(got.len(), 1, "{src}: {got:?}");
        assert!(
            got[0].starts_with(&format!("{at}: the YAML tag `{tag}`")),
            "{src}: {got:?}"
        );
    }
    // Every tag is named, not only the first.
    let got = problems("store: !a x\nlisten: !b y\n");
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got[1].starts_with("2:9: the YAML tag `!b`"), "{got:?}");
}

#[test]
fn a_route_with_an_unknown_class_still_has_its_scopes_checked_in_the_same_run() {
    let errors = problems(
            "providers:\n  fake:\n    base_url: http://127.0.0.1:1\n    scopes:\n      account: { limit: 10, window_seconds: 60 }\n    routes:\n      \"GET /v1/x\": { class: reed, scopes: [acount] }\n",
        );
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors[0].contains("unknown request class `reed`"),
        "{errors:?}"
    );
    assert!(errors[1].contains("unknown scope `acount`"), "{errors:?}");
}

#[test]
fn a_wrong_type_names_the_key_path_and_keeps_the_position() {
    let provider = "providers:\n  fake:\n    base_url: http://127.0.0.1:1\n    routes:\n";
    let errors = problems(&format!(
        "{provider}      \"GET /v1/x\": {{ class: read, coalesce: maybe }}\n"
    ));
    assert_eq!(
        errors,
        ["5:45: providers.fake.routes.\"GET /v1/x\".coalesce: invalid boolean"]
    );
    // Sequence items by index, names chosen in the file as written, at any depth.
    let errors = problems(&format!(
        "{provider}      \"GET /v1/x\": {{ class: read, scopes: [a, [b]] }}\n"
    ));
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].starts_with("5:47: providers.fake.routes.\"GET /v1/x\".scopes[1]: "),
        "{errors:?}"
    );
    let errors = problems("providers:\n  fake:\n    idempotent_put_delete: sure\n");
    assert!(
        errors[0].starts_with("3:28: providers.fake.idempotent_put_delete: "),
        "{errors:?}"
    );
    let errors = problems("request_classes:\n  bulk: [1]\n");
    assert!(
        errors[0].starts_with("2:9: request_classes.bulk: "),
        "{errors:?}"
    );
    // An error about the document as a whole has no key path to name.
    let errors = problems("- 1\n");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].starts_with("1:1: "), "{errors:?}");
    assert!(!errors[0].starts_with("1:1: :"), "{errors:?}");
}

#[test]
fn a_number_that_is_not_finite_names_its_key_path() {
    for (src, at) in [
            ("backoff:\n  base_seconds: .nan\n", "2:17: backoff.base_seconds"),
            ("breaker:\n  threshold: .NaN\n", "2:14: breaker.threshold"),
            (
                "request_classes:\n  read: { retry_statuses: [429, .nan] }\n",
                "2:33: request_classes.read.retry_statuses[1]",
            ),
            (
                "providers:\n  p:\n    base_url: https://p.example\n    scopes:\n      s: { limit: 10, window_seconds: 60, headroom: .nan }\n",
                "5:53: providers.p.scopes.s.headroom",
            ),
        ] {
            let errors = problems(src);
            assert_eq!(errors.len(), 1, "{src}: {errors:?}");
            assert!(
                errors[0].starts_with(&format!("{at}: value `.")),
                "{src}: {errors:?}"
            );
            assert!(errors[0].ends_with("is not a finite number"), "{src}: {errors:?}");
        }
}

#[test]
fn alias_error_message_is_complete_and_has_no_inline_position() {
    let errors = problems("backoff: &b\n  base_seconds: 1\nbreaker: *b\n");
    assert_eq!(errors.len(), 1, "{errors:?}");
    let e = &errors[0];
    assert!(
        e.starts_with(
            "3:10: breaker.base_seconds: unknown field `base_seconds`, expected one of threshold"
        ),
        "{e}"
    );
    assert!(
        e.ends_with("(the value comes from the anchor at 2:3)"),
        "{e}"
    );
    assert!(!e.contains(" at line "), "{e}");
    assert!(!e.contains("(used"), "{e}");
}

#[test]
fn duplicate_key_message_names_the_key_without_library_advice() {
    let errors = problems("backoff:\n  base_seconds: 1\n  base_seconds: 2\n");
    assert_eq!(
        errors,
        ["3:3: duplicate key `base_seconds` (each key may appear once per mapping)"]
    );
}

#[test]
fn empty_or_comment_only_policy_is_refused() {
    for src in ["", "\n\n", "# only a comment\n  # another\n", "\u{feff}"] {
        let errors = problems(src);
        assert_eq!(errors.len(), 1, "{src:?}: {errors:?}");
        assert!(
            errors[0].contains("empty policy file"),
            "{src:?}: {errors:?}"
        );
    }
}

#[test]
fn non_utf8_policy_file_names_line_and_offset() {
    let dir = std::env::temp_dir().join(format!("backstop-policy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("latin1.yaml");
    std::fs::write(&path, b"breaker:\n  threshold: 3\n# caf\xe9\n").expect("write");
    let errors = Policy::load(&path).expect_err("refused").0;
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(errors.len(), 1);
    assert_eq!((errors[0].line, errors[0].column), (3, 6));
    assert_eq!(
        errors[0].message,
        "not UTF-8 (invalid byte at offset 29); a policy file is UTF-8 text"
    );
}

#[test]
fn wrong_number_types_name_the_field() {
    assert_eq!(
        problems("breaker:\n  threshold: -3\n"),
        ["2:14: breaker.threshold: expected a non-negative integer, got -3"]
    );
    assert_eq!(
        problems("breaker:\n  threshold: 2.5\n"),
        ["2:14: breaker.threshold: expected a non-negative integer, got 2.5"]
    );
    assert_eq!(
        problems("backoff:\n  base_seconds: one\n"),
        ["2:17: backoff.base_seconds: expected a finite number, got \"one\""]
    );
}

#[test]
fn backoff_base_and_min_delay_are_at_least_a_tenth_of_a_second() {
    let base = |got: &str| {
        format!(
            "2:17: backoff.base_seconds: must be at least 0.1 seconds, got {got} (the first \
                 retry waits at most twice the base, so a smaller one retries a failing request \
                 within milliseconds, a tight retry loop)"
        )
    };
    let floor = |got: &str| {
        format!(
            "2:22: backoff.min_delay_seconds: must be at least 0.1 seconds, got {got} (it is \
                 the shortest wait after a Retry-After of 0 or a reset already past, so a \
                 smaller one retries a throttled request within milliseconds, a tight retry loop)"
        )
    };
    for got in ["0", "1e-9", "0.099"] {
        assert_eq!(
            problems(&format!("backoff:\n  base_seconds: {got}\n")),
            [base(if got == "1e-9" { "0.000000001" } else { got })]
        );
        assert_eq!(
            problems(&format!("backoff:\n  min_delay_seconds: {got}\n")),
            [floor(if got == "1e-9" { "0.000000001" } else { got })]
        );
    }
    let shortest = Policy::from_yaml_str(
        "backoff:\n  base_seconds: 0.1\n  min_delay_seconds: 0.1\n",
        "p.yaml",
    )
    .expect("a tenth of a second is allowed");
    assert_eq!(shortest.backoff.base, MIN_BACKOFF_BASE);
    assert_eq!(shortest.backoff.min_delay, MIN_RETRY_DELAY_FLOOR);
}

#[test]
fn a_scope_window_under_one_second_is_refused_naming_its_place_and_why() {
    let scope = |window: &str| {
        format!(
                "providers:\n  a:\n    base_url: https://a.example\n    scopes:\n      s: {{ limit: 10, window_seconds: {window} }}\n"
            )
    };
    let too_short = |got: &str| {
        format!(
            "5:39: providers.a.scopes.s.window_seconds: must be at least 1 second, got {got} \
                 (providers publish their limit windows in whole seconds; a shorter one, such \
                 as 0.0001, paces so fast that pacing holds nothing back)"
        )
    };
    // One problem each: the pacing is not refused a second time for the same window.
    for (window, shown) in [
        ("0.0001", "0.0001"),
        ("1e-9", "0.000000001"),
        ("0.999", "0.999"),
        ("0", "0"),
    ] {
        assert_eq!(problems(&scope(window)), [too_short(shown)], "{window}");
    }
    assert_eq!(
            problems(&scope("-1")),
            ["5:39: providers.a.scopes.s.window_seconds: must be a non-negative number of seconds, got -1"]
        );
    // Refused by the YAML reader already, at the value's place and naming it.
    assert_eq!(
        problems(&scope(".nan")),
        ["5:39: providers.a.scopes.s.window_seconds: value `.nan` is not a finite number"]
    );
    let errors = problems(&scope("1e12"));
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].starts_with(
            "5:39: providers.a.scopes.s.window_seconds: too large, at most 4294967295 seconds"
        ),
        "{errors:?}"
    );
    let shortest = Policy::from_yaml_str(&scope("1"), "p.yaml").expect("one second is allowed");
    let scope = &shortest.providers["a"].scopes["s"];
    assert_eq!(scope.window, MIN_WINDOW);
    let pacing = scope.pacer_config().expect("paced");
    assert_eq!(pacing.emission_interval, Duration::from_millis(125));
}

#[test]
fn a_boundary_spread_of_zero_loads_with_a_warning_naming_the_burst() {
    let spread = |seconds: &str| {
        Policy::from_yaml_str(
                &format!("agents:\n  bot: {{ token_env: BOT_TOKEN }}\nbackoff:\n  boundary_spread_seconds: {seconds}\n"),
                "p.yaml",
            )
            .expect("the policy loads")
    };
    let off = spread("0");
    assert_eq!(off.backoff.boundary_spread, Duration::ZERO);
    let warnings: Vec<String> = off
        .warnings
        .iter()
        .map(|w| format!("{}:{}: {}", w.line, w.column, w.message))
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
            warnings[0].starts_with("4:28: backoff.boundary_spread_seconds: 0 turns off the jitter after a provider boundary"),
            "{warnings:?}"
        );
    assert!(warnings[0].contains("one burst"), "{warnings:?}");
    for seconds in ["0.5", "5"] {
        assert!(spread(seconds).warnings.is_empty(), "{seconds}");
    }
}

#[test]
fn the_retry_after_ceiling_is_at_least_one_second() {
    let too_small = |got: &str| {
        format!(
            "2:32: backoff.retry_after_ceiling_seconds: must be at least 1 second, got {got} \
                 (providers give Retry-After in whole seconds, so a smaller ceiling treats every \
                 delay of a second or more as absurd: throttled requests are retried on local \
                 backoff alone, before the provider allows it)"
        )
    };
    // Said once, even when the ceiling is also under the Retry-After floor.
    for (ceiling, shown) in [("0.5", "0.5"), ("1e-9", "0.000000001"), ("0", "0")] {
        assert_eq!(
            problems(&format!(
                "backoff:\n  retry_after_ceiling_seconds: {ceiling}\n"
            )),
            [too_small(shown)],
            "{ceiling}"
        );
    }
    let shortest = Policy::from_yaml_str("backoff:\n  retry_after_ceiling_seconds: 1\n", "p.yaml")
        .expect("one second is allowed");
    assert_eq!(
        shortest.backoff.retry_after_ceiling,
        MIN_RETRY_AFTER_CEILING
    );
    // Above one second it is still held to the floor of every boundary.
    assert_eq!(
        problems("backoff:\n  min_delay_seconds: 5\n  retry_after_ceiling_seconds: 2\n"),
        ["3:32: backoff.retry_after_ceiling_seconds: must be at least backoff.min_delay_seconds"]
    );
}

#[test]
fn breaker_forget_after_is_read_defaulted_and_at_least_one_second() {
    let policy = Policy::from_yaml_str(
        "breaker:\n  threshold: 2\n  forget_after_seconds: 3600\n",
        "p.yaml",
    )
    .expect("valid");
    assert_eq!(policy.breaker.threshold, 2);
    assert_eq!(policy.breaker.forget_after, Duration::from_secs(3600));
    let defaulted = Policy::from_yaml_str("breaker:\n  threshold: 2\n", "p.yaml").expect("valid");
    assert_eq!(defaulted.breaker.forget_after, Duration::from_secs(86_400));
    let too_short = |got: &str| {
        format!(
            "2:25: breaker.forget_after_seconds: must be at least 1 second, got {got} (a \
                 breaker forgotten sooner after a failure is forgotten before the same request \
                 can fail again, so its circuit would never open)"
        )
    };
    assert_eq!(
        problems("breaker:\n  forget_after_seconds: 0\n"),
        [too_short("0")]
    );
    assert_eq!(
        problems("breaker:\n  forget_after_seconds: 1e-9\n"),
        [too_short("0.000000001")]
    );
    assert_eq!(
        problems("breaker:\n  forget_after_seconds: 0.999\n"),
        [too_short("0.999")]
    );
    let shortest = Policy::from_yaml_str("breaker:\n  forget_after_seconds: 1\n", "p.yaml")
        .expect("one second is allowed");
    assert_eq!(shortest.breaker.forget_after, MIN_FORGET_AFTER);
    assert_eq!(
        problems("breaker:\n  forget_after_seconds: -5\n"),
        ["2:25: breaker.forget_after_seconds: must be a non-negative number of seconds, got -5"]
    );
    assert_eq!(
        problems("breaker:\n  forget_after_seconds: a day\n"),
        ["2:25: breaker.forget_after_seconds: expected a finite number, got \"a day\""]
    );
}

#[test]
fn an_unknown_key_lists_the_expected_keys_without_the_refused_secret_keys() {
    assert_eq!(
            problems("agents:\n  bot: { tokenenv: X }\n"),
            ["2:10: agents.bot.tokenenv: unknown field `tokenenv`, expected one of token_env, token_file, token_sha256"]
        );
    assert_eq!(
            problems("operators:\n  ops: { tokenfile: X }\n"),
            ["2:10: operators.ops.tokenfile: unknown field `tokenfile`, expected one of token_env, token_file, token_sha256"]
        );
    assert_eq!(
            problems("providers:\n  a:\n    base_url: https://a.example\n    credential: { secret_envv: X }\n"),
            ["4:19: providers.a.credential.secret_envv: unknown field `secret_envv`, expected one of secret_env, secret_file, header, scheme"]
        );
    let provider = problems("providers:\n  a:\n    base_url: https://a.example\n    apikey: 1\n");
    assert_eq!(provider.len(), 1, "{provider:?}");
    assert!(
        provider[0].starts_with(
            "4:5: providers.a.apikey: unknown field `apikey`, expected one of base_url, "
        ) && provider[0].ends_with(", default_scopes, routes"),
        "{provider:?}"
    );
    let (_, listed) = provider[0].split_once("expected one of ").expect("a list");
    assert!(
        !listed.split(", ").any(|k| REFUSED_SECRET_KEYS.contains(&k)),
        "{listed}"
    );
    // The refused keys themselves are still refused with their own message.
    assert_eq!(
            problems("agents:\n  bot: { token: abc }\n"),
            ["2:17: agents.bot.token: literal secret; secrets are referenced, never written into the policy (use token_env, token_file or token_sha256)"]
        );
}

#[test]
fn too_large_numbers_say_too_large_with_the_limit() {
    assert_eq!(
        problems("breaker:\n  threshold: 99999999999\n"),
        ["2:14: breaker.threshold: too large, at most 4294967295, got 99999999999"]
    );
    let errors = problems("backoff:\n  retry_after_ceiling_seconds: 1e300\n");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].starts_with(
            "2:32: backoff.retry_after_ceiling_seconds: too large, at most 4294967295 seconds"
        ),
        "{errors:?}"
    );
}

#[test]
fn retry_quota_cost_is_compared_with_the_files_capacity() {
    assert_eq!(
        problems("retry_quota: {capacity: 0, retry_cost: 1000}\n"),
        ["1:25: retry_quota.capacity: must be at least 1"]
    );
    assert_eq!(
        problems("retry_quota: {capacity: 10, retry_cost: 11}\n"),
        ["1:41: retry_quota.retry_cost: 11 exceeds the capacity 10; no retry could ever be paid"]
    );
}

#[test]
fn uncertain_write_cannot_be_configured_to_retry() {
    let errors =
        problems("request_classes:\n  uncertain_write: {max_attempts: 5, retry_statuses: [500]}\n");
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
            errors[0].starts_with("2:35: request_classes.uncertain_write.max_attempts: must be 1, got 5: an uncertain write is never resent blindly"),
            "{errors:?}"
        );
    assert!(
        errors[1].starts_with(
            "2:54: request_classes.uncertain_write.retry_statuses: must be empty, got [500]"
        ),
        "{errors:?}"
    );
    // The shipped defaults stay valid.
    Policy::from_yaml_str(
        "request_classes:\n  uncertain_write: {max_attempts: 1}\n",
        "p.yaml",
    )
    .expect("one attempt is fine");
}

const PROVIDER: &str = "providers:\n  billing:\n    base_url: https://billing.example\n";

#[test]
fn the_openai_dialect_reads_error_codes_where_openai_documents_them_unless_told_otherwise() {
    let pointer = |extra: &str| {
        let policy = Policy::from_yaml_str(&format!("{PROVIDER}{extra}"), "p.yaml").expect("valid");
        policy.providers["billing"].error_code_pointer.clone()
    };
    assert_eq!(
        pointer("    dialect: openai\n").as_deref(),
        Some("/error/code")
    );
    assert_eq!(
        pointer("    dialect: openai\n    error_code_pointer: /detail/code\n").as_deref(),
        Some("/detail/code")
    );
    for dialect in ["generic", "ietf", "anthropic", "github"] {
        assert_eq!(
            pointer(&format!("    dialect: {dialect}\n")),
            None,
            "{dialect}"
        );
    }
}

#[test]
fn provider_names_shadowed_by_backstop_routes_or_dot_segments_are_refused() {
    for name in ["v1", "METRICS", "metrics", ".", ".."] {
        let src = format!("providers:\n  \"{name}\":\n    base_url: https://p.example\n");
        let errors = problems(&src);
        assert_eq!(errors.len(), 1, "{name}: {errors:?}");
        assert!(
            errors[0].starts_with("2:3: providers."),
            "{name}: {errors:?}"
        );
        assert!(errors[0].contains("rename the provider"), "{errors:?}");
    }
    assert!(Policy::from_yaml_str(
        "providers:\n  v2:\n    base_url: https://p.example\n",
        "p.yaml"
    )
    .is_ok());
}

#[test]
fn secret_env_must_be_a_variable_name_and_is_never_echoed() {
    for value in ["sk-proj-abc123secret", "\"\"", "1ABC", "MY VAR"] {
        let src = format!("{PROVIDER}    credential:\n      secret_env: {value}\n");
        let errors = problems(&src);
        assert_eq!(errors.len(), 1, "{value}: {errors:?}");
        assert!(errors[0].contains("credential.secret_env"), "{errors:?}");
        assert!(
            !errors[0].contains("sk-proj"),
            "echoes the value: {errors:?}"
        );
        assert!(
            !errors[0].contains("MY VAR"),
            "echoes the value: {errors:?}"
        );
    }
    Policy::from_yaml_str(
        &format!("{PROVIDER}    credential:\n      secret_env: BILLING_API_KEY\n"),
        "p.yaml",
    )
    .expect("a variable name is accepted");
}

#[test]
fn empty_secret_file_and_token_refs_are_refused() {
    let errors = problems(&format!(
        "{PROVIDER}    credential:\n      secret_file: \"\"\n"
    ));
    assert!(
        errors[0].contains("credential.secret_file: empty"),
        "{errors:?}"
    );
    let errors = problems("agents:\n  a1:\n    token_env: sk-live-123\n");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].contains("agents.a1.token_env"), "{errors:?}");
    assert!(!errors[0].contains("sk-live"), "{errors:?}");
    let errors = problems("operators:\n  o1:\n    token_file: \"\"\n");
    assert!(
        errors[0].contains("operators.o1.token_file: empty"),
        "{errors:?}"
    );
}

#[test]
fn base_url_with_a_query_or_fragment_is_refused_without_echo() {
    for url in [
        "https://x.example/?api_key=sk-123",
        "https://x.example/v1#sk-123",
    ] {
        let src = format!("providers:\n  p:\n    base_url: {url}\n");
        let errors = problems(&src);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("query string or fragment"), "{errors:?}");
        assert!(!errors[0].contains("sk-123"), "{errors:?}");
    }
}

#[test]
fn credential_header_with_a_value_is_refused_without_echo() {
    let src = format!(
            "{PROVIDER}    credential:\n      secret_env: K\n      header: \"Authorization: Bearer sk-live-9\"\n"
        );
    let errors = problems(&src);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].contains("credential.header: not a valid HTTP header field name"));
    assert!(!errors[0].contains("sk-live"), "{errors:?}");
}

#[test]
fn listen_must_be_host_and_port_and_store_not_empty() {
    assert_eq!(
            problems("listen: \"not an addr\"\n"),
            ["1:9: listen: `not an addr` has no port; expected HOST:PORT such as 127.0.0.1:8080 or [::1]:8080"]
        );
    let errors = problems("listen: \"127.0.0.1:99999\"\n");
    assert!(
        errors[0].starts_with(
            "1:9: listen: `127.0.0.1:99999`: the port `99999` is not a number 0–65535"
        ),
        "{errors:?}"
    );
    assert_eq!(
        problems("store: \"\"\n"),
        ["1:8: store: must be the path of the SQLite database file, not empty"]
    );
    for ok in [
        "127.0.0.1:8080",
        "[::1]:0",
        "localhost:9000",
        "gateway.internal:80",
    ] {
        Policy::from_yaml_str(&format!("listen: \"{ok}\"\n"), "p.yaml").expect(ok);
    }
}

#[test]
fn two_callers_with_one_token_source_are_refused_naming_both() {
    let digest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
    let errors = problems(&format!(
        "agents:\n  a: {{ token_sha256: {digest} }}\n  b: {{ token_sha256: {} }}\n",
        digest.to_ascii_uppercase()
    ));
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].starts_with("3:22: agents.b.token_sha256: the same digest as agents.a.token_sha256 (p.yaml:2:22), so agents.a and agents.b would have one token"), "{errors:?}");
    assert!(!errors[0].contains(digest), "{errors:?}");
    let errors = problems(&format!(
            "agents:\n  a: {{ token_sha256: {digest} }}\noperators:\n  o: {{ token_sha256: {digest} }}\n"
        ));
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].starts_with("4:22: operators.o.token_sha256: the same digest as agents.a.token_sha256 (p.yaml:2:22), so agents.a and operators.o"), "{errors:?}");
    let errors =
        problems("agents:\n  a: { token_env: BOT_TOKEN }\n  b: { token_env: BOT_TOKEN }\n");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].starts_with("3:19: agents.b.token_env: the same environment variable as agents.a.token_env (p.yaml:2:19)"), "{errors:?}");
    let errors =
        problems("agents:\n  a: { token_file: /run/t }\noperators:\n  o: { token_file: /run/t }\n");
    assert!(
        errors[0].contains("operators.o.token_file: the same file as agents.a.token_file"),
        "{errors:?}"
    );
    Policy::from_yaml_str(
            "agents:\n  a: { token_env: A_TOKEN }\n  b: { token_env: B_TOKEN }\noperators:\n  o: { token_env: O_TOKEN }\n",
            "p.yaml",
        )
        .expect("distinct sources load");
}

#[test]
fn two_routes_matching_the_same_requests_are_refused_naming_both() {
    let provider = "providers:\n  fake:\n    base_url: http://127.0.0.1:1\n    routes:\n";
    let errors = problems(&format!(
            "{provider}      \"POST /v1/{{a}}\": {{ class: uncertain_write }}\n      \"POST /v1/{{b}}\": {{ class: uncertain_write }}\n"
        ));
    assert_eq!(
            errors,
            ["6:7: providers.fake.routes.\"POST /v1/{b}\": matches exactly the same requests as route \"POST /v1/{a}\" (p.yaml:5:7), only the parameter names differ, so which of them applies would be ambiguous; keep one"]
        );
    let errors = problems(&format!(
            "{provider}      \"GET /v1/items/{{id}}\": {{ class: read }}\n      \"GET /v1/items/{{id}}/\": {{ class: read }}\n"
        ));
    assert_eq!(
            errors,
            ["6:7: providers.fake.routes.\"GET /v1/items/{id}/\": the same method and template are already routed by route \"GET /v1/items/{id}\" (p.yaml:5:7)"]
        );
    // Another method, or a literal where the other has a parameter, is another route.
    Policy::from_yaml_str(
            &format!(
                "{provider}      \"GET /v1/{{a}}\": {{ class: read }}\n      \"POST /v1/{{b}}\": {{ class: uncertain_write }}\n      \"GET /v1/me\": {{ class: read }}\n"
            ),
            "p.yaml",
        )
        .expect("distinct routes load");
}

#[test]
fn idempotency_header_cannot_be_a_credential_or_an_owned_header() {
    for name in [
        "Authorization",
        "authorization",
        "Proxy-Authorization",
        "Cookie",
        "Set-Cookie",
        "Host",
        "Content-Length",
        "Transfer-Encoding",
        "Connection",
        "Keep-Alive",
        "TE",
        "Trailer",
        "Upgrade",
        "Expect",
        "Prefer",
        "X-Backstop-Task",
        "x-backstop-key",
    ] {
        let errors = problems(&format!("{PROVIDER}    idempotency_header: {name}\n"));
        assert_eq!(errors.len(), 1, "{name}: {errors:?}");
        assert!(
                errors[0].starts_with(&format!(
                    "4:25: providers.billing.idempotency_header: `{name}` cannot carry the idempotency key: "
                )),
                "{errors:?}"
            );
    }
    let errors = problems(&format!(
            "{PROVIDER}    credential: {{ secret_env: K, header: X-Api-Key, scheme: \"\" }}\n    idempotency_header: x-api-key\n"
        ));
    assert_eq!(
            errors,
            ["5:25: providers.billing.idempotency_header: `x-api-key` cannot carry the idempotency key: it is the provider's `credential.header`: it carries credentials, and an idempotency key is stored, audited and echoed in answers"]
        );
    for ok in ["Idempotency-Key", "X-Request-Id", "Stripe-Idempotency-Key"] {
        Policy::from_yaml_str(
            &format!(
                "{PROVIDER}    credential: {{ secret_env: K }}\n    idempotency_header: {ok}\n"
            ),
            "p.yaml",
        )
        .expect(ok);
    }
}

#[test]
fn credential_header_cannot_be_an_owned_header_or_the_key_header() {
    for name in [
        "Host",
        "content-length",
        "Transfer-Encoding",
        "Connection",
        "Keep-Alive",
        "TE",
        "Trailer",
        "Upgrade",
        "Proxy-Authorization",
        "Expect",
        "X-Backstop-Token",
        "Idempotency-Key",
    ] {
        let errors = problems(&format!(
            "{PROVIDER}    credential: {{ secret_env: K, header: {name} }}\n"
        ));
        assert_eq!(errors.len(), 1, "{name}: {errors:?}");
        assert!(
            errors[0].starts_with(&format!(
                "4:42: providers.billing.credential.header: `{name}` cannot carry the credential: "
            )),
            "{errors:?}"
        );
    }
    // Another idempotency header leaves `Idempotency-Key` free for a credential.
    Policy::from_yaml_str(
            &format!("{PROVIDER}    credential: {{ secret_env: K, header: Idempotency-Key }}\n    idempotency_header: X-Request-Id\n"),
            "p.yaml",
        )
        .expect("Idempotency-Key is not the key header");
    for ok in ["Authorization", "X-Api-Key", "Cookie", "api-key"] {
        Policy::from_yaml_str(
                &format!("{PROVIDER}    credential: {{ secret_env: K, header: {ok} }}\n    idempotency_header: Idempotency-Key\n"),
                "p.yaml",
            )
            .expect(ok);
    }
}

#[test]
fn a_base_url_path_with_non_ascii_characters_is_refused_with_a_hint_to_percent_encode() {
    for (url, c) in [
        ("https://api.example.com/v1/café", 'é'),
        ("https://api.example.com/données/v1", 'é'),
        ("http://127.0.0.1:9/ü", 'ü'),
    ] {
        assert_eq!(
                problems(&format!("providers:\n  p:\n    base_url: \"{url}\"\n")),
                [format!("3:15: providers.p.base_url: the path holds `{c}`, which is not ASCII; a URL path is ASCII, so percent-encode the character's UTF-8 bytes (e.g. `é` as `%C3%A9`)")],
                "{url}"
            );
    }
}

#[test]
fn a_base_url_no_request_can_be_sent_to_is_refused_with_the_reason() {
    for (url, reason) in [
        (
            "http://[::1",
            "not a URL a request can be sent to (invalid authority)",
        ),
        (
            "http://ex ample.com",
            "not a URL a request can be sent to (invalid uri character)",
        ),
        (
            "https://é.example",
            "not a URL a request can be sent to (invalid uri character)",
        ),
        ("http://:8080", "missing host"),
        (
            "http://h.example:99999",
            "the port `99999` is not a number 0–65535",
        ),
    ] {
        let errors = problems(&format!("providers:\n  p:\n    base_url: \"{url}\"\n"));
        assert_eq!(errors.len(), 1, "{url}: {errors:?}");
        assert!(
            errors[0].starts_with(&format!("3:15: providers.p.base_url: {reason}")),
            "{url}: {errors:?}"
        );
    }
    for ok in [
        "https://api.example.com/v1/caf%C3%A9",
        "http://127.0.0.1:9",
        "http://[::1]:8080/",
        "https://api.example.com/v1",
        "https://api.example.com:443",
    ] {
        Policy::from_yaml_str(
            &format!("providers:\n  p:\n    base_url: \"{ok}\"\n"),
            "p.yaml",
        )
        .expect(ok);
    }
}

#[test]
fn an_empty_external_reference_pointer_is_refused_at_load() {
    let route = |pointer: &str| {
        format!(
                "providers:\n  p:\n    base_url: https://p.example\n    routes:\n      \"POST /v1/transfers\":\n        class: uncertain_write\n        reconcile:\n          by: external_reference\n          lookup: \"GET /v1/transfers?reference={{ref}}\"\n          external_reference_pointer: {pointer}\n"
            )
    };
    assert_eq!(
            problems(&route("\"\"")),
            ["10:39: providers.p.routes.\"POST /v1/transfers\".reconcile.external_reference_pointer: the empty pointer is the whole payload, not a field the reference can be written to; point to a field (start with `/`, e.g. `/reference`)"]
        );
    Policy::from_yaml_str(&route("/reference"), "p.yaml").expect("a field");
}

#[test]
fn an_empty_operation_id_pointer_is_refused_at_load() {
    let route = |pointer: &str| {
        format!(
                "providers:\n  p:\n    base_url: https://p.example\n    routes:\n      \"POST /v1/transfers\":\n        class: uncertain_write\n        reconcile:\n          by: operation_id\n          lookup: \"GET /v1/transfers/{{operation_id}}\"\n          operation_id_pointer: {pointer}\n"
            )
    };
    assert_eq!(
            problems(&route("\"\"")),
            ["10:33: providers.p.routes.\"POST /v1/transfers\".reconcile.operation_id_pointer: the empty pointer is the whole answer, not the field holding the provider's operation id; point to a field (start with `/`, e.g. `/id`)"]
        );
    let policy = Policy::from_yaml_str(&route("/id"), "p.yaml").expect("a field");
    let reconcile = policy.providers["p"].routes[0].reconcile.as_ref().unwrap();
    assert_eq!(reconcile.operation_id_pointer.as_deref(), Some("/id"));
}

#[test]
fn an_empty_found_pointer_is_refused_at_load() {
    let route = |pointer: &str| {
        format!(
                "providers:\n  p:\n    base_url: https://p.example\n    routes:\n      \"POST /v1/transfers\":\n        class: uncertain_write\n        reconcile:\n          by: external_reference\n          lookup: \"GET /v1/transfers?reference={{ref}}\"\n          external_reference_pointer: /reference\n          found_pointer: {pointer}\n"
            )
    };
    assert_eq!(
            problems(&route("\"\"")),
            ["11:26: providers.p.routes.\"POST /v1/transfers\".reconcile.found_pointer: the empty pointer is the whole lookup answer, so any non-empty answer would count as found; point to the field that is present only when the operation exists (start with `/`, e.g. `/data/0/id`)"]
        );
    Policy::from_yaml_str(&route("/data/0/id"), "p.yaml").expect("a field");
}

#[test]
fn a_status_listed_twice_in_retry_statuses_is_refused() {
    assert_eq!(
        problems("request_classes:\n  read: { retry_statuses: [429, 503, 429] }\n"),
        ["2:38: request_classes.read.retry_statuses: 429 is listed twice"]
    );
    let policy = Policy::from_yaml_str(
        "request_classes:\n  read: { retry_statuses: [429, 503] }\n",
        "p.yaml",
    )
    .expect("distinct statuses");
    assert_eq!(policy.request_classes["read"].retry_statuses, [429, 503]);
}

#[test]
fn a_route_key_with_extra_spaces_is_refused_naming_it() {
    let route = |key: &str| {
        format!("providers:\n  p:\n    base_url: https://p.example\n    routes:\n      \"{key}\": {{ class: read }}\n")
    };
    for key in ["GET  /v1/x", " GET /v1/x", "GET /v1/x ", "GET\t/v1/x"] {
        let errors = problems(&route(key));
        assert_eq!(errors.len(), 1, "{key:?}: {errors:?}");
        assert!(
                errors[0].contains(&format!("providers.p.routes.\"{key}\": a route is `METHOD /path/{{param}}` with exactly one space between the method and the path")),
                "{key:?}: {errors:?}"
            );
    }
    Policy::from_yaml_str(&route("GET /v1/x"), "p.yaml").expect("one space");
}

#[cfg(unix)]
#[test]
fn a_policy_that_is_not_a_regular_file_or_too_large_is_refused() {
    let message = |path: &std::path::Path| {
        let errors = Policy::load(path).expect_err("refused").0;
        assert_eq!(errors.len(), 1, "{errors:?}");
        errors[0].message.clone()
    };
    assert_eq!(
        message(std::path::Path::new("/dev/zero")),
        "not a regular file (a character device); a policy is read from a regular file"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    assert_eq!(
        message(dir.path()),
        "not a regular file (a directory); a policy is read from a regular file"
    );
    let fifo = dir.path().join("fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(made.success());
    assert_eq!(
        message(&fifo),
        "not a regular file (a FIFO); a policy is read from a regular file"
    );
    let big = dir.path().join("big.yaml");
    let mut text = String::from("# padding\n");
    while text.len() as u64 <= MAX_POLICY_BYTES {
        text.push_str(&"#".repeat(1023));
        text.push('\n');
    }
    text.push_str("providers: {}\n");
    std::fs::write(&big, text).expect("write");
    assert_eq!(
        message(&big),
        "larger than 4 MiB; a policy file is at most 4194304 bytes"
    );
}

#[test]
fn route_templates_that_can_never_match_are_refused_naming_why() {
    let route = |template: &str| {
        format!("providers:\n  p:\n    base_url: https://p.example\n    routes:\n      \"GET {template}\": {{ class: read }}\n")
    };
    for (template, reason) in [
            ("/v1/élément/{id}", "`élément` is not ASCII: requests carry it percent-encoded and are matched that way; write `%C3%A9l%C3%A9ment`"),
            ("/v1/../items/{id}", "`..` is a dot segment: request paths are normalized before matching (RFC 3986 §5.2.4) and have none; write the path it resolves to"),
            ("/./v1/items", "`.` is a dot segment"),
            ("/v1/%2E%2e/items", "`%2E%2e` is a dot segment"),
            ("/v1/%6cimited", "`%6cimited`: request paths are normalized before matching (RFC 3986 §6.2.2: unreserved characters decoded, other percent-encodings in upper-case hex); write `limited`"),
            ("/v1/a%2fb", "write `a%2Fb`"),
            ("/v1/%zz", "`%zz`: a `%` must be followed by two hex digits"),
        ] {
            let errors = problems(&route(template));
            assert_eq!(errors.len(), 1, "{template}: {errors:?}");
            assert!(
                errors[0].starts_with(&format!("5:7: providers.p.routes.\"GET {template}\": ")),
                "{errors:?}"
            );
            assert!(errors[0].contains(reason), "{template}: {errors:?}");
            assert!(
                errors[0].ends_with(", so this route would never match"),
                "{errors:?}"
            );
        }
    for ok in [
        "/v1/%C3%A9l%C3%A9ment/{id}",
        "/v1/a%2Fb",
        "/v1/.well-known/x",
        "/v1/..x",
    ] {
        Policy::from_yaml_str(&route(ok), "p.yaml").expect(ok);
    }
}
