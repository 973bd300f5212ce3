"""The compiled CPU decode-attention kernel (kvlab.kernels.cpu) against the torch path,
the dense reference and the engine's own tokens; its input checks; and the fallback."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from dense_attention import dense_causal_attention

from kvlab.engine.attention_cpu import CpuAttention
from kvlab.engine.attention_metadata import ChunkSpec, build_metadata
from kvlab.engine.attention_torch import TorchAttention
from kvlab.engine.kv_cache import write_kv
from kvlab.engine.ops import Kernels, LayerOps, select_kernels
from kvlab.kernels import cpu as cpu_kernels
from kvlab.labs.parity.triton import scattered_tables

TORCH = TorchAttention()
PAGED_MAX_TOKENS = CpuAttention.paged_max_tokens


def _toolchain() -> bool:
    """A C++ compiler and ninja (the pip package puts ``ninja`` on the venv's PATH)."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    return bool(compiler and (shutil.which("ninja") or importlib.util.find_spec("ninja")))


needs_kernel = pytest.mark.skipif(not _toolchain(), reason="no C++ compiler or ninja here")


def _cpu(dtype=torch.float32) -> CpuAttention:
    """The compiled backend for ``dtype`` (the tests that call it need the build)."""
    backend = CpuAttention.create(dtype)
    assert backend is not None, cpu_kernels.build_error()
    return backend


@needs_kernel
def test_the_kernel_builds_where_a_toolchain_exists():
    # so that the parity tests below can never skip silently on a machine that can build it
    assert cpu_kernels.available(), cpu_kernels.build_error()


def _case(seed, rows, heads, kv_heads, dim, block_size, lengths, dtype):
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = scattered_tables(lengths, block_size, 3, gen)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    chunks = [ChunkSpec([0], n - 1, t) for n, t in zip(lengths, tables, strict=True)]
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, chunks


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 2), (4, 1), (14, 2)])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("dim", [32, 48, 64])
def test_kernel_equals_torch_path_and_dense_reference(heads, kv_heads, block_size, dim):
    lengths = [1, 2, block_size, block_size + 1, 3 * block_size, 37, 100, 5]
    q, kc, vc, chunks = _case(heads * block_size + dim, len(lengths), heads, kv_heads, dim,
                              block_size, lengths, torch.float32)
    meta = build_metadata(chunks, block_size)
    fast = _cpu().attend(q, None, None, kc, vc, meta, dim ** -0.5)
    slow = TORCH.attend(q, None, None, kc, vc, meta, dim ** -0.5)
    assert torch.allclose(fast, slow, atol=2e-6, rtol=1e-5), (fast - slow).abs().max()
    flat_k, flat_v = kc.view(-1, kv_heads, dim), vc.view(-1, kv_heads, dim)
    for row, c in enumerate(chunks):     # the flat rows are the chunks, in order
        n = c.start_pos + 1
        slots = torch.tensor([c.block_table[p // block_size] * block_size + p % block_size
                              for p in range(n)])
        # the last row of a causal pass over the whole context is this decode step
        qq = torch.zeros(n, heads, dim)
        qq[-1] = q[row]
        dense = dense_causal_attention(qq, flat_k[slots], flat_v[slots], dim ** -0.5)[-1]
        assert torch.allclose(fast[row], dense, atol=2e-6, rtol=1e-5)


@needs_kernel
def test_bfloat16_and_several_threads():
    lengths = [1, 17, 64, 300, 33, 2, 128, 90]
    q, kc, vc, chunks = _case(7, len(lengths), 8, 2, 64, 16, lengths, torch.bfloat16)
    meta = build_metadata(chunks, 16)
    ref = TORCH.attend(q.float(), None, None, kc.float(), vc.float(), meta, 0.125)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = _cpu(torch.bfloat16).attend(q, None, None, kc, vc, meta, 0.125)
            assert got.dtype == torch.bfloat16
            assert torch.allclose(got.float(), ref, atol=2e-2, rtol=2e-2)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_bad_inputs_are_refused_before_anything_is_written():
    q, kc, vc, chunks = _case(3, 2, 4, 2, 32, 8, [9, 4], torch.float32)
    tables = torch.tensor([list(chunks[0].block_table), [*chunks[1].block_table, 0]])
    lens = torch.tensor([9, 4])
    out = torch.full_like(q, 7.0)
    bad = [
        (tables, torch.tensor([0, 4])),                       # empty context
        (tables, torch.tensor([17, 4])),                      # longer than the table
        (tables.clone().fill_(kc.shape[0]), lens),            # block id past the cache
        (tables.clone().fill_(-1), lens),                     # negative block id
        (tables.int(), lens),                                 # int32 tables
        (tables[:1], lens[:1]),                               # rows disagree with q
    ]
    for t, n in bad:
        with pytest.raises(ValueError, match="decode_attention"):
            cpu_kernels.decode_attention(q, kc, vc, t, n, 0.1, out=out)
        assert torch.equal(out, torch.full_like(q, 7.0))
    with pytest.raises(ValueError, match="one dtype"):
        cpu_kernels.decode_attention(q.double(), kc, vc, tables, lens, 0.1)
    with pytest.raises(ValueError, match="one dtype"):   # float64 stays on the torch path
        cpu_kernels.decode_attention(q.double(), kc.double(), vc.double(), tables, lens, 0.1)
    with pytest.raises(ValueError, match="KV dividing H"):
        cpu_kernels.decode_attention(q[:, :3], kc, vc, tables, lens, 0.1)
    with pytest.raises(ValueError, match="out must be"):
        cpu_kernels.decode_attention(q, kc, vc, tables, lens, 0.1, out=out[:, :2])


@needs_kernel
def test_engine_tokens_and_logprobs_agree_with_the_torch_path(monkeypatch):
    from kvlab.core.sampling_params import SamplingParams
    from kvlab.engine.llm import LLM

    prompts = ["The river", "Once upon a time the shepherd", "A", "Trern Thyvet was a generous"]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=2)
    runs = []
    for flag in (True, False):
        monkeypatch.setenv("KVLAB_CPU_ATTENTION", "1" if flag else "0")   # read at construction
        llm = LLM("kvlab-tiny")
        attention = llm.engine.executor.kernels.attention
        assert isinstance(attention, CpuAttention if flag else TorchAttention)
        runs.append(llm.generate(prompts, params))
    for a, b in zip(*runs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) < 1e-4


