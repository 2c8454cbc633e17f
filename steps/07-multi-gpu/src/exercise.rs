//! Chapter 7's exercise, on the CPU: the merge of two partial results of a row over
//! disjoint sets of keys, through their log-sum-exps, written by the reader in
//! `exercises/merge_row.rs`. The checker splits the keys of every row of seeded sequences
//! in two, computes each part's partial result in `f64` and rounds it to `f32` (what a
//! rank holds), has the reader's function merge them, and holds the merged output and
//! log-sum-exp to the `f64` attention over the union of the parts, by FlashAttention's rule
//! against [`merge_row`](crate::merge::merge_row), the function the template was cut from.
//! The `ring-exercise` binary runs it on the reader's file.

use flash_core::Shape;
use flash_core::exercise::{NotYet, attempt, max_error, twice, within};
use flash_core::inputs::random_qkv;
use ndarray::{Array2, ArrayView1, ArrayViewMut1, s};

/// The template the reader fills in.
pub const TEMPLATE: &str = "steps/07-multi-gpu/exercises/merge_row.rs";

/// Where the solution is.
pub const SOLUTION: &str =
    "merge_row in steps/07-multi-gpu/src/merge.rs (chapter 7, Exercises, under Solution)";

/// The signature of the exercise: `(o_a, lse_a, o_b, lse_b)`.
pub type Merge<'a> = dyn Fn(ArrayViewMut1<f32>, &mut f32, ArrayView1<f32>, f32) + 'a;

/// One case: a name, tokens, head dim, what the queries are multiplied by, and which keys
/// of row `i` each part holds (key `j` goes to part A where `part(i, j)` is 0, to part B
/// where it is 1, to neither where it is 2).
pub struct Case {
    pub name: &'static str,
    pub tokens: usize,
    pub head_dim: usize,
    pub q_times: f32,
    pub part: fn(usize, usize) -> u8,
}

/// Keys split at the middle of the row, so that row 0's part B is empty; even and odd keys;
/// every key in part A; keys `j mod 3 = 1` and `2`, so that row 0 sees neither part and
/// the merge of two empty parts must stay empty, `(0, −∞)`; and even and odd keys with the
/// queries times 40, whose log-sum-exps pass 88.7, where `e^lse` overflows `f32`.
pub fn cases() -> [Case; 5] {
    [
        Case {
            name: "keys before the middle of the row and after it",
            tokens: 60,
            head_dim: 64,
            q_times: 1.0,
            part: |i, j| u8::from(2 * j > i),
        },
        Case {
            name: "even keys and odd keys",
            tokens: 33,
            head_dim: 32,
            q_times: 1.0,
            part: |_, j| (j % 2) as u8,
        },
        Case {
            name: "every key in part A, none in part B",
            tokens: 20,
            head_dim: 16,
            q_times: 1.0,
            part: |_, _| 0,
        },
        Case {
            name: "keys j mod 3 = 1 and 2, key j mod 3 = 0 in neither",
            tokens: 30,
            head_dim: 64,
            q_times: 1.0,
            part: |_, j| [2, 0, 1][j % 3],
        },
        Case {
            name: "even keys and odd keys, queries times 40",
            tokens: 40,
            head_dim: 64,
            q_times: 40.0,
            part: |_, j| (j % 2) as u8,
        },
    ]
}

/// The output and log-sum-exp, in `f64`, of a row whose scores are `s` over the keys
/// `keys`; `(0, −∞)` for no key.
fn partial(s: &[f64], v: &Array2<f64>, keys: &[usize]) -> (Vec<f64>, f64) {
    let max = keys.iter().map(|&j| s[j]).fold(f64::NEG_INFINITY, f64::max);
    if keys.is_empty() {
        return (vec![0.0; v.ncols()], max);
    }
    let p: Vec<f64> = keys.iter().map(|&j| (s[j] - max).exp()).collect();
    let sum: f64 = p.iter().sum();
    let out = (0..v.ncols())
        .map(|d| {
            keys.iter()
                .zip(&p)
                .map(|(&j, p)| p * v[[j, d]])
                .sum::<f64>()
                / sum
        })
        .collect();
    (out, max + sum.ln())
}

