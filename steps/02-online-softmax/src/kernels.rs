//! The micro-kernels of the fast version: the two matrix products of one block pair and the
//! softmax between them, each in the instruction sets of two architectures (AVX-512F and
//! AVX2 with FMA on x86-64, NEON on aarch64) and in plain Rust, chosen at run time.
//!
//! The SIMD lanes run along the *queries* of a block. The block's queries are stored
//! transposed once per block, and the scores come out transposed too, one row per key:
//!
//! - `qt`: `d × br`, the block's queries transposed (zero past the sequence's end);
//! - `k`, `v`: `keys × d`, rows of the input as they are (no copy, no transpose);
//! - `st`: `bc × br` scores `s_ij = (q_i·k_j)·scale` stored at `[j][i]`, then
//!   probabilities;
//! - `o`: `br × dp` running (unnormalised) outputs, `dp` = `d` rounded up to 16;
//! - `m`, `l`, `alpha`: `br` running maxima, running sums and this block's correction
//!   factors.
//!
//! With a query per lane, the softmax's reductions over keys are element-wise maxima and
//! sums across the rows of `st`, never a shuffle within a register. `br` is a multiple of
//! [`LANES`].
//!
//! All `unsafe` of the crate is in this module. Its two kinds: calling a
//! `#[target_feature]` function, sound only after the CPU was seen to have the feature,
//! which [`Kernels::new`] checks once and a [`Kernels`] value stands for; and raw-pointer
//! loads and stores inside the tiles, whose bounds each safe entry point asserts before the
//! first one.

// The tiles index their register arrays by row and column on purpose: the loops mirror the
// tile's shape and unroll completely, with each element in its own register.
#![allow(clippy::needless_range_loop)]

use std::f32::consts::LOG2_E;

use flash_core::AttnError;

/// Floats in one AVX-512 register: a query block is a multiple of it, and so is `dp`.
pub const LANES: usize = 16;

/// Independent accumulators of the peak measurement: more than a core's fused multiply-add
/// units × their latency (2 × 4 on the AMD and Intel cores of the last years), so the chains
/// never wait on each other.
pub const PEAK_CHAINS: usize = 12;

/// Which instructions the micro-kernels use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust, no intrinsics: always available, and the reference for the two others.
    Scalar,
    /// 256-bit AVX2 with fused multiply-add.
    Avx2,
    /// 512-bit AVX-512F.
    Avx512,
    /// 128-bit NEON (Advanced SIMD) of aarch64, with fused multiply-add. Checked against
    /// the scalar path under an emulator (qemu); no speed of it has been measured here.
    Neon,
}

impl Isa {
    /// The widest instruction set this CPU has.
    pub fn detect() -> Isa {
        [Isa::Avx512, Isa::Avx2, Isa::Neon]
            .into_iter()
            .find(|isa| isa.is_available())
            .unwrap_or(Isa::Scalar)
    }

    /// Whether this CPU can run this instruction set.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            _ => false,
        }
    }
}

/// The sizes of one block pair, shared by the three kernels.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    /// Queries in the block (a multiple of [`LANES`]).
    pub br: usize,
    /// Rows of `st` (keys per block).
    pub bc: usize,
    /// The head dim.
    pub d: usize,
    /// The head dim rounded up to a multiple of [`LANES`]: the row length of `o`.
    pub dp: usize,
}

impl Dims {
    fn check(&self, keys: usize) {
        assert!(
            self.br.is_multiple_of(LANES)
                && self.dp == self.d.next_multiple_of(LANES)
                && keys <= self.bc,
            "{self:?} with {keys} keys: br must be a multiple of {LANES}, dp = d rounded up to \
             {LANES}, keys ≤ bc"
        );
    }
}

/// The kernels of one instruction set, known to be available: holding a `Kernels` is the
/// proof the `unsafe` calls below rely on.
#[derive(Clone, Copy, Debug)]
pub struct Kernels {
    isa: Isa,
}

impl Kernels {
    /// The kernels of `isa`, or an error when this CPU does not have it.
    pub fn new(isa: Isa) -> Result<Kernels, AttnError> {
        if isa.is_available() {
            Ok(Kernels { isa })
        } else {
            Err(AttnError::Unsupported {
                what: format!(
                    "this CPU has no {isa:?} instructions; available here: {:?} (Isa::detect())",
                    Isa::detect()
                ),
            })
        }
    }

    pub fn isa(self) -> Isa {
        self.isa
    }

    /// Runs `iters` rounds of [`PEAK_CHAINS`] independent vector fused multiply-adds, the
    /// most one core can issue, and returns the floating-point operations done (a
    /// multiply-add is two) with a value that depends on every one of them, so none is
    /// optimised away. [`crate::peak`] times it on every core.
    pub fn fma_chains(self, iters: usize) -> (f64, f32) {
        let lanes = match self.isa {
            Isa::Scalar => 1,
            Isa::Avx2 => 8,
            Isa::Avx512 => LANES,
            Isa::Neon => 4,
        };
        let sum = match self.isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a `Kernels` of this ISA exists only where the CPU has it
            Isa::Avx512 => unsafe { avx512::fma_chains(iters) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above
            Isa::Avx2 => unsafe { avx2::fma_chains(iters) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: as above
            Isa::Neon => unsafe { neon::fma_chains(iters) },
            _ => scalar::fma_chains(iters),
        };
        let flops = 2.0 * (lanes * PEAK_CHAINS) as f64 * iters as f64;
        (flops, sum)
    }

    // ANCHOR: scores_dispatch
    /// `st[j][i] = (Σ_d k[j][d]·qt[d][i])·scale` for the first `keys` rows of `st`: one
    /// block of scores, transposed.
    ///
    /// The sum runs over d in order, one fused multiply-add at a time, and is multiplied by
    /// `scale` once at the end: the same rounding as `ndarray`'s matrix product, so on
    /// x86-64 with AVX2 and FMA or AVX-512 these are step 01's scores bit for bit (head
    /// dims up to 256, where `matrixmultiply` sums in one piece). The backward of step 04
    /// rebuilds the probabilities from its own scores and the log-sum-exp made from these:
    /// the two must agree to the last bit, or every probability of a row is off by the
    /// difference, which grows with the scores (chapter 4).
    pub fn scores(
        self,
        qt: &[f32],
        k: &[f32],
        st: &mut [f32],
        keys: usize,
        scale: f32,
        n: Dims,
    ) {
        n.check(keys);
        assert!(qt.len() >= n.d * n.br && k.len() >= keys * n.d && st.len() >= n.bc * n.br);
        match self.isa {
            // SAFETY: `self` exists only if the CPU has AVX-512F (`Kernels::new`); the
            // asserts above bound every pointer the tiles form (keys < `keys`, d < n.d,
            // queries < br).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::scores(qt, k, st, keys, scale, n) },
            // SAFETY: as above, for AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::scores(qt, k, st, keys, scale, n) },
            // SAFETY: as above, for NEON.
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => unsafe { neon::scores(qt, k, st, keys, scale, n) },
            _ => scalar::scores(qt, k, st, 0, keys, scale, n),
        }
    }
    // ANCHOR_END: scores_dispatch

    /// The online softmax of one block, in place on `st`: per query i, `m_new = max(m_i,
    /// max_j st[j][i])`, `st[j][i] = e^(st[j][i] − m_new)`, `alpha_i = e^(m_i − m_new)`,
    /// `l_i = alpha_i·l_i + Σ_j st[j][i]`, every `e^x` as `2^(x·log2 e)`.
    ///
    /// With `FOLDED` the multiply by `log2 e` is folded into the subtraction of the
    /// maximum, one fused multiply-add per score: `2^(s·log2 e − M)` with `M = m_new·log2
    /// e` rounded to `f32`. Every value of a row then carries the same factor
    /// `2^(m_new·log2 e − M)`, which cancels in the output and which [`log2e_rounding`]
    /// gives back for the log-sum-exp. Without, `2^((s − m_new)·log2 e)`: one multiply more
    /// per score. `fast_exp = false` takes the standard library's `exp2` one value at a
    /// time, to measure what the polynomial saves.
    #[allow(clippy::too_many_arguments)]
    pub fn softmax<const FOLDED: bool>(
        self,
        st: &mut [f32],
        m: &mut [f32],
        l: &mut [f32],
        alpha: &mut [f32],
        fast_exp: bool,
        n: Dims,
    ) {
        n.check(0);
        assert!(st.len() >= n.bc * n.br && m.len() >= n.br && l.len() >= n.br);
        assert!(alpha.len() >= n.br);
        match self.isa {
            // SAFETY: `self` proves AVX-512F; the asserts above bound every pointer (rows <
            // bc, queries < br).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if fast_exp => unsafe {
                avx512::softmax::<FOLDED>(st, m, l, alpha, n)
            },
            // SAFETY: as above, for AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 if fast_exp => unsafe { avx2::softmax::<FOLDED>(st, m, l, alpha, n) },
            // SAFETY: as above, for NEON.
            #[cfg(target_arch = "aarch64")]
            Isa::Neon if fast_exp => unsafe { neon::softmax::<FOLDED>(st, m, l, alpha, n) },
            _ => scalar::softmax::<FOLDED>(st, m, l, alpha, n),
        }
    }

