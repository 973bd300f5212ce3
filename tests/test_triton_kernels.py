"""The Triton decode-attention and KV-store kernels equal the torch path (CPU, interpreter).

The kernels are written for CUDA; here they run under Triton's interpreter
(``TRITON_INTERPRET=1``), which must be set before Triton is first imported, so every case runs
in one subprocess (``python -m kvlab.labs.parity.triton``) and this module only reads its
JSON. Cases (see ``kvlab.labs.parity.triton.CASES``): multi-head, grouped-query with groups
of 2, 3 and 4 and multi-query; block sizes 1, 4, 8, 16 and 32; ragged context lengths (one
token, exactly one block, one past a block, several blocks); a head_dim that is not a power of
two; float32 and bfloat16; one context split, the default, five and 32 (splits left empty
by short rows). Every construct the kernels use runs in the interpreter.
"""

from __future__ import annotations

import importlib.util

import pytest
from triton_interpret import run_interpreted

from kvlab.labs.parity.triton import CASES

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (pip install -e '.[dev]' installs it; CI does)")



@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted("kvlab.labs.parity.triton")


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_kernels_match_torch(results, name):
    r = results[name]
    assert r["store_exact"], "store_kv wrote different cache contents than index_copy_"
    if CASES[name].dtype == "float32":
        assert r["max_abs_diff_vs_torch_path"] < 2e-6, r
    else:
        # bfloat16 outputs (values of order 1) are rounded to 8 significant bits: the kernel
        # and the torch path each lie within a couple of ulps (2**-7) of the float32 answer
        assert r["max_abs_diff_vs_float32_reference"] < 2 ** -6, r
        assert r["max_abs_diff_vs_torch_path"] < 2 ** -5, r
    assert r["rows"] == len(CASES[name].lengths)


def test_parity_harness_detects_a_wrong_kernel(monkeypatch):
    """The comparison can fail: a decode that ignores the last context token is caught. Runs
    in-process on the torch path only (no Triton needed), by swapping the Triton functions for
    torch stand-ins that share the harness's metadata."""
    import torch

    from kvlab.engine.kv_cache import write_kv
    from kvlab.kernels import triton as triton_kernels
    from kvlab.labs.parity import triton as triton_parity

    def fake_decode(q, kc, vc, table, positions, scale, out=None, splits=None):
        # attends to positions 0 .. p-1 only (drops the newest token): must be caught
        bs = kc.shape[1]
        rows = []
        for i in range(q.shape[0]):
            p = int(positions[i])
            slots = [int(table[i, x // bs]) * bs + x % bs for x in range(max(p, 1))]
            k = kc.view(-1, *kc.shape[2:])[slots]
            v = vc.view(-1, *vc.shape[2:])[slots]
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            w = torch.einsum("hd,thd->ht", q[i].float(), k.float()) * scale
            rows.append(torch.einsum("ht,thd->hd", w.softmax(-1), v.float()))
        result = torch.stack(rows).to(q.dtype)
        if out is not None:   # the harness passes its output buffer, as the kernel fills it
            out.copy_(result)
        return result

    monkeypatch.setattr(triton_kernels, "available", lambda: True)
    monkeypatch.setattr(triton_kernels, "store_kv", write_kv)
    monkeypatch.setattr(triton_kernels, "decode_attention", fake_decode)
    r = triton_parity.compare(CASES["gqa_bs16"])
    assert r["store_exact"]
    assert r["max_abs_diff_vs_torch_path"] > 1e-2


def test_split_counts_fill_the_gpu_once_and_are_powers_of_two():
    """Contexts split so that rows x KV heads x splits gives each multiprocessor about two
    programs (16 stand in for a CPU), never more splits than blocks or MAX_SPLITS, always a
    power of two (each count is a compiled kernel variant, so eager steps whose tables grow
    do not compile a new one every block)."""
    import torch

    from kvlab.kernels.triton import MAX_SPLITS, num_splits

    cpu = torch.device("cpu")
    assert num_splits(1, 2, 256, cpu) == 16           # 2 programs -> 16 splits: 32 programs
    assert num_splits(1, 1, 256, cpu) == MAX_SPLITS   # capped
    assert num_splits(64, 2, 256, cpu) == 1           # the batch fills the GPU already
    assert num_splits(3, 2, 5, cpu) == 4              # 6 wanted, 5 blocks: 4
    assert num_splits(1, 2, 1, cpu) == 1              # one block: nothing to split
    for rows in range(1, 70):
        for blocks in (1, 2, 3, 7, 33, 300):
            n = num_splits(rows, 2, blocks, cpu)
            assert n & (n - 1) == 0 and 1 <= n <= min(blocks, MAX_SPLITS)
