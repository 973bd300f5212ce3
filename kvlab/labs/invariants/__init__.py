"""kvlab.labs.invariants: checks run from outside the engine (chapters 3-5 and 12).

:mod:`.structural` checks the KV manager (pool, radix tree, tables, locks) and a scheduler's
queues: :func:`check_kv_manager`, :func:`check_scheduler`; :func:`check_engine` (:mod:`.engine`)
adds the engine's bookkeeping (runner tables, sampler and grammar states). :mod:`.spec_invariants`
holds the spec's nine engine invariants (rule 11) and :class:`InvariantMonitor`, reading the
public state of :mod:`.view`; :mod:`.install_audit` is invariant 8's independent record of P/D
installs; :func:`check_every_step` attaches the set to a real engine as an observer (it loads
torch; the rest is torch-free, so the chaos labs use it too). The engine never imports this
package.
"""

from kvlab._lazy import lazy_exports
from kvlab.labs.invariants.engine import check_engine
from kvlab.labs.invariants.install_audit import InstallAudit
from kvlab.labs.invariants.spec_invariants import (
    SPEC_INVARIANTS,
    Invariant,
    InvariantMonitor,
    InvariantViolation,
)
from kvlab.labs.invariants.structural import check_kv_manager, check_scheduler
from kvlab.labs.invariants.view import EngineView

__getattr__, __dir__ = lazy_exports(__name__, globals(), {
    "EveryStep": "kvlab.labs.invariants.every_step",
    "check_every_step": "kvlab.labs.invariants.every_step"})

__all__ = ["SPEC_INVARIANTS", "EngineView", "EveryStep", "InstallAudit", "Invariant",
           "InvariantMonitor", "InvariantViolation", "check_engine", "check_every_step",
           "check_kv_manager", "check_scheduler"]
