//! Chapter 4's exercise: softmax's backward on the GPU, written by the reader.
//! `exercises/softmax_backward.cu` is `kernels/by_hand_backward.cu` with the body of
//! `softmax_backward` (the row sum δ, its reduction over the warp, and dS = P ∘ (dP − δ)
//! with zeros past the diagonal) taken out; the `backward-exercise` binary runs the
//! backward by hand on the GPU with the reader's two row kernels in place of the step's
//! ([`cuda_by_hand::forward_backward_from`]) and holds out, dq, dk and dv to
//! FlashAttention's rule ([`BackwardCheck`]), as the GPU tests hold the backward by hand
//! itself.

use flash_core::inputs::{random_normal, random_qkv};
use flash_core::{AttnError, Shape};
use step03_cuda_forward::{Dtype, Gpu};

use crate::cuda_by_hand::{self, BY_HAND_BACKWARD_CU};
use crate::rule::BackwardCheck;

/// The exercises of this step, by the name the `backward-exercise` binary takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Exercise {
    /// dS = P ∘ (dP − δ) for a row of the table, a warp a row.
    SoftmaxBackward,
}

impl Exercise {
    /// The template the reader fills in, under the crate's folder.
    pub fn template(self) -> &'static str {
        match self {
            Exercise::SoftmaxBackward => "exercises/softmax_backward.cu",
        }
    }

    /// The solution's file, under the crate's folder.
    pub fn solution_file(self) -> &'static str {
        match self {
            Exercise::SoftmaxBackward => "kernels/by_hand_backward.cu",
        }
    }

    /// The solution's text.
    pub fn solution(self) -> &'static str {
        match self {
            Exercise::SoftmaxBackward => BY_HAND_BACKWARD_CU,
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
    let Exercise::SoftmaxBackward = exercise;
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
