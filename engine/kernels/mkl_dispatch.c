/* Loaded into the process before torch (engine/mkl_dispatch.py), so that MKL -- linked into torch's libtorch_cpu.so
 * on Linux x86-64, which calls this function of its own through the dynamic linker -- finds this definition first.
 * MKL asks it whether the CPU is Intel's and, where it is not, takes its generic code paths whatever the CPU can do;
 * with the answer "yes" it picks its kernels by the CPU's instruction sets (AVX2, AVX-512) as it does on Intel CPUs. */
int mkl_serv_intel_cpu_true(void) { return 1; }
