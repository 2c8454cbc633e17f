// The solution of chapter 9's GPU exercise: the dilated window as the kernels' mask.
// ANCHOR: dilated_cuda
__device__ __forceinline__ bool mask_mod(int b, int h, int q, int k,
                                         const int* __restrict__ data) {
  return k <= q && q - k < WINDOW * DILATION && (q - k) % DILATION == 0;
}
// ANCHOR_END: dilated_cuda
