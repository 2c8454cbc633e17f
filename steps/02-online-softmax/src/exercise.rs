//! Chapter 2's exercise, on the CPU: the online update, one block of keys into a query row's
//! running `m`, `ℓ` and output, written by the reader in `exercises/online_update.rs`. The
//! checker walks every row of seeded sequences through blocks of keys as
//! [`attention_blocked`](crate::attention_blocked) does, the last block of a row partly
//! masked, and after every block holds the row's output so far, `acc / ℓ`, and its
//! log-sum-exp so far, `m + ln ℓ`, to the `f64` reference over the keys seen, by
//! FlashAttention's rule against [`crate::blocked::online_update`], the function the
//! template was cut from. The `online-exercise` binary runs it on the reader's file.

use flash_core::Shape;
use flash_core::exercise::{NotYet, attempt, max_error, twice, within};
use flash_core::inputs::random_qkv;
use ndarray::{ArrayView2, s};

/// The template the reader fills in.
pub const TEMPLATE: &str = "steps/02-online-softmax/exercises/online_update.rs";

/// Where the solution is.
pub const SOLUTION: &str = "online_update in steps/02-online-softmax/src/blocked.rs \
     (chapter 2, Exercises, under Solution)";

/// The signature of the exercise: `(m, ℓ, acc, scores, v)`.
pub type Update<'a> = dyn Fn(&mut f32, &mut f32, &mut [f32], &[f32], ArrayView2<f32>) + 'a;

/// One case: tokens, head dim, block size, and what the queries are multiplied by.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub tokens: usize,
    pub head_dim: usize,
    pub block: usize,
    pub q_times: f32,
}

/// One token; blocks of one key; a last block of 13 keys of 16; blocks of 64 past the
/// length of a row; and queries times 40, whose scores reach past 88.7, where `e^s`
/// overflows `f32` unless the running maximum is subtracted.
pub const CASES: [Case; 5] = [
    Case {
        tokens: 1,
        head_dim: 64,
        block: 64,
        q_times: 1.0,
    },
    Case {
        tokens: 40,
        head_dim: 32,
        block: 1,
        q_times: 1.0,
    },
    Case {
        tokens: 77,
        head_dim: 64,
        block: 16,
        q_times: 1.0,
    },
    Case {
        tokens: 130,
        head_dim: 16,
        block: 64,
        q_times: 1.0,
    },
    Case {
        tokens: 50,
        head_dim: 64,
        block: 8,
        q_times: 40.0,
    },
];

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} token{}, head dim {}, blocks of {}",
            self.tokens,
            if self.tokens == 1 { "" } else { "s" },
            self.head_dim,
            self.block
        )?;
        if self.q_times != 1.0 {
            write!(f, ", queries times {}", self.q_times)?;
        }
        Ok(())
    }
}

/// A row after a block: where it is, its output and log-sum-exp so far.
struct Snapshot {
    at: String,
    out: Vec<f32>,
    lse: f32,
}

/// Runs `update` on every row of `case` and block of keys the row sees; a snapshot after
/// each block. A panic in `update` is a [`NotYet`].
fn run(case: Case, seed: u64, update: &Update) -> Result<Vec<Snapshot>, NotYet> {
    let shape = Shape::new(1, 1, case.tokens, case.head_dim);
    let [q, k, v] = random_qkv(shape, seed);
    let (q, k, v) = (
        q.slice(s![0, 0, .., ..]).mapv(|x| x * case.q_times),
        k.slice(s![0, 0, .., ..]),
        v.slice(s![0, 0, .., ..]),
    );
    let scale = shape.scale() as f32;
    let mut snapshots = Vec::new();
    for i in 0..case.tokens {
        let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
        let mut acc = vec![0.0f32; case.head_dim];
        for k0 in (0..=i).step_by(case.block) {
            let keys = k0..(k0 + case.block).min(case.tokens);
            // s_ij = q_i·k_j/√d as attention_blocked rounds it; −∞ after the query
            let scores: Vec<f32> = keys
                .clone()
                .map(|j| {
                    if j > i {
                        f32::NEG_INFINITY
                    } else {
                        q.row(i).dot(&k.row(j)) * scale
                    }
                })
                .collect();
            let at = format!("{case}: row {i}, after keys {}..{}", keys.start, keys.end);
            let values = v.slice(s![keys, ..]);
            attempt(&at, || update(&mut m, &mut l, &mut acc, &scores, values))?;
            if acc.len() != case.head_dim {
                return Err(NotYet::new(
                    at,
                    format!("acc has {} values, head dim {}", acc.len(), case.head_dim),
                ));
            }
            let out = acc.iter().map(|a| a / l).collect();
            snapshots.push(Snapshot {
                at,
                out,
                lse: m + l.ln(),
            });
        }
    }
    Ok(snapshots)
}

/// The `f64` reference of every snapshot [`run`] takes: the row's output and log-sum-exp
/// over the keys it has seen by then.
fn reference(case: Case, seed: u64) -> Vec<(Vec<f64>, f64)> {
    let shape = Shape::new(1, 1, case.tokens, case.head_dim);
    let [q, k, v] = random_qkv(shape, seed);
    let q = q.mapv(|x| x * case.q_times);
    let scale = shape.scale();
    let mut refs = Vec::new();
    for i in 0..case.tokens {
        let s: Vec<f64> = (0..=i)
            .map(|j| {
                let dot: f64 = (0..case.head_dim)
                    .map(|d| f64::from(q[[0, 0, i, d]]) * f64::from(k[[0, 0, j, d]]))
                    .sum();
                dot * scale
            })
            .collect();
        for k0 in (0..=i).step_by(case.block) {
            let seen = &s[..(k0 + case.block).min(i + 1)];
            let max = seen.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = seen.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = p.iter().sum();
            let out = (0..case.head_dim)
                .map(|d| {
                    p.iter()
                        .enumerate()
                        .map(|(j, p)| p * f64::from(v[[0, 0, j, d]]))
                        .sum::<f64>()
                        / sum
                })
                .collect();
            refs.push((out, max + sum.ln()));
        }
    }
    refs
}

/// Checks `update` (the reader's) on every case: after every block, the row's output so far
/// and its log-sum-exp so far within twice the error of the step's own
/// [`online_update`](crate::blocked::online_update) against the `f64` reference (or of one
/// rounding, where the step's is smaller). The number of cases, or the first row and block
/// that fails and why.
pub fn check(update: &Update) -> Result<usize, NotYet> {
    let rule = "twice the error of the step's online_update";
    for (n, case) in CASES.into_iter().enumerate() {
        let seed = 200 + n as u64;
        let refs = reference(case, seed);
        let ours = run(case, seed, &crate::blocked::online_update)?;
        let (mut out_error, mut lse_error, mut lse_size) = (0.0f64, 0.0f64, 0.0f64);
        for (o, (r, r_lse)) in ours.iter().zip(&refs) {
            out_error = out_error.max(max_error(&o.out, r));
            lse_error = lse_error.max(max_error(&[o.lse], &[*r_lse]));
            lse_size = lse_size.max(r_lse.abs());
        }
        let yours = run(case, seed, update)?;
        for (y, (r, r_lse)) in yours.iter().zip(&refs) {
            within(
                &y.at,
                "the output so far (acc / ℓ)",
                &y.out,
                r,
                twice(out_error, 1.0),
                rule,
            )?;
            let allowed = twice(lse_error, lse_size);
            within(
                &y.at,
                "the log-sum-exp so far (m + ln ℓ)",
                &[y.lse],
                &[*r_lse],
                allowed,
                rule,
            )?;
        }
    }
    Ok(CASES.len())
}
