"""``kvlab bench`` against a server kvlab did not write: ``transformers serve`` on the shipped
checkpoint (CPU, offline). Its defaults (token-id prompts, vLLM's ``ignore_eos``) are refused
there: bench must exit non-zero and print the server's error with the flag that helps; with
text prompts it must finish every request with the same greedy text as kvlab's engine."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi", reason="transformers serve needs transformers[serving]")

from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm_engine import LLMEngine
from kvlab.entrypoints import bench
from kvlab.entrypoints.load_client import plan_requests

ROOT = Path(__file__).resolve().parents[1]
CKPT = str(ROOT / "kvlab" / "models" / "kvlab-tiny")
SEEN: dict[str, str] = {}


def record(prompt, text: str) -> bool:
    """bench's --quality-check hook: remember each answer's streamed text."""
    SEEN[prompt] = text
    return True


@pytest.fixture(scope="module")
def hf_server():
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("no transformers CLI")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen([exe, "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning", CKPT], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600     # a readiness wait, not a speed assertion
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "transformers serve did not come up"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def test_bench_defaults_fail_loudly_against_transformers_serve(hf_server, capsys):
    rc = bench.main(["--base-url", hf_server, "--model", CKPT, "--num-prompts", "2",
                     "--input-len", "fixed:6", "--output-len", "fixed:4", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "2 of 2 requests failed" in err and "ignore_eos" in err and "--no-ignore-eos" in err


def test_bench_text_prompts_get_kvlab_greedy_text_from_transformers_serve(hf_server, capsys):
    args = ["--num-prompts", "4", "--input-len", "fixed:6", "--output-len", "fixed:8",
            "--seed", "5"]
    SEEN.clear()
    rc = bench.main(["--base-url", hf_server, "--model", CKPT, *args, "--text-prompts",
                     "--no-ignore-eos", "--no-progress",
                     "--quality-check", f"{__name__}:record"])
    out = capsys.readouterr().out
    assert rc == 0 and "Successful requests:                    4" in out
    assert int(out.split("Total input tokens:")[1].split()[0]) > 0      # from usage
    plan = plan_requests(4, float("inf"), bench.length_dist("fixed:6"),
                         bench.length_dist("fixed:8"), seed=5, text=True)
    engine = LLMEngine(EngineArgs("kvlab-tiny"))
    for req in plan:
        engine.add_request(req.request_id, req.prompt,
                           SamplingParams(max_tokens=req.output_len, temperature=0))
    want = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                want[o.prompt] = o.outputs[0].text
    assert want == SEEN
