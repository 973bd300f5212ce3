"""Bad input raises a clear exception naming the problem, and leaves the engine unchanged."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers")

from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.checkpoint import CheckpointError, load_checkpoint
from kvlab.engine.config import ConfigError
from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm import LLM
from kvlab.engine.llm_engine import LLMEngine
from kvlab.labs.invariants import check_engine
from kvlab.labs.kv_snapshot import snapshot_of
from kvlab.labs.parity.hf import save_random_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_hf_model(tmp_path_factory.mktemp("errors") / "llama", "llama", seed=4,
                                max_position_embeddings=64)


@pytest.fixture()
def engine(model_dir):
    eng = LLMEngine(EngineArgs(model_dir, block_size=4, num_blocks=40))
    eng.add_request("live", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8, temperature=0))
    eng.step()
    return eng


def _state(eng):
    return (eng.kv.state_tuple(), sorted(eng.outputs.requests), sorted(eng.outputs.samples),
            [(r.request_id, r.status, len(r.output_token_ids)) for r in eng.scheduler.requests()])


def _copy(model_dir, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(model_dir, dst)
    return dst


def test_unknown_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="unknown model"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="unknown model 'no-such-model'"):
        LLM("no-such-model")


def test_malformed_config(model_dir, tmp_path):
    path = _copy(model_dir, tmp_path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="malformed JSON"):
        load_checkpoint(path)
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_checkpoint(path)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_key_value_heads"] = 3
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        load_checkpoint(path)


def test_unsupported_architecture_and_rope(model_dir, tmp_path):
    path = _copy(model_dir, tmp_path)
    cfg = json.loads((model_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        LLM(path)
    bad_rope = {**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    (path / "config.json").write_text(json.dumps(bad_rope))
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        LLM(path)


def test_checkpoint_tensor_mismatch(model_dir, tmp_path):
    path = _copy(model_dir, tmp_path)
    cfg = json.loads((model_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match=r"missing tensor.*layers\.2"):
        load_checkpoint(path)
    (path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
     ({"temperature": float("nan")}, "temperature"), ({"top_k": -3}, "top_k"),
     ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"),
     ({"logprobs": -1}, "logprobs"), ({"seed": 1.5}, "seed"),
     ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"ignore_eos": 1}, "ignore_eos")],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("args", "exc", "message"),
    [
        (("x", [1] * 64), ValueError, "does not fit the context"),
        (("x", []), ValueError, "empty prompt"),
        (("x", [1, 2, 999]), ValueError, "outside the vocabulary"),
        (("x", [1, "a"]), TypeError, "must be ints"),
        (("x", 3.5), TypeError, "prompt must be"),
        (("live", [1, 2]), ValueError, "duplicate request_id 'live'"),
        (("", [1, 2]), ValueError, "non-empty"),
        (("a#1", [1, 2]), ValueError, "may not contain"),
        (("x", [1, 2], "greedy"), TypeError, "SamplingParams"),
        (("x", [1, 2], SamplingParams(stop_token_ids=[500])), ValueError, "stop_token_ids"),
        (("x", list(range(60)), SamplingParams(max_tokens=4)), ValueError, "blocks"),
        (("x", "text"), ValueError, "no tokenizer"),
    ],
)
def test_bad_requests_leave_engine_unchanged(engine, args, exc, message):
    if args[1] == list(range(60)):
        engine = LLMEngine(EngineArgs(engine.checkpoint, block_size=4, num_blocks=10))
    before = _state(engine)
    with pytest.raises(exc, match=message):
        engine.add_request(*args)
    assert _state(engine) == before
    check_engine(engine)


def test_abort_unknown_id(engine):
    before = _state(engine)
    with pytest.raises(KeyError, match="unknown request_id 'ghost'"):
        engine.abort_request("ghost")
    assert _state(engine) == before
    while engine.has_unfinished_requests():
        engine.step()
    check_engine(engine)
    assert snapshot_of(engine.kv).count("exclusive") == 0  # no leaked block


def test_generate_validates_every_prompt_before_running(model_dir):
    llm = LLM(model_dir, block_size=4, num_blocks=40)
    before = _state(llm.engine)
    with pytest.raises(ValueError, match="does not fit the context"):
        llm.generate([[1, 2, 3], [1] * 64], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()])
    assert _state(llm.engine) == before  # nothing was queued
    check_engine(llm.engine)


def test_bad_engine_arguments(model_dir):
    for kwargs, msg in [({"block_size": 0}, "block_size"), ({"num_blocks": -1}, "num_blocks"),
                        ({"max_model_len": 10_000}, "max_model_len"),
                        ({"scheduler": "fifo"}, "unknown scheduler"),
                        ({"dtype": "float13"}, "unknown dtype"),
                        ({"dtype": "int8"}, "dtype must be one of"),
                        ({"dtype": "float8_e4m3fn"}, "dtype must be one of"),
                        ({"device": "meta"}, "device must be 'cpu' or 'cuda'"),
                        ({"kv_cache_memory": 1000}, "kv_cache_memory=1000 bytes holds no KV"),
                        ({"block_size": 10**9}, "block_size must be a positive int <= 4096"),
                        ({"num_blocks": 10**12}, "does not fit"),
                        ({"seed": True}, "seed"), ({"seed": 2**64}, "seed"),
                        ({"max_model_len": True}, "max_model_len"),
                        ({"enable_prefix_caching": 1}, "enable_prefix_caching"),
                        ({"kv_cache_memory": 0}, "kv_cache_memory"),
                        ({"security_domain": ""}, "security_domain"),
                        ({"device": "cuda:0"} if not __import__("torch").cuda.is_available()
                         else {"block_size": -1}, "cuda|block_size")]:
        with pytest.raises(ValueError, match=msg):
            LLMEngine(EngineArgs(model_dir, **kwargs))
    for model in ("", "   "):
        with pytest.raises(ValueError, match="model"):
            LLMEngine(EngineArgs(model))


def test_engine_args_are_one_frozen_object_checked_when_made(model_dir):
    import dataclasses

    args = EngineArgs(model_dir, block_size=4, num_blocks=40)
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.block_size = 8                                  # type: ignore[misc]
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineArgs(model_dir, max_num_seqs=0)                # refused before any engine exists
    with pytest.raises(ValueError, match="block_size"):
        EngineArgs(model_dir, block_size=0)
    with pytest.raises(TypeError, match="EngineArgs"):
        LLMEngine(model_dir)                                 # type: ignore[arg-type]
    engine = LLMEngine(args)
    assert engine.args is args and engine.block_size == 4 and engine.num_blocks == 40
    assert dataclasses.replace(args, block_size=8).block_size == 8 and args.block_size == 4


def test_kv_cache_memory_is_never_exceeded(model_dir):
    """``kv_cache_memory`` is a budget: the cache takes the whole blocks that fit, no more."""
    probe = LLMEngine(EngineArgs(model_dir, block_size=4, num_blocks=1))
    block_bytes = probe.cache.data.numel() * probe.cache.data.element_size()
    eng = LLMEngine(EngineArgs(model_dir, block_size=4, kv_cache_memory=3 * block_bytes - 1))
    assert eng.num_blocks == 2
    assert eng.cache.data.numel() * eng.cache.data.element_size() <= 3 * block_bytes - 1


@pytest.mark.parametrize("scheduler", ["baseline", "production"])
def test_engine_token_budget_below_max_num_seqs(model_dir, scheduler):
    """The schedulers require max_num_seqs <= max_num_batched_tokens; the engine caps the batch
    size it hands them at the token budget (a batch never holds more requests than tokens)."""
    eng = LLMEngine(EngineArgs(model_dir, block_size=4, num_blocks=40, max_num_seqs=64,
                    max_num_batched_tokens=8, scheduler=scheduler))
    assert eng.scheduler_config.max_num_seqs == 8
    assert _run(eng, {"a": [1, 2, 3], "b": [4, 5, 6, 7]}) == {"a": 3, "b": 3}
    check_engine(eng)


def _run(eng, prompts, max_tokens=3):
    """Add ``prompts`` (id -> tokens), step until done; id -> number of generated tokens."""
    for rid, prompt in prompts.items():
        eng.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = len(out.outputs[0].token_ids)
    return done


def _all_blocks_free_or_cached(eng):
    snap = snapshot_of(eng.kv)
    assert not snap.tables and not snap.pending_copies
    assert snap.free_blocks + snap.evictable_blocks == eng.kv.num_blocks


class _FailOnce:
    """Wraps a callable; the ``at``-th call raises RuntimeError, the others pass through."""

    def __init__(self, fn, at=1):
        self.fn, self.at, self.calls = fn, at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("device lost (test)")
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("scheduler", ["baseline", "production"])
def test_executor_error_fails_the_step_and_engine_keeps_serving(model_dir, scheduler,
                                                                 monkeypatch):
    eng = LLMEngine(EngineArgs(model_dir, block_size=4, num_blocks=40, scheduler=scheduler))
    eng.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0))
    eng.step()
    eng.add_request("b", [6, 7, 8], SamplingParams(max_tokens=4, temperature=0))
    monkeypatch.setattr(eng.executor, "execute", _FailOnce(eng.executor.execute))
    with pytest.raises(RuntimeError, match="device lost"):
        eng.step()
    check_engine(eng)
    _all_blocks_free_or_cached(eng)   # the step's KV was released, exactly once
    for rid in ("a", "b"):
        req = eng.scheduler.get_request(rid)
        assert req.status.value == "failed" and req.finish_reason.value == "error"
        assert "device lost" in req.status_message
    # the next step reports them (finish_reason "error") and the engine serves new requests
    outs = {o.request_id: o for o in eng.step()}
    assert {rid: o.outputs[0].finish_reason for rid, o in outs.items()} == {
        "a": "error", "b": "error"}
    assert outs["a"].finished and len(outs["a"].outputs[0].token_ids) == 1
    assert not eng.has_unfinished_requests()
    assert _run(eng, {"c": [1, 2, 3, 4, 5], "d": [6, 7]}) == {"c": 3, "d": 3}
    check_engine(eng)
    _all_blocks_free_or_cached(eng)


def test_sampling_error_fails_the_step_and_spares_the_rest(model_dir, monkeypatch):
    """The sampler raises in the first step that samples: that step's requests fail (one of
    them a sample of an n=2 request), their KV is released once, and the requests that were not
    in the step (the other sample, a later request) are untouched and then served."""
    import kvlab.engine.model_runner as mod

    eng = LLMEngine(EngineArgs(model_dir, block_size=4, num_blocks=40, max_num_seqs=2,
                    max_num_batched_tokens=8))
    eng.add_request("long", list(range(1, 30)), SamplingParams(max_tokens=3, temperature=0))
    eng.step()    # 8 of 29 prompt tokens: no sampling yet
    eng.add_request("pair", [1, 2, 3], SamplingParams(n=2, max_tokens=3, temperature=0))
    eng.add_request("later", [4, 5, 6], SamplingParams(max_tokens=3, temperature=0))
    monkeypatch.setattr(mod, "sample", _FailOnce(mod.sample))
    with pytest.raises(RuntimeError, match="device lost"):
        while True:   # the first sampling step: long's last chunk + pair's prompt
            eng.step()
    assert mod.sample.calls == 1
    statuses = {r: eng.scheduler.get_request(r).status.value
                for r in ("long", "pair", "pair#1", "later")}
    assert statuses == {"long": "failed", "pair": "failed", "pair#1": "waiting",
                        "later": "waiting"}
    check_engine(eng)
    _all_blocks_free_or_cached(eng)
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = [(len(c.token_ids), c.finish_reason)
                                            for c in out.outputs]
    assert finished == {"long": [(0, "error")], "pair": [(0, "error"), (3, "length")],
                        "later": [(3, "length")]}
    check_engine(eng)
    _all_blocks_free_or_cached(eng)
