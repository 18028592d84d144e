"""What megatron needs where TE is missing applies on a GPU machine too, not only on CPU."""

import importlib

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
