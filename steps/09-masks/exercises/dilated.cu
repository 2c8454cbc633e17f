// Chapter 9's GPU exercise: exercises/dilated.rs's dilated window as CUDA, compiled
// by NVRTC into the Hopper kernels as their mask. Write the body, then check it on a Hopper GPU:
//
//   cargo run --release -p step09-masks --bin masks-exercise -- dilated-cuda
//
// The checker defines WINDOW and DILATION before this text, for each window it tries.
// q and k are absolute positions; b, h and data are not needed here.
__device__ __forceinline__ bool mask_mod(int b, int h, int q, int k,
                                         const int* __restrict__ data) {
  return false;  // causal, within WINDOW · DILATION positions, and every DILATION-th key
}
