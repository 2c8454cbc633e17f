// Step 06's backward kernels: step 04's two passes with Hopper's products.
// src/backward.rs prepends hopper.cuh (types, descriptors, mbarriers, TMA, the products) and
// runs step 04's backward_delta first (δ = rowsum(dO ∘ O)).
//
//   hopper_dkdv  one block per BLOCK_ROWS = 64·WGS keys of a head, each consumer warpgroup
//                owning 64 of them; the queries that see them stream past STREAM at a time:
//                Sᵀ = k·qᵀ and dPᵀ = v·dOᵀ (wgmma from shared memory), Pᵀ = 2^(Sᵀ·scale·log2e
//                − lse₂) and dSᵀ = Pᵀ ∘ (dPᵀ − δ) in registers, then dV += Pᵀ·dO and
//                dK += dSᵀ·q with Pᵀ and dSᵀ straight from registers.
//   hopper_dq    one block per BLOCK_ROWS queries of a head; the keys they see stream past:
//                S = q·kᵀ, dP = dO·vᵀ, P and dS in registers, dQ += dS·k.
//
// A module holds one of them (PASS), so each pass is compiled in block shapes of its own.
//
// Every product reads its tiles in the layouts the forward's products already read (q·kᵀ
// from two K-major tiles, P·v with v MN-major; DQ_ATOMIC's dS·k reads dS as q and k as v).
// Each block writes only its own rows: the gradients are deterministic (dQ with DQ_ATOMIC
// aside). A producer warp (or warpgroup, PRODUCER_WG) brings the tiles with TMA; its 32
// lanes also copy each stage's log-sum-exps and δs into shared memory, and every lane
// arrives on the stage's "full" barrier.

#ifndef STREAM
#define STREAM 64  // rows streamed past a block: queries (dkdv), keys (dq); 32, 64 or 128
#endif
// which pass this module holds: 0 dkdv, 1 dq (each pass has block shapes of its own)
#ifndef PASS
#define PASS 0
#endif
// DQ_ATOMIC=1: the dkdv pass gives dQ too, in one pass as FlashAttention-2 and -3 do: each
// warpgroup writes dS for its keys to shared memory, takes dQ += dS·k for the block's queries,
// and adds it into an f32 buffer with atomic adds (hopper_dq_convert then scales and rounds
// it); the sums' order, and so dQ's last bits, depend on which blocks finish first
#ifndef DQ_ATOMIC
#define DQ_ATOMIC 0
#endif
// DQ_ATOMIC=2: the two warpgroups' dS meet in shared memory and warpgroup 0 alone takes dQ
// over the block's 128 keys (half the sums of DQ_ATOMIC=1); it puts dQ in shared memory and
// a warp's lanes add it into the f32 buffer a row at a time with bulk reductions
// (cp.reduce.async.bulk), one instruction per row instead of one per pair of values
// DQ_ATOMIC=3: as FlashAttention-3 does, a warp of its own adds dQ. Each warpgroup stores its
// dS transposed with stmatrix into one of two buffers, and the warpgroups meet at one barrier;
// then each takes dQᵀ = kᵀ·dSᵀ for half the block's queries over all its keys (the sums of
// DQ_ATOMIC=2, split evenly; DQ_SPLIT splits them otherwise, and with its split by blocks
// only the warpgroup that takes dQ waits at the barrier), stores it to one of two f32 buffers
// in its registers' order and goes on. The producer warpgroup's second warp adds the buffer
// (16 KB at head dim 64, 32 at 128) into dq_accum with a bulk reduction a half; dq_accum holds
// each block of 64 queries in that order, and hopper_dq_convert puts the values back in rows
#if DQ_ATOMIC && (STREAM != 64 || PASS != 0 || (HEAD_DIM != 64 && DQ_ATOMIC != 3))
#error "DQ_ATOMIC takes the dkdv pass with STREAM 64, at HEAD_DIM 64 (or 128 with DQ_ATOMIC=3)"
#endif
#if DQ_ATOMIC >= 2 && WGS != 2
#error "DQ_ATOMIC=2 and 3 take two consumer warpgroups"
#endif
#if DQ_ATOMIC >= 3 && !PRODUCER_WG
#error "DQ_ATOMIC=3 takes a producer warpgroup (its second warp adds dQ)"
#endif
// How DQ_ATOMIC=3 splits a block's dQᵀ = kᵀ·dSᵀ between the warpgroups. 0: each takes 32 of
// the 64 queries, an m64n32 product for each 64 columns of the head dim, whose k-steps read
// 3 KB of shared memory for 16 cycles of the tensor cores (more than the 128 bytes a cycle
// shared memory gives). 1 (head dim 128): each takes 64 of the head dim's columns for all 64
// queries, one m64n64 product reading 4 KB for 32 cycles. 2 (head dim 64): each takes every
// other block's whole dQᵀ (m64n64), warpgroup n % 2 block n's. 3 (head dim 128): as 2, but
// as dQ = dS·k, not transposed: one m64n128 product the head dim across, whose k-steps read
// 6 KB for 64 cycles (96 bytes a cycle, where the m64n64 products take all 128); the
// warpgroup first waits for its dV and dK, whose fragments' registers then hold dQ's 64
// accumulators, and the other goes on to the next block meanwhile
#ifndef DQ_SPLIT
#define DQ_SPLIT 0
#endif
#if DQ_SPLIT && (DQ_ATOMIC != 3 || HEAD_DIM != (DQ_SPLIT == 1 || DQ_SPLIT == 3 ? 128 : 64) || (DQ_SPLIT == 2 && DQ_BUFS != 2))
#error "DQ_SPLIT takes DQ_ATOMIC=3, 1 and 3 at head dim 128, 2 at head dim 64 with two dQ buffers"
#endif
// a warpgroup's dQᵀ registers: [HALVES][16] split by queries, [1][32] by columns or blocks;
// DQ_SPLIT=3's dQ (not transposed), [1][64]
#if DQ_SPLIT == 3
#define DQT_H 1
#define DQT_N 64
#elif DQ_SPLIT
#define DQT_H 1
#define DQT_N 32
#else
#define DQT_H HALVES
#define DQT_N 16
#endif
// DQ_ATOMIC=3 and 4's buffers of dQ, 64 queries in f32 each: with one, a warpgroup stores a
// block's dQ only once the adding warp has read the last block's (the shared memory of a
// third stage at head dim 128)
#ifndef DQ_BUFS
#define DQ_BUFS 2
#endif
// DQ_ATOMIC=3's named barriers: the warpgroups' dS written (256 threads); a warpgroup's part
// of dQ buffer b written (BAR_DQ_FULL + 2·wg + b: the warpgroup and the adding warp, 160; its
// half split by queries, its columns of both halves split by columns, the whole buffer split
// by blocks), and read by the bulk reductions (BAR_DQ_EMPTY + 2·wg + b; with DQ_SPLIT=3,
// whose warpgroups take turns at one buffer, BAR_DQ_EMPTY + b, whoever wrote it)
#define BAR_DS 1
// DQ_SPLIT=2 and 3's barrier for odd blocks' dS (one for each parity, so that the arrival of a
// warpgroup that has run a block ahead is not counted as the other's)
#define BAR_DS_ODD 10
#define BAR_DQ_FULL 2
#define BAR_DQ_EMPTY 6
#define BAR_DQ_COUNT (128 + 32)
// the barrier on which the adding warp says that buffer b, written by warpgroup wg, was read
#define BAR_DQ_READ(wg, b) (DQ_SPLIT == 3 ? BAR_DQ_EMPTY + (b) : BAR_DQ_EMPTY + 2 * (wg) + (b))
// LONGEST_FIRST=1: the grid is (heads, blocks) rather than (blocks, heads), so that every
// head's longest block (the most rows streamed past it) starts before any head's next longest
// and the short ones fill the grid's tail, as the forward's LONGEST_FIRST orders its blocks
#ifndef LONGEST_FIRST
#define LONGEST_FIRST 0
#endif
// EARLY_DV=1: dV += Pᵀ·dO is issued as soon as Pᵀ is made, and runs while dSᵀ is made; it
// holds Pᵀ's fragments in registers meanwhile, which only one warpgroup, or two with the
// producer's registers given to them, can spare (ptxas spills otherwise); at head dim 128
// with DQ_ATOMIC=3, whose producer keeps 32 registers for the adding warp, they cannot
#ifndef EARLY_DV
#define EARLY_DV (WGS == 1 || (WGS == 2 && PRODUCER_WG && !(DQ_ATOMIC == 3 && HEAD_DIM == 128)))
#endif
// EARLY_FREE=1 (DQ_SPLIT=3): a warp says the stage is free once its dV and dK have landed,
// before its warpgroup's dQ product (which reads k and dS, not the stage), so that the
// producer may refill it meanwhile
#ifndef EARLY_FREE
#define EARLY_FREE 0
#endif
#if EARLY_FREE && DQ_SPLIT != 3
#error "EARLY_FREE takes DQ_SPLIT=3"
#endif
// LANE_RELEASE=1 (dkdv): every consumer lane arrives on a stage's "empty" barrier, each
// releasing its own reads of the stage's log-sum-exps and δs; 0: each warp's lane 0, after
// __syncwarp has ordered the other lanes' reads before its arrival. Both are sound, but
// compute-sanitizer's racecheck, told to check this kernel alone (--kernel-name), does not
// follow __syncwarp into lane 0's arrival, and reports every read by lanes 1 to 31 as racing
// the producer's next write of the stage (measurements/lane-release.txt). The __syncwarp
// stays with LANE_RELEASE=1, where it orders nothing: without it ptxas spills in the two-pass
// shape at head dim 128
#ifndef LANE_RELEASE
#define LANE_RELEASE 0
#endif
#define EMPTY_COUNT (LANE_RELEASE && PASS == 0 ? 128 * WGS : 4 * WGS)
#define DQ_ROW_BYTES 288  // a row of dQ in shared memory: 64 f32 and 32 bytes against bank conflicts
#define BLOCK_ROWS (64 * WGS)
#define LOG2E 1.4426950408889634f

