//! The CPU side of 16-bit attention: rounding to bf16 or f16 and back, and attention by
//! hand in those precisions, rounded where a GPU running it would round.

use half::{bf16, f16};
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, Array4, ArrayView2, ArrayView4, s};

use crate::gpu::Dtype;
use flash_core::Shape;

/// Each value rounded to `dtype` (to nearest, ties to even), as raw 16 bits.
pub fn to_bits(x: ArrayView4<f32>, dtype: Dtype) -> Vec<u16> {
    let x = x.as_standard_layout();
    let values = x.as_slice().expect("standard layout");
    match dtype {
        Dtype::Bf16 => values
            .iter()
            .map(|&v| bf16::from_f32(v).to_bits())
            .collect(),
        Dtype::F16 => values.iter().map(|&v| f16::from_f32(v).to_bits()).collect(),
        Dtype::F32 => unreachable!("16-bit values only: the callers check with half_dtype"),
    }
}

/// Raw 16-bit values widened to `f32` (exactly).
pub fn from_bits(bits: &[u16], shape: Shape, dtype: Dtype) -> Array4<f32> {
    let values: Vec<f32> = match dtype {
        Dtype::Bf16 => bits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect(),
        Dtype::F16 => bits.iter().map(|&b| f16::from_bits(b).to_f32()).collect(),
        Dtype::F32 => unreachable!("16-bit values only: the callers check with half_dtype"),
    };
    Array4::from_shape_vec(shape.dims(), values).expect("shape matches the buffer")
}

/// One value rounded to `dtype` and widened back.
pub fn round(x: f32, dtype: Dtype) -> f32 {
    match dtype {
        Dtype::Bf16 => bf16::from_f32(x).to_f32(),
        Dtype::F16 => f16::from_f32(x).to_f32(),
        Dtype::F32 => x,
    }
}

/// Every value of an array rounded to `dtype`: what the GPU sees of an `f32` input.
pub fn round_array(x: ArrayView4<f32>, dtype: Dtype) -> Array4<f32> {
    x.mapv(|v| round(v, dtype))
}

// ANCHOR: by_hand_low_precision
/// Attention by hand as PyTorch computes it on a GPU in `dtype`: inputs in `dtype`;
/// products accumulated in f32 and their results rounded to `dtype` (the scores, then the
/// scaled scores); the softmax computed in f32 and rounded; the output rounded.
/// FlashAttention's test rule compares a kernel's error with this computation's error: both
/// against `f64`.
pub fn by_hand_low_precision(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dtype: Dtype,
) -> Array4<f32> {
    let (q, k, v) = (
        round_array(q, dtype),
        round_array(k, dtype),
        round_array(v, dtype),
    );
    let (b_n, h_n, t_n, d_n) = q.dim();
    let mut out = Array4::<f32>::zeros((b_n, h_n, t_n, d_n));
    for b in 0..b_n {
        for h in 0..h_n {
            let p = probabilities_low_precision(
                q.slice(s![b, h, .., ..]),
                k.slice(s![b, h, .., ..]),
                dtype,
            );
            let mut o = out.slice_mut(s![b, h, .., ..]);
            general_mat_mul(1.0, &p, &v.slice(s![b, h, .., ..]), 0.0, &mut o);
            o.mapv_inplace(|x| round(x, dtype));
        }
    }
    out
}
// ANCHOR_END: by_hand_low_precision

/// One head's table of probabilities as [`by_hand_low_precision`] computes it: `q` and `k`
/// (`[tokens, head_dim]`, values already in `dtype`) multiplied with f32 accumulation, the
/// scores rounded, scaled by the rounded `1/√d` and rounded again, masked, softmaxed in f32
/// and rounded. The backward by hand in low precision (step 04) starts from the same table.
pub fn probabilities_low_precision(
    q: ArrayView2<f32>,
    k: ArrayView2<f32>,
    dtype: Dtype,
) -> Array2<f32> {
    let (t_n, d_n) = q.dim();
    let scale = round(1.0 / (d_n as f32).sqrt(), dtype);
    let mut table = Array2::<f32>::zeros((t_n, t_n));
    general_mat_mul(1.0, &q, &k.t(), 0.0, &mut table);
    for (i, mut row) in table.rows_mut().into_iter().enumerate() {
        row.mapv_inplace(|x| round(round(x, dtype) * scale, dtype));
        row.slice_mut(s![i + 1..]).fill(f32::NEG_INFINITY);
        let max = row.fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        row.mapv_inplace(|x| (x - max).exp());
        let sum = row.sum();
        row.mapv_inplace(|x| round(x / sum, dtype));
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_to_nearest_even_and_widening_is_exact() {
        // 1 + 2^-8 lies halfway between two bf16 values (1 and 1 + 2^-7): ties go to even,
        // 1
        assert_eq!(round(1.0 + 1.0 / 256.0, Dtype::Bf16), 1.0);
        assert_eq!(round(1.0 + 3.0 / 256.0, Dtype::Bf16), 1.0 + 4.0 / 256.0);
        // f16 has 10 fraction bits
        assert_eq!(round(1.0 + 1.0 / 1024.0, Dtype::F16), 1.0 + 1.0 / 1024.0);
        let shape = Shape::new(1, 1, 2, 3);
        let x = Array4::from_shape_vec(
            shape.dims(),
            vec![0.1f32, -2.5, 3.0e4, 1.0e-3, 7.0, -0.0],
        )
        .unwrap();
        for dtype in [Dtype::Bf16, Dtype::F16] {
            let back = from_bits(&to_bits(x.view(), dtype), shape, dtype);
            assert_eq!(back, round_array(x.view(), dtype));
        }
    }

    #[test]
    fn low_precision_by_hand_is_close_to_the_f64_reference() {
        use flash_core::inputs::random_qkv;
        use flash_core::reference::{attention_f64, error};
        let shape = Shape::new(1, 2, 50, 64);
        let [q, k, v] = random_qkv(shape, 3);
        for (dtype, bound) in [(Dtype::Bf16, 0.05), (Dtype::F16, 0.01)] {
            let (qr, kr, vr) = (
                round_array(q.view(), dtype),
                round_array(k.view(), dtype),
                round_array(v.view(), dtype),
            );
            let reference = attention_f64(qr.view(), kr.view(), vr.view()).unwrap();
            let e = error(
                &by_hand_low_precision(q.view(), k.view(), v.view(), dtype),
                &reference.out,
            );
            // rounding does happen (the error is not zero) but stays at the dtype's scale
            assert!(
                e.max_abs > 0.0 && e.max_abs < bound,
                "{}: {e}",
                dtype.name()
            );
        }
    }
}
