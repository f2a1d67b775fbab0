"""RL rollouts on Ray actors: the paged engine over a copy of the policy in each actor, the learner in the driver.

`RolloutActors` is the `workers` of a `RolloutLoader` (`rl.rollout_workers=N`). Ray is joined or
started as the data pipeline does it (`data.ray_pipeline.ray_session`: the cluster at
`rl.ray_address`, the one this process already joined, or a private local instance); actors start
on the first request, each with a pickled copy of the policy as it is then (LoRA adapters and
their routing included), its own `rollout_engine` and `rl.rollout_cpus` torch threads.

Weights travel, never files: after every optimizer step the trainer calls `push(model, version)`,
which puts the tensors that can change — everything but frozen parameters, so with LoRA only the
adapters (and buffers) — into Ray's object store once, and every actor copies them into its
model in place, as the optimizer updates the learner's; the engine then runs its adapter the way
it does in-process. A Ray actor runs its calls one at a time in the order the driver made them, so
a push sent after step t reaches each actor before any request sent after it, and every request
returns the version of the weights it ran on.

Requests are split into contiguous slices, one per actor, and come back in prompt order; each
prompt's sampling seed travels in its `SamplingParams`, so with one actor the tokens are the ones
the in-process engine draws. A dead actor raises `RolloutWorkerError` at the next result instead of
waiting, and a cluster too small for the actors is refused up front (Ray would queue them forever).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenmind.data.ray_pipeline import ray_session
from tokenmind.data.stages import DataPipelineConfig
from tokenmind.engine.sampling import SamplingParams
from tokenmind.model.load import Pretrained

from .rollout import Generation, generate_eval, rollout_engine


class RolloutWorkerError(RuntimeError):
    """A rollout actor died or failed; the run stops instead of waiting for it."""


class RolloutWorker:
    """One generator (a Ray actor): the paged engine over its own copy of the policy at `version`."""

    def __init__(self, policy: Pretrained, adapter: str | None, seqs: int, max_len: int, threads: int,
                 version: int) -> None:
        torch.set_num_threads(threads)
        policy.model.requires_grad_(False).eval()
        self.llm = rollout_engine(policy, seqs, max_len)
        self.adapter, self.version = adapter, version
        self.tensors = policy.model.state_dict(keep_vars=True)

    def load(self, state: dict[str, np.ndarray | torch.Tensor], version: int) -> None:
        """Copy the learner's changed tensors in place (the engine keeps running on the same ones)."""
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # only read
            for name, value in state.items():
                self.tensors[name].copy_(torch.from_numpy(value) if isinstance(value, np.ndarray) else value)
        self.version = version

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list, int, float]:
        """(outputs in prompt order, the weights' version, seconds)."""
        tick = time.perf_counter()
        outputs = generate_eval(self.llm, prompts, params, self.adapter)
        return outputs, self.version, time.perf_counter() - tick

    def weights_version(self) -> int:
        return self.version


def portable(tensor: torch.Tensor) -> np.ndarray | torch.Tensor:
    """The tensor on CPU, as a numpy array where numpy has its dtype: Ray stores arrays without pickling and
    actors read them in place (a 540 MB fp32 state dict: ~0.14 s instead of ~1.2 s to put here);
    bf16 and other dtypes numpy lacks stay tensors."""
    tensor = tensor.detach().cpu()
    try:
        return tensor.numpy()
    except TypeError:
        return tensor


def changing_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What an optimizer step (or a MoE balancing update) may change: the state dict less the frozen
    parameters; with LoRA, the adapters alone."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    return {name: t.detach() for name, t in model.state_dict().items() if name not in frozen}


class RolloutActors:
    """`count` Ray actors generating for a `RolloutLoader`; see the module docstring."""

    def __init__(self, policy: Pretrained, adapter: str | None, count: int, cpus: int, seqs: int, max_len: int,
                 address: str | None = None) -> None:
        self.stack = contextlib.ExitStack()
        try:
            self.ray = self.stack.enter_context(ray_session(DataPipelineConfig(engine="ray", ray_address=address)))
        except ImportError as err:
            raise ImportError(f"rl.rollout_workers={count} runs rollouts on Ray actors, and Ray is not installed: "
                              "pip install 'tokenmind[ray]' (or set rl.rollout_workers=0 to sample in-process)") from err
        available = self.ray.cluster_resources().get("CPU", 0)
        if available < count * cpus:
            self.stack.close()
            raise ValueError(f"rl.rollout_workers={count} × rl.rollout_cpus={cpus} needs {count * cpus} CPUs but the "
                             f"Ray cluster has {available:g}; lower them or add nodes")
        self.policy, self.adapter, self.count, self.cpus = policy, adapter, count, cpus
        self.seqs, self.max_len = -(-seqs // count), max_len
        self.actors: list[Any] = []
        self.version = 0

    def start(self) -> None:
        """The actors, each with a copy of the policy as it is now (on CPU: an actor holds no GPU)."""
        model = self.policy.model
        if next(model.parameters()).device.type != "cpu":
            model = copy.deepcopy(model).cpu()
        policy = self.ray.put(dataclasses.replace(self.policy, model=model))
        worker = self.ray.remote(num_cpus=self.cpus)(RolloutWorker)
        self.actors = [worker.remote(policy, self.adapter, self.seqs, self.max_len, self.cpus, self.version)
                       for _ in range(self.count)]

    def push(self, model: nn.Module, version: int) -> None:
        """Send the learner's weights, now `version`, to every actor (queued after its current work)."""
        self.version = version
        if self.actors:
            state = self.ray.put({name: portable(t) for name, t in changing_tensors(model).items()})
            for actor in self.actors:
                actor.load.remote(state, version)

    def submit(self, prompts: list[list[int]], params: list[SamplingParams]) -> PendingGeneration:
        """Split the requests into one contiguous slice per actor and start them."""
        if not self.actors:
            self.start()
        size = -(-len(prompts) // self.count)
        refs = [actor.generate.remote(prompts[k * size:(k + 1) * size], params[k * size:(k + 1) * size])
                for k, actor in enumerate(self.actors) if k * size < len(prompts)]
        return PendingGeneration(self, refs)

    def get(self, refs: list[Any]) -> list[Any]:
        """`ray.get`, with a dead or failing actor turned into a `RolloutWorkerError`."""
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayActorError as err:
            raise RolloutWorkerError(f"a rollout actor died ({type(err).__name__}: {str(err).splitlines()[0]}); the "
                                     "run stops here. Resume from the last checkpoint with --train.resume=true; if "
                                     "actors run out of memory, lower rl.group_size or data.batch_size") from err
        except self.ray.exceptions.RayTaskError as err:
            raise RolloutWorkerError(f"a rollout actor failed: {err}") from err

    def versions(self) -> list[int]:
        """The weights' version each actor holds now (after the pushes sent so far)."""
        return self.get([actor.weights_version.remote() for actor in self.actors])

    def close(self) -> None:
        """Stop the actors, and Ray if this run started it."""
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
        self.stack.close()


@dataclasses.dataclass
class PendingGeneration:
    """Requests on the actors; `result()` waits for them."""

    actors: RolloutActors
    refs: list[Any]

    def result(self) -> Generation:
        outputs, versions, seconds = [], [], 0.0
        for part, version, part_s in self.actors.get(self.refs):
            outputs += part
            versions += [version] * len(part)
            seconds = max(seconds, part_s)  # the actors run side by side
        return Generation(outputs, versions, seconds)
