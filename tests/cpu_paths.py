"""Which floating-point code paths this process's CPU kernels take, for scripts/test.sh.

MKL (linked into torch's libtorch_cpu.so) picks its GEMM kernels by vendor and ISA: Intel's
AVX-512 path on an Intel Xeon, a generic path on AMD CPUs, another under ``MKL_CBWR`` (its
conditional numerical reproducibility branches). Each rounds differently, so a test that
asserts bits must hold on all of them. The test script runs the numerics tests again under
``MKL_CBWR=AVX2`` and under the other vendor's path, which ``tests/mkl_vendor.c`` reaches by
answering MKL's "is this an Intel CPU?" the other way; :func:`gemm_fingerprint` is how the
script sees that a tier really ran on a path of its own, whatever MKL reports.

``python -m tests.cpu_paths`` prints one line: the CPU, its vector units, MKL's path and
GEMM fingerprint. ``python -m tests.cpu_paths --intel`` prints 1 where MKL takes its Intel
paths, else 0.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import sys

import torch


def _mkl() -> ctypes.CDLL | None:
    """torch's own library, where MKL's service functions live (a static MKL)."""
    try:
        return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    except OSError:
        return None


class _MKLVersion(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_int),
        ("minor", ctypes.c_int),
        ("update", ctypes.c_int),
        ("patch", ctypes.c_int),
        ("status", ctypes.c_char_p),
        ("build", ctypes.c_char_p),
        ("processor", ctypes.c_char_p),
        ("platform", ctypes.c_char_p),
    ]


_CNR_BRANCHES = {
    1: "off",
    2: "auto",
    3: "COMPATIBLE",
    4: "SSE2",
    6: "SSSE3",
    7: "SSE4_1",
    8: "SSE4_2",
    9: "AVX",
    10: "AVX2",
    12: "AVX512",
    14: "AVX512_E1",
}


def mkl_path() -> str:
    """MKL's own account of its code path: the processor kind it optimises for and its CNR
    branch (``MKL_CBWR``); "no MKL" where torch has none."""
    lib = _mkl()
    if not torch.backends.mkl.is_available() or lib is None:
        return "no MKL"
    version = _MKLVersion()
    try:
        lib.mkl_serv_get_version(ctypes.byref(version))
        branch = lib.mkl_serv_cbwr_get(1)  # MKL_CBWR_BRANCH
    except AttributeError:
        return "MKL (path not reported)"
    processor = (version.processor or b"?").decode().replace("(R)", "")
    tuned = re.search(r"\((Intel [^)]*)\)", processor)  # "... (Intel AVX-512) ..."
    kernels = f"{tuned.group(1)} kernels" if tuned else f"generic kernels ({processor})"
    return f"{kernels}, CNR {_CNR_BRANCHES.get(branch, branch)}"


def gemm_fingerprint() -> str:
    """A hash of the bits of fixed fp32 GEMMs of a fine-tuning step's shapes (1 to 200 rows
    or columns, sums of 8 to 1536 terms, either layout of the second operand), one thread:
    equal on one code path, different across MKL's paths (measured: AMD's default and its
    ``MKL_CBWR=AVX2`` differ in one-row and one-column products; Intel's AVX-512 path in
    most)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gen, digest = torch.Generator().manual_seed(0), hashlib.sha256()
    try:
        for m in (1, 2, 5, 17, 68, 200):
            for n in (1, 8, 40, 576):
                for k in (8, 40, 576, 1536):
                    a = torch.randn(m, k, generator=gen)
                    b = torch.randn(k, n, generator=gen)
                    digest.update((a @ b).numpy().tobytes())
                    digest.update((a @ b.t().contiguous().t()).numpy().tobytes())
    finally:
        torch.set_num_threads(threads)
    return digest.hexdigest()[:12]


def mkl_takes_intel_path() -> bool:
    """MKL's answer to "is this an Intel CPU?", which picks its kernels, asked as MKL asks
    it: in the process's global symbols first, where a preloaded tests/mkl_vendor.c answers,
    then in torch's library (False without MKL)."""
    for library in (ctypes.CDLL(None), _mkl()):
        try:
            return bool(library.mkl_serv_intel_cpu_true())
        except AttributeError:  # not here (or no library: None has no such attribute)
            continue
    return False


def cpu() -> str:
    """The CPU as the benchmark reports name it: model, vector units, cores."""
    from benchmarks.report import hardware

    info = hardware(torch.device("cpu"))
    return f"{info['cpu']} ({info['cpu_units']}), {info['cpu_cores']} cores"


if __name__ == "__main__":
    if sys.argv[1:] == ["--intel"]:
        print(int(mkl_takes_intel_path()))
    else:
        print(f"{cpu()}; MKL: {mkl_path()}; GEMM bits {gemm_fingerprint()}")