def test_a_failed_build_falls_back_to_the_torch_path(tmp_path):
    # a fresh extension cache and a compiler that does not exist: the build fails, the engine
    # warns once and generates with the torch path
    code = textwrap.dedent("""
        import warnings
        from kvlab.kernels import cpu as cpu_kernels
        from kvlab.engine.llm import LLM
        from kvlab.core.sampling_params import SamplingParams
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = LLM("kvlab-tiny").generate(["The river"], SamplingParams(max_tokens=4,
                                                                           temperature=0))
        assert not cpu_kernels.available()
        assert cpu_kernels.build_error()
        assert len(out[0].outputs[0].token_ids) == 4
        assert sum("could not be built" in str(w.message) for w in caught) == 1, caught
        print("fell back")
    """)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "/nonexistent/c++",
           "KVLAB_CPU_ATTENTION": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fell back" in done.stdout


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("KVLAB_CPU_ATTENTION", "0")
    assert not cpu_kernels.available()
    with pytest.raises(RuntimeError, match="not available"):
        cpu_kernels.decode_attention(torch.zeros(1, 1, 4), torch.zeros(1, 1, 1, 4),
                                     torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, dtype=torch.long),
                                     torch.ones(1, dtype=torch.long), 1.0)


def test_float64_attention_keeps_full_precision():
    # the kernel accumulates in float32, so a float64 engine gets the torch definitions
    assert select_kernels("cpu", torch.float64) == Kernels.torch()
    assert CpuAttention.create(torch.float64) is None
    lengths = [3, 40, 17]
    q, kc, vc, chunks = _case(11, len(lengths), 4, 2, 32, 8, lengths, torch.float64)
    got = TORCH.attend(q, None, None, kc, vc, build_metadata(chunks, 8), 32 ** -0.5)
    flat_k, flat_v = kc.view(-1, 2, 32), vc.view(-1, 2, 32)
    for row, c in enumerate(chunks):
        slots = [c.block_table[p // 8] * 8 + p % 8 for p in range(c.start_pos + 1)]
        qq = torch.zeros(len(slots), 4, 32, dtype=torch.float64)
        qq[-1] = q[row]
        dense = dense_causal_attention(qq, flat_k[slots], flat_v[slots], 32 ** -0.5)[-1]
        assert got.dtype == torch.float64
        torch.testing.assert_close(got[row], dense, rtol=1e-12, atol=1e-12)


@needs_kernel
def test_paged_rows_equal_dense_attention_for_short_chunks_behind_a_prefix():
    gen = torch.Generator().manual_seed(5)
    bs, kv_heads, heads, dim = 8, 2, 6, 32
    specs = [(13, 4), (40, 1 + PAGED_MAX_TOKENS), (7, 2), (0, 5), (21, PAGED_MAX_TOKENS)]
    num_blocks = 64
    kc = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    vc = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, at = [], 0
    for start, n in specs:
        nb = -(-(start + n) // bs)
        chunks.append(ChunkSpec(list(range(n)), start, perm[at:at + nb]))
        at += nb
    meta = build_metadata(chunks, bs, paged_max_tokens=PAGED_MAX_TOKENS)
    assert meta.dense == (1, 3)          # the long chunk and the fresh prompt
    assert int(meta.paged_rows.numel()) == 4 + 2 + PAGED_MAX_TOKENS  # short, prefixed
    total = sum(n for _, n in specs)
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, kv_heads, dim, generator=gen)
    v = torch.randn(total, kv_heads, dim, generator=gen)
    write_kv(kc, vc, k, v, meta.slot_mapping)
    got = _cpu().attend(q, k, v, kc, vc, meta, dim ** -0.5)
    flat_k, flat_v = kc.view(-1, kv_heads, dim), vc.view(-1, kv_heads, dim)
    for i, c in enumerate(chunks):
        lo, hi = meta.query_start[i], meta.query_start[i + 1]
        end = c.start_pos + len(c.token_ids)
        slots = torch.tensor([c.block_table[p // bs] * bs + p % bs for p in range(end)])
        qq = torch.zeros(end, heads, dim)
        qq[c.start_pos:] = q[lo:hi]
        dense = dense_causal_attention(qq, flat_k[slots], flat_v[slots], dim ** -0.5)
        assert torch.allclose(got[lo:hi], dense[c.start_pos:], atol=2e-6, rtol=1e-5)


def test_build_name_is_keyed_to_the_environment(monkeypatch):
    # two venvs (another sys.prefix, another torch) get their own build directory, so they
    # never rewrite each other's build.ninja; the same environment always finds its own
    from torch.utils import cpp_extension

    name = cpu_kernels.build_name("AVX2")
    assert name == cpu_kernels.build_name("AVX2") and name.startswith(
        "kvlab_paged_attention_cpu_avx2_")
    assert cpu_kernels.build_name("AVX512") != name
    monkeypatch.setattr(sys, "prefix", "/some/other/venv")
    other_venv = cpu_kernels.build_name("AVX2")
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    other_torch = cpu_kernels.build_name("AVX2")
    monkeypatch.undo()
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: ["/elsewhere/include"])
    other_include = cpu_kernels.build_name("AVX2")
    assert len({name, other_venv, other_torch, other_include}) == 4


_BUILD = "from kvlab.kernels import cpu as cpu_kernels; print(cpu_kernels.available(), " \
         "cpu_kernels.build_error())"


@needs_kernel
def test_a_build_killed_midway_and_stale_lock_files_never_block_the_next(tmp_path):
    """SIGKILL a first build while it compiles (and leave torch's old-layout ``lock`` file, which
    made the next process wait forever): the next process removes the dead build's directory,
    leaves a live build's alone, builds and loads the kernel, and the one after it loads that
    build without compiling again."""
    import fcntl
    import signal
    import time

    legacy = tmp_path / "py311_cpu" / "kvlab_paged_attention_cpu_avx2"
    legacy.mkdir(parents=True)
    (legacy / "lock").write_text("")
    root = tmp_path / "kvlab"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "KVLAB_CPU_ATTENTION": "1"}
    # its own process group, killed whole: a SIGKILL of python alone leaves ninja and the
    # compiler running, still writing into the directory
    first = subprocess.Popen([sys.executable, "-c", _BUILD], env=env, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not list(root.glob("*.tmp-*/build.ninja")):   # the compiler is running
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first build never started"
            time.sleep(0.05)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    killed = list(root.glob("*.tmp-*"))
    assert len(killed) == 1 and not [p for p in root.iterdir() if ".tmp-" not in p.name]
    assert (killed[0] / "owner").is_file()
    prefix = killed[0].name.split(".tmp-")[0]
    live, fresh = root / f"{prefix}.tmp-live", root / f"{prefix}.tmp-fresh"
    live.mkdir()
    fresh.mkdir()                       # just made by a builder that has not locked it yet
    with open(live / "owner", "w") as held:             # a build in progress elsewhere
        fcntl.flock(held, fcntl.LOCK_EX)
        done = subprocess.run([sys.executable, "-c", _BUILD], env=env, capture_output=True,
                              text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.split() == ["True", "None"], done.stderr[-3000:]
    assert not killed[0].exists()                       # its builder is dead: removed
    assert live.exists() and fresh.exists()             # live (or not yet claimed): kept
    final = [p for p in root.iterdir() if ".tmp-" not in p.name]
    assert len(final) == 1 and not (final[0] / "lock").exists()
    assert (final[0] / f"{final[0].name}.so").is_file()
    ninja = (final[0] / "build.ninja").stat().st_mtime_ns
    again = subprocess.run([sys.executable, "-c", _BUILD], env=env, capture_output=True,
                           text=True, timeout=300)
    assert again.stdout.split() == ["True", "None"], again.stderr[-3000:]
    assert (final[0] / "build.ninja").stat().st_mtime_ns == ninja    # loaded, not rebuilt
    assert not live.exists() and fresh.exists()         # the lock is free now: removed


def _chunk_case(seed, heads, kv_heads, dim, bs, specs, dtype=torch.float32, scale=None):
    """Caches holding every chunk's context (prefix and its own K/V) under scattered tables,
    queries, and each chunk's dense float64 reference (the last rows of a causal pass) at
    ``scale`` (default ``dim ** -0.5``)."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-(start + n) // bs) for start, n in specs]
    perm = torch.randperm(sum(widths) + 2, generator=gen).tolist()
    kc = torch.randn(len(perm), bs, kv_heads, dim, generator=gen).to(dtype)
    vc = torch.randn(len(perm), bs, kv_heads, dim, generator=gen).to(dtype)
    tables, at = [], 0
    for w in widths:
        tables.append(perm[at:at + w] + [0] * (max(widths) - w))
        at += w
    q = torch.randn(sum(n for _, n in specs), heads, dim, generator=gen).to(dtype)
    qs = [0]
    refs = []
    for (start, n), table in zip(specs, tables, strict=True):
        slots = [table[p // bs] * bs + p % bs for p in range(start + n)]
        qq = torch.zeros(start + n, heads, dim, dtype=torch.float64)
        qq[start:] = q[qs[-1]:qs[-1] + n].double()
        k = kc.view(-1, kv_heads, dim)[slots].double()
        v = vc.view(-1, kv_heads, dim)[slots].double()
        refs.append(dense_causal_attention(qq, k, v, scale or dim ** -0.5)[start:])
        qs.append(qs[-1] + n)
    return q, kc, vc, torch.tensor(tables), qs, [s for s, _ in specs], torch.cat(refs)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 32), (4, 2, 64), (8, 4, 64), (4, 4, 128),
                                                (14, 2, 48), (80, 1, 8), (130, 2, 12)])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_chunk_op_equals_dense_attention(heads, kv_heads, dim, block_size):
    # fresh prompts, chunks behind a prefix (aligned or not to the key tiles), one-token
    # chunks; query heads per KV head from 1 to 80 (more than one tile of rows holds)
    specs = [(0, 37), (20, 70), (100, 1), (3, 130), (0, 1), (64, 33)]
    q, kc, vc, tables, qs, starts, ref = _chunk_case(dim + block_size, heads, kv_heads, dim,
                                                     block_size, specs)
    got = cpu_kernels.chunk_attention(q, kc, vc, tables, qs, starts, dim ** -0.5)
    torch.testing.assert_close(got.double(), ref, atol=3e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_chunk_op_masks_exactly_and_keeps_precision_over_wide_score_spreads(scale):
    # scores spread over hundreds (weights from 1 down past e^-80): the op is as close to the
    # float64 reference as torch's own float32 attention is (its error is the scores'
    # float32 rounding); and the keys and values of a chunk's last positions, made enormous,
    # leave the rows before them bit for bit as they were: a masked key weighs exactly 0
    specs = [(0, 45), (16, 40)]
    q, kc, vc, tables, qs, starts, exact = _chunk_case(7, 6, 2, 32, 16, specs, scale=scale)
    torch32 = []
    for s, (start, n) in enumerate(specs):
        slots = [int(tables[s, p // 16]) * 16 + p % 16 for p in range(start + n)]
        k, v = (c.view(-1, 2, 32)[slots].repeat_interleave(3, 1).transpose(0, 1)
                for c in (kc, vc))
        qq = torch.cat((torch.zeros(start, 6, 32), q[qs[s]:qs[s + 1]]))
        torch32.append(torch.nn.functional.scaled_dot_product_attention(
            qq.transpose(0, 1), k, v, is_causal=True, scale=scale).transpose(0, 1)[start:])
    got = cpu_kernels.chunk_attention(q, kc, vc, tables, qs, starts, scale)
    ours = float((got.double() - exact).abs().max())
    theirs = float((torch.cat(torch32).double() - exact).abs().max())
    assert ours <= 2 * theirs + 1e-6, (ours, theirs)
    loud_k, loud_v, keep = kc.clone(), vc.clone(), []
    for s, (start, n) in enumerate(specs):
        for p in range(start + n - 10, start + n):
            slot = tables[s, p // 16] * 16 + p % 16
            loud_k.view(-1, 2, 32)[slot] = 1e4
            loud_v.view(-1, 2, 32)[slot] = 1e36   # e^-80 of it would show
        keep += range(qs[s], qs[s + 1] - 10)
    loud = cpu_kernels.chunk_attention(q, loud_k, loud_v, tables, qs, starts, scale)
    assert torch.equal(loud[keep], got[keep])
    assert not torch.equal(loud, got)


@needs_kernel
def test_chunk_op_bfloat16_strided_queries_and_two_threads():
    specs = [(0, 50), (31, 90)]
    q, kc, vc, tables, qs, starts, ref = _chunk_case(2, 8, 2, 64, 16, specs, torch.bfloat16)
    wide = torch.cat((q, torch.zeros_like(q[:, :2])), 1)[:, :8]   # rows 10 heads apart
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = cpu_kernels.chunk_attention(wide, kc, vc, tables, qs, starts, 0.125)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=2e-2)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_chunk_op_refuses_bad_inputs():
    q, kc, vc, tables, qs, starts, _ = _chunk_case(4, 4, 2, 32, 8, [(5, 9), (0, 4)])
    bad = [
        (dict(tables=tables[:, :1]), "does not cover"),              # the first chunk's table
        (dict(tables=tables.clone().fill_(kc.shape[0])), "block ids"),
        (dict(tables=tables.clone().fill_(-1)), "block ids"),
        (dict(tables=tables.int()), "int64 tables"),
        (dict(query_start=[0, 9, 9, 13]), "offsets"),
        (dict(start_pos=[5, 20]), "does not cover"),                 # chunk 1 to position 23
        (dict(query_start=[0, 9, 12]), "offsets"),                   # does not end at N
        (dict(start_pos=[-1, 0]), "does not cover"),
        (dict(q=q[:, :, :30]), "multiple of 4"),
        (dict(q=q.double()), "one dtype"),
    ]
    args = dict(q=q, k_cache=kc, v_cache=vc, tables=tables, query_start=qs, start_pos=starts,
                scale=0.1)
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            cpu_kernels.chunk_attention(**{**args, **change})


@needs_kernel
def test_the_cpu_backend_takes_every_dense_chunk_through_the_op():
    # the compiled backend runs the dense chunks in one call of its chunk op; the torch
    # backend runs them with SDPA; both equal the reference
    specs = [(0, 40), (24, 30), (9, 1)]
    q, kc, vc, tables, *_, ref = _chunk_case(8, 6, 2, 32, 16, specs)
    chunks = [ChunkSpec(list(range(n)), s, t[:-(-(s + n) // 16)].tolist())
              for (s, n), t in zip(specs, tables, strict=True)]
    slots = build_metadata(chunks, 16).slot_mapping
    k, v = kc.view(-1, 2, 32)[slots], vc.view(-1, 2, 32)[slots]   # the chunks' own K/V
    backend = _cpu()
    calls, real = [], backend._chunk
    backend._chunk = lambda *a: calls.append(a[7]) or real(*a)
    for attention in (backend, TORCH):
        meta = build_metadata(chunks, 16, paged_max_tokens=attention.paged_max_tokens)
        got = attention.attend(q, k, v, kc, vc, meta, 32 ** -0.5)
        torch.testing.assert_close(got.double(), ref, atol=3e-6, rtol=1e-5)
    assert calls == [(0, 1)]        # once, with both multi-token chunks; the decode row paged


@needs_kernel
def test_over_a_rounding_cache_a_fresh_prompt_attends_its_own_kv():
    # exact=False (a quantized cache): the compiled backend runs a fresh prompt on the torch
    # path over its new K/V, and a chunk behind a prefix through the op, as the torch backend
    specs = [(0, 24), (24, 30)]
    q, kc, vc, tables, *_ = _chunk_case(9, 6, 2, 32, 16, specs)
    chunks = [ChunkSpec(list(range(n)), s, t[:-(-(s + n) // 16)].tolist())
              for (s, n), t in zip(specs, tables, strict=True)]
    meta = build_metadata(chunks, 16, paged_max_tokens=PAGED_MAX_TOKENS)
    k = torch.randn(meta.num_tokens, 2, 32)      # differs from what the cache holds
    v = torch.randn(meta.num_tokens, 2, 32)
    backend = _cpu()
    calls, real = [], backend._chunk
    backend._chunk = lambda *a: calls.append(a[7]) or real(*a)
    got = backend.attend(q, k, v, kc, vc, meta, 32 ** -0.5, exact=False)
    want = TORCH.attend(q, k, v, kc, vc, meta, 32 ** -0.5, exact=False)
    torch.testing.assert_close(got, want, atol=3e-6, rtol=1e-5)
    assert calls == [(1,)]


@needs_kernel
def test_fused_layer_ops_equal_the_torch_ops():
    # the compiled RMSNorm / RoPE / SiLU-and-mul against the torch definitions (LayerOps), on
    # the strided views a layer hands them (rows of a wider buffer); RoPE rotates in place
    TorchOps = LayerOps()
    fused = cpu_kernels.compiled()
    assert fused is not None, cpu_kernels.build_error()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 300, generator=gen)[:, :192]
    w = torch.randn(192, generator=gen)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), TorchOps.rms_norm(x, w, 1e-6))
    qkv = torch.randn(37, 10 * 32, generator=gen)
    qk = qkv[:, :8 * 32].view(37, 8, 32)
    cos, sin = torch.randn(37, 16, generator=gen), torch.randn(37, 16, generator=gen)
    want = TorchOps.rope_(qk.clone(), cos, sin)
    assert fused.rope_(qk, cos, sin).data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qkv[:, :8 * 32].view(37, 8, 32), want)
    gu = (3 * torch.randn(37, 1100, generator=gen))[:, :2 * 512]
    torch.testing.assert_close(fused.silu_and_mul(gu), TorchOps.silu_and_mul(gu))
    # a width that leaves a tail after the vector lanes, and gates far out on both sides
    # (sigmoid saturating to 0 and 1), in the lanes and in the tail
    extreme = torch.tensor([-1e4, -100.0, -88.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 88.0, 100.0,
                            1e4])
    gate = torch.cat((extreme, 20 * torch.randn(15, generator=gen), extreme.flip(0)))
    gu = torch.cat((gate[None].expand(5, -1), torch.randn(5, 37, generator=gen)), 1)
    torch.testing.assert_close(fused.silu_and_mul(gu), TorchOps.silu_and_mul(gu))
    with pytest.raises(RuntimeError, match="float32"):
        fused.rms_norm(x.double(), w.double(), 1e-6)
    with pytest.raises(RuntimeError, match="cos and sin"):
        fused.rope_(qk, cos[:3], sin)
