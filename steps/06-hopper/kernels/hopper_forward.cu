// Step 06's forward kernel: FlashAttention's loop with Hopper's own instructions.
// src/forward.rs prepends hopper.cuh (types, descriptors, mbarriers, TMA, the products).
//
// A thread block takes BLOCK_M = 64·WGS queries of one head and is WGS consumer warpgroups and
// one producer warp. The producer brings q once and each block of BLOCK_N keys and values with
// the tensor memory accelerator (TMA: one thread starts a bulk copy of a whole tile, written in
// the 128-byte swizzle) into STAGES buffers, each with a "full" mbarrier the copies complete and
// an "empty" one the consumers release. Each consumer warpgroup owns 64 query rows: S = q·kᵀ as
// one asynchronous warpgroup product (wgmma) from shared memory, the online softmax on S in
// registers, then o += P·v with P straight from registers. The causal mask is applied only in
// the blocks that cross the diagonal.
//
// At head dim 128 every tile is two halves of 64 columns (hopper.cuh): q·kᵀ takes its k-steps
// from one half then the other, and o is two accumulators of 64 columns. With OVERLAP=1 the products of one block run while the softmax of the next is
// computed (FlashAttention-3's intra-warpgroup pipelining): S of block n+1 and P·v of block n
// are issued together, and the warpgroup waits only for S before its softmax.

#ifndef OVERLAP
#define OVERLAP 0
#endif
// EARLY_RESCALE=1 (with OVERLAP): o is multiplied by the last softmax's correction while the
// next block's scores are on the tensor cores, just before P·v is issued (FlashAttention-3's
// order), rather than after P·v, when the tensor cores would wait for it
#ifndef EARLY_RESCALE
#define EARLY_RESCALE 0
#endif
#if EARLY_RESCALE && !OVERLAP
#error "EARLY_RESCALE takes OVERLAP"
#endif
// PINGPONG=1: the consumer warpgroups take turns issuing their products (FlashAttention-3's
// ping-pong): warpgroup w waits at named barrier 1 + w for its turn, issues q·kᵀ (with
// OVERLAP, and the previous block's P·v), and hands the turn to the next, so that one
// warpgroup's softmax runs on the CUDA cores while the next one's product has the tensor
// cores, rather than all of them wanting the same unit at once
#ifndef PINGPONG
#define PINGPONG 0
#endif
#if PINGPONG && WGS < 2
#error "PINGPONG takes two or more warpgroups"
#endif
// POLY_EXP = n: of the 16 groups of 8 keys a thread's row holds in a block, n take their
// exponentials from a polynomial on the FMA units (exp2_poly) and the rest from the
// multifunction unit (fast_exp2), which does 16 a cycle on a multiprocessor against 128 FMAs:
// at head dim 64 a block's exponentials keep that unit as busy as its products keep the tensor
// cores, so moving some of them to the FMA units frees it (FlashAttention-4 does this on
// Blackwell). On the H200 it measured slower at every length: the cubic's eight instructions
// take the warp schedulers' issue slots, which fast_exp2 leaves the busier resource (chapter 6)
#ifndef POLY_EXP
#define POLY_EXP 0
#endif
#if POLY_EXP < 0 || POLY_EXP > 16
#error "POLY_EXP counts groups of 8 keys: 0 to 16"
#endif
#ifndef LONGEST_FIRST
#define LONGEST_FIRST 0
#endif
// KV_BARRIERS=1: the keys and the values of a buffer each have their own "full" and "empty"
// mbarriers, and the producer brings each block's keys one block ahead of its values, in the
// order the products take them: a block's keys are free once its scores are computed, so the
// next keys can come in while P·v still reads the values. With OVERLAP and one barrier pair
// per buffer, two buffers are held at once (the scores' keys and the last block's values),
// and with two stages the next block cannot start to arrive until P·v is done
#ifndef KV_BARRIERS
#define KV_BARRIERS 0
#endif
#define BLOCK_M (64 * WGS)
#define BLOCK_N 128

