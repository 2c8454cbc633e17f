//! The inputs whose scores are large, shared by the CPU tests (`large_scores.rs`), the GPU
//! tests (`gpu.rs`) and the check of the GPU tests' baseline (`low_precision.rs`).

use ndarray::Array4;

/// From seeded normal q, k and v: queries or keys scaled by 10, 30 and 100 (log-sum-exps up
/// to about 400 at head dim 64), queries or keys shifted by 20, both scaled by 10, values
/// scaled by 100. Each case with its name.
pub fn large_score_cases(
    q: &Array4<f32>,
    k: &Array4<f32>,
    v: &Array4<f32>,
) -> [(&'static str, [Array4<f32>; 3]); 10] {
    [
        ("q × 10", [q * 10.0, k.clone(), v.clone()]),
        ("q × 30", [q * 30.0, k.clone(), v.clone()]),
        ("q × 100", [q * 100.0, k.clone(), v.clone()]),
        ("k × 10", [q.clone(), k * 10.0, v.clone()]),
        ("k × 30", [q.clone(), k * 30.0, v.clone()]),
        ("k × 100", [q.clone(), k * 100.0, v.clone()]),
        ("q + 20", [q + 20.0, k.clone(), v.clone()]),
        ("k + 20", [q.clone(), k + 20.0, v.clone()]),
        ("q, k × 10", [q * 10.0, k * 10.0, v.clone()]),
        ("v × 100", [q.clone(), k.clone(), v * 100.0]),
    ]
}
