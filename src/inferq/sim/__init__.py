"""Discrete-event simulation of a fleet, in virtual time, through the production policies.

Modules: :mod:`~inferq.sim.workload` (trace rows -> requests),
:mod:`~inferq.sim.fleet` (simulated workers), :mod:`~inferq.sim.policies`
(the five named policies), :mod:`~inferq.sim.deployment` (what is simulated),
:mod:`~inferq.sim.engine` (the event loop), :mod:`~inferq.sim.loads` (the
scaler's inputs), :mod:`~inferq.sim.result` (what a run produces),
:mod:`~inferq.sim.capacity` (sustainable rate, peak fleet) and
:mod:`~inferq.sim.report` (metrics, table, JSON, PNG). ``inferq simulate`` is
the command line; :func:`replay` the shortest way in from Python.
"""

from inferq.sim.deployment import SimConfig, fixed_latency
from inferq.sim.engine import replay, simulate
from inferq.sim.policies import POLICIES, SimPolicy
from inferq.sim.result import AssignmentRecord, RequestOutcome, SimResult
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
