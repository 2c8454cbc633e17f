// A probe of Hopper's warpgroup products (`wgmma`, sm_90a): one warpgroup of 128 threads computes
// S = Q·Kᵀ with both operands read from shared memory through matrix descriptors, then
// O = P·V with P = bf16(S) taken from registers and V read from shared memory transposed
// (V is [keys, head_dim] row-major, so the product's B operand is "MN-major"). Tiles are 64×64
// bf16 in the 128-byte swizzle that TMA writes and wgmma reads. The descriptors' two byte
// offsets are launch parameters, so the host can find which encodings give the right answer.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// ANCHOR: sw128
// Byte offset of element (row, col) of a [rows, 64] tile of 16-bit values, 128 bytes a row, in
// the 128-byte swizzle: the 16-byte chunk c of row r lands at chunk c ^ (r % 8).
__device__ __forceinline__ u32 sw128(u32 row, u32 col) {
  u32 chunk = (col * 2) / 16;
  return row * 128 + ((chunk ^ (row % 8)) * 16) + (col * 2) % 16;
}
// ANCHOR_END: sw128

// A shared-memory matrix descriptor: start address, leading and stride byte offsets (all in
// 16-byte units, 14 bits each), 128-byte swizzle (mode 1 in bits 62-63).
__device__ __forceinline__ u64 descriptor(u32 addr, u32 lbo, u32 sbo) {
  u64 d = 0;
  d |= (u64)((addr & 0x3FFFF) >> 4);
  d |= (u64)((lbo & 0x3FFFF) >> 4) << 16;
  d |= (u64)((sbo & 0x3FFFF) >> 4) << 32;
  d |= (u64)1 << 62;
  return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ void wgmma_ss(float (&d)[32], unsigned long long da, unsigned long long db, int scale_d) {
  asm volatile(
    "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
    : "l"(da), "l"(db), "r"(scale_d));
}

template <int TRANS_B>
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long db, int scale_d) {
  asm volatile(
    "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TRANS_B));
}

// S = Q·Kᵀ and O = bf16(S)·V on tiles already in shared memory; writes both to global memory.
__device__ __forceinline__ void products(unsigned char* sq, unsigned char* sk, unsigned char* sv,
                                         float* s_out, float* o_out,
                                         u32 lbo_k, u32 sbo_k, u32 lbo_v, u32 sbo_v) {
  int tid = threadIdx.x;
  u32 aq = (u32)__cvta_generic_to_shared(sq);
  u32 ak = (u32)__cvta_generic_to_shared(sk);
  u32 av = (u32)__cvta_generic_to_shared(sv);
  float s[32];
  for (int i = 0; i < 32; ++i) s[i] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    // 16 columns of head_dim = 32 bytes further along each 128-byte row
    wgmma_ss(s, descriptor(aq + kk * 32, lbo_k, sbo_k), descriptor(ak + kk * 32, lbo_k, sbo_k), 1);
  }
  wgmma_commit();
  wgmma_wait0();

  // accumulator layout: warp w holds rows 16w..16w+15; register 4j+e of lane l is row
  // 16w + l/4 + 8*(e/2), column 8j + 2*(l%4) + e%2
  int warp = tid / 32, lane = tid % 32;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int row = 16 * warp + lane / 4 + 8 * (e / 2);
      int col = 8 * j + 2 * (lane % 4) + (e % 2);
      s_out[row * 64 + col] = s[4 * j + e];
    }
  }

  // O = bf16(S)·V: the accumulator's columns 16kk..16kk+15 are the A fragment of step kk
  float o[32];
  for (int i = 0; i < 32; ++i) o[i] = 0.f;
  u32 a[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    a[kk][0] = pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
    a[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
    a[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
    a[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
  }
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    // 16 keys = 16 rows of 128 bytes further down V
    wgmma_rs<1>(o, a[kk], descriptor(av + kk * 2048, lbo_v, sbo_v), 1);
  }
  wgmma_commit();
  wgmma_wait0();
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int row = 16 * warp + lane / 4 + 8 * (e / 2);
      int col = 8 * j + 2 * (lane % 4) + (e % 2);
      o_out[row * 64 + col] = o[4 * j + e];
    }
  }
}

extern "C" __global__ void __launch_bounds__(128, 1)
wgmma_probe(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
            float* __restrict__ s_out, float* __restrict__ o_out,
            u32 lbo_k, u32 sbo_k, u32 lbo_v, u32 sbo_v) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // the swizzle pattern repeats every 1024 bytes: tiles start on 1024-byte boundaries
  unsigned char* smem = (unsigned char*)(((unsigned long long)smem_raw + 1023) & ~1023ull);
  unsigned char* sq = smem;
  unsigned char* sk = smem + 8192;
  unsigned char* sv = smem + 16384;
  int tid = threadIdx.x;
  for (int i = tid; i < 64 * 64; i += 128) {
    int r = i / 64, c = i % 64;
    *(u16*)(sq + sw128(r, c)) = q[i];
    *(u16*)(sk + sw128(r, c)) = k[i];
    *(u16*)(sv + sw128(r, c)) = v[i];
  }
  // ordinary stores, read next by the tensor cores (the async proxy)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();

  products(sq, sk, sv, s_out, o_out, lbo_k, sbo_k, lbo_v, sbo_v);
}

// The tensor memory accelerator's view of a tensor: 128 opaque bytes the host encodes
// (cuTensorMapEncodeTiled), passed by value.
struct __align__(64) TensorMap {
  u64 opaque[16];
};

// The same products with the tiles brought in by TMA: one thread tells an mbarrier how many
// bytes to expect, starts three bulk tensor copies (each writes its tile in the 128-byte
// swizzle), and every thread waits on the barrier's phase.
extern "C" __global__ void __launch_bounds__(128, 1)
wgmma_probe_tma(const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_k,
                const __grid_constant__ TensorMap map_v, float* __restrict__ s_out,
                float* __restrict__ o_out, u32 lbo_k, u32 sbo_k, u32 lbo_v, u32 sbo_v) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = (unsigned char*)(((unsigned long long)smem_raw + 1023) & ~1023ull);
  unsigned char* sq = smem;
  unsigned char* sk = smem + 8192;
  unsigned char* sv = smem + 16384;
  __shared__ __align__(8) u64 bar;
  u32 abar = (u32)__cvta_generic_to_shared(&bar);
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(abar));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(abar), "r"(3 * 8192)
                 : "memory");
    const TensorMap* maps[3] = {&map_q, &map_k, &map_v};
    unsigned char* dst[3] = {sq, sk, sv};
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      asm volatile(
          "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
              (u32)__cvta_generic_to_shared(dst[i])),
          "l"((u64)maps[i]), "r"(0), "r"(0), "r"(abar)
          : "memory");
    }
  }
  // phase 0 completes when the one arrival and all the expected bytes are in
  asm volatile(
      "{\n.reg .pred done;\nwait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
      "@!done bra wait;\n}\n" ::"r"(abar)
      : "memory");
  products(sq, sk, sv, s_out, o_out, lbo_k, sbo_k, lbo_v, sbo_v);
}
