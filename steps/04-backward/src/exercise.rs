//! Chapter 4's exercises. On the CPU, [`Exercise::GradScores`]: δ = rowsum(dO ∘ O) and
//! dS = P ∘ (dP − δ) for one block, written in Rust in `exercises/grad_scores.rs` and held
//! on every block of seeded sequences to the `f64` dS by FlashAttention's rule against the
//! step's own ([`check_grad_scores`]). On the GPU, [`Exercise::SoftmaxBackward`]:
//! softmax's backward, written by the reader.
//! `exercises/softmax_backward.cu` is `kernels/by_hand_backward.cu` with the body of
//! `softmax_backward` (the row sum δ, its reduction over the warp, and dS = P ∘ (dP − δ)
//! with zeros past the diagonal) taken out; the `backward-exercise` binary runs the
//! backward by hand on the GPU with the reader's two row kernels in place of the step's
//! ([`cuda_by_hand::forward_backward_from`]) and holds out, dq, dk and dv to
//! FlashAttention's rule ([`BackwardCheck`]), as the GPU tests hold the backward by hand
//! itself.

use std::ops::Range;

use flash_core::exercise::{NotYet, attempt, max_error, twice, within, zero_where};
use flash_core::inputs::{random_normal, random_qkv};
use flash_core::reference::attention_f64;
use flash_core::{AttnError, Shape};
use ndarray::{Array2, ArrayView2, ArrayViewMut2, Axis, s};
use step03_cuda_forward::gpu::{Dtype, Gpu};

use crate::cuda_by_hand::{self, BY_HAND_BACKWARD_CU};
use crate::rule::BackwardCheck;

/// The exercises of this step, by the name the `backward-exercise` binary takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Exercise {
    /// dS = P ∘ (dP − δ) for a row of the table, a warp a row (needs a GPU).
    SoftmaxBackward,
    /// δ = rowsum(dO ∘ O) and dS = P ∘ (dP − δ) for one block, in Rust on the CPU.
    GradScores,
}

impl Exercise {
    /// The template the reader fills in, under the crate's folder.
    pub fn template(self) -> &'static str {
        match self {
            Exercise::SoftmaxBackward => "exercises/softmax_backward.cu",
            Exercise::GradScores => "exercises/grad_scores.rs",
        }
    }

    /// The solution's file, under the crate's folder.
    pub fn solution_file(self) -> &'static str {
        match self {
            Exercise::SoftmaxBackward => "kernels/by_hand_backward.cu",
            Exercise::GradScores => "src/blockwise.rs",
        }
    }

    /// The solution's text.
    pub fn solution(self) -> &'static str {
        match self {
            Exercise::SoftmaxBackward => BY_HAND_BACKWARD_CU,
            Exercise::GradScores => include_str!("blockwise.rs"),
        }
    }
}

/// Sequences, heads, tokens and head dim of each case: one token, rows shorter than a warp
/// and rows that leave a partial warp's worth of keys, odd numbers of sequences and heads,
/// and head dim 32.
pub const CASES: [(usize, usize, usize, usize); 5] = [
    (1, 1, 1, 64),
    (3, 5, 77, 64),
    (2, 3, 128, 64),
    (3, 1, 300, 64),
    (2, 3, 190, 32),
];

/// Runs the backward by hand with the row kernels of `kernel` (the text of a reader's file)
/// on every case in bf16 and f16, after the forward by hand, and measures each run; `each`
/// sees every check as it is made. An error where the file does not compile or a launch
/// fails.
pub fn check(
    gpu: &Gpu,
    exercise: Exercise,
    kernel: &str,
    mut each: impl FnMut(&BackwardCheck),
) -> Result<Vec<BackwardCheck>, AttnError> {
    if exercise != Exercise::SoftmaxBackward {
        return Err(AttnError::Unsupported {
            what: format!(
                "{exercise:?} is checked on the CPU ({}), not as a kernel",
                exercise.template()
            ),
        });
    }
    let mut checks = Vec::new();
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for (seed, (batch, heads, tokens, head_dim)) in CASES.into_iter().enumerate() {
            let shape = Shape::new(batch, heads, tokens, head_dim);
            let seed = 4000 + seed as u64;
            let [q, k, v] = random_qkv(shape, seed);
            let dout = random_normal(shape, seed + 99);
            let check = BackwardCheck::run(
                gpu,
                |gpu: &Gpu, q, k, v, dout, dtype| {
                    cuda_by_hand::forward_backward_from(gpu, kernel, q, k, v, dout, dtype)
                },
                [&q, &k, &v, &dout],
                dtype,
                &format!("yours {shape}"),
            )?;
            each(&check);
            checks.push(check);
        }
    }
    Ok(checks)
}

