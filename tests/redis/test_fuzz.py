"""Hostile input: malformed submissions thrown at the client and at ``inferq submit``.

Each generated submission has one or more broken fields among valid ones. Every one is
refused with an :class:`InvalidRequest` naming one of the broken fields (the CLI prints
one line ``error: <field>: ...`` and exits 1, or click's usage error naming the option
and exits 2; never a traceback), and nothing reaches Redis: the namespace holds no key
afterwards. Then the limits: oversized prompts and one tenant's flood are refused with a
clear error while other tenants go on submitting.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from inferq.cli.main import cli
from inferq.client import AsyncClient, BatchRefused, Client
from inferq.config import Settings
from inferq.errors import InvalidRequest, QueueFull
from inferq.intake import build_request
from inferq.store.keys import Keys

from ..conftest import REDIS_URL

#: Small prompt limit so "huge" prompts stay cheap to generate.
MAX_PROMPT_BYTES = 2000
FUZZ = hsettings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# --- strategies: one valid and one broken value per field ---------------------------

other_types = st.one_of(
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.booleans(),
    st.builds(object),
)
odd_text = st.text(max_size=20)  # any code point but surrogates (those come separately)
surrogate = st.sampled_from(["\ud800", "\udfff", "\udc80x"])
nul_text = st.builds(lambda a, b: f"{a}\x00{b}", st.text(max_size=5), st.text(max_size=5))
huge_text = st.integers(MAX_PROMPT_BYTES + 1, 4 * MAX_PROMPT_BYTES).map(lambda n: "é" * n)
bad_numbers = st.one_of(
    st.integers(-(10**40), 0),
    st.integers(10**9, 10**4000),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-9, 1e300]),
    st.text(max_size=4),
    st.none().map(lambda _: [1]),
    st.booleans(),
)


def _nested(depth: int) -> dict[str, Any]:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return {"p": value}


def with_text(base: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.builds(lambda a, b: a + b, base, st.text(max_size=10))


BAD: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.one_of(
        other_types.filter(lambda v: v is not None),
        st.sampled_from(["", "   ", "\n\t", "\u2028\u00a0"]),
        with_text(surrogate),
        nul_text,
        huge_text,
    ),
    "messages": st.one_of(
        st.just([]),
        st.just("not a list"),
        st.integers(),
        st.lists(other_types, min_size=1, max_size=2),
        st.lists(
            st.fixed_dictionaries({"role": odd_text, "content": st.just("x")}), min_size=1
        ).filter(
            lambda ms: any(m["role"] not in ("system", "user", "assistant", "tool") for m in ms)
        ),
        st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": other_types}), min_size=1
        ).filter(lambda ms: not all(isinstance(m["content"], str) for m in ms)),
        st.just([{"role": "user", "content": "x", "extra": 1}]),
        st.just([{"role": "user"}]),
        st.builds(lambda t: [{"role": "user", "content": t}], with_text(surrogate)),
        st.builds(lambda t: [{"role": "user", "content": t}], nul_text),
        st.builds(lambda t: [{"role": "user", "content": t}], huge_text),
        st.just([{"role": "user", "content": " "}, {"role": "system", "content": ""}]),
    ),
    "model": st.one_of(
        other_types,
        st.sampled_from(["", " ", "gpt-17", ">=400b", ">=0b", ">=-1b", "a b", "x" * 65]),
        st.sampled_from([">=١٣b", "llama\u00e9", ">=1e3b", "../../etc", "q:*"]),
        with_text(surrogate),
        odd_text.filter(
            lambda t: t.strip() not in ("llama-3.1-8b", "llama-2-13b", "llama-3.1-70b-awq")
        ),
    ),
    "priority": st.one_of(
        st.floats(),
        st.lists(st.integers(), max_size=2),
        st.binary(max_size=4),
        st.booleans(),
        st.integers().filter(lambda n: not 0 <= n <= 2),
        st.sampled_from(["", "urgent", "REALTIME", "3", "²", "9" * 5000, "[/red]", "1.0"]),
        odd_text.filter(lambda t: t not in ("realtime", "standard", "batch", "0", "1", "2")),
    ),
    "tenant": st.one_of(
        other_types,
        st.sampled_from(["", " ", "has space", "a" * 65, "-lead", "t\u00e9", "t\n", "t\x00"]),
        with_text(surrogate),
    ),
    "task_type": st.one_of(
        other_types.filter(lambda v: v is not None),
        st.sampled_from(["", "a b", "x" * 65, "ch\u00e4t", "chat\n"]),
    ),
    "max_tokens": bad_numbers.filter(
        lambda v: not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1000)
    ),
    "timeout": bad_numbers,
    "deadline": st.one_of(
        bad_numbers,
        st.floats(1.0, 1.7e9),  # the past
        st.floats(1e10, 1e300),  # centuries ahead
    ),
    "idempotency_key": st.one_of(
        other_types.filter(lambda v: v is not None),
        st.sampled_from(["", " ", "a b", "k" * 129, "caf\u00e9", "tab\t"]),
        with_text(surrogate),
    ),
    "params": st.one_of(
        st.integers(),
        st.text(max_size=3),
        st.lists(st.integers(), max_size=2),
        st.builds(lambda v: {"temperature": v}, st.sampled_from([math.nan, math.inf, -math.inf])),
        st.builds(lambda v: {"stop": v}, st.one_of(st.builds(object), st.sets(st.integers()))),
        st.builds(lambda t: {"stop": t}, with_text(surrogate)),
        st.just({"stop": "x" * 20_000}),
        st.just({(1, 2): "tuple key"}),
        st.integers(33, 3000).map(_nested),
    ),
    "surplus": st.sampled_from(["temperature", "callback", "now_", "id", "attempts"]),
}

VALID: dict[str, Any] = {
    "model": "llama-3.1-8b",
    "priority": "standard",
    "tenant": "acme",
    "task_type": "chat",
    "max_tokens": 16,
    "timeout": 30.0,
    "idempotency_key": "order-17",
    "params": {"temperature": 0.2},
}


@st.composite
def submissions(draw: st.DrawFn) -> tuple[dict[str, Any], set[str]]:
    """Keyword arguments of one submission and the names of its broken fields (>= 1)."""
    broken = draw(st.sets(st.sampled_from(sorted(BAD)), min_size=1, max_size=3))
    kwargs: dict[str, Any] = {}
    for name, value in VALID.items():
        if draw(st.booleans()) or name in broken:
            kwargs[name] = draw(BAD[name]) if name in broken else value
    if "deadline" in broken:
        kwargs.pop("timeout", None)
        kwargs["deadline"] = draw(BAD["deadline"])
    if "messages" in broken:
        kwargs["messages"] = draw(BAD["messages"])
        broken.discard("prompt")
    else:
        kwargs["prompt"] = draw(BAD["prompt"]) if "prompt" in broken else "Say hello"
    if "surplus" in broken:
        kwargs[draw(BAD["surplus"])] = 1
    return kwargs, broken


def names_a_broken_field(field: str, broken: set[str]) -> bool:
    """True when a refusal's field is one of the broken ones (``messages.0.content`` too)."""
    head = field.split(".", 1)[0]
    if head in broken:
        return True
    return "surplus" in broken and head not in VALID and head not in ("prompt", "messages")


