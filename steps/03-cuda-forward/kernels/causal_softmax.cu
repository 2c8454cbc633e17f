// The softmax of attention by hand on the GPU: one warp per row of the [B*H*T, T] table of
// scaled scores, in place. Row i of a head may see keys 0..i: the rest become exact zeros.
// Each row's natural log-sum-exp is stored too. Values are 16-bit (IS_BF16, a -D option: 1
// for bf16, 0 for f16); the arithmetic is f32.

typedef unsigned short u16;

__device__ __forceinline__ float to_f32(u16 x) {
    if constexpr (IS_BF16) {
        return __uint_as_float((unsigned int)x << 16);
    } else {
        float f;
        asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
        return f;
    }
}

__device__ __forceinline__ u16 from_f32(float x) {
    u16 h;
    if constexpr (IS_BF16)
        asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(x));
    else
        asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(x));
    return h;
}

// ANCHOR: causal_softmax
extern "C" __global__ void causal_softmax(
    u16* __restrict__ table,   // [rows, T] scaled scores in, probabilities out
    float* __restrict__ lse,   // [rows] natural log-sum-exp of each row
    int T,                     // tokens: row r is query r % T of its head
    long long rows             // batch * heads * T
) {
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int last = (int)(row % T);  // the last key this query may see
    u16* p = table + row * T;

    // pass 1: this lane's running maximum and sum over its keys (the online softmax, per
    // lane)
    float m = -__int_as_float(0x7f800000), l = 0.f;
    for (int j = lane; j <= last; j += 32) {
        float s = to_f32(p[j]);
        float m_new = fmaxf(m, s);
        l = l * __expf(m - m_new) + __expf(s - m_new);
        m = m_new;
    }
    // merge the 32 lanes' (m, l) pairs: l·e^(m - M) summed, M the largest m
    for (int offset = 16; offset > 0; offset /= 2) {
        float m_other = __shfl_xor_sync(0xffffffff, m, offset);
        float l_other = __shfl_xor_sync(0xffffffff, l, offset);
        float m_new = fmaxf(m, m_other);
        l = (m == m_new ? l : l * __expf(m - m_new)) +
            (m_other == m_new ? l_other : l_other * __expf(m_other - m_new));
        m = m_new;
    }
    // pass 2: probabilities, and zeros above the diagonal
    float inv = 1.f / l;
    for (int j = lane; j < T; j += 32)
        p[j] = j <= last ? from_f32(__expf(to_f32(p[j]) - m) * inv) : (u16)0;
    if (lane == 0) lse[row] = m + __logf(l);
}
// ANCHOR_END: causal_softmax
