"""The official OpenAI and Anthropic Python SDKs and LiteLLM at their DEFAULT settings (their own
retries on: `max_retries=2`; default timeouts unless a test says otherwise) through a real
`backstop serve` to a real `backstop fake-api`.

backstop is the one retry layer: with the SDKs' own retries left on, the provider must see
exactly what the policy allows (SPEC §4.2a, §4.3, §11). Every count is taken at the fake.

The policy (conftest.policy): class `llm_call` = 3 attempts, 60 s of waiting, retried on 429,
500, 502, 503 and 529; `POST /v1/chat/completions` (provider `openai`) and `POST /v1/messages`
(provider `anthropic`) in it.
"""

from __future__ import annotations

import anthropic
import openai

from stack import AGENT_TOKEN, CHAT_ROUTE, MESSAGES_ROUTE, Stack, exchange

MAX_ATTEMPTS = 3
MESSAGES = [{"role": "user", "content": "Say hi."}]
COMPLETION_TEXT = "token-0 token-1 token-2 "


def every_call(fault: dict) -> dict:
    """Fault rules applying `fault` to every call of the route."""
    return {"faults": [{"every_nth": 1, "fault": fault}]}


# OpenAI's own 429 body; `Retry-After: 1` is short enough to be inside every budget.
OPENAI_429 = {
    "kind": "status", "status": 429, "retry_after": "1",
    "body": {"error": {"message": "Rate limit reached for requests", "type": "requests",
                       "param": None, "code": "rate_limit_exceeded"}},
}
ANTHROPIC_429 = {
    "kind": "status", "status": 429, "retry_after": "1",
    "body": {"type": "error", "error": {"type": "rate_limit_error",
                                        "message": "Number of requests has exceeded your rate limit"}},
}
ANTHROPIC_529 = {
    "kind": "status", "status": 529, "retry_after": "1",
    "body": {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
}


def openai_client(stack: Stack, **options) -> openai.OpenAI:
    """The OpenAI SDK as the README points it at backstop, its retries and timeouts left at the
    SDK's defaults unless `options` says otherwise."""
    return openai.OpenAI(
        base_url=f"{stack.gateway_url}/openai/v1",
        api_key=AGENT_TOKEN,
        default_headers={"X-Backstop-Task": stack.task},
        **options,
    )


def anthropic_client(stack: Stack) -> anthropic.Anthropic:
    """The Anthropic SDK at its defaults; the backstop token goes as `Authorization: Bearer`
    (`auth_token`), which is what backstop authenticates agents by."""
    return anthropic.Anthropic(
        base_url=f"{stack.gateway_url}/anthropic",
        auth_token=AGENT_TOKEN,
        api_key=None,
        default_headers={"X-Backstop-Task": stack.task},
    )


def assert_backstop_reason(err: Exception, stack: Stack) -> None:
    """The exception's text names backstop's reason (its retry budget), not only a status code:
    the problem document carries the SDKs' `error.message`."""
    text = str(err)
    assert "budget" in text.lower(), (
        f"the SDK's message does not say why backstop stopped: {text!r}\n{exchange(err)}\n{stack.describe()}"
    )


def outcome_of(stack: Stack, fn):
    """What the SDK call ended with: its result, or the exception it raised (so that a test
    counts the attempts at the fake before it looks at the exception)."""
    try:
        return stack.call(fn)
    except Exception as err:  # noqa: BLE001 - every outcome is judged by the test
        return err


def assert_raised(outcome, expected: type, stack: Stack) -> None:
    assert isinstance(outcome, expected), (
        f"expected {expected.__module__}.{expected.__name__}, the SDK ended with "
        f"{exchange(outcome) if isinstance(outcome, Exception) else repr(outcome)[:300]}\n{stack.describe()}"
    )


def assert_attempts(stack: Stack, route: str, expected: int, err: Exception | None = None) -> None:
    attempts = stack.settled_attempts(route)
    detail = exchange(err) if err is not None else ""
    assert len(attempts) == expected, (
        f"the provider saw {len(attempts)} attempts of {route}, the policy allows {expected}\n"
        f"gateway's last answer: {detail}\n{stack.describe(route)}"
    )


def test_openai_429_storm_reaches_the_provider_max_attempts_times(make_stack):
    stack = make_stack(chat=every_call(OPENAI_429))
    client = openai_client(stack)
    err = outcome_of(stack, lambda: client.chat.completions.create(model="gpt-fake", messages=MESSAGES))
    assert_attempts(stack, CHAT_ROUTE, MAX_ATTEMPTS, err)
    assert_raised(err, openai.RateLimitError, stack)
    assert_backstop_reason(err, stack)


def test_openai_streaming_429_storm_reaches_the_provider_max_attempts_times(make_stack):
    stack = make_stack(chat=every_call(OPENAI_429))
    client = openai_client(stack)

    def stream():
        return list(client.chat.completions.create(model="gpt-fake", messages=MESSAGES, stream=True))

    err = outcome_of(stack, stream)
    assert_attempts(stack, CHAT_ROUTE, MAX_ATTEMPTS, err)
    assert_raised(err, openai.RateLimitError, stack)
    assert_backstop_reason(err, stack)


def test_anthropic_429_storm_reaches_the_provider_max_attempts_times(make_stack):
    stack = make_stack(messages=every_call(ANTHROPIC_429))
    client = anthropic_client(stack)
    err = outcome_of(stack, lambda: client.messages.create(model="claude-fake", max_tokens=16, messages=MESSAGES))
    assert_attempts(stack, MESSAGES_ROUTE, MAX_ATTEMPTS, err)
    assert_raised(err, anthropic.RateLimitError, stack)
    assert_backstop_reason(err, stack)
    # The Anthropic SDK's own reading of the body's `error.message`.
    assert "budget" in (err.api_message or "").lower(), exchange(err)


def test_litellm_429_storm_reaches_the_provider_max_attempts_times(make_stack):
    import litellm

    stack = make_stack(chat=every_call(OPENAI_429))
    err = outcome_of(stack, lambda: litellm.completion(
        model="openai/gpt-fake",
        api_base=f"{stack.gateway_url}/openai/v1",
        api_key=AGENT_TOKEN,
        messages=MESSAGES,
        extra_headers={"X-Backstop-Task": stack.task},
    ))
    assert_attempts(stack, CHAT_ROUTE, MAX_ATTEMPTS, err)
    assert_raised(err, litellm.RateLimitError, stack)
    assert_backstop_reason(err, stack)


def test_anthropic_529_with_retry_after_keeps_its_status_and_reaches_the_provider_max_attempts_times(make_stack):
    stack = make_stack(messages=every_call(ANTHROPIC_529))
    client = anthropic_client(stack)
    err = outcome_of(stack, lambda: client.messages.create(model="claude-fake", max_tokens=16, messages=MESSAGES))
    assert_attempts(stack, MESSAGES_ROUTE, MAX_ATTEMPTS, err)
    # The provider's own status reaches the agent: Anthropic's "overloaded" (a subclass of
    # InternalServerError), not a 429.
    assert_raised(err, anthropic.OverloadedError, stack)
    assert err.status_code == 529, exchange(err)


def test_a_provider_409_is_sent_once(make_stack):
    conflict = {
        "kind": "status", "status": 409,
        "body": {"error": {"message": "Another request with these parameters is in progress",
                           "type": "invalid_request_error", "param": None, "code": "conflict"}},
    }
    stack = make_stack(chat=every_call(conflict))
    client = openai_client(stack)
    err = outcome_of(stack, lambda: client.chat.completions.create(model="gpt-fake", messages=MESSAGES))
    assert_attempts(stack, CHAT_ROUTE, 1, err)
    assert_raised(err, openai.ConflictError, stack)


def test_a_completion_slower_than_the_attempt_timeout_is_retried_or_answered_never_escalated(make_stack):
    # The first completion takes 2 s, twice the gateway's attempt timeout; later ones are fast.
    stack = make_stack(chat={"script": [{"kind": "slow", "hold_ms": 2000}]}, attempt_timeout=1)
    client = openai_client(stack)
    result = outcome_of(stack, lambda: client.chat.completions.create(model="gpt-fake", messages=MESSAGES))
    escalations = stack.open_escalations()
    attempts = stack.settled_attempts(CHAT_ROUTE)
    summary = f"SDK got: {exchange(result) if isinstance(result, Exception) else 'a completion'}\n{stack.describe()}"
    assert escalations == [], f"a slow completion was escalated: {escalations}\n{summary}"
    assert 1 <= len(attempts) <= MAX_ATTEMPTS, summary
    if isinstance(result, Exception):
        assert_raised(result, openai.RateLimitError, stack)
        assert_backstop_reason(result, stack)
    else:
        assert result.choices[0].message.content == COMPLETION_TEXT, summary


def test_a_stream_whose_first_call_is_a_429_is_streamed_after_one_retry(make_stack):
    stack = make_stack(chat={"script": [OPENAI_429]})
    client = openai_client(stack)

    def stream():
        chunks = client.chat.completions.create(model="gpt-fake", messages=MESSAGES, stream=True)
        return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]

    pieces = stack.call(stream)
    assert "".join(pieces) == COMPLETION_TEXT, f"{pieces}\n{stack.describe()}"
    assert len(pieces) == 3, pieces
    assert_attempts(stack, CHAT_ROUTE, 2)


