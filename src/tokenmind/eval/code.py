"""Code generation scored by running tests: HumanEval pass@k.

A completion passes when the problem's prompt + the completion + its unit tests run to the end
without an exception. pass@k is the chance that at least one of k samples passes. Estimating it
as "did any of the first k samples pass" is high-variance, so, following Chen et al. (2021), n ≥ k
samples are drawn per problem, c of them pass, and the unbiased estimator is

    pass@k = 1 - C(n - c, k) / C(n, k)

(the chance that k samples drawn without replacement from the n are not all failures), computed
as a product so that large n does not overflow. With greedy decoding n = k = 1 and pass@1 is the
fraction of problems solved.

Completions are untrusted model output: each program runs in `tokenmind.sandbox`: its own PID
and network namespaces (no network; every process it starts dies with it, detached or not), a
read-only filesystem except a private /tmp, an unprivileged uid, and limits on CPU time, memory,
file size, processes and open files; it is killed whole after `timeout` seconds. Where no
isolation works (bubblewrap missing, user namespaces disabled) the evaluation refuses to start,
before generating anything, unless the caller passes `allow_unsandboxed=True` or sets
TOKENMIND_ALLOW_UNSANDBOXED=1 (then only the timeout and rlimits apply).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

from ..engine.sampling import SamplingParams
from ..sandbox import SandboxConfig, require_isolation, run_python
from .generative import generate_batch

Item = dict[str, Any]
# A function body ends where the next top-level statement begins.
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset contains a passing sample
        return 1.0
    fail_all = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
        fail_all *= 1.0 - k / i
    return 1.0 - fail_all


def run_program(source: str, timeout: float = 10.0, *, allow_unsandboxed: bool = False) -> bool:
    """True if `source` exits with status 0 within `timeout` seconds, run in the sandbox."""
    return run_python(source, SandboxConfig(timeout_s=timeout, allow_unsandboxed=allow_unsandboxed)).ok


def humaneval_program(item: Item, completion: str, done_marker: str = "") -> str:
    """The program that tests one completion: prompt, completion, the tests, the check call, and
    (if given) a line printing `done_marker` once the check has returned."""
    program = f"{item['prompt']}{completion}\n\n{item['test']}\n\ncheck({item['entry_point']})\n"
    return program + (f"print({done_marker!r})\n" if done_marker else "")


def passes_tests(item: Item, completion: str, timeout: float = 10.0, *, allow_unsandboxed: bool = False) -> bool:
    """True if the completion's program gets through its tests. A clean exit is not enough: a
    completion could call `sys.exit(0)` before the tests run, so the program must also print a
    marker, secret to the completion, after the check call."""
    marker = f"tests-done-{secrets.token_hex(8)}"
    config = SandboxConfig(timeout_s=timeout, allow_unsandboxed=allow_unsandboxed)
    result = run_python(humaneval_program(item, completion, marker), config)
    return result.ok and marker in result.stdout


def evaluate_humaneval(model, tokenizer, items: Sequence[Item], *, max_tokens: int = 384, batch_size: int = 32,
                       timeout: float = 10.0, progress: Callable[[int], None] | None = None,
                       allow_unsandboxed: bool = False) -> dict[str, Any]:
    """Greedy pass@1 on HumanEval `items`: the prompt (a signature and docstring) is continued as
    plain text, cut at the next top-level statement, and tested. `progress` counts generated
    completions and then tested programs (2 per item). Raises `SandboxUnavailable` up front where
    programs cannot be isolated, unless `allow_unsandboxed`."""
    require_isolation(SandboxConfig(allow_unsandboxed=allow_unsandboxed))
    prompts = [tokenizer.encode(item["prompt"], add_special_tokens=True) for item in items]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=STOP)
    completions = generate_batch(model, tokenizer, prompts, params, batch_size, progress)
    predictions = []
    for item, completion in zip(items, completions):
        passed = passes_tests(item, completion, timeout, allow_unsandboxed=allow_unsandboxed)
        predictions.append({"id": item["task_id"], "passed": passed, "completion": completion})
        if progress is not None:
            progress(1)
    n = len(predictions)
    score = sum(pass_at_k(1, int(p["passed"]), 1) for p in predictions) / max(n, 1)
    return {"pass@1": score, "n": n, "predictions": predictions}
