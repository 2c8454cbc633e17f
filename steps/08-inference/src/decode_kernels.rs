//! The micro-kernels of the grouped rungs of CPU decoding ([`decode_grouped`],
//! [`decode_simd`], [`decode_threads`]): one block of keys against the `R` query rows that
//! share a kv head, in the instruction sets of two architectures (AVX-512F and AVX2 with
//! FMA on x86-64, NEON on aarch64) and in plain Rust, chosen at run time as step 02's
//! [`Isa`] chooses them. The NEON kernels are checked against plain Rust under an emulator;
//! no speed of theirs has been measured here.
//!
//! The SIMD lanes run along the *head dim*: a key, a value, a query row and an output row
//! are each `d` contiguous numbers, loaded `LANES` at a time (the last, partial load
//! masked), so no copy or transpose of the cache is needed. With one or a few rows per kv
//! head there are too few rows to fill the lanes, so the lanes cannot run along the rows as
//! step 02's prefill kernels do.
//!
//! The loads take any alignment. A large array from glibc's allocator starts 16 bytes past
//! a 64-byte line, so most 512-bit loads of a row span two lines; the same cache placed on
//! 64-byte lines was measured no faster where it comes from memory (head dims 64 and 128,
//! 32 kv heads, 16k tokens, on a 2-core AMD EPYC: within ±10%, the noise), so the kernels
//! take the cache where the caller's allocator put it.
//!
//! - `q`: `R × d`, the rows of the kv head's query heads (head after head, each head's
//!   `n` rows in order: as q stores them);
//! - `k`, `v`: `keys × d`, one block of the cache as it lies in memory;
//! - `s`: `R × bc`, row `r`'s scores of the block at `s[r·bc ..]`, then its probabilities;
//! - `o`: `R × d`, the running (unnormalised) outputs.
//!
//! Each product also reports whether the block's keys (values) were finite, without a
//! pass of its own over the cache (a second pass over a cache that does not fit in the
//! caches costs as much as the attention) and without a look at each value it loads (an
//! integer AND and MAX a register loaded, competing with the multiply-adds for the SIMD
//! units): it looks at what it wrote. q is finite (checked before), so a key with a value that is
//! not finite gives every row a score that is not finite (`x·∞` is ±∞, `0·∞` is NaN), and a
//! value that is not finite leaves every row's output so for good (a probability, even 0,
//! times it is ±∞ or NaN, and sums and products keep it). Row 0's scores of the block and
//! its output row are enough. A score or a sum that overflows reads as not finite too: the
//! caller then searches the cache, finds it finite and goes on.
//!
//! The AVX-512 kernels also care how the block comes from memory: the first tile of rows,
//! the one that brings it, reads each value whole and in order (the keys four at a time,
//! register by register), and asks for the block after next to be brought into the L2
//! cache while it computes, so that enough lines are in flight to read memory at its speed
//! while the multiply-adds run. With fewer than four rows a kv head there is no tile: each
//! key and value is read whole, one after the other.
//!
//! All `unsafe` of the crate's CPU decoding is in this module: calling a
//! `#[target_feature]` function, sound only after the CPU was seen to have the feature
//! ([`DecodeKernels::new`] checks once, and a value stands for it), and raw-pointer loads
//! and stores, whose bounds each safe entry point asserts before the first one.
//!
//! [`decode_grouped`]: crate::decode_grouped::decode_grouped
//! [`decode_simd`]: crate::decode_grouped::decode_simd
//! [`decode_threads`]: crate::decode_grouped::decode_threads

// The register tiles index their arrays by register on purpose: the loops mirror the row's
// registers and unroll completely, each element in its own register.
#![allow(clippy::needless_range_loop)]

use flash_core::AttnError;
use step02_online_softmax::kernels::{Isa, Kernels};

/// The sizes of one block: rows, keys in the block, the stride of a row of `s`, head dim.
#[derive(Clone, Copy, Debug)]
pub struct Tile {
    /// Query rows sharing the kv head, `g · n`.
    pub rows: usize,
    /// Keys in this block (the last block of a range may have fewer than `bc`).
    pub keys: usize,
    /// Room for keys in a row of `s`.
    pub bc: usize,
    /// The head dim.
    pub d: usize,
}

/// The exponent field of an `f32`: all ones for ±∞ and NaN alone.
const EXPONENT: u32 = 0x7f80_0000;

/// The kernels of one instruction set, known to be available: holding one is the proof the
/// `unsafe` calls below rely on.
#[derive(Clone, Copy, Debug)]
pub struct DecodeKernels {
    isa: Isa,
}

impl DecodeKernels {
    /// The kernels of `isa`, or an error naming what this CPU has when it lacks `isa`.
    pub fn new(isa: Isa) -> Result<DecodeKernels, AttnError> {
        Kernels::new(isa).map(|k| DecodeKernels { isa: k.isa() })
    }

