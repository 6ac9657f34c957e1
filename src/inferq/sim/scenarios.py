"""Named workloads for ``inferq simulate --scenario NAME[:ARG[:ARG...]]``.

A scenario is a workload that stands for a kind of situation a policy must
survive — a lower class holding every slot, one tenant flooding a class, a rate
that swings through the day — built deterministically from the settings, a
seed and its arguments. It may bring its own fleet (a one-worker scenario must
not be diluted by the default four workers) and names the tenants and classes
its verdict is about (``watch_tenants``), so every policy is compared on the
same terms.

Adding a scenario is one decorated builder in one of the modules that register
them (:mod:`inferq.sim.adversarial` for hostile mixes; rate shapes live beside
it), listed once in :mod:`inferq.sim.catalog`, which the command line asks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from inferq import defaults
from inferq.config import Settings
from inferq.errors import ConfigError
from inferq.sim.deployment import SimConfig, default_fleet
from inferq.sim.workload import SimRequest


@dataclass(frozen=True, slots=True)
class ScenarioContext:
    """What a builder may use.

    Attributes:
        settings: classes and the model registry.
        seed: the run's seed (every random draw of a builder derives from it).
        duration_s: ``--duration`` when given (a builder may ignore it), seconds.
        tenants: ``--tenants`` (Zipf-drawn tenants of trace rows).
    """

    settings: Settings
    seed: int = 0
    duration_s: float | None = None
    tenants: int = 20


@dataclass(frozen=True, slots=True)
class ScenarioWorkload:
    """A scenario's requests and the fleet it is meant for.

    Attributes:
        requests: in arrival order, ids as :func:`inferq.sim.workload.request_id`.
        fleet: initial warm workers, model -> count (None: ``--fleet``).
        slots: slots per worker (None: ``--slots``).
        vram_mib: VRAM per card, MiB (None: ``--vram-mib``).
        max_workers: scaler bound per model (None: ``--max-workers``).
        watch_tenants: tenants whose waits the verdict is about (reported apart).
        note: one line saying what the scenario checks and what a good policy does.
    """

    requests: list[SimRequest]
    fleet: Mapping[str, int] | None = None
    slots: int | None = None
    vram_mib: int | None = None
    max_workers: int | None = None
    watch_tenants: tuple[str, ...] = ()
    note: str = ""

    def sim_config(self, settings: Settings, *, check: bool = False) -> SimConfig:
        """The deployment the scenario is meant for: its fleet, slots, card and scaler
        bound, the simulator's defaults (``defaults.SIM_*``) where it names none."""
        return SimConfig(
            settings=settings,
            fleet=dict(self.fleet) if self.fleet is not None else default_fleet(),
            slots=self.slots or defaults.SIM_WORKER_SLOTS,
            vram_mib=self.vram_mib or defaults.SIM_VRAM_MIB,
            max_workers=self.max_workers or defaults.SCALE_MAX_WORKERS,
            check=check,
        )


Builder = Callable[[ScenarioContext, Sequence[str]], ScenarioWorkload]


@dataclass(frozen=True, slots=True)
class Scenario:
    """A named workload.

    Attributes:
        name: what ``--scenario`` takes (letters, digits, ``-``).
        summary: one line for ``--help`` and the reports.
        build: (context, arguments after the name) -> workload; raises
            ConfigError naming the argument when one is malformed.
        params: the arguments' shape for help texts, e.g. ``PERIOD_S:AMPLITUDE``.
    """

    name: str
    summary: str
    build: Builder
    params: str = ""


SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, summary: str, *, params: str = "") -> Callable[[Builder], Builder]:
    """Register the decorated builder as scenario ``name``.

    Raises:
        ValueError: ``name`` is registered already (a programming error).
    """

    def register(build: Builder) -> Builder:
        if name in SCENARIOS:
            raise ValueError(f"scenario {name!r} is registered twice")
        SCENARIOS[name] = Scenario(name, summary, build, params)
        return build

    return register


def expect_args(name: str, args: Sequence[str], count: int, shape: str) -> None:
    """Check a builder got ``count`` arguments.

    Raises:
        ConfigError: naming the scenario and the expected shape.
    """
    if len(args) != count:
        raise ConfigError(f"scenario {name}: takes {shape or 'no arguments'}, got {list(args)}")
