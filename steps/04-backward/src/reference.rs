//! The `f64` backward every other backward is checked against.
//!
//! By hand through the whole table of probabilities, one head at a time, each line one
//! formula of the chain rule. It takes no forward result: it computes the probabilities
//! itself, in `f64`, from the inputs widened exactly, so the only error left in a
//! comparison is the method's own. Its own correctness is checked against finite
//! differences of the `f64` forward (`tests/finite_differences.rs`).

use flash_core::{AttnError, check_qkv, check_same};
use ndarray::{Array2, Array4, ArrayView2, ArrayView4, s};

/// The gradients in `f64`, each `[batch, heads, tokens, head_dim]`.
#[derive(Clone, Debug)]
pub struct ReferenceGrads {
    pub dq: Array4<f64>,
    pub dk: Array4<f64>,
    pub dv: Array4<f64>,
}

// ANCHOR: reference_backward
/// The gradients of the loss `L = Σ dO ∘ O` (any loss whose gradient with respect to the
/// output is `dout`) with respect to q, k and v of causal attention, in `f64`.
pub fn backward_f64<A: Copy + Into<f64>>(
    q: ArrayView4<A>,
    k: ArrayView4<A>,
    v: ArrayView4<A>,
    dout: ArrayView4<A>,
) -> Result<ReferenceGrads, AttnError> {
    let shape = check_qkv(&q, &k, &v)?;
    check_same("dout", &dout, shape)?;
    let scale = shape.scale();
    let mut grads = ReferenceGrads {
        dq: Array4::zeros(shape.dims()),
        dk: Array4::zeros(shape.dims()),
        dv: Array4::zeros(shape.dims()),
    };
    let wide = |x: ArrayView2<A>| -> Array2<f64> { x.mapv(Into::into) };
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let at = s![b, h, .., ..];
            let (q, k, v) = (wide(q.slice(at)), wide(k.slice(at)), wide(v.slice(at)));
            let dout = wide(dout.slice(at));
            // P = softmax(mask(Q·Kᵀ·scale)), one row at a time
            let mut p = q.dot(&k.t()) * scale;
            for (i, mut row) in p.rows_mut().into_iter().enumerate() {
                row.slice_mut(s![i + 1..]).fill(f64::NEG_INFINITY);
                let max = row.fold(f64::NEG_INFINITY, |m, &x| m.max(x));
                row.mapv_inplace(|x| (x - max).exp());
                let sum = row.sum();
                row.mapv_inplace(|x| x / sum);
            }
            // O = P·V, so dV = Pᵀ·dO and dP = dO·Vᵀ
            let dv = p.t().dot(&dout);
            let mut ds = dout.dot(&v.t());
            // the softmax's Jacobian, row by row: dS_ij = P_ij·(dP_ij − Σ_j' P_ij'·dP_ij')
            for (p, mut ds) in p.rows().into_iter().zip(ds.rows_mut()) {
                let c = p.dot(&ds);
                ds.zip_mut_with(&p, |d, &p| *d = p * (*d - c));
            }
            // S = Q·Kᵀ·scale, so dQ = dS·K·scale and dK = dSᵀ·Q·scale
            grads.dq.slice_mut(at).assign(&(ds.dot(&k) * scale));
            grads.dk.slice_mut(at).assign(&(ds.t().dot(&q) * scale));
            grads.dv.slice_mut(at).assign(&dv);
        }
    }
    Ok(grads)
}
// ANCHOR_END: reference_backward