// The producer's loop, shared by both kernels: `own` (BLOCK_ROWS rows from own_row of
// map_a0 and map_a1) once, on `own_bar`; then n_blocks stages of STREAM rows of map_b0 and
// map_b1 from stream_row0, and (dkdv only) their log-sum-exps in base 2 and δs.
template <bool ROWS_STATS>
__device__ __forceinline__ void produce(const TensorMap* map_a0, const TensorMap* map_a1, const TensorMap* map_b0,
                                        const TensorMap* map_b1, unsigned char* sa0, unsigned char* sa1,
                                        unsigned char* sb0, unsigned char* sb1, float (*slse)[STREAM],
                                        float (*sdelta)[STREAM], u64* own_bar, u64* full, u64* empty,
                                        const float* lse, const float* delta, int own_row, int stream_row0,
                                        int n_blocks, int head, int heads, int tokens, int lane) {
  if (lane == 0) {
    mbar_expect_tx(smem_u32(own_bar), 2 * BLOCK_ROWS * ROW_BYTES);
    tma_load(smem_u32(sa0), map_a0, smem_u32(own_bar), BLOCK_ROWS, own_row, head, heads);
    tma_load(smem_u32(sa1), map_a1, smem_u32(own_bar), BLOCK_ROWS, own_row, head, heads);
  }
  for (int n = 0; n < n_blocks; ++n) {
    const int s = n % STAGES, row0 = stream_row0 + n * STREAM;
    // wait until every consumer is done with what is last in this buffer
    if (n >= STAGES) mbar_wait(smem_u32(&empty[s]), ((n / STAGES) - 1) & 1);
    if (ROWS_STATS) {
      // a query past the end gets lse = +inf, so its probabilities are 0
      for (int i = lane; i < STREAM; i += 32) {
        const bool valid = row0 + i < tokens;
        slse[s][i] = valid ? lse[(u64)head * tokens + row0 + i] * LOG2E : INFINITY;
        sdelta[s][i] = valid ? delta[(u64)head * tokens + row0 + i] : 0.f;
      }
    }
    if (lane == 0) {
      mbar_expect_tx(smem_u32(&full[s]), 2 * STREAM * ROW_BYTES);
      tma_load(smem_u32(sb0 + s * STREAM * ROW_BYTES), map_b0, smem_u32(&full[s]), STREAM, row0, head, heads);
      tma_load(smem_u32(sb1 + s * STREAM * ROW_BYTES), map_b1, smem_u32(&full[s]), STREAM, row0, head, heads);
    } else {
      // the arrival releases this lane's writes of lse and δ to the consumers
      mbar_arrive(smem_u32(&full[s]));
    }
  }
}

// The barriers both kernels start with: "full" counts the producer warp's 32 lanes (and the
// copies' bytes), "empty" every consumer warp (with LANE_RELEASE every consumer thread). A
// warp arrives on "empty" only after its own wait on "full": a warpgroup that skips a block
// could otherwise release the stage while one of its warps has yet to see it full, and that
// warp would then wait on a phase two behind
__device__ __forceinline__ void init_barriers(u64* own_bar, u64* full, u64* empty) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(smem_u32(&full[s]), 32);
      mbar_init(smem_u32(&empty[s]), EMPTY_COUNT);
    }
    mbar_init(smem_u32(own_bar), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
}

// ANCHOR: release_stage
// A consumer warp's release of stage s in dkdv (see LANE_RELEASE)
__device__ __forceinline__ void release_stage(u64* empty, int s, int lane) {
  __syncwarp();
  if (LANE_RELEASE || lane == 0) mbar_arrive(smem_u32(&empty[s]));
}
// ANCHOR_END: release_stage

