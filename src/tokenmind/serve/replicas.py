"""Starting the engine replicas behind the router, and `serve_replicas`, what `tokenmind serve --replicas N` runs.

A replica is a plain `tokenmind serve` process: one engine loop and one KV cache per process, so
N replicas use N cores' worth of engines without sharing a Python interpreter, and a crash takes
down one replica, not the router. `ReplicaProcess` starts one from a `ServeConfig` (written to a
temporary YAML file, the API key passed in the environment, never on disk); `LocalReplicas` runs N
of them on this machine (loopback ports), `RayReplicas` runs each inside a Ray actor, spread over
a cluster's nodes, bound to its node's address. Both stop their replicas on close (SIGTERM, which
drains them, then SIGKILL); on Linux a replica also gets SIGTERM when the process that started it
dies, so even a killed router leaves no replica behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import httpx
import uvicorn
import yaml

from ..config import config_dict
from .config import ServeConfig
from .router import RouterConfig, build_router_app
from .server import GracefulServer, warn_if_exposed

log = logging.getLogger("tokenmind.serve.router")
PR_SET_PDEATHSIG = 1  # prctl(2) option: the signal this process gets when its parent thread exits


def replica_settings(serve: ServeConfig) -> dict[str, Any]:
    """The `ServeConfig` fields a replica runs with: all but the front door's own (bind address, API
    key, Host names, CORS), which the router handles."""
    settings = config_dict(serve)
    for name in ("host", "port", "api_key", "allowed_hosts", "cors_origins"):
        settings.pop(name)
    return settings


def replica_threads(config: RouterConfig, count: int) -> int:
    """Torch threads per replica: `replica_threads`, or this machine's cores shared out."""
    return config.replica_threads or max(1, (os.cpu_count() or 1) // count)


def _die_with_parent() -> Callable[[], Any] | None:
    """A call for the child to make before exec: SIGTERM when the starting thread's process dies, so a
    killed router leaves no replica behind (Linux prctl; None elsewhere, or off the main thread, since
    the signal follows the thread that started the child). Resolved here, before the fork."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        return functools.partial(ctypes.CDLL(None, use_errno=True).prctl, PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return None


def _free_port(host: str) -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _node_ip() -> str:
    """This Ray node's address (replicas on other machines must be reachable from the router)."""
    import ray

    return ray.util.get_node_ip_address()


class ReplicaProcess:
    """One `tokenmind serve` child process. Also the body of a Ray actor, so it holds only plain state."""

    def __init__(self, settings: dict[str, Any], threads: int, api_key: str | None = None,
                 command: list[str] | None = None):
        """`command`: run this instead of `tokenmind serve --config ...` (`{port}` and `{host}` are
        filled in); for tests that serve an in-memory model."""
        self.settings, self.threads, self.api_key, self.command = settings, threads, api_key, command
        self.proc: subprocess.Popen | None = None
        self.folder: tempfile.TemporaryDirectory | None = None

    def start(self, host: str | None = "127.0.0.1") -> str:
        """Start the server on a free port of `host` (None: this Ray node's address); returns its URL."""
        host = host or _node_ip()
        port = _free_port(host)
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        env.pop("TOKENMIND_API_KEY", None)
        if self.api_key is not None:
            env["TOKENMIND_API_KEY"] = self.api_key  # read by load_serve_config: the key stays off the disk
        if self.command is None:
            self.folder = tempfile.TemporaryDirectory(prefix="tokenmind-replica-")
            path = Path(self.folder.name) / "serve.yaml"
            path.write_text(yaml.safe_dump(self.settings, sort_keys=False), encoding="utf-8")
            argv = [sys.executable, "-m", "tokenmind.cli", "serve", "--config", str(path), "--host", host,
                    "--port", str(port)]
        else:
            argv = [a.format(host=host, port=port) for a in self.command]
        # the child runs one prepared foreign call (prctl) before exec; nothing that takes a lock
        self.proc = subprocess.Popen(argv, env=env, preexec_fn=_die_with_parent())  # noqa: PLW1509
        return f"http://{host}:{port}"

    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def exit_code(self) -> int | None:
        """None while running."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the replica drains its requests), SIGKILL after `timeout` seconds; the exit status."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("replica pid %d did not stop within %gs: killing it", self.proc.pid, timeout)
                self.proc.kill()
                self.proc.wait()
        if self.folder is not None:
            self.folder.cleanup()
            self.folder = None
        return None if self.proc is None else self.proc.returncode


def wait_until_healthy(urls: list[str], timeout: float, check_alive: Callable[[], None] | None = None) -> None:
    """Block until every URL's /health answers 200; `check_alive()` raises if a replica died meanwhile."""
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending:
        if check_alive is not None:
            check_alive()
        for url in list(pending):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    pending.remove(url)
                    log.info("replica %s is ready", url)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"replicas {pending} did not become healthy within {timeout:g}s; see their logs above")
        if pending:
            time.sleep(0.25)


