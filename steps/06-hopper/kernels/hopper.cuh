// What step 06's kernels share: 16-bit types, the shared-memory matrix descriptors,
// mbarriers, TMA copies, and the warpgroup products (wgmma) they are built from.
// src/kernel.rs prepends it to each kernel's source, after the -D set of the kernel's typed
// description.
//
// Every kernel is compiled with IS_BF16 (1 bf16, 0 f16), HEAD_DIM (64 or 128) and TMA_RANK
// (3 or 4, below); a parameter left out is a compile error here, never a default. A row of
// head dim 128 is 256 bytes, wider than the swizzle's 128: every tile is stored as HALVES
// halves of 64 columns, each [rows][128 bytes] in the 128-byte swizzle and loaded by a TMA
// box of its own.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

static_assert(IS_BF16 == 0 || IS_BF16 == 1, "IS_BF16: 1 bf16, 0 f16");
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM: 64 or 128");
static_assert(TMA_RANK == 3 || TMA_RANK == 4, "TMA_RANK: 3 or 4");
#if IS_BF16
#define ELEM "bf16"
#define CVT_PAIR "cvt.rn.bf16x2.f32"
#else
#define ELEM "f16"
#define CVT_PAIR "cvt.rn.f16x2.f32"
#endif
// The descriptors' byte offsets (leading, stride) in the 128-byte swizzle: q and k are
// K-major, v is MN-major. The lab's wgmma-probe pins these down on the GPU at hand.
#define QK_LBO 16
#define QK_SBO 1024
#define V_LBO 16
#define V_SBO 1024
// halves of 64 columns (128 bytes, one swizzle row) in a row
#define HALVES (HEAD_DIM / 64)
#define ROW_BYTES (HEAD_DIM * 2)

// ANCHOR: setmaxnreg
// setmaxnreg acts on whole warpgroups: a producer warpgroup keeps REGS registers a thread
// and gives the rest back to the block's pool, from which each consumer thread then takes
// up to REGS. src/kernel.rs picks both and checks that the block starts with what they end
// with.
template <int REGS>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void take_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
// ANCHOR_END: setmaxnreg

#define INFINITY __int_as_float(0x7f800000)

// ANCHOR: fast_exp2
// 2^x in one instruction of the multifunction unit, as chapter 3's fast_exp2. exp2f becomes
// four: a comparison and two multiplications around the same instruction keep results below
// 2^-126 (subnormal) exact, which a probability never needs; this one flushes them to 0 and
// gives 2^-inf = 0 for a masked score
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// ANCHOR_END: fast_exp2

struct __align__(64) TensorMap {
  u64 opaque[16];
};

__device__ __forceinline__ u32 smem_u32(const void* p) {
  return (u32)__cvta_generic_to_shared(p);
}

// ANCHOR: descriptor
// A shared-memory matrix descriptor in the 128-byte swizzle: start address, leading and
// stride byte offsets, each in 16-byte units.
__device__ __forceinline__ u64 descriptor(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo & 0x3FFFF) >> 4) << 16) |
         ((u64)((sbo & 0x3FFFF) >> 4) << 32) | ((u64)1 << 62);
}
// ANCHOR_END: descriptor

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait1() {
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}
// Pins an accumulator's registers in place around a wait: the compiler may not move a read
// or write of them across this point (CUTLASS's warpgroup_fence_operand)
template <int N>
__device__ __forceinline__ void fence_operands(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(x[i])::"memory");
}
template <int H, int N>
__device__ __forceinline__ void fence_operands(float (&x)[H][N]) {
#pragma unroll
  for (int h = 0; h < H; ++h) fence_operands(x[h]);
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 phase) {
  u32 done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(phase)
        : "memory");
  }
}
// One box of a tensor map into shared memory, completing on `bar`: `rows` rows from `token`
// on of head `bh` (batch · heads + head), 64 columns from `column`. With TMA_RANK 3 the
// maps merge batches and heads into one dimension, [B·H][T][D], as they may when one head
// follows another at the same distance across batches; with 4 they are [B][H][T][D] at any
// strides (the trainer's fused projection). src/layout.rs's TmaRank picks it.
__device__ __forceinline__ void tma_box(u32 dst, const TensorMap* map, u32 bar, int column,
                                        int token, int bh, int heads) {
  if constexpr (TMA_RANK == 3) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n"
        :: "r"(dst), "l"((u64)map), "r"(column), "r"(token), "r"(bh), "r"(bar)
        : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
        :: "r"(dst), "l"((u64)map), "r"(column), "r"(token), "r"(bh % heads),
           "r"(bh / heads), "r"(bar)
        : "memory");
  }
}
// A tile of `rows` rows of head `bh` (batch · heads + head), half by half: the half of
// columns 64h.. lands at dst + h·rows·128
__device__ __forceinline__ void tma_load(u32 dst, const TensorMap* map, u32 bar, int rows,
                                         int token, int bh, int heads) {
#pragma unroll
  for (int h = 0; h < HALVES; ++h)
    tma_box(dst + h * rows * 128, map, bar, 64 * h, token, bh, heads);
}

// One value rounded to 16 bits
__device__ __forceinline__ u16 to16(float x) {
  u16 r;
  asm("cvt.rn." ELEM ".f32 %0, %1;\n" : "=h"(r) : "f"(x));
  return r;
}

// A 16-bit value as f32
__device__ __forceinline__ float from16(u16 x) {
  float r;
  asm("cvt.f32." ELEM " %0, %1;\n" : "=f"(r) : "h"(x));
  return r;
}