/// The signature of the CPU exercise, [`Exercise::GradScores`]: `(out, dout, p, ds)`, `ds`
/// holding `dP` on entry.
pub type GradScores<'a> =
    dyn Fn(ArrayView2<f32>, ArrayView2<f32>, ArrayView2<f32>, ArrayViewMut2<f32>) + 'a;

/// Where the CPU exercise's solution is.
pub const GRAD_SCORES_SOLUTION: &str = "delta and grad_scores in steps/04-backward/src/blockwise.rs \
     (chapter 4, Exercises, under Solution)";

/// One case of the CPU exercise: tokens, head dim, the block's rows and columns, and what
/// the queries are multiplied by.
#[derive(Clone, Copy, Debug)]
pub struct BlockCase {
    pub tokens: usize,
    pub head_dim: usize,
    pub rows: usize,
    pub cols: usize,
    pub q_times: f32,
}

/// One token; blocks of 32 queries by 16 keys, so that most of a row lies outside any one
/// block, and partial blocks at the end; blocks of 8 by 8; and queries times 8, whose
/// probabilities are near 0 or 1.
pub const BLOCK_CASES: [BlockCase; 4] = [
    BlockCase {
        tokens: 1,
        head_dim: 64,
        rows: 64,
        cols: 64,
        q_times: 1.0,
    },
    BlockCase {
        tokens: 77,
        head_dim: 64,
        rows: 32,
        cols: 16,
        q_times: 1.0,
    },
    BlockCase {
        tokens: 50,
        head_dim: 32,
        rows: 8,
        cols: 8,
        q_times: 1.0,
    },
    BlockCase {
        tokens: 40,
        head_dim: 16,
        rows: 16,
        cols: 8,
        q_times: 8.0,
    },
];

impl std::fmt::Display for BlockCase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} token{}, head dim {}, blocks of {} queries × {} keys",
            self.tokens,
            if self.tokens == 1 { "" } else { "s" },
            self.head_dim,
            self.rows,
            self.cols
        )?;
        if self.q_times != 1.0 {
            write!(f, ", queries times {}", self.q_times)?;
        }
        Ok(())
    }
}

/// A case's inputs in `f32` (the forward's output, dO, P and dP, each rounded from `f64`)
/// and the `f64` dS they approximate, every table `[tokens, ·]`.
struct BlockInputs {
    out: Array2<f32>,
    dout: Array2<f32>,
    p: Array2<f32>,
    dp: Array2<f32>,
    ds: Array2<f64>,
}

fn block_inputs(case: BlockCase, seed: u64) -> BlockInputs {
    let shape = Shape::new(1, 1, case.tokens, case.head_dim);
    let [q, k, v] = random_qkv(shape, seed);
    let q = q.mapv(|x| x * case.q_times);
    let dout = random_normal(shape, seed + 99);
    let fwd =
        attention_f64(q.view(), k.view(), v.view()).expect("seeded inputs of one shape");
    let at = s![0, 0, .., ..];
    let (q, k, v) = (
        q.slice(at).mapv(f64::from),
        k.slice(at).mapv(f64::from),
        v.slice(at).mapv(f64::from),
    );
    let dout64 = dout.slice(at).mapv(f64::from);
    let (t_n, lse) = (case.tokens, fwd.lse.slice(s![0, 0, ..]).to_owned());
    // P_ij = e^(s_ij − lse_i), 0 after the query; dP = dO·Vᵀ; δ_i = Σ_j P_ij·dP_ij
    let p = Array2::from_shape_fn((t_n, t_n), |(i, j)| {
        if j > i {
            0.0
        } else {
            (q.row(i).dot(&k.row(j)) * shape.scale() - lse[i]).exp()
        }
    });
    let dp = dout64.dot(&v.t());
    let delta: Vec<f64> = (0..t_n).map(|i| p.row(i).dot(&dp.row(i))).collect();
    let ds =
        Array2::from_shape_fn((t_n, t_n), |(i, j)| p[[i, j]] * (dp[[i, j]] - delta[i]));
    BlockInputs {
        out: fwd.out.slice(at).mapv(|x| x as f32),
        dout: dout.slice(at).to_owned(),
        p: p.mapv(|x| x as f32),
        dp: dp.mapv(|x| x as f32),
        ds,
    }
}