    pub fn isa(self) -> Isa {
        self.isa
    }

    /// Step 02's kernels of the same instruction set, for the block's exponentials.
    pub fn exp(self) -> Kernels {
        Kernels::new(self.isa).expect("a DecodeKernels proves its instruction set")
    }

    // ANCHOR: block_scores
    /// `s[r·bc + j] = (q_r · k_j)·scale` for every row `r` and key `j < t.keys`: each key
    /// loaded from memory once and multiplied by all `R` rows while it is in the L1 cache,
    /// the small matrix product `Q Kᵀ` of the block. True when the block's keys are finite
    /// (row 0's scores are), false also for a score that overflowed.
    pub fn scores(self, q: &[f32], k: &[f32], s: &mut [f32], t: Tile, scale: f32) -> bool {
        assert!(
            t.d > 0
                && t.keys <= t.bc
                && q.len() >= t.rows * t.d
                && k.len() >= t.keys * t.d
                && s.len() >= t.rows * t.bc,
            "{t:?}: d ≥ 1, keys ≤ bc, q R·d, k keys·d and s R·bc long"
        );
        match self.isa {
            // SAFETY: `self` exists only if the CPU has AVX-512F (`DecodeKernels::new`);
            // the asserts above bound every pointer (rows < R, keys < t.keys, dims < d).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::scores(q, k, s, t, scale) },
            // SAFETY: as above, for AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::scores(q, k, s, t, scale) },
            // SAFETY: as above, for NEON.
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => unsafe { neon::scores(q, k, s, t, scale) },
            _ => scalar::scores(q, k, s, t, scale),
        }
        t.rows == 0 || finite(&s[..t.keys])
    }
    // ANCHOR_END: block_scores

    // ANCHOR: block_values
    /// `o_r += Σ_j p[r·bc + j]·v_j` for every row `r`, keys `j < t.keys`: each value loaded
    /// from memory once and added into all `R` running outputs. True when the block's values
    /// are finite (row 0's output is), false also for an output that overflowed.
    pub fn values(self, p: &[f32], v: &[f32], o: &mut [f32], t: Tile) -> bool {
        assert!(
            t.d > 0
                && t.keys <= t.bc
                && p.len() >= t.rows * t.bc
                && v.len() >= t.keys * t.d
                && o.len() >= t.rows * t.d,
            "{t:?}: d ≥ 1, keys ≤ bc, p R·bc, v keys·d and o R·d long"
        );
        match self.isa {
            // SAFETY: `self` proves AVX-512F; the asserts above bound every pointer (rows
            // < R, keys < t.keys, dims < d).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::values(p, v, o, t) },
            // SAFETY: as above, for AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::values(p, v, o, t) },
            // SAFETY: as above, for NEON.
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => unsafe { neon::values(p, v, o, t) },
            _ => scalar::values(p, v, o, t),
        }
        t.rows == 0 || finite(&o[..t.d])
    }
    // ANCHOR_END: block_values
}

/// Whether every number of `x` is finite, in one pass of integer additions and ORs that any
/// SIMD unit has: a value is finite when its exponent field is not all ones, and only an
/// all-ones field carries into the sign bit when the lowest exponent bit is added to it.
fn finite(x: &[f32]) -> bool {
    let carry = |x: &f32| (x.to_bits() & EXPONENT) + (1 << 23);
    let mut acc = [0u32; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a |= carry(x);
        }
    }
    let all = acc.iter().fold(0, |a, b| a | b) | tail.iter().fold(0, |a, x| a | carry(x));
    all & (1 << 31) == 0
}

/// The portable path, plain Rust: correct on every CPU, the reference the SIMD paths are
/// tested against. The compiler vectorises its loops for the target's baseline (SSE2 on
/// x86-64, NEON on aarch64, where NEON is always there).
mod scalar {
    use super::Tile;

    pub fn scores(q: &[f32], k: &[f32], s: &mut [f32], t: Tile, scale: f32) {
        for (j, k_j) in k.chunks_exact(t.d).take(t.keys).enumerate() {
            for (r, q_r) in q.chunks_exact(t.d).take(t.rows).enumerate() {
                s[r * t.bc + j] = crate::decode::dot(q_r, k_j) * scale;
            }
        }
    }

