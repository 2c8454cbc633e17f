//! Two partial results of the same rows over disjoint sets of keys make the result over
//! both.
//!
//! A row's output over a set of keys `A` is the average of their values weighted by
//! `e^(s_j) / e^(lse_A)`, with `lse_A = ln Σ_{j∈A} e^(s_j)`. Over `A ∪ B` the weights are
//! `e^(s_j) / e^(lse)` with `lse = ln(e^(lse_A) + e^(lse_B))`, so each partial output is
//! scaled by its share of the whole, `e^(lse_A − lse)` and `e^(lse_B − lse)`, and the two
//! are added:
//!
//! ```text
//! lse = logaddexp(lse_A, lse_B)        o = e^(lse_A − lse)·o_A + e^(lse_B − lse)·o_B
//! ```
//!
//! It is chapter 2's rescaling by `e^(m_old − m_new)` once more, with each partial's
//! log-sum-exp in the place of its running maximum: the two shares add up to 1, so the
//! outputs need no division afterwards. The merge is commutative and, up to rounding,
//! associative, so the blocks of keys may arrive in any order: what lets the keys and
//! values of a sequence travel round a ring of devices.
//!
//! A row that has seen no key yet has the partial result `(0, −∞)` ([`no_keys`]): its share
//! `e^(−∞)` is 0, so merging it changes nothing, and merging two of them gives it back.

use flash_core::{Attention, AttnError};
use ndarray::{Array3, Array4, ArrayView1, ArrayViewMut1, Axis, Zip};

// ANCHOR: merge
/// Merges a row's partial result over keys `B`, `(o_b, lse_b)`, into its partial result
/// over keys `A`, `(o_a, lse_a)`, `A` and `B` disjoint: afterwards `(o_a, lse_a)` is the
/// row's result over `A ∪ B`.
pub fn merge_row(
    mut o_a: ArrayViewMut1<f32>,
    lse_a: &mut f32,
    o_b: ArrayView1<f32>,
    lse_b: f32,
) {
    let lse = logaddexp(*lse_a, lse_b);
    if lse == f32::NEG_INFINITY {
        // neither saw a key: (0, −∞) stays as it is, where e^(−∞ − (−∞)) would be NaN
        return;
    }
    // each partial's share of the whole; a partial that saw no key has e^(−∞) = 0
    let (w_a, w_b) = ((*lse_a - lse).exp(), (lse_b - lse).exp());
    o_a.zip_mut_with(&o_b, |a, &b| *a = w_a * *a + w_b * b);
    *lse_a = lse;
}

/// `ln(e^a + e^b)` without overflow: the larger of the two plus `ln(1 + e^(−|a − b|))`,
/// which lies in `[0, ln 2]`. `−∞` when both are.
pub fn logaddexp(a: f32, b: f32) -> f32 {
    let max = a.max(b);
    if max == f32::NEG_INFINITY {
        return max;
    }
    max + (-(a - b).abs()).exp().ln_1p()
}
// ANCHOR_END: merge

/// The partial result of rows that have seen no key: output 0 and log-sum-exp `−∞`, `dims`
/// being `[batch, heads, tokens, head_dim]`. Merging anything into it gives that thing
/// back.
pub fn no_keys(dims: [usize; 4]) -> Attention {
    let [b, h, t, _] = dims;
    Attention {
        out: Array4::zeros(dims),
        lse: Array3::from_elem((b, h, t), f32::NEG_INFINITY),
    }
}

/// Merges `b` into `a`, row by row ([`merge_row`]): two partial results of the same rows,
/// `out` `[batch, heads, tokens, head_dim]` and `lse` `[batch, heads, tokens]`, over
/// disjoint sets of keys.
pub fn merge_into(a: &mut Attention, b: &Attention) -> Result<(), AttnError> {
    check_partial("the first partial result", a)?;
    if a.out.dim() != b.out.dim() || a.lse.dim() != b.lse.dim() {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "merging partial results of different rows: out {:?} and lse {:?} into out \
                 {:?} and lse {:?}; both must cover the same [batch, heads, tokens]",
                b.out.shape(),
                b.lse.shape(),
                a.out.shape(),
                a.lse.shape()
            ),
        });
    }
    Zip::from(a.out.lanes_mut(Axis(3)))
        .and(&mut a.lse)
        .and(b.out.lanes(Axis(3)))
        .and(&b.lse)
        .for_each(|o_a, lse_a, o_b, &lse_b| merge_row(o_a, lse_a, o_b, lse_b));
    Ok(())
}

