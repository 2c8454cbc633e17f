// The ring's own kernels: merging one block's partial attention into a rank's accumulator
// (the online softmax's merge, chapter 2, with whole blocks as the "keys"), and rounding an
// f32 accumulator to 16 bits at the end (the output, and the backward's dq, dk and dv,
// which step 04's kernels add into f32 sums directly). Every block of the ring itself is a
// plain launch of step 03's and step 04's kernels.
// src/gpu.rs prepends step 03's kernels/tensor_cores.cuh (u16, to_f32, pack2, NEG_INF).
//
// Compile-time parameters, given to NVRTC as -D options:
//   HEAD_DIM  32, 64 or 128
//   IS_BF16   1 for bf16 values, 0 for f16

// values of a row each lane of a warp handles
#define PER_LANE (HEAD_DIM / 32)

// ANCHOR: ring_merge
// acc ⊕= part for one row a warp: two results of the online softmax over disjoint sets of
// keys, each normalised by its own sum, merge through their log-sum-exps:
//   lse = log(e^lse_acc + e^lse_part)          (logaddexp, from the larger one)
//   out = e^(lse_acc - lse)·out_acc + e^(lse_part - lse)·out_part
// A side with lse = -inf has seen no key and weighs 0. With `first`, the accumulator holds
// nothing yet and takes the part as it is.
extern "C" __global__ void ring_merge(
    float* __restrict__ acc_out,          // [rows, HEAD_DIM] the merged output so far, f32
    float* __restrict__ acc_lse,          // [rows] its natural log-sum-exp
    const u16* __restrict__ part_out,     // [rows, HEAD_DIM] one block's output, bf16/f16
    const float* __restrict__ part_lse,   // [rows] its log-sum-exp
    long long rows,                       // B*H*c: the rows of one chunk of queries
    int first                             // 1: the accumulator is empty (overwrite it)
) {
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    float* o = acc_out + row * HEAD_DIM;
    const u16* p = part_out + row * HEAD_DIM;
    const float lp = part_lse[row];
    if (first) {
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) o[lane + 32 * i] = to_f32(p[lane + 32 * i]);
        if (lane == 0) acc_lse[row] = lp;
        return;
    }
    const float la = acc_lse[row];
    const float m = fmaxf(la, lp);
    float wa = 0.f, wp = 0.f, lse = NEG_INF;
    if (m != NEG_INF) {
        const float ea = __expf(la - m), ep = __expf(lp - m);  // e^-inf = 0
        const float sum = ea + ep;
        lse = m + __logf(sum);
        wa = ea / sum;  // e^(la - lse)
        wp = ep / sum;
    }
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        const int d = lane + 32 * i;
        o[d] = wa * o[d] + wp * to_f32(p[d]);
    }
    // every lane has read the old lse before lane 0 writes the new one
    __syncwarp();
    if (lane == 0) acc_lse[row] = lse;
}
// ANCHOR_END: ring_merge

// The accumulator rounded to the inputs' 16 bits (to nearest, ties to even): the ring's
// output, and at the end of the backward its dq, dk and dv.
extern "C" __global__ void ring_round(
    const float* __restrict__ acc,  // [n] f32
    u16* __restrict__ out,          // [n] bf16/f16
    long long n                     // values, even (HEAD_DIM is)
) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; 2 * i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float2 x = ((const float2*)acc)[i];
        ((u32*)out)[i] = pack2(x.x, x.y);
    }
}
