"""A producer engine as its own OS process: ``python -m kvlab.labs.pd.producer_main``.

Arguments: ``--port`` (the consumer's TCP port on the loopback), ``--prompts`` (JSON list of
token-id lists), ``--faults`` (JSON of a :class:`~kvlab.disagg.transfer_faults.FaultSchedule`),
``--block-size``. It prefills every prompt (``max_tokens=1``), exports the KV over TCP, and
prints one JSON line: its pid, the transfer counters, the faults it applied and, per exported
entry, the request id and the seconds since start when it was sent.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main(argv: list[str] | None = None) -> dict:
    from kvlab.core.sampling_params import SamplingParams
    from kvlab.engine.llm import LLM

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--faults", default='{"faults": []}')
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--model", default="kvlab-tiny")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    llm = LLM(args.model, block_size=args.block_size, num_blocks=256, kv_transfer_config={
        "kv_connector": "tcp", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"port": args.port,
                                      "fault_schedule": json.loads(args.faults)}})
    loaded = time.perf_counter() - t0
    llm.generate(json.loads(args.prompts), SamplingParams(max_tokens=1, temperature=0.0),
                 use_tqdm=False)
    kt = llm.engine.kv_transfer
    kt.flush()
    exports = [d.request_id for d in kt.scheduler.decisions if d.kind == "exported"]
    report = {"pid": os.getpid(), "stats": kt.stats, "applied": kt.injector.applied,
              "exports": exports, "load_s": loaded, "total_s": time.perf_counter() - t0}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
