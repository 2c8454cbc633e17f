//! # Step 01: attention by hand
//!
//! Causal attention exactly as the formula reads, `softmax(mask(q·kᵀ/√d))·v`, with every
//! intermediate kept: a table of scores with one row and one column per token, for every
//! head of every sequence. Its memory grows with the square of the length; the later steps
//! exist to remove it. Its result is what every later step is checked against, through the
//! `f64` reference of the shared core (`steps/00-core`), where the input checks, the error
//! type and the seeded inputs live too.
//!
//! ## Layout
//!
//! - [`attention`]: the method itself, in four visible stages ([`scores`],
//!   [`apply_causal_mask`], [`softmax_rows`], then the product with v).
//! - [`Naive`]: the method as the benchmark's registry lists it ([`methods`]).
//! - [`exercise`]: the checker of chapter 1's exercise, the softmax of one row.

pub mod exercise;

use flash_core::{
    Attention, AttnError, Describe, Descriptor, Device, Dtype, Method, check_f32,
    check_qkv, try_zeros,
};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array3, Array4, ArrayView4, ArrayViewMut1, s};

/// This step's methods, as the benchmark and the cross-step tests run them.
pub fn methods() -> Vec<&'static dyn Method> {
    vec![&Naive]
}

// ANCHOR: naive_method
/// `naive`: [`attention`], the method every later one is checked against.
#[derive(Clone, Copy, Debug)]
pub struct Naive;

impl Describe for Naive {
    fn descriptor(&self) -> Descriptor {
        Descriptor::new(
            "naive",
            "01-naive",
            Device::Cpu,
            "attention by hand: the whole [b, h, T, T] table of scores, single-threaded",
        )
    }
}

impl Method for Naive {
    fn forward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        check_f32(dtype)?;
        attention(q, k, v)
    }
}
// ANCHOR_END: naive_method

// ANCHOR: by_hand
/// Causal attention by hand: `softmax(mask(q·kᵀ/√d))·v` for `[batch, heads, tokens,
/// head_dim]` inputs, materialising the whole `[batch, heads, tokens, tokens]` table of
/// scores.
///
/// Empty input (zero sequences, heads or tokens) gives an empty output. A table too large
/// to allocate gives [`AttnError::OutOfMemory`].
pub fn attention(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Attention, AttnError> {
    let shape = check_qkv(&q, &k, &v)?;
    if shape.is_empty() {
        return Ok(Attention::empty(shape));
    }
    let mut table = scores(q, k)?; // [b, h, T, T]: s_ij = q_i·k_j/√d
    apply_causal_mask(&mut table); // s_ij = −∞ where j > i
    let lse = softmax_rows(&mut table); // p_ij = e^(s_ij) / Σ_j e^(s_ij)
    let mut out = Array4::zeros(shape.dims());
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            // out_i = Σ_j p_ij v_j: the table times v
            let p = table.slice(s![b, h, .., ..]);
            general_mat_mul(
                1.0,
                &p,
                &v.slice(s![b, h, .., ..]),
                0.0,
                &mut out.slice_mut(s![b, h, .., ..]),
            );
        }
    }
    Ok(Attention { out, lse })
}
// ANCHOR_END: by_hand

// ANCHOR: scores
/// The table of scores, `s_ij = q_i·k_j / √d` for every query i and key j of every head:
/// one `tokens × tokens` matrix per head, `4·T²` bytes each.
pub fn scores(q: ArrayView4<f32>, k: ArrayView4<f32>) -> Result<Array4<f32>, AttnError> {
    let shape = check_qkv(&q, &k, &k)?;
    let [b_n, h_n, t_n, _] = shape.dims();
    let len = b_n
        .checked_mul(h_n)
        .and_then(|n| n.checked_mul(t_n))
        .and_then(|n| n.checked_mul(t_n));
    let buf = try_zeros::<f32>(&format!("the table of scores for {shape}"), len)?;
    let mut table =
        Array4::from_shape_vec((b_n, h_n, t_n, t_n), buf).expect("length is b·h·T·T");
    let scale = shape.scale() as f32;
    for b in 0..b_n {
        for h in 0..h_n {
            let (q, k) = (q.slice(s![b, h, .., ..]), k.slice(s![b, h, .., ..]));
            general_mat_mul(
                scale,
                &q,
                &k.t(),
                0.0,
                &mut table.slice_mut(s![b, h, .., ..]),
            );
        }
    }
    Ok(table)
}
// ANCHOR_END: scores

// ANCHOR: causal_mask
/// The causal mask: token i may look at tokens 0..=i only, so every score above the
/// diagonal becomes −∞, which the softmax turns into a probability of exactly 0.
pub fn apply_causal_mask(table: &mut Array4<f32>) {
    let t_n = table.shape()[2];
    for i in 0..t_n {
        // row i of every head: the keys after i
        table
            .slice_mut(s![.., .., i, i + 1..])
            .fill(f32::NEG_INFINITY);
    }
}
// ANCHOR_END: causal_mask

// ANCHOR: softmax
/// Turns each row of scores into probabilities in place, `p_ij = e^(s_ij − m_i) / ℓ_i` with
/// `m_i` the row's maximum (so no exponential overflows) and `ℓ_i = Σ_j e^(s_ij − m_i)`,
/// and returns each row's log-sum-exp `m_i + ln ℓ_i`.
pub fn softmax_rows(table: &mut Array4<f32>) -> Array3<f32> {
    let [b_n, h_n, t_n, _] = <[usize; 4]>::try_from(table.shape()).expect("4 dimensions");
    let mut lse = Array3::zeros((b_n, h_n, t_n));
    for (mut row, lse) in table.rows_mut().into_iter().zip(lse.iter_mut()) {
        *lse = softmax_row(row.as_slice_mut().expect("the table's rows are contiguous"));
    }
    lse
}

// ANCHOR: softmax_row
/// One row of [`softmax_rows`]: `row` becomes its probabilities, and the row's log-sum-exp
/// is returned. A masked score (−∞) becomes exactly 0.
pub fn softmax_row(row: &mut [f32]) -> f32 {
    let mut row = ArrayViewMut1::from(row);
    let max = row.fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    row.mapv_inplace(|x| (x - max).exp());
    let sum = row.sum();
    row.mapv_inplace(|x| x / sum);
    max + sum.ln()
}
// ANCHOR_END: softmax_row
// ANCHOR_END: softmax

/// The table of probabilities itself (scores, mask, softmax), for tests and the book.
pub fn probabilities(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
) -> Result<Array4<f32>, AttnError> {
    let mut table = scores(q, k)?;
    apply_causal_mask(&mut table);
    softmax_rows(&mut table);
    Ok(table)
}