    pub fn values(p: &[f32], v: &[f32], o: &mut [f32], t: Tile) {
        for (j, v_j) in v.chunks_exact(t.d).take(t.keys).enumerate() {
            for (r, o_r) in o.chunks_exact_mut(t.d).take(t.rows).enumerate() {
                let p_rj = p[r * t.bc + j];
                for (o, &x) in o_r.iter_mut().zip(v_j) {
                    *o += p_rj * x;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::Tile;
    use std::arch::x86_64::*;

    const LANES: usize = 16;

    /// The fewest rows given to the register tiles, which pay by sharing each loaded key
    /// or value among their rows. With one row a key (plain multi-head attention) there is
    /// nothing to share, and with two or three the tiles' leftover rows went one at a time
    /// anyway; there a loop that takes one key after the other, whole ([`scores_any`],
    /// [`values_any`]), read a cache from memory as fast as plain Rust, and the tiles did
    /// not. The tiles' first call takes four rows ([`scores_rows`]): soundness needs at
    /// least that many.
    const TILE_ROWS: usize = 4;
    const _: () = assert!(TILE_ROWS >= 4, "scores_rows' first tile takes four rows");

    /// Whether a block goes to the register tiles: [`TILE_ROWS`] rows or more, and a row
    /// that fits in eight registers. The rule of both products.
    fn tiled(t: Tile) -> bool {
        t.rows >= TILE_ROWS && t.d <= 8 * LANES
    }

    /// The lanes of the last, partial register of a row of `d`.
    #[target_feature(enable = "avx512f")]
    fn tail_mask(d: usize) -> __mmask16 {
        ((1u32 << (d % LANES)) - 1) as __mmask16
    }

    /// A head dim of at most `W` registers: a query row, or an output row, held in
    /// registers while the block's keys go by.
    macro_rules! by_width {
        ($f:ident, $d:expr, $($arg:expr),*) => {
            match $d.div_ceil(LANES) {
                1 => $f::<1>($($arg),*),
                2 => $f::<2>($($arg),*),
                3 => $f::<3>($($arg),*),
                4 => $f::<4>($($arg),*),
                5 => $f::<5>($($arg),*),
                6 => $f::<6>($($arg),*),
                7 => $f::<7>($($arg),*),
                _ => $f::<8>($($arg),*),
            }
        };
    }

    /// Fewer than [`TILE_ROWS`] rows, or a head dim past eight registers: one key at a
    /// time, whole and in order ([`scores_any`]); otherwise the tiles of [`scores_rows`].
    ///
    /// SAFETY (caller): the CPU has AVX-512F; `DecodeKernels::scores`' asserts hold.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn scores(q: &[f32], k: &[f32], s: &mut [f32], t: Tile, scale: f32) {
        if !tiled(t) {
            // SAFETY: the caller's conditions
            return unsafe { scores_any(q, k, s, t, scale) };
        }
        // SAFETY: the caller's conditions, d ≤ W · 16 for the W chosen, and R ≥ TILE_ROWS
        // ≥ 4
        unsafe { by_width!(scores_rows, t.d, q, k, s, t, scale) }
    }

    /// The sums of four registers, one a lane: `[Σ a[0], Σ a[1], Σ a[2], Σ a[3]]`, halving
    /// all four at once (256 bits, then 128, then 64 and 32) instead of each on its own.
    #[target_feature(enable = "avx512f")]
    fn sum4(a: [__m512; 4]) -> __m128 {
        // lanes of 128 bits: [a0 a0 a1 a1] and [a2 a2 a3 a3], each half summed
        let x01 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a[0], a[1]),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a[0], a[1]),
        );
        let x23 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a[2], a[3]),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a[2], a[3]),
        );
        // [a0 a1 a2 a3], four partial sums each
        let y = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x01, x23),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x01, x23),
        );
        // within each lane of 128 bits: element 0 the lane's sum
        let y = _mm512_add_ps(y, _mm512_permute_ps::<0b01_00_11_10>(y));
        let y = _mm512_add_ps(y, _mm512_permute_ps::<0b10_11_00_01>(y));
        let first = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        _mm512_castps512_ps128(_mm512_permutexvar_ps(first, y))
    }

    /// The sums of sixteen registers, `a[r][u]` for four rows `r` and four keys `u`: lane `r`
    /// (128 bits) of the result holds row `r`'s four sums, `[Σ a[r][0], …, Σ a[r][3]]`, as
    /// the row's four scores lie in `s`. Halving the sixteen together (256 bits, 128, then
    /// within each lane of 128) takes 45 shuffles and additions where [`sum4`] on each row
    /// takes 56, and no constant to load.
    #[target_feature(enable = "avx512f")]
    fn sum4x4(a: [[__m512; 4]; 4]) -> __m512 {
        // two rows of a key: halves of 256 bits, each summed
        let halves = |x, y| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
            )
        };
        // lanes of 128 bits: lane r row r's partial sums
        let quarters = |x, y| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
            )
        };
        let y: [__m512; 4] = std::array::from_fn(|u| {
            quarters(halves(a[0][u], a[1][u]), halves(a[2][u], a[3][u]))
        });
        // within each lane: two keys' two partial sums, then element u key u's sum
        let pairs = |x, y| {
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b01_00_01_00>(x, y),
                _mm512_shuffle_ps::<0b11_10_11_10>(x, y),
            )
        };
        let (z01, z23) = (pairs(y[0], y[1]), pairs(y[2], y[3]));
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(z01, z23),
            _mm512_shuffle_ps::<0b11_01_11_01>(z01, z23),
        )
    }

    /// Asks for the row at `x[at..]` of the block after next (`2 · bc` keys on, the next
    /// block's keys and values being read meanwhile) to be brought into the L2 cache, one
    /// request a line of 16 values. The products' own loads, spread among their
    /// multiply-adds, keep too few misses in flight to read memory at its speed; these
    /// requests, one block of work ahead, leave them to find their lines in the L2 cache.
    /// Past the end of the cache they point beyond `x`: a prefetch never faults, and
    /// `wrapping_add` makes no claim on where the address lies.
    #[target_feature(enable = "avx512f")]
    fn prefetch_ahead<const W: usize>(x: &[f32], at: usize, t: Tile) {
        let row = x.as_ptr().wrapping_add(at + 2 * t.bc * t.d);
        for c in 0..W {
            _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(c * LANES).cast::<i8>());
        }
    }

    /// Rows four at a time (then one at a time), each group of four keys multiplied by the
    /// four rows register by register: a register of a key serves four rows and a register
    /// of a row four keys, so the sixteen sums need eight loads for sixteen multiply-adds
    /// rather than one load each, and the four sums of a row are halved together into
    /// four scores: for four rows, the sixteen sums halved together ([`sum4x4`]).
    ///
    /// SAFETY (caller): the CPU has AVX-512F; `DecodeKernels::scores`' asserts hold;
    /// `d ≤ 16 · W`; `R ≥ 4`.
    #[target_feature(enable = "avx512f")]
    unsafe fn scores_rows<const W: usize>(
        q: &[f32],
        k: &[f32],
        s: &mut [f32],
        t: Tile,
        scale: f32,
    ) {
        // SAFETY (all three calls): rows r .. r + RB ≤ R; the caller's conditions
        unsafe { scores_tile::<W, 4, true>(q, k, s, t, scale, 0) };
        let mut r = 4;
        while r + 4 <= t.rows {
            unsafe { scores_tile::<W, 4, false>(q, k, s, t, scale, r) };
            r += 4;
        }
        while r < t.rows {
            unsafe { scores_tile::<W, 1, false>(q, k, s, t, scale, r) };
            r += 1;
        }
    }

    /// Rows `r0 .. r0 + RB` against every key of the block; with `FIRST` (the tile that
    /// brings the block from memory), the block after next asked for.
    ///
    /// SAFETY (caller): as [`scores_rows`], and `r0 + RB ≤ R`.
    #[target_feature(enable = "avx512f")]
    unsafe fn scores_tile<const W: usize, const RB: usize, const FIRST: bool>(
        q: &[f32],
        k: &[f32],
        s: &mut [f32],
        t: Tile,
        scale: f32,
        r0: usize,
    ) {
        let d = t.d;
        // lanes of register c inside a row: all of them but in the last, partial one
        let mask = |c: usize| {
            if c + 1 < W || d.is_multiple_of(LANES) {
                0xffff
            } else {
                tail_mask(d)
            }
        };
        let load = |x: *const f32, c: usize| {
            // SAFETY: the callers pass a row of d values; the masked lanes are not read
            unsafe { _mm512_maskz_loadu_ps(mask(c), x.add(c * LANES)) }
        };
        let row = |r: usize| q[(r0 + r) * d..].as_ptr();
        let key = |j: usize| k[j * d..].as_ptr();
        let (scale4, scale16) = (_mm_set1_ps(scale), _mm512_set1_ps(scale));
        let base = s.as_mut_ptr();
        let mut j = 0;
        while j + 4 <= t.keys {
            if FIRST {
                for u in 0..4 {
                    prefetch_ahead::<W>(k, (j + u) * d, t);
                }
            }
            let mut acc = [[_mm512_setzero_ps(); 4]; RB];
            for c in 0..W {
                let keys = [
                    load(key(j), c),
                    load(key(j + 1), c),
                    load(key(j + 2), c),
                    load(key(j + 3), c),
                ];
                for r in 0..RB {
                    let x = load(row(r), c);
                    for u in 0..4 {
                        acc[r][u] = _mm512_fmadd_ps(x, keys[u], acc[r][u]);
                    }
                }
            }
            // row r's scores of keys j .. j + 4: inside s, as r0 + r < R and j + 4 ≤ bc
            let at = |r: usize| base.wrapping_add((r0 + r) * t.bc + j);
            if RB == 4 {
                let sums = _mm512_mul_ps(sum4x4(std::array::from_fn(|r| acc[r])), scale16);
                // SAFETY: at(r) .. at(r) + 4 lies in s (above)
                unsafe {
                    _mm_storeu_ps(at(0), _mm512_castps512_ps128(sums));
                    _mm_storeu_ps(at(1), _mm512_extractf32x4_ps::<1>(sums));
                    _mm_storeu_ps(at(2), _mm512_extractf32x4_ps::<2>(sums));
                    _mm_storeu_ps(at(3), _mm512_extractf32x4_ps::<3>(sums));
                }
            } else {
                for r in 0..RB {
                    let sums = _mm_mul_ps(sum4(acc[r]), scale4);
                    // SAFETY: at(r) .. at(r) + 4 lies in s (above)
                    unsafe { _mm_storeu_ps(at(r), sums) };
                }
            }
            j += 4;
        }
        while j < t.keys {
            for r in 0..RB {
                let mut a = _mm512_setzero_ps();
                for c in 0..W {
                    a = _mm512_fmadd_ps(load(row(r), c), load(key(j), c), a);
                }
                s[(r0 + r) * t.bc + j] = _mm512_reduce_add_ps(a) * scale;
            }
            j += 1;
        }
    }

    /// As [`scores`]: [`values_any`] for fewer than [`TILE_ROWS`] rows or a head dim past
    /// eight registers, the tiles of [`values_rows`] otherwise.
    ///
    /// SAFETY (caller): the CPU has AVX-512F; `DecodeKernels::values`' asserts hold.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn values(p: &[f32], v: &[f32], o: &mut [f32], t: Tile) {
        if !tiled(t) {
            // SAFETY: the caller's conditions
            return unsafe { values_any(p, v, o, t) };
        }
        // SAFETY: the caller's conditions, d ≤ W · 16 for the W chosen, and R ≥ TILE_ROWS
        // ≥ 4
        unsafe { by_width!(values_rows, t.d, p, v, o, t) }
    }

    /// Rows in tiles of four (two where a row takes more than four registers: sixteen sums
    /// at most), their outputs in registers while the block's values go by, whole: a
    /// register of a value serves the tile's rows, and each row's probability, broadcast
    /// once a key, serves its registers. Stored once at the end. A tile reads each value
    /// whole, so that the first one, which brings the block from memory, reads it in
    /// order, as the hardware's prefetcher expects (two passes over halves of each value
    /// leave the second half to miss again).
    ///
    /// SAFETY (caller): the CPU has AVX-512F; `DecodeKernels::values`' asserts hold; `d ≤
    /// 16 · W`; `R ≥ 4`.
    #[target_feature(enable = "avx512f")]
    unsafe fn values_rows<const W: usize>(p: &[f32], v: &[f32], o: &mut [f32], t: Tile) {
        // SAFETY (both calls): the caller's conditions
        if W <= 4 {
            unsafe { values_tiles::<W, 4>(p, v, o, t) }
        } else {
            unsafe { values_tiles::<W, 2>(p, v, o, t) }
        }
    }

    /// [`values_rows`] in tiles of `RB` rows, then one at a time.
    ///
    /// SAFETY (caller): as [`values_rows`].
    #[target_feature(enable = "avx512f")]
    unsafe fn values_tiles<const W: usize, const RB: usize>(
        p: &[f32],
        v: &[f32],
        o: &mut [f32],
        t: Tile,
    ) {
        // SAFETY (all three calls): rows r .. r + RB ≤ R; the caller's conditions
        unsafe { values_tile::<W, RB, true>(p, v, o, t, 0) };
        let mut r = RB;
        while r + RB <= t.rows {
            unsafe { values_tile::<W, RB, false>(p, v, o, t, r) };
            r += RB;
        }
        while r < t.rows {
            unsafe { values_tile::<W, 1, false>(p, v, o, t, r) };
            r += 1;
        }
    }

    /// Rows `r0 .. r0 + RB`, every value of the block added into their outputs; with
    /// `FIRST` (the tile that brings the block from memory), the block after next asked
    /// for.
    ///
    /// SAFETY (caller): as [`values_rows`], and `r0 + RB ≤ R`.
    #[target_feature(enable = "avx512f")]
    unsafe fn values_tile<const W: usize, const RB: usize, const FIRST: bool>(
        p: &[f32],
        v: &[f32],
        o: &mut [f32],
        t: Tile,
        r0: usize,
    ) {
        let d = t.d;
        let mask = |c: usize| {
            if c + 1 < W || d.is_multiple_of(LANES) {
                0xffff
            } else {
                tail_mask(d)
            }
        };
        let load = |x: *const f32, c: usize| {
            // SAFETY: the callers pass a row of d values; the masked lanes are not read
            unsafe { _mm512_maskz_loadu_ps(mask(c), x.add(c * LANES)) }
        };
        let base = o.as_mut_ptr();
        // SAFETY: row r0 + r < R, o holds R · d values
        let out = |r: usize| unsafe { base.add((r0 + r) * d) };
        let mut acc = [[_mm512_setzero_ps(); W]; RB];
        for r in 0..RB {
            for c in 0..W {
                acc[r][c] = load(out(r), c);
            }
        }
        for j in 0..t.keys {
            if FIRST {
                prefetch_ahead::<W>(v, j * d, t);
            }
            let mut pr = [_mm512_setzero_ps(); RB];
            for r in 0..RB {
                pr[r] = _mm512_set1_ps(p[(r0 + r) * t.bc + j]);
            }
            let value = v[j * d..].as_ptr();
            for c in 0..W {
                let x = load(value, c);
                for r in 0..RB {
                    acc[r][c] = _mm512_fmadd_ps(pr[r], x, acc[r][c]);
                }
            }
        }
        for r in 0..RB {
            for c in 0..W {
                // SAFETY: row r0 + r < R; the masked lanes, past d, are not written
                unsafe { _mm512_mask_storeu_ps(out(r).add(c * LANES), mask(c), acc[r][c]) };
            }
        }
    }

    /// Any head dim: the key's registers loaded again for each row.
    ///
    /// SAFETY (caller): the CPU has AVX-512F; `DecodeKernels::scores`' asserts hold.
    #[target_feature(enable = "avx512f")]
    unsafe fn scores_any(q: &[f32], k: &[f32], s: &mut [f32], t: Tile, scale: f32) {
        let d = t.d;
        let (full, mask) = (d / LANES * LANES, tail_mask(d));
        for j in 0..t.keys {
            // SAFETY: key j < t.keys, k holds t.keys · d values
            let k_j = unsafe { k.as_ptr().add(j * d) };
            for r in 0..t.rows {
                let q_r = unsafe { q.as_ptr().add(r * d) };
                // two sums, so that consecutive multiply-adds do not wait for each other
                let (mut a, mut b) = (_mm512_setzero_ps(), _mm512_setzero_ps());
                let mut c = 0;
                while c + 2 * LANES <= full {
                    // SAFETY: c + 32 ≤ d, in q_r and k_j
                    unsafe {
                        a = _mm512_fmadd_ps(
                            _mm512_loadu_ps(q_r.add(c)),
                            _mm512_loadu_ps(k_j.add(c)),
                            a,
                        );
                        b = _mm512_fmadd_ps(
                            _mm512_loadu_ps(q_r.add(c + LANES)),
                            _mm512_loadu_ps(k_j.add(c + LANES)),
                            b,
                        );
                    }
                    c += 2 * LANES;
                }
                if c < full {
                    // SAFETY: c + 16 ≤ d
                    unsafe {
                        a = _mm512_fmadd_ps(
                            _mm512_loadu_ps(q_r.add(c)),
                            _mm512_loadu_ps(k_j.add(c)),
                            a,
                        );
                    }
                }
                if full < d {
                    // SAFETY: the masked lanes, past d, are not read
                    unsafe {
                        b = _mm512_fmadd_ps(
                            _mm512_maskz_loadu_ps(mask, q_r.add(full)),
                            _mm512_maskz_loadu_ps(mask, k_j.add(full)),
                            b,
                        );
                    }
                }
                s[r * t.bc + j] = _mm512_reduce_add_ps(_mm512_add_ps(a, b)) * scale;
            }
        }
    }

    /// Any head dim: the outputs loaded and stored for each key.
    ///
    /// SAFETY (caller): the CPU has AVX-512F; `DecodeKernels::values`' asserts hold.
    #[target_feature(enable = "avx512f")]
    unsafe fn values_any(p: &[f32], v: &[f32], o: &mut [f32], t: Tile) {
        let d = t.d;
        let (full, mask) = (d / LANES * LANES, tail_mask(d));
        for j in 0..t.keys {
            // SAFETY: value j < t.keys, v holds t.keys · d values
            let v_j = unsafe { v.as_ptr().add(j * d) };
            for r in 0..t.rows {
                let p_rj = _mm512_set1_ps(p[r * t.bc + j]);
                // SAFETY: row r < R, o holds R · d values
                let o_r = unsafe { o.as_mut_ptr().add(r * d) };
                let mut c = 0;
                while c < full {
                    // SAFETY: c + 16 ≤ d, in o_r and v_j
                    unsafe {
                        let x = _mm512_fmadd_ps(
                            p_rj,
                            _mm512_loadu_ps(v_j.add(c)),
                            _mm512_loadu_ps(o_r.add(c)),
                        );
                        _mm512_storeu_ps(o_r.add(c), x);
                    }
                    c += LANES;
                }
                if full < d {
                    // SAFETY: the masked lanes, past d, are neither read nor written
                    unsafe {
                        let x = _mm512_fmadd_ps(
                            p_rj,
                            _mm512_maskz_loadu_ps(mask, v_j.add(full)),
                            _mm512_maskz_loadu_ps(mask, o_r.add(full)),
                        );
                        _mm512_mask_storeu_ps(o_r.add(full), mask, x);
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Tile;
    use std::arch::x86_64::*;

    const LANES: usize = 8;

    /// The lanes of the last, partial register of a row of `d`: all bits set in the lanes
    /// to load, as `maskload` reads them.
    #[target_feature(enable = "avx2")]
    fn tail_mask(d: usize) -> __m256i {
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_cmpgt_epi32(_mm256_set1_epi32((d % LANES) as i32), lane)
    }

    #[target_feature(enable = "avx2")]
    fn sum(x: __m256) -> f32 {
        let x = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
        let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)))
    }

    /// SAFETY (caller): the CPU has AVX2 and FMA; `DecodeKernels::scores`' asserts hold.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scores(q: &[f32], k: &[f32], s: &mut [f32], t: Tile, scale: f32) {
        let d = t.d;
        let (full, mask) = (d / LANES * LANES, tail_mask(d));
        for j in 0..t.keys {
            // SAFETY: key j < t.keys, k holds t.keys · d values
            let k_j = unsafe { k.as_ptr().add(j * d) };
            for r in 0..t.rows {
                let q_r = unsafe { q.as_ptr().add(r * d) };
                let (mut a, mut b) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut c = 0;
                while c + 2 * LANES <= full {
                    // SAFETY: c + 16 ≤ d, in q_r and k_j
                    unsafe {
                        a = _mm256_fmadd_ps(
                            _mm256_loadu_ps(q_r.add(c)),
                            _mm256_loadu_ps(k_j.add(c)),
                            a,
                        );
                        b = _mm256_fmadd_ps(
                            _mm256_loadu_ps(q_r.add(c + LANES)),
                            _mm256_loadu_ps(k_j.add(c + LANES)),
                            b,
                        );
                    }
                    c += 2 * LANES;
                }
                if c < full {
                    // SAFETY: c + 8 ≤ d
                    unsafe {
                        a = _mm256_fmadd_ps(
                            _mm256_loadu_ps(q_r.add(c)),
                            _mm256_loadu_ps(k_j.add(c)),
                            a,
                        );
                    }
                }
                if full < d {
                    // SAFETY: the masked lanes, past d, are not read
                    unsafe {
                        b = _mm256_fmadd_ps(
                            _mm256_maskload_ps(q_r.add(full), mask),
                            _mm256_maskload_ps(k_j.add(full), mask),
                            b,
                        );
                    }
                }
                s[r * t.bc + j] = sum(_mm256_add_ps(a, b)) * scale;
            }
        }
    }

    /// SAFETY (caller): the CPU has AVX2 and FMA; `DecodeKernels::values`' asserts hold.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn values(p: &[f32], v: &[f32], o: &mut [f32], t: Tile) {
        let d = t.d;
        let (full, mask) = (d / LANES * LANES, tail_mask(d));
        for j in 0..t.keys {
            // SAFETY: value j < t.keys, v holds t.keys · d values
            let v_j = unsafe { v.as_ptr().add(j * d) };
            for r in 0..t.rows {
                let p_rj = _mm256_set1_ps(p[r * t.bc + j]);
                // SAFETY: row r < R, o holds R · d values
                let o_r = unsafe { o.as_mut_ptr().add(r * d) };
                let mut c = 0;
                while c < full {
                    // SAFETY: c + 8 ≤ d, in o_r and v_j
                    unsafe {
                        let x = _mm256_fmadd_ps(
                            p_rj,
                            _mm256_loadu_ps(v_j.add(c)),
                            _mm256_loadu_ps(o_r.add(c)),
                        );
                        _mm256_storeu_ps(o_r.add(c), x);
                    }
                    c += LANES;
                }
                if full < d {
                    // SAFETY: the masked lanes, past d, are neither read nor written
                    unsafe {
                        let x = _mm256_fmadd_ps(
                            p_rj,
                            _mm256_maskload_ps(v_j.add(full), mask),
                            _mm256_maskload_ps(o_r.add(full), mask),
                        );
                        _mm256_maskstore_ps(o_r.add(full), mask, x);
                    }
                }
            }
        }
    }
}