/// A row's two partial results, rounded to `f32`, and the `f64` reference over their union.
struct Row {
    a: (Vec<f32>, f32),
    b: (Vec<f32>, f32),
    reference: (Vec<f64>, f64),
}

fn rows(case: &Case, seed: u64) -> Vec<Row> {
    let shape = Shape::new(1, 1, case.tokens, case.head_dim);
    let [q, k, v] = random_qkv(shape, seed);
    let (q, k) = (q.slice(s![0, 0, .., ..]), k.slice(s![0, 0, .., ..]));
    let v = v.slice(s![0, 0, .., ..]).mapv(f64::from);
    let round =
        |(o, lse): (Vec<f64>, f64)| (o.iter().map(|&x| x as f32).collect(), lse as f32);
    (0..case.tokens)
        .map(|i| {
            let s: Vec<f64> = (0..=i)
                .map(|j| {
                    let dot: f64 = q
                        .row(i)
                        .iter()
                        .zip(k.row(j))
                        .map(|(&q, &k)| f64::from(q * case.q_times) * f64::from(k))
                        .sum();
                    dot * shape.scale()
                })
                .collect();
            let keys = |p: u8| -> Vec<usize> {
                (0..=i).filter(|&j| (case.part)(i, j) == p).collect()
            };
            let (a, b) = (keys(0), keys(1));
            let union: Vec<usize> = (0..=i).filter(|&j| (case.part)(i, j) < 2).collect();
            Row {
                a: round(partial(&s, &v, &a)),
                b: round(partial(&s, &v, &b)),
                reference: partial(&s, &v, &union),
            }
        })
        .collect()
}

/// Merges every row's part B into its part A with `merge`; the merged `(o, lse)` of each.
fn run(case: &Case, rows: &[Row], merge: &Merge) -> Result<Vec<(Vec<f32>, f32)>, NotYet> {
    rows.iter()
        .enumerate()
        .map(|(i, row)| {
            let (mut o, mut lse) = row.a.clone();
            let at = format!("{}: row {i}", case.name);
            attempt(&at, || {
                merge(
                    ArrayViewMut1::from(&mut o[..]),
                    &mut lse,
                    ArrayView1::from(&row.b.0[..]),
                    row.b.1,
                )
            })?;
            Ok((o, lse))
        })
        .collect()
}

/// Checks `merge` (the reader's) on every row of every case: the merged output and
/// log-sum-exp within twice the error of the step's own
/// [`merge_row`](crate::merge::merge_row) against the `f64` attention over the union of the
/// parts (or of one rounding, where the step's is smaller); a row that saw no key in
/// either part must stay exactly `(0, −∞)`. The number of cases, or the first row that
/// fails and why.
pub fn check(merge: &Merge) -> Result<usize, NotYet> {
    let rule = "twice the error of the step's merge_row";
    let cases = cases();
    for (n, case) in cases.iter().enumerate() {
        let rows = rows(case, 700 + n as u64);
        let ours = run(case, &rows, &crate::merge::merge_row)?;
        let (mut out_error, mut lse_error, mut lse_size) = (0.0f64, 0.0f64, 0.0f64);
        for ((o, lse), row) in ours.iter().zip(&rows) {
            out_error = out_error.max(max_error(o, &row.reference.0));
            if row.reference.1.is_finite() {
                lse_error = lse_error.max(max_error(&[*lse], &[row.reference.1]));
                lse_size = lse_size.max(row.reference.1.abs());
            }
        }
        let yours = run(case, &rows, merge)?;
        for (i, ((o, lse), row)) in yours.iter().zip(&rows).enumerate() {
            let at = format!("{}: row {i}", case.name);
            within(
                &at,
                "the merged output",
                o,
                &row.reference.0,
                twice(out_error, 1.0),
                rule,
            )?;
            let allowed = twice(lse_error, lse_size);
            within(
                &at,
                "the merged log-sum-exp",
                &[*lse],
                &[row.reference.1],
                allowed,
                rule,
            )?;
        }
    }
    Ok(cases.len())
}
