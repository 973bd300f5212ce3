"""The compiled CPU kernels (``csrc/paged_attention_cpu.cpp``): paged attention of decode rows
and of whole chunks (fresh prompts, chunks behind a cached prefix) in one causal pass, and a
decoder layer's small float32 ops (RMSNorm, RoPE in place, SiLU-and-mul) in one pass each.

The decode op walks each row's block table straight through the cache with a float32 softmax
instead of gathering the blocks first, as the torch path does
(``benchmarks/bench_decode_attention.py`` measures both). :func:`compiled` hands out the
loaded build; the engine's CPU attention backend (:mod:`kvlab.engine.attention_cpu`) and CPU
layer ops (:mod:`kvlab.engine.ops`) call its functions every step with no Python in between.
:func:`decode_attention` and :func:`chunk_attention` are the checked entry points (tests,
benchmarks): the kernels read raw memory, so they validate every index first.

Built on first use with :func:`torch.utils.cpp_extension.load_inline` (a C++ compiler and
``ninja``; about 20 s once) for the CPU's vector width, cached under ``$TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``) in ``kvlab/<name>_<key>``: the key hashes the source, its
bound functions, the flags, the compiler, Python, torch's version and include paths and
``sys.prefix``, so two virtual environments keep one build each. A build runs in a private
temporary directory renamed into place only once it succeeded: a process killed mid-build
leaves a stray temporary directory (removed by the next process: the builder holds an
``flock`` on its ``owner`` file, which the kernel releases when the builder dies), never a
half-built cache or a ``lock`` file that would make the next process wait forever. Where the
build fails, or with ``KVLAB_CPU_ATTENTION=0``, there are no ops and the engine keeps the torch
paths, which compute the same thing (``tests/test_cpu_kernels.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import itertools
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["DTYPES", "available", "build_error", "build_name", "chunk_attention", "compiled",
           "decode_attention"]

#: what the kernel computes in (it accumulates in float32, so float64 stays on the torch path)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.cpp"
_FUNCTIONS = ("decode_attention", "chunk_attention", "rms_norm", "rope_", "silu_and_mul")
_FLAGS = {  # the vector extensions of torch's CPU capability levels
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}
_lock = threading.Lock()
_module: Any = None
_error: str | None = None


#: a temporary build directory without an ``owner`` file older than this is a leftover (seconds)
STALE_BUILD_S = 3600.0


def _build_root() -> Path:
    """Where kvlab's builds live: ``$TORCH_EXTENSIONS_DIR/kvlab`` (torch's default root)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "kvlab"


def _cflags(capability: str) -> list[str]:
    return ["-O3", "-ffast-math", "-fopenmp-simd", *_FLAGS.get(capability, [])]


def build_name(capability: str | None = None) -> str:
    """The module (and directory) name of this environment's build: ``..._<capability>_<key>``
    with ``key`` a hash of everything the binary depends on (see the module docstring)."""
    from torch.utils.cpp_extension import include_paths

    capability = capability or torch.backends.cpu.get_cpu_capability()
    parts = [_SOURCE.read_text(), *_FUNCTIONS, " ".join(_cflags(capability)), torch.__version__,
             sys.version, sys.prefix, *include_paths(), os.environ.get("CXX", "c++")]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]
    return f"kvlab_paged_attention_cpu_{capability.lower()}_{key}"


