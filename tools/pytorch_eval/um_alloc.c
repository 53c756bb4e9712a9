/* Unified-memory allocator for PyTorch (torch.cuda.memory.CUDAPluggableAllocator):
 * every allocation is cuMemAllocManaged, so a job larger than the GPU runs by
 * demand paging with no gate. tools/pytorch-eval.sh's `oversub` part builds it
 * for the "scheduler off" row of nvshare's experiment (issue 15):
 *
 *   cc -shared -fPIC -O2 -o um_alloc.so um_alloc.c -I/usr/local/cuda/include \
 *      -L/usr/local/cuda/lib64/stubs -lcuda
 *
 * Only with SALUS_OVERSUB_UM=1: managed memory asked for past what the card
 * has free can hang the GPU itself, not only the job.
 */
#include <cuda.h>
#include <stddef.h>
#include <sys/types.h>

/* PyTorch calls the allocator from its autograd threads too, which need not
 * have a context current yet (pytorch#92055): make the device's primary
 * context current, as the runtime API would. */
static void bind(int device) {
  CUcontext ctx = NULL;
  if (cuCtxGetCurrent(&ctx) == CUDA_SUCCESS && ctx != NULL) return;
  CUdevice dev;
  if (cuDeviceGet(&dev, device) == CUDA_SUCCESS &&
      cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS)
    cuCtxSetCurrent(ctx);
}

void* salus_um_alloc(ssize_t size, int device, void* stream) {
  (void)stream;
  bind(device);
  CUdeviceptr p = 0;
  if (cuMemAllocManaged(&p, size > 0 ? (size_t)size : 1, CU_MEM_ATTACH_GLOBAL) != CUDA_SUCCESS)
    return NULL;
  return (void*)p;
}

void salus_um_free(void* ptr, ssize_t size, int device, void* stream) {
  (void)size;
  (void)stream;
  bind(device);
  cuMemFree((CUdeviceptr)ptr); /* synchronous: no kernel still uses it afterwards */
}
