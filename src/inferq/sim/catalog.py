"""Every named workload of ``inferq simulate --scenario``: the modules that register
scenarios are imported here (and only here), then looked up by name.
"""

from __future__ import annotations

from inferq.errors import ConfigError
from inferq.sim import adversarial, shapes  # noqa: F401  (register their scenarios)
from inferq.sim.scenarios import SCENARIOS, Scenario, ScenarioContext, ScenarioWorkload


def scenario_names() -> list[str]:
    """Every registered scenario name, with its arguments' shape (``sinusoid:PERIOD:AMP``)."""
    return [f"{s.name}:{s.params}" if s.params else s.name for s in SCENARIOS.values()]


def adversarial_names() -> list[str]:
    """The hostile mixes (:mod:`inferq.sim.adversarial`), in registration order."""
    return [s.name for s in SCENARIOS.values() if s.build.__module__ == adversarial.__name__]


def build_scenario(text: str, context: ScenarioContext) -> tuple[Scenario, ScenarioWorkload]:
    """Parse ``NAME[:ARG...]`` and build its workload.

    Raises:
        ConfigError: unknown name (the message lists the known ones), a malformed
            argument, or a workload with no requests.
    """
    name, *args = text.strip().split(":")
    found = SCENARIOS.get(name)
    if found is None:
        raise ConfigError(
            f"scenario: unknown scenario {name!r} (known: {', '.join(scenario_names())})"
        )
    workload = found.build(context, args)
    if not workload.requests:
        raise ConfigError(f"scenario: {text!r} produced no requests")
    return found, workload