def _import(name: str, directory: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, directory / f"{name}.so")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {directory / name}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _claim(tmp: Path) -> int:
    """Mark ``tmp`` as this process's live build: an exclusive ``flock`` on ``tmp/owner``, taken
    before the name appears (so no other process ever sees an unlocked owner of a live build)."""
    fd = os.open(tmp / "owner.new", os.O_CREAT | os.O_WRONLY, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(tmp / "owner.new", tmp / "owner")
    return fd


def _remove_stale(root: Path, name: str) -> None:
    """Delete the temporary directories of dead builds: those whose ``owner`` lock is free (its
    builder died, the kernel released the lock) and, without an owner, those older than
    ``STALE_BUILD_S``."""
    for tmp in root.glob(f"{name}.tmp-*"):
        try:
            fd = os.open(tmp / "owner", os.O_RDONLY)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                if time.time() - tmp.stat().st_mtime > STALE_BUILD_S:
                    shutil.rmtree(tmp, ignore_errors=True)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue                                   # a live build holds it
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        finally:
            os.close(fd)


def _build() -> Any:
    """Load this environment's build, or build it in a temporary directory and rename that
    into place (atomic: another process sees the whole build or none; if two build at once,
    the first rename wins and the other's copy is discarded)."""
    from torch.utils.cpp_extension import load_inline

    capability = torch.backends.cpu.get_cpu_capability()
    name = build_name(capability)
    root = _build_root()
    final = root / name
    _remove_stale(root, name)
    if (final / f"{name}.so").is_file():
        return _import(name, final)
    if shutil.which("ninja") is None:   # the pip package's binary, when its bin dir is off PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{name}.tmp-", dir=root))
    owner = _claim(tmp)
    try:
        module = load_inline(name, cpp_sources=_SOURCE.read_text(), functions=list(_FUNCTIONS),
                             extra_cflags=_cflags(capability), build_directory=str(tmp))
        # the loaded .so stays mapped whatever happens to tmp; OSError: another process
        # renamed its build into place first
        with contextlib.suppress(OSError):
            os.rename(tmp, final)
        return module
    finally:
        os.close(owner)
        shutil.rmtree(tmp, ignore_errors=True)


def available() -> bool:
    """True when the kernel is built (building it on the first call; thread-safe). False with
    ``KVLAB_CPU_ATTENTION=0`` or when the build failed (a warning says why, once)."""
    global _module, _error
    if os.environ.get("KVLAB_CPU_ATTENTION", "1") == "0":
        return False
    if _module is not None or _error is not None:
        return _module is not None
    with _lock:
        if _module is None and _error is None:
            try:
                _module = _build()
            except Exception as error:  # no compiler, no ninja, a read-only cache, ...
                _error = f"{type(error).__name__}: {error}"
                warnings.warn(f"kvlab: the CPU attention kernel could not be built ({_error}); "
                              "using the torch path", RuntimeWarning, stacklevel=2)
    return _module is not None


def compiled() -> Any | None:
    """The loaded build (building it on first use), or None where there is none
    (``KVLAB_CPU_ATTENTION=0``, or the build failed). Its functions check nothing: ``
    decode_attention(out, q, k_cache, v_cache, tables, lens, scale, window)`` and
    ``chunk_attention(out, q, k_cache, v_cache, tables, query_start, start_pos, chunks, scale,
    window)`` with the contracts of
    the checked entry points below (float32, bfloat16 or float16), and the float32 layer ops
    ``rms_norm(x, weight, eps)``, ``rope_(x, cos, sin)`` (in place), ``silu_and_mul(gate_up)``."""
    return _module if available() else None


def build_error() -> str | None:
    """Why the kernel is not available (None when it is, or before the first build)."""
    return _error


def _check_window(op: str, window: int) -> int:
    if not (isinstance(window, int) and not isinstance(window, bool) and window >= 0):
        raise ValueError(f"{op}: window must be an int >= 0 (0: none), got {window!r}")
    return window


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: torch.Tensor, lens: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Attention of ``q: [R, H, D]`` (one token per row) over the first ``lens[r]`` positions
    of row ``r``'s table ``tables[r]`` (``[R, W]`` block ids) in the paged caches
    ``[num_blocks, block_size, KV, D]`` (the last ``window`` of them when ``window > 0``);
    returns ``out: [R, H, D]`` (written in place if given).

    ValueError for shapes, dtypes or devices that do not fit, a length outside
    ``1 .. W * block_size`` or a block id outside the cache: the kernel reads raw memory, so
    everything it would index is checked here first. RuntimeError if the kernel is unavailable.
    """
    if not available():
        raise RuntimeError(f"the CPU attention kernel is not available: {_error or 'disabled'}")
    window = _check_window("decode_attention", window)
    rows, heads, dim = q.shape
    num_blocks, block_size, kv_heads, kdim = k_cache.shape
    if (v_cache.shape != k_cache.shape or kdim != dim or heads % kv_heads
            or q.dtype not in DTYPES or q.dtype != k_cache.dtype or v_cache.dtype != q.dtype
            or any(t.device.type != "cpu" for t in (q, k_cache, v_cache, tables, lens))):
        raise ValueError("decode_attention: q [R, H, D] and caches [N, bs, KV, D] of one dtype "
                         "of DTYPES on the CPU, with KV dividing H")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode_attention: the KV caches must be contiguous")
    if tables.dtype != torch.long or lens.dtype != torch.long or tables.dim() != 2 \
            or tables.shape[0] != rows or lens.shape != (rows,):
        raise ValueError("decode_attention: tables [R, W] and lens [R] must be int64")
    if rows:
        if int(lens.min()) < 1 or int(lens.max()) > tables.shape[1] * block_size:
            raise ValueError(f"decode_attention: lengths must lie in 1..{tables.shape[1]} "
                             f"blocks of {block_size}")
        if int(tables.min()) < 0 or int(tables.max()) >= num_blocks:
            raise ValueError(f"decode_attention: block ids must lie in 0..{num_blocks - 1}")
    if out is None:
        out = torch.empty(rows, heads, dim, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("decode_attention: out must be a contiguous tensor like q")
    _module.decode_attention(out, q.contiguous(), k_cache, v_cache, tables.contiguous(),
                             lens.contiguous(), float(scale), window)
    return out


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    tables: torch.Tensor, query_start: list[int], start_pos: list[int],
                    scale: float, out: torch.Tensor | None = None, window: int = 0
                    ) -> torch.Tensor:
    """Causal attention of chunks whose K/V are already in the paged caches: chunk ``s`` owns
    rows ``query_start[s] .. query_start[s+1]-1`` of ``q: [N, H, D]`` at positions
    ``start_pos[s] ...`` and reads table ``tables[s]`` (each query only its last ``window``
    positions when ``window > 0``); returns ``out: [N, H, D]``.

    ValueError for shapes, dtypes or devices that do not fit (``D`` a multiple of 4), offsets
    that do not tile ``N``, or a table that
    does not cover its chunk or holds a block id outside the cache (the kernel reads raw
    memory). RuntimeError if the kernel is unavailable.
    """
    if not available():
        raise RuntimeError(f"the CPU attention kernel is not available: {_error or 'disabled'}")
    window = _check_window("chunk_attention", window)
    rows, heads, dim = q.shape
    num_blocks, block_size, kv_heads, kdim = k_cache.shape
    if (v_cache.shape != k_cache.shape or kdim != dim or dim % 4 or heads % kv_heads
            or q.dtype not in DTYPES
            or q.dtype != k_cache.dtype or v_cache.dtype != q.dtype
            or any(t.device.type != "cpu" for t in (q, k_cache, v_cache, tables))):
        raise ValueError("chunk_attention: q [N, H, D] and caches [N, bs, KV, D] of one dtype "
                         "of DTYPES on the CPU, D a multiple of 4, KV dividing H")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("chunk_attention: the KV caches must be contiguous")
    chunks = len(start_pos)
    if (tables.dtype != torch.long or tables.dim() != 2 or tables.shape[0] != chunks
            or len(query_start) != chunks + 1 or query_start[0] != 0
            or query_start[-1] != rows
            or any(b <= a for a, b in itertools.pairwise(query_start))):
        raise ValueError("chunk_attention: int64 tables [B, W], B + 1 increasing offsets "
                         "from 0 to N and B start positions")
    for s, start in enumerate(start_pos):
        end = start + query_start[s + 1] - query_start[s]
        used = tables[s, :-(-end // block_size)]
        if start < 0 or -(-end // block_size) > tables.shape[1]:
            raise ValueError(f"chunk_attention: table {s} does not cover positions 0..{end - 1}")
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            raise ValueError(f"chunk_attention: block ids must lie in 0..{num_blocks - 1}")
    if q.stride(2) != 1 or q.stride(1) != dim:
        q = q.contiguous()
    if out is None:
        out = torch.empty(rows, heads, dim, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("chunk_attention: out must be a contiguous tensor like q")
    _module.chunk_attention(out, q, k_cache, v_cache, tables.contiguous(), list(query_start),
                            list(start_pos), list(range(chunks)), float(scale), window)
    return out