    /// `o[i] = alpha_i·o[i] + Σ_{j < keys} st[j][i]·v[j]`: rescale the running outputs and
    /// add one block of values.
    pub fn pv(
        self,
        pt: &[f32],
        v: &[f32],
        o: &mut [f32],
        alpha: &[f32],
        keys: usize,
        n: Dims,
    ) {
        n.check(keys);
        assert!(pt.len() >= n.bc * n.br && v.len() >= keys * n.d && o.len() >= n.br * n.dp);
        assert!(alpha.len() >= n.br);
        match self.isa {
            // SAFETY: `self` proves AVX-512F; the asserts above bound every pointer (keys <
            // `keys`, queries < br, dims < dp in o and, masked, < d in v).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::pv(pt, v, o, alpha, keys, n) },
            // SAFETY: as above, for AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::pv(pt, v, o, alpha, keys, n) },
            // SAFETY: as above, for NEON (v's last, partial register is copied, not read
            // past d).
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => unsafe { neon::pv(pt, v, o, alpha, keys, n) },
            _ => scalar::pv(pt, v, o, alpha, keys, n),
        }
    }

    /// `x = 2^((x − shift)·scale)` for every element, with the softmax's polynomial: for
    /// arguments at most 0 (probabilities), exactly 0 below about −126.5. Step 04 rebuilds
    /// its probabilities with it, `e^(s − lse)`: the subtraction comes first, so two scores
    /// close to the log-sum-exp cancel exactly (Sterbenz) and the error is that of `x −
    /// shift`, not that of `x` or `shift`.
    pub fn exp2_shifted(self, x: &mut [f32], shift: f32, scale: f32) {
        match self.isa {
            // SAFETY: `self` proves AVX-512F; the loads and stores stay inside `x`.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::exp2_shifted(x, shift, scale) },
            // SAFETY: as above, for AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::exp2_shifted(x, shift, scale) },
            // SAFETY: as above, for NEON.
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => unsafe { neon::exp2_shifted(x, shift, scale) },
            _ => scalar::exp2_shifted(x, shift, scale),
        }
    }
}

/// What the folded softmax leaves in a row's sum: `e = m·log2 e − M` with `M = m·log2 e`
/// rounded to `f32`, exactly (one fused multiply-add gives the rounding error of a
/// product). The sum is `2^e` times the true one, so `ln ℓ = (log2 ℓ_folded − e)·ln 2`.
pub fn log2e_rounding(m: f32) -> f32 {
    m.mul_add(LOG2_E, -(m * LOG2_E))
}

// ANCHOR: exp2_poly
/// `2^f` for `f ∈ [−½, ½]`: the minimax polynomial of Cephes' `exp2f` (Moshier 1992),
/// relative error about 2·10⁻⁷, highest degree first. `2^x = 2^n · 2^f` with `n =
/// round(x)`, `f = x − n`, and `2^n` written straight into the exponent bits.
const EXP2_POLY: [f32; 6] = [
    1.535_336_2e-4,
    1.339_887_4e-3,
    9.618_438e-3,
    5.550_332_5e-2,
    2.402_264_8e-1,
    6.931_472e-1,
];
/// `x` is clamped here first; `n = −127` makes the exponent bits those of 0.0, so a masked
/// score, `−∞`, gives a probability of exactly 0, as `e^(−∞)` does (and so does everything
/// below about `2^−126.5`, under the smallest normal `f32`).
const EXP2_MIN: f32 = -127.0;
// ANCHOR_END: exp2_poly

/// The portable path: always correct, and the reference the SIMD paths are tested against.
mod scalar {
    use super::{Dims, PEAK_CHAINS};
    use std::f32::consts::LOG2_E;

    /// The peak loop one float at a time (the compiler may vectorise it; it is only the
    /// fallback's number).
    pub fn fma_chains(iters: usize) -> f32 {
        let mut acc = [0.0f32; PEAK_CHAINS];
        let (a, b) = (
            std::hint::black_box(0.999_999f32),
            std::hint::black_box(1e-7f32),
        );
        for _ in 0..iters {
            for x in &mut acc {
                *x = x.mul_add(a, b);
            }
        }
        acc.iter().sum()
    }

    /// `x = 2^((x − shift)·scale)`, one value at a time with the standard library's `exp2`.
    pub fn exp2_shifted(x: &mut [f32], shift: f32, scale: f32) {
        for x in x {
            *x = ((*x - shift) * scale).exp2();
        }
    }

    /// Rows `from..keys` of the transposed scores. Fused multiply-adds where
    /// `matrixmultiply`'s kernels for this target fuse them (aarch64), separate ones where
    /// they do not (an x86 CPU without AVX2 and FMA, the only one `Isa::detect` chooses
    /// this path on).
    pub fn scores(
        qt: &[f32],
        k: &[f32],
        st: &mut [f32],
        from: usize,
        keys: usize,
        scale: f32,
        n: Dims,
    ) {
        for j in from..keys {
            let s_j = &mut st[j * n.br..(j + 1) * n.br];
            s_j.fill(0.0);
            for d in 0..n.d {
                let k_jd = k[j * n.d + d];
                for (s, &q) in s_j.iter_mut().zip(&qt[d * n.br..(d + 1) * n.br]) {
                    *s = if cfg!(target_arch = "aarch64") {
                        k_jd.mul_add(q, *s)
                    } else {
                        *s + k_jd * q
                    };
                }
            }
            s_j.iter_mut().for_each(|s| *s *= scale);
        }
    }