#if PASS == 0
// Pᵀ from Sᵀ in place, for a consumer warpgroup's keys from kw0 and a block of queries from
// q0: register 4j+e is key kr0 + 8·(e/2), query q0 + 8j + 2·(lane%4) + e%2 (lse2: the block's
// log-sum-exps in base 2); only a block that reaches a query before one of these keys is
// masked
__device__ __forceinline__ void probabilities_t(float (&st)[STREAM / 2], const float* lse2, int q0, int kw0, int kr0,
                                                int lane, float scale_log2) {
  const bool masked = q0 < kw0 + 63;
#pragma unroll
  for (int j = 0; j < STREAM / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = 8 * j + 2 * (lane % 4) + (e % 2);
      float p = fast_exp2(st[4 * j + e] * scale_log2 - lse2[col]);
      if (masked && q0 + col < kr0 + 8 * (e / 2)) p = 0.f;
      st[4 * j + e] = p;
    }
  }
}

// dSᵀ = Pᵀ ∘ (dPᵀ − δ) in place of dPᵀ (δ: the block's, a query each)
__device__ __forceinline__ void scores_grad_t(float (&dpt)[STREAM / 2], const float (&pt)[STREAM / 2],
                                              const float* delta, int lane) {
#pragma unroll
  for (int j = 0; j < STREAM / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dpt[4 * j + e] = pt[4 * j + e] * (dpt[4 * j + e] - delta[8 * j + 2 * (lane % 4) + (e % 2)]);
  }
}

#if DQ_ATOMIC >= 3
// A compile-time flag passed as a value (to a generic lambda)
template <bool B>
struct Flag {
  static constexpr bool value = B;
};

// dSᵀ's fragments into a warpgroup's tile at `tile`: dsf[2j + h] is an 8×8 fragment (keys
// warp·16 + 8h.., queries 8j..); stmatrix stores four at a time transposed, a query a row, in
// the 128-byte swizzle (chunk c of row r at c ^ (r % 8)), lanes 8m..8m+7 naming the rows of
// fragment m; then made visible to the tensor cores' reads
__device__ __forceinline__ void store_ds_t(u32 tile, const u32 (&dsf)[STREAM / 4], int warp, int lane) {
#pragma unroll
  for (int j = 0; j < STREAM / 8; j += 2) {
    const u32 row = 8 * (j + lane / 16) + lane % 8, chunk = 2 * warp + (lane / 8) % 2;
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                     tile + row * 128 + ((chunk ^ (row % 8)) * 16)),
                 "r"(dsf[2 * j]), "r"(dsf[2 * j + 1]), "r"(dsf[2 * j + 2]), "r"(dsf[2 * j + 3])
                 : "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// dQᵀ = kᵀ·dSᵀ for warpgroup wg's part of the block's 64 queries (DQ_SPLIT) over its 128 keys,
// 16 a k-step: k (at sk) read M-major (transposed, as v is read), dSᵀ K-major from the two
// tiles at ads. Split by queries, wg's 32 with a product for each 64 columns of the head dim
// (dqt[h]: columns 64h..); by columns, wg's 64 (dqt[0]: columns 64·wg..); by blocks, all.
// DQ_SPLIT=3 takes dQ = dS·k instead: dS K-major as A, k MN-major as B over the whole head dim,
// its two 64-column halves BLOCK_ROWS·128 bytes apart (the descriptor's leading offset)
__device__ __forceinline__ void issue_dq_t(float (&dqt)[DQT_H][DQT_N], u32 sk, u32 ads, int wg) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
#if DQ_SPLIT == 3
    const u64 a = descriptor(ads + (kk / 4) * 64 * 128 + (kk % 4) * 32, QK_LBO, QK_SBO);
    wgmma_m64n128_ss<1>(dqt[0], a, descriptor(sk + kk * 16 * 128, BLOCK_ROWS * 128, V_SBO), kk > 0);
#elif DQ_SPLIT
    const u64 b = descriptor(ads + (kk / 4) * 64 * 128 + (kk % 4) * 32, QK_LBO, QK_SBO);
    const u32 a = sk + (DQ_SPLIT == 1 ? wg : 0) * BLOCK_ROWS * 128 + kk * 16 * 128;
    wgmma_m64n64_ss<0, 1>(dqt[0], descriptor(a, V_LBO, V_SBO), b, kk > 0);
#else
    const u64 b = descriptor(ads + (kk / 4) * 64 * 128 + wg * 32 * 128 + (kk % 4) * 32, QK_LBO, QK_SBO);
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
      wgmma_m64n32_ss<1>(dqt[h], descriptor(sk + h * BLOCK_ROWS * 128 + kk * 16 * 128, V_LBO, V_SBO), b, kk > 0);
    }
#endif
  }
}

// dQᵀ's registers into dQ buffer b for the adding warp, once it has read what was last in it,
// in the order of the split by queries: dqt[h][4i..4i+3] of thread t of warpgroup w at float
// 4·(128·(4·HALVES·w + 4h + i) + t) (the split by columns puts its registers 4j.. (query 8j..)
// where that split has them, as does the split by blocks; DQ_SPLIT=3's dQ, not transposed,
// has dqt[0][4i..4i+3] at float 4·(128·i + t)); then the warp is told. `reused`: the buffer
// held an earlier block's dQ
__device__ __forceinline__ void store_dq_t(unsigned char* sdq, const float (&dqt)[DQT_H][DQT_N], int b, bool reused,
                                           int wg, int tid) {
  if (reused) asm volatile("bar.sync %0, %1;\n" ::"r"(BAR_DQ_READ(wg, b)), "n"(BAR_DQ_COUNT) : "memory");
  const u32 adq = smem_u32(sdq) + b * 64 * HEAD_DIM * 4 + (tid % 128) * 16;
#pragma unroll
  for (int h = 0; h < DQT_H; ++h) {
#pragma unroll
    for (int i = 0; i < DQT_N / 4; ++i) {
      const int r = DQ_SPLIT == 1 ? 8 * (i / 4) + 4 * wg + i % 4 : DQ_SPLIT >= 2 ? i : 4 * HALVES * wg + 4 * h + i;
      asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(adq + r * 128 * 16), "f"(dqt[h][4 * i]),
                   "f"(dqt[h][4 * i + 1]), "f"(dqt[h][4 * i + 2]), "f"(dqt[h][4 * i + 3])
                   : "memory");
    }
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  asm volatile("bar.arrive %0, %1;\n" ::"r"(BAR_DQ_FULL + 2 * wg + b), "n"(BAR_DQ_COUNT) : "memory");
}

#endif

