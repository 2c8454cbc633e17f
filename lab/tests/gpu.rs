//! Every tile shape the lab's tools may time, on a GPU: each forward shape against the f64
//! reference with FlashAttention's rule (at most twice the error of attention by hand in
//! the same precision), each backward shape against the default's gradients. Ignored where
//! there is no GPU (`cargo test -p flash-lab -- --include-ignored` runs them on one).

use flash_core::Shape;
use flash_core::inputs::{random_normal, random_qkv};
use flash_core::reference::{attention_f64, error};
use flash_lab::{backward_shapes, forward_shapes};
use ndarray::Array4;
use step03_cuda_forward::gpu::{Dtype, Gpu};
use step03_cuda_forward::host::{by_hand_low_precision, round_array};
use step03_cuda_forward::kernel::HEAD_DIMS;

/// A margin for the case where both errors are (nearly) zero.
const MARGIN: f64 = 1e-5;
/// The kernel's log-sum-exp is accumulated in f32 from the 16-bit inputs' exact products.
const KERNEL_LSE: f64 = 1e-3;

/// Every forward shape of every head dim, in bf16 and f16, on lengths that leave partial
/// blocks of every size, held to the rule like the default.
#[test]
#[ignore = "needs a CUDA GPU"]
fn every_forward_shape_matches_the_reference() {
    let gpu = Gpu::new().expect("a GPU");
    for head_dim in HEAD_DIMS {
        for config in forward_shapes::candidates(head_dim) {
            for dtype in [Dtype::Bf16, Dtype::F16] {
                for tokens in [200, 1000] {
                    let shape = Shape::new(1, 2, tokens, head_dim);
                    let what = format!("{} {shape} {}", config.label(), dtype.name());
                    let [q, k, v] = random_qkv(shape, tokens as u64);
                    let up = |x: &Array4<f32>| gpu.upload(x.view(), dtype).unwrap();
                    let (dq, dk, dv) = (up(&q), up(&k), up(&v));
                    let mut result = gpu.alloc_output(shape, dtype).unwrap();
                    forward_shapes::forward(&gpu, config, &dq, &dk, &dv, &mut result)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let got = gpu.download_attention(&result).unwrap();
                    // the reference sees exactly the values the GPU saw
                    let round = |x: &Array4<f32>| round_array(x.view(), dtype);
                    let (qr, kr, vr) = (round(&q), round(&k), round(&v));
                    let reference = attention_f64(qr.view(), kr.view(), vr.view()).unwrap();
                    let ours = error(&got.out, &reference.out);
                    let by_hand = error(
                        &by_hand_low_precision(q.view(), k.view(), v.view(), dtype),
                        &reference.out,
                    );
                    let lse = error(&got.lse, &reference.lse);
                    assert!(
                        ours.max_abs <= 2.0 * by_hand.max_abs + MARGIN,
                        "{what}: out max abs error {:.3e} > 2 × by hand's {:.3e}",
                        ours.max_abs,
                        by_hand.max_abs
                    );
                    assert!(lse.max_abs < KERNEL_LSE, "{what}: lse {lse}");
                }
            }
        }
    }
}

/// Every backward shape of every head dim gives the default's gradients, within a few bf16
/// roundings (other tile sizes sum in another order).
#[test]
#[ignore = "needs a CUDA GPU"]
fn every_backward_shape_gives_the_same_gradients() {
    let gpu = Gpu::new().expect("a GPU");
    // partial blocks of every size the shapes use (64, 128), two heads, every head dim
    for head_dim in HEAD_DIMS {
        let shape = Shape::new(1, 2, 333, head_dim);
        let [q, k, v] = random_qkv(shape, 7);
        let dout = random_normal(shape, 8);
        let up = |x: &Array4<f32>| gpu.upload(x.view(), Dtype::Bf16).unwrap();
        let (q, k, v, dout) = (up(&q), up(&k), up(&v), up(&dout));
        let fwd = gpu.forward(&q, &k, &v).unwrap();
        let grads = |config| {
            let g = backward_shapes::backward(&gpu, config, &q, &k, &v, &fwd, &dout)
                .unwrap_or_else(|e| panic!("{config:?}: {e}"));
            [g.dq, g.dk, g.dv].map(|t| gpu.download(&t).unwrap())
        };
        let configs = backward_shapes::candidates(head_dim);
        let base = grads(configs[0]);
        for &config in &configs[1..] {
            for (name, (a, b)) in ["dq", "dk", "dv"]
                .iter()
                .zip(base.iter().zip(grads(config)))
            {
                let diff = (a - &b).fold(0.0f32, |m, x| m.max(x.abs()));
                let size = a.fold(0.0f32, |m, x| m.max(x.abs()));
                assert!(
                    diff <= 0.02 * size,
                    "head dim {head_dim}, {config:?}: {name} differs from the default's by {diff:.3e} (largest {size:.3e})"
                );
            }
        }
    }
}