    pub fn softmax<const FOLDED: bool>(
        st: &mut [f32],
        m: &mut [f32],
        l: &mut [f32],
        alpha: &mut [f32],
        n: Dims,
    ) {
        let mut m_new = m[..n.br].to_vec();
        for s_j in st[..n.bc * n.br].chunks_exact(n.br) {
            for (m, &s) in m_new.iter_mut().zip(s_j) {
                *m = m.max(s);
            }
        }
        // folded: 2^(s·log2 e − M) = 2^((s − m)·log2 e + e), e = m·log2 e − M exactly,
        // which gives the SIMD paths' values without a fused multiply-add per score
        let e: Vec<f32> = m_new.iter().map(|&m| super::log2e_rounding(m)).collect();
        for i in 0..n.br {
            alpha[i] = if FOLDED {
                (m[i] * LOG2_E - m_new[i] * LOG2_E).exp2()
            } else {
                ((m[i] - m_new[i]) * LOG2_E).exp2()
            };
            l[i] *= alpha[i];
        }
        for s_j in st[..n.bc * n.br].chunks_exact_mut(n.br) {
            for i in 0..n.br {
                let x = (s_j[i] - m_new[i]) * LOG2_E;
                s_j[i] = if FOLDED { x + e[i] } else { x }.exp2();
                l[i] += s_j[i];
            }
        }
        m[..n.br].copy_from_slice(&m_new);
    }

    pub fn pv(pt: &[f32], v: &[f32], o: &mut [f32], alpha: &[f32], keys: usize, n: Dims) {
        for i in 0..n.br {
            let o_i = &mut o[i * n.dp..i * n.dp + n.d];
            o_i.iter_mut().for_each(|o| *o *= alpha[i]);
            for j in 0..keys {
                let p_ij = pt[j * n.br + i];
                for (o, &v) in o_i.iter_mut().zip(&v[j * n.d..(j + 1) * n.d]) {
                    *o += p_ij * v;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Dims, EXP2_MIN, EXP2_POLY, LANES, PEAK_CHAINS, scalar};
    use std::arch::x86_64::*;

    /// SAFETY (caller): the CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_chains(iters: usize) -> f32 {
        let (a, b) = (
            _mm512_set1_ps(std::hint::black_box(0.999_999)),
            _mm512_set1_ps(std::hint::black_box(1e-7)),
        );
        let mut acc = [_mm512_setzero_ps(); PEAK_CHAINS];
        for _ in 0..iters {
            for x in &mut acc {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
    }

    /// Keys per scores tile, queries per output tile.
    const R: usize = 8;

    /// `2^x` for 16 lanes, `x ≤ 0`; exactly 0 for `x < −126.5` (−∞ included).
    #[target_feature(enable = "avx512f")]
    fn exp2(x: __m512) -> __m512 {
        let x = _mm512_max_ps(x, _mm512_set1_ps(EXP2_MIN));
        // n = round(x) (0x08: to nearest, exceptions suppressed), f = x − n ∈ [−½, ½]
        let n = _mm512_roundscale_ps::<0x08>(x);
        let f = _mm512_sub_ps(x, n);
        let mut p = _mm512_set1_ps(EXP2_POLY[0]);
        for &c in &EXP2_POLY[1..] {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
        }
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0));
        let n = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
        _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32::<23>(n)))
    }

