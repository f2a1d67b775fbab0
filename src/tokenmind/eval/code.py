"""Code generation scored by running tests: HumanEval pass@k.

A completion passes when the problem's prompt + the completion + its unit tests run to the end
without an exception. pass@k is the chance that at least one of k samples passes. Estimating it
as "did any of the first k samples pass" is high-variance, so, following Chen et al. (2021), n ≥ k
samples are drawn per problem, c of them pass, and the unbiased estimator is

    pass@k = 1 - C(n - c, k) / C(n, k)

(the chance that k samples drawn without replacement from the n are not all failures), computed
as a product so that large n does not overflow. With greedy decoding n = k = 1 and pass@1 is the
fraction of problems solved.

Completions are untrusted model output: each program runs in a separate Python process
(isolated mode, a fresh temporary directory as working directory, no inherited environment
beyond PATH) that is killed after `timeout` seconds. That contains crashes, infinite loops and
stray files, not a malicious program; run untrusted models' evaluations in a container.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from ..engine.sampling import SamplingParams
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


def run_program(source: str, timeout: float = 10.0) -> bool:
    """True if `source` exits with status 0 within `timeout` seconds in a fresh Python process."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "program.py")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(source)
        try:
            done = subprocess.run([sys.executable, "-I", path], cwd=tmp, capture_output=True, timeout=timeout,
                                  env={"PATH": os.environ.get("PATH", "")})
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0


def humaneval_program(item: Item, completion: str) -> str:
    """The program that tests one completion: prompt, completion, the tests, and the check call."""
    return f"{item['prompt']}{completion}\n\n{item['test']}\n\ncheck({item['entry_point']})\n"


def evaluate_humaneval(model, tokenizer, items: Sequence[Item], *, max_tokens: int = 384, batch_size: int = 32,
                       timeout: float = 10.0, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Greedy pass@1 on HumanEval `items`: the prompt (a signature and docstring) is continued as
    plain text, cut at the next top-level statement, and tested. `progress` counts generated
    completions and then tested programs (2 per item)."""
    prompts = [tokenizer.encode(item["prompt"], add_special_tokens=True) for item in items]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=STOP)
    completions = generate_batch(model, tokenizer, prompts, params, batch_size, progress)
    predictions = []
    for item, completion in zip(items, completions):
        passed = run_program(humaneval_program(item, completion), timeout)
        predictions.append({"id": item["task_id"], "passed": passed, "completion": completion})
        if progress is not None:
            progress(1)
    n = len(predictions)
    score = sum(pass_at_k(1, int(p["passed"]), 1) for p in predictions) / max(n, 1)
    return {"pass@1": score, "n": n, "predictions": predictions}
