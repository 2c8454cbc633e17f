// The block mask, computed on the GPU once per mask and shape (FlexAttention's
// create_block_mask), after the mask's source. Two kernels: `classify` evaluates mask_mod
// on every score of every tile of 64 queries × 128 keys and says whether the tile is
// empty, partial or full; `block_lists` turns the classes into the lists the kernels walk
// (masked.cuh's BlockList): the forward's, a block of 64·WGS queries a row, and the
// backward's, a block of 128 keys a row.
//
// Compiled with WGS (the forward's warpgroups: its query blocks are WGS tiles tall).

typedef unsigned long long u64;

#define TILE_Q 64
#define TILE_K 128

// A mask row's sequence and head from its number (b · row_b + h · row_h): row_h is 1 only
// when every head has its row, and row_b is then the heads
__device__ __forceinline__ void row_place(int row, int row_b, int row_h, int& b, int& h) {
  b = row_b ? row / row_b : 0;
  h = row_h ? row % row_b : 0;
}

// ANCHOR: classify
// One thread block a tile (x: key blocks, y: query tiles, z: mask rows): 0 empty, 1
// partial, 2 full, into classes[row][query tile][key block]; and the tile's visible scores
// added to `visible` (the scores the kernels compute, for the benchmark's FLOP count).
// Rows past tq do not count; keys past tk are never visible, and a tile that reaches past
// tk is never full (its last keys must be masked)
extern "C" __global__ void classify(unsigned char* __restrict__ classes,
                                    unsigned long long* __restrict__ visible,
                                    const int* __restrict__ mask_data, int tq, int tk,
                                    int row_b, int row_h) {
  const int kb = blockIdx.x, qt = blockIdx.y, row = blockIdx.z;
  int b, h;
  row_place(row, row_b, row_h, b, h);
  const int q_offset = tk - tq;
  int seen = 0;
  bool all = true;
  for (int i = threadIdx.x; i < TILE_Q * TILE_K; i += blockDim.x) {
    const int r = qt * TILE_Q + i / TILE_K, key = kb * TILE_K + i % TILE_K;
    if (r >= tq) continue;
    const bool v = key < tk && mask_mod(b, h, r + q_offset, key, mask_data);
    seen += v;
    all = all && v;
  }
  const int any_seen = __syncthreads_or(seen > 0);
  const int all_seen = __syncthreads_and(all);
  // the tile's count, summed over the block's warps
  for (int offset = 16; offset > 0; offset /= 2)
    seen += __shfl_xor_sync(0xffffffff, seen, offset);
  if (threadIdx.x % 32 == 0 && seen > 0) atomicAdd(visible, (unsigned long long)seen);
  if (threadIdx.x == 0) {
    const int q_tiles = gridDim.y, k_blocks = gridDim.x;
    classes[((long long)row * q_tiles + qt) * k_blocks + kb] =
        !any_seen ? 0 : (all_seen && (kb + 1) * TILE_K <= tk ? 2 : 1);
  }
}
// ANCHOR_END: classify

// ANCHOR: block_lists
// One thread a (mask row, block): with `forward`, a block of WGS query tiles (empty where
// all its tiles are, full where all are full) and the key blocks it visits; without, a
// block of keys and the query tiles that see it. Each entry is the block's number · 2, + 1
// when full
extern "C" __global__ void block_lists(const unsigned char* __restrict__ classes,
                                       int* __restrict__ count, int* __restrict__ index,
                                       int rows, int q_tiles, int k_blocks, int forward) {
  const int blocks = forward ? (q_tiles + WGS - 1) / WGS : k_blocks;
  const int others = forward ? k_blocks : q_tiles;
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= (long long)rows * blocks) return;
  const int row = (int)(i / blocks), blk = (int)(i % blocks);
  const unsigned char* tiles = classes + (long long)row * q_tiles * k_blocks;
  int* out = index + i * others;
  int n = 0;
  for (int o = 0; o < others; ++o) {
    int c;
    if (forward) {
      bool any = false, all = true;
      for (int w = 0; w < WGS && blk * WGS + w < q_tiles; ++w) {
        const unsigned char t = tiles[(blk * WGS + w) * k_blocks + o];
        any = any || t != 0;
        all = all && t == 2;
      }
      c = !any ? 0 : (all ? 2 : 1);
    } else {
      c = tiles[o * k_blocks + blk];
    }
    if (c != 0) out[n++] = 2 * o + (c == 2);
  }
  count[i] = n;
}
// ANCHOR_END: block_lists