    /// SAFETY (caller): the CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp2_shifted(x: &mut [f32], shift: f32, scale: f32) {
        let (a, b) = (_mm512_set1_ps(scale), _mm512_set1_ps(shift));
        let mut chunks = x.chunks_exact_mut(LANES);
        for c in &mut chunks {
            // SAFETY: `c` holds LANES floats
            unsafe {
                let v = _mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), b);
                _mm512_storeu_ps(c.as_mut_ptr(), exp2(_mm512_mul_ps(v, a)));
            }
        }
        scalar::exp2_shifted(chunks.into_remainder(), shift, scale);
    }

    // ANCHOR: scores_tile
    /// One register tile of transposed scores: 8 keys × `16·NV` queries, `8·NV`
    /// accumulators. Per dimension d: `NV` loads of `qt`'s row d, 8 broadcasts of k[j][d],
    /// `8·NV` fused multiply-adds; at the end one multiply by the scale per score.
    ///
    /// SAFETY (caller): `qt` points at column c0 of a `d × br` block with `16·NV` columns
    /// left; `k` at row j0 of a `· × d` block with 8 rows left; `st` at (j0, c0) of a `· ×
    /// br` block.
    #[target_feature(enable = "avx512f")]
    unsafe fn scores_tile<const NV: usize>(
        qt: *const f32,
        k: *const f32,
        st: *mut f32,
        scale: __m512,
        n: Dims,
    ) {
        let mut acc = [[_mm512_setzero_ps(); NV]; R];
        for d in 0..n.d {
            let mut q = [_mm512_setzero_ps(); NV];
            for c in 0..NV {
                // SAFETY: d < n.d rows, 16·(c+1) ≤ 16·NV columns left
                q[c] = unsafe { _mm512_loadu_ps(qt.add(d * n.br + LANES * c)) };
            }
            for j in 0..R {
                // SAFETY: j < 8 rows left, d < n.d
                let k_jd = _mm512_set1_ps(unsafe { *k.add(j * n.d + d) });
                for c in 0..NV {
                    acc[j][c] = _mm512_fmadd_ps(k_jd, q[c], acc[j][c]);
                }
            }
        }
        for j in 0..R {
            for c in 0..NV {
                let s = _mm512_mul_ps(acc[j][c], scale);
                // SAFETY: j < 8 rows, 16·(c+1) ≤ 16·NV columns left
                unsafe { _mm512_storeu_ps(st.add(j * n.br + LANES * c), s) };
            }
        }
    }
    // ANCHOR_END: scores_tile

    #[target_feature(enable = "avx512f")]
    pub unsafe fn scores(
        qt: &[f32],
        k: &[f32],
        st: &mut [f32],
        keys: usize,
        scale: f32,
        n: Dims,
    ) {
        let full = keys - keys % R;
        let scale = _mm512_set1_ps(scale);
        for j0 in (0..full).step_by(R) {
            let mut c0 = 0;
            // SAFETY (both calls): j0 + 8 ≤ keys rows of k and ≤ bc rows of st, c0 + 16·NV
            // ≤ br columns; the slices hold d·br, keys·d and bc·br values (asserted by the
            // caller)
            unsafe {
                let (k, st) = (k.as_ptr().add(j0 * n.d), st.as_mut_ptr().add(j0 * n.br));
                while c0 + 2 * LANES <= n.br {
                    scores_tile::<2>(qt.as_ptr().add(c0), k, st.add(c0), scale, n);
                    c0 += 2 * LANES;
                }
                if c0 < n.br {
                    scores_tile::<1>(qt.as_ptr().add(c0), k, st.add(c0), scale, n);
                }
            }
        }
        // the last keys % 8 keys, only ever in a sequence's last block: one key at a time,
        // with the same fused multiply-adds as the tiles
        for j in full..keys {
            for c0 in (0..n.br).step_by(LANES) {
                let mut acc = _mm512_setzero_ps();
                for d in 0..n.d {
                    // SAFETY: j < keys rows of k, d < n.d, c0 + 16 ≤ br columns of qt's row
                    // d
                    unsafe {
                        let q = _mm512_loadu_ps(qt.as_ptr().add(d * n.br + c0));
                        acc = _mm512_fmadd_ps(_mm512_set1_ps(k[j * n.d + d]), q, acc);
                    }
                }
                // SAFETY: j < bc rows of st, c0 + 16 ≤ br columns
                unsafe {
                    _mm512_storeu_ps(
                        st.as_mut_ptr().add(j * n.br + c0),
                        _mm512_mul_ps(acc, scale),
                    )
                };
            }
        }
    }

    // ANCHOR: softmax_simd
    /// The online softmax of one block, 16 queries at a time: every reduction over keys is
    /// an element-wise max or add down the rows of `st`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn softmax<const FOLDED: bool>(
        st: &mut [f32],
        m: &mut [f32],
        l: &mut [f32],
        alpha: &mut [f32],
        n: Dims,
    ) {
        // e^x = 2^(x·log2 e)
        let log2e = _mm512_set1_ps(std::f32::consts::LOG2_E);
        for c in (0..n.br).step_by(LANES) {
            // SAFETY: c + 16 ≤ br ≤ the lengths of m, l, alpha, and every row j < bc of st
            // has br values (asserted by the caller)
            unsafe {
                let st = st.as_mut_ptr().add(c);
                let m_old = _mm512_loadu_ps(m.as_ptr().add(c));
                let mut m_new = m_old;
                for j in 0..n.bc {
                    m_new = _mm512_max_ps(m_new, _mm512_loadu_ps(st.add(j * n.br)));
                }
                // m_new is finite: key 0 (block 0) is seen by every query. Folded, the
                // maxima go to base 2 rounded, M = m·log2 e, and so does everything summed
                let (mm_old, mm_new) =
                    (_mm512_mul_ps(m_old, log2e), _mm512_mul_ps(m_new, log2e));
                let x = if FOLDED {
                    _mm512_sub_ps(mm_old, mm_new)
                } else {
                    _mm512_mul_ps(_mm512_sub_ps(m_old, m_new), log2e)
                };
                let a = exp2(x); // m_old = −∞ on the first block: exactly 0
                let mut sum = _mm512_setzero_ps();
                for j in 0..n.bc {
                    let s = _mm512_loadu_ps(st.add(j * n.br));
                    let x = if FOLDED {
                        // s·log2 e − M, rounded once
                        _mm512_fmsub_ps(s, log2e, mm_new)
                    } else {
                        _mm512_mul_ps(_mm512_sub_ps(s, m_new), log2e)
                    };
                    let p = exp2(x);
                    _mm512_storeu_ps(st.add(j * n.br), p);
                    sum = _mm512_add_ps(sum, p);
                }
                let l_new = _mm512_fmadd_ps(a, _mm512_loadu_ps(l.as_ptr().add(c)), sum);
                _mm512_storeu_ps(l.as_mut_ptr().add(c), l_new);
                _mm512_storeu_ps(m.as_mut_ptr().add(c), m_new);
                _mm512_storeu_ps(alpha.as_mut_ptr().add(c), a);
            }
        }
    }
    // ANCHOR_END: softmax_simd

    // ANCHOR: pv_tile
    /// One register tile of the output: 8 queries × `16·NV` dims of o, loaded once and
    /// rescaled by alpha, then per key j: `NV` (masked) loads of v's row j, 8 broadcasts of
    /// p[j][i], `8·NV` fused multiply-adds; stored once. `mask[c]` selects the dims < d of
    /// vector c.
    ///
    /// SAFETY (caller): `pt` points at column i0 of a `· × br` block with `keys` rows and 8
    /// columns left, `alpha` at alpha[i0]; `v` at column c0 of a `keys × d` block, whose
    /// columns the masks keep below d; `o` at (i0, c0) of a `· × dp` block, `16·NV` columns
    /// left.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv_tile<const NV: usize>(
        pt: *const f32,
        v: *const f32,
        o: *mut f32,
        alpha: *const f32,
        mask: [__mmask16; NV],
        keys: usize,
        n: Dims,
    ) {
        let mut acc = [[_mm512_setzero_ps(); NV]; R];
        for i in 0..R {
            // SAFETY: i < 8 queries left
            let a = _mm512_set1_ps(unsafe { *alpha.add(i) });
            for c in 0..NV {
                // SAFETY: i < 8 rows, 16·(c+1) ≤ 16·NV columns of o left
                acc[i][c] = _mm512_mul_ps(a, unsafe {
                    _mm512_loadu_ps(o.add(i * n.dp + LANES * c))
                });
            }
        }
        for j in 0..keys {
            let mut vj = [_mm512_setzero_ps(); NV];
            for c in 0..NV {
                // SAFETY: j < keys rows of v; lanes at or past d are masked off, not read
                vj[c] =
                    unsafe { _mm512_maskz_loadu_ps(mask[c], v.add(j * n.d + LANES * c)) };
            }
            for i in 0..R {
                // SAFETY: j < keys rows, i < 8 columns left
                let p_ij = _mm512_set1_ps(unsafe { *pt.add(j * n.br + i) });
                for c in 0..NV {
                    acc[i][c] = _mm512_fmadd_ps(p_ij, vj[c], acc[i][c]);
                }
            }
        }
        for i in 0..R {
            for c in 0..NV {
                // SAFETY: as for the loads of o
                unsafe { _mm512_storeu_ps(o.add(i * n.dp + LANES * c), acc[i][c]) };
            }
        }
    }
    // ANCHOR_END: pv_tile

    #[target_feature(enable = "avx512f")]
    pub unsafe fn pv(
        pt: &[f32],
        v: &[f32],
        o: &mut [f32],
        alpha: &[f32],
        keys: usize,
        n: Dims,
    ) {
        // lanes of the dim vector starting at c0 that are real dims (< d)
        let mask = |c0: usize| -> __mmask16 {
            let left = n.d.saturating_sub(c0).min(LANES);
            ((1u32 << left) - 1) as __mmask16
        };
        for i0 in (0..n.br).step_by(R) {
            let mut c0 = 0;
            // SAFETY (both calls): i0 + 8 ≤ br, c0 + 16·NV ≤ dp; masks keep v's reads below
            // d; the slices hold bc·br, keys·d, br·dp and br values (asserted by the
            // caller)
            unsafe {
                let (pt, a) = (pt.as_ptr().add(i0), alpha.as_ptr().add(i0));
                let o = o.as_mut_ptr().add(i0 * n.dp);
                while c0 + 2 * LANES <= n.dp {
                    let masks = [mask(c0), mask(c0 + LANES)];
                    pv_tile::<2>(pt, v.as_ptr().add(c0), o.add(c0), a, masks, keys, n);
                    c0 += 2 * LANES;
                }
                if c0 < n.dp {
                    pv_tile::<1>(pt, v.as_ptr().add(c0), o.add(c0), a, [mask(c0)], keys, n);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Dims, EXP2_MIN, EXP2_POLY, PEAK_CHAINS, scalar};
    use std::arch::x86_64::*;

    /// SAFETY (caller): the CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_chains(iters: usize) -> f32 {
        let (a, b) = (
            _mm256_set1_ps(std::hint::black_box(0.999_999)),
            _mm256_set1_ps(std::hint::black_box(1e-7)),
        );
        let mut acc = [_mm256_setzero_ps(); PEAK_CHAINS];
        for _ in 0..iters {
            for x in &mut acc {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        let mut lanes = [0.0f32; 8];
        let mut sum = 0.0;
        for x in acc {
            // SAFETY: `lanes` holds the register's 8 floats
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), x) };
            sum += lanes.iter().sum::<f32>();
        }
        sum
    }

    /// Floats in one AVX2 register.
    const W: usize = 8;
    /// Keys per scores tile, queries per output tile: 4 × 2 registers, 8 of the 16.
    const R: usize = 4;

    /// `2^x` for 8 lanes, `x ≤ 0`; exactly 0 for `x < −126.5` (−∞ included).
    #[target_feature(enable = "avx2,fma")]
    fn exp2(x: __m256) -> __m256 {
        let x = _mm256_max_ps(x, _mm256_set1_ps(EXP2_MIN));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let f = _mm256_sub_ps(x, n);
        let mut p = _mm256_set1_ps(EXP2_POLY[0]);
        for &c in &EXP2_POLY[1..] {
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
        }
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0));
        let n = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
        _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(n)))
    }

    /// SAFETY (caller): the CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp2_shifted(x: &mut [f32], shift: f32, scale: f32) {
        let (a, b) = (_mm256_set1_ps(scale), _mm256_set1_ps(shift));
        let mut chunks = x.chunks_exact_mut(W);
        for c in &mut chunks {
            // SAFETY: `c` holds W floats
            unsafe {
                let v = _mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), b);
                _mm256_storeu_ps(c.as_mut_ptr(), exp2(_mm256_mul_ps(v, a)));
            }
        }
        scalar::exp2_shifted(chunks.into_remainder(), shift, scale);
    }

    /// 4 keys × 16 queries. SAFETY (caller): as `avx512::scores_tile` with 4 rows, 16
    /// columns.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn scores_tile(
        qt: *const f32,
        k: *const f32,
        st: *mut f32,
        scale: __m256,
        n: Dims,
    ) {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for d in 0..n.d {
            // SAFETY: d < n.d rows, 16 columns left
            let q = unsafe {
                [
                    _mm256_loadu_ps(qt.add(d * n.br)),
                    _mm256_loadu_ps(qt.add(d * n.br + W)),
                ]
            };
            for j in 0..R {
                // SAFETY: j < 4 rows left, d < n.d
                let k_jd = _mm256_set1_ps(unsafe { *k.add(j * n.d + d) });
                for c in 0..2 {
                    acc[j][c] = _mm256_fmadd_ps(k_jd, q[c], acc[j][c]);
                }
            }
        }
        for j in 0..R {
            for c in 0..2 {
                let s = _mm256_mul_ps(acc[j][c], scale);
                // SAFETY: j < 4 rows, 16 columns left
                unsafe { _mm256_storeu_ps(st.add(j * n.br + W * c), s) };
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scores(
        qt: &[f32],
        k: &[f32],
        st: &mut [f32],
        keys: usize,
        scale: f32,
        n: Dims,
    ) {
        let full = keys - keys % R;
        let scale = _mm256_set1_ps(scale);
        for j0 in (0..full).step_by(R) {
            for c0 in (0..n.br).step_by(2 * W) {
                // SAFETY: j0 + 4 ≤ keys ≤ bc, c0 + 16 ≤ br (a multiple of 16); the slices
                // hold d·br, keys·d and bc·br values (asserted by the caller)
                unsafe {
                    scores_tile(
                        qt.as_ptr().add(c0),
                        k.as_ptr().add(j0 * n.d),
                        st.as_mut_ptr().add(j0 * n.br + c0),
                        scale,
                        n,
                    )
                };
            }
        }
        // the last keys % 4 keys: as `avx512::scores`
        for j in full..keys {
            for c0 in (0..n.br).step_by(W) {
                let mut acc = _mm256_setzero_ps();
                for d in 0..n.d {
                    // SAFETY: j < keys rows of k, d < n.d, c0 + 8 ≤ br columns of qt's row
                    // d
                    unsafe {
                        let q = _mm256_loadu_ps(qt.as_ptr().add(d * n.br + c0));
                        acc = _mm256_fmadd_ps(_mm256_set1_ps(k[j * n.d + d]), q, acc);
                    }
                }
                // SAFETY: j < bc rows of st, c0 + 8 ≤ br columns
                unsafe {
                    _mm256_storeu_ps(
                        st.as_mut_ptr().add(j * n.br + c0),
                        _mm256_mul_ps(acc, scale),
                    )
                };
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax<const FOLDED: bool>(
        st: &mut [f32],
        m: &mut [f32],
        l: &mut [f32],
        alpha: &mut [f32],
        n: Dims,
    ) {
        let log2e = _mm256_set1_ps(std::f32::consts::LOG2_E);
        for c in (0..n.br).step_by(W) {
            // SAFETY: c + 8 ≤ br ≤ the lengths of m, l, alpha, and every row j < bc of st
            // has br values (asserted by the caller)
            unsafe {
                let st = st.as_mut_ptr().add(c);
                let m_old = _mm256_loadu_ps(m.as_ptr().add(c));
                let mut m_new = m_old;
                for j in 0..n.bc {
                    m_new = _mm256_max_ps(m_new, _mm256_loadu_ps(st.add(j * n.br)));
                }
                // as `avx512::softmax`
                let (mm_old, mm_new) =
                    (_mm256_mul_ps(m_old, log2e), _mm256_mul_ps(m_new, log2e));
                let x = if FOLDED {
                    _mm256_sub_ps(mm_old, mm_new)
                } else {
                    _mm256_mul_ps(_mm256_sub_ps(m_old, m_new), log2e)
                };
                let a = exp2(x);
                let mut sum = _mm256_setzero_ps();
                for j in 0..n.bc {
                    let s = _mm256_loadu_ps(st.add(j * n.br));
                    let x = if FOLDED {
                        _mm256_fmsub_ps(s, log2e, mm_new)
                    } else {
                        _mm256_mul_ps(_mm256_sub_ps(s, m_new), log2e)
                    };
                    let p = exp2(x);
                    _mm256_storeu_ps(st.add(j * n.br), p);
                    sum = _mm256_add_ps(sum, p);
                }
                let l_new = _mm256_fmadd_ps(a, _mm256_loadu_ps(l.as_ptr().add(c)), sum);
                _mm256_storeu_ps(l.as_mut_ptr().add(c), l_new);
                _mm256_storeu_ps(m.as_mut_ptr().add(c), m_new);
                _mm256_storeu_ps(alpha.as_mut_ptr().add(c), a);
            }
        }
    }

    /// 4 queries × 16 dims of o. SAFETY (caller): as `avx512::pv_tile` with 4 rows, 16
    /// columns; `mask` lanes are all ones for dims < d and zero past it.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv_tile(
        pt: *const f32,
        v: *const f32,
        o: *mut f32,
        alpha: *const f32,
        mask: [__m256i; 2],
        keys: usize,
        n: Dims,
    ) {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for i in 0..R {
            // SAFETY: i < 4 rows, 16 columns of o left
            unsafe {
                let a = _mm256_set1_ps(*alpha.add(i));
                for c in 0..2 {
                    acc[i][c] = _mm256_mul_ps(a, _mm256_loadu_ps(o.add(i * n.dp + W * c)));
                }
            }
        }
        for j in 0..keys {
            // SAFETY: j < keys rows of v; lanes at or past d are masked off, not read
            let vj = unsafe {
                [
                    _mm256_maskload_ps(v.add(j * n.d), mask[0]),
                    _mm256_maskload_ps(v.add(j * n.d + W), mask[1]),
                ]
            };
            for i in 0..R {
                // SAFETY: j < keys rows, i < 4 columns left
                let p_ij = _mm256_set1_ps(unsafe { *pt.add(j * n.br + i) });
                for c in 0..2 {
                    acc[i][c] = _mm256_fmadd_ps(p_ij, vj[c], acc[i][c]);
                }
            }
        }
        for i in 0..R {
            for c in 0..2 {
                // SAFETY: as for the loads of o
                unsafe { _mm256_storeu_ps(o.add(i * n.dp + W * c), acc[i][c]) };
            }
        }
    }

    /// All-ones lanes for the dims < d of the vector starting at dim c0.
    #[target_feature(enable = "avx2,fma")]
    fn mask(d: usize, c0: usize) -> __m256i {
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let left = _mm256_set1_epi32(d.saturating_sub(c0).min(W) as i32);
        _mm256_cmpgt_epi32(left, lane)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn pv(
        pt: &[f32],
        v: &[f32],
        o: &mut [f32],
        alpha: &[f32],
        keys: usize,
        n: Dims,
    ) {
        for i0 in (0..n.br).step_by(R) {
            for c0 in (0..n.dp).step_by(2 * W) {
                // SAFETY: i0 + 4 ≤ br, c0 + 16 ≤ dp; masks keep v's reads below d; the
                // slices hold bc·br, keys·d, br·dp and br values (asserted by the caller)
                unsafe {
                    pv_tile(
                        pt.as_ptr().add(i0),
                        v.as_ptr().add(c0),
                        o.as_mut_ptr().add(i0 * n.dp + c0),
                        alpha.as_ptr().add(i0),
                        [mask(n.d, c0), mask(n.d, c0 + W)],
                        keys,
                        n,
                    )
                };
            }
        }
    }
}

/// The AVX2 kernels' tiles in NEON's 128-bit registers, four floats each: 32 of them, so
/// the tiles keep AVX2's shape (4 keys or queries × 16 columns, 16 accumulators). NEON has
/// no masked load; the last, partial register of a row of `v` is copied into a zeroed one.
#[cfg(target_arch = "aarch64")]
mod neon {
    use super::{Dims, EXP2_MIN, EXP2_POLY, PEAK_CHAINS, scalar};
    use std::arch::aarch64::*;

    /// Floats in one NEON register.
    const W: usize = 4;
    /// Registers a tile row: 16 columns, as the x86 tiles.
    const C: usize = 4;
    /// Keys per scores tile, queries per output tile.
    const R: usize = 4;

    #[target_feature(enable = "neon")]
    /// SAFETY (caller): the CPU has NEON.
    pub unsafe fn fma_chains(iters: usize) -> f32 {
        let (a, b) = (
            vdupq_n_f32(std::hint::black_box(0.999_999)),
            vdupq_n_f32(std::hint::black_box(1e-7)),
        );
        let mut acc = [vdupq_n_f32(0.0); PEAK_CHAINS];
        for _ in 0..iters {
            for x in &mut acc {
                // x·a + b, as the x86 chains
                *x = vfmaq_f32(b, *x, a);
            }
        }
        acc.iter().map(|&x| vaddvq_f32(x)).sum()
    }

    /// `2^x` for 4 lanes, `x ≤ 0`; exactly 0 for `x < −126.5` (−∞ included): `avx2::exp2`.
    #[target_feature(enable = "neon")]
    fn exp2(x: float32x4_t) -> float32x4_t {
        let x = vmaxq_f32(x, vdupq_n_f32(EXP2_MIN));
        // to the nearest integer, ties to even, as _MM_FROUND_TO_NEAREST_INT
        let n = vrndnq_f32(x);
        let f = vsubq_f32(x, n);
        let mut p = vdupq_n_f32(EXP2_POLY[0]);
        for &c in &EXP2_POLY[1..] {
            p = vfmaq_f32(vdupq_n_f32(c), p, f);
        }
        p = vfmaq_f32(vdupq_n_f32(1.0), p, f);
        let n = vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127));
        vmulq_f32(p, vreinterpretq_f32_s32(vshlq_n_s32::<23>(n)))
    }

    #[target_feature(enable = "neon")]
    /// SAFETY (caller): the CPU has NEON.
    pub unsafe fn exp2_shifted(x: &mut [f32], shift: f32, scale: f32) {
        let (a, b) = (vdupq_n_f32(scale), vdupq_n_f32(shift));
        let mut chunks = x.chunks_exact_mut(W);
        for c in &mut chunks {
            // SAFETY: `c` holds W floats
            unsafe {
                let v = vsubq_f32(vld1q_f32(c.as_ptr()), b);
                vst1q_f32(c.as_mut_ptr(), exp2(vmulq_f32(v, a)));
            }
        }
        scalar::exp2_shifted(chunks.into_remainder(), shift, scale);
    }

    /// 4 keys × 16 queries, the sum over d in order, one fused multiply-add at a time (as
    /// `matrixmultiply` sums on aarch64, so the scores are step 01's). SAFETY (caller): 4
    /// rows of k and of st, 16 columns of qt and st left; the CPU has NEON.
    #[target_feature(enable = "neon")]
    unsafe fn scores_tile(
        qt: *const f32,
        k: *const f32,
        st: *mut f32,
        scale: f32,
        n: Dims,
    ) {
        let mut acc = [[vdupq_n_f32(0.0); C]; R];
        for d in 0..n.d {
            // SAFETY: d < n.d rows, 16 columns left
            let q: [float32x4_t; C] =
                std::array::from_fn(|c| unsafe { vld1q_f32(qt.add(d * n.br + W * c)) });
            for j in 0..R {
                // SAFETY: j < 4 rows left, d < n.d
                let k_jd = unsafe { *k.add(j * n.d + d) };
                for c in 0..C {
                    acc[j][c] = vfmaq_n_f32(acc[j][c], q[c], k_jd);
                }
            }
        }
        for j in 0..R {
            for c in 0..C {
                // SAFETY: j < 4 rows, 16 columns left
                unsafe {
                    vst1q_f32(st.add(j * n.br + W * c), vmulq_n_f32(acc[j][c], scale))
                };
            }
        }
    }

    /// SAFETY (caller): the CPU has NEON; `Kernels::scores`' asserts hold.
    #[target_feature(enable = "neon")]
    pub unsafe fn scores(
        qt: &[f32],
        k: &[f32],
        st: &mut [f32],
        keys: usize,
        scale: f32,
        n: Dims,
    ) {
        let full = keys - keys % R;
        for j0 in (0..full).step_by(R) {
            for c0 in (0..n.br).step_by(C * W) {
                // SAFETY: j0 + 4 ≤ keys ≤ bc, c0 + 16 ≤ br (a multiple of 16); the slices
                // hold d·br, keys·d and bc·br values (asserted by the caller)
                unsafe {
                    scores_tile(
                        qt.as_ptr().add(c0),
                        k.as_ptr().add(j0 * n.d),
                        st.as_mut_ptr().add(j0 * n.br + c0),
                        scale,
                        n,
                    )
                };
            }
        }
        // the last keys % 4 keys, in the same order of sums
        scalar::scores(qt, k, st, full, keys, scale, n);
    }

    /// SAFETY (caller): the CPU has NEON; `Kernels::softmax`' asserts hold.
    #[target_feature(enable = "neon")]
    pub unsafe fn softmax<const FOLDED: bool>(
        st: &mut [f32],
        m: &mut [f32],
        l: &mut [f32],
        alpha: &mut [f32],
        n: Dims,
    ) {
        let log2e = vdupq_n_f32(std::f32::consts::LOG2_E);
        for c in (0..n.br).step_by(W) {
            // SAFETY: c + 4 ≤ br ≤ the lengths of m, l, alpha, and every row j < bc of st
            // has br values (asserted by the caller)
            unsafe {
                let st = st.as_mut_ptr().add(c);
                let m_old = vld1q_f32(m.as_ptr().add(c));
                let mut m_new = m_old;
                for j in 0..n.bc {
                    m_new = vmaxq_f32(m_new, vld1q_f32(st.add(j * n.br)));
                }
                // as `avx512::softmax`
                let (mm_old, mm_new) = (vmulq_f32(m_old, log2e), vmulq_f32(m_new, log2e));
                let x = if FOLDED {
                    vsubq_f32(mm_old, mm_new)
                } else {
                    vmulq_f32(vsubq_f32(m_old, m_new), log2e)
                };
                let a = exp2(x);
                let mut sum = vdupq_n_f32(0.0);
                for j in 0..n.bc {
                    let s = vld1q_f32(st.add(j * n.br));
                    let x = if FOLDED {
                        // s·log2 e − M with one rounding: −(M − s·log2 e), negation exact
                        vnegq_f32(vfmsq_f32(mm_new, s, log2e))
                    } else {
                        vmulq_f32(vsubq_f32(s, m_new), log2e)
                    };
                    let p = exp2(x);
                    vst1q_f32(st.add(j * n.br), p);
                    sum = vaddq_f32(sum, p);
                }
                let l_new = vfmaq_f32(sum, a, vld1q_f32(l.as_ptr().add(c)));
                vst1q_f32(l.as_mut_ptr().add(c), l_new);
                vst1q_f32(m.as_mut_ptr().add(c), m_new);
                vst1q_f32(alpha.as_mut_ptr().add(c), a);
            }
        }
    }

    /// The 4 floats of `x` from column `c`, zeros past `d`: a whole register where `c + 4 ≤
    /// d`, else the tail copied (NEON has no masked load). SAFETY (caller): `x..x + d` is
    /// readable; the CPU has NEON.
    #[target_feature(enable = "neon")]
    unsafe fn load_upto(x: *const f32, c: usize, d: usize) -> float32x4_t {
        if c + W <= d {
            // SAFETY: c + 4 ≤ d
            unsafe { vld1q_f32(x.add(c)) }
        } else {
            let mut tail = [0.0f32; W];
            for (i, t) in tail.iter_mut().enumerate().take(d.saturating_sub(c)) {
                // SAFETY: c + i < d
                *t = unsafe { *x.add(c + i) };
            }
            // SAFETY: `tail` holds 4 floats
            unsafe { vld1q_f32(tail.as_ptr()) }
        }
    }

    /// 4 queries × 16 dims of o. SAFETY (caller): 4 rows of o with 16 columns left from
    /// `c0` (inside dp), `keys` rows of v of `n.d` values, 4 columns of pt and alpha left;
    /// the CPU has NEON.
    #[target_feature(enable = "neon")]
    unsafe fn pv_tile(
        pt: *const f32,
        v: *const f32,
        o: *mut f32,
        alpha: *const f32,
        c0: usize,
        keys: usize,
        n: Dims,
    ) {
        let mut acc = [[vdupq_n_f32(0.0); C]; R];
        for i in 0..R {
            // SAFETY: i < 4 rows, 16 columns of o left
            unsafe {
                let a = *alpha.add(i);
                for c in 0..C {
                    acc[i][c] = vmulq_n_f32(vld1q_f32(o.add(i * n.dp + W * c)), a);
                }
            }
        }
        for j in 0..keys {
            // SAFETY: j < keys rows of v; nothing at or past d is read
            let vj: [float32x4_t; C] = std::array::from_fn(|c| unsafe {
                load_upto(v.add(j * n.d), c0 + W * c, n.d)
            });
            for i in 0..R {
                // SAFETY: j < keys rows, i < 4 columns left
                let p_ij = unsafe { *pt.add(j * n.br + i) };
                for c in 0..C {
                    acc[i][c] = vfmaq_n_f32(acc[i][c], vj[c], p_ij);
                }
            }
        }
        for i in 0..R {
            for c in 0..C {
                // SAFETY: as for the loads of o
                unsafe { vst1q_f32(o.add(i * n.dp + W * c), acc[i][c]) };
            }
        }
    }

    /// SAFETY (caller): the CPU has NEON; `Kernels::pv`'s asserts hold.
    #[target_feature(enable = "neon")]
    pub unsafe fn pv(
        pt: &[f32],
        v: &[f32],
        o: &mut [f32],
        alpha: &[f32],
        keys: usize,
        n: Dims,
    ) {
        for i0 in (0..n.br).step_by(R) {
            for c0 in (0..n.dp).step_by(C * W) {
                // SAFETY: i0 + 4 ≤ br, c0 + 16 ≤ dp; v is read below d only; the slices
                // hold bc·br, keys·d, br·dp and br values (asserted by the caller)
                unsafe {
                    pv_tile(
                        pt.as_ptr().add(i0),
                        v.as_ptr(),
                        o.as_mut_ptr().add(i0 * n.dp + c0),
                        alpha.as_ptr().add(i0),
                        c0,
                        keys,
                        n,
                    )
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in about [−2, 2].
    fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as f32 / u32::MAX as f32) * 4.0 - 2.0
            })
            .collect()
    }

    fn simd() -> Vec<Kernels> {
        [Isa::Avx512, Isa::Avx2, Isa::Neon]
            .into_iter()
            .filter_map(|isa| Kernels::new(isa).ok())
            .collect()
    }

    fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= tol * (1.0 + y.abs()),
                "{what}[{i}]: {x} vs scalar {y}"
            );
        }
    }

    fn dims(br: usize, bc: usize, d: usize) -> Dims {
        Dims {
            br,
            bc,
            d,
            dp: d.next_multiple_of(LANES),
        }
    }

    #[test]
    fn unavailable_instruction_sets_are_refused_and_scalar_always_works() {
        assert!(Kernels::new(Isa::Scalar).is_ok());
        for isa in [Isa::Avx2, Isa::Avx512, Isa::Neon] {
            assert_eq!(Kernels::new(isa).is_ok(), isa.is_available());
        }
        println!("detected: {:?}", Isa::detect());
    }

    #[test]
    fn simd_products_equal_the_scalar_path() {
        let scalar = Kernels::new(Isa::Scalar).unwrap();
        // partial key blocks, query blocks of one and several tiles, head dims with a tail
        for (br, bc, keys, d) in [
            (16, 8, 8, 16),
            (16, 16, 13, 1),
            (48, 64, 64, 64),
            (32, 24, 21, 70),
            (64, 64, 37, 128),
            (16, 32, 3, 33),
        ] {
            let n = dims(br, bc, d);
            for kern in simd() {
                let what = format!("{:?} {n:?}, {keys} keys", kern.isa());
                let (qt, k) = (values(d * br, 1), values(keys * d, 2));
                let (mut s1, mut s2) = (vec![0.0; bc * br], vec![0.0; bc * br]);
                kern.scores(&qt, &k, &mut s1, keys, 0.3, n);
                scalar.scores(&qt, &k, &mut s2, keys, 0.3, n);
                close(&s1, &s2, 1e-5, &format!("scores, {what}"));

                let (pt, v, alpha) =
                    (values(bc * br, 3), values(keys * d, 4), values(br, 5));
                let (mut o1, mut o2) = (values(br * n.dp, 6), values(br * n.dp, 6));
                kern.pv(&pt, &v, &mut o1, &alpha, keys, n);
                scalar.pv(&pt, &v, &mut o2, &alpha, keys, n);
                // the padding dims (≥ d) of o are only rescaled, never read back
                for i in 0..br {
                    close(
                        &o1[i * n.dp..i * n.dp + d],
                        &o2[i * n.dp..i * n.dp + d],
                        1e-5,
                        &format!("pv, {what}"),
                    );
                }
            }
        }
    }

    /// The scores are step 01's, bit for bit, for head dims whose scale is a power of two
    /// and for others: the backward of step 04 rebuilds the probabilities from step 01's
    /// scores and the log-sum-exp that this step made from its own.
    #[test]
    fn the_scores_are_step_01s_to_the_last_bit() {
        let detected = Kernels::new(Isa::detect()).unwrap();
        let fused = simd();
        // the scalar path matches only where `matrixmultiply` does not fuse either
        let kernels = if fused.is_empty() {
            vec![detected]
        } else {
            fused
        };
        for (t, d) in [(37, 64), (50, 48), (21, 128), (19, 5)] {
            let shape = flash_core::Shape::new(1, 1, t, d);
            let [q, k, _] = flash_core::inputs::random_qkv(shape, d as u64);
            // large values, so that a different rounding would show in many scores
            let q = q * 30.0;
            let want = step01_naive::scores(q.view(), k.view()).unwrap();
            let (br, bc) = (t.next_multiple_of(LANES), t);
            let n = dims(br, bc, d);
            let mut qt = vec![0.0f32; d * br];
            for i in 0..t {
                for dd in 0..d {
                    qt[dd * br + i] = q[[0, 0, i, dd]];
                }
            }
            let k = k.as_slice().unwrap();
            for kern in &kernels {
                let mut st = vec![0.0f32; bc * br];
                kern.scores(&qt, k, &mut st, t, shape.scale() as f32, n);
                for i in 0..t {
                    for j in 0..t {
                        let (got, want) = (st[j * br + i], want[[0, 0, i, j]]);
                        assert!(
                            got.to_bits() == want.to_bits(),
                            "{:?}, T {t}, d {d}: s[{i}][{j}] = {got} but step 01 has {want}",
                            kern.isa()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn simd_softmax_equals_the_scalar_path() {
        let scalar = Kernels::new(Isa::Scalar).unwrap();
        let n = dims(32, 24, 64);
        let mut st: Vec<f32> = values(n.bc * n.br, 7).iter().map(|x| x * 20.0).collect();
        st[5] = f32::NEG_INFINITY; // a masked score
        // a first block (m = −∞) and a later one (m finite, sometimes the largest)
        for m0 in [f32::NEG_INFINITY, 15.0] {
            for folded in [true, false] {
                let mut runs = Vec::new();
                for kern in [scalar].into_iter().chain(simd()) {
                    let (mut st, mut m, mut l, mut a) =
                        (st.clone(), vec![m0; n.br], vec![2.0; n.br], vec![0.0; n.br]);
                    if folded {
                        kern.softmax::<true>(&mut st, &mut m, &mut l, &mut a, true, n);
                    } else {
                        kern.softmax::<false>(&mut st, &mut m, &mut l, &mut a, true, n);
                    }
                    assert_eq!(
                        st[5],
                        0.0,
                        "{:?}: a masked score gives exactly 0",
                        kern.isa()
                    );
                    runs.push((kern.isa(), st, m, l, a));
                }
                let (_, st0, m0, l0, a0) = &runs[0];
                for (isa, st, m, l, a) in &runs[1..] {
                    let what = format!("{isa:?} (folded {folded})");
                    close(st, st0, 1e-6, &format!("p, {what}"));
                    assert_eq!(m, m0, "{what}: m");
                    close(l, l0, 1e-6, &format!("l, {what}"));
                    close(a, a0, 1e-6, &format!("alpha, {what}"));
                }
            }
        }
    }

    #[test]
    fn exp2_shifted_matches_the_scalar_path_on_every_length() {
        // lengths that leave every tail size of both register widths
        for len in [0, 1, 7, 8, 15, 16, 17, 33, 130] {
            let mut want = values(len, len as u32 + 1);
            // two exact zeros: −∞ and a value far below −126.5 after the shift
            if len > 2 {
                want[0] = f32::NEG_INFINITY;
                want[1] = -1000.0;
            }
            let x = want.clone();
            scalar::exp2_shifted(&mut want, 1.5, 0.25);
            for k in simd() {
                let mut got = x.clone();
                k.exp2_shifted(&mut got, 1.5, 0.25);
                close(&got, &want, 1e-6, &format!("{:?} exp2_shifted", k.isa()));
                if len > 2 {
                    assert_eq!((got[0], got[1]), (0.0, 0.0), "{:?}", k.isa());
                }
            }
        }
    }

    #[test]
    fn the_exp2_polynomial_is_accurate_to_a_few_ulp_and_flushes_to_exactly_zero() {
        // from 0 down to −130 in uneven steps: 2^((x − 0)·1), the polynomial's own error
        let xs: Vec<f32> = (0..4096)
            .map(|i| -(i as f32) * 0.031_7)
            .chain([f32::NEG_INFINITY, -200.0])
            .collect();
        for kern in simd() {
            let mut got = xs.clone();
            kern.exp2_shifted(&mut got, 0.0, 1.0);
            let mut worst = 0.0f64;
            for (&got, &x) in got.iter().zip(&xs) {
                let want = (x as f64).exp2();
                if x < -126.5 {
                    assert_eq!(got, 0.0, "{:?}: 2^{x} must flush to 0", kern.isa());
                } else if x >= -125.0 {
                    worst = worst.max((got as f64 - want).abs() / want);
                }
            }
            println!("{:?}: worst relative error of 2^x: {worst:.2e}", kern.isa());
            assert!(worst < 4e-7, "{:?}: relative error {worst:e}", kern.isa());
        }
    }
}
