// Rung 4: rung 3 with each warpgroup's softmax beside its own products. After hopper.cuh
// and forward.cuh.
//
// In rung 3 a warpgroup waits for P·v before it starts the next block's scores. Here the
// products of one block run while the softmax of the next is computed (FlashAttention-3's
// intra-warpgroup pipelining): S of block n + 1 and P·v of block n are issued together, and
// the warpgroup waits only for S before its softmax. P·v then still reads block n's values
// while the next scores need block n + 1's keys, so the keys and the values of a buffer
// have barriers of their own, and the producer brings each block's keys one block ahead of
// its values, in the order the products take them: with one pair a buffer, two buffers
// would be held at once, and with two stages the next block could not start to arrive until
// P·v is done.

static_assert(THREADS == 128 * WGS + 128,
              "WGS consumer warpgroups and a producer warpgroup");
static_assert(MIN_BLOCKS == 1,
              "the producer's registers go to this block's consumers alone");
static_assert(WGS >= 2, "turns take two or more warpgroups");

// When the output takes the last softmax's correction. At head dim 64 it is rescaled while
// the next block's scores are on the tensor cores, just before P·v is issued
// (FlashAttention-3's order); at head dim 128 after P·v, which measured faster there (the
// lab's notes have both).
#define RESCALE_EARLY (HEAD_DIM == 64)

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) hopper_forward(
    const __grid_constant__ TensorMap map_q,  // q, read in boxes of BLOCK_M rows
    const __grid_constant__ TensorMap map_k,  // k, in boxes of BLOCK_N rows
    const __grid_constant__ TensorMap map_v,  // v, in boxes of BLOCK_N rows
    u16* __restrict__ out,                    // the output, where out_layout says
    const Layout out_layout,                  // the output's strides (q's heads)
    float* __restrict__ lse,                  // [batch · heads, tokens] log-sum-exps
    int tokens,                               // the sequence's length
    int q_per_kv,                             // query heads per head of k, v // [step 08]
    float scale_log2) {                       // 1/√d · log2(e): scores to base 2
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = (unsigned char*)(((u64)smem_raw + 1023) & ~1023ull);
  unsigned char* sq = smem;
  unsigned char* sk = sq + BLOCK_M * ROW_BYTES;
  unsigned char* sv = sk + STAGES * BLOCK_N * ROW_BYTES;
  // a buffer's keys and its values each have a "full" and an "empty" barrier
  __shared__ __align__(8) u64 full_k[STAGES], empty_k[STAGES], qbar;
  __shared__ __align__(8) u64 full_v[STAGES], empty_v[STAGES];

  const BlockPlace place = block_place(tokens);
  const int mb = place.mb, head = place.head;
  // the head of k and v this block reads, and their heads per sequence: q's
  int kv_head = head, kv_heads = out_layout.heads;
  // [step 08]
  // grouped-query attention: each head of k and v serves q_per_kv query heads
  kv_head /= q_per_kv;
  kv_heads /= q_per_kv;
  // [/step 08]
  const int n_blocks =
      min((tokens + BLOCK_N - 1) / BLOCK_N, ((mb + 1) * BLOCK_M + BLOCK_N - 1) / BLOCK_N);
  const int tid = threadIdx.x;
  const int wg = tid / 128;

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(smem_u32(&full_k[s]), 1);
      mbar_init(smem_u32(&empty_k[s]), WGS);
      mbar_init(smem_u32(&full_v[s]), 1);
      mbar_init(smem_u32(&empty_v[s]), WGS);
    }
    mbar_init(smem_u32(&qbar), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // ANCHOR: producer
  if (wg == WGS) {
    release_registers<PRODUCER_REGS>();
    // the producer: its first thread starts every copy
    if (tid == 128 * WGS) {
      mbar_expect_tx(smem_u32(&qbar), BLOCK_M * ROW_BYTES);
      tma_load(smem_u32(sq), &map_q, smem_u32(&qbar), BLOCK_M, mb * BLOCK_M, head,
               out_layout.heads);
      // block n's keys or values into buffer n % STAGES, once every consumer is done with
      // what was last in it
      auto load = [&](const TensorMap* map, unsigned char* tiles, u64* full, u64* empty,
                      int n) {
        const int s = n % STAGES;
        if (n >= STAGES) mbar_wait(smem_u32(&empty[s]), ((n / STAGES) - 1) & 1);
        mbar_expect_tx(smem_u32(&full[s]), BLOCK_N * ROW_BYTES);
        tma_load(smem_u32(tiles + s * BLOCK_N * ROW_BYTES), map, smem_u32(&full[s]),
                 BLOCK_N, n * BLOCK_N, kv_head, kv_heads);
      };
      // the keys one block ahead of the values
      load(&map_k, sk, full_k, empty_k, 0);
      for (int n = 1; n <= n_blocks; ++n) {
        if (n < n_blocks) load(&map_k, sk, full_k, empty_k, n);
        load(&map_v, sv, full_v, empty_v, n - 1);
      }
    }
    return;
  }
  // ANCHOR_END: producer

  // ANCHOR: consumer
  // a consumer warpgroup: 64 rows, 16 per warp; each thread holds two rows, r0 and r0 + 8
  take_registers<CONSUMER_REGS>();
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
  const u32 aq = smem_u32(sq) + wg * 64 * 128, q_half = BLOCK_M * 128,
            k_half = BLOCK_N * 128;
  auto k_tile = [&](int n) { return smem_u32(sk + (n % STAGES) * BLOCK_N * ROW_BYTES); };
  auto v_tile = [&](int n) { return smem_u32(sv + (n % STAGES) * BLOCK_N * ROW_BYTES); };
  // only the blocks that cross the diagonal are masked
  auto crosses = [&](int n) { return n * BLOCK_N + BLOCK_N - 1 > first_row; };
  // waiting for block n's keys or values, and handing their buffer back
  auto keys_ready = [&](int n) {
    mbar_wait(smem_u32(&full_k[n % STAGES]), (n / STAGES) & 1);
  };
  auto values_ready = [&](int n) {
    mbar_wait(smem_u32(&full_v[n % STAGES]), (n / STAGES) & 1);
  };
  auto keys_done = [&](int n) {
    if (tid % 128 == 0) mbar_arrive(smem_u32(&empty_k[n % STAGES]));
  };
  auto values_done = [&](int n) {
    if (tid % 128 == 0) mbar_arrive(smem_u32(&empty_v[n % STAGES]));
  };
  mbar_wait(smem_u32(&qbar), 0);

  // the turns, as rung 3's
  if (wg == WGS - 1) asm volatile("bar.arrive 1, 256;\n" ::: "memory");
  auto my_turn = [&]() { asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory"); };
  auto next_turn = [&](int n) {
    if (wg < WGS - 1 || n + 1 < n_blocks)
      asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + (wg + 1) % WGS) : "memory");
  };

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
    issue_abt<BLOCK_N>(sc, aq, q_half, k_tile(n), k_half);  // S(n) = q·kᵀ
    wgmma_commit();
    if constexpr (RESCALE_EARLY) {
      // o as far as block n-2, to the maxima of block n-1, while the scores are computed
      fence_operands(o);
      rescale(o, corr);
      fence_operands(o);
      wgmma_fence();
    }
    issue_pb<BLOCK_N>(o, p, v_tile(n - 1), BLOCK_N);  // o += P(n-1)·v
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
    if constexpr (!RESCALE_EARLY) rescale(o, corr);
    pack_fragments<BLOCK_N>(p, sc);
  }
  if constexpr (RESCALE_EARLY) {
    rescale(o, corr);
    fence_operands(o);
  }
  values_ready(n_blocks - 1);
  wgmma_fence();
  issue_pb<BLOCK_N>(o, p, v_tile(n_blocks - 1), BLOCK_N);
  wgmma_commit();
  wgmma_wait0();
  fence_operands(o);
  // ANCHOR_END: consumer

  store_output(o, m, l, out, out_layout, lse, head, r0, tokens, lane);
}
