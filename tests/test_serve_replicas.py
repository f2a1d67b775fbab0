"""`tokenmind serve --replicas N`: the prefix-cache-aware routing policy, the router over live replicas,
a replica killed mid-stream, clean shutdown without orphans, and replicas on Ray actors."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Self

import httpx
import openai
import pytest
from test_serve_fixtures import MODEL, LiveServer, free_port, sse_events, tiny_pretrained

from tokenmind.model.load import save_model
from tokenmind.serve.config import ServeConfig
from tokenmind.serve.replicas import RayReplicas, router_server
from tokenmind.serve.router import (
    NoReplicaAvailable,
    PrefixPolicy,
    Replica,
    RoundRobinPolicy,
    RouterConfig,
    prefix_hashes,
    routing_text,
)

PIRATE = "You are a pirate captain. Answer every question in a pirate's voice, briefly, and never break character."
POET = "You are a court poet of the fourteenth century. Answer only in rhyming couplets, with archaic words."


def chat(*turns: str, system: str = PIRATE) -> list[dict]:
    """A conversation: the system prompt, then user and assistant turns alternating."""
    roles = ["user", "assistant"]
    return [{"role": "system", "content": system}] + [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


def text_of(messages: list[dict]) -> str:
    return routing_text("/v1/chat/completions", {"model": MODEL, "messages": messages})


def replicas(n: int) -> list[Replica]:
    return [Replica(i, f"http://replica{i}", up=True) for i in range(n)]


# ----------------------------------------------------------------- the policy, as pure functions


def test_a_longer_conversation_extends_the_shorter_ones_routing_text_and_prefix_hashes():
    short, longer = text_of(chat("Where is the treasure?")), text_of(chat("Where is the treasure?", "Arr.", "Dig!"))
    assert longer.startswith(short)
    a, b = prefix_hashes(short, 32), prefix_hashes(longer, 32)
    assert len(a) == len(short) // 32 and b[:len(a)] == a  # block i names the whole prefix up to it
    other = prefix_hashes(text_of(chat("Where is the treasure?", system=POET)), 32)
    assert not set(other) & set(a[1:])  # a different system prompt: nothing shared after the common JSON head
    assert routing_text("/v1/completions", {"model": MODEL, "prompt": "Once upon"}).endswith("Once upon")
    assert routing_text("/v1/models", {}) is None


def test_prefix_policy_keeps_a_conversation_on_its_replica_and_spreads_new_prefixes():
    policy, reps = PrefixPolicy(block_chars=32), replicas(2)
    first = policy.choose(text_of(chat("Where is the treasure?")), reps)
    first.in_flight += 1  # still running: the next new prefix goes to the other, idle replica
    poet = policy.choose(text_of(chat("Where is the treasure?", system=POET)), reps)
    assert poet is not first
    follow_up = policy.choose(text_of(chat("Where is the treasure?", "Arr.", "Dig where?")), reps)
    assert follow_up is first and policy.stats["prefix_hit"] == 1 and policy.stats["least_loaded"] == 2
    # a new conversation with the same system prompt shares its first blocks: same replica
    assert policy.choose(text_of(chat("What ship do you sail?")), reps) is first


def test_prefix_policy_falls_back_to_the_least_loaded_when_the_holder_is_overloaded_or_down():
    policy, reps = PrefixPolicy(block_chars=32, max_imbalance=2), replicas(3)
    text = text_of(chat("Where is the treasure?"))
    holder = policy.choose(text, reps)
    holder.in_flight = 2  # 2 more than the idle ones: still within the bound
    assert policy.choose(text, reps) is holder
    holder.in_flight = 3
    moved = policy.choose(text, reps)
    assert moved is not holder and policy.stats["prefix_overloaded"] == 1
    moved.up = False  # the new holder goes down: back to the least loaded live replica
    assert policy.choose(text, reps) not in (moved, holder)
    for r in reps:
        r.up = False
    with pytest.raises(NoReplicaAvailable):
        policy.choose(text, reps)


def test_prefix_policy_forgets_the_least_recently_used_prefixes():
    policy = PrefixPolicy(block_chars=8, cache_entries=10)
    policy.choose("x" * 200, replicas(2))
    assert len(policy.holder) == 10


def test_round_robin_takes_turns_and_skips_down_replicas():
    policy, reps = RoundRobinPolicy(), replicas(3)
    assert [policy.choose("same prompt", reps).index for _ in range(4)] == [0, 1, 2, 0]
    reps[1].up = False
    assert [policy.choose("same prompt", reps).index for _ in range(3)] == [2, 0, 2]


def test_router_config_names_the_problem():
    with pytest.raises(ValueError, match="round_robin"):
        RouterConfig(policy="random")
    with pytest.raises(ValueError, match="http://"):
        RouterConfig(replica_urls=["10.0.0.2:8001"])
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        RouterConfig(replicas=0)
    assert RouterConfig(replicas=2).routed and not RouterConfig().routed
    assert RouterConfig(ray_address="auto").launcher == "ray"


# ----------------------------------------------------------------- the router over live replicas (in-process)


class LiveRouter:
    """The router on 127.0.0.1 (a free port) in a background thread, over `urls`."""

    def __init__(self, urls: list[str], config: RouterConfig, api_key: str | None = None):
        self.server = router_server(ServeConfig(model="", port=0, api_key=api_key, log_level="warning"), config, urls)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.router = self.server.config.app.state.router

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the router did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def test_router_routes_by_prefix_relays_streams_and_errors_and_survives_a_dead_replica():
    key = "sk-test"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with LiveServer(tiny_pretrained(context=512), api_key=key) as a, LiveServer(tiny_pretrained(context=512),
                                                                               api_key=key) as b:
        config = RouterConfig(health_interval=60.0, block_chars=32)  # no health check undoes the states set below
        with LiveRouter([dead, a.url, b.url], config, api_key=key) as live:
            reps = live.router.replicas
            assert [r.up for r in reps] == [False, True, True]  # checked once at start
            reps[0].up = True  # as if it died after its last health check: the first new prefix tries it
            client = openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0)
            turn1 = chat("Where is the treasure buried?")
            r1 = client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=8, temperature=0)
            assert not reps[0].up and "connection failed" in reps[0].reason  # refused, marked down, retried
            holder = next(r for r in reps if r.routed == 1 and r.up)
            turn2 = [*turn1, {"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And who guards it?"}]
            stream = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=8, temperature=0,
                                                    stream=True, stream_options={"include_usage": True})
            chunks = list(stream)
            assert holder.routed == 2  # the follow-up went where its prefix is cached ...
            assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16  # ... and hit that replica's cache
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            client.chat.completions.create(model=MODEL, messages=chat("Who are you?", system=POET), max_tokens=4)
            assert [r.routed for r in reps[1:]] in ([2, 1], [1, 2])  # a new prefix: the less busy replica

            auth = {"Authorization": f"Bearer {key}"}
            with httpx.stream("POST", live.url + "/v1/chat/completions", headers=auth, json={
                    "model": MODEL, "messages": turn1, "max_tokens": 300, "stream": True}) as r:
                next(line for line in r.iter_lines() if line.startswith("data: "))  # then the client leaves
            wait_for(lambda: all(r.in_flight == 0 for r in reps), 10, "the router frees the replica's slot")
            a.wait_idle(), b.wait_idle()  # ... and the replica aborted the generation

            with pytest.raises(openai.NotFoundError, match="does not exist"):  # the replica's 4xx, as it is
                client.chat.completions.create(model="nope", messages=turn1, max_tokens=4)
            bad = httpx.post(live.url + "/v1/chat/completions", content=b"{not json",
                             headers={**auth, "Content-Type": "application/json"})
            assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
            assert httpx.post(live.url + "/v1/chat/completions", json={}).status_code == 401  # the router's key check
            assert [m.id for m in client.models.list()] == [MODEL]

            metrics = httpx.get(live.url + "/metrics", headers=auth).text
            assert 'tokenmind_router_replica_up{replica="0",url="' + dead + '"} 0' in metrics
            rate = float(next(line.split()[-1] for line in metrics.splitlines()
                              if line.startswith("tokenmind_router_prefix_cache_hit_rate ")))
            assert 0 < rate < 1  # the aggregate of the replicas' own prefix-cache hit rates

            for r in reps:
                r.up = False
            with pytest.raises(openai.InternalServerError) as err:
                client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=4)
            assert err.value.status_code == 503 and err.value.body["code"] == "no_replica_available"
            health = httpx.get(live.url + "/health")
            assert health.status_code == 503 and health.json()["replicas_up"] == 0


# ----------------------------------------------------------------- end to end: the CLI, a killed replica, shutdown


def children_by_port(pid: int) -> dict[int, int]:
    """The child processes of `pid` that run a server, by the --port they were given."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and "--port" in argv:
            found[int(argv[argv.index("--port") + 1])] = int(entry.name)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, f"the router exited with {proc.returncode} while waiting: {what}"
        try:
            value = condition()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting: {what}")


