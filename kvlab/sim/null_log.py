"""An event log that keeps nothing: the simulator's write-ahead log.

The schedulers write a write-ahead log (:class:`~kvlab.core.event_log.EventLog`) so that a
crashed engine can be recovered (chapter 5). A simulation never crashes and never recovers, and
sealing a checksummed record for every token is a quarter of a large simulation's time. The
scheduler's decisions never read the log, so a scheduler built with :class:`NullEventLog`
decides exactly what it decides with the real one (a test checks this on random workloads).
"""

from __future__ import annotations

from typing import Any

from kvlab.core.event_log import EVENT_KINDS, Event, EventLog

__all__ = ["NullEventLog"]


class NullEventLog(EventLog):
    """Numbers each event like :class:`EventLog` and returns it unsealed, storing nothing."""

    def append(self, kind: str, request_id: str, data: tuple[Any, ...] = (),
               step: int = 0) -> Event:
        if kind not in EVENT_KINDS or kind == "checkpoint":
            raise ValueError(f"bad event kind {kind!r}")
        index = self.next_index
        self.next_index += 1
        return Event(index, kind, request_id, tuple(data), step)
