// A new token's keys and values into a paged cache: the model's fused projection of one
// token, [q's heads | k's heads | v's heads] in 16 bits with its bias added, gives each
// head's key and value row at position `pos`, in the page the table names. q stays where
// the projection wrote it: the decoding kernel reads it there.
//
// Compile-time parameters (src/kernel.rs): HEAD_DIM and IS_BF16, for tensor_cores.cuh,
// which src/kernel.rs prepends (u16).

// ANCHOR: append_kv
extern "C" __global__ void append_kv(
    const u16* __restrict__ qkv,    // [3, KVH, HEAD_DIM]: one token's q, k and v
    u16* __restrict__ k,            // the pool of keys, [pages, KVH, page_size, HEAD_DIM]
    u16* __restrict__ v,            // the pool of values, laid out as k
    const int* __restrict__ table,  // [max_pages] the sequence's pages
    int KVH,                        // heads
    int page_size,                  // tokens per page
    int pos                         // the token's position: its row in the cache
) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;  // one value of one head's row
    if (i >= KVH * HEAD_DIM) return;
    const int h = i / HEAD_DIM, c = i % HEAD_DIM;
    const long long page = table[pos / page_size];
    const long long at = ((page * KVH + h) * page_size + pos % page_size) * HEAD_DIM + c;
    k[at] = qkv[KVH * HEAD_DIM + i];
    v[at] = qkv[2 * KVH * HEAD_DIM + i];
}
// ANCHOR_END: append_kv
