/* Makes Intel MKL (PyTorch's CPU BLAS) take the kernels it keeps for Intel CPUs on any x86-64 CPU.
 *
 * MKL chooses its sgemm kernels by vendor: on an AMD EPYC (Zen 3, AVX2) it runs a slower path than the
 * AVX2 + FMA kernels the CPU can run. Its vendor check is an exported function of libtorch_cpu.so, looked
 * up through the dynamic linker like any other, so a library loaded with RTLD_GLOBAL before PyTorch that
 * defines the same name answers first. MKL still picks among its Intel kernels by the CPU's feature bits
 * (AVX2, AVX-512), so it never runs an instruction the CPU lacks. Loaded by model/cpu.py:take_mkl_intel_kernels.
 */
int mkl_serv_intel_cpu_true(void) { return 1; }
