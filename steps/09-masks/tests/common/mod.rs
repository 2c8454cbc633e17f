//! What the tests share: the masks and score functions every test runs, seeded inputs of a
//! grouped, chunked-prefill shape, and FlashAttention's rule.

#![allow(dead_code)]

use flash_core::Shape;
use flash_core::inputs::random_normal;
use flash_core::reference::{Error, error};
use ndarray::{Array4, ArrayBase, Data, Dimension};
use step09_masks::{CustomMask, CustomScore, Documents, Mask, ScoreMod, Varies};

/// q, k, v and dO: `batch` sequences, `heads` query heads on `kv_heads`, `tq` queries (the
/// last ones) on `tk` keys, head dim `d`.
pub struct Inputs {
    pub q: Array4<f32>,
    pub k: Array4<f32>,
    pub v: Array4<f32>,
    pub dout: Array4<f32>,
}

pub fn inputs(
    (batch, heads, kv_heads, tq, tk, d): (usize, usize, usize, usize, usize, usize),
    seed: u64,
) -> Inputs {
    Inputs {
        q: random_normal(Shape::new(batch, heads, tq, d), seed),
        k: random_normal(Shape::new(batch, kv_heads, tk, d), seed + 1),
        v: random_normal(Shape::new(batch, kv_heads, tk, d), seed + 2),
        dout: random_normal(Shape::new(batch, heads, tq, d), seed + 3),
    }
}

/// Every built-in mask and a custom one, for 2 sequences of `tk ≥ 6` keys: documents per
/// sequence from `cu_seqlens` (the second sequence's last token a document of its own), and
/// one packing for every sequence.
pub fn masks(tk: usize) -> Vec<Mask> {
    let third = tk / 3;
    vec![
        Mask::Causal,
        Mask::Full,
        Mask::Sliding { window: 10 },
        Mask::PrefixLm { prefix: 20 },
        Mask::Documents(
            Documents::from_cu_seqlens(
                tk,
                &[vec![0, third, 2 * third, tk], vec![0, tk - 1, tk]],
            )
            .unwrap(),
        ),
        Mask::Documents(
            Documents::from_lengths(&[third, third + 1, tk - 2 * third - 1]).unwrap(),
        ),
        // a mask that differs between heads, with gaps inside the causal part
        Mask::Custom(CustomMask::new("stripes", |_, h, q, k| {
            k <= q && (k + h) % 3 != 0
        })),
    ]
}

/// Every score function: none, soft-capping at 5 (so that it bites on scores of order 1),
/// ALiBi for `heads`, and a custom one with its derivative.
pub fn score_mods(heads: usize) -> Vec<ScoreMod> {
    vec![
        ScoreMod::None,
        ScoreMod::SoftCap { cap: 5.0 },
        ScoreMod::Alibi { heads },
        ScoreMod::Custom(CustomScore::new(
            "wobble",
            |s, _, h, _, _| s + 0.3 * (s * (h + 1) as f64).sin(),
            |s, _, h, _, _| 1.0 + 0.3 * (h + 1) as f64 * (s * (h + 1) as f64).cos(),
        )),
    ]
}

/// A mask under which some rows see no key: rows before position 60 see nothing, and after
/// it every fifth position sees nothing either.
pub fn mask_with_empty_rows() -> Mask {
    let mask = CustomMask::new("late", |_, _, q, k| {
        q >= 60 && !q.is_multiple_of(5) && k <= q
    });
    Mask::Custom(mask.varying(Varies {
        batch: false,
        head: false,
    }))
}

/// The error of `got` against `want`, where a `want` of −∞ (a row that saw no key) must be
/// matched exactly and is otherwise left out.
pub fn error_with_infinities<A, B, D>(
    got: &ArrayBase<A, D>,
    want: &ArrayBase<B, D>,
) -> Error
where
    A: Data<Elem = f32>,
    B: Data<Elem = f64>,
    D: Dimension,
{
    let mut bad = false;
    let got_f = got.mapv(f64::from);
    let mut g = got_f.clone();
    let mut w = want.to_owned();
    ndarray::Zip::from(&mut g).and(&mut w).for_each(|g, w| {
        if w.is_infinite() {
            bad |= *g != *w;
            (*g, *w) = (0.0, 0.0);
        }
    });
    let mut e = error(&g, &w);
    if bad {
        e.max_abs = f64::INFINITY;
    }
    e
}

/// FlashAttention's rule: the method's max-abs error against `f64` at most twice that of
/// attention by hand in `f32`, plus 10⁻⁶ for cases where both are near zero.
pub fn assert_rule(what: &str, ours: Error, by_hand: Error) {
    assert!(
        ours.max_abs <= 2.0 * by_hand.max_abs + 1e-6,
        "{what}: ours {ours}, attention by hand in f32 {by_hand}"
    );
}