@pytest.fixture
def fuzz_settings(namespace: str) -> Settings:
    return Settings.load(
        redis_url=REDIS_URL, namespace=namespace, max_prompt_bytes=MAX_PROMPT_BYTES
    )


def assert_namespace_empty(client: redis.Redis, namespace: str) -> None:
    """Nothing written: none of the keys an accepted submission always creates exists.

    (Cheap enough for every example on a shared Redis; the full SCAN of the namespace
    runs once per test, in :func:`no_key_left`.)
    """
    keys = Keys(namespace)
    written = [keys.stats, keys.events, keys.deadlines, keys.queues, keys.counts, keys.wake]
    assert client.exists(*written) == 0, [k for k in written if client.exists(k)]


@pytest.fixture
def no_key_left(namespace: str, redis_client: redis.Redis) -> Iterator[None]:
    """After each test (all its examples): the namespace holds no key at all."""
    yield
    leaked = list(redis_client.scan_iter(match=f"inferq:{namespace}:*", count=10_000))
    leaked += list(redis_client.scan_iter(match=f"rq:*{namespace}*", count=10_000))
    assert leaked == [], leaked


# --- the client ----------------------------------------------------------------------


@pytest.mark.usefixtures("no_key_left")
@FUZZ
@given(case=submissions())
def test_client_submit_refuses_every_malformed_submission(
    case: tuple[dict[str, Any], set[str]], fuzz_settings: Settings, redis_client: redis.Redis
) -> None:
    kwargs, broken = dict(case[0]), case[1]
    client = Client(settings=fuzz_settings, connection=redis_client)
    prompt = kwargs.pop("prompt", None)
    with pytest.raises(InvalidRequest) as info:
        client.submit(prompt, **kwargs)
    assert names_a_broken_field(info.value.field, broken), (info.value, broken)
    assert info.value.reason and "\n" not in str(info.value)
    assert_namespace_empty(redis_client, fuzz_settings.namespace)


