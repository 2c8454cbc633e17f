//! The backward of attention by hand: the chain rule in `f32` through two whole tables, the
//! probabilities `P` and their gradient `dP`, `[batch, heads, tokens, tokens]` each.
//!
//! It is the backward that goes with step 01's forward if that forward had kept its table:
//! the table is made again exactly as step 01 makes it ([`step01_naive::probabilities`]),
//! and the forward's result is used only for its shape. Its memory is `2·B·H·T²·4` bytes,
//! twice the forward's; a table too large to allocate gives [`AttnError::OutOfMemory`].

use flash_core::{Attention, AttnError, Shape, try_zeros};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array4, ArrayView4, s};

use crate::{Grads, check_backward};

// ANCHOR: by_hand_backward
/// The gradients of q, k and v through the whole tables `P` and `dP`.
pub fn backward_by_hand(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    fwd: &Attention,
    dout: ArrayView4<f32>,
) -> Result<Grads, AttnError> {
    let shape = check_backward(&q, &k, &v, fwd, &dout)?;
    if shape.is_empty() {
        return Ok(Grads::zeros(shape));
    }
    let p = step01_naive::probabilities(q, k)?; // [b, h, T, T], 0 above the diagonal
    let mut ds = table(shape, "the table of dP")?; // dP, then dS in place
    let mut grads = Grads::zeros(shape);
    let scale = shape.scale() as f32;
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let at = s![b, h, .., ..];
            let (p, mut ds) = (p.slice(at), ds.slice_mut(at));
            let (q, k, v, dout) = (q.slice(at), k.slice(at), v.slice(at), dout.slice(at));
            // O = P·V: dV = Pᵀ·dO and dP = dO·Vᵀ
            general_mat_mul(1.0, &p.t(), &dout, 0.0, &mut grads.dv.slice_mut(at));
            general_mat_mul(1.0, &dout, &v.t(), 0.0, &mut ds);
            // the softmax's Jacobian: dS_ij = P_ij·(dP_ij − Σ_j' P_ij'·dP_ij')
            for (p, mut ds) in p.rows().into_iter().zip(ds.rows_mut()) {
                let c = p.dot(&ds);
                ds.zip_mut_with(&p, |d, &p| *d = p * (*d - c));
            }
            // S = Q·Kᵀ·scale: dQ = dS·K·scale and dK = dSᵀ·Q·scale
            general_mat_mul(scale, &ds, &k, 0.0, &mut grads.dq.slice_mut(at));
            general_mat_mul(scale, &ds.t(), &q, 0.0, &mut grads.dk.slice_mut(at));
        }
    }
    Ok(grads)
}
// ANCHOR_END: by_hand_backward

/// A `[batch, heads, tokens, tokens]` table of zeros, or [`AttnError::OutOfMemory`] when
/// its size overflows or the allocator refuses it.
fn table(shape: Shape, what: &str) -> Result<Array4<f32>, AttnError> {
    let [b_n, h_n, t_n, _] = shape.dims();
    let len = b_n
        .checked_mul(h_n)
        .and_then(|n| n.checked_mul(t_n))
        .and_then(|n| n.checked_mul(t_n));
    let buf = try_zeros::<f32>(&format!("{what} for {shape}"), len)?;
    Ok(Array4::from_shape_vec((b_n, h_n, t_n, t_n), buf).expect("length is b·h·T·T"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_too_large_is_an_error_not_an_abort() {
        // 2^64 entries: the size overflows before any allocation
        let err = table(Shape::new(1 << 16, 1 << 16, 1 << 16, 1), "dP").unwrap_err();
        assert!(matches!(err, AttnError::OutOfMemory { .. }), "{err}");
        // 2^60 entries, 4 EiB: more than any address space, so the allocator refuses
        let err = table(Shape::new(1 << 15, 1 << 15, 1 << 15, 1), "dP").unwrap_err();
        assert!(
            err.to_string()
                .starts_with("out of memory: dP for [batch 32768"),
            "{err}"
        );
    }
}