@pytest.mark.slow
def test_cli_replicas_a_killed_replica_fails_its_requests_with_503_and_shutdown_leaves_no_process(tmp_path):
    model = save_model(tiny_pretrained(context=4096), tmp_path / "tiny")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tokenmind.cli", "serve", "--model", str(model), "--replicas", "2",
           "--replica-threads", "1", "--port", str(port), "--kv-cache-mb", "32", "--log-level", "warning"]
    with open(tmp_path / "router.log", "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)  # the child keeps its own copy
    try:
        wait_for(lambda: httpx.get(url + "/health", timeout=2).json()["replicas_up"] == 2, 150, "2 replicas", proc)
        pids = children_by_port(proc.pid)
        assert len(pids) == 2
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        long = {"model": "tiny", "messages": chat("Tell me a very long story."), "max_tokens": 3000,
                "extra_body": {"ignore_eos": True}}
        stream = client.chat.completions.create(stream=True, **long)
        next(iter(stream))  # running on one replica; a second request with the same prefix joins it there
        outcome = {}

        def collect():
            try:
                client.chat.completions.create(**long)
            except openai.APIStatusError as e:
                outcome["error"] = e

        waiter = threading.Thread(target=collect)
        waiter.start()
        busy = wait_for(lambda: [r for r in httpx.get(url + "/health").json()["replicas"] if r["in_flight"] == 2],
                        30, "both requests on one replica", proc)[0]
        victim = pids[int(busy["url"].rsplit(":", 1)[1])]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="replica .* stopped answering"):  # the stream's error event
            for _ in stream:
                pass
        waiter.join(timeout=30)
        assert not waiter.is_alive()
        assert outcome["error"].status_code == 503 and outcome["error"].body["code"] == "replica_failed"
        for question in ("Hello?", "Are you there?"):  # new requests go to the survivor
            reply = client.chat.completions.create(model="tiny", messages=chat(question), max_tokens=4)
            assert reply.choices[0].finish_reason in ("length", "stop")
        health = httpx.get(url + "/health").json()
        assert health["replicas_up"] == 1
        index = [r["url"] for r in health["replicas"]].index(busy["url"])
        assert f'tokenmind_router_replica_failures_total{{replica="{index}",url="{busy["url"]}"}} 2' in \
            httpx.get(url + "/metrics").text

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not [pid for pid in pids.values() if alive(pid)], "a replica outlived the router"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in children_by_port(proc.pid).values():
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_ray_replicas_answer_as_a_single_server_does(tmp_path):
    ray = pytest.importorskip("ray")
    model = save_model(tiny_pretrained(context=512), tmp_path / "tiny")
    request = {"model": "tiny", "messages": chat("Where is the treasure?"), "max_tokens": 12, "temperature": 0}
    with LiveServer(None, model=str(model)) as single:
        expected = httpx.post(single.url + "/v1/chat/completions", json=request, timeout=60).json()
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        serve = ServeConfig(model=str(model), kv_cache_bytes=16 << 20, log_level="warning")
        config = RouterConfig(replicas=1, launcher="ray", replica_threads=1)  # one: a second costs a minute here
        with RayReplicas(serve, config) as reps:
            urls = reps.start()
            pids = ray.get([a.pid.remote() for a in reps.actors])
            with LiveRouter(urls, config) as live:
                for _ in range(2):
                    got = httpx.post(live.url + "/v1/chat/completions", json=request, timeout=60).json()
                    assert got["choices"][0]["message"] == expected["choices"][0]["message"]
                events = sse_events(httpx.post(live.url + "/v1/chat/completions", json={**request, "stream": True},
                                               timeout=60).text.splitlines())
                assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]) \
                    == expected["choices"][0]["message"]["content"]
        assert not [pid for pid in pids if alive(pid)]
    finally:
        ray.shutdown()
