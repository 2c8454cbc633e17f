//! Grouped-query attention in the training kernels: step 03's forward, step 06's Hopper
//! forward and step 04's and step 06's backwards, with k and v of `kv_heads` heads, each read by the
//! `g = heads / kv_heads` query heads of its group.
//!
//! The kernels change by a pointer (or, for TMA, a coordinate): query head `bh` reads
//! head `bh / g` of k and v. The backward writes dK and dV for each query head, as if k
//! and v had been repeated, and `backward_group_sum` adds each group's into its shared
//! head (FlashAttention-2's way: `dk_expanded`, summed). Here: the calls on host arrays
//! that the tests and the benchmark use, and the reference they are checked against, the
//! shared `f64` attention on k and v with each head repeated `g` times.

use flash_core::check::grouped_kv;
use flash_core::reference::{Reference, attention_f64};
use flash_core::{Attention, AttnError, Shape, check_finite};
use ndarray::{Array4, ArrayView4};
use step03_cuda_forward::DeviceAttention;
use step03_cuda_forward::gpu::{DeviceTensor, Dtype, Gpu};
use step04_backward::Grads;
use step04_backward::cuda::DeviceGrads;
use step04_backward::reference::{ReferenceGrads, backward_f64};
use step05_train::layers::{repeat_kv, sum_groups};

/// Which forward kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forward {
    /// Step 03's `flash_forward` (mma.sync, any GPU of compute capability 8.0 or later)
    Step03,
    /// Step 06's Hopper forward (wgmma and TMA, an H100 or H200)
    Hopper,
}

impl Forward {
    pub const ALL: [Forward; 2] = [Forward::Step03, Forward::Hopper];

    /// The name the benchmark's rows carry (the registry's name of the kernel's method).
    pub fn name(self) -> &'static str {
        match self {
            Forward::Step03 => "cuda_flash",
            Forward::Hopper => "cuda_hopper",
        }
    }

    /// The backward of the same method: step 04's kernels after step 03's forward, step
    /// 06's after step 06's. dk and dv have k's heads.
    pub fn backward(
        self,
        gpu: &Gpu,
        [q, k, v]: [&DeviceTensor; 3],
        fwd: &DeviceAttention,
        dout: &DeviceTensor,
    ) -> Result<DeviceGrads, AttnError> {
        match self {
            Forward::Step03 => step04_backward::cuda::backward(gpu, q, k, v, fwd, dout),
            Forward::Hopper => step06_hopper::backward::backward(gpu, q, k, v, fwd, dout),
        }
    }

    /// Runs the forward on device tensors (k and v with any number of heads that divides
    /// q's).
    pub fn run(
        self,
        gpu: &Gpu,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
    ) -> Result<DeviceAttention, AttnError> {
        match self {
            Forward::Step03 => gpu.forward(q, k, v),
            Forward::Hopper => step06_hopper::forward::forward(gpu, q, k, v),
        }
    }
}

/// The checks on host arrays: q `[batch, heads, tokens, head_dim]`, k and v `[batch,
/// kv_heads, tokens, head_dim]` with `kv_heads` dividing `heads`, finite values. Returns
/// q's shape and k's.
pub fn check_grouped(
    q: &ArrayView4<f32>,
    k: &ArrayView4<f32>,
    v: &ArrayView4<f32>,
) -> Result<(Shape, Shape), AttnError> {
    let (b, h, t, d) = q.dim();
    let shape = Shape::new(b, h, t, d);
    if d == 0 {
        return Err(AttnError::ZeroHeadDim);
    }
    let kv = grouped_kv(shape, k.dim().1)?;
    let dims = |x: &ArrayView4<f32>| {
        let (b, h, t, d) = x.dim();
        Shape::new(b, h, t, d)
    };
    if dims(k) != kv || dims(v) != kv {
        return Err(AttnError::ShapeMismatch {
            what: format!("q is {shape}, k is {}, v is {}", dims(k), dims(v)),
        });
    }
    check_finite("q", q)?;
    check_finite("k", k)?;
    check_finite("v", v)?;
    Ok((shape, kv))
}

