"""Discrete-event simulation of a fleet, in virtual time, through the production policies.

Modules: :mod:`~inferq.sim.workload` (trace rows -> requests),
:mod:`~inferq.sim.fleet` (simulated workers), :mod:`~inferq.sim.policies`
(the five named policies), :mod:`~inferq.sim.engine` (the event loop),
:mod:`~inferq.sim.capacity` (sustainable rate, peak fleet) and
:mod:`~inferq.sim.report` (metrics, table, JSON, PNG). ``inferq simulate`` is
the command line; :func:`replay` the shortest way in from Python.
"""

from inferq.sim.engine import (
    AssignmentRecord,
    RequestOutcome,
    SimConfig,
    SimResult,
    fixed_latency,
    replay,
    simulate,
)
from inferq.sim.policies import POLICIES, SimPolicy
from inferq.sim.workload import SimRequest, build_requests

__all__ = [
    "POLICIES",
    "AssignmentRecord",
    "RequestOutcome",
    "SimConfig",
    "SimPolicy",
    "SimRequest",
    "SimResult",
    "build_requests",
    "fixed_latency",
    "replay",
    "simulate",
]
