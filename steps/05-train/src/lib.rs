//! # Step 05: training a GPT with our kernels
//!
//! A GPT-2-style decoder (Radford et al. 2019) over bytes, trained on real text, whose
//! attention is ours: step 02's online-softmax forward, which keeps each row's log-sum-exp,
//! and step 04's blockwise backward, which rebuilds the probabilities from it. Everything
//! around them is written here by hand, forward and backward, on `ndarray` in `f32`: the
//! embeddings, LayerNorm, the fused q/k/v projection, the MLP with GELU, the tied output
//! layer and the cross-entropy; then AdamW, the learning rate's schedule and gradient
//! clipping. This is the CPU model, the one CI trains. The GPU trainer ([`cuda`]) is the
//! same model on the GPU, with step 03's forward kernel and step 04's backward kernels as
//! its attention, and is checked against the CPU model, as llm.c checks its CUDA trainer
//! against its C one.
//!
//! The layers are generic over the float type ([`layers::Float`]): in `f64`, with the `f64`
//! references of steps 01 and 04 in place of our kernels, the same code gives the gradients
//! that the `f32` model's are checked against, and finite differences of its loss check
//! those.
// [step 09]
//!
//! With `train --documents` (step 09) the files packed into a window stay apart: a token
//! attends to the earlier tokens of its own file only, through step 09's document mask
//! ([`data::window_documents`] gives each token its file), on both CPU paths.
// [/step 09]
//!
//! ## Layout
//!
//! - [`layers`]: each layer's forward and backward, and the float types.
//! - [`model`]: [`Config`], [`Params`] (one struct of arrays, named as GPT-2's, with a flat
//!   view by name for the optimizer and the checkpoints), [`forward`] and [`backward`].
//! - [`fast`]: the same model's fast path on the CPU, checked against [`model`]: a shard
//!   of the batch per thread, the products by faer, fused element-wise passes.
//! - [`optim`]: [`AdamW`], the [`Schedule`] of the learning rate, [`clip_grad_norm`].
//! - [`data`]: the [`Corpus`] (split by file into training and held-out bytes) and the
//!   batches, drawn from a seed and the step.
//! - [`checkpoint`]: [`Checkpoint`]s as safetensors files, written whole or not at all.
//! - [`flag`]: the command line's numbers, checked where they enter.
//! - [`train`](mod@train): [`Trainer`], the [`Learner`] the loop trains (CPU or GPU), the
//!   loop (stopped by Ctrl-C, saving along the way: [`train_with`]) and its record, and
//!   [`sample`].
//! - [`cuda`]: [`GpuTrainer`](cuda::GpuTrainer), the model on the GPU (`kernels/train.cu`,
//!   cuBLAS, and the kernels of steps 03 and 04).
//! - `src/main.rs`: the command, `train` (`--device cpu|cuda`) and `sample`.

pub mod checkpoint;
pub mod cuda;
pub mod data;
pub mod exercise;
pub mod fast;
pub mod flag;
pub mod layers;
pub mod model;
pub mod optim;
pub mod train;

use std::path::Path;

pub use checkpoint::Checkpoint;
pub use data::{Batch, Corpus};
pub use model::{Config, Params, backward, forward, loss};
pub use optim::{AdamW, AdamWSettings, Schedule, clip_grad_norm};
pub use train::{
    Control, Learner, RunRecord, Settings, Trainer, sample, train, train_with,
};

use flash_core::AttnError;
use flash_core::files::FileError;

/// What can go wrong, each with a message that says what was wrong and what is accepted.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A model or run that cannot be: a shape, a length, a flag.
    #[error("{0}")]
    Config(String),
    /// A corpus that cannot be trained on.
    #[error("{0}")]
    Data(String),
    /// A checkpoint that cannot be read or does not fit.
    #[error("{0}")]
    Checkpoint(String),
    /// A file that could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// An output that cannot be written where it was asked for, or a write that failed
    /// (and left the old file as it was).
    #[error("{0}")]
    File(#[from] FileError),
    /// The attention refused its inputs.
    #[error("attention: {0}")]
    Attention(#[from] AttnError),
    /// The GPU: none, a missing library, a failed launch, or out of its memory.
    #[error("GPU: {0}")]
    Device(AttnError),
}

impl TrainError {
    pub fn io(path: &Path, source: std::io::Error) -> TrainError {
        TrainError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}
