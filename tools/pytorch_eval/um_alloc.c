/* Unified-memory allocator for PyTorch (torch.cuda.memory.CUDAPluggableAllocator):
 * every allocation is cuMemAllocManaged, so a job larger than the GPU runs by
 * demand paging with no gate. tools/pytorch-eval.sh's `oversub` part builds it
 * for the "scheduler off" row of nvshare's experiment (issue 15):
 *
 *   cc -shared -fPIC -O2 -o um_alloc.so um_alloc.c -I/usr/local/cuda/include -lcuda
 */
#include <cuda.h>
#include <stddef.h>
#include <sys/types.h>

void* salus_um_alloc(ssize_t size, int device, void* stream) {
  (void)device;
  (void)stream;
  CUdeviceptr p = 0;
  if (cuMemAllocManaged(&p, size > 0 ? (size_t)size : 1, CU_MEM_ATTACH_GLOBAL) != CUDA_SUCCESS)
    return NULL;
  return (void*)p;
}

void salus_um_free(void* ptr, ssize_t size, int device, void* stream) {
  (void)size;
  (void)device;
  (void)stream;
  cuMemFree((CUdeviceptr)ptr); /* synchronous: no kernel still uses it afterwards */
}