@pytest.mark.usefixtures("no_key_left")
@hsettings(FUZZ, max_examples=100)
@given(
    cases=st.lists(submissions(), min_size=1, max_size=3),
    valid_before=st.integers(0, 3),
)
def test_submit_many_refuses_the_batch_and_names_the_item(
    cases: list[tuple[dict[str, Any], set[str]]],
    valid_before: int,
    fuzz_settings: Settings,
    redis_client: redis.Redis,
) -> None:
    items: list[Any] = [{"prompt": f"fine {i}", "max_tokens": 4} for i in range(valid_before)]
    items += [kwargs for kwargs, _ in cases]
    client = Client(settings=fuzz_settings, connection=redis_client)
    with pytest.raises(InvalidRequest) as info:
        client.submit_many(items)
    index, _, field = info.value.field.removeprefix("items[").partition("].")
    assert int(index) == valid_before, info.value  # the first bad item is named
    assert names_a_broken_field(field, cases[0][1]), (info.value, cases[0][1])
    assert_namespace_empty(redis_client, fuzz_settings.namespace)


@pytest.mark.usefixtures("no_key_left")
@pytest.mark.parametrize(
    ("items", "field"),
    [
        (None, "items"),
        (5, "items"),
        ({"prompt": "one dict, not a list"}, "items"),
        ("a string", "items"),
        ([{"prompt": "ok"}, "not a mapping"], "items[1]"),
        ([{"prompt": "ok"}, {1: "non-string key"}], "items[1]"),
    ],
)
def test_submit_many_refuses_containers_of_the_wrong_shape(
    items: Any, field: str, fuzz_settings: Settings, redis_client: redis.Redis
) -> None:
    client = Client(settings=fuzz_settings, connection=redis_client)
    with pytest.raises(InvalidRequest) as info:
        client.submit_many(items)
    assert info.value.field == field
    assert_namespace_empty(redis_client, fuzz_settings.namespace)


def _self_referencing() -> dict[str, Any]:
    params: dict[str, Any] = {}
    params["again"] = params
    return params


@pytest.mark.usefixtures("no_key_left")
@pytest.mark.parametrize(
    ("fields", "field"),
    [  # values that once escaped as TypeError/ValueError/OverflowError/RecursionError
        ({"deadline": 10**300}, "deadline"),
        ({"timeout": 10**5000}, "timeout"),
        ({"timeout": 3e-125}, "timeout"),
        ({"max_tokens": 10**5000}, "max_tokens"),
        ({"priority": "9" * 5000}, "priority"),
        ({"priority": "\u00b2"}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"priority": [0]}, "priority"),
        ({"prompt": "a\ud800b"}, "prompt"),
        ({"messages": [{"role": "user", "content": "\x00"}]}, "messages.0.content"),
        ({"params": {"stop": "\udfff"}}, "params"),
        ({"params": _nested(5000)}, "params"),
        ({"params": _self_referencing()}, "params"),
        ({"tenant": b"acme"}, "tenant"),
        ({"idempotency_key": b"k"}, "idempotency_key"),
        ({"model": ">=\u0661\u0663b"}, "model"),
        ({"temperature": 0.2}, "temperature"),
    ],
)
def test_hostile_values_found_by_fuzzing(
    fields: dict[str, Any], field: str, fuzz_settings: Settings, redis_client: redis.Redis
) -> None:
    client = Client(settings=fuzz_settings, connection=redis_client)
    fields = dict(fields)
    prompt = fields.pop("prompt", None if "messages" in fields else "hello")
    with pytest.raises(InvalidRequest) as info:
        client.submit(prompt, **fields)
    assert info.value.field == field and len(str(info.value)) < 300, info.value
    assert_namespace_empty(redis_client, fuzz_settings.namespace)


