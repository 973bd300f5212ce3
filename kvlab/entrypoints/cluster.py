"""``python -m kvlab cluster``: N ``kvlab serve`` replicas behind vLLM's router, on loopback.

Each replica publishes its prefix cache's changes as vLLM KV events (a ZMQ PUB socket bound on
its own port, topic ``""``), and ``vllm-router`` (PyPI ``vllm-router``) fronts them with one
policy: ``round_robin``, ``cache_aware`` (the router's own approximate prefix tree of what it
sent where) or ``kv_aware`` (the replicas' events, one ``--kv-event-source`` each). Example::

    python -m kvlab cluster --replicas 2 --policy kv_aware --port 8100
    python -m kvlab bench --base-url http://127.0.0.1:8100 --model kvlab-tiny \\
        --dataset-name prefix_repetition --prefix-repetition-num-prefixes 24 ...

What vllm-router 0.1.17 needs of a replica, as measured against it (chapter 13): ``/health``,
``/v1/models``, ``/tokenize`` (its ``kv_aware`` asks ``/v1/completions/render`` first, which
vLLM serves only with ``--enable-scale-out`` and kvlab answers 404, then falls back to
``/tokenize``), and events on the topic its static sources subscribe to, which is ``""``
(vLLM's default; events on another topic never reach its index). It indexes the ``token_ids``
of each ``BlockStored`` by a hash of its own, so the replica's block hashes only name blocks for
``BlockRemoved``. Ctrl-C (or SIGTERM) stops the router, then the replicas, each waited for.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["POLICIES", "Cluster", "Replica", "free_port", "kvlab_replica", "main",
           "router_binary", "wait_ready"]

#: the router policies a cluster runs (vllm-router has more: random, power_of_two, ...)
POLICIES = ("round_robin", "cache_aware", "kv_aware")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_binary() -> str | None:
    """``vllm-router`` beside this Python, else on PATH (None: not installed)."""
    local = Path(sys.executable).parent / "vllm-router"
    return str(local) if local.exists() else shutil.which("vllm-router")


def wait_ready(url: str, proc: subprocess.Popen, *, path: str = "/health",
               timeout: float = 900.0) -> None:
    """Poll ``url + path`` until it answers 200; RuntimeError with the process's last output if
    it exits first, TimeoutError after ``timeout`` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with status {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} was not ready after {timeout:.0f} s")
        time.sleep(0.5)


@dataclass
class Replica:
    """One engine server: its HTTP URL and the ZMQ endpoint its KV events go to (as a
    subscriber connects to it)."""

    url: str
    events: str
    proc: subprocess.Popen


ReplicaCommand = Callable[[int, int], Sequence[str]]


def kvlab_replica(model: str, extra: Sequence[str] = ()) -> ReplicaCommand:
    """The command of a ``kvlab serve`` replica on ``(http_port, event_port)``."""
    def command(port: int, event_port: int) -> list[str]:
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{event_port}", "topic": ""}
        return [sys.executable, "-m", "kvlab", "serve", "--model", model, "--port", str(port),
                "--kv-events-config", json.dumps(config), *extra]
    return command


@dataclass
class Cluster:
    """Replicas (started once) and a router (restarted per policy). ``command(port,
    event_port)`` starts one replica; ``env(i)`` adds to replica ``i``'s environment. Use as a
    context manager: leaving it stops everything."""

    command: ReplicaCommand
    replicas: int = 2
    env: Callable[[int], dict[str, str]] | None = None
    log_dir: Path | None = None
    members: list[Replica] = field(default_factory=list)
    router: subprocess.Popen | None = None
    router_url: str | None = None
    _logs: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if type(self.replicas) is not int or self.replicas < 1:
            raise ValueError(f"replicas must be a positive int, got {self.replicas!r}")

    def _log(self, name: str):
        if self.log_dir is None:
            return subprocess.DEVNULL
        self.log_dir.mkdir(parents=True, exist_ok=True)
        handle = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed in stop()
        self._logs.append(handle)
        return handle

    def start_replicas(self, timeout: float = 900.0) -> list[Replica]:
        for i in range(self.replicas):
            port, event_port = free_port(), free_port()
            env = {**os.environ, **(self.env(i) if self.env else {})}
            proc = subprocess.Popen(list(self.command(port, event_port)), env=env,
                                    stdout=self._log(f"replica{i}"), stderr=subprocess.STDOUT)
            self.members.append(Replica(f"http://127.0.0.1:{port}",
                                        f"tcp://127.0.0.1:{event_port}", proc))
        for member in self.members:
            wait_ready(member.url, member.proc, timeout=timeout)
        return self.members

    def start_router(self, policy: str, *, port: int | None = None, block_size: int = 16,
                     model: str = "kvlab-tiny", extra: Sequence[str] = ()) -> str:
        """Start ``vllm-router`` with ``policy`` in front of the replicas (``kv_aware``: one
        static event source per replica, ``block_size`` their block size, ``model`` their
        served name); its URL. RuntimeError when the router is not installed."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        binary = router_binary()
        if binary is None:
            raise RuntimeError("vllm-router is not installed (pip install vllm-router: a "
                               "manylinux x86_64 wheel; it is in kvlab's [cluster] extra)")
        self.stop_router()
        port = free_port() if port is None else port
        argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                "--worker-urls", *(m.url for m in self.members), "--log-level", "warning"]
        if policy == "kv_aware":
            for m in self.members:
                argv += ["--kv-event-source", f"{m.url}={m.events}"]
            argv += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
        self.router = subprocess.Popen([*argv, *extra], stdout=self._log(f"router-{policy}"),
                                       stderr=subprocess.STDOUT)
        self.router_url = f"http://127.0.0.1:{port}"
        wait_ready(self.router_url, self.router, path="/v1/models", timeout=120)
        return self.router_url

    def stop_router(self) -> None:
        if self.router is not None:
            _stop(self.router)
            self.router = self.router_url = None

    def stop(self) -> None:
        """Stop the router, then every replica (SIGTERM, then SIGKILL after 30 s)."""
        self.stop_router()
        for member in self.members:
            member.proc.terminate()
        for member in self.members:
            _stop(member.proc)
        self.members.clear()
        for handle in self._logs:
            handle.close()
        self._logs.clear()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvlab cluster",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--policy", choices=POLICIES, default="kv_aware")
    ap.add_argument("--port", type=int, default=8100, help="the router's port")
    ap.add_argument("--model", default="kvlab-tiny")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--log-dir", default=None, help="write each process's output there")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER,
                    help="after --: more flags for every kvlab serve replica")
    args = ap.parse_args(argv)
    if args.replicas < 1:
        ap.error(f"--replicas must be >= 1, got {args.replicas}")
    extra = [a for a in args.serve_args if a != "--"]
    cluster = Cluster(kvlab_replica(args.model, ["--block-size", str(args.block_size), *extra]),
                      args.replicas, log_dir=Path(args.log_dir) if args.log_dir else None)

    def stop(signum, frame):   # SIGTERM: leave through the finally below
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        for member in cluster.start_replicas():
            print(f"replica {member.url} (KV events {member.events})", flush=True)
        url = cluster.start_router(args.policy, port=args.port, block_size=args.block_size,
                                   model=args.model)
        print(f"vllm-router --policy {args.policy} on {url}; Ctrl-C stops the cluster",
              flush=True)
        while all(m.proc.poll() is None for m in cluster.members) \
                and cluster.router.poll() is None:
            time.sleep(0.5)
        print("kvlab cluster: a process exited; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as err:
        print(f"kvlab cluster: {err}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
