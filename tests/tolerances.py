"""Tolerances that come from the computation compared, not fixed numbers.

Two fp32 computations that differ only in the order of their sums (other GEMM kernels, other
blockings) each lie within gamma_n * sum|terms| of the exact sum of n terms (Higham, Accuracy
and Stability of Numerical Algorithms, 2nd ed., eq. 3.5): gamma_n = n u / (1 - n u), u the
dtype's unit roundoff. Through a chain of such sums (a network's layers, forward then
backward) the differences add up along the chain.
"""

import torch


def summation_bound(terms: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """How far apart two summation orders of ``terms`` products can end, where the products'
    absolute values add up to at most ``magnitude``: 2 gamma_n * magnitude."""
    u = torch.finfo(dtype).eps / 2
    return 2 * terms * u / (1 - terms * u) * magnitude


def chain_atol(reference: torch.Tensor, sums: int, longest: int) -> float:
    """Absolute tolerance for a tensor computed through ``sums`` chained reductions of at most
    ``longest`` terms each (e.g. the GEMMs from the input to a gradient and back), in two
    orders: each step's bound at the size of the result, added along the chain."""
    return summation_bound(sums * longest, float(reference.abs().max()), reference.dtype)
