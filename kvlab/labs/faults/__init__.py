"""kvlab.labs.faults: seeded faults at named points of the one step loop (chapter 12).

:mod:`.step_faults` holds the schedule (plain data, replayable from its seed) and
:class:`StepFaultInjector`, an observer the simulator's chaos runs drive;
:func:`attach_faults` puts it on a real engine (it loads torch). Faults on KV transfer are
:mod:`kvlab.disagg.transfer_faults`. The engine never imports this package.
"""

from kvlab._lazy import lazy_exports
from kvlab.labs.faults.step_faults import (
    STEP_FAULTS,
    InjectedFault,
    StepFault,
    StepFaultInjector,
    StepFaultSchedule,
)

__getattr__, __dir__ = lazy_exports(__name__, globals(), {
    "EngineFaults": "kvlab.labs.faults.engine_faults",
    "attach_faults": "kvlab.labs.faults.engine_faults",
    "ENGINE_FAULTS": "kvlab.labs.faults.engine_faults"})

__all__ = ["ENGINE_FAULTS", "STEP_FAULTS", "EngineFaults", "InjectedFault",
           "StepFault", "StepFaultInjector", "StepFaultSchedule", "attach_faults"]