class LocalReplicas:
    """`config.replicas` replica processes on this machine's loopback; a context manager that stops them."""

    def __init__(self, serve: ServeConfig, config: RouterConfig, command: list[str] | None = None):
        threads = replica_threads(config, config.replicas)
        self.config = config
        self.replicas = [ReplicaProcess(replica_settings(serve), threads, serve.api_key, command)
                         for _ in range(config.replicas)]
        self.shutdown_timeout = serve.shutdown_timeout + 10.0

    def start(self) -> list[str]:
        """Start every replica and wait until all are healthy; their URLs."""
        urls = [r.start() for r in self.replicas]
        log.info("started %d replicas (%s), waiting until they are ready", len(urls), ", ".join(urls))
        wait_until_healthy(urls, self.config.startup_timeout, self.check_alive)
        return urls

    def check_alive(self) -> None:
        for i, r in enumerate(self.replicas):
            if r.exit_code() is not None:
                raise RuntimeError(f"replica {i} (pid {r.pid()}) exited with status {r.exit_code()} while starting; "
                                   "its log is above")

    def close(self) -> None:
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.terminate()  # all at once: they drain in parallel
        for r in self.replicas:
            r.stop(self.shutdown_timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RayReplicas:
    """One Ray actor per replica (spread over the cluster's nodes, `replica_threads` CPUs each), each
    running a `ReplicaProcess` bound to its node's address. Joins `ray_address`, the Ray instance this
    process already joined, or starts a local one (shut down on close)."""

    def __init__(self, serve: ServeConfig, config: RouterConfig):
        from ..data.ray_pipeline import import_ray

        self.ray = import_ray()
        self.serve, self.config = serve, config
        self.threads = replica_threads(config, config.replicas)
        self.started_ray = False
        self.actors: list[Any] = []

    def start(self) -> list[str]:
        ray = self.ray
        if not ray.is_initialized():
            ray.init(address=self.config.ray_address, include_dashboard=False)
            self.started_ray = True
        actor = ray.remote(ReplicaProcess).options(num_cpus=self.threads, scheduling_strategy="SPREAD")
        settings = replica_settings(self.serve)
        self.actors = [actor.remote(settings, self.threads, self.serve.api_key) for _ in range(self.config.replicas)]
        urls = ray.get([a.start.remote(None) for a in self.actors], timeout=self.config.startup_timeout)
        log.info("started %d replicas on Ray (%s), waiting until they are ready", len(urls), ", ".join(urls))
        wait_until_healthy(urls, self.config.startup_timeout, self.check_alive)
        return urls

    def check_alive(self) -> None:
        codes = self.ray.get([a.exit_code.remote() for a in self.actors], timeout=60)
        for i, code in enumerate(codes):
            if code is not None:
                raise RuntimeError(f"replica {i} (a Ray actor's process) exited with status {code} while starting; "
                                   "see the actor's log (ray logs, or the driver's output)")

    def close(self) -> None:
        timeout = self.serve.shutdown_timeout + 10.0
        with contextlib.suppress(Exception):  # an actor already gone (its node died) has nothing left to stop
            self.ray.get([a.stop.remote(timeout) for a in self.actors], timeout=timeout + 30)
        for a in self.actors:
            self.ray.kill(a)
        if self.started_ray:
            self.ray.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def router_server(serve: ServeConfig, config: RouterConfig, urls: list[str]) -> GracefulServer:
    """A ready-to-run uvicorn server for the router over `urls` (`.run()` blocks; tests run it on a thread)."""
    app = build_router_app(urls, config, serve)
    uv = uvicorn.Config(app, host=serve.host, port=serve.port, log_level=serve.log_level, access_log=False,
                        timeout_graceful_shutdown=serve.shutdown_timeout + 5.0)
    return GracefulServer(uv, on_exit=lambda: None)  # exits 0 on SIGTERM, so the caller stops the replicas


def serve_replicas(serve: ServeConfig, config: RouterConfig) -> int:
    """`tokenmind serve --replicas N`: start the replicas (or take `replica_urls`), serve the router on
    `serve.host:serve.port` until SIGINT/SIGTERM, then stop the replicas. Exit status 0."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=serve.log_level.upper(), format="%(levelname)s: %(message)s", stream=sys.stderr)
    warn_if_exposed(serve)
    if threading.current_thread() is threading.main_thread():  # a SIGTERM while replicas start still stops them
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if config.replica_urls:
        launcher: LocalReplicas | RayReplicas | contextlib.nullcontext = contextlib.nullcontext()
    elif config.launcher == "ray":
        launcher = RayReplicas(serve, config)
    else:
        launcher = LocalReplicas(serve, config)
    with launcher:
        urls = config.replica_urls or launcher.start()
        server = router_server(serve, config, urls)
        log.info("routing (%s) over %d replicas on http://%s:%d/v1", config.policy, len(urls), serve.host, serve.port)
        server.run()
    return 0

