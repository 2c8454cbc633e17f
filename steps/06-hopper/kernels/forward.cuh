// What the forward's rungs share, after hopper.cuh: a thread block's place in the grid, the
// causal mask, the online softmax of one block of scores in registers, the output's
// rescaling, and the end: the output's rows and their log-sum-exps written out.
//
// A thread block takes BLOCK_M = 64·WGS queries of one head: WGS consumer warpgroups of 64
// rows each, and a producer that brings q once and each block of BLOCK_N keys and values
// with TMA. Every rung is compiled with WGS, MIN_BLOCKS (blocks a multiprocessor must fit),
// THREADS (the block's threads) and LONGEST_FIRST (the grid's order), from src/kernel.rs's
// ForwardKernel.

#define BLOCK_M (64 * WGS)
#define BLOCK_N 128
#define STAGES 2  // buffers of keys and values in flight

// ANCHOR: block_order
// Which (head, query block) this block computes, a head of any sequence of the batch.
// Blocks start roughly in the order of their index, x fastest, and the longest query blocks
// (the most keys to see) go first so that the short ones fill the grid's tail. With
// LONGEST_FIRST the grid is (heads, query blocks): every head's longest block before any
// head's next longest, as chapter 3 orders its blocks, which pays when a launch is a few
// waves; without it, (query blocks, heads): one head after another, fewer heads' keys and
// values in flight at once, which pays when they no longer fit L2. Both come from the
// block's index registers.
struct BlockPlace {
  int mb, head;
};
__device__ __forceinline__ BlockPlace block_place(int tokens) {
  const int m_blocks = (tokens + BLOCK_M - 1) / BLOCK_M;
  if (LONGEST_FIRST) return {m_blocks - 1 - (int)blockIdx.y, (int)blockIdx.x};
  return {m_blocks - 1 - (int)blockIdx.x, (int)blockIdx.y};
}
// ANCHOR_END: block_order

// ANCHOR: steps
// register 4j+e of a thread: row r0 + 8·(e/2), key first_key + 8j + 2·(lane%4) + e%2
__device__ __forceinline__ void mask(float (&sc)[64], int first_key, int r0, int lane) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = first_key + 8 * j + 2 * (lane % 4) + (e % 2);
      if (key > r0 + 8 * (e / 2)) sc[4 * j + e] = -INFINITY;
    }
  }
}

// The online softmax of one block in place: sc becomes P, m and l move on, corr[h] is what
// the output rows so far must be multiplied by
__device__ __forceinline__ void softmax(float (&sc)[64], float (&m)[2], float (&l)[2],
                                        float (&corr)[2], float scale_log2) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 16; ++j)
      mx = fmaxf(mx, fmaxf(sc[4 * j + 2 * h], sc[4 * j + 2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
    const float m_new = fmaxf(m[h], mx * scale_log2);
    corr[h] = fast_exp2(m[h] - m_new);
    m[h] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = fast_exp2(sc[4 * j + 2 * h + e] * scale_log2 - m_new);
        sc[4 * j + 2 * h + e] = p;
        sum += p;
      }
    }
    l[h] = l[h] * corr[h] + sum;
  }
}

__device__ __forceinline__ void rescale(float (&o)[HALVES][32], const float (&corr)[2]) {
#pragma unroll
  for (int hh = 0; hh < HALVES; ++hh) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        o[hh][4 * j + 2 * h] *= corr[h];
        o[hh][4 * j + 2 * h + 1] *= corr[h];
      }
    }
  }
}
// ANCHOR_END: steps

// The end of a consumer thread's two rows, r0 and r0 + 8: each row's sum gathered from the
// four threads that hold parts of it, the output divided by it and rounded to 16 bits where
// `out_layout` puts the row, and the row's log-sum-exp (natural log) for the backward
__device__ __forceinline__ void
store_output(const float (&o)[HALVES][32], const float (&m)[2], const float (&l)[2],
             u16* __restrict__ out, const Layout& out_layout, float* __restrict__ lse,
             int head, int r0, int tokens, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = l[h];
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    sum += __shfl_xor_sync(0xffffffff, sum, 2);
    const int row = r0 + 8 * h;
    if (row < tokens) {
      const float inv = 1.f / sum;
      u32* dst = (u32*)(out + out_layout.start(head) + (long long)row * out_layout.token);
#pragma unroll
      for (int hh = 0; hh < HALVES; ++hh) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          dst[32 * hh + 4 * j + (lane % 4)] =
              pack(o[hh][4 * j + 2 * h] * inv, o[hh][4 * j + 2 * h + 1] * inv);
        }
      }
      if (lane % 4 == 0)
        lse[(u64)head * tokens + row] = (m[h] + __log2f(sum)) * 0.6931471805599453f;
    }
  }
}
