"""The seams :class:`~kvlab.core.engine_core.EngineCore` steps over: the :class:`Scheduler` and
:class:`Executor` protocols, and the :class:`StepObserver` hooks the labs attach (none by
default: the invariant monitor, the fault injector and chapter 12's probes are observers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .engine_core import EngineCore, ModelOutput, SchedulerOutput, StepResult
    from .kv_cache_manager import KVCacheManager
    from .request import RuntimeRequest


class Scheduler(Protocol):
    """The scheduler seam of :class:`EngineCore` (``fail_step``: the step in flight could not
    run; fail its requests, release their KV once, and clear the step)."""

    kv: KVCacheManager

    def add_request(self, request: RuntimeRequest) -> None: ...
    def abort_request(self, request_id: str) -> RuntimeRequest | None: ...
    def schedule(self) -> SchedulerOutput: ...
    def update_from_output(self, output: SchedulerOutput,
                           sampled: Mapping[str, int]) -> list[RuntimeRequest]: ...
    def fail_step(self, output: SchedulerOutput, message: str) -> list[RuntimeRequest]: ...
    def has_unfinished_requests(self) -> bool: ...
    def get_request(self, request_id: str) -> RuntimeRequest: ...
    def find_request(self, request_id: str) -> RuntimeRequest | None: ...
    def can_forget(self, request_id: str) -> bool: ...
    def forget(self, request_id: str) -> RuntimeRequest: ...
    def requests(self) -> Sequence[RuntimeRequest]: ...
    def check_invariants(self) -> None: ...


class Executor(Protocol):
    """Runs one step's decisions: copies first, then the chunks, then one sample per
    ``sample=True`` chunk. Must not change scheduler or KV-manager state."""

    def execute(self, output: SchedulerOutput) -> ModelOutput: ...


class StepObserver:
    """Base class of the engine core's observers: override the hooks you need (each default
    does nothing). Observers must not change scheduler state except as their hook allows."""

    def before_execute(self, core: EngineCore, output: SchedulerOutput) -> None:
        """After ``schedule()``, before the executor runs ``output``."""

    def defer_copies(self, core: EngineCore, output: SchedulerOutput) -> bool:
        """Return True to lift ``output.copies``' fences yourself (before the next execute)."""
        return False

    def after_step(self, core: EngineCore, result: StepResult) -> None:
        """After ``update_from_output()`` applied the step."""

    def after_failed_step(self, core: EngineCore, output: SchedulerOutput,
                          error: BaseException) -> None:
        """After the step was failed (the executor raised, or its output was refused)."""
