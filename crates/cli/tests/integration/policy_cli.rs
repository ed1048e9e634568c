//! `backstop policy check` as a process: exit codes and output (SPEC §3, §11).

use std::path::PathBuf;
use std::process::{Command, Output};

fn backstop() -> Command {
    Command::new(env!("CARGO_BIN_EXE_backstop"))
}

/// Writes `yaml` to `name` in a fresh directory and runs `backstop policy check` on it; the
/// directory lives as long as the returned guard.
fn check(name: &str, yaml: &str) -> (tempfile::TempDir, PathBuf, Output) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join(name);
    std::fs::write(&file, yaml).expect("write");
    let out = backstop()
        .args(["policy", "check"])
        .arg(&file)
        .output()
        .expect("run backstop");
    (dir, file, out)
}

#[test]
fn shipped_example_passes_with_a_summary() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/backstop.yaml");
    let out = backstop()
        .args(["policy", "check", example])
        .output()
        .expect("run backstop");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("ok: 5 request classes, 2 providers, 3 scopes, 7 routes"),
        "{stdout}"
    );
    assert!(stdout.contains(
        "route billing-api POST /v1/transfers -> idempotent_write [billing-api/account, billing-api/transfers]"
    ));
    assert!(
        stdout.contains("route openai POST /v1/chat/completions -> llm_call [openai/org-requests]"),
        "{stdout}"
    );
}

#[test]
fn broken_file_exits_2_with_file_line_column() {
    let (_dir, file, out) = check("broken.yaml", "breaker:\n  threshold: 0\nproviders:\n  a:\n    base_url: https://a.example\n    credential: { secret: sk-live-123 }\n");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let name = file.display().to_string();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 3, "{stderr}");
    assert_eq!(
        lines[0],
        format!("{name}:2:14: breaker.threshold: must be at least 1")
    );
    assert!(
        lines[1].starts_with(&format!(
            "{name}:6:27: providers.a.credential.secret: literal secret"
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("sk-live-123"));
    assert_eq!(lines[2], format!("{name}: 2 problems"));
}

#[test]
fn syntax_error_exits_2() {
    let (_dir, file, out) = check("syntax.yaml", "request_classes: [\n");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with(&format!("{}:", file.display())),
        "{stderr}"
    );
}

#[test]
fn yaml_alias_error_is_printed_whole_with_one_position() {
    let (_dir, file, out) = check(
        "alias.yaml",
        "backoff: &b\n  base_seconds: 1\nbreaker: *b\n",
    );
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let name = file.display().to_string();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines[0],
        format!(
            "{name}:3:10: breaker.base_seconds: unknown field `base_seconds`, expected one of threshold, forget_after_seconds \
             (the value comes from the anchor at 2:3)"
        ),
        "{stderr}"
    );
    assert_eq!(lines[1], format!("{name}: 1 problem"));
}

#[test]
fn summary_counts_are_pluralized_correctly() {
    let (_dir, _file, out) = check("one.yaml", "agents:\n  bot: { token_env: BOT_TOKEN }\noperators:\n  ops: { token_env: OPS_TOKEN }\nproviders:\n  a:\n    base_url: https://a.example\n    scopes:\n      account: { limit: 10 }\n    routes:\n      \"GET /v1/items\": { class: read }\n");
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout
            .contains("ok: 4 request classes, 1 provider, 1 scope, 1 route, 1 agent, 1 operator\n"),
        "{stdout}"
    );
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn warnings_print_file_line_column_and_exit_0() {
    let (_dir, file, out) = check("warn.yaml", "providers:\n  a:\n    base_url: https://a.example\n    idempotent_put_delete: true\n    routes:\n      \"PUT /v1/items/{id}\": { class: idempotent_write }\n");
    assert_eq!(out.status.code(), Some(0));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let name = file.display();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 4, "{stderr}");
    assert!(
        lines[0].starts_with(&format!("{name}:1:1: warning: agents: none")),
        "{stderr}"
    );
    assert!(
        lines[1].starts_with(&format!(
            "{name}:1:1: warning: operators: none configured, but calls through these providers can be escalated"
        )),
        "{stderr}"
    );
    assert!(
        lines[2].starts_with(&format!("{name}:2:3: warning: providers.a: no scopes")),
        "{stderr}"
    );
    assert!(
        lines[3].starts_with(&format!("{name}:6:38: warning: ")),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("0 agents, 0 operators (4 warnings)"),
        "{stdout}"
    );
}

