// Step 06's forward kernel: FlashAttention's loop with Hopper's own instructions.
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
// Head dim 128 rows are 256 bytes, wider than the swizzle's 128: a tile is stored as two
// halves of 64 columns, each [rows][128 bytes] in the same swizzle, loaded by one TMA box
// each; q·kᵀ takes its k-steps from one half then the other, and o is two accumulators of 64
// columns. With OVERLAP=1 the products of one block run while the softmax of the next is
// computed (FlashAttention-3's intra-warpgroup pipelining): S of block n+1 and P·v of block n
// are issued together, and the warpgroup waits only for S before its softmax.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef IS_BF16
#define IS_BF16 1
#endif
#if IS_BF16
#define ELEM "bf16"
#define CVT_PAIR "cvt.rn.bf16x2.f32"
#else
#define ELEM "f16"
#define CVT_PAIR "cvt.rn.f16x2.f32"
#endif
// the descriptors' byte offsets (leading, stride): q and k are K-major, v is MN-major
#ifndef QK_LBO
#define QK_LBO 16
#endif
#ifndef QK_SBO
#define QK_SBO 1024
#endif
#ifndef V_LBO
#define V_LBO 16
#endif
#ifndef V_SBO
#define V_SBO 1024
#endif
#ifndef WGS
#define WGS 2
#endif
#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#if HEAD_DIM != 64 && HEAD_DIM != 128
#error "HEAD_DIM must be 64 or 128"
#endif
// halves of 64 columns (128 bytes, one swizzle row) in a row
#define HALVES (HEAD_DIM / 64)
#ifndef OVERLAP
#define OVERLAP 0
#endif
#define BLOCK_M (64 * WGS)
#define BLOCK_N 128
#ifndef STAGES
#define STAGES 2
#endif
// With PRODUCER_WG=1 the producer is a whole warpgroup, so that registers can move between
// the roles (setmaxnreg acts on warpgroups): the producer gives up all but PRODUCER_REGS and
// each consumer thread may use CONSUMER_REGS
#ifndef PRODUCER_WG
#define PRODUCER_WG 0
#endif
#if PRODUCER_WG
#define THREADS (128 * WGS + 128)
#define PRODUCER_REGS (WGS == 1 ? 56 : WGS == 2 ? 24 : 32)
// what is left of the 65,536 registers, per consumer thread, in steps of 8
#define CONSUMER_REGS (((65536 - 128 * PRODUCER_REGS) / (128 * WGS)) / 8 * 8 > 240 ? 240 : ((65536 - 128 * PRODUCER_REGS) / (128 * WGS)) / 8 * 8)
#else
#define THREADS (128 * WGS + 32)
#endif
// thread blocks each multiprocessor must fit (the register budget)
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#define ROW_BYTES (HEAD_DIM * 2)
#define INFINITY __int_as_float(0x7f800000)

struct __align__(64) TensorMap {
  u64 opaque[16];
};

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// ANCHOR: descriptor
// A shared-memory matrix descriptor in the 128-byte swizzle: start address, leading and
// stride byte offsets, each in 16-byte units.
__device__ __forceinline__ u64 descriptor(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo & 0x3FFFF) >> 4) << 16) |
         ((u64)((sbo & 0x3FFFF) >> 4) << 32) | ((u64)1 << 62);
}
// ANCHOR_END: descriptor

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 phase) {
  u32 done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(phase)
        : "memory");
  }
}
// One box of a rank-3 tensor map ([heads][tokens][head_dim]) into shared memory, completing
// on `bar`: `rows` rows from `token` on, 64 columns from `column`.
__device__ __forceinline__ void tma_box(u32 dst, const TensorMap* map, u32 bar, int column, int token, int head) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"((u64)map), "r"(column), "r"(token), "r"(head), "r"(bar)
      : "memory");
}
// A tile of `rows` rows, half by half: the half of columns 64h.. lands at dst + h·rows·128
__device__ __forceinline__ void tma_load(u32 dst, const TensorMap* map, u32 bar, int rows, int token, int head) {
#pragma unroll
  for (int h = 0; h < HALVES; ++h) tma_box(dst + h * rows * 128, map, bar, 64 * h, token, head);
}

