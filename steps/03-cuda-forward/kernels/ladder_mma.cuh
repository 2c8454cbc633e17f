// What rungs 3 and 4 of the ladder share, between tensor_cores.cuh and the rung's own file
// (src/ladder.rs puts the three together): the tile's sizes, the running state of a warp's
// rows, the causal mask, chapter 2's update on the accumulators, and the end, o / l and
// the log-sum-exp. The two rungs differ only in how fragments reach the registers.

#define WARP_ROWS (M_TILES * 16)
#define BLOCK_M (WARPS * WARP_ROWS)
#define THREADS (WARPS * 32)
#define LN2 0.6931471805599453f

// The running state of a warp's rows, per thread: for each 16-row tile mt, rows g and g + 8
// (h = 0, 1) of the tile, with g = lane / 4 and t = lane % 4 (the mma fragment layout).
struct Rows {
    float m[M_TILES][2];               // the largest raw score seen so far in the row
    float l[M_TILES][2];  // this thread's part of the row's sum of 2^((s - m)·scale_log2)
    float o[M_TILES][HEAD_DIM / 8]
           [4];  // the unnormalised output, columns 8n + 2t and 8n + 2t + 1
};

// keys after a row (and so every key at or past T) get -inf; only blocks that reach past
// the warp's first row can hold such keys
__device__ __forceinline__ void mask(float (&s)[M_TILES][BLOCK_N / 8][4], int kv0, int row0,
                                     int g, int t) {
    if (kv0 + BLOCK_N - 1 <= row0) return;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int n = 0; n < BLOCK_N / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int key = kv0 + n * 8 + 2 * t + (e & 1);
                int row = row0 + mt * 16 + g + (e >> 1) * 8;
                if (key > row) s[mt][n][e] = NEG_INF;
            }
}

// chapter 2's update on the accumulators: new maxima (over the 4 threads of a quad, which
// hold a row between them), o and l rescaled, and s turned into p = 2^((s - m)·scale_log2)
// in place
__device__ __forceinline__ void online_softmax(float (&s)[M_TILES][BLOCK_N / 8][4],
                                               Rows& rows, float scale_log2) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = rows.m[mt][h];
#pragma unroll
            for (int n = 0; n < BLOCK_N / 8; ++n)
                mx = fmaxf(mx, fmaxf(s[mt][n][2 * h], s[mt][n][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            // a row still all -inf (only rows past T can be) keeps its zeros
            float m_scaled = mx == NEG_INF ? 0.f : mx * scale_log2;
            float correction = fast_exp2(rows.m[mt][h] * scale_log2 - m_scaled);
            rows.m[mt][h] = mx;
            rows.l[mt][h] *= correction;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n) {
                rows.o[mt][n][2 * h] *= correction;
                rows.o[mt][n][2 * h + 1] *= correction;
            }
#pragma unroll
            for (int n = 0; n < BLOCK_N / 8; ++n) {
                s[mt][n][2 * h] = fast_exp2(fmaf(s[mt][n][2 * h], scale_log2, -m_scaled));
                s[mt][n][2 * h + 1] =
                    fast_exp2(fmaf(s[mt][n][2 * h + 1], scale_log2, -m_scaled));
                rows.l[mt][h] += s[mt][n][2 * h] + s[mt][n][2 * h + 1];
            }
        }
}

// o / l, and the log-sum-exp, for the rows inside the sequence (as flash_forward.cu); `out`
// and `lse` point at this head's rows
__device__ __forceinline__ void store_rows(const Rows& rows, u16* out, float* lse, int row0,
                                           int T, int g, int t, float scale_log2) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = rows.l[mt][h];
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
            int row = row0 + mt * 16 + g + h * 8;
            if (row < T) {
                float inv = 1.f / sum;
                u16* dst = out + (long long)row * HEAD_DIM + 2 * t;
#pragma unroll
                for (int n = 0; n < HEAD_DIM / 8; ++n)
                    *(u32*)(dst + n * 8) =
                        pack2(rows.o[mt][n][2 * h] * inv, rows.o[mt][n][2 * h + 1] * inv);
                if (t == 0) lse[row] = (rows.m[mt][h] * scale_log2 + __log2f(sum)) * LN2;
            }
        }
}