#if DQ_ATOMIC >= 3
// The adding warp of DQ_ATOMIC=3 and 4: each step's dQ buffer (DQ_BUFS in turn at sdq, 64
// queries of HEAD_DIM f32 each, a half 32 of them) into the f32 sums of its block of queries,
// first + n, with a bulk reduction a half; each warpgroup that wrote the buffer is told when
// it has been read. Split by queries, a half is a warpgroup's, added as soon as it is done;
// by columns both warpgroups write both halves; by blocks warpgroup n % 2 writes the buffer
// alone. Not inlined: the producer's registers would otherwise have to hold what it computes
__device__ __noinline__ void add_dq(float* dq_accum, unsigned char* sdq, int head, int first, int n_blocks, int tokens,
                                    int lane) {
  float* dst = dq_accum + ((u64)head * ((tokens + 63) / 64) + first) * 64 * HEAD_DIM;
  const auto reduce_half = [&](int b, int half) {
    if (lane == 0) {
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst + half * 32 * HEAD_DIM),
                   "r"(smem_u32(sdq + b * 64 * HEAD_DIM * 4 + half * 32 * HEAD_DIM * 4)), "n"(32 * HEAD_DIM * 4)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    }
  };
#pragma unroll 1
  for (int n = 0; n < n_blocks; ++n, dst += 64 * HEAD_DIM) {
    const int b = n % DQ_BUFS;
    // the warpgroups that write this block's buffer
    const int w_first = DQ_SPLIT >= 2 ? n % 2 : 0, w_last = DQ_SPLIT >= 2 ? n % 2 : WGS - 1;
#pragma unroll 1
    for (int w = w_first; w <= w_last; ++w) {
      asm volatile("bar.sync %0, %1;\n" ::"r"(BAR_DQ_FULL + 2 * w + b), "n"(BAR_DQ_COUNT) : "memory");
      if (DQ_SPLIT == 0) reduce_half(b, w);
    }
    if (DQ_SPLIT != 0) {
      reduce_half(b, 0);
      reduce_half(b, 1);
    }
    // the buffer has been read: the consumers may write it again
    if (lane == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    __syncwarp();
    if (n + DQ_BUFS < n_blocks) {
#pragma unroll 1
      for (int w = w_first; w <= w_last; ++w) {
        asm volatile("bar.arrive %0, %1;\n" ::"r"(BAR_DQ_READ(w, b)), "n"(BAR_DQ_COUNT) : "memory");
      }
    }
  }
  if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
#endif

// ANCHOR: dkdv
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
hopper_dkdv(const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_k,
            const __grid_constant__ TensorMap map_v, const __grid_constant__ TensorMap map_do,
            const float* __restrict__ lse, const float* __restrict__ delta, u16* __restrict__ dk_out,
            u16* __restrict__ dv_out, const Layout layout, float* __restrict__ dq_accum, int tokens, float scale_log2,
            float scale) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = (unsigned char*)(((u64)smem_raw + 1023) & ~1023ull);
  unsigned char* sk = smem;
  unsigned char* sv = sk + BLOCK_ROWS * ROW_BYTES;
  unsigned char* sq = sv + BLOCK_ROWS * ROW_BYTES;
  unsigned char* sdo = sq + STAGES * STREAM * ROW_BYTES;
#if DQ_ATOMIC
  // each warpgroup's dS: [64 queries][64 keys], K-major for dQ += dS·k
  unsigned char* sds = sdo + STAGES * STREAM * ROW_BYTES;
#endif
#if DQ_ATOMIC == 2
  // the block's dQ in f32 for the bulk reductions, [64 queries][DQ_ROW_BYTES]
  unsigned char* sdq = sds + WGS * 64 * 128;
#elif DQ_ATOMIC >= 3
  // two buffers of dS (each both warpgroups' tiles, 16 KB), then DQ_BUFS of dQ in f32 (64 queries)
  unsigned char* sdq = sds + 2 * WGS * 64 * 128;
#endif
  __shared__ float slse[STAGES][STREAM], sdelta[STAGES][STREAM];
  __shared__ __align__(8) u64 full[STAGES], empty[STAGES], kvbar;
#if DQ_ATOMIC == 4
  // a dS buffer written by both warpgroups (ds_full), read by both warpgroups' dQ (ds_empty)
  __shared__ __align__(8) u64 ds_full[2], ds_empty[2];
  if (threadIdx.x == 0) {
    for (int b = 0; b < 2; ++b) {
      mbar_init(smem_u32(&ds_full[b]), 128 * WGS);
      mbar_init(smem_u32(&ds_empty[b]), 128 * WGS);
    }
  }
#endif

  // the first key blocks are seen by the most queries: they start first
#if LONGEST_FIRST
  const int kb = blockIdx.y, head = blockIdx.x, k0 = kb * BLOCK_ROWS;
#else
  const int kb = blockIdx.x, head = blockIdx.y, k0 = kb * BLOCK_ROWS;
#endif
  // the queries from the block holding key k0 to the end see these keys
  const int first = k0 / STREAM, n_blocks = (tokens + STREAM - 1) / STREAM - first;
  const int tid = threadIdx.x, wg = tid / 128;
  init_barriers(&kvbar, full, empty);

  if (wg == WGS) {
    producer_registers();
    if (tid < 128 * WGS + 32) {
      produce<true>(&map_k, &map_v, &map_q, &map_do, sk, sv, sq, sdo, slse, sdelta, &kvbar, full, empty, lse, delta, k0,
                    first * STREAM, n_blocks, head, layout.heads, tokens, tid % 32);
    }
#if DQ_ATOMIC >= 3
    else if (tid < 128 * WGS + 64) {
      add_dq(dq_accum, sdq, head, first, n_blocks, tokens, tid % 32);
    }
#endif
    return;
  }

  consumer_registers();
  // a consumer warpgroup: 64 keys, 16 per warp; each thread holds two keys, kr0 and kr0 + 8
  const int warp = (tid % 128) / 32, lane = tid % 32;
  const int kw0 = k0 + wg * 64, kr0 = kw0 + warp * 16 + lane / 4;
  float dk[HALVES][32], dv[HALVES][32];
#pragma unroll
  for (int h = 0; h < HALVES; ++h) {
#pragma unroll
    for (int i = 0; i < 32; ++i) dk[h][i] = dv[h][i] = 0.f;
  }
  float st[STREAM / 2], dpt[STREAM / 2];
  u32 pf[STREAM / 4], dsf[STREAM / 4];
  const u32 ak = smem_u32(sk) + wg * 64 * 128, av = smem_u32(sv) + wg * 64 * 128, kv_half = BLOCK_ROWS * 128;
  mbar_wait(smem_u32(&kvbar), 0);

#if DQ_ATOMIC == 4
  // One pass, pipelined: block n's dQ product is issued after block n + 1's Sᵀ and dPᵀ, so the
  // warpgroups need not reach block n's dS together, and its registers are stored while
  // block n + 1's products run. Groups of products in flight, in order: Sᵀ(n), dPᵀ(n),
  // dQ(n − 1), dV(n), dK(n).
  float dqt[DQT_H][DQT_N];
  const u32 ads0 = smem_u32(sds);
  // one block; the first (block 0, no dQ before it) is a step of its own, so that every
  // wait counts the same groups in flight wherever it is (ptxas serialises the products
  // otherwise)
  auto step = [&](const int n, auto is_first) {
    constexpr bool FIRST = decltype(is_first)::value;
    const int s = n % STAGES, q0 = (first + n) * STREAM, b = n % 2;
    mbar_wait(smem_u32(&full[s]), (n / STAGES) & 1);
    const u32 aq = smem_u32(sq + s * STREAM * ROW_BYTES), ado = smem_u32(sdo + s * STREAM * ROW_BYTES);
    wgmma_fence();
    issue_abt<STREAM>(st, ak, kv_half, aq, STREAM * 128);    // Sᵀ = k·qᵀ
    wgmma_commit();
    issue_abt<STREAM>(dpt, av, kv_half, ado, STREAM * 128);  // dPᵀ = v·dOᵀ
    wgmma_commit();
    if constexpr (FIRST) {
      wgmma_wait1();
    } else {
      // both warpgroups' dS of block n − 1 are in shared memory
      mbar_wait(smem_u32(&ds_full[1 - b]), ((n - 1) / 2) & 1);
      issue_dq_t(dqt, smem_u32(sk), ads0 + (1 - b) * WGS * 64 * 128, wg);
      wgmma_commit();
      wgmma_wait2();
      // Sᵀ(n) has landed, and before it block n − 1's dV and dK: its stage is free
      release_stage(empty, (n - 1) % STAGES, lane);
    }
    fence_operands(st);
    probabilities_t(st, slse[s], q0, kw0, kr0, lane, scale_log2);
    pack_fragments<STREAM>(pf, st);
    wgmma_fence();
    issue_pb<STREAM>(dv, pf, ado, STREAM);  // dV += Pᵀ·dO
    wgmma_commit();
    // dPᵀ has landed (dQ(n − 1) and dV may not have)
    if constexpr (FIRST) {
      wgmma_wait1();
    } else {
      wgmma_wait2();
    }
    fence_operands(dpt);
    scores_grad_t(dpt, st, sdelta[s], lane);
    pack_fragments<STREAM>(dsf, dpt);
    // both warpgroups' dQ products of block n − 2 have read this dS buffer
    if (n >= 2) mbar_wait(smem_u32(&ds_empty[b]), ((n - 2) / 2) & 1);
    store_ds_t(ads0 + b * WGS * 64 * 128 + wg * 64 * 128, dsf, warp, lane);
    mbar_arrive(smem_u32(&ds_full[b]));
    wgmma_fence();
    issue_pb<STREAM>(dk, dsf, aq, STREAM);  // dK += dSᵀ·q  (· scale at the end)
    wgmma_commit();
    if constexpr (!FIRST) {
      // dQ(n − 1) has landed: its dS buffer is free, and its dQ goes to the adding warp; so
      // have dV(n) and dK(n) (with dK(n) left in flight, its dS fragments would be live
      // across the loop, and ptxas would serialise the products for want of registers)
      wgmma_wait0();
      fence_operands(dqt);
      mbar_arrive(smem_u32(&ds_empty[1 - b]));
      store_dq_t(sdq, dqt, (n - 1) % DQ_BUFS, n - 1 >= DQ_BUFS, wg, tid);
    }
  };
  step(0, Flag<true>{});
  for (int n = 1; n < n_blocks; ++n) step(n, Flag<false>{});
  {
    // the last block's dQ
    const int n = n_blocks - 1, b = n % 2;
    mbar_wait(smem_u32(&ds_full[b]), (n / 2) & 1);
    wgmma_fence();
    issue_dq_t(dqt, smem_u32(sk), ads0 + b * WGS * 64 * 128, wg);
    wgmma_commit();
    wgmma_wait0();
    fence_operands(dqt);
    fence_operands(dv);
    fence_operands(dk);
    store_dq_t(sdq, dqt, n % DQ_BUFS, n >= DQ_BUFS, wg, tid);
  }
#else
  for (int n = 0; n < n_blocks; ++n) {
    const int s = n % STAGES, q0 = (first + n) * STREAM;
    mbar_wait(smem_u32(&full[s]), (n / STAGES) & 1);
    // a block whose queries all come before this warpgroup's keys adds nothing here (with
    // DQ_ATOMIC=3 the warpgroup runs it all the same, masked to zeros: its dS tile is read)
    if (DQ_ATOMIC == 3 || q0 + STREAM - 1 >= kw0) {
      const u32 aq = smem_u32(sq + s * STREAM * ROW_BYTES), ado = smem_u32(sdo + s * STREAM * ROW_BYTES);
      // two groups of products: Pᵀ is made from Sᵀ while dPᵀ is still being computed, and
      // (EARLY_DV) dV += Pᵀ·dO runs while dSᵀ is made
      wgmma_fence();
      issue_abt<STREAM>(st, ak, kv_half, aq, STREAM * 128);    // Sᵀ = k·qᵀ
      wgmma_commit();
      issue_abt<STREAM>(dpt, av, kv_half, ado, STREAM * 128);  // dPᵀ = v·dOᵀ
      wgmma_commit();
      wgmma_wait1();
      fence_operands(st);
      // register 4j+e: key kr0 + 8·(e/2), query q0 + 8j + 2·(lane%4) + e%2; only a block that
      // reaches a query before one of these keys is masked
      const bool masked = q0 < kw0 + 63;
#pragma unroll
      for (int j = 0; j < STREAM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 8 * j + 2 * (lane % 4) + (e % 2);
          float p = fast_exp2(st[4 * j + e] * scale_log2 - slse[s][col]);
          if (masked && q0 + col < kr0 + 8 * (e / 2)) p = 0.f;
          st[4 * j + e] = p;
        }
      }
      pack_fragments<STREAM>(pf, st);
#if EARLY_DV
      wgmma_fence();
      issue_pb<STREAM>(dv, pf, ado, STREAM);  // dV += Pᵀ·dO
      wgmma_commit();
      // dPᵀ has landed (dV may not have)
      wgmma_wait1();
#else
      wgmma_wait0();
#endif
      fence_operands(dpt);
#pragma unroll
      for (int j = 0; j < STREAM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 8 * j + 2 * (lane % 4) + (e % 2);
          dpt[4 * j + e] = st[4 * j + e] * (dpt[4 * j + e] - sdelta[s][col]);
        }
      }
      pack_fragments<STREAM>(dsf, dpt);
#if DQ_ATOMIC == 3
      const u32 ads = smem_u32(sds) + (n % 2) * WGS * 64 * 128;
      store_ds_t(ads + wg * 64 * 128, dsf, warp, lane);
#elif DQ_ATOMIC
      // dSᵀ's register 4j+e is dS's element (query 8j + 2·(lane%4) + e%2, key warp·16 +
      // lane/4 + 8·(e/2)): stored transposed, a query a row, in the 128-byte swizzle (chunk c
      // of row r at c ^ (r % 8)), then made visible to the tensor cores' reads
      const u32 ads = smem_u32(sds) + wg * 64 * 128;
#if DQ_ATOMIC == 1
      // every warp of the warpgroup is past its wait for the last block's dQ product, which
      // read the whole tile (a warp's wait covers only its own part of the product)
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
#else
      // warpgroup 1 has this block unless all its queries come before the block's keys 64..
      const bool pair = q0 + STREAM - 1 >= k0 + 64;
      if (wg == 0) {
        // the lanes that reduce dQ: their last bulk reductions have read sdq (the barrier
        // after the stores below holds the other warps' writes to it until then)
        if (warp == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
      } else {
        // warpgroup 0's last dQ product has read this warpgroup's tile
        asm volatile("bar.sync 2, 256;\n" ::: "memory");
      }
#endif
#pragma unroll
      for (int j = 0; j < STREAM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const u32 row = 8 * j + 2 * (lane % 4) + (e % 2), col = warp * 16 + lane / 4 + 8 * (e / 2);
          const u32 at = ads + row * 128 + ((((col * 2) / 16) ^ (row % 8)) * 16) + (col * 2) % 16;
          asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(at), "h"(to16(dpt[4 * j + e])) : "memory");
        }
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#if DQ_ATOMIC == 1
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
#else
      // warpgroup 0 waits for both tiles (its own alone where warpgroup 1 has no part)
      if (wg == 1) {
        asm volatile("bar.arrive 3, 256;\n" ::: "memory");
      } else if (pair) {
        asm volatile("bar.sync 3, 256;\n" ::: "memory");
      } else {
        asm volatile("bar.sync 1, 128;\n" ::: "memory");
      }
#endif
      float dq[32];
#endif
      wgmma_fence();
#if !EARLY_DV
      issue_pb<STREAM>(dv, pf, ado, STREAM);  // dV += Pᵀ·dO
#endif
      issue_pb<STREAM>(dk, dsf, aq, STREAM);  // dK += dSᵀ·q  (· scale at the end)
#if DQ_ATOMIC == 3
      wgmma_commit();
#if DQ_SPLIT >= 2
      // split by blocks, this warpgroup takes block n's dQ (the index read through a shuffle:
      // ptxas then sees the branch taken by whole warps and does not serialise the products in
      // it); it waits for the other's dS, which goes on
      const bool dq_here = __shfl_sync(0xffffffff, wg, 0) == n % 2;
      const int bar_ds = n % 2 ? BAR_DS_ODD : BAR_DS;
#endif
#if DQ_SPLIT == 3
      // Both warpgroups wait for their dV and dK first, outside any branch, so that ptxas sees
      // Pᵀ's and dSᵀ's fragments free wherever dQ's 64 accumulators are live; the other
      // warpgroup says its dS is written before it waits
      if (!dq_here) asm volatile("bar.arrive %0, %1;\n" ::"r"(bar_ds), "n"(128 * WGS) : "memory");
      wgmma_wait0();
      fence_operands(dv);
      fence_operands(dk);
#if EARLY_FREE
      release_stage(empty, s, lane);
#endif
      if (dq_here) {
        float dqt[DQT_H][DQT_N];
        asm volatile("bar.sync %0, %1;\n" ::"r"(bar_ds), "n"(128 * WGS) : "memory");
        wgmma_fence();
        issue_dq_t(dqt, smem_u32(sk), ads, wg);
        wgmma_commit();
        wgmma_wait0();
        fence_operands(dqt);
        store_dq_t(sdq, dqt, n % DQ_BUFS, n >= DQ_BUFS, wg, tid);
      }
#else
      float dqt[DQT_H][DQT_N];
#endif
#if DQ_SPLIT == 2
      // (dK runs meanwhile)
      if (dq_here) {
        asm volatile("bar.sync %0, %1;\n" ::"r"(bar_ds), "n"(128 * WGS) : "memory");
        wgmma_fence();
        issue_dq_t(dqt, smem_u32(sk), ads, wg);
      } else {
        asm volatile("bar.arrive %0, %1;\n" ::"r"(bar_ds), "n"(128 * WGS) : "memory");
      }
#elif DQ_SPLIT < 2
      // both warpgroups' dS are in shared memory (dK runs meanwhile)
      asm volatile("bar.sync %0, %1;\n" ::"n"(BAR_DS), "n"(128 * WGS) : "memory");
      wgmma_fence();
      issue_dq_t(dqt, smem_u32(sk), ads, wg);
#endif
#elif DQ_ATOMIC == 1
      // dQ = dS·k over this warpgroup's 64 keys: dS from shared memory, k MN-major (as v)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wgmma_m64n64_ss<1>(dq, descriptor(ads + kk * 32, QK_LBO, QK_SBO), descriptor(ak + kk * 16 * 128, V_LBO, V_SBO), kk > 0);
      }
