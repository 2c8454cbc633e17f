// What the attention kernels share: 16-bit values as raw bits, the swizzled layout of tiles
// in shared memory, and the instructions the tensor cores are fed with (cp.async, ldmatrix,
// mma.sync), as inline PTX, so that no CUDA header is needed and the code compiles wherever
// NVRTC runs. src/kernel.rs prepends this file to each kernel's source.
//
// Compile-time parameters, given to NVRTC as -D options by every kernel that includes this
// file (a missing one is a compile error):
//   HEAD_DIM  32, 64 or 128
//   IS_BF16   1 for bf16 values, 0 for f16

static_assert(HEAD_DIM % 16 == 0, "HEAD_DIM: a multiple of 16 (32, 64 or 128)");
static_assert(IS_BF16 == 0 || IS_BF16 == 1, "IS_BF16: 1 for bf16 values, 0 for f16");

typedef unsigned short u16;
typedef unsigned int u32;

// 16-byte chunks (8 values) per row of a tile
#define CHUNKS (HEAD_DIM / 8)
// chunks are swizzled within groups of at most 8 (128 bytes, all 32 banks)
#define SWIZZLE (CHUNKS < 8 ? CHUNKS : 8)

// -inf without math.h
#define NEG_INF __int_as_float(0xff800000)

#if IS_BF16
#define MMA_TYPE "bf16"
#define CVT_X2 "cvt.rn.bf16x2.f32"
#define CVT_1 "cvt.rn.bf16.f32"
#else
#define MMA_TYPE "f16"
#define CVT_X2 "cvt.rn.f16x2.f32"
#define CVT_1 "cvt.rn.f16.f32"
#endif

// ANCHOR: swizzle
// Shared-memory offset, in elements, of chunk `chunk` of row `row` in a tile of
// HEAD_DIM-wide rows. ldmatrix reads one 16-byte chunk from each of 8 consecutive rows;
// unswizzled, with 128-byte rows those 8 chunks sit in the same 4 banks and the read takes
// 8 turns. XOR-ing the chunk index with the row spreads them over all 32 banks,
// conflict-free.
__device__ __forceinline__ u32 swizzled(int row, int chunk) {
    return row * HEAD_DIM + ((chunk ^ (row & (SWIZZLE - 1))) << 3);
}
// ANCHOR_END: swizzle

// ANCHOR: b_offsets
// Each lane's ldmatrix offsets, in bytes, into a tile of HEAD_DIM-wide rows, for the B
// operands of attention's products, computed once. A tile's rows 8 apart share their
// swizzle (it depends on row % 8), so moving on by 8 or 16 rows is a constant offset the
// compiler folds into the instruction; and the swizzle permutes chunks only within groups
// of SWIZZLE, so moving on by SWIZZLE chunks is one too (at head dim 128, chunks 8-15 sit
// 128 bytes after chunks 0-7). Only the column chunks of the first group need a register
// each:
//   abt(kk):  B of a·tileᵀ, the tile's rows as the columns (k in q·kᵀ), plain ldmatrix:
//             row lane % 8 + 8·(lane / 16), chunk 2kk + (lane / 8) % 2   (+ 8 rows per
//             n-tile)
//   ab(n/2):  B of a·tile, the tile's rows as k (v in p·v), transposing ldmatrix:
//             row lane % 16, chunk n + lane / 16, for n = 0, 2, ...      (+ 16 rows per
//             k-step)
struct BOffsets {
    static constexpr int GROUP =
        SWIZZLE / 2;  // 16-column steps per group of swizzled chunks
    u32 abt_[GROUP], ab_[GROUP];
    __device__ __forceinline__ BOffsets(int lane) {
#pragma unroll
        for (int kk = 0; kk < GROUP; ++kk)
            abt_[kk] =
                2 * swizzled((lane & 7) + 8 * (lane >> 4), 2 * kk + ((lane >> 3) & 1));
#pragma unroll
        for (int i = 0; i < GROUP; ++i)
            ab_[i] = 2 * swizzled(lane & 15, 2 * i + (lane >> 4));
    }
    // (up to head dim 64 every kk is in the first group: the same code as indexing the
    // arrays)
    __device__ __forceinline__ u32 abt(int kk) const {
        return kk < GROUP ? abt_[kk] : abt_[kk % GROUP] + kk / GROUP * (SWIZZLE * 16);
    }
    __device__ __forceinline__ u32 ab(int i) const {
        return i < GROUP ? ab_[i] : ab_[i % GROUP] + i / GROUP * (SWIZZLE * 16);
    }
};
// ANCHOR_END: b_offsets

// ANCHOR: xor_step
// A lane's byte offset, within a tile, of its chunk for the 16 columns 16kk..16kk+15, given
// its offset for columns 0..15 (chunk c of its row, c = 0 or 1). Chunk 2kk + c lands at
// chunk (2kk + c) ^ (row % SWIZZLE) = 2kk ^ (c ^ row % SWIZZLE): the step flips bits of the
// chunk index that the row's own offset (a multiple of 2·HEAD_DIM bytes) leaves at zero, so
// it is one XOR with a constant, and a lane needs no register per step.
__device__ __forceinline__ u32 xor_step(u32 first, int kk) {
    return first ^ (u32)(kk << 5);
}

// BOffsets with one register for each operand: the offset for columns 0..15, stepped by
// xor_step
struct XorBOffsets {
    u32 abt0_, ab0_;
    __device__ __forceinline__ XorBOffsets(int lane)
        : abt0_(2 * swizzled((lane & 7) + 8 * (lane >> 4), (lane >> 3) & 1)),
          ab0_(2 * swizzled(lane & 15, lane >> 4)) {}
    __device__ __forceinline__ u32 abt(int kk) const { return xor_step(abt0_, kk); }
    __device__ __forceinline__ u32 ab(int i) const { return xor_step(ab0_, i); }
};
// ANCHOR_END: xor_step

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// Copies 16 bytes from global to shared memory without passing through registers; with
// `valid` false it writes 16 zero bytes and reads nothing (rows past the end of the
// sequence).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
    int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}
