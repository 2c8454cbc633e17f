//! # What every step shares
//!
//! The small core the steps are built on, so that each step only adds: the shape of an
//! attention call and the error every method returns, the checks every method runs before
//! any work, the seeded inputs, the `f64` reference every method is checked against, the
//! types of the method registry, the FLOP count, the one timing loop, and the benchmark's
//! row as the JSON files hold it.
//!
//! ## Layout
//!
//! - [`check`]: [`Shape`], [`AttnError`], [`check_qkv`] and [`try_zeros`].
//! - [`exercise`]: what the CPU exercise checkers share: a panic in a reader's code as a
//!   verdict ([`exercise::attempt`]), and the verdict printed ([`exercise::report`]).
//! - [`files`]: files a user makes, written whole or not at all ([`files::write_atomic`]),
//!   and output paths checked before the work ([`files::check_output`]).
//! - [`Attention`]: what every forward method returns, the output and each row's
//!   log-sum-exp.
//! - [`inputs`]: seeded normal inputs, the same on every machine.
//! - [`reference`]: causal attention in `f64`, and the one error measure.
//! - [`method`]: [`Method`], [`Describe`], [`Device`], [`Dtype`]: one trait for every
//!   method, so one test table and one benchmark run them all.
//! - [`timing`]: the median of timed runs after a warm-up, on the CPU's clock or a device's
//!   events.
//! - [`row`]: [`Row`], one measurement as `charts/data/*.json` holds it.

pub mod check;
pub mod exercise;
pub mod files;
pub mod inputs;
pub mod method;
pub mod reference;
pub mod row;
pub mod timing;

pub use check::{
    AttnError, Pass, Shape, check_finite, check_qkv, check_same, memory_and_swap, try_zeros,
};
pub use method::{Describe, Descriptor, Device, Dtype, Method, check_f32};
pub use row::Row;

use ndarray::{Array3, Array4};

/// What every forward method returns.
#[derive(Clone, Debug)]
pub struct Attention {
    /// `[batch, heads, tokens, head_dim]`
    pub out: Array4<f32>,
    /// `[batch, heads, tokens]`: each row's natural log-sum-exp of its scaled scores, the
    /// one number per row that lets the backward pass rebuild the probabilities (step 04).
    pub lse: Array3<f32>,
}

impl Attention {
    /// The output of an empty call (no sequence, head or token): arrays with a zero
    /// dimension.
    pub fn empty(shape: Shape) -> Self {
        Attention {
            out: Array4::zeros(shape.dims()),
            lse: Array3::zeros((shape.batch, shape.heads, shape.tokens)),
        }
    }
}