// ANCHOR: exp2_poly
// 2^x for x <= 0 (and -inf) from FMAs alone: x = j + f with j = round(x) and f in [-1/2, 1/2];
// 2^f from a cubic (the minimax fit of its relative error: at most 7.5e-5, against 2^-9 for
// the bf16 rounding P takes next), and j added to its exponent bits. Adding 1.5 * 2^23 rounds
// x to an integer in the low bits of t, which the shift by 23 moves into the exponent field.
// Clamped at -126 so that the exponent stays a float's: what a masked key gets, 2^-126 times
// the cubic, adds nothing to a row whose largest term is 1.
__device__ __forceinline__ float exp2_poly(float x) {
  x = fmaxf(x, -126.f);
  const float t = x + 12582912.f;
  const float f = x - (t - 12582912.f);
  const float p = fmaf(fmaf(fmaf(0.05517123f, f, 0.24261007f), f, 0.69326097f), f, 0.9999281f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}
// ANCHOR_END: exp2_poly

// The exponential of key group j (of 16): from the polynomial for POLY_EXP groups spread
// evenly over the 16, from the multifunction unit for the others (j is a constant once the
// loops are unrolled, so the choice costs nothing)
__device__ __forceinline__ float exp2_mixed(float x, int j) {
  return (j * POLY_EXP) % 16 < POLY_EXP ? exp2_poly(x) : fast_exp2(x);
}

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
__device__ __forceinline__ void softmax(float (&sc)[64], float (&m)[2], float (&l)[2], float (&corr)[2], float scale_log2) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 16; ++j) mx = fmaxf(mx, fmaxf(sc[4 * j + 2 * h], sc[4 * j + 2 * h + 1]));
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
        const float p = exp2_mixed(sc[4 * j + 2 * h + e] * scale_log2 - m_new, j);
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

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
hopper_forward(const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_k,
               const __grid_constant__ TensorMap map_v, u16* __restrict__ out, const Layout out_layout,
               float* __restrict__ lse, int tokens, float scale_log2) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = (unsigned char*)(((u64)smem_raw + 1023) & ~1023ull);
  unsigned char* sq = smem;
  unsigned char* sk = sq + BLOCK_M * ROW_BYTES;
  unsigned char* sv = sk + STAGES * BLOCK_N * ROW_BYTES;
  __shared__ __align__(8) u64 full_k[STAGES], empty_k[STAGES], qbar;
#if KV_BARRIERS
  __shared__ __align__(8) u64 full_v[STAGES], empty_v[STAGES];
#else
  u64 *const full_v = full_k, *const empty_v = empty_k;
#endif

  // ANCHOR: block_order
  // Which (head, query block) this block computes, a head of any sequence of the batch.
  // Blocks start roughly in the order of their index, x fastest, and the longest query blocks
  // (the most keys to see) go first so that the short ones fill the grid's tail: with
  // LONGEST_FIRST=1 the grid is (heads, query blocks), every head's longest block before any
  // head's next longest, as chapter 3 orders its blocks; with 0 it is (query blocks, heads),
  // one head after another, fewer keys and values in flight at once. Either way both come
  // from the block's index registers, not from registers held through the loop.
  const int m_blocks = (tokens + BLOCK_M - 1) / BLOCK_M;
#if LONGEST_FIRST
  const int mb = m_blocks - 1 - blockIdx.y;
  const int head = blockIdx.x;
#else
  const int mb = m_blocks - 1 - blockIdx.x;
  const int head = blockIdx.y;
#endif
  // ANCHOR_END: block_order
  const int n_blocks = min((tokens + BLOCK_N - 1) / BLOCK_N, ((mb + 1) * BLOCK_M + BLOCK_N - 1) / BLOCK_N);
  const int tid = threadIdx.x;
  const int wg = tid / 128;

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(smem_u32(&full_k[s]), 1);
      mbar_init(smem_u32(&empty_k[s]), WGS);
#if KV_BARRIERS
      mbar_init(smem_u32(&full_v[s]), 1);
      mbar_init(smem_u32(&empty_v[s]), WGS);