#elif DQ_ATOMIC == 2
      // dQ = dS·k over the block's keys, by warpgroup 0: the k-steps past 64 read warpgroup
      // 1's tile of dS and its keys
      // (the warpgroup's index read through a shuffle: ptxas then sees the branch taken by
      // whole warps and does not serialise the products in it)
      if (__shfl_sync(0xffffffff, wg, 0) == 0) {
        const u32 a0 = smem_u32(sds), b0 = smem_u32(sk);
        if (pair) {
#pragma unroll
          for (int kk = 0; kk < 8; ++kk) {
            wgmma_m64n64_ss<1>(dq, descriptor(a0 + (kk / 4) * 64 * 128 + (kk % 4) * 32, QK_LBO, QK_SBO),
                               descriptor(b0 + kk * 16 * 128, V_LBO, V_SBO), kk > 0);
          }
        } else {
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
            wgmma_m64n64_ss<1>(dq, descriptor(a0 + kk * 32, QK_LBO, QK_SBO), descriptor(b0 + kk * 16 * 128, V_LBO, V_SBO),
                               kk > 0);
          }
        }
      }
#endif
#if DQ_ATOMIC != 3 || DQ_SPLIT != 3
      // (DQ_SPLIT=3 waited and stored above: an empty group's commit would cost a product)
      wgmma_commit();
      wgmma_wait0();
      fence_operands(dv);
      fence_operands(dk);
