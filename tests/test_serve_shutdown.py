"""Graceful shutdown: on SIGTERM (or SIGINT) streams end cleanly and the server process exits 0."""

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from test_serve_fixtures import MODEL, free_port, sse_events

from tokenmind.serve.server import GracefulServer

SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from test_serve_fixtures import tiny_pretrained
from tokenmind.serve import ServeConfig, run_server
run_server(ServeConfig(model="tiny", port={port}, shutdown_timeout=1.0), tiny_pretrained(step_delay=0.02, context=512))
"""


def wait_healthy(url, proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server process died while starting"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not become healthy")


def test_sigterm_lets_short_requests_finish_aborts_long_ones_and_exits_0(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w+")
    script = SCRIPT.format(tests=str(Path(__file__).parent), port=port)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc)
        results, ended, started = {}, {}, threading.Barrier(3)

        def stream(name, max_tokens):
            body = {"model": MODEL, "messages": [{"role": "user", "content": name}], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                started.wait()
                results[name] = sse_events([first, *lines])
            ended[name] = time.monotonic()

        threads = [threading.Thread(target=stream, args=("short", 20)),  # ~0.4 s: inside the 1 s grace period
                   threading.Thread(target=stream, args=("long", 400))]  # ~8 s: aborted when the grace period ends
        for t in threads:
            t.start()
        started.wait(timeout=30)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with pytest.raises((httpx.TransportError, httpx.HTTPStatusError)):  # no new work once shutting down
            httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=5) \
                .raise_for_status()
        for t in threads:
            t.join(timeout=30)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    output = log.read()
    for name, reason in (("short", "length"), ("long", "abort")):
        events = results[name]
        assert events[-1] == "[DONE]", (name, output)
        assert events[-2]["choices"][0]["finish_reason"] == reason, (name, output)
    assert len("".join(e["choices"][0]["delta"].get("content", "") for e in results["short"][:-1])) == 20
    long_text = "".join(e["choices"][0]["delta"].get("content", "") for e in results["long"][:-1])
    assert len(long_text) < 300 and ended["long"] - t0 < 6.0  # aborted after the 1 s grace period, not run to 400
    assert "aborting 1 unfinished request" in output


def test_sigint_and_sigterm_start_the_same_graceful_shutdown():
    """The in-process half of the signal path (signals reach only a main thread, so no live server here)."""
    calls = []
    server = GracefulServer(uvicorn.Config(app=None), on_exit=lambda: calls.append(1))
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN when run as a background job
    with server.capture_signals():
        assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM) == server.handle_exit
    assert signal.getsignal(signal.SIGINT) is before  # restored, and not re-raised
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and not server.force_exit and calls == [1]
    server.handle_exit(signal.SIGINT, None)  # a second Ctrl-C forces the exit
    assert server.force_exit and calls == [1]
