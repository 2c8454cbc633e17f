// The masked forward: step 06's rung 4 (forward_4_overlap.cu) walking a block mask's list
// rather than every block up to the diagonal. After hopper.cuh, forward.cuh, the mask's
// source and masked.cuh.
//
// Three things change. The producer loads the blocks of keys and values the list names, in
// its order, and never the empty ones. A consumer applies the score function to every
// block and evaluates the mask only where the list says a block is partial. And q holds tq
// rows that are the last of the tk keys' positions, so k and v have maps of their own
// length.

static_assert(THREADS == 128 * WGS + 128,
              "WGS consumer warpgroups and a producer warpgroup");
static_assert(MIN_BLOCKS == 1,
              "the producer's registers go to this block's consumers alone");
static_assert(WGS >= 2, "turns take two or more warpgroups");

// As rung 4: the output rescaled while the next scores are computed at head dim 64
#define RESCALE_EARLY (HEAD_DIM == 64)

// ANCHOR: masked_4
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) masked_forward(
    const __grid_constant__ TensorMap map_q,  // q, read in boxes of BLOCK_M rows
    const __grid_constant__ TensorMap map_k,  // k, in boxes of BLOCK_N rows
    const __grid_constant__ TensorMap map_v,  // v, in boxes of BLOCK_N rows
    u16* __restrict__ out,                    // the output, where out_layout says
    const Layout out_layout,                  // the output's strides (q's heads)
    float* __restrict__ lse,                  // [batch · heads, tq] log-sum-exps
    int tq,                                   // q's length
    int tk,                                   // k's and v's length, tq or more
    int q_per_kv,                             // query heads per head of k and v
    const BlockList list,                     // the blocks of keys each query block sees
    const int* __restrict__ mask_data,        // the mask's data (document ids), or null
    float scale,                              // 1/√d: the scores the score function sees
    float scale_log2) {                       // 1/√d · log2(e): scores to base 2
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = (unsigned char*)(((u64)smem_raw + 1023) & ~1023ull);
  unsigned char* sq = smem;
  unsigned char* sk = sq + BLOCK_M * ROW_BYTES;
  unsigned char* sv = sk + STAGES * BLOCK_N * ROW_BYTES;
  __shared__ __align__(8) u64 full_k[STAGES], empty_k[STAGES], qbar;
  __shared__ __align__(8) u64 full_v[STAGES], empty_v[STAGES];
  // the list's entry of the keys in each buffer, written by the producer before their
  // barrier is armed (the arrival releases it to the consumers' wait): the consumers read
  // shared memory where each would otherwise wait on a global load every block
  __shared__ int stage_entry[STAGES];

  const BlockPlace place = block_place(tq);
  const int mb = place.mb, head = place.head;
  const int heads = out_layout.heads, b = head / heads, h = head % heads;
  const int kv_head = head / q_per_kv, kv_heads = heads / q_per_kv;
  // this query block's row of the list: how many blocks of keys, and which
  const int row = list.row(b, h);
  const int n_blocks = list.n(row, mb);
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

  if (wg == WGS) {
    release_registers<PRODUCER_REGS>();
    if (tid == 128 * WGS && n_blocks > 0) {
      mbar_expect_tx(smem_u32(&qbar), BLOCK_M * ROW_BYTES);
      tma_load(smem_u32(sq), &map_q, smem_u32(&qbar), BLOCK_M, mb * BLOCK_M, head, heads);
      // ANCHOR: masked_producer
      // the list's i-th block of keys or values into buffer i % STAGES
      auto load = [&](const TensorMap* map, unsigned char* tiles, u64* full, u64* empty,
                      int i) {
        const int s = i % STAGES, entry = list.at(row, mb, i);
        if (i >= STAGES) mbar_wait(smem_u32(&empty[s]), ((i / STAGES) - 1) & 1);
        if (full == full_k) stage_entry[s] = entry;
        mbar_expect_tx(smem_u32(&full[s]), BLOCK_N * ROW_BYTES);
        tma_load(smem_u32(tiles + s * BLOCK_N * ROW_BYTES), map, smem_u32(&full[s]),
                 BLOCK_N, (entry >> 1) * BLOCK_N, kv_head, kv_heads);
      };
      load(&map_k, sk, full_k, empty_k, 0);
      for (int i = 1; i <= n_blocks; ++i) {
        if (i < n_blocks) load(&map_k, sk, full_k, empty_k, i);
        load(&map_v, sv, full_v, empty_v, i - 1);
      }
      // ANCHOR_END: masked_producer
    }
    return;
  }

  take_registers<CONSUMER_REGS>();
  const int warp = (tid % 128) / 32, lane = tid % 32;
  const int first_row = mb * BLOCK_M + wg * 64;
  const int r0 = first_row + warp * 16 + lane / 4;
  float o[HALVES][32];
#pragma unroll
  for (int hh = 0; hh < HALVES; ++hh) {
#pragma unroll
    for (int i = 0; i < 32; ++i) o[hh][i] = 0.f;
  }
  float m[2] = {NO_KEY_YET, NO_KEY_YET};
  float l[2] = {0.f, 0.f};
  float corr[2];
  if (n_blocks == 0) {
    // no key for any row of the block: zeros, and log-sum-exps of −∞
    store_masked_output(o, m, l, out, out_layout, lse, head, r0, tq, lane);
    return;
  }
  const MaskArgs args{mask_data, b, h, tk - tq, tk};
  const RowKeys keys = row_keys(r0, args);
  // the score function's scores are natural: their exponents to base 2 take log2(e)
  const float exp_scale = SCORE_MOD_IDENTITY ? scale_log2 : LOG2E;
  float sc[64];
  u32 p[32];
  const u32 aq = smem_u32(sq) + wg * 64 * 128, q_half = BLOCK_M * 128,
            k_half = BLOCK_N * 128;
  auto k_tile = [&](int i) { return smem_u32(sk + (i % STAGES) * BLOCK_N * ROW_BYTES); };
  auto v_tile = [&](int i) { return smem_u32(sv + (i % STAGES) * BLOCK_N * ROW_BYTES); };
  auto keys_ready = [&](int i) {
    mbar_wait(smem_u32(&full_k[i % STAGES]), (i / STAGES) & 1);
  };
  auto values_ready = [&](int i) {
    mbar_wait(smem_u32(&full_v[i % STAGES]), (i / STAGES) & 1);
  };
  auto keys_done = [&](int i) {
    if (tid % 128 == 0) mbar_arrive(smem_u32(&empty_k[i % STAGES]));
  };
  auto values_done = [&](int i) {
    if (tid % 128 == 0) mbar_arrive(smem_u32(&empty_v[i % STAGES]));
  };
  mbar_wait(smem_u32(&qbar), 0);

  if (wg == WGS - 1) asm volatile("bar.arrive 1, 256;\n" ::: "memory");
  auto my_turn = [&]() { asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory"); };
  auto next_turn = [&](int i) {
    if (wg < WGS - 1 || i + 1 < n_blocks)
      asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + (wg + 1) % WGS) : "memory");
  };

  // ANCHOR: masked_block
  // block i's entry, once its keys have landed, and its mask: a bit a score (all ones
  // when the block is full, or when the mask is an interval a row)
  int entry;
  u64 bits;
  auto block_ready = [&](int i) {
    keys_ready(i);
    entry = stage_entry[i % STAGES];
    bits = MASK_INTERVAL || (entry & 1)
               ? ~0ull
               : visible_bits((entry >> 1) * BLOCK_N, r0, lane, args);
  };
  // ANCHOR_END: masked_block
  block_ready(0);
  my_turn();
  wgmma_fence();
  issue_abt<BLOCK_N>(sc, aq, q_half, k_tile(0), k_half);
  wgmma_commit();
  next_turn(0);
  wgmma_wait0();
  fence_operands(sc);
  keys_done(0);
  apply_mods(sc, (entry & 1) == 0, bits, keys, (entry >> 1) * BLOCK_N, r0, lane, scale,
             args);
  softmax(sc, m, l, corr, exp_scale);
  pack_fragments<BLOCK_N>(p, sc);
  for (int i = 1; i < n_blocks; ++i) {
    block_ready(i);
    values_ready(i - 1);
    my_turn();
    wgmma_fence();
    issue_abt<BLOCK_N>(sc, aq, q_half, k_tile(i), k_half);  // S(i) = q·kᵀ
    wgmma_commit();
    if constexpr (RESCALE_EARLY) {
      fence_operands(o);
      rescale(o, corr);
      fence_operands(o);
      wgmma_fence();
    }
    issue_pb<BLOCK_N>(o, p, v_tile(i - 1), BLOCK_N);  // o += P(i-1)·v
    wgmma_commit();
    next_turn(i);
    wgmma_wait1();
    fence_operands(sc);
    keys_done(i);
    apply_mods(sc, (entry & 1) == 0, bits, keys, (entry >> 1) * BLOCK_N, r0, lane, scale,
             args);
    softmax(sc, m, l, corr, exp_scale);
    wgmma_wait0();
    fence_operands(o);
    values_done(i - 1);
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

  store_masked_output(o, m, l, out, out_layout, lse, head, r0, tq, lane);
}
// ANCHOR_END: masked_4
