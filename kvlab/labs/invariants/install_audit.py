"""An independent audit of P/D installs: the records invariant 8 reads.

The consumer (:class:`~kvlab.disagg.remote_kv_scheduler.RemoteKVScheduler`) checks every
delivery before it installs it. Invariant 8 must not trust that check, since it is the thing
under test. So :class:`InstallAudit` keeps its own copy of what arrived: wrap the consumer's KV
source with :meth:`InstallAudit.source` and every delivery is recorded by entry id. After each
step, :meth:`InstallAudit.records` turns each new ``installed`` decision of the consumer into
``(request id, entry id, problem)``, where ``problem`` is this audit's own verdict
(:func:`~kvlab.disagg.entry.check_delivery` against an expectation rebuilt from the request
and the engine's model fields: prompt hash, security domain, model version, shapes, ...), or
``""`` when the entry was fit to install. An install of an entry that never arrived through the
source is a problem too. The records go into
:attr:`~kvlab.labs.invariants.spec_invariants.EngineView.installs`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvlab.disagg.entry import Delivery, check_delivery, make_descriptor
from kvlab.disagg.interfaces import scope_domain

__all__ = ["InstallAudit"]


class _RecordingSource:
    """A KV source that remembers every delivery it hands out (by entry id)."""

    def __init__(self, inner: Any, audit: InstallAudit) -> None:
        self.inner, self.audit = inner, audit

    def fetch(self, keys: Sequence[str]) -> list[Delivery]:
        deliveries = self.inner.fetch(keys)
        for d in deliveries:
            self.audit.seen.setdefault(d.entry_id, []).append(d)
        return deliveries

    def wait(self, timeout: float) -> None:
        self.inner.wait(timeout)


class InstallAudit:
    """Records deliveries and audits install decisions (module docstring).

    ``model_fields``: the consumer's descriptor fields (its :class:`RemoteKVPolicy`'s).
    """

    def __init__(self, model_fields: Mapping[str, Any]) -> None:
        self.model_fields = dict(model_fields)
        self.seen: dict[str, list[Delivery]] = {}
        self.audited = 0
        self._done: set[tuple[int, str, str]] = set()

    def source(self, inner: Any) -> Any:
        """``inner`` (a KVSource), recording what it delivers."""
        return _RecordingSource(inner, self)

    def verdict(self, request: Any, entry_id: str) -> str:
        """Why an install of ``entry_id`` for ``request`` was wrong ("" if it was fine)."""
        deliveries = self.seen.get(entry_id)
        if not deliveries:
            return "no such entry was ever delivered"
        expected = make_descriptor(request.request_id, request.prompt_token_ids,
                                   scope_domain(request.scope), self.model_fields)
        expected.pop("request_id")
        problems = [check_delivery(d, expected) for d in deliveries]
        if any(p is None for p in problems):
            return ""
        return f"the delivered entry is {problems[0]}"

    def records(self, scheduler: Any) -> list[tuple[str, str, str]]:
        """``(request id, entry id, problem)`` for every install decided since the last call."""
        out = []
        for d in list(scheduler.decisions):
            if d.kind != "installed":
                continue
            key = (d.step, d.request_id, d.entry_id)
            if key in self._done:
                continue
            self._done.add(key)
            request = scheduler.find_request(d.request_id)
            if request is None:
                out.append((d.request_id, d.entry_id, "the request is unknown"))
                continue
            out.append((d.request_id, d.entry_id, self.verdict(request, d.entry_id)))
            self.audited += 1
        return out