/// Grouped-query attention on the GPU from host arrays: the inputs rounded to `dtype`, the
/// forward `kernel`, the output widened back to `f32`.
pub fn attention(
    gpu: &Gpu,
    kernel: Forward,
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<Attention, AttnError> {
    let (shape, _) = check_grouped(&q, &k, &v)?;
    if shape.is_empty() {
        return Ok(Attention::empty(shape));
    }
    let (q, k, v) = (
        gpu.upload(q, dtype)?,
        gpu.upload(k, dtype)?,
        gpu.upload(v, dtype)?,
    );
    let result = kernel.run(gpu, &q, &k, &v)?;
    gpu.download_attention(&result)
}

/// Forward and backward on the GPU from host arrays, by `kernel`'s method ([`Forward::run`],
/// [`Forward::backward`]); dk and dv have k's heads.
pub fn forward_backward(
    gpu: &Gpu,
    kernel: Forward,
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dout: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<(Attention, Grads), AttnError> {
    let (shape, kv) = check_grouped(&q, &k, &v)?;
    flash_core::check_same("dout", &dout, shape)?;
    if shape.is_empty() {
        let grads = Grads {
            dq: Array4::zeros(shape.dims()),
            dk: Array4::zeros(kv.dims()),
            dv: Array4::zeros(kv.dims()),
        };
        return Ok((Attention::empty(shape), grads));
    }
    let up = |x: ArrayView4<f32>| gpu.upload(x, dtype);
    let (q, k, v, dout) = (up(q)?, up(k)?, up(v)?, up(dout)?);
    let fwd = kernel.run(gpu, &q, &k, &v)?;
    let DeviceGrads { dq, dk, dv } = kernel.backward(gpu, [&q, &k, &v], &fwd, &dout)?;
    let grads = Grads {
        dq: gpu.download(&dq)?,
        dk: gpu.download(&dk)?,
        dv: gpu.download(&dv)?,
    };
    Ok((gpu.download_attention(&fwd)?, grads))
}

/// The `f64` reference of grouped-query attention: the shared causal attention on k and v
/// with their heads repeated.
pub fn reference(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Reference, AttnError> {
    let (shape, kv) = check_grouped(&q, &k, &v)?;
    let g = shape.heads / kv.heads.max(1);
    let (k, v) = (repeat_kv(k.to_owned(), g), repeat_kv(v.to_owned(), g));
    attention_f64(q, k.view(), v.view())
}

/// The `f64` gradients of grouped-query attention: step 04's reference on the repeated
/// heads, dk and dv summed over each group.
pub fn reference_grads(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dout: ArrayView4<f32>,
) -> Result<ReferenceGrads, AttnError> {
    let (shape, kv) = check_grouped(&q, &k, &v)?;
    let g = shape.heads / kv.heads.max(1);
    let (kx, vx) = (repeat_kv(k.to_owned(), g), repeat_kv(v.to_owned(), g));
    let grads = backward_f64(q, kx.view(), vx.view(), dout)?;
    Ok(ReferenceGrads {
        dk: sum_groups(grads.dk, g),
        dv: sum_groups(grads.dv, g),
        dq: grads.dq,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_kv_head_a_query_head_is_plain_attention() {
        let shape = Shape::new(1, 4, 9, 8);
        let [q, k, v] = flash_core::inputs::random_qkv(shape, 5);
        let grouped = reference(q.view(), k.view(), v.view()).unwrap();
        let plain = attention_f64(q.view(), k.view(), v.view()).unwrap();
        assert_eq!(grouped.out, plain.out);
    }

    #[test]
    fn kv_heads_that_do_not_divide_the_query_heads_are_refused() {
        let q = Array4::<f32>::zeros((1, 6, 4, 8));
        let k = Array4::<f32>::zeros((1, 4, 4, 8));
        let e = check_grouped(&q.view(), &k.view(), &k.view()).unwrap_err();
        let said = e.to_string();
        assert!(
            said.contains("q has 6 heads and k and v 4") && said.contains("1, 2, 3, 6"),
            "{said}"
        );
        let short = Array4::<f32>::zeros((1, 2, 3, 8));
        let e = check_grouped(&q.view(), &short.view(), &short.view()).unwrap_err();
        assert!(matches!(e, AttnError::ShapeMismatch { .. }), "{e}");
    }
}
