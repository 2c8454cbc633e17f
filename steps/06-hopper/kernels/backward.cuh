// What the backward's kernels share, after hopper.cuh: the block's place in the grid, the
// producer's loop, the stages' barriers, Pᵀ and dSᵀ rebuilt in registers, and δ.
//
// Step 04's passes with Hopper's products. Every pass is one block per BLOCK_ROWS = 64·WGS
// rows of a head that it owns (keys for dK and dV, queries for dQ), each consumer warpgroup
// owning 64 of them, while the rows that meet them stream past STREAM at a time in STAGES
// buffers. A producer warpgroup (its first warp) brings the tiles with TMA; its 32 lanes
// also copy each stage's log-sum-exps and δs into shared memory, and every lane arrives on
// the stage's "full" barrier. Every product reads its tiles in the layouts the forward's
// products already read (q·kᵀ from two K-major tiles, P·v with v MN-major).
//
// Every kernel is compiled with WGS, STAGES, STREAM, THREADS, PRODUCER_REGS, CONSUMER_REGS
// and LONGEST_FIRST from src/kernel.rs's BackwardKernel.

static_assert(THREADS == 128 * WGS + 128,
              "WGS consumer warpgroups and a producer warpgroup");
static_assert(STREAM == 64 || STREAM == 128,
              "STREAM: rows streamed past a block, 64 or 128");

#define BLOCK_ROWS (64 * WGS)
#define LOG2E 1.4426950408889634f

// Which block of BLOCK_ROWS rows of which head this block owns, a head of any sequence of
// the batch; `last_first` for the dQ pass, whose last query blocks see the most keys (dK
// and dV's first key blocks are seen by the most queries). The longest blocks start first;
// with LONGEST_FIRST every head's longest block before any head's next longest (the grid is
// (heads, blocks)), else one head after another ((blocks, heads)), as the forward orders
// its blocks.
struct BlockPlace {
  int block, head;
};
__device__ __forceinline__ BlockPlace block_place(int tokens, bool last_first) {
  const int blocks = (tokens + BLOCK_ROWS - 1) / BLOCK_ROWS;
  const int b = LONGEST_FIRST ? blockIdx.y : blockIdx.x,
            head = LONGEST_FIRST ? blockIdx.x : blockIdx.y;
  return {last_first ? blocks - 1 - b : b, head};
}

// The producer's loop: `own` (BLOCK_ROWS rows from own_row of map_a0 and map_a1) once, on
// `own_bar`; then n_blocks stages of STREAM rows of map_b0 and map_b1 from stream_row0, and
// (dK and dV only) their log-sum-exps in base 2 and δs.
template <bool ROWS_STATS>
__device__ __forceinline__ void
produce(const TensorMap* map_a0, const TensorMap* map_a1, const TensorMap* map_b0,
        const TensorMap* map_b1, unsigned char* sa0, unsigned char* sa1, unsigned char* sb0,
        unsigned char* sb1, float (*slse)[STREAM], float (*sdelta)[STREAM], u64* own_bar,
        u64* full, u64* empty, const float* lse, const float* delta, int own_row,
        int stream_row0, int n_blocks, int head, int heads,
        int a_group, int b_group,  // query heads per head of a's, b's tensors // [step 08]
        int tokens, int lane) {
  // the head of a's and of b's tensors this block reads, and their heads per sequence
  int a_head = head, a_heads = heads, b_head = head, b_heads = heads;
  // [step 08]
  // grouped-query attention: k and v have a head for every q_per_kv query heads
  a_head /= a_group;
  a_heads /= a_group;
  b_head /= b_group;
  b_heads /= b_group;
  // [/step 08]
  if (lane == 0) {
    mbar_expect_tx(smem_u32(own_bar), 2 * BLOCK_ROWS * ROW_BYTES);
    tma_load(smem_u32(sa0), map_a0, smem_u32(own_bar), BLOCK_ROWS, own_row, a_head, a_heads);
    tma_load(smem_u32(sa1), map_a1, smem_u32(own_bar), BLOCK_ROWS, own_row, a_head, a_heads);
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
      tma_load(smem_u32(sb0 + s * STREAM * ROW_BYTES), map_b0, smem_u32(&full[s]), STREAM,
               row0, b_head, b_heads);
      tma_load(smem_u32(sb1 + s * STREAM * ROW_BYTES), map_b1, smem_u32(&full[s]), STREAM,
               row0, b_head, b_heads);
    } else {
      // the arrival releases this lane's writes of lse and δ to the consumers
      mbar_arrive(smem_u32(&full[s]));
    }
  }
}

