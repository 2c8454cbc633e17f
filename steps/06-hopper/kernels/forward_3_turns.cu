// Rung 3: rung 2 with the consumer warpgroups taking turns at the tensor cores. After
// hopper.cuh and forward.cuh.
//
// Each warpgroup alternates between a product (tensor cores) and a softmax (the CUDA cores
// and the exponential's unit). Left alone the warpgroups fall into step and all want the
// tensor cores at once, then all wait on their softmax. Here warpgroup w waits at named
// barrier 1 + w for its turn, issues its scores' product, and hands the turn to the next,
// so that one warpgroup's softmax runs while the next one's product has the tensor cores
// (FlashAttention-3's ping-pong).

static_assert(THREADS == 128 * WGS + 128,
              "WGS consumer warpgroups and a producer warpgroup");
static_assert(WGS >= 2, "turns take two or more warpgroups");
static_assert(MIN_BLOCKS == 1,
              "the producer's registers go to this block's consumers alone");

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
  // full[s]: stage s's keys and values have landed; empty[s]: every warpgroup is done with
  // them
  __shared__ __align__(8) u64 full[STAGES], empty[STAGES], qbar;

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
      mbar_init(smem_u32(&full[s]), 1);
      mbar_init(smem_u32(&empty[s]), WGS);
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
      for (int n = 0; n < n_blocks; ++n) {
        // block n's keys and values into buffer n % STAGES, once every consumer is done
        // with what was last in it; one barrier for both, which expects both copies' bytes
        const int s = n % STAGES;
        if (n >= STAGES) mbar_wait(smem_u32(&empty[s]), ((n / STAGES) - 1) & 1);
        mbar_expect_tx(smem_u32(&full[s]), 2 * BLOCK_N * ROW_BYTES);
        tma_load(smem_u32(sk + s * BLOCK_N * ROW_BYTES), &map_k, smem_u32(&full[s]),
                 BLOCK_N, n * BLOCK_N, kv_head, kv_heads);
        tma_load(smem_u32(sv + s * BLOCK_N * ROW_BYTES), &map_v, smem_u32(&full[s]),
                 BLOCK_N, n * BLOCK_N, kv_head, kv_heads);
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
  mbar_wait(smem_u32(&qbar), 0);

  // ANCHOR: turns
  // the last warpgroup opens the first turn, warpgroup 0's (every warpgroup takes n_blocks
  // turns, so each barrier sees as many arrivals as waits)
  if (wg == WGS - 1) asm volatile("bar.arrive 1, 256;\n" ::: "memory");
  // this warpgroup's turn; the next warpgroup's (the last one's final turn opens none)
  auto my_turn = [&]() { asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory"); };
  auto next_turn = [&](int n) {
    if (wg < WGS - 1 || n + 1 < n_blocks)
      asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + (wg + 1) % WGS) : "memory");
  };
  // ANCHOR_END: turns

  for (int n = 0; n < n_blocks; ++n) {
    const int s = n % STAGES;
    mbar_wait(smem_u32(&full[s]), (n / STAGES) & 1);
    my_turn();
    wgmma_fence();
    issue_abt<BLOCK_N>(sc, aq, q_half, smem_u32(sk + s * BLOCK_N * ROW_BYTES),
                       k_half);  // S = q·kᵀ
    wgmma_commit();
    next_turn(n);
    wgmma_wait0();
    fence_operands(sc);
    if (n * BLOCK_N + BLOCK_N - 1 > first_row) mask(sc, n * BLOCK_N, r0, lane);
    softmax(sc, m, l, corr, scale_log2);
    rescale(o, corr);
    pack_fragments<BLOCK_N>(p, sc);
    wgmma_fence();
    issue_pb<BLOCK_N>(o, p, smem_u32(sv + s * BLOCK_N * ROW_BYTES), BLOCK_N);  // o += P·v
    wgmma_commit();
    wgmma_wait0();
    fence_operands(o);
    // this warpgroup is done with the buffer
    if (tid % 128 == 0) mbar_arrive(smem_u32(&empty[s]));
  }
  // ANCHOR_END: consumer

  store_output(o, m, l, out, out_layout, lse, head, r0, tokens, lane);
}
