// New tokens' keys and values into a paged cache, for every sequence of a batch: sequence
// b's new[b] tokens become its last, each head's key and value row written in the page its
// table names. Where they come from is a strided layout: a head's row of new token j of
// sequence b starts at k_src + b·batch_stride + j·row_stride + h·head_stride (likewise in
// v_src). A decoding step writes one token a sequence from the model's fused projection
// [q's heads | k's heads | v's heads] (row_stride the projection's width, head_stride
// HEAD_DIM), where q stays for the decoding kernel to read; a prefill writes the prompt's
// keys and values from the attention's [B, KVH, rows, HEAD_DIM] tensors.
//
// The lengths come from memory, where the host wrote them before the launch (the
// cache's reserve, src/cuda.rs): so the launch is the same at every position, as a
// graph's must be, and the lengths are the ones the decoding kernel reads after it.
//
// Compile-time parameters (src/kernel.rs): HEAD_DIM and IS_BF16, for tensor_cores.cuh,
// which src/kernel.rs prepends (u16).

// ANCHOR: append_kv
extern "C" __global__ void append_kv(
    const u16* __restrict__ k_src,  // the new tokens' keys, laid out as above
    const u16* __restrict__ v_src,  // their values, laid out as the keys
    long long batch_stride,         // values from a sequence's first new row to the next's
    long long row_stride,           // values from one token's row to the next's
    long long head_stride,          // values from one head's row to the next head's
    u16* __restrict__ k,            // the layer's pool of keys, [pages, KVH, page_size,
                                    // HEAD_DIM]
    u16* __restrict__ v,            // its pool of values, laid out as k
    const int* __restrict__ table,  // [B, max_pages] each sequence's pages
    int max_pages,                  // the table's row length
    int KVH,                        // heads
    int page_size,                  // tokens per page
    const int* __restrict__ lens,   // [2B]: each sequence's length with its new tokens,
                                    // then new[b], how many are new: they are its last,
                                    // from position lens[b] - new[b] on
    int rows,                       // new tokens a sequence at most (new[b] ≤ rows)
    int B                           // sequences
) {
    // one value of one head's row of one token of one sequence
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)B * rows * KVH * HEAD_DIM) return;
    const int c = i % HEAD_DIM;
    const int h = (i / HEAD_DIM) % KVH;
    const int j = (i / ((long long)KVH * HEAD_DIM)) % rows;
    const int b = i / ((long long)rows * KVH * HEAD_DIM);
    const int added = lens[B + b];
    if (j >= added) return;
    const int p = lens[b] - added + j;
    const long long page = table[(long long)b * max_pages + p / page_size];
    const long long at = ((page * KVH + h) * page_size + p % page_size) * HEAD_DIM + c;
    const long long from = b * batch_stride + j * row_stride + h * head_stride + c;
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