// The same for a chunk known to be inside the sequence.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
// waits until at most N of this thread's committed groups are still in flight
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ANCHOR: load_rows
// Loads ROWS rows of a [T, HEAD_DIM] matrix starting at row `row0` into a swizzled tile,
// with cp.async, by the NTHREADS threads of a block; rows at or past T become zeros. Thread
// i copies chunk i % CHUNKS of rows i / CHUNKS, i / CHUNKS + STEP, ... (STEP = NTHREADS /
// CHUNKS): consecutive threads read consecutive 16-byte chunks. The kernels copy inside
// their main loops, where every instruction competes with the products for issue slots, so
// the loop has a fixed count, the rows a thread copies sit at constant offsets from its
// first (in both memories: STEP rows keep the swizzle), and a tile wholly before T copies
// without a test per row.
template <int ROWS, int NTHREADS>
__device__ __forceinline__ void load_rows(u16* tile, const u16* src, int row0, int T) {
    constexpr int STEP = NTHREADS / CHUNKS;
    const int chunk = threadIdx.x % CHUNKS, r0 = threadIdx.x / CHUNKS;
    if constexpr (ROWS % STEP == 0 && STEP % SWIZZLE == 0) {
        const u32 dst = smem_addr(tile + swizzled(r0, chunk));
        const u16* g = src + (long long)(row0 + r0) * HEAD_DIM + chunk * 8;
        if (row0 + ROWS <= T) {
#pragma unroll
            for (int i = 0; i < ROWS / STEP; ++i)
                cp_async_16(dst + i * (STEP * HEAD_DIM * 2), g + i * (STEP * HEAD_DIM));
        } else {
#pragma unroll
            for (int i = 0; i < ROWS / STEP; ++i) {
                const bool valid = row0 + r0 + i * STEP < T;
                cp_async_16(dst + i * (STEP * HEAD_DIM * 2),
                            valid ? g + i * (STEP * HEAD_DIM) : src, valid);
            }
        }
    } else {
        // (a thread count that does not divide the tile: the general loop)
#pragma unroll
        for (int r = r0; r < ROWS; r += STEP) {
            bool valid = row0 + r < T;
            const u16* g = src + (valid ? (long long)(row0 + r) * HEAD_DIM + chunk * 8 : 0);
            cp_async_16(smem_addr(tile + swizzled(r, chunk)), g, valid);
        }
    }
}
// ANCHOR_END: load_rows

// ANCHOR: ldmatrix
// Four 8x8 matrices of 16-bit values from shared memory, one register of each per thread:
// lanes 8i..8i+7 give the addresses of matrix i's eight rows, and thread `lane` receives
// row lane/4, columns 2(lane%4) and 2(lane%4)+1 of each matrix, the layout of an mma
// fragment.
__device__ __forceinline__ void ldmatrix_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
// The same, each matrix transposed: thread `lane` receives rows 2(lane%4), 2(lane%4)+1 of
// column lane/4.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2,
                                                  u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
// ANCHOR_END: ldmatrix

// ANCHOR: mma
// c += a·b for a 16x16 tile a (row-major), a 16x8 tile b (column-major) and a 16x8 tile c
// in f32, one warp together. With g = lane/4 and t = lane%4, thread `lane` holds
//   a: a0 = a[g][2t..2t+1], a1 = a[g+8][2t..2t+1], a2 = a[g][2t+8..2t+9], a3 =
//   a[g+8][2t+8..2t+9] b: b0 = b[2t..2t+1][g], b1 = b[2t+8..2t+9][g]
//   c: c0, c1 = c[g][2t], c[g][2t+1];  c2, c3 = c[g+8][2t], c[g+8][2t+1]
// (PTX ISA, "Matrix fragments for mma.m16n8k16 with floating point type").
__device__ __forceinline__ void mma_16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// ANCHOR_END: mma

// ANCHOR: to_f32
// One 16-bit value widened to f32 (exactly): bf16 is the top half of an f32, f16 needs cvt.
__device__ __forceinline__ float to_f32(u16 x) {
    if constexpr (IS_BF16) {
        return __uint_as_float((u32)x << 16);
    } else {
        float f;
        asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
        return f;
    }
}
// ANCHOR_END: to_f32

// One f32 value rounded to 16 bits (to nearest, ties to even), as raw bits.
__device__ __forceinline__ u16 from_f32(float x) {
    u16 h;
    asm("" CVT_1 " %0, %1;\n" : "=h"(h) : "f"(x));
    return h;
}

// Two f32 values rounded to 16 bits and packed, `lo` in the low half (the lower column).
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    asm("" CVT_X2 " %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// ANCHOR: accumulators_to_a
// Two neighbouring 16x8 accumulator tiles (columns 16kk..16kk+15 of a product) as the A
// fragment of one 16x16 tile, rounded to 16 bits: the layouts match (see mma_16816), so a
// product's result feeds the next product from registers.
__device__ __forceinline__ void accumulators_to_a(const float (&lo)[4],
                                                  const float (&hi)[4], u32 (&a)[4]) {
    a[0] = pack2(lo[0], lo[1]);
    a[1] = pack2(lo[2], lo[3]);
    a[2] = pack2(hi[0], hi[1]);
    a[3] = pack2(hi[2], hi[3]);
}
// ANCHOR_END: accumulators_to_a

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

