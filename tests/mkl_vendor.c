/* MKL's GEMM code path as on the other CPU vendor's machines (see tests/cpu_paths.py).
 *
 * MKL, linked statically into torch's libtorch_cpu.so, asks these two exported functions
 * whether it runs on an Intel CPU before it picks its kernels: Intel's tuned AVX-512/AVX2
 * paths if so, its generic path otherwise. scripts/test.sh builds this file with
 * INTEL_CPU set to the opposite of the real CPU's vendor and preloads it (LD_PRELOAD) into
 * a tier of the numerics tests: an AMD machine then runs Intel's paths (what an Intel
 * Xeon's MKL runs, ISA permitting), an Intel machine AMD's. */
int mkl_serv_intel_cpu_true(void) { return INTEL_CPU; }
int mkl_serv_intel_cpu(void) { return INTEL_CPU; }
