"""KV events in vLLM's protocol (kvlab/engine/kv_events.py).

- vLLM 0.32's own ``kv_events`` types decode kvlab's stream, re-encode it to the same bytes, and
  vLLM's own hash function gives the published block hashes (run with ``.venv-vllm``'s
  interpreter; skipped with the reason when it is absent);
- replaying the stream into an index gives the radix cache's contents, after a random workload
  with evictions and clears, through the recorder alone and through the real ZMQ socket;
- the replay socket answers as vLLM's; off by default, nothing is imported, listened to or
  opened.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.core.block_pool import OutOfBlocks
from kvlab.core.kv_cache_manager import KVCacheManager

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from kvlab.engine.kv_events import (  # noqa: E402
    END_SEQ,
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    KVEventIndex,
    KVEventRecorder,
    KVEventsConfig,
    decode_batch,
    radix_prefixes,
)

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def _engine(tmp_path: Path, **kwargs):
    from kvlab import LLM

    config = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/kv",
              "replay_endpoint": f"ipc://{tmp_path}/replay"}
    return LLM("kvlab-tiny", max_model_len=256, block_size=16, kv_events_config=config,
               **kwargs)


def _subscribe(endpoint: str):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)   # PUB drops what is sent before the subscription arrives
    return sub


def _drain(sub, expect: int) -> list[tuple[int, bytes]]:
    frames = []
    while len(frames) < expect and sub.poll(5000):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b""
        frames.append((int.from_bytes(seq, "big"), payload))
    while sub.poll(300):
        _, seq, payload = sub.recv_multipart()
        frames.append((int.from_bytes(seq, "big"), payload))
    return frames


def _run(llm, prompts, domain=None, max_tokens=6):
    from kvlab import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{domain}-{i}-{time.monotonic_ns()}", prompt, params,
                           security_domain=domain)
    while engine.has_unfinished_requests():
        engine.step()


PROMPTS = ["The lamplighter of Vale walked the long road at dusk " * 3,
           "Once upon a time the shepherd counted his sheep " * 3,
           "The lamplighter of Vale walked the long road at dusk " * 2 + "and lit the lamps"]

VLLM_CHECK = r"""
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved
from vllm.v1.core import kv_cache_utils as U
from vllm.utils.hashing import sha256
U.init_none_hash(sha256)
frames = json.load(open(sys.argv[1]))
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
encoder = msgspec.msgpack.Encoder()
full, kinds, same_bytes, hashes_ok, n_hashes = {}, [], True, True, 0
for hexpayload in frames:
    payload = bytes.fromhex(hexpayload)
    batch = decoder.decode(payload)
    same_bytes &= encoder.encode(batch) == payload
    for e in batch.events:
        kinds.append(type(e).__name__)
        if isinstance(e, BlockStored):
            parent = None if e.parent_block_hash is None else full[e.parent_block_hash]
            for i, h in enumerate(e.block_hashes):
                tokens = e.token_ids[i * e.block_size:(i + 1) * e.block_size]
                extra = e.extra_keys[i] if e.extra_keys else None
                salted = (("cache_salt", extra[0]),) if extra else None
                parent = U.hash_block_tokens(sha256, parent, tokens, salted)
                hashes_ok &= U.maybe_convert_block_hash(parent) == h
                full[h] = parent
                n_hashes += 1
print(json.dumps({"same_bytes": same_bytes, "hashes_ok": hashes_ok, "kinds": kinds,
                  "n_hashes": n_hashes}))