#[test]
fn idempotent_write_post_without_a_key_header_fails_the_check() {
    let (_dir, file, out) = check("nokey.yaml", "agents:\n  bot: { token_env: BOT_TOKEN }\nproviders:\n  a:\n    base_url: https://a.example\n    scopes:\n      account: { limit: 10 }\n    routes:\n      \"POST /v1/items\": { class: idempotent_write }\n");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("{}:9:34: ", file.display()))
            && stderr.contains("no `idempotency_header`"),
        "{stderr}"
    );
}

#[test]
fn shipped_example_marks_required_keys_and_documents_every_default() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/backstop.yaml");
    let text = std::fs::read_to_string(example).expect("read the example");
    let line_of = |key: &str| {
        text.lines()
            .find(|l| l.trim_start().starts_with(&format!("{key}:")))
            .unwrap_or_else(|| panic!("{key} is in the example"))
    };
    for key in ["base_url", "secret_env", "by", "lookup"] {
        assert!(line_of(key).contains("(required)"), "{}", line_of(key));
    }
    for (key, default) in [
        ("store", "default: ./backstop.db"),
        ("listen", "default: 127.0.0.1:8080"),
        ("headroom", "default 0.8"),
        ("reserve_interactive", "default 0.2"),
        ("coalesce", "default false"),
        ("honour_hints", "default true"),
        ("dialect", "default generic"),
        ("default_scopes", "default: every scope"),
        ("min_delay_seconds", "default 1"),
        ("idempotent_put_delete", "default false"),
        ("window_seconds", "default 60"),
        ("threshold", "default 3"),
    ] {
        assert!(line_of(key).contains(default), "{key}: {}", line_of(key));
    }
    let out = backstop()
        .args(["policy", "check", example])
        .output()
        .expect("run backstop");
    assert_eq!(out.status.code(), Some(0));
    assert!(
        out.stderr.is_empty(),
        "no warnings: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn summary_prints_the_resolved_breaker_settings() {
    let (_dir, _file, out) = check(
        "breaker.yaml",
        "agents:\n  bot: { token_env: BOT_TOKEN }\nbreaker:\n  threshold: 5\n  forget_after_seconds: 90.5\n",
    );
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    let class = lines
        .iter()
        .rposition(|l| l.starts_with("class "))
        .expect("class lines");
    assert_eq!(
        lines[class + 1],
        "breaker: threshold 5, forget_after 90.5 s",
        "{stdout}"
    );
    // Without a `breaker` section, its defaults.
    let (_dir, _file, out) = check(
        "defaults.yaml",
        "agents:\n  bot: { token_env: BOT_TOKEN }\n",
    );
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("\nbreaker: threshold 3, forget_after 86400 s\n"),
        "{stdout}"
    );
}

#[test]
fn a_forget_window_under_one_second_fails_the_check_naming_its_place_and_why() {
    let (_dir, file, out) = check(
        "forget.yaml",
        "agents:\n  bot: { token_env: BOT_TOKEN }\nbreaker:\n  threshold: 3\n  forget_after_seconds: 1e-9\n",
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let name = file.display().to_string();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(
        lines[0].starts_with(&format!(
            "{name}:5:25: breaker.forget_after_seconds: must be at least 1 second, got 0.000000001 ("
        )) && lines[0].contains("its circuit would never open"),
        "{stderr}"
    );
    assert_eq!(lines[1], format!("{name}: 1 problem"));
}

#[test]
fn an_unknown_key_is_not_told_to_use_a_key_that_is_refused() {
    let (_dir, file, out) = check(
        "typo.yaml",
        "providers:\n  a:\n    base_url: https://a.example\n    credential: { secret_envv: A_KEY }\n",
    );
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.lines().next(),
        Some(
            format!(
                "{}:4:19: providers.a.credential.secret_envv: unknown field `secret_envv`, expected one of secret_env, secret_file, header, scheme",
                file.display()
            )
            .as_str()
        ),
        "{stderr}"
    );
}