@pytest.mark.usefixtures("no_key_left")
@hsettings(FUZZ, max_examples=40)
@given(case=submissions())
def test_async_client_refuses_every_malformed_submission(
    case: tuple[dict[str, Any], set[str]], fuzz_settings: Settings, redis_client: redis.Redis
) -> None:
    kwargs, broken = case
    fields = {k: v for k, v in kwargs.items() if k != "prompt"}

    async def submit() -> InvalidRequest:
        async with AsyncClient(settings=fuzz_settings) as client:
            with pytest.raises(InvalidRequest) as info:
                await client.submit(kwargs.get("prompt"), **fields)
            with pytest.raises(InvalidRequest) as many:
                await client.submit_many([{"prompt": "fine"}, kwargs])
            assert many.value.field.startswith("items[1].")
            return info.value

    err = asyncio.run(submit())
    assert names_a_broken_field(err.field, broken), (err, broken)
    assert_namespace_empty(redis_client, fuzz_settings.namespace)


# --- inferq submit ---------------------------------------------------------------------

#: CLI option of each field that ``inferq submit`` takes.
OPTIONS = {
    "model": "--model",
    "priority": "--priority",
    "tenant": "--tenant",
    "task_type": "--task-type",
    "max_tokens": "--max-tokens",
    "timeout": "--timeout",
    "idempotency_key": "--idempotency-key",
}
CLI_VALID = {
    "model": "llama-3.1-8b",
    "priority": "batch",
    "tenant": "acme",
    "task_type": "chat",
    "max_tokens": "16",
    "timeout": "30",
    "idempotency_key": "k-1",
}
cli_text = st.one_of(
    st.text(max_size=12),
    odd_text,
    with_text(surrogate),
    nul_text,
    st.sampled_from(["-1", "0", "nan", "inf", "-inf", "1e400", "1e-300", "9" * 400, "[/red]"]),
)


@st.composite
def cli_submissions(draw: st.DrawFn) -> tuple[list[str], set[str]]:
    """``inferq submit`` arguments with at least one broken value, and the broken fields."""
    fields = ["prompt", *OPTIONS]
    broken = draw(st.sets(st.sampled_from(fields), min_size=1, max_size=2))
    args: list[str] = []
    for name, option in OPTIONS.items():
        if name in broken:
            args += [option, draw(cli_text.filter(lambda t, n=name: _cli_bad(n, t)))]
        elif draw(st.booleans()):
            args += [option, CLI_VALID[name]]
    prompt = (
        draw(BAD["prompt"].filter(lambda v: isinstance(v, str))) if "prompt" in broken else "hi"
    )
    return [*args, "--", prompt], broken


def _cli_bad(name: str, text: str) -> bool:
    """True when ``text`` given for ``name`` is refused (by click's type or by intake)."""
    value: Any = text
    try:
        if name == "max_tokens":
            value = int(text)
        elif name == "timeout":
            value = float(text)
    except ValueError:
        return True
    try:
        build_request(ORACLE, prompt="hi", **{name: value})
    except InvalidRequest:
        return True
    return False


ORACLE = Settings.load(max_prompt_bytes=MAX_PROMPT_BYTES)


@pytest.mark.usefixtures("no_key_left")
@hsettings(FUZZ, max_examples=120)
@given(case=cli_submissions())
def test_cli_submit_refuses_with_one_line_naming_the_field(
    case: tuple[list[str], set[str]], namespace: str, redis_client: redis.Redis
) -> None:
    args, broken = case
    result = CliRunner().invoke(
        cli,
        ["--redis-url", REDIS_URL, "--namespace", namespace, "submit", *args],
        env={"INFERQ_MAX_PROMPT_BYTES": str(MAX_PROMPT_BYTES)},
    )
    assert isinstance(result.exception, SystemExit), result.exception  # never a traceback
    output = result.output
    if result.exit_code == 2:  # click's own type check (--max-tokens abc): names the option
        assert any(f"'{OPTIONS[f]}'" in output for f in broken if f in OPTIONS), output
    else:
        assert result.exit_code == 1, output
        line = output.strip()
        assert "\n" not in line and line.startswith("error: "), output
        field = line.removeprefix("error: ").split(":", 1)[0]
        assert names_a_broken_field(field, broken), (output, broken)
    assert "Traceback" not in output
    assert_namespace_empty(redis_client, namespace)