__device__ __forceinline__ u32 pack(float lo, float hi) {
  u32 r;
  asm(CVT_PAIR " %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// d[64] (+)= A·B for one k-step of 16, A and B from shared memory (both K-major); the
// product overwrites d when scale_d is 0
__device__ __forceinline__ void wgmma_m64n128_ss(float (&d)[64], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." ELEM "." ELEM " "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

// d[32] += A·B for one k-step of 16, A from registers, B from shared memory transposed
// (MN-major)
__device__ __forceinline__ void wgmma_m64n64_rs_tb(float (&d)[32], const u32 (&a)[4], u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." ELEM "." ELEM " "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// ANCHOR: steps
// S = q·kᵀ for one block: 64 rows × 128 keys, HEAD_DIM/16 k-steps of 16 columns (32 bytes),
// four in each 128-byte half; `aq` and `ak` are the first half's tiles, `q_half` and
// `k_half` the bytes from one half to the next
__device__ __forceinline__ void issue_scores(float (&sc)[64], u32 aq, u32 q_half, u32 ak, u32 k_half) {
#pragma unroll
  for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
    const u32 h = kk / 4, c = (kk % 4) * 32;
    wgmma_m64n128_ss(sc, descriptor(aq + h * q_half + c, QK_LBO, QK_SBO), descriptor(ak + h * k_half + c, QK_LBO, QK_SBO), kk > 0);
  }
}

// o += P·v: eight steps of 16 keys, P's fragment of step kk in p[4kk..4kk+3], v's 16 rows of
// 128 bytes at 2048·kk in each half
__device__ __forceinline__ void issue_pv(float (&o)[HALVES][32], const u32 (&p)[32], u32 av) {
#pragma unroll
  for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
    const u32 a[4] = {p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3]};
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
      wgmma_m64n64_rs_tb(o[h], a, descriptor(av + h * BLOCK_N * 128 + kk * 16 * 128, V_LBO, V_SBO));
    }
  }
}

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
    corr[h] = exp2f(m[h] - m_new);
    m[h] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = exp2f(sc[4 * j + 2 * h + e] * scale_log2 - m_new);
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

