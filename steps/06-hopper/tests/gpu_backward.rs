//! The Hopper backward kernels on the GPU against the f64 reference with FlashAttention's rule
//! (each gradient's error at most twice that of the backward by hand in the same precision),
//! in every block shape they can be compiled with; ignored where there is no GPU.

use cudarc::driver::DevicePtrMut;
use flash_core::inputs::{random_normal, random_qkv};
use flash_core::reference::error;
use flash_core::{AttnError, Shape};
use ndarray::Array4;
use step03_cuda_forward::host::round_array;
use step03_cuda_forward::{DeviceTensor, Dtype, Gpu};
use step04_backward::cuda::{DeviceGrads, backward_by_hand_low_precision};
use step04_backward::reference::backward_f64;
use step06_hopper::backward::{self, BackwardConfigs, GradLayout};
use step06_hopper::forward;
use step06_hopper::methods::hopper_backward;

/// One token, partial blocks of every size the kernels stream (32, 64, 128 rows), one block,
/// several, and the diagonal in every position.
const SHAPES: [(usize, usize, usize); 6] = [
    (1, 2, 1),
    (2, 3, 77),
    (1, 2, 128),
    (3, 1, 300),
    (1, 3, 1024),
    (1, 1, 4097),
];

fn up(gpu: &Gpu, x: &Array4<f32>, dtype: Dtype) -> DeviceTensor {
    gpu.upload(x.view(), dtype).unwrap()
}

/// Random bf16 q, k, v and dout of `shape` on the GPU (seeds `seed` and `seed + 1`), and the
/// Hopper forward's output and log-sum-exp for them.
fn bf16_inputs(
    gpu: &Gpu,
    shape: Shape,
    seed: u64,
) -> ([DeviceTensor; 4], step03_cuda_forward::DeviceAttention) {
    let [q, k, v] = random_qkv(shape, seed);
    let dout = random_normal(shape, seed + 1);
    let [q, k, v, dout] = [&q, &k, &v, &dout].map(|x| up(gpu, x, Dtype::Bf16));
    let fwd = forward::forward(gpu, &q, &k, &v).unwrap();
    ([q, k, v, dout], fwd)
}

fn download(gpu: &Gpu, g: &DeviceGrads) -> [Array4<f32>; 3] {
    [&g.dq, &g.dk, &g.dv].map(|x| gpu.download(x).unwrap())
}

// ANCHOR: check_backward
#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_backward_is_within_twice_by_hand_error_in_every_block_shape() {
    let gpu = Gpu::shared().expect("a GPU");
    let mut seed = 700;
    for (dtype, d) in [Dtype::Bf16, Dtype::F16]
        .into_iter()
        .flat_map(|dtype| forward::HEAD_DIMS.map(|d| (dtype, d)))
    {
        for &(b, h, t) in &SHAPES {
            seed += 1;
            let shape = Shape::new(b, h, t, d);
            let [q, k, v] = random_qkv(shape, seed);
            let dout = random_normal(shape, seed + 99);
            // the reference sees exactly the values the GPU saw
            let [qr, kr, vr, dr] = [&q, &k, &v, &dout].map(|x| round_array(x.view(), dtype));
            let want = backward_f64(qr.view(), kr.view(), vr.view(), dr.view()).unwrap();
            let hand =
                backward_by_hand_low_precision(q.view(), k.view(), v.view(), dout.view(), dtype);
            let hand = [&hand.dq, &hand.dk, &hand.dv];
            let want = [&want.dq, &want.dk, &want.dv];
            let (dq, dk, dv, ddo) = (
                up(gpu, &q, dtype),
                up(gpu, &k, dtype),
                up(gpu, &v, dtype),
                up(gpu, &dout, dtype),
            );
            let fwd = forward::forward(gpu, &dq, &dk, &dv).unwrap();
            for configs in BackwardConfigs::candidates(d) {
                let grads = backward::backward_with(gpu, configs, &dq, &dk, &dv, &fwd, &ddo)
                    .unwrap_or_else(|e| panic!("{shape} {}: {e}", configs.name()));
                let got = download(gpu, &grads);
                for (i, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
                    let ours = error(&got[i], want[i]);
                    let by_hand = error(hand[i], want[i]);
                    let size = want[i].iter().fold(1.0f64, |m, x| m.max(x.abs()));
                    println!(
                        "{} {shape} {}: {name} ours {ours}; by hand {by_hand}",
                        dtype.name(),
                        configs.name()
                    );
                    assert!(
                        ours.max_abs <= 2.0 * by_hand.max_abs + 1e-5 * size,
                        "{} {shape} {}: {name} {ours}; by hand {by_hand}",
                        dtype.name(),
                        configs.name()
                    );
                }
            }
        }
    }
}
// ANCHOR_END: check_backward

