// Rung 2: rung 1 with a producer warpgroup that hands its registers to the consumers. After
// hopper.cuh and forward.cuh.
//
// A thread block starts with the register file shared evenly among its threads. The
// producer needs few (it only starts copies), the consumers many (the output, the scores
// and P of 64 rows: at head dim 128 more than the 168 a thread of a 384-thread block starts
// with). setmaxnreg moves them, but acts on whole warpgroups, so the producer is a
// warpgroup of which one thread works: it keeps PRODUCER_REGS registers a thread, and each
// consumer thread takes up to CONSUMER_REGS. One block a multiprocessor.

static_assert(THREADS == 128 * WGS + 128,
              "WGS consumer warpgroups and a producer warpgroup");
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

  for (int n = 0; n < n_blocks; ++n) {
    const int s = n % STAGES;
    mbar_wait(smem_u32(&full[s]), (n / STAGES) & 1);
    wgmma_fence();
    issue_abt<BLOCK_N>(sc, aq, q_half, smem_u32(sk + s * BLOCK_N * ROW_BYTES),
                       k_half);  // S = q·kᵀ
    wgmma_commit();
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