#endif
    }
    mbar_init(smem_u32(&qbar), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // ANCHOR: producer
  if (wg == WGS) {
    producer_registers();
    // the producer: its first thread starts every copy
    if (tid == 128 * WGS) {
      mbar_expect_tx(smem_u32(&qbar), BLOCK_M * ROW_BYTES);
      tma_load(smem_u32(sq), &map_q, smem_u32(&qbar), BLOCK_M, mb * BLOCK_M, head, out_layout.heads);
      // block n's keys or values into buffer n % STAGES, once every consumer is done with
      // what was last in it
      auto load = [&](const TensorMap* map, unsigned char* tiles, u64* full, u64* empty, int n, u32 bytes) {
        const int s = n % STAGES;
        if (n >= STAGES) mbar_wait(smem_u32(&empty[s]), ((n / STAGES) - 1) & 1);
        mbar_expect_tx(smem_u32(&full[s]), bytes);
        tma_load(smem_u32(tiles + s * BLOCK_N * ROW_BYTES), map, smem_u32(&full[s]), BLOCK_N, n * BLOCK_N, head, out_layout.heads);
      };
#if KV_BARRIERS
      load(&map_k, sk, full_k, empty_k, 0, BLOCK_N * ROW_BYTES);
      for (int n = 1; n <= n_blocks; ++n) {
        if (n < n_blocks) load(&map_k, sk, full_k, empty_k, n, BLOCK_N * ROW_BYTES);
        load(&map_v, sv, full_v, empty_v, n - 1, BLOCK_N * ROW_BYTES);
      }
#else
      for (int n = 0; n < n_blocks; ++n) {
        // one barrier pair for the keys and values of a buffer: the second copy neither
        // waits again nor expects bytes of its own
        load(&map_k, sk, full_k, empty_k, n, 2 * BLOCK_N * ROW_BYTES);
        tma_load(smem_u32(sv + (n % STAGES) * BLOCK_N * ROW_BYTES), &map_v, smem_u32(&full_k[n % STAGES]), BLOCK_N, n * BLOCK_N, head, out_layout.heads);
      }
#endif
    }
    return;
  }
  // ANCHOR_END: producer

  // ANCHOR: consumer
  // a consumer warpgroup: 64 rows, 16 per warp; each thread holds two rows, r0 and r0 + 8
  consumer_registers();
  const int warp = (tid % 128) / 32, lane = tid % 32;
  const int first_row = mb * BLOCK_M + wg * 64;
  const int r0 = first_row + warp * 16 + lane / 4;
  float o[HALVES][32];
#pragma unroll
  for (int h = 0; h < HALVES; ++h) {
#pragma unroll
    for (int i = 0; i < 32; ++i) o[h][i] = 0.f;
  }
  float m[2] = {-INFINITY, -INFINITY};  // running maxima, scaled to base 2
  float l[2] = {0.f, 0.f};              // this thread's part of the running sums
  float corr[2];
  float sc[64];
  u32 p[32];
  const u32 aq = smem_u32(sq) + wg * 64 * 128, q_half = BLOCK_M * 128, k_half = BLOCK_N * 128;
  auto k_tile = [&](int n) { return smem_u32(sk + (n % STAGES) * BLOCK_N * ROW_BYTES); };
  auto v_tile = [&](int n) { return smem_u32(sv + (n % STAGES) * BLOCK_N * ROW_BYTES); };
  // only the blocks that cross the diagonal are masked
  auto crosses = [&](int n) { return n * BLOCK_N + BLOCK_N - 1 > first_row; };
  // waiting for block n's keys or values, and handing their buffer back (with one barrier
  // pair a buffer, the keys' wait is the values' too, and the values' release the keys')
  auto keys_ready = [&](int n) { mbar_wait(smem_u32(&full_k[n % STAGES]), (n / STAGES) & 1); };
  auto values_ready = [&](int n) {
    if (KV_BARRIERS) mbar_wait(smem_u32(&full_v[n % STAGES]), (n / STAGES) & 1);
  };
  auto keys_done = [&](int n) {
    if (KV_BARRIERS && tid % 128 == 0) mbar_arrive(smem_u32(&empty_k[n % STAGES]));
  };
  auto values_done = [&](int n) {
    if (tid % 128 == 0) mbar_arrive(smem_u32(&empty_v[n % STAGES]));
  };
  mbar_wait(smem_u32(&qbar), 0);

#if PINGPONG
  // the last warpgroup opens the first turn, warpgroup 0's (every warpgroup takes n_blocks
  // turns, so each barrier sees as many arrivals as waits)
  if (wg == WGS - 1) asm volatile("bar.arrive 1, 256;\n" ::: "memory");
  // this warpgroup's turn; the next warpgroup's (the last one's final turn opens none)
  auto my_turn = [&]() { asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory"); };
  auto next_turn = [&](int n) {
    if (wg < WGS - 1 || n + 1 < n_blocks) asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + (wg + 1) % WGS) : "memory");
  };
