"""kvlab.disagg: prefill/decode disaggregation, the torch-free half (chapter 10).

What an entry of transferred KV is and how a consumer decides to install it (:mod:`.entry`),
the scheduler that parks requests for remote KV and installs it (:mod:`.remote_kv_scheduler`,
over the seams of :mod:`.interfaces`), the in-process transport (:mod:`.channel`), the install
journal and its recovery (:mod:`.install_journal`), and seeded transfer faults
(:mod:`.transfer_faults`). It imports :mod:`kvlab.core`, never the reverse; the tensors and the
connectors are :mod:`kvlab.engine.kv_transfer`.
"""

from kvlab.disagg.channel import EntryExporter, Inbox, InProcessChannel
from kvlab.disagg.entry import Delivery, check_delivery, decode_frame, encode_frame, make_descriptor
from kvlab.disagg.install_journal import InstallJournal, recover_installs
from kvlab.disagg.interfaces import KVExporter, KVSource, KVWriter, RemoteKVPolicy, TransferDecision
from kvlab.disagg.remote_kv_scheduler import RemoteKVScheduler
from kvlab.disagg.transfer_faults import Fault, FaultSchedule, TransferFaultInjector

__all__ = [
    "Delivery",
    "EntryExporter",
    "Fault",
    "FaultSchedule",
    "InProcessChannel",
    "Inbox",
    "InstallJournal",
    "KVExporter",
    "KVSource",
    "KVWriter",
    "RemoteKVPolicy",
    "RemoteKVScheduler",
    "TransferDecision",
    "TransferFaultInjector",
    "check_delivery",
    "decode_frame",
    "encode_frame",
    "make_descriptor",
    "recover_installs",
]