# The SDK's own timeout shorter than the completion: `OpenAI(timeout=1.0)` with its default two
# retries. The SDK's attempt 1 gives up at 1 s, attempt 2 starts 0.375-0.5 s later and gives up
# 1 s after that (2.375-2.5 s), attempt 3 starts 0.75-1 s later (3.125-3.5 s). Each hold below
# falls clear of those edges, so each test exercises one case, not a race between the two.


def sdk_timeout_call(stack: Stack):
    client = openai_client(stack, timeout=1.0)
    result = outcome_of(stack, lambda: client.chat.completions.create(model="gpt-fake", messages=MESSAGES))
    stack.notes.append(f"SDK got {exchange(result) if isinstance(result, Exception) else 'a completion'}")
    attempts = stack.settled_attempts(CHAT_ROUTE, quiet=1.5)
    assert len(attempts) == 1, (
        f"the provider started {len(attempts)} completions for one SDK call\n{stack.describe(CHAT_ROUTE)}"
    )
    escalations = stack.open_escalations()
    assert escalations == [], f"a completion was escalated: {escalations}\n{stack.describe()}"
    return result


def test_an_sdk_resend_after_its_own_timeout_joins_the_completion_in_flight(make_stack):
    # 2 s: the completion ends while the SDK's attempt 2 (1.375-2.5 s) waits for it.
    stack = make_stack(chat={"script": [{"kind": "slow", "hold_ms": 2000}]})
    result = sdk_timeout_call(stack)
    assert not isinstance(result, Exception), f"the SDK's attempt 2 was there to get it\n{stack.describe()}"
    assert result.choices[0].message.content == COMPLETION_TEXT, stack.describe()


def test_an_sdk_resend_after_the_completion_ended_unseen_starts_no_second_one(make_stack):
    # 2.8 s: the SDK's attempt 2 has given up (by 2.5 s) and attempt 3 comes later (3.125 s or
    # after): the completion ended with no caller to take it, and the SDK sends it once more.
    stack = make_stack(chat={"script": [{"kind": "slow", "hold_ms": 2800}]})
    result = sdk_timeout_call(stack)
    # The SDK gets that completion, or gives up on its own timeout; nothing else.
    if isinstance(result, Exception):
        assert_raised(result, openai.APITimeoutError, stack)
    else:
        assert result.choices[0].message.content == COMPLETION_TEXT, stack.describe()