@pytest.mark.usefixtures("no_key_left")
def test_cli_refuses_a_bad_prompt_on_stdin(run_cli: Any, redis_client: redis.Redis) -> None:
    run, namespace = run_cli
    for text, reason in (("", "must not be empty"), ("a\x00b", "NUL"), ("é" * 3000, "bytes")):
        result = run("submit", input=text)
        assert result.exit_code == 1 and result.output.startswith("error: prompt: "), result.output
        assert reason in result.output
    assert_namespace_empty(redis_client, namespace)


@pytest.fixture
def run_cli(namespace: str) -> tuple[Any, str]:
    runner = CliRunner()

    def invoke(*args: str, input: str | None = None) -> Any:
        return runner.invoke(
            cli,
            ["--redis-url", REDIS_URL, "--namespace", namespace, *args],
            input=input,
            env={"INFERQ_MAX_PROMPT_BYTES": str(MAX_PROMPT_BYTES)},
        )

    return invoke, namespace


# --- limits: oversized prompts and one tenant's flood --------------------------------


@pytest.fixture
def limited(namespace: str, redis_client: redis.Redis) -> Client:
    """standard: 8 queued at most, 5 per tenant; prompts up to 2,000 bytes."""
    base = Settings.load(redis_url=REDIS_URL, namespace=namespace)
    classes = [
        c.model_copy(update={"queue_limit": 8, "tenant_queue_limit": 5})
        if c.name == "standard"
        else c
        for c in base.classes
    ]
    settings = Settings.load(
        redis_url=REDIS_URL,
        namespace=namespace,
        classes=[c.model_dump() for c in classes],
        max_prompt_bytes=MAX_PROMPT_BYTES,
    )
    return Client(settings=settings, connection=redis_client)


def queued(client: Client, tenant: str, cls: str = "standard") -> int:
    value = client.store.redis.hget(client.store.keys.counts, f"t:{cls}:{tenant}")
    return int(value or 0)


def test_one_tenants_flood_hits_its_limit_and_others_go_on(limited: Client) -> None:
    for i in range(5):
        limited.submit(f"flood {i}", tenant="flood", priority="standard")
    with pytest.raises(QueueFull) as info:
        limited.submit("one too many", tenant="flood", priority="standard")
    err = info.value
    assert (err.priority, err.tenant, err.limit) == ("standard", "flood", 5)
    assert "tenant 'flood' in class 'standard'" in str(err) and "limit 5" in str(err)
    with pytest.raises(BatchRefused) as batch:
        limited.submit_many({"prompt": "more", "tenant": "flood"} for _ in range(3))
    assert batch.value.accepted == [] and len(batch.value.refused) == 3
    assert queued(limited, "flood") == 5  # refusals wrote nothing
    # Another tenant of the same class, and the same tenant in another class, go on.
    limited.submit("quiet one", tenant="quiet", priority="standard")
    limited.submit("urgent", tenant="flood", priority="realtime")
    assert (queued(limited, "quiet"), queued(limited, "flood", "realtime")) == (1, 1)


def test_the_class_limit_names_the_class_and_spares_other_classes(limited: Client) -> None:
    for i in range(8):
        limited.submit(f"r{i}", tenant=f"t{i % 4}", priority="standard")
    with pytest.raises(QueueFull) as info:
        limited.submit("late", tenant="newcomer", priority="standard")
    assert (info.value.priority, info.value.tenant, info.value.limit) == ("standard", None, 8)
    assert str(info.value).startswith("queue full: class 'standard' already has 8 queued")
    assert limited.submit("batch work", tenant="newcomer", priority="batch").id


def test_oversized_prompts_are_refused_before_redis_and_others_go_on(
    limited: Client, namespace: str
) -> None:
    keys = limited.store.keys
    with pytest.raises(InvalidRequest) as info:
        limited.submit("€" * 700, tenant="big")  # 2,100 bytes of UTF-8
    assert str(info.value) == (
        "prompt: 2100 bytes exceeds the limit of 2000 bytes (max_prompt_bytes)"
    )
    messages = [{"role": "user", "content": "x" * 1500}, {"role": "user", "content": "y" * 600}]
    with pytest.raises(InvalidRequest, match=r"^messages: 2101 bytes exceeds the limit of 2000"):
        limited.submit(messages=messages, tenant="big")
    assert list(limited.store.redis.scan_iter(match=keys.pattern())) == []
    assert limited.submit("x" * 2000, tenant="big").id  # exactly at the limit is fine
    assert limited.submit("small", tenant="other").id