#else
  auto my_turn = [&]() {};
  auto next_turn = [&](int) {};
#endif
#if OVERLAP
  // block 0's scores and softmax alone; then each step issues block n's scores and block
  // n-1's P·v together, and the softmax of block n runs while P·v is on the tensor cores
  keys_ready(0);
  my_turn();
  wgmma_fence();
  issue_abt<BLOCK_N>(sc, aq, q_half, k_tile(0), k_half);
  wgmma_commit();
  next_turn(0);
  wgmma_wait0();
  fence_operands(sc);
  keys_done(0);
  if (crosses(0)) mask(sc, 0, r0, lane);
  softmax(sc, m, l, corr, scale_log2);
  pack_fragments<BLOCK_N>(p, sc);
  for (int n = 1; n < n_blocks; ++n) {
    keys_ready(n);
    values_ready(n - 1);
    my_turn();
    wgmma_fence();
    issue_abt<BLOCK_N>(sc, aq, q_half, k_tile(n), k_half);
    wgmma_commit();
#if EARLY_RESCALE
    // o as far as block n-2, to the maxima of block n-1, while the scores are computed
    fence_operands(o);
    rescale(o, corr);
    fence_operands(o);
    wgmma_fence();
#endif
    issue_pb<BLOCK_N>(o, p, v_tile(n - 1), BLOCK_N);
    wgmma_commit();
    next_turn(n);
    wgmma_wait1();  // the scores are ready; P·v may still run
    fence_operands(sc);
    keys_done(n);
    if (crosses(n)) mask(sc, n * BLOCK_N, r0, lane);
    softmax(sc, m, l, corr, scale_log2);
    wgmma_wait0();  // P·v of block n-1 is done: o may be read and rescaled, p rewritten
    fence_operands(o);
    values_done(n - 1);
#if !EARLY_RESCALE
    rescale(o, corr);
#endif
    pack_fragments<BLOCK_N>(p, sc);
  }
#if EARLY_RESCALE
  rescale(o, corr);
  fence_operands(o);
#endif
  values_ready(n_blocks - 1);
  wgmma_fence();
  issue_pb<BLOCK_N>(o, p, v_tile(n_blocks - 1), BLOCK_N);
  wgmma_commit();
  wgmma_wait0();
  fence_operands(o);
#else
  for (int n = 0; n < n_blocks; ++n) {
    keys_ready(n);
    my_turn();
    wgmma_fence();
    issue_abt<BLOCK_N>(sc, aq, q_half, k_tile(n), k_half);
    wgmma_commit();
    next_turn(n);
    wgmma_wait0();
    fence_operands(sc);
    keys_done(n);
    if (crosses(n)) mask(sc, n * BLOCK_N, r0, lane);
    softmax(sc, m, l, corr, scale_log2);
    rescale(o, corr);
    pack_fragments<BLOCK_N>(p, sc);
    values_ready(n);
    wgmma_fence();
    issue_pb<BLOCK_N>(o, p, v_tile(n), BLOCK_N);
    wgmma_commit();
    wgmma_wait0();
    fence_operands(o);
    // this warpgroup is done with the buffer
    values_done(n);
  }
#endif
  // ANCHOR_END: consumer

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
          dst[32 * hh + 4 * j + (lane % 4)] = pack(o[hh][4 * j + 2 * h] * inv, o[hh][4 * j + 2 * h + 1] * inv);
        }
      }
      if (lane % 4 == 0) lse[(u64)head * tokens + row] = (m[h] + __log2f(sum)) * 0.6931471805599453f;
    }
  }
}
