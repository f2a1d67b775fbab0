"""MKL's kernel choice on AMD CPUs (`model/cpu.py:take_mkl_intel_kernels`): taken when tokenmind loads before
torch, never after it or when turned off, and the matmuls stay as exact as fp32 allows either way.

Each case runs in a fresh interpreter: the choice is made when PyTorch loads. That it is faster is measured by
`benchmarks/bench_mkl_path.py`, not here.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenmind.model import ccompile, cpu

TAKES_THEM_HERE = (cpu.cpu_vendor() == "AuthenticAMD" and sys.platform == "linux"
                   and ccompile.find_compiler() is not None)

PROBE = """
import ctypes
{imports}
import torch
from tokenmind.model.cpu import mkl_intel_kernels_taken
g = torch.Generator().manual_seed(0)
a, b = torch.randn(300, 200, generator=g), torch.randn(200, 100, generator=g)
exact = a.double() @ b.double()
err = ((a @ b).double() - exact).abs().max().item() / exact.abs().max().item()
try:  # MKL's vendor check, as the dynamic linker resolves it for libtorch_cpu.so's own calls
    vendor_check = ctypes.CDLL(None).mkl_serv_intel_cpu_true()
except AttributeError:
    vendor_check = None
print(mkl_intel_kernels_taken(), vendor_check, err)
"""


def probe(imports: str, **env: str) -> tuple[bool, str, float]:
    base = {k: v for k, v in os.environ.items() if k != "TOKENMIND_MKL_INTEL_PATH"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], env={**base, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    taken, vendor_check, err = out.stdout.split()
    return taken == "True", vendor_check, float(err)


def test_importing_tokenmind_first_takes_the_intel_kernels_on_amd_cpus_only():
    taken, vendor_check, err = probe("import tokenmind")
    assert taken == TAKES_THEM_HERE
    if TAKES_THEM_HERE:
        assert vendor_check == "1"
    assert err < 1e-5


@pytest.mark.parametrize("imports, env", [("import torch; import tokenmind", {}),
                                          ("import tokenmind", {"TOKENMIND_MKL_INTEL_PATH": "0"})],
                         ids=["torch-loaded-first", "turned-off"])
def test_mkl_keeps_its_own_choice_after_torch_or_when_turned_off(imports, env):
    taken, vendor_check, err = probe(imports, **env)
    assert not taken
    if cpu.cpu_vendor() == "AuthenticAMD":  # (an Intel CPU's own check says 1, wherever the linker finds it)
        assert vendor_check != "1"
    assert err < 1e-5