#[test]
fn a_backoff_base_or_retry_floor_under_a_tenth_of_a_second_fails_the_check_naming_its_place_and_why(
) {
    let (_dir, file, out) = check(
        "backoff.yaml",
        "agents:\n  bot: { token_env: BOT_TOKEN }\nbackoff:\n  base_seconds: 1e-9\n  min_delay_seconds: 0.001\n",
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let name = file.display().to_string();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 3, "{stderr}");
    assert!(
        lines[0].starts_with(&format!(
            "{name}:4:17: backoff.base_seconds: must be at least 0.1 seconds, got 0.000000001 ("
        )) && lines[0].contains("a tight retry loop"),
        "{stderr}"
    );
    assert!(
        lines[1].starts_with(&format!(
            "{name}:5:22: backoff.min_delay_seconds: must be at least 0.1 seconds, got 0.001 ("
        )) && lines[1].contains("a tight retry loop"),
        "{stderr}"
    );
    assert_eq!(lines[2], format!("{name}: 2 problems"));
}

#[test]
fn summary_prints_the_resolved_backoff_shared_scope_and_retry_quota_settings() {
    let (_dir, _file, out) = check(
        "limits.yaml",
        "agents:\n  bot: { token_env: BOT_TOKEN }\nshared_scope:\n  max_delayed_requests: 7\n  max_concurrent_requests: 3\nbackoff:\n  base_seconds: 0.5\n  max_seconds: 30\n  min_delay_seconds: 2\n  retry_after_ceiling_seconds: 3600\n  boundary_spread_seconds: 0\nretry_quota:\n  capacity: 100\n  retry_cost: 4\n  timeout_cost: 8\n  success_refund: 2\n",
    );
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    let breaker = lines
        .iter()
        .position(|l| l.starts_with("breaker: "))
        .expect("breaker line");
    assert_eq!(
        lines[breaker + 1..breaker + 4],
        [
            "backoff: base 0.5 s, max 30 s, min_delay 2 s, retry_after_ceiling 3600 s, boundary_spread 0 s",
            "shared_scope: max_concurrent_requests 3, max_delayed_requests 7",
            "retry_quota: capacity 100, retry_cost 4, timeout_cost 8, success_refund 2",
        ],
        "{stdout}"
    );
    // Without those sections, their defaults.
    let (_dir, _file, out) = check(
        "defaults.yaml",
        "agents:\n  bot: { token_env: BOT_TOKEN }\n",
    );
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(
            "\nbackoff: base 1 s, max 60 s, min_delay 1 s, retry_after_ceiling 86400 s, boundary_spread 5 s\n\
             shared_scope: max_concurrent_requests 2, max_delayed_requests 25\n\
             retry_quota: capacity 500, retry_cost 5, timeout_cost 10, success_refund 1\n"
        ),
        "{stdout}"
    );
}

#[test]
fn a_scope_window_under_one_second_fails_the_check_naming_its_place_and_why() {
    let (_dir, file, out) = check(
        "window.yaml",
        "agents:\n  bot: { token_env: BOT_TOKEN }\nproviders:\n  billing:\n    base_url: https://billing.example\n    scopes:\n      account:\n        limit: 10\n        window_seconds: 0.0001\n",
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let name = file.display().to_string();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(
        lines[0].starts_with(&format!(
            "{name}:9:25: providers.billing.scopes.account.window_seconds: must be at least 1 second, got 0.0001 ("
        )) && lines[0].contains("whole seconds"),
        "{stderr}"
    );
    assert_eq!(lines[1], format!("{name}: 1 problem"));
}

/// A key quoted from the policy file in an error is escaped: its control and bidi characters
/// can neither drive the terminal nor reorder the message.
#[test]
fn control_characters_of_the_file_are_escaped_in_its_errors() {
    let (_dir, _path, out) = check(
        "esc.yaml",
        "providers:\n  p:\n    base_url: https://p.example\n    routes:\n      \"GET /a\\e[31mRED\\u202e\": { class: read }\n",
    );
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains('\u{1b}'), "{stderr:?}");
    assert!(!stderr.contains('\u{202e}'), "{stderr:?}");
    assert!(stderr.contains("\\u{1b}[31mRED\\u{202e}"), "{stderr}");
}

#[test]
fn the_routes_a_dialect_implies_carry_the_side_effect_of_the_class_they_get() {
    let policy = "operators:\n  ops: { token_env: OPS_TOKEN }\nagents:\n  bot: { token_env: BOT_TOKEN }\nrequest_classes:\n  llm_call: { side_effect: write }\nproviders:\n  ai:\n    base_url: https://ai.example\n    dialect: openai\n    scopes:\n      org: { limit: 10 }\n";
    let (_dir, _file, out) = check("implied.yaml", policy);
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("route ai POST /v1/chat/completions | /v1/completions | /v1/embeddings | /v1/moderations -> llm_call (dialect openai, side_effect write) [ai/org]\n"),
        "{stdout}"
    );
}
