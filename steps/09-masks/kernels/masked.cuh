// What the masked kernels add to step 06's (and to steps 03's and 04's, on any GPU from
// Ampere: masked_ampere_*.cu), after hopper.cuh (tensor_cores.cuh) and the user's mask
// source (mask_mod, score_mod, score_mod_grad, from src/mask.rs or a user's file): the block
// lists they walk, the mask and the score function applied to a block of scores in
// registers, and an end that gives a row that sees no key an output of 0 and a log-sum-exp
// of −∞.
//
// The mask's source defines SCORE_MOD_IDENTITY as 1 when the score function is the
// identity: the scores then stay in base-2 units, as in step 06, and no call is made.

// (step 03's tensor_cores.cuh, before it in the Ampere kernels, defines neither)
typedef unsigned long long u64;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef SCORE_MOD_IDENTITY
#define SCORE_MOD_IDENTITY 0
#endif
#ifndef LOG2E
#define LOG2E 1.4426950408889634f
#endif
// A mask whose rows are each one interval of keys (causal, a window, a prefix: src/mask.rs
// says so with MASK_INTERVAL and mask_interval) is applied as two comparisons a score; any
// other through mask_mod
#ifndef MASK_INTERVAL
#define MASK_INTERVAL 0
__device__ __forceinline__ void mask_interval(int, int, int, int, const int*, int& lo,
                                              int& hi) {
  lo = 0, hi = -1;
}
#endif

// ANCHOR: no_key
// A row's running maximum starts at the lowest finite float rather than −∞: a row that has
// seen no key yet keeps it (its scores are all −∞), so step 06's online softmax takes its
// exponents against a finite number and its correction 2^0 = 1 of a sum of 0, never the NaN
// of −∞ − (−∞); the row's end then finds a sum of 0.
#define NO_KEY_YET -3.402823466e38f
// ANCHOR_END: no_key

// ANCHOR: block_list
// A block mask's lists, as src/block.rs lays them out: for each row of the mask (a
// sequence, a head, or one row for all, as the mask varies) and each block of queries (or,
// in the backward, of keys), `count` blocks to visit and `index`, each block's number
// times 2 plus 1 when it is full (every score visible: no mask to evaluate), in ascending
// order. `row_b` and `row_h` give a (sequence, head)'s row: b · row_b + h · row_h.
struct BlockList {
  const int* __restrict__ count;  // [rows][blocks]
  const int* __restrict__ index;  // [rows][blocks][other blocks]
  int blocks, others;             // blocks of this kernel's rows; of the other side
  int row_b, row_h;               // a sequence's and a head's step in the rows
  __device__ __forceinline__ int row(int b, int h) const { return b * row_b + h * row_h; }
  __device__ __forceinline__ int n(int row, int block) const {
    return count[row * blocks + block];
  }
  __device__ __forceinline__ int at(int row, int block, int i) const {
    return index[((long long)row * blocks + block) * others + i];
  }
};
// ANCHOR_END: block_list

// What every element of a block needs to evaluate the mask and the score function: the
// sequence and the query head, the queries' offset (the queries are the last tq of the tk
// positions: chunked prefill), the keys' length and the mask's data (document ids)
struct MaskArgs {
  const int* __restrict__ data;  // [batch][tk] document ids, or null
  int b, h;                      // the sequence and the query head
  int q_offset;                  // tk − tq: query row r is at position r + q_offset
  int tk;                        // keys past it are never seen
};

// ANCHOR: apply_mods
// The keys a consumer thread's two rows (r0 and r0 + 8) see, lo..hi, with an interval mask:
// found once, they hold for every block
struct RowKeys {
  int lo[2], hi[2];
};
__device__ __forceinline__ RowKeys row_keys(int r0, const MaskArgs& a) {
  RowKeys r;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // a row past tq (past tk) is never stored: its bounds are not asked
    const int qp = min(r0 + 8 * h + a.q_offset, a.tk - 1);
    mask_interval(a.b, a.h, qp, a.tk, a.data, r.lo[h], r.hi[h]);
  }
  return r;
}

// Which of a consumer thread's 64 scores of a partial block of keys from first_key the mask
// lets through, a bit each: register 4j+e is row r0 + 8·(e/2), key first_key + 8j +
// 2·(lane%4) + e%2 (step 06's mask). Asked before the block's scores are issued, while
// their registers are free: a mask that reads memory (documents), evaluated beside them,
// costs registers the kernels do not have. Past the ends (a block's last rows and keys)
// mask_mod is not asked: its data holds the tk positions only.
__device__ __forceinline__ u64 visible_bits(int first_key, int r0, int lane,
                                            const MaskArgs& a) {
  u64 bits = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = first_key + 8 * j + 2 * (lane % 4) + (e % 2);
      const int qp = r0 + 8 * (e / 2) + a.q_offset;
      if (key < a.tk && qp < a.tk && mask_mod(a.b, a.h, qp, key, a.data))
        bits |= 1ull << (4 * j + e);
    }
  }
  return bits;
}