/// Every block writes only its own rows: two runs give the same bits, and the block shapes
/// agree with each other within rounding.
#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_backward_is_deterministic() {
    let gpu = Gpu::shared().expect("a GPU");
    for d in forward::HEAD_DIMS {
        let shape = Shape::new(2, 3, 1000, d);
        let [q, k, v] = random_qkv(shape, 3);
        let dout = random_normal(shape, 4);
        let [q, k, v, dout] = [&q, &k, &v, &dout].map(|x| up(gpu, x, Dtype::Bf16));
        let fwd = forward::forward(gpu, &q, &k, &v).unwrap();
        let first = download(
            gpu,
            &backward::backward(gpu, &q, &k, &v, &fwd, &dout).unwrap(),
        );
        let again = download(
            gpu,
            &backward::backward(gpu, &q, &k, &v, &fwd, &dout).unwrap(),
        );
        assert_eq!(first, again, "{shape}: two runs differ");
    }
}

/// The registry's `cuda_hopper` backward on host arrays, and its refusals: bad shapes before
/// any GPU work, and a head dim the kernels lack by name.
#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_backward_on_host_arrays_refuses_what_it_cannot_take() {
    let shape = Shape::new(1, 2, 40, 96);
    let [q, k, v] = random_qkv(shape, 1);
    let fwd = step01_forward(&q, &k, &v);
    let dout = random_normal(shape, 2);
    match hopper_backward(q.view(), k.view(), v.view(), &fwd, dout.view()) {
        Err(e @ AttnError::UnsupportedHeadDim { .. }) => {
            assert!(e.to_string().contains("64, 128"), "{e}")
        }
        other => panic!("head dim 96: {:?}", other.map(|_| ())),
    }
    let wrong = random_normal(Shape::new(1, 2, 41, 96), 2);
    assert!(hopper_backward(q.view(), k.view(), v.view(), &fwd, wrong.view()).is_err());
}

fn step01_forward(q: &Array4<f32>, k: &Array4<f32>, v: &Array4<f32>) -> flash_core::Attention {
    step04_backward::forward(q.view(), k.view(), v.view()).unwrap()
}

/// Without a GPU (or without a Hopper one), the backward is an error that says what it needs.
#[test]
fn no_gpu_is_an_error_not_a_panic() {
    if Gpu::shared().is_ok() {
        return;
    }
    let shape = Shape::new(1, 1, 8, 64);
    let [q, k, v] = random_qkv(shape, 1);
    let fwd = step01_forward(&q, &k, &v);
    let dout = random_normal(shape, 2);
    let e = hopper_backward(q.view(), k.view(), v.view(), &fwd, dout.view()).unwrap_err();
    assert!(
        e.to_string().contains("GPU") || e.to_string().contains("CUDA"),
        "{e}"
    );
}

/// The one-pass backward adds dQ with atomics: dK and dV are the same bits run to run, dQ may
/// differ in its last bits (the order of the sums), and by no more than one rounding step.
#[test]
#[ignore = "needs a CUDA GPU"]
fn one_pass_backward_differs_run_to_run_only_in_dqs_rounding() {
    let gpu = Gpu::shared().expect("a GPU");
    let ([q, k, v, dout], fwd) = bf16_inputs(gpu, Shape::new(2, 3, 1000, 64), 5);
    let one_pass: Vec<_> = BackwardConfigs::candidates(64)
        .into_iter()
        .filter(|c| c.dkdv.dq_atomic)
        .collect();
    assert!(!one_pass.is_empty(), "no one-pass candidate at head dim 64");
    for configs in one_pass {
        let run = || {
            download(
                gpu,
                &backward::backward_with(gpu, configs, &q, &k, &v, &fwd, &dout).unwrap(),
            )
        };
        let (first, again) = (run(), run());
        assert_eq!(first[1], again[1], "{}: dk differs", configs.name());
        assert_eq!(first[2], again[2], "{}: dv differs", configs.name());
        let size = first[0].iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let diff = first[0]
            .iter()
            .zip(&again[0])
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        let differing = first[0]
            .iter()
            .zip(&again[0])
            .filter(|(a, b)| a != b)
            .count();
        println!(
            "{}: dq run to run: {differing} of {} values differ, by at most {diff:.3e} (largest |dq| {size:.3e})",
            configs.name(),
            first[0].len()
        );
        assert!(
            diff <= size / 128.0,
            "{}: dq differs by {diff}",
            configs.name()
        );
    }
}