__device__ __forceinline__ u32 pack(float lo, float hi) {
  u32 r;
  asm(CVT_PAIR " %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}


// d[64] (+)= A·B for one k-step of 16, A and B from shared memory (both K-major, or B
// transposed with TRANS_B = 1: MN-major, as the backward's dQ = dS·k reads k); the product
// overwrites d when scale_d is 0
template <int TRANS_B = 0>
__device__ __forceinline__ void wgmma_m64n128_ss(float (&d)[64], u64 da, u64 db,
                                                 int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." ELEM "." ELEM " "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
      ", %64, %65, p, 1, 1, 0, %67;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
        "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
        "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
        "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
        "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),
        "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),
        "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]),
        "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d), "n"(TRANS_B));
}

// d[32] (+)= A·B for one k-step of 16, A and B from shared memory: N = 64; A K-major, B
// K-major too, or with TRANS_B = 1 transposed (MN-major, as v is stored); A transposed with
// TRANS_A = 1 (M-major, as the one-pass backward's dQᵀ = kᵀ·dSᵀ reads k at head dim 64)
template <int TRANS_B = 0, int TRANS_A = 0>
__device__ __forceinline__ void wgmma_m64n64_ss(float (&d)[32], u64 da, u64 db,
                                                int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." ELEM "." ELEM " "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
      ", %32, %33, p, 1, 1, %36, %35;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
        "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
        "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
        "+f"(d[31])
      : "l"(da), "l"(db), "r"(scale_d), "n"(TRANS_B), "n"(TRANS_A));
}

// d[32] += A·B for one k-step of 16, A from registers, B from shared memory transposed
// (MN-major)
__device__ __forceinline__ void wgmma_m64n64_rs_tb(float (&d)[32], const u32 (&a)[4],
                                                   u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." ELEM "." ELEM " "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
      ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
        "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
        "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
        "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// A product of N columns from shared memory: N = 64 or 128
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], u64 da, u64 db, int scale_d) {
  static_assert(N == 64 || N == 128, "N is 64 or 128");
  if constexpr (N == 128) {
    wgmma_m64n128_ss(d, da, db, scale_d);
  } else {
    wgmma_m64n64_ss(d, da, db, scale_d);
  }
}

// ANCHOR: products
// d = A·Bᵀ over the head dim, A 64 rows and B N rows of two tiles in shared memory, both
// stored [rows][head_dim] (K-major): HEAD_DIM/16 k-steps of 16 columns (32 bytes), four in
// each 128-byte half; `a` and `b` are the first half's rows, `a_half` and `b_half` the
// bytes from one half to the next
template <int N>
__device__ __forceinline__ void issue_abt(float (&d)[N / 2], u32 a, u32 a_half, u32 b,
                                          u32 b_half) {
#pragma unroll
  for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
    const u32 h = kk / 4, c = (kk % 4) * 32;
    wgmma_ss<N>(d, descriptor(a + h * a_half + c, QK_LBO, QK_SBO),
                descriptor(b + h * b_half + c, QK_LBO, QK_SBO), kk > 0);
  }
}

// acc += P·B: P (64 rows × K, from registers: p[4kk..4kk+3] is k-step kk's fragment) times
// a tile B of K rows stored [rows][head_dim] (MN-major for this product), in 16-row steps
// of 2,048 bytes in each half of `rows`·128 bytes
template <int K>
__device__ __forceinline__ void issue_pb(float (&acc)[HALVES][32], const u32 (&p)[K / 4],
                                         u32 b, int rows) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const u32 a[4] = {p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3]};
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
      wgmma_m64n64_rs_tb(acc[h], a,
                         descriptor(b + h * rows * 128 + kk * 16 * 128, V_LBO, V_SBO));
    }
  }
}
// ANCHOR_END: products

// A product's accumulator as the next product's A fragments: columns 16kk..16kk+15 of a
// thread's registers are 8kk..8kk+7, packed in pairs to 16 bits
template <int N>
__device__ __forceinline__ void pack_fragments(u32 (&p)[N / 4], const float (&s)[N / 2]) {
#pragma unroll
  for (int i = 0; i < N / 4; ++i) p[i] = pack(s[2 * i], s[2 * i + 1]);
}

// Where a tensor's values are: the strides, in values, between batches, heads and tokens (a
// token's HEAD_DIM values contiguous), and the heads per batch. [B, H, T, D] is
// {H·T·D, T·D, D}; the trainer's fused projection, one row of q, k and v heads per token,
// {T·3C, D, 3C} from each third's first column; the rows the attention's output projection
// reads, {T·C, D, C}.
struct Layout {
  long long batch, head, token;
  int heads;
  // the first value of head `bh` (blockIdx.y: batch · heads + head)
  __device__ __forceinline__ long long start(int bh) const {
    return (long long)(bh / heads) * batch + (long long)(bh % heads) * head;
  }
};

// A row-major [rows][HEAD_DIM] accumulator (two rows per thread, r0 and r0 + 8, as every
// m64 product leaves them) times `scale`, stored in 16 bits at `base` (the head's first
// value) `token` values apart for the rows below `tokens`
__device__ __forceinline__ void store_rows(u16* base, long long token,
                                           const float (&acc)[HALVES][32], float scale,
                                           int r0, int tokens, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + 8 * h;
    if (row < tokens) {
      u32* dst = (u32*)(base + (u64)row * token);
#pragma unroll
      for (int hh = 0; hh < HALVES; ++hh) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          dst[32 * hh + 4 * j + (lane % 4)] =
              pack(acc[hh][4 * j + 2 * h] * scale, acc[hh][4 * j + 2 * h + 1] * scale);
        }
      }
    }
  }
}
