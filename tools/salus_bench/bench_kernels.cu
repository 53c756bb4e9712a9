// Kernels that salus-bench loads into salusd sessions as a user module, to read
// device timestamps around each iteration. Compiled to PTX by nvcc at build time.

// Appends the GPU's global nanosecond timer to `t`: t[0] counts the stamps taken,
// t[1 + i] is stamp i. Launched with one thread on a session's own stream, so the
// stamps of one session come in stream order.
extern "C" __global__ void salus_bench_stamp(unsigned long long* t) {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  const unsigned long long i = atomicAdd(t, 1ULL);
  t[1 + i] = now;
}