#endif
#if DQ_ATOMIC == 3
#if DQ_SPLIT == 2
      if (dq_here) {
        fence_operands(dqt);
        store_dq_t(sdq, dqt, n % DQ_BUFS, n >= DQ_BUFS, wg, tid);
      }
#elif DQ_SPLIT < 2
      fence_operands(dqt);
      store_dq_t(sdq, dqt, n % DQ_BUFS, n >= DQ_BUFS, wg, tid);
#endif
#elif DQ_ATOMIC == 2
      if (wg == 0) {
        fence_operands(dq);
        // register 4j + 2h + {0,1}: row warp·16 + lane/4 + 8h, columns 8j + 2·(lane%4) + {0,1}
        const u32 adq = smem_u32(sdq);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const u32 row = warp * 16 + lane / 4 + 8 * h;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(adq + row * DQ_ROW_BYTES + (8 * j + 2 * (lane % 4)) * 4),
                         "f"(dq[4 * j + 2 * h]), "f"(dq[4 * j + 2 * h + 1])
                         : "memory");
          }
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        asm volatile("bar.sync 1, 128;\n" ::: "memory");
        // warp 0's lanes add the rows into the f32 sums, two rows a lane
        if (warp == 0) {
#pragma unroll
          for (int r = lane; r < STREAM; r += 32) {
            if (q0 + r < tokens) {
              float* dst = dq_accum + ((u64)head * tokens + q0 + r) * HEAD_DIM;
              asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
                           "r"(adq + r * DQ_ROW_BYTES), "n"(HEAD_DIM * 4)
                           : "memory");
            }
          }
          asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        }
        // warpgroup 1 may write its tile of dS for the next block
        if (n + 1 < n_blocks) asm volatile("bar.arrive 2, 256;\n" ::: "memory");
      }