/// The merge of two partial results over disjoint sets of keys, as a new result.
pub fn merge(a: &Attention, b: &Attention) -> Result<Attention, AttnError> {
    let mut merged = a.clone();
    merge_into(&mut merged, b)?;
    Ok(merged)
}

/// A partial result's `lse` must be `[batch, heads, tokens]` of its `out`.
fn check_partial(what: &str, p: &Attention) -> Result<(), AttnError> {
    let (b, h, t, _) = p.out.dim();
    if p.lse.dim() != (b, h, t) {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "{what} has out {:?} and lse {:?}; lse must be [batch, heads, tokens] of out",
                p.out.shape(),
                p.lse.shape()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flash_core::Shape;
    use flash_core::inputs::{SplitMix64, random_qkv};
    use flash_core::reference::{Reference, attention_f64, error};
    use proptest::prelude::*;

    /// Causal attention in `f64` over the keys `keep` says yes to (besides the mask), as
    /// the partial result the merge takes: output 0 and log-sum-exp −∞ for a row that sees
    /// none.
    fn over_keys(
        q: &Array4<f32>,
        k: &Array4<f32>,
        v: &Array4<f32>,
        keep: impl Fn(usize) -> bool,
    ) -> Reference {
        let (b_n, h_n, t_n, d_n) = q.dim();
        let scale = Shape::new(b_n, h_n, t_n, d_n).scale();
        let mut out = Array4::zeros((b_n, h_n, t_n, d_n));
        let mut lse = Array3::from_elem((b_n, h_n, t_n), f64::NEG_INFINITY);
        for (b, h, i) in all_rows(b_n, h_n, t_n) {
            let keys: Vec<usize> = (0..=i).filter(|&j| keep(j)).collect();
            if keys.is_empty() {
                continue;
            }
            let s: Vec<f64> = keys
                .iter()
                .map(|&j| {
                    let dot: f64 = (0..d_n)
                        .map(|d| f64::from(q[[b, h, i, d]]) * f64::from(k[[b, h, j, d]]))
                        .sum();
                    dot * scale
                })
                .collect();
            let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = p.iter().sum();
            for d in 0..d_n {
                let acc: f64 = keys
                    .iter()
                    .zip(&p)
                    .map(|(&j, p)| p * f64::from(v[[b, h, j, d]]))
                    .sum();
                out[[b, h, i, d]] = acc / sum;
            }
            lse[[b, h, i]] = max + sum.ln();
        }
        Reference { out, lse }
    }

    fn all_rows(
        b_n: usize,
        h_n: usize,
        t_n: usize,
    ) -> impl Iterator<Item = (usize, usize, usize)> {
        (0..b_n)
            .flat_map(move |b| (0..h_n).flat_map(move |h| (0..t_n).map(move |i| (b, h, i))))
    }

    /// A partial result in `f64`, rounded to what a method in `f32` would hold.
    fn rounded(r: &Reference) -> Attention {
        Attention {
            out: r.out.mapv(|x| x as f32),
            lse: r.lse.mapv(|x| x as f32),
        }
    }

    /// Max-abs errors of out and lse against the reference over every key.
    fn errors(got: &Attention, want: &Reference) -> (f64, f64) {
        (
            error(&got.out, &want.out).max_abs,
            error(&got.lse, &want.lse).max_abs,
        )
    }

    /// The merge adds only the rounding of two shares and a sum, a few units of 10⁻⁷ on
    /// outputs of order 1 and log-sum-exps below 10: measured at most 5.5·10⁻⁷ here.
    const MERGE_MAX_ABS: f64 = 2e-6;

    #[test]
    fn two_halves_of_the_keys_merge_into_the_whole() {
        for tokens in [1, 2, 7, 77, 128] {
            let shape = Shape::new(2, 3, tokens, 16);
            let [q, k, v] = random_qkv(shape, tokens as u64);
            let whole = attention_f64(q.view(), k.view(), v.view()).unwrap();
            // which keys are in A; the others are in B
            let split = |in_a: fn(usize, usize) -> bool| {
                (0..tokens).map(|j| in_a(j, tokens)).collect()
            };
            let splits: [(&str, Vec<bool>); 3] = [
                ("first half", split(|j, t| j < t / 2)),
                ("even keys", split(|j, _| j % 2 == 0)),
                ("key 0 alone", split(|j, _| j == 0)),
            ];
            for (name, in_a) in splits {
                let a = rounded(&over_keys(&q, &k, &v, |j| in_a[j]));
                let b = rounded(&over_keys(&q, &k, &v, |j| !in_a[j]));
                let (out, lse) = errors(&merge(&a, &b).unwrap(), &whole);
                println!("{tokens} tokens, {name}: out {out:.2e}, lse {lse:.2e}");
                assert!(
                    out <= MERGE_MAX_ABS && lse <= MERGE_MAX_ABS,
                    "{tokens} tokens, A = {name}: out {out:e}, lse {lse:e}"
                );
            }
        }
    }

    #[test]
    fn the_merge_is_commutative_and_associative_up_to_rounding() {
        let shape = Shape::new(1, 2, 50, 8);
        let [q, k, v] = random_qkv(shape, 5);
        let part = |r: usize| rounded(&over_keys(&q, &k, &v, move |j| j % 3 == r));
        let (a, b, c) = (part(0), part(1), part(2));
        // commutative exactly: logaddexp is symmetric, and so is w_a·o_a + w_b·o_b
        let (ab, ba) = (merge(&a, &b).unwrap(), merge(&b, &a).unwrap());
        assert_eq!(ab.out, ba.out);
        assert_eq!(ab.lse, ba.lse);
        let left = merge(&ab, &c).unwrap();
        let right = merge(&a, &merge(&b, &c).unwrap()).unwrap();
        let wide = |x: &Attention| Reference {
            out: x.out.mapv(f64::from),
            lse: x.lse.mapv(f64::from),
        };
        let (out, lse) = errors(&left, &wide(&right));
        assert!(out <= 1e-6 && lse <= 1e-6, "out {out:e}, lse {lse:e}");
        let (out, lse) =
            errors(&left, &attention_f64(q.view(), k.view(), v.view()).unwrap());
        assert!(out <= MERGE_MAX_ABS && lse <= MERGE_MAX_ABS);
    }

    #[test]
    fn a_partial_that_saw_no_key_weighs_nothing_and_never_makes_nan() {
        let x = Attention {
            out: Array4::from_shape_vec((1, 1, 2, 2), vec![0.5, -1.0, 2.0, 3.0]).unwrap(),
            lse: Array3::from_shape_vec((1, 1, 2), vec![1.5, -80.0]).unwrap(),
        };
        let none = no_keys([1, 1, 2, 2]);
        for merged in [merge(&x, &none).unwrap(), merge(&none, &x).unwrap()] {
            assert_eq!(merged.out, x.out);
            assert_eq!(merged.lse, x.lse);
        }
        let still_none = merge(&none, &none).unwrap();
        assert!(still_none.out.iter().all(|&o| o == 0.0));
        assert!(still_none.lse.iter().all(|&l| l == f32::NEG_INFINITY));
        assert_eq!(logaddexp(f32::NEG_INFINITY, 2.0), 2.0);
        // far apart: the smaller vanishes without overflow, and large values stay exact
        assert_eq!(logaddexp(1000.0, 0.0), 1000.0);
        assert!((logaddexp(3.0, 3.0) - (3.0 + std::f32::consts::LN_2)).abs() < 1e-6);
    }

    #[test]
    fn partial_results_of_different_rows_are_an_error() {
        let mut a = no_keys([1, 2, 3, 4]);
        let err = merge_into(&mut a, &no_keys([1, 2, 4, 4])).unwrap_err();
        assert!(
            err.to_string().contains("same [batch, heads, tokens]"),
            "{err}"
        );
        let mut bad = no_keys([1, 2, 3, 4]);
        bad.lse = Array3::zeros((1, 2, 2));
        let err = merge_into(&mut bad, &a).unwrap_err();
        assert!(matches!(err, AttnError::ShapeMismatch { .. }), "{err}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Any split of the keys into two sets, some rows seeing none of one of them,
        /// merges into the result over all keys.
        #[test]
        fn any_split_of_the_keys_merges_into_the_whole(
            tokens in 1usize..40,
            head_dim in 1usize..9,
            seed in any::<u64>(),
        ) {
            let shape = Shape::new(1, 2, tokens, head_dim);
            let [q, k, v] = random_qkv(shape, seed);
            let mut rng = SplitMix64::new(seed ^ 0x5eed);
            let in_a: Vec<bool> = (0..tokens).map(|_| rng.next_u64() & 1 == 1).collect();
            let a = rounded(&over_keys(&q, &k, &v, |j| in_a[j]));
            let b = rounded(&over_keys(&q, &k, &v, |j| !in_a[j]));
            let whole = attention_f64(q.view(), k.view(), v.view()).unwrap();
            let (out, lse) = errors(&merge(&a, &b).unwrap(), &whole);
            prop_assert!(
                out <= MERGE_MAX_ABS && lse <= MERGE_MAX_ABS,
                "{} with A = {:?}: out {:e}, lse {:e}", shape, in_a, out, lse
            );
        }
    }
}
