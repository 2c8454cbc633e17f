//! The whole model's gradients against central differences of its loss, in `f64`.
//!
//! The model is generic over the float type: in `f64` its attention is the `f64` reference
//! forward and backward of steps 01 and 04, and everything else is the same code that
//! trains in `f32`. Central differences of an `f64` loss are good to about eight digits, so
//! they check the backward by hand of every layer tightly; the `f32` model, with our
//! kernels inside, is then held to the same differences at `f32`'s accuracy.

use ndarray::Array2;
use step05_train::{Config, Params, backward, forward, loss};

const TINY: Config = Config {
    layers: 2,
    d_model: 16,
    heads: 2,
    kv_heads: 2, // [step 08]
    context: 8,
    vocab: 256,
};

/// Two sequences of eight bytes of text, and each one's next bytes.
fn batch() -> (Array2<u8>, Array2<u8>) {
    let text = b"fn main() { println!(\"flash\"); }";
    let inputs = Array2::from_shape_fn((2, 8), |(b, t)| text[b * 11 + t]);
    let targets = Array2::from_shape_fn((2, 8), |(b, t)| text[b * 11 + t + 1]);
    (inputs, targets)
}

fn loss_of(p: &Params<f64>, inputs: &Array2<u8>, targets: &Array2<u8>) -> f64 {
    let acts = forward(p, inputs.view()).unwrap();
    loss(&acts, targets.view())
}

/// A handful of positions in a tensor of `len` numbers: the first, the last, three spread
/// between, and the one whose gradient is largest.
fn picks(len: usize, grad: &[f64]) -> Vec<usize> {
    let largest = (0..len)
        .max_by(|&a, &b| grad[a].abs().total_cmp(&grad[b].abs()))
        .unwrap();
    let mut p = vec![0, len / 4 + 1, len / 2, 3 * len / 4, len - 1, largest];
    p.retain(|&i| i < len);
    p.sort();
    p.dedup();
    p
}

#[test]
fn every_tensor_matches_central_differences() {
    matches_central_differences(TINY);
}

// [step 08]
// ANCHOR: grouped_gradients
#[test]
fn grouped_heads_match_central_differences() {
    // 4 query heads sharing 2 key and value heads, then 1 (multi-query attention)
    for kv_heads in [2, 1] {
        matches_central_differences(Config {
            heads: 4,
            kv_heads,
            ..TINY
        });
    }
}
// ANCHOR_END: grouped_gradients
// [/step 08]

fn matches_central_differences(config: Config) {
    let (inputs, targets) = batch();
    let p32 = Params::<f32>::init(config, 7).unwrap();
    // the weights the f32 model has, widened exactly
    let p64 = p32.cast(|x| x as f64);
    let g64 = backward(
        &p64,
        &forward(&p64, inputs.view()).unwrap(),
        inputs.view(),
        targets.view(),
    )
    .unwrap();
    let acts32 = forward(&p32, inputs.view()).unwrap();
    let g32 = backward(&p32, &acts32, inputs.view(), targets.view()).unwrap();

    // ANCHOR: gradient_check
    let h = 1e-5;
    let (mut worst64, mut worst32) = (0.0f64, 0.0f64);
    let names: Vec<String> = p64.tensors().into_iter().map(|(n, _)| n).collect();
    for (i, name) in names.iter().enumerate() {
        let grad64 = g64.tensors()[i].1.iter().copied().collect::<Vec<f64>>();
        let grad32 = g32.tensors()[i].1.iter().copied().collect::<Vec<f32>>();
        // the tensor's scale of gradients: the errors of f32 are relative to it
        let scale = grad64.iter().fold(0.0f64, |m, g| m.max(g.abs())).max(1e-6);
        for j in picks(grad64.len(), &grad64) {
            let at = |delta: f64| {
                let mut p = p64.clone();
                p.tensors_mut()[i].1.as_slice_mut().unwrap()[j] += delta;
                loss_of(&p, &inputs, &targets)
            };
            let fd = (at(h) - at(-h)) / (2.0 * h);
            let e64 = (grad64[j] - fd).abs();
            let e32 = (grad32[j] as f64 - fd).abs();
            // f64: the differences' own error is about h² and 1e-16/h
            assert!(
                e64 <= 1e-8 + 1e-6 * fd.abs(),
                "{name}[{j}]: f64 backward {} against central differences {fd}: error \
                {e64:.2e}",
                grad64[j]
            );
            // f32, our kernels inside: within 1e-4 of the tensor's largest gradient
            // (measured: about 1e-6)
            assert!(
                e32 <= 1e-4 * scale + 1e-7,
                "{name}[{j}]: f32 backward {} against central differences {fd}: error \
                {e32:.2e}, the tensor's largest gradient {scale:.2e}",
                grad32[j]
            );
            // ANCHOR_END: gradient_check
            worst64 = worst64.max(e64 / (1e-8 + fd.abs()));
            worst32 = worst32.max(e32 / scale);
        }
    }
    eprintln!(
        "{config:?}: {} tensors: worst f64 error {worst64:.1e} of the difference, worst f32 error {worst32:.1e} of the tensor's largest gradient",
        names.len()
    );
}
