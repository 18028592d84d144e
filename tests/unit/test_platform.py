"""What megatron needs where TE is missing applies on a GPU machine too, not only on CPU."""

import importlib
import subprocess
import sys

import pytest
import torch

from megatron_multilora.platform import cpu_support, support_megatron_here


def test_the_router_gemm_stand_in_does_not_depend_on_cuda(monkeypatch):
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    assert not moe_utils.HAVE_TE
    inp, weight = torch.randn(5, 8), torch.randn(3, 8)
    # A GPU machine without TE: the CPU shims stay off, the name is undefined.
    monkeypatch.delattr(moe_utils, "te_general_gemm")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpu_support, "_active", False)
    with pytest.raises(NameError, match="te_general_gemm"):
        moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    support_megatron_here()  # what init_parallel runs
    assert not cpu_support._active  # no CPU shim on a CUDA machine
    out = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    torch.testing.assert_close(out, inp @ weight.t())


def test_megatron_imported_by_the_cpu_shims_prepares_no_compiled_kernels():
    """Activated before megatron's first import (as the recipe does), the CPU shims import it
    with its jit_fuser off: its fused kernels stay plain functions, and torch.compile is
    torch's own again for everyone else; megatron's optional wandb logging is off, and
    wandb imports for whoever asks for it later."""
    code = """
import sys, torch
real = torch.compile
from megatron_multilora.platform import support_megatron_here
assert "megatron.core" not in sys.modules
support_megatron_here()
from megatron.core import jit
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.transformer.moe import router
assert torch.compile is real
assert jit.jit_fuser is jit.noop_decorator, jit.jit_fuser
for fn in (fused_bias_swiglu.swiglu, router.TopKRouter._apply_expert_bias):
    assert not hasattr(fn, "_torchdynamo_orig_callable"), fn  # what torch.compile wraps
from megatron.core.inference.contexts import dynamic_context
assert "wandb" not in sys.modules and not dynamic_context.HAVE_WANDB
import wandb
assert wandb.init
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