#elif DQ_ATOMIC == 1
      fence_operands(dq);
      // register 4j + 2h + {0,1}: query q0 + warp·16 + lane/4 + 8h, columns 8j + 2·(lane%4) + {0,1}
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = q0 + warp * 16 + lane / 4 + 8 * h;
        if (row < tokens) {
          float* dst = dq_accum + ((u64)head * tokens + row) * HEAD_DIM + 2 * (lane % 4);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst + 8 * j), "f"(dq[4 * j + 2 * h]),
                         "f"(dq[4 * j + 2 * h + 1])
                         : "memory");
          }
        }
      }
#endif
    }
#if !EARLY_FREE
    // this warp is done with the buffer
    release_stage(empty, s, lane);
#endif
  }
#endif
#if DQ_ATOMIC == 2
  // the bulk reductions read sdq until they are done: the block keeps its shared memory
  if (wg == 0 && warp == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
  const long long start = layout.start(head);
  store_rows(dk_out + start, layout.token, dk, scale, kr0, tokens, lane);
  store_rows(dv_out + start, layout.token, dv, 1.f, kr0, tokens, lane);
}
// ANCHOR_END: dkdv

// δ = Σ_d dO·O for every row, a warp a row, before either pass: the forward's output and its
// gradient read where their layouts put them; δ is [heads, tokens] as the log-sum-exp. The
// grid is (token blocks, sequences × heads), so that no thread divides to find its row (a
// 64-bit division per row cost as much as the loads)
extern "C" __global__ void hopper_delta(const u16* __restrict__ out, const Layout out_layout, const u16* __restrict__ dout,
                                        const Layout dout_layout, float* __restrict__ delta, int tokens) {
  const int bh = blockIdx.y, t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= tokens) return;
  const u32* o = (const u32*)(out + out_layout.start(bh) + (long long)t * out_layout.token);
  const u32* d = (const u32*)(dout + dout_layout.start(bh) + (long long)t * dout_layout.token);
  float sum = 0.f;
  for (int i = lane; i < HEAD_DIM / 2; i += 32) {
    const u32 a = o[i], b = d[i];
    sum += from16(a & 0xffff) * from16(b & 0xffff) + from16(a >> 16) * from16(b >> 16);
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (lane == 0) delta[(long long)bh * tokens + t] = sum;
}

#if DQ_ATOMIC >= 3 && DQ_SPLIT == 3
// dq = 16-bit(acc · scale) where `layout` puts it, from the f32 sums in the order the adding
// warp wrote: [heads, blocks of 64 queries, 64 · HEAD_DIM], where the float4 at 128·j + t
// (t = 32·warp + lane) holds register 4j + e (e = 0..3) of dQ in thread t of the warpgroup
// that took it: query 16·warp + lane/4 + 8·(e/2), column 8j + 2·(lane%4) + e%2. A thread reads
// the float4s of j and j + 1 (j even) and writes two pairs of columns in each of two rows:
// `items` is an eighth of the sums
extern "C" __global__ void hopper_dq_convert(const float* __restrict__ acc, u16* __restrict__ dq, const Layout layout,
                                             int tokens, long long items, float scale) {
  const int blocks = (tokens + 63) / 64;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < items; i += (long long)gridDim.x * blockDim.x) {
    const long long blk = i / (8 * HEAD_DIM);
    const int r = (int)(i % (8 * HEAD_DIM)), j = 2 * (r / 128), t = r % 128;
    const int warp = t / 32, lane = t % 32;
    const float4* at = reinterpret_cast<const float4*>(acc + blk * 64 * HEAD_DIM) + 128 * j + t;
    const float4 a = at[0], b = at[128];
    const int bh = (int)(blk / blocks), q = (int)(blk % blocks) * 64 + 16 * warp + lane / 4;
    u16* row = dq + layout.start(bh) + (long long)q * layout.token + 8 * j + 2 * (lane % 4);
    if (q < tokens) {
      *reinterpret_cast<u32*>(row) = pack(a.x * scale, a.y * scale);
      *reinterpret_cast<u32*>(row + 8) = pack(b.x * scale, b.y * scale);
    }
    if (q + 8 < tokens) {
      *reinterpret_cast<u32*>(row + 8 * layout.token) = pack(a.z * scale, a.w * scale);
      *reinterpret_cast<u32*>(row + 8 * layout.token + 8) = pack(b.z * scale, b.w * scale);
    }
  }
}
#elif DQ_ATOMIC >= 3
// dq = 16-bit(acc · scale) where `layout` puts it, from the f32 sums in the order the adding
// warp wrote: [heads, blocks of 64 queries, 64 · HEAD_DIM], where the float4 at 128·R + t
// (R = 4·HALVES·w + 4h + j, t = 32·warp + lane) holds register 4j + e (e = 0..3) of dQᵀ's half
// h in thread t of warpgroup w: column 64h + 16·warp + lane/4 + 8·(e/2), query 32w + 8j +
// 2·(lane%4) + e%2. Lanes L and L + 4 hold neighbouring columns, so a thread reads both
// float4s (L/4 even) and writes four pairs of columns: `items` is an eighth of the sums
extern "C" __global__ void hopper_dq_convert(const float* __restrict__ acc, u16* __restrict__ dq, const Layout layout,
                                             int tokens, long long items, float scale) {
  const int blocks = (tokens + 63) / 64;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < items; i += (long long)gridDim.x * blockDim.x) {
    const long long blk = i / (8 * HEAD_DIM);
    const int r = (int)(i % (8 * HEAD_DIM)), R = r / 64, u = r % 64;
    const int warp = u / 16, L = 8 * ((u % 16) / 4) + u % 4;
    const int w = R / (4 * HALVES), h = (R / 4) % HALVES, j = R % 4;
    const float4* at = reinterpret_cast<const float4*>(acc + blk * 64 * HEAD_DIM) + 128 * R + 32 * warp + L;
    const float4 a = at[0], b = at[4];
    const int bh = (int)(blk / blocks), q = (int)(blk % blocks) * 64 + 32 * w + 8 * j + 2 * (L % 4);
    const int d = 64 * h + 16 * warp + L / 4;
    u16* row = dq + layout.start(bh) + (long long)q * layout.token + d;
    if (q < tokens) {
      *reinterpret_cast<u32*>(row) = pack(a.x * scale, b.x * scale);
      *reinterpret_cast<u32*>(row + 8) = pack(a.z * scale, b.z * scale);
    }
    if (q + 1 < tokens) {
      *reinterpret_cast<u32*>(row + layout.token) = pack(a.y * scale, b.y * scale);
      *reinterpret_cast<u32*>(row + layout.token + 8) = pack(a.w * scale, b.w * scale);
    }
  }
}
#elif DQ_ATOMIC
// dq = 16-bit(acc · scale), two values a thread at a time, where `layout` puts it, from the
// f32 sums [heads, tokens, HEAD_DIM] (`items`: half the values)
extern "C" __global__ void hopper_dq_convert(const float* __restrict__ acc, u16* __restrict__ dq, const Layout layout,
                                             int tokens, long long items, float scale) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < items; i += (long long)gridDim.x * blockDim.x) {
    const long long row = 2 * i / HEAD_DIM, bh = row / tokens;
    const int t = (int)(row % tokens), d = (int)(2 * i % HEAD_DIM);
    const float2 ab = reinterpret_cast<const float2*>(acc)[i];
    *reinterpret_cast<u32*>(dq + layout.start((int)bh) + (long long)t * layout.token + d) = pack(ab.x * scale, ab.y * scale);
  }
}
#endif
#else