// P's fragment for the next product: S's columns 16kk..16kk+15 are registers 8kk..8kk+7
__device__ __forceinline__ void pack_p(u32 (&p)[32], const float (&sc)[64]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) p[i] = pack(sc[2 * i], sc[2 * i + 1]);
}
// ANCHOR_END: steps

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
hopper_forward(const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_k,
               const __grid_constant__ TensorMap map_v, u16* __restrict__ out, float* __restrict__ lse,
               int tokens, float scale_log2) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = (unsigned char*)(((u64)smem_raw + 1023) & ~1023ull);
  unsigned char* sq = smem;
  unsigned char* sk = sq + BLOCK_M * ROW_BYTES;
  unsigned char* sv = sk + STAGES * BLOCK_N * ROW_BYTES;
  __shared__ __align__(8) u64 full[STAGES], empty[STAGES], qbar;

  const int m_blocks = (tokens + BLOCK_M - 1) / BLOCK_M;
  const int mb = m_blocks - 1 - blockIdx.x;  // longest rows first
  const int head = blockIdx.y;
  const int n_blocks = min((tokens + BLOCK_N - 1) / BLOCK_N, ((mb + 1) * BLOCK_M + BLOCK_N - 1) / BLOCK_N);
  const int tid = threadIdx.x;
  const int wg = tid / 128;

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(smem_u32(&full[s]), 1);
      mbar_init(smem_u32(&empty[s]), WGS);
    }
    mbar_init(smem_u32(&qbar), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // ANCHOR: producer
  if (wg == WGS) {
#if PRODUCER_WG
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
#endif
    // the producer: its first thread starts every copy
    if (tid == 128 * WGS) {
      mbar_expect_tx(smem_u32(&qbar), BLOCK_M * ROW_BYTES);
      tma_load(smem_u32(sq), &map_q, smem_u32(&qbar), BLOCK_M, mb * BLOCK_M, head);
      for (int n = 0; n < n_blocks; ++n) {
        const int s = n % STAGES;
        // wait until every consumer is done with the keys and values last in this buffer
        if (n >= STAGES) mbar_wait(smem_u32(&empty[s]), ((n / STAGES) - 1) & 1);
        mbar_expect_tx(smem_u32(&full[s]), 2 * BLOCK_N * ROW_BYTES);
        tma_load(smem_u32(sk + s * BLOCK_N * ROW_BYTES), &map_k, smem_u32(&full[s]), BLOCK_N, n * BLOCK_N, head);
        tma_load(smem_u32(sv + s * BLOCK_N * ROW_BYTES), &map_v, smem_u32(&full[s]), BLOCK_N, n * BLOCK_N, head);
      }
    }
    return;
  }
  // ANCHOR_END: producer

  // ANCHOR: consumer
  // a consumer warpgroup: 64 rows, 16 per warp; each thread holds two rows, r0 and r0 + 8
#if PRODUCER_WG
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
#endif
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
  mbar_wait(smem_u32(&qbar), 0);

#if OVERLAP
  // block 0's scores and softmax alone; then each step issues block n's scores and block
  // n-1's P·v together, and the softmax of block n runs while P·v is on the tensor cores
  mbar_wait(smem_u32(&full[0]), 0);
  wgmma_fence();
  issue_scores(sc, aq, q_half, k_tile(0), k_half);
  wgmma_commit();
  wgmma_wait0();
  if (crosses(0)) mask(sc, 0, r0, lane);
  softmax(sc, m, l, corr, scale_log2);
  pack_p(p, sc);
  for (int n = 1; n < n_blocks; ++n) {
    mbar_wait(smem_u32(&full[n % STAGES]), (n / STAGES) & 1);
    wgmma_fence();
    issue_scores(sc, aq, q_half, k_tile(n), k_half);
    wgmma_commit();
    issue_pv(o, p, v_tile(n - 1));
    wgmma_commit();
    wgmma_wait1();  // the scores are ready; P·v may still run
    if (crosses(n)) mask(sc, n * BLOCK_N, r0, lane);
    softmax(sc, m, l, corr, scale_log2);
    wgmma_wait0();  // P·v of block n-1 is done: o may be rescaled, p rewritten
    if (tid % 128 == 0) mbar_arrive(smem_u32(&empty[(n - 1) % STAGES]));
    rescale(o, corr);
    pack_p(p, sc);
  }
  wgmma_fence();
  issue_pv(o, p, v_tile(n_blocks - 1));
  wgmma_commit();
  wgmma_wait0();
#else
  for (int n = 0; n < n_blocks; ++n) {
    mbar_wait(smem_u32(&full[n % STAGES]), (n / STAGES) & 1);
    wgmma_fence();
    issue_scores(sc, aq, q_half, k_tile(n), k_half);
    wgmma_commit();
    wgmma_wait0();
    if (crosses(n)) mask(sc, n * BLOCK_N, r0, lane);
    softmax(sc, m, l, corr, scale_log2);
    rescale(o, corr);
    pack_p(p, sc);
    wgmma_fence();
    issue_pv(o, p, v_tile(n));
    wgmma_commit();
    wgmma_wait0();
    // this warpgroup is done with the buffer
    if (tid % 128 == 0) mbar_arrive(smem_u32(&empty[n % STAGES]));
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
      u32* dst = (u32*)(out + ((u64)head * tokens + row) * HEAD_DIM);
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