/// `backward_into` writes the gradients where a layout says: into one buffer with a row of
/// q's, k's and v's heads per token (the trainer's fused projection), the same values as
/// `backward_with`'s three tensors, bit for bit where the passes are deterministic.
#[test]
#[ignore = "needs a CUDA GPU"]
fn backward_into_fused_rows_writes_the_same_gradients() {
    let gpu = Gpu::shared().expect("a GPU");
    for d in [64, 128] {
        let shape = Shape::new(2, 3, 300, d);
        let ([q, k, v, dout], fwd) = bf16_inputs(gpu, shape, 11);
        let mut all = vec![BackwardConfigs::for_head_dim(d)];
        all.extend(
            BackwardConfigs::candidates(d)
                .into_iter()
                .filter(|c| c.dkdv.dq_atomic),
        );
        for configs in all {
            let want = download(
                gpu,
                &backward::backward_with(gpu, configs, &q, &k, &v, &fwd, &dout).unwrap(),
            );
            // [batch · tokens, 3 · heads · d] is a [batch, tokens, 3 · heads, d] tensor
            let (b, h, t) = (shape.batch, shape.heads, shape.tokens);
            let rows = Shape::new(b, t, 3 * h, d);
            let mut fused = DeviceTensor {
                data: gpu.stream().alloc_zeros::<u16>(rows.len()).unwrap(),
                shape: rows,
                dtype: Dtype::Bf16,
            };
            let layout = GradLayout::fused_rows(shape);
            assert_eq!(layout.span(shape), rows.len() - 2 * h * d);
            {
                let (base, _guard) = fused.data.device_ptr_mut(gpu.stream());
                let third = (h * d * 2) as u64; // bytes
                // SAFETY: each third's span ends within the buffer, and the thirds' values are
                // apart (the layout's heads of one token sit side by side)
                unsafe {
                    backward::backward_into(
                        gpu,
                        configs,
                        &q,
                        &k,
                        &v,
                        &fwd,
                        &dout,
                        [base, base + third, base + 2 * third],
                        layout,
                    )
                    .unwrap();
                }
            }
            let got = gpu.download(&fused).unwrap();
            // dq may differ in its last bits where the pass adds it with atomics
            let tolerance = if configs.dkdv.dq_atomic {
                1.0 / 64.0
            } else {
                0.0
            };
            for (part, grad) in want.iter().enumerate() {
                let mut worst = 0.0f32;
                for ((bi, hi, ti, di), &x) in grad.indexed_iter() {
                    let y = got[[bi, ti, part * h + hi, di]];
                    worst = worst.max((x - y).abs());
                }
                let allowed = if part == 0 { tolerance } else { 0.0 };
                assert!(
                    worst <= allowed,
                    "{} d{d}: gradient {part} differs from backward_with's by {worst}",
                    configs.name()
                );
            }
        }
    }
}

/// A layout that does not fit the shape is refused before anything is launched.
#[test]
#[ignore = "needs a CUDA GPU"]
fn backward_into_refuses_a_layout_of_another_shape() {
    let gpu = Gpu::shared().expect("a GPU");
    let ([q, k, v, dout], fwd) = bf16_inputs(gpu, Shape::new(1, 2, 64, 64), 1);
    let layout = GradLayout::heads(Shape::new(1, 3, 64, 64));
    // SAFETY: refused before any launch, so the addresses are never written
    let e = unsafe {
        backward::backward_into(
            gpu,
            BackwardConfigs::for_head_dim(64),
            &q,
            &k,
            &v,
            &fwd,
            &dout,
            [0, 0, 0],
            layout,
        )
    }
    .unwrap_err();
    assert!(e.to_string().contains("3 heads"), "{e}");
}
