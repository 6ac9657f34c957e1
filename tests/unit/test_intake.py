"""Validation of submissions: every refusal names the field and the limit (no server)."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from inferq.config import Settings
from inferq.errors import InvalidRequest, UnknownPriorityClass, UnknownRoute
from inferq.intake import build_request, classify
from inferq.routes import check_context

SETTINGS = Settings.load(max_prompt_bytes=1000)


def refuse(**fields: object) -> InvalidRequest:
    args: dict[str, object] = {"prompt": "hi", "max_tokens": 8}
    args.update(fields)
    with pytest.raises(InvalidRequest) as info:
        build_request(SETTINGS, **args)  # type: ignore[arg-type]
    return info.value


def test_unknown_priority_class_names_the_known_ones() -> None:
    err = refuse(priority="urgent")
    assert isinstance(err, UnknownPriorityClass)
    assert str(err) == "priority: unknown class 'urgent' (known: realtime, standard, batch)"


def test_priority_levels_map_onto_classes() -> None:
    assert build_request(SETTINGS, prompt="x", priority=0).priority == "realtime"
    assert build_request(SETTINGS, prompt="x", priority=2).priority == "batch"
    assert str(refuse(priority=3)) == "priority: level 3 is outside 0..2"


def test_empty_and_oversized_prompt() -> None:
    assert str(refuse(prompt="   ")) == "prompt: must not be empty"
    err = refuse(prompt="x" * 1001)
    assert err.field == "prompt"
    assert "1001 bytes exceeds the limit of 1000 bytes" in err.reason


def test_prompt_and_messages_are_exclusive() -> None:
    err = refuse(messages=[{"role": "user", "content": "x"}])
    assert str(err) == "prompt: give exactly one of prompt and messages"
    assert refuse(prompt=None, messages=[]).field == "messages"
    assert refuse(prompt=None, messages=[{"role": "wizard", "content": "x"}]).field.startswith(
        "messages"
    )


def test_a_message_content_of_bytes_is_refused_not_decoded() -> None:
    # the prompt's rule for messages too (the fuzz test found b"\x01" stored as "\x01")
    err = refuse(prompt=None, messages=[{"role": "user", "content": b"\x01"}])
    assert err.field == "messages.0.content", err


def test_max_tokens_bounds_name_the_context() -> None:
    assert str(refuse(max_tokens=0)) == (
        "max_tokens: 0 is outside 1..131072 (max context of llama-3.1-8b)"
    )
    err = refuse(model="llama-2-13b", max_tokens=5000)
    assert "outside 1..4096 (max context of llama-2-13b)" in str(err)
    assert refuse(max_tokens="many").field == "max_tokens"
    err = refuse(model="llama-2-13b", prompt="word " * 190, max_tokens=4090)
    assert "exceeds the max context of llama-2-13b (4096 tokens)" in str(err)
    assert err.field == "max_tokens"
    # A prompt that fills the context alone is the prompt's fault, whatever max_tokens.
    specs = [m for m in Settings.load().models if m.name == "llama-2-13b"]
    with pytest.raises(InvalidRequest) as caught:
        check_context(5, 4096, specs, "llama-2-13b")
    assert caught.value.field == "prompt"
    assert str(caught.value) == (
        "prompt: ~4096 tokens (an estimate, not the model's tokenizer) leave no room for "
        "output in the max context of llama-2-13b (4096 tokens)"
    )


def test_timeout_and_deadline() -> None:
    assert str(refuse(timeout=0)) == "timeout: must be a positive number of seconds, got 0"
    assert refuse(timeout=-1).field == "timeout"
    assert refuse(timeout=math.inf).field == "timeout"
    assert refuse(timeout="soon").field == "timeout"
    assert "not in the future" in str(refuse(deadline=time.time() - 5))
    assert str(refuse(timeout=1, deadline=time.time() + 5)) == (
        "timeout: give timeout or deadline, not both"
    )


def test_tenant_and_idempotency_key_patterns() -> None:
    err = refuse(tenant="has space")
    assert err.field == "tenant" and "does not match the pattern" in err.reason
    assert refuse(tenant="").field == "tenant"
    assert refuse(idempotency_key="x" * 200).field == "idempotency_key"


def test_unknown_route() -> None:
    err = refuse(model="gpt-17")
    assert isinstance(err, UnknownRoute)
    assert str(err).startswith("model: unknown model 'gpt-17' (registry: ")
    assert str(refuse(model=">=400b")) == ("model: no model has >=400b parameters (largest: 70b)")
    assert "neither a model name" in str(refuse(model="no spaces allowed"))


def test_params_must_be_json() -> None:
    assert "JSON-serializable" in str(refuse(params={"f": object()}))
    assert "exceeds the limit of 16384" in str(refuse(params={"x": "y" * 20000}))


def test_several_answers_per_request_are_refused_naming_the_field() -> None:
    error = refuse(params={"n": 3})
    assert error.field == "params.n" and "must be 1" in str(error) and "got 3" in str(error)
    assert refuse(params={"best_of": 2}).field == "params.best_of"
    assert refuse(params={"n": True}).field == "params.n"
    req = build_request(SETTINGS, prompt="x", params={"n": 1, "temperature": 0})
    assert req.payload.params["n"] == 1


def test_classifier_fills_in_class_and_route() -> None:
    assert classify(SETTINGS, "chat") == ("realtime", "llama-3.1-8b")
    assert classify(SETTINGS, "unknown-kind") == ("standard", "llama-3.1-8b")
    req = build_request(SETTINGS, prompt="x", task_type="summarize")
    assert req.priority == "batch"
    req = build_request(SETTINGS, prompt="x", task_type="summarize", priority="realtime")
    assert req.priority == "realtime"  # the caller wins


def test_size_route_is_accepted_and_normalised() -> None:
    req = build_request(SETTINGS, prompt="x", model=">= 13B", max_tokens=10)
    assert req.model == req.route == ">=13b"


@hsettings(max_examples=200, deadline=None)
@given(
    max_tokens=st.one_of(st.integers(-10, 40000), st.floats(), st.text(max_size=3), st.none()),
    timeout=st.one_of(st.floats(allow_nan=True), st.integers(-5, 10**7), st.none()),
    tenant=st.text(max_size=70),
    priority=st.one_of(st.sampled_from(["realtime", "batch", "x"]), st.integers(-2, 5)),
)
def test_every_outcome_is_a_valid_request_or_a_named_refusal(
    max_tokens: object, timeout: object, tenant: str, priority: object
) -> None:
    try:
        req = build_request(
            SETTINGS,
            prompt="hello",
            max_tokens=max_tokens,
            timeout=timeout,  # type: ignore[arg-type]
            tenant=tenant,
            priority=priority,  # type: ignore[arg-type]
        )
    except InvalidRequest as exc:
        assert exc.field in {"max_tokens", "timeout", "tenant", "priority"}
        assert exc.reason
        return
    assert 1 <= req.max_tokens <= 131072
    assert req.timeout_s > 0 and math.isfinite(req.timeout_s)
    assert req.deadline > req.submitted_at


def test_the_fingerprint_is_the_work_not_the_deadline() -> None:
    # What an idempotency key remembers (issue 12, fault 6): the route, class, task type,
    # payload and max_tokens; a retry with a later deadline is the same request.
    base = build_request(SETTINGS, prompt="hi", max_tokens=8, params={"a": 1, "b": 2})
    same = build_request(SETTINGS, prompt="hi", max_tokens=8, params={"b": 2, "a": 1}, timeout=9)
    assert base.fingerprint() == same.fingerprint() and base.id != same.id
    # stream says how the answer travels, not what is computed: left out on purpose (a
    # retry without streaming after a dropped stream is the same request).
    streamed = build_request(SETTINGS, prompt="hi", max_tokens=8, params={"a": 1, "b": 2},
                             stream=True)  # fmt: skip
    assert streamed.fingerprint() == base.fingerprint()
    for changed in (
        {"prompt": "ho"},
        {"max_tokens": 9},
        {"params": {"a": 1}},
        {"priority": "batch"},
        {"task_type": "chat"},
        {"model": ">=13b"},
    ):
        args: dict[str, object] = {"prompt": "hi", "max_tokens": 8, "params": {"a": 1, "b": 2}}
        other = build_request(SETTINGS, **{**args, **changed})  # type: ignore[arg-type]
        assert other.fingerprint() != base.fingerprint(), changed


def test_tool_call_arguments_count_in_the_prompt_size_limit() -> None:
    call = {"id": "c", "function": {"name": "f", "arguments": "x" * 2000}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    error = refuse(prompt=None, messages=messages)
    assert error.field == "messages" and "exceeds the limit of 1000 bytes" in str(error)


@pytest.mark.parametrize(
    ("part", "text", "why"),
    [("arguments", '{"a": "\udcff"}', "lone surrogate"), ("name", "f\ud800", "lone surrogate")],
)
def test_a_tool_call_sent_back_must_be_valid_unicode_too(part: str, text: str, why: str) -> None:
    """A lone surrogate in a tool call's name or arguments (JSON's ``"\\udcff"`` escape,
    which the gateway's parser decodes) passed intake, which checked only the contents,
    and failed at submit with a PydanticSerializationError (a 500 at the gateway); with
    a caller's ``prefix_hashes`` the chain's size raised a UnicodeEncodeError."""
    function = {"name": "f", "arguments": "{}", part: text}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": function}]},
    ]
    for hashes in (None, [1, 2]):
        error = refuse(prompt=None, messages=messages, prefix_hashes=hashes)
        assert error.field == f"messages.1.tool_calls.0.function.{part}" and why in str(error)
