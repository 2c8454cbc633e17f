// Tokens' keys and values into a paged cache: `rows` tokens that become the cache's last,
// each head's key and value row written in the page the table names, and the cache's new
// length. Where they come from is a layout: a head's row of token j starts at k_src +
// j·row_stride + h·head_stride (and likewise in v_src). A decoding step writes one token
// from the model's fused projection [q's heads | k's heads | v's heads] (row_stride the
// projection's width, head_stride HEAD_DIM), where q stays for the decoding kernel to read;
// a prefill writes the prompt's keys and values from the attention's [KVH, rows, HEAD_DIM]
// tensors (row_stride HEAD_DIM, head_stride rows·HEAD_DIM).
//
// Compile-time parameters (src/kernel.rs): HEAD_DIM and IS_BF16, for tensor_cores.cuh,
// which src/kernel.rs prepends (u16).

// ANCHOR: append_kv
extern "C" __global__ void append_kv(
    const u16* __restrict__ k_src,  // the new tokens' keys, laid out as above
    const u16* __restrict__ v_src,  // their values, laid out as the keys
    long long row_stride,           // values from one token's row to the next's
    long long head_stride,          // values from one head's row to the next head's
    u16* __restrict__ k,            // the pool of keys, [pages, KVH, page_size, HEAD_DIM]
    u16* __restrict__ v,            // the pool of values, laid out as k
    const int* __restrict__ table,  // [max_pages] the sequence's pages
    int KVH,                        // heads
    int page_size,                  // tokens per page
    const int* __restrict__ len,    // tokens in the cache once these are in: they are its
                                    // last `rows`, from position *len - rows on
    int* __restrict__ lens,         // [1] the cache's length, which the decoding kernel
                                    // reads: set to *len
    int rows                        // tokens
) {
    // one value of one head's row of one token
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) lens[0] = *len;
    if (i >= (long long)rows * KVH * HEAD_DIM) return;
    const int c = i % HEAD_DIM;
    const int h = (i / HEAD_DIM) % KVH;
    const int j = i / ((long long)KVH * HEAD_DIM);
    const int p = *len - rows + j;
    const long long page = table[p / page_size];
    const long long at = ((page * KVH + h) * page_size + p % page_size) * HEAD_DIM + c;
    const long long from = j * row_stride + h * head_stride + c;
    k[at] = k_src[from];
    v[at] = v_src[from];
}
// ANCHOR_END: append_kv

// ANCHOR: embed_token
// A step's first kernel: the token's embedding and its position's, added into the residual
// stream x [C] (step 05's embedding, for one token). Both come from memory, `step` =
// [tokens in the cache with this one, the token], which the host writes before each step:
// so the launch is the same at every position, as a graph's must be.
extern "C" __global__ void embed_token(
    const int* __restrict__ step,   // [2]: the cache's length with the token, the token
    const float* __restrict__ wte,  // [V, C] the token embeddings
    const float* __restrict__ wpe,  // [context, C] the position embeddings
    float* __restrict__ x,          // [C]
    int C
) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const long long token = step[1], pos = step[0] - 1;
    x[c] = wte[token * C + c] + wpe[pos * C + c];
}
// ANCHOR_END: embed_token
