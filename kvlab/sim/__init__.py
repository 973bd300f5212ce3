"""kvlab.sim: cost-model executor and workload generators (no torch).

The same schedulers and KV manager the engine uses, driven on a simulated clock whose steps
cost what a roofline model of a named GPU and model says (:mod:`.costmodel`), over synthetic
workloads (:mod:`.workload`). :mod:`.static_batching` is the request-level baseline of Orca's
comparison; :mod:`.tokens` is a deterministic stand-in for a model used by tests and chapters.
"""

from kvlab.sim.costmodel import RooflineCostModel, StepCost
from kvlab.sim.executor import RequestRecord, SimClock, SimResult, StepRecord, simulate
from kvlab.sim.static_batching import StaticBatchScheduler
from kvlab.sim.tokens import drive, greedy_tokens, hash_token
from kvlab.sim.workload import (
    RequestSpec,
    fixed,
    lognormal,
    make_workload,
    poisson_arrivals,
    to_request,
    uniform,
)

__all__ = [
    "RequestRecord",
    "RequestSpec",
    "RooflineCostModel",
    "SimClock",
    "SimResult",
    "StaticBatchScheduler",
    "StepCost",
    "StepRecord",
    "drive",
    "fixed",
    "greedy_tokens",
    "hash_token",
    "lognormal",
    "make_workload",
    "poisson_arrivals",
    "simulate",
    "to_request",
    "uniform",
]
