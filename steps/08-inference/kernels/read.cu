// The physical limit decoding is measured against: a kernel that only reads the cache's
// bytes, 16 at a time, and sums them, writing one number per block so that the compiler
// cannot drop the reads. A copy would also write, and a write costs the memory about what
// a read does; decoding writes almost nothing, so its bound is this kernel's time.
//
// No compile-time parameters. Launched with enough blocks of 256 threads to fill every
// multiprocessor (src/cuda.rs, `read_bytes`).

#define UNROLL 4

// ANCHOR: read_kernel
__device__ __forceinline__ unsigned fold(uint4 x) { return x.x ^ x.y ^ x.z ^ x.w; }

extern "C" __global__ void read_bytes(
    const uint4* __restrict__ a,  // the keys' bytes, 16 at a time
    const uint4* __restrict__ b,  // the values' bytes
    long long n,                  // 16-byte vectors in each of a and b
    unsigned* __restrict__ sums   // [gridDim.x]: one number per block
) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned acc = 0;
    const uint4* both[2] = {a, b};
#pragma unroll
    for (int which = 0; which < 2; ++which) {
        const uint4* x = both[which];
        long long i = first;
        // UNROLL independent loads in flight per thread, each warp's 512 contiguous bytes
        for (; i + (UNROLL - 1) * stride < n; i += UNROLL * stride) {
            uint4 y[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) y[u] = x[i + u * stride];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) acc ^= fold(y[u]);
        }
        for (; i < n; i += stride) acc ^= fold(x[i]);
    }
    for (int s = 16; s > 0; s /= 2) acc ^= __shfl_xor_sync(0xffffffff, acc, s);
    __shared__ unsigned warps[32];
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < blockDim.x / 32; ++w) acc ^= warps[w];
        sums[blockIdx.x] = acc;
    }
}
// ANCHOR_END: read_kernel