/// The AVX2 kernels in NEON's 128-bit registers: a key against each row in two chains of
/// four lanes, a value into each output row. NEON has no masked load or store, so the last,
/// partial register of a row goes through a zeroed copy.
#[cfg(target_arch = "aarch64")]
mod neon {
    use super::Tile;
    use std::arch::aarch64::*;

    const LANES: usize = 4;

    /// The 4 floats of `x` from `c`, zeros past `d`: a whole register where `c + 4 ≤ d`,
    /// else the tail copied.
    ///
    /// SAFETY (caller): the CPU has NEON; `x..x + d` is readable.
    #[target_feature(enable = "neon")]
    unsafe fn load_upto(x: *const f32, c: usize, d: usize) -> float32x4_t {
        if c + LANES <= d {
            // SAFETY: c + 4 ≤ d
            unsafe { vld1q_f32(x.add(c)) }
        } else {
            let mut tail = [0.0f32; LANES];
            for (i, t) in tail.iter_mut().enumerate().take(d.saturating_sub(c)) {
                // SAFETY: c + i < d
                *t = unsafe { *x.add(c + i) };
            }
            // SAFETY: `tail` holds 4 floats
            unsafe { vld1q_f32(tail.as_ptr()) }
        }
    }

    /// SAFETY (caller): the CPU has NEON; `DecodeKernels::scores`' asserts hold.
    #[target_feature(enable = "neon")]
    pub unsafe fn scores(q: &[f32], k: &[f32], s: &mut [f32], t: Tile, scale: f32) {
        let d = t.d;
        let full = d / LANES * LANES;
        for j in 0..t.keys {
            // SAFETY: key j < t.keys, k holds t.keys · d values
            let k_j = unsafe { k.as_ptr().add(j * d) };
            for r in 0..t.rows {
                // SAFETY: row r < R, q holds R · d values
                let q_r = unsafe { q.as_ptr().add(r * d) };
                // two sums, so that consecutive multiply-adds do not wait for each other
                let (mut a, mut b) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
                let mut c = 0;
                while c + 2 * LANES <= full {
                    // SAFETY: c + 8 ≤ d, in q_r and k_j
                    unsafe {
                        a = vfmaq_f32(a, vld1q_f32(q_r.add(c)), vld1q_f32(k_j.add(c)));
                        b = vfmaq_f32(
                            b,
                            vld1q_f32(q_r.add(c + LANES)),
                            vld1q_f32(k_j.add(c + LANES)),
                        );
                    }
                    c += 2 * LANES;
                }
                if c < d {
                    // SAFETY: q_r and k_j hold d values; nothing past d is read
                    unsafe {
                        a = vfmaq_f32(a, load_upto(q_r, c, d), load_upto(k_j, c, d));
                    }
                    if c + LANES < d {
                        // SAFETY: as above
                        unsafe {
                            b = vfmaq_f32(
                                b,
                                load_upto(q_r, c + LANES, d),
                                load_upto(k_j, c + LANES, d),
                            );
                        }
                    }
                }
                s[r * t.bc + j] = vaddvq_f32(vaddq_f32(a, b)) * scale;
            }
        }
    }