// ANCHOR: dq
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
hopper_dq(const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_k,
          const __grid_constant__ TensorMap map_v, const __grid_constant__ TensorMap map_do,
          const float* __restrict__ lse, const float* __restrict__ delta, u16* __restrict__ dq_out,
          const Layout layout, int tokens, float scale_log2, float scale) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = (unsigned char*)(((u64)smem_raw + 1023) & ~1023ull);
  unsigned char* sq = smem;
  unsigned char* sdo = sq + BLOCK_ROWS * ROW_BYTES;
  unsigned char* sk = sdo + BLOCK_ROWS * ROW_BYTES;
  unsigned char* sv = sk + STAGES * STREAM * ROW_BYTES;
  __shared__ __align__(8) u64 full[STAGES], empty[STAGES], qbar;

  // the last query blocks see the most keys: they start first
  const int m_blocks = (tokens + BLOCK_ROWS - 1) / BLOCK_ROWS;
#if LONGEST_FIRST
  const int mb = m_blocks - 1 - blockIdx.y, head = blockIdx.x, q0 = mb * BLOCK_ROWS;
#else
  const int mb = m_blocks - 1 - blockIdx.x, head = blockIdx.y, q0 = mb * BLOCK_ROWS;
#endif
  // the keys up to this block's last query
  const int n_blocks = min((tokens + STREAM - 1) / STREAM, (q0 + BLOCK_ROWS + STREAM - 1) / STREAM);
  const int tid = threadIdx.x, wg = tid / 128;
  init_barriers(&qbar, full, empty);

  if (wg == WGS) {
    producer_registers();
    if (tid < 128 * WGS + 32) {
      produce<false>(&map_q, &map_do, &map_k, &map_v, sq, sdo, sk, sv, nullptr, nullptr, &qbar, full, empty, lse,
                     delta, q0, 0, n_blocks, head, layout.heads, tokens, tid % 32);
    }
    return;
  }

  consumer_registers();
  // a consumer warpgroup: 64 queries, 16 per warp; each thread holds two, r0 and r0 + 8
  const int warp = (tid % 128) / 32, lane = tid % 32;
  const int w0 = q0 + wg * 64, r0 = w0 + warp * 16 + lane / 4;
  float lse2[2], dl[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + 8 * h;
    lse2[h] = row < tokens ? lse[(u64)head * tokens + row] * LOG2E : INFINITY;
    dl[h] = row < tokens ? delta[(u64)head * tokens + row] : 0.f;
  }
  float dq[HALVES][32];
#pragma unroll
  for (int h = 0; h < HALVES; ++h) {
#pragma unroll
    for (int i = 0; i < 32; ++i) dq[h][i] = 0.f;
  }
  float sc[STREAM / 2], dp[STREAM / 2];
  u32 dsf[STREAM / 4];
  const u32 aq = smem_u32(sq) + wg * 64 * 128, ado = smem_u32(sdo) + wg * 64 * 128, q_half = BLOCK_ROWS * 128;
  mbar_wait(smem_u32(&qbar), 0);

  for (int n = 0; n < n_blocks; ++n) {
    const int s = n % STAGES, key0 = n * STREAM;
    mbar_wait(smem_u32(&full[s]), (n / STAGES) & 1);
    // a block whose keys all come after this warpgroup's queries adds nothing here
    if (key0 <= w0 + 63) {
      const u32 ak = smem_u32(sk + s * STREAM * ROW_BYTES), av = smem_u32(sv + s * STREAM * ROW_BYTES);
      // two groups of products: P is made from S while dP is still being computed
      wgmma_fence();
      issue_abt<STREAM>(sc, aq, q_half, ak, STREAM * 128);  // S = q·kᵀ
      wgmma_commit();
      issue_abt<STREAM>(dp, ado, q_half, av, STREAM * 128);  // dP = dO·vᵀ
      wgmma_commit();
      wgmma_wait1();
      fence_operands(sc);
      // register 4j+e: query r0 + 8·(e/2), key key0 + 8j + 2·(lane%4) + e%2
      const bool masked = key0 + STREAM - 1 > w0;
#pragma unroll
      for (int j = 0; j < STREAM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + 8 * j + 2 * (lane % 4) + (e % 2);
          float p = fast_exp2(sc[4 * j + e] * scale_log2 - lse2[e / 2]);
          if (masked && key > r0 + 8 * (e / 2)) p = 0.f;
          sc[4 * j + e] = p;
        }
      }
      wgmma_wait0();
      fence_operands(dp);
#pragma unroll
      for (int j = 0; j < STREAM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[4 * j + e] = sc[4 * j + e] * (dp[4 * j + e] - dl[e / 2]);
      }
      pack_fragments<STREAM>(dsf, dp);
      wgmma_fence();
      issue_pb<STREAM>(dq, dsf, ak, STREAM);  // dQ += dS·k  (· scale at the end)
      wgmma_commit();
      wgmma_wait0();
      fence_operands(dq);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(smem_u32(&empty[s]));
  }
  store_rows(dq_out + layout.start(head), layout.token, dq, scale, r0, tokens, lane);
}
// ANCHOR_END: dq
#endif