"""


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's CPU build is not installed in "
                    ".venv-vllm (benchmarks/bench_vs_vllm.py creates it)")
def test_vllm_decodes_kvlab_stream_to_the_same_bytes_and_hashes(tmp_path):
    llm = _engine(tmp_path, num_blocks=10)
    try:
        sub = _subscribe(f"ipc://{tmp_path}/kv")
        for round_ in range(2):   # more than 10 blocks: evictions
            _run(llm, [p + f" round {round_}" for p in PROMPTS])
        _run(llm, PROMPTS[:1], domain="tenant-b")   # a salted first block
        llm.engine.reset_prefix_cache()
        frames = _drain(sub, 4)
    finally:
        llm.engine.close()
    assert [seq for seq, _ in frames] == list(range(len(frames)))
    (tmp_path / "frames.json").write_text(json.dumps([p.hex() for _, p in frames]))
    script = tmp_path / "check.py"
    script.write_text(VLLM_CHECK)
    env = {"VLLM_LOGGING_LEVEL": "ERROR", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([str(VLLM_PYTHON), str(script), str(tmp_path / "frames.json")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["same_bytes"] and result["hashes_ok"]
    kinds = result["kinds"]
    assert {"BlockStored", "BlockRemoved"} <= set(kinds) and kinds[-1] == "AllBlocksCleared"
    assert result["n_hashes"] >= 10


def test_hash_chain_is_vllms_definition():
    """The chain spelled out with hashlib and pickle, against BlockHasher."""
    import hashlib
    import pickle

    def h(value):
        return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    hasher = BlockHasher("vllm-none-hash", as_int=False)
    first = hasher.block_hash(None, [1, 2, 3])
    assert first == h((h("vllm-none-hash"), (1, 2, 3), None))
    second = hasher.block_hash(first, (4, 5, 6), (("cache_salt", "x"),))
    assert second == h((first, (4, 5, 6), (("cache_salt", "x"),)))
    assert BlockHasher("vllm-none-hash", as_int=True).external(second) == \
        int.from_bytes(second, "big") % 2**64
    assert BlockHasher("0").none_hash != hasher.none_hash


# ------------------------------------------------------------------- replay = radix cache
ops = st.lists(st.tuples(st.sampled_from(["admit", "admit", "admit", "finish", "reset"]),
                         st.integers(0, 5), st.integers(1, 40), st.integers(0, 1)),
               min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_replayed_events_equal_the_radix_cache(operations):
    """Random admissions (shared prefixes, two scopes) over a cache small enough to evict,
    finishes and clears: after every operation the index rebuilt from the events holds exactly
    the prefixes the radix cache holds."""
    kv = KVCacheManager(num_blocks=12, block_size=4)
    scopes = [(("security_domain", "a"),), (("security_domain", "b"),)]

    def salt_of(scope):
        domain = dict(scope)["security_domain"]
        return None if domain == "a" else domain

    recorder = KVEventRecorder(4, BlockHasher("0"), salt_of)
    kv.prefix_cache.listener = recorder
    index = KVEventIndex()
    from kvlab.engine.kv_events import KVEventBatch

    running: list[str] = []
    for n, (op, family, length, which) in enumerate(operations):
        if op == "admit":
            tokens = [family] * 8 + list(range(100 + family, 100 + family + length))
            rid = f"r{n}"
            try:
                kv.admit(rid, scopes[which], tokens, len(tokens) + 1)
            except OutOfBlocks:
                continue
            kv.commit(rid, tokens)
            running.append(rid)
        elif op == "finish" and running:
            kv.free(running.pop(family % len(running)))
        elif op == "reset":
            for rid in running:
                kv.free(rid)
            running.clear()
            assert kv.reset_prefix_cache()
        events = recorder.take()
        index.apply(KVEventBatch(ts=0.0, events=events))
        assert index.prefixes() == radix_prefixes(kv.prefix_cache, salt_of)
        assert len(index.blocks) == kv.prefix_cache.num_cached_blocks()


def test_engine_stream_replays_to_the_cache_with_evictions(tmp_path):
    """Through the real socket: a cache of 10 blocks and prompts that need more, so blocks are
    evicted; the index rebuilt from what the subscriber received equals the cache."""
    llm = _engine(tmp_path, num_blocks=10)
    try:
        sub = _subscribe(f"ipc://{tmp_path}/kv")
        for round_ in range(3):
            _run(llm, [p + f" round {round_}" for p in PROMPTS])
        time.sleep(0.2)
        frames = _drain(sub, 3)
        index = KVEventIndex().apply_all(decode_batch(p) for _, p in frames)
        kinds = [type(e) for _, p in frames for e in decode_batch(p).events]
        assert BlockRemoved in kinds and BlockStored in kinds
        assert index.prefixes() == radix_prefixes(llm.engine.kv.prefix_cache)
        assert llm.engine.kv_events.publisher.published == len(frames)
    finally:
        llm.engine.close()


def test_replay_socket_resends_from_a_sequence_number(tmp_path):
    llm = _engine(tmp_path)
    try:
        _run(llm, PROMPTS)
        deadline = time.monotonic() + 5
        while llm.engine.kv_events.publisher.published < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        published = llm.engine.kv_events.publisher.published
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(f"ipc://{tmp_path}/replay")
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        frames = []
        while dealer.poll(5000):
            _, _topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            frames.append(int.from_bytes(seq, "big"))
            decode_batch(payload)
        dealer.close(linger=0)
        assert frames == list(range(1, published))
    finally:
        llm.engine.close()


def test_reset_prefix_cache_clears_once_idle(tmp_path):
    from kvlab import SamplingParams

    llm = _engine(tmp_path)
    try:
        engine = llm.engine
        engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=40, temperature=0))
        engine.step()
        assert engine.kv.prefix_cache.num_cached_blocks() > 0
        assert engine.reset_prefix_cache() is False   # a request holds KV
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.reset_prefix_cache() is True
        assert engine.kv.prefix_cache.num_cached_blocks() == 0
        assert engine.kv.num_allocatable_blocks() == engine.num_blocks
    finally:
        llm.engine.close()


# --------------------------------------------------------------------------- off / config
def test_off_by_default_imports_and_opens_nothing():
    code = ("import sys\n"
            "from kvlab import LLM, SamplingParams\n"
            "llm = LLM('kvlab-tiny', max_model_len=128)\n"
            "llm.generate(['The lamplighter of Vale'] * 2, SamplingParams(max_tokens=4),"
            " use_tqdm=False)\n"
            "off = LLM('kvlab-tiny', max_model_len=128,"
            " kv_events_config={'enable_kv_cache_events': False, 'endpoint': 'tcp://*:1'})\n"
            "assert llm.engine.kv_events is None and off.engine.kv_events is None\n"
            "assert llm.engine.kv.prefix_cache.listener is None\n"
            "print('zmq' in sys.modules, 'kvlab.engine.kv_events' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    # an explicit disabled config parses the JSON (kv_events imported), but opens no socket
    assert out.stdout.split()[-2:] == ["False", "True"]


def test_config_is_vllms_and_checked():
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert config.publisher == "zmq" and config.endpoint == "tcp://*:5557" and config.enabled
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True,
                                     "publisher": "null"}).enabled
    assert KVEventsConfig().publisher == "null"
    for bad, name in [({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher"),
                      ({"enable_kv_cache_event": True}, "enable_kv_cache_event"),
                      ({"endpoint": "http://x"}, "endpoint"),
                      ({"buffer_steps": 0}, "buffer_steps"),
                      ("{not json", "JSON")]:
        with pytest.raises(ValueError, match=name):
            KVEventsConfig.parse(bad)
    from kvlab.engine.engine_args import EngineArgs
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineArgs("kvlab-tiny", enable_prefix_caching=False,
                   kv_events_config={"enable_kv_cache_events": True})


def test_cleared_event_is_a_tagged_map():
    from kvlab.engine.kv_events import KVEventBatch, encode_batch

    payload = encode_batch(KVEventBatch(ts=1.5, events=[AllBlocksCleared()],
                                        data_parallel_rank=0))
    assert msgspec.msgpack.decode(payload) == [1.5, [{"type": "AllBlocksCleared"}], 0]