// The block's scores through the score function (in natural units, scaled by 1/√d:
// FlexAttention's score_mod sees what the softmax would), then, in a partial block, the
// mask: the rows' intervals, or the bits visible_bits found. A full block takes no mask at
// all: one test a block, not one a score
__device__ __forceinline__ void apply_mods(float (&sc)[64], bool partial, u64 bits,
                                           const RowKeys& keys, int first_key, int r0,
                                           int lane, float scale, const MaskArgs& a) {
  if constexpr (!SCORE_MOD_IDENTITY) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = first_key + 8 * j + 2 * (lane % 4) + (e % 2);
        const int qp = r0 + 8 * (e / 2) + a.q_offset;
        sc[4 * j + e] = score_mod(sc[4 * j + e] * scale, a.b, a.h, qp, key);
      }
    }
  }
  if (partial) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = first_key + 8 * j + 2 * (lane % 4) + (e % 2);
        const bool seen = MASK_INTERVAL
                              ? key >= keys.lo[e / 2] && key <= keys.hi[e / 2]
                              : (bits >> (4 * j + e)) & 1;
        if (!seen) sc[4 * j + e] = -INFINITY;
      }
    }
  }
}
// ANCHOR_END: apply_mods

// apply_mods for N column tiles of mma.sync's accumulators (the Ampere kernels, step 03's
// tensor_cores.cuh): s[n][e] is row r0 + 8·(e/2), key first_key + 8n + 2·(lane%4) + e%2,
// wgmma's layout 8 keys at a time, so register 4j+e above is s[j][e] here; `bits` starts
// at this step's first key (visible_bits of its block, shifted)
template <int N>
__device__ __forceinline__ void apply_mods_mma(float (&s)[N][4], bool partial, u64 bits,
                                               const RowKeys& keys, int first_key, int r0,
                                               int lane, float scale, const MaskArgs& a) {
  if constexpr (!SCORE_MOD_IDENTITY) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = first_key + 8 * j + 2 * (lane % 4) + (e % 2);
        const int qp = r0 + 8 * (e / 2) + a.q_offset;
        s[j][e] = score_mod(s[j][e] * scale, a.b, a.h, qp, key);
      }
    }
  }
  if (partial) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = first_key + 8 * j + 2 * (lane % 4) + (e % 2);
        const bool seen = MASK_INTERVAL
                              ? key >= keys.lo[e / 2] && key <= keys.hi[e / 2]
                              : (bits >> (4 * j + e)) & 1;
        if (!seen) s[j][e] = -INFINITY;
      }
    }
  }
}

// Which of a thread's 32 scores of a partial tile of the backward's dK/dV pass (64 queries
// from q0, the block mask's tile, by its keys kr0 and kr0 + 8) the mask lets through, a bit
// each: bit 4j+e is key kr0 + 8·(e/2), query q0 + 8j + 2·(lane%4) + e%2 (the accumulators
// are transposed: their rows are keys). Asked before the tile's products are issued, while
// only dK and dV hold registers: beside Sᵀ and dPᵀ a mask that reads memory (documents)
// would leave the products too few
__device__ __forceinline__ u32 visible_bits_t(int q0, int kr0, int lane,
                                              const MaskArgs& a) {
  u32 bits = 0;
#pragma unroll
  for (int j = 0; j < 64 / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = kr0 + 8 * (e / 2);
      const int qp = q0 + 8 * j + 2 * (lane % 4) + (e % 2) + a.q_offset;
      // past the ends mask_mod is not asked: its data holds the tk positions only
      if (key < a.tk && qp < a.tk && mask_mod(a.b, a.h, qp, key, a.data))
        bits |= 1u << (4 * j + e);
    }
  }
  return bits;
}


// (the Hopper forwards' end, in hopper.cuh's layout of the output: step 03's copies end
// their own way, masked_ampere_forward.cu)
#ifdef HALVES
// Step 06's end, where a row that saw no key (its sum 0) is written as 0 with a
// log-sum-exp of −∞, as step 07's merge reads an empty part; `tokens` is tq
__device__ __forceinline__ void
store_masked_output(const float (&o)[HALVES][32], const float (&m)[2], const float (&l)[2],
                    u16* __restrict__ out, const Layout& out_layout,
                    float* __restrict__ lse,
                    int head, int r0, int tokens, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = l[h];
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    sum += __shfl_xor_sync(0xffffffff, sum, 2);
    const int row = r0 + 8 * h;
    if (row < tokens) {
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
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
        lse[(u64)head * tokens + row] =
            sum > 0.f ? (m[h] + __log2f(sum)) * 0.6931471805599453f : -INFINITY;
    }
  }
}
#endif
