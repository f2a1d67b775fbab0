"""Suite-wide settings for running the tests in parallel with pytest-xdist (`make test`: `-n 2 --dist loadfile`).

Each xdist worker computes with one thread, so two workers share two cores instead of oversubscribing them
(serially the suite runs single-threaded anyway: several test modules call torch.set_num_threads(1) on import).
Tests are scheduled a module at a time, so module-scoped fixtures (a loaded SmolLM2, a trained run) are built
once, except that the tests starting a local Ray instance form one unit of their own: two Ray clusters at once
on two cores starve each other's raylets and actors. xdist's own `xdist_group` marks cannot express this here:
with pytest 9 its loadgroup mode no longer rewrites node ids, so the marks are ignored.
"""
from __future__ import annotations

import os
from pathlib import PurePosixPath

import pytest

import tokenmind  # noqa: F401  (before torch: the suite runs the MKL kernels users get, model/cpu.py)

XDIST = "PYTEST_XDIST_WORKER" in os.environ
if XDIST:
    # Before torch is imported anywhere: sets torch's own pool, and the subprocesses the tests start inherit it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)

# Tests that start a local Ray cluster (ray.init, Ray Train, Ray Serve replicas): every test of the first two
# modules, the tests with "ray" in their name in the others.
RAY_MODULES = {"test_data_ray.py": "", "test_rl_ray.py": "", "test_serve_replicas.py": "ray",
               "test_train_multinode.py": "ray"}


def schedule_unit(nodeid: str) -> str:
    """The unit a test is scheduled in under xdist: "ray" for the tests that start Ray, else its module."""
    path, _, name = nodeid.partition("::")
    marker = RAY_MODULES.get(PurePosixPath(path).name)
    return "ray" if marker is not None and marker in name.lower() else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` with the Ray tests of all modules as one more unit (see the module docstring)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SuiteScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return schedule_unit(nodeid)

    return SuiteScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, order the units that hold `slow` tests (real SmolLM2 training, Ray, subprocess runs) first,
    so the longest start first and the short ones fill in at the end (run with --no-loadscope-reorder, which
    keeps this order instead of sorting the units by their number of tests)."""
    if not XDIST:
        return
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(schedule_unit(item.nodeid), []).append(item)
    slow_first = sorted(units.values(), key=lambda unit: not any(i.get_closest_marker("slow") for i in unit))
    items[:] = [item for unit in slow_first for item in unit]