/// The blocks the blockwise backward visits, `(queries, keys)`: every pair with a key at or
/// before one of the block's queries.
fn blocks(case: BlockCase) -> Vec<(Range<usize>, Range<usize>)> {
    let mut pairs = Vec::new();
    for i0 in (0..case.tokens).step_by(case.rows) {
        let rows = i0..(i0 + case.rows).min(case.tokens);
        for j0 in (0..rows.end).step_by(case.cols) {
            pairs.push((rows.clone(), j0..(j0 + case.cols).min(case.tokens)));
        }
    }
    pairs
}

/// The step's own dS for a block, as `Head::grad_scores` computes it: δ from the rows of
/// the output and its gradient ([`delta`](crate::blockwise::delta)), then `P ∘ (dP − δ)`.
pub fn grad_scores_of_the_step(
    out: ArrayView2<f32>,
    dout: ArrayView2<f32>,
    p: ArrayView2<f32>,
    mut ds: ArrayViewMut2<f32>,
) {
    let (out, dout) = (
        out.insert_axis(Axis(0)).insert_axis(Axis(0)),
        dout.insert_axis(Axis(0)).insert_axis(Axis(0)),
    );
    let delta = crate::blockwise::delta(out, dout);
    for ((mut ds, p), &delta) in ds.rows_mut().into_iter().zip(p.rows()).zip(&delta) {
        ds.zip_mut_with(&p, |d, &p| *d = p * (*d - delta));
    }
}

/// A block's dS, its `f64` reference and where P is 0, flattened row-major.
struct Block {
    at: String,
    ds: Vec<f32>,
    expected: Vec<f64>,
    masked: Vec<bool>,
}

/// Runs `grad_scores` on every block of `case`.
fn run_blocks(
    case: BlockCase,
    inputs: &BlockInputs,
    grad_scores: &GradScores,
) -> Result<Vec<Block>, NotYet> {
    blocks(case)
        .into_iter()
        .map(|(rows, cols)| {
            let at = format!(
                "{case}: the block of queries {}..{} and keys {}..{}",
                rows.start, rows.end, cols.start, cols.end
            );
            let mut ds = inputs.dp.slice(s![rows.clone(), cols.clone()]).to_owned();
            attempt(&at, || {
                grad_scores(
                    inputs.out.slice(s![rows.clone(), ..]),
                    inputs.dout.slice(s![rows.clone(), ..]),
                    inputs.p.slice(s![rows.clone(), cols.clone()]),
                    ds.view_mut(),
                )
            })?;
            let p = inputs.p.slice(s![rows.clone(), cols.clone()]);
            let masked = p.iter().map(|&p| p == 0.0).collect();
            let expected = inputs.ds.slice(s![rows, cols]).iter().copied().collect();
            let ds = ds.iter().copied().collect();
            Ok(Block {
                at,
                ds,
                expected,
                masked,
            })
        })
        .collect()
}

/// Checks `grad_scores` (the reader's) on every block of every case: the block's dS within
/// twice the error of [`grad_scores_of_the_step`] against the `f64` dS (or of one rounding,
/// where the step's is smaller), exactly 0 where P is. The number of cases, or the first
/// block that fails and why.
pub fn check_grad_scores(grad_scores: &GradScores) -> Result<usize, NotYet> {
    let rule = "twice the error of the step's delta and grad_scores";
    for (n, case) in BLOCK_CASES.into_iter().enumerate() {
        let inputs = block_inputs(case, 4400 + n as u64);
        let ours = run_blocks(case, &inputs, &grad_scores_of_the_step)?;
        let error = ours
            .iter()
            .map(|b| max_error(&b.ds, &b.expected))
            .fold(0.0, f64::max);
        for b in run_blocks(case, &inputs, grad_scores)? {
            // entry [r, c] of a block is r·cols + c
            let what = format!("dS (row-major, {} keys a row)", case.cols);
            let what = what.as_str();
            within(&b.at, what, &b.ds, &b.expected, twice(error, 1.0), rule)?;
            zero_where(&b.at, what, &b.ds, |i| b.masked[i], "P is 0 there")?;
        }
    }
    Ok(BLOCK_CASES.len())
}
