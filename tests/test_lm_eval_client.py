"""lm-eval-harness, a client nobody here wrote, scores ``kvlab serve`` (issue 21).

Its ``local-completions`` model asks ``/v1/completions`` for ``echo`` with ``logprobs`` and
``max_tokens: 1`` and sums the continuation's token logprobs. A small multiple-choice task (a
JSONL file and a task YAML in tmp_path, no download) is run through its CLI against a real
``kvlab serve`` subprocess; every choice's log-likelihood it reports must equal the sum kvlab
computes offline with ``SamplingParams(prompt_logprobs=...)`` for the same context and
continuation, its ``is_greedy`` the offline argmax test, and its ``acc`` the offline argmax
against the gold index. The gold indices are set from the offline scores so that some items
are right and some wrong: an ``acc`` of 0 or 1 would not tell a reordering apart. Run twice:
with the checkpoint's tokenizer and kvlab's BOS (docs/serving.md's command), and with lm-eval's
default tokenizer backend, which finds the server's ``/tokenizer_info`` and tokenizes through
``/tokenize`` (no BOS: the offline reference then has none either)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_serve import free_port, metric, wait_until

from kvlab import LLM, SamplingParams

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity", reason="local-completions needs lm-eval[api]")
pytest.importorskip("transformers")      # lm-eval's huggingface tokenizer backend

ROOT = Path(__file__).resolve().parents[1]
MODEL = "kvlab-tiny"
CKPT = ROOT / "kvlab" / "models" / MODEL
TASK = "kvlab_mc"
# contexts and choices; lm-eval scores " " + choice after each context (target_delimiter)
ITEMS = [
    ("The shepherd walked to the", ["river", "town", "hill", "sea"]),
    ("Trern Thyvet was a generous", ["shepherd", "king", "stone"]),
    ("The town by the river had a", ["market", "bridge", "old stone wall"]),
    ("In the morning the sheep", ["slept", "ran away", "ate the grass"]),
    ("Question: who mended the clocks?\nAnswer:", ["the shepherd", "nobody", "a river"]),
]


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, max_model_len=256)


@pytest.fixture(scope="module", params=[True, False], ids=["bos", "no_bos"])
def offline(request, llm):
    """Per item, per choice: (log-likelihood of the continuation, is it greedy), from
    LLM.generate's prompt_logprobs over kvlab's own tokenization of context + continuation,
    with kvlab's BOS first (what lm-eval sends with the checkpoint's tokenizer and
    add_bos_token) or without it (what its remote tokenizer backend sends)."""
    bos = request.param
    tok = llm.tokenizer
    pairs = [(ctx, " " + c) for ctx, choices in ITEMS for c in choices]
    prompts = [tok.encode(ctx + cont, add_special_tokens=bos) for ctx, cont in pairs]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1),
                        use_tqdm=False)
    scores = []
    for (ctx, cont), out in zip(pairs, outs, strict=True):
        head = tok.encode(ctx, add_special_tokens=bos)
        ids = tok.encode(ctx + cont, add_special_tokens=bos)
        assert ids[:len(head)] == head and len(ids) > len(head)   # lm-eval splits here too
        assert out.prompt_token_ids == ids
        entries = [(ids[j], out.prompt_logprobs[j]) for j in range(len(head), len(ids))]
        scores.append((sum(d[t] for t, d in entries),
                       all(max(d, key=d.get) == t for t, d in entries)))
    it = iter(scores)
    return bos, [[next(it) for _ in choices] for _, choices in ITEMS]


def gold_indices(offline) -> list[int]:
    """Even items: the offline best choice (acc 1); odd items: the worst (acc 0)."""
    out = []
    for i, item in enumerate(offline):
        lls = [ll for ll, _ in item]
        out.append(lls.index(max(lls) if i % 2 == 0 else min(lls)))
    return out


@pytest.fixture(scope="module")
def kvlab_server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "kvlab", "serve", "--port", str(port),
                                 "--max-model-len", "256", "--enable-tokenizer-info-endpoint"],
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                                stdout=sink, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, timeout=900)       # a readiness wait (a first CPU-kernel build), no speed
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def write_task(root: Path, gold: list[int]) -> Path:
    data = root / "items.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "gold": g}) + "\n"
                            for (q, c), g in zip(ITEMS, gold, strict=True)))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files: {json.dumps(str(data))}
test_split: train
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: gold
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return tasks


def run_lm_eval(url: str, tasks: Path, out: Path, batch_size: int,
                bos: bool) -> subprocess.CompletedProcess:
    """The command a user runs (docs/serving.md), in a child with its own env; without
    ``bos``, lm-eval's default tokenizer backend, which finds the server's /tokenize."""
    tokenizer = ["tokenizer_backend=huggingface", f"tokenizer={CKPT}",
                 "add_bos_token=True"] if bos else []     # kvlab encodes text with BOS
    model_args = ",".join([f"model={MODEL}", f"base_url={url}/v1/completions", *tokenizer,
                           "num_concurrent=1", "max_retries=1"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(out.parent / "hf"),
           "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model",
                           "local-completions", "--model_args", model_args, "--tasks", TASK,
                           "--include_path", str(tasks), "--batch_size", str(batch_size),
                           "--log_samples", "--output_path", str(out)],
                          env=env, cwd=out.parent, capture_output=True, text=True,
                          timeout=900)


def only(paths) -> Path:
    paths = list(paths)
    assert len(paths) == 1, paths
    return paths[0]


# batch_size 5: one request carries five token-id prompts; "no_bos": lm-eval's default
# tokenizer backend ("auto"), which finds /tokenizer_info and tokenizes through the server
@pytest.mark.parametrize("batch_size", [1, 5])
def test_lm_eval_scores_equal_kvlabs_offline_loglikelihoods(kvlab_server, offline, tmp_path,
                                                           batch_size):
    bos, offline = offline
    if not bos and batch_size == 1:
        pytest.skip("the remote tokenizer backend runs once, at batch size 5")
    gold = gold_indices(offline)
    want_acc = [float(max(range(len(s)), key=lambda k: s[k][0]) == g)
                for s, g in zip(offline, gold, strict=True)]
    assert 0 < sum(want_acc) < len(want_acc)          # right and wrong items both
    greedy = [g for item in offline for _, g in item]
    assert any(greedy) and not all(greedy)           # greedy and non-greedy continuations

    def requests_done() -> float:
        text = httpx.get(kvlab_server + "/metrics", timeout=30).text
        return metric(text, "vllm:request_success_total", finished_reason="length")

    before = requests_done()
    out = tmp_path / "out"
    proc = run_lm_eval(kvlab_server, write_task(tmp_path, gold), out, batch_size, bos)
    # (without bos, lm-eval could not fall back to a Hugging Face tokenizer: "kvlab-tiny" is no
    # hub name and the hub is offline; it ran on the server's /tokenize or not at all)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    # every choice was one echo request that kvlab served (max_tokens 1: finished by length)
    assert requests_done() - before == sum(len(c) for _, c in ITEMS)

    samples = sorted((json.loads(line) for line in
                      only(out.rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines()),
                     key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(len(ITEMS)))
    for s, (question, choices), want, g, acc in zip(samples, ITEMS, offline, gold, want_acc,
                                                    strict=True):
        args = [s["arguments"][f"gen_args_{k}"] for k in range(len(choices))]
        assert [(a["arg_0"], a["arg_1"]) for a in args] == [(question, " " + c)
                                                            for c in choices]
        got = [(float(r[0]), str(r[1]) == "True") for r in s["filtered_resps"]]
        assert len(got) == len(want)
        for (ll, is_greedy), (ll_ref, greedy_ref) in zip(got, want, strict=True):
            assert ll == pytest.approx(ll_ref, abs=1e-4), (s["doc_id"], got, want)
            assert is_greedy == greedy_ref, (s["doc_id"], got, want)
        assert int(s["target"]) == g
        assert s["acc"] == acc, (s["doc_id"], got, g)
    results = json.loads(only(out.rglob("results_*.json")).read_text())["results"][TASK]
    assert results["acc,none"] == pytest.approx(sum(want_acc) / len(want_acc))