// The barriers every pass starts with: "full" counts the producer warp's 32 lanes (and the
// copies' bytes), "empty" `releases` arrivals (each consumer thread's in dK and dV, each
// consumer warp's in dQ). A consumer arrives on "empty" only after its own wait on "full":
// a warpgroup that skips a block could otherwise release the stage while one of its warps
// has yet to see it full, and that warp would then wait on a phase two behind
__device__ __forceinline__ void init_barriers(u64* own_bar, u64* full, u64* empty,
                                              u32 releases) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(smem_u32(&full[s]), 32);
      mbar_init(smem_u32(&empty[s]), releases);
    }
    mbar_init(smem_u32(own_bar), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
}

// ANCHOR: release_stage
// A consumer thread's release of stage s in dK and dV: every lane arrives, each releasing
// its own reads of the stage's log-sum-exps and δs. (One arrival a warp after __syncwarp
// would be as sound, but compute-sanitizer's racecheck does not follow __syncwarp into lane
// 0's arrival and reports the other lanes' reads as racing the producer's next write.) The
// __syncwarp orders nothing here; without it ptxas spills in the two-pass shape at head dim
// 128.
__device__ __forceinline__ void release_stage(u64* empty, int s) {
  __syncwarp();
  mbar_arrive(smem_u32(&empty[s]));
}
// ANCHOR_END: release_stage

// ANCHOR: probabilities
// Pᵀ from Sᵀ in place, for a consumer warpgroup's keys from kw0 and a block of queries from
// q0: register 4j+e is key kr0 + 8·(e/2), query q0 + 8j + 2·(lane%4) + e%2 (lse2: the
// block's log-sum-exps in base 2); only a block that reaches a query before one of these
// keys is masked
__device__ __forceinline__ void probabilities_t(float (&st)[STREAM / 2], const float* lse2,
                                                int q0, int kw0, int kr0, int lane,
                                                float scale_log2) {
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
__device__ __forceinline__ void scores_grad_t(float (&dpt)[STREAM / 2],
                                              const float (&pt)[STREAM / 2],
                                              const float* delta, int lane) {
#pragma unroll
  for (int j = 0; j < STREAM / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = 8 * j + 2 * (lane % 4) + (e % 2);
      dpt[4 * j + e] = pt[4 * j + e] * (dpt[4 * j + e] - delta[col]);
    }
  }
}
// ANCHOR_END: probabilities

// δ = Σ_d dO·O for every row, a warp a row, before the passes: the forward's output and its
// gradient read where their layouts put them; δ is [heads, tokens] as the log-sum-exp. The
// grid is (token blocks, sequences × heads), so that no thread divides to find its row (a
// 64-bit division per row cost as much as the loads)
extern "C" __global__ void
hopper_delta(const u16* __restrict__ out,   // the forward's output
             const Layout out_layout,       // its strides
             const u16* __restrict__ dout,  // the output's gradient
             const Layout dout_layout,      // its strides
             float* __restrict__ delta,     // [batch · heads, tokens]
             int tokens) {                  // the sequence's length
  const int bh = blockIdx.y, t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= tokens) return;
  const u32* o = (const u32*)(out + out_layout.start(bh) + (long long)t * out_layout.token);
  const u32* d =
      (const u32*)(dout + dout_layout.start(bh) + (long long)t * dout_layout.token);
  float sum = 0.f;
  for (int i = lane; i < HEAD_DIM / 2; i += 32) {
    const u32 a = o[i], b = d[i];
    sum += from16(a & 0xffff) * from16(b & 0xffff) + from16(a >> 16) * from16(b >> 16);
  }
  for (int offset = 16; offset > 0; offset /= 2)
    sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (lane == 0) delta[(long long)bh * tokens + t] = sum;
}
