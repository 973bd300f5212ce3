"""kvlab.invariants: the spec's nine engine invariants (rule 11) and their monitor (chapter 12).

:mod:`.spec_invariants` holds the set and :class:`InvariantMonitor`, reading the public state
of :mod:`.view`; :mod:`.install_audit` is invariant 8's independent record of P/D installs;
:func:`check_every_step` attaches the set to a real engine as an observer (it loads torch; the
rest is torch-free, so the simulator's chaos runs use it too). The engine never imports this
package: the KV manager's and the engine's own self-checks (``check_invariants()``) live with
their owners.
"""

from kvlab._lazy import lazy_exports

from .install_audit import InstallAudit
from .spec_invariants import SPEC_INVARIANTS, Invariant, InvariantMonitor
from .view import EngineView, InvariantViolation

__getattr__, __dir__ = lazy_exports(__name__, globals(), {
    "EveryStep": ".every_step", "check_every_step": ".every_step"})

__all__ = ["SPEC_INVARIANTS", "EngineView", "EveryStep", "InstallAudit", "Invariant",
           "InvariantMonitor", "InvariantViolation", "check_every_step"]