    /// SAFETY (caller): the CPU has NEON; `DecodeKernels::values`' asserts hold.
    #[target_feature(enable = "neon")]
    pub unsafe fn values(p: &[f32], v: &[f32], o: &mut [f32], t: Tile) {
        let d = t.d;
        let full = d / LANES * LANES;
        for j in 0..t.keys {
            // SAFETY: value j < t.keys, v holds t.keys · d values
            let v_j = unsafe { v.as_ptr().add(j * d) };
            for r in 0..t.rows {
                let p_rj = p[r * t.bc + j];
                let o_r = &mut o[r * d..(r + 1) * d];
                let mut c = 0;
                while c < full {
                    // SAFETY: c + 4 ≤ d, in o_r and v_j
                    unsafe {
                        let x = vfmaq_n_f32(
                            vld1q_f32(o_r.as_ptr().add(c)),
                            vld1q_f32(v_j.add(c)),
                            p_rj,
                        );
                        vst1q_f32(o_r.as_mut_ptr().add(c), x);
                    }
                    c += LANES;
                }
                if full < d {
                    // SAFETY: o_r and v_j hold d values; nothing past d is read
                    let x = unsafe {
                        vfmaq_n_f32(
                            load_upto(o_r.as_ptr(), full, d),
                            load_upto(v_j, full, d),
                            p_rj,
                        )
                    };
                    let mut tail = [0.0f32; LANES];
                    // SAFETY: `tail` holds 4 floats
                    unsafe { vst1q_f32(tail.as_mut_ptr(), x) };
                    o_r[full..].copy_from_slice(&tail[..d - full]);
                }
            }
        }
    }
}
