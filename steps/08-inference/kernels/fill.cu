// What decode-bench fills its caches with, on the GPU (a 128k-token cache of 64 sequences
// is tens of GB: too much to make on the host and copy): every value a function of its
// place in the logical cache [B, KVH, T, HEAD_DIM] and a seed, so the host can make any
// sequence's keys and values again to check a result, and a paged cache holds the same
// values as a contiguous one through its table. src/cuda.rs's `cache_value` is the same
// function on the host.
//
// Compile-time parameters (src/kernel.rs): HEAD_DIM and IS_BF16, for tensor_cores.cuh,
// which src/kernel.rs prepends (u16, from_f32).

// Chris Wellons's lowbias32: a 32-bit hash whose output bits each depend on every input bit
__device__ __forceinline__ unsigned mix(unsigned x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// The value at logical index e: a multiple of 1/64 in [-2, 2), exact in bf16 and f16.
__device__ __forceinline__ float cache_value(unsigned seed, long long e) {
    const unsigned h = mix(mix((unsigned)(e >> 32) ^ seed) ^ (unsigned)e);
    return (float)((int)(h >> 24) - 128) / 64.f;
}

extern "C" __global__ void fill_cache(
    u16* __restrict__ x,              // the cache, contiguous or a pool of pages
    const int* __restrict__ table,    // page_size > 0: [B, max_pages] the table
    long long n,                      // B·KVH·T·HEAD_DIM values
    int KVH,                          // kv heads
    int T,                            // tokens
    int page_size,                    // 0: contiguous; else tokens per page
    int max_pages,                    // the table's row length
    unsigned seed                     // the values' seed
) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {
        long long dst = e;
        if (page_size > 0) {
            const long long row = e / HEAD_DIM, bk = row / T;
            const int j = row % T, kvh = bk % KVH;
            const long long b = bk / KVH;
            const long long page = table[b * max_pages + j / page_size];
            const long long place = (page * KVH + kvh) * page_size + j % page_size;
            dst = place * HEAD_DIM + e % HEAD_DIM;
        }
        x[dst] = from_f32(cache_value(seed, e));
    }
}
