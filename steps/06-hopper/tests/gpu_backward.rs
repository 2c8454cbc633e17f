//! The Hopper backward kernels on the GPU against the f64 reference with FlashAttention's
//! rule (each gradient's error at most twice that of the backward by hand in the same
//! precision): both rungs, in every block shape a method launches them in. Those tests are
//! `#[ignore = "needs a Hopper GPU …"]`: a machine without one lists them as ignored; `--
//! --include-ignored` runs them, and run where there is no Hopper GPU they fail, saying so.
//! One test checks on every machine: what the backward says without a Hopper GPU, and that
//! it runs with one.

use cudarc::driver::DevicePtr;
use flash_core::inputs::{random_normal, random_qkv};
use flash_core::reference::error;
use flash_core::{AttnError, Shape};
use ndarray::{Array4, Axis};
use step03_cuda_forward::gpu::{DeviceTensor, Dtype, Gpu};
use step03_cuda_forward::host::round_array;
use step04_backward::cuda::{DeviceGrads, backward_by_hand_low_precision};
use step04_backward::reference::backward_f64;
use step06_hopper::backward::{self, BackwardInputs};
use step06_hopper::forward;
use step06_hopper::kernel::{
    BackwardKernels, BackwardPass, BackwardRung, ForwardKernel, HEAD_DIMS,
};
use step06_hopper::layout::{Layout, Strided};

/// `cuda_hopper`'s backward on host arrays, after a forward that returned `fwd`.
fn hopper_backward(
    q: ndarray::ArrayView4<f32>,
    k: ndarray::ArrayView4<f32>,
    v: ndarray::ArrayView4<f32>,
    fwd: &flash_core::Attention,
    dout: ndarray::ArrayView4<f32>,
    dtype: Dtype,
) -> Result<flash_core::method::Grads, AttnError> {
    step04_backward::methods::on_host(backward::backward, q, k, v, fwd, dout, dtype)
}

/// Every set of kernels a method launches at head dim `d`, whatever the shape: both rungs
/// in their shapes on both sides of the lengths where a shape changes, in both block
/// orders.
fn every_rung(d: usize) -> Vec<BackwardKernels> {
    let mut all = Vec::new();
    for t in [1, 8193, 1 << 14] {
        for rung in [BackwardRung::TwoPasses, BackwardRung::OnePass] {
            let k = BackwardKernels::rung(rung, Shape::new(1, 1, t, d));
            for k in [k, k.other_order()] {
                if !all.contains(&k) {
                    all.push(k);
                }
            }
        }
    }
    all
}

/// The one-pass kernels a method launches at head dim `d`.
fn one_pass(d: usize) -> Vec<BackwardKernels> {
    every_rung(d)
        .into_iter()
        .filter(|k| k.dkdv.pass == BackwardPass::OnePass)
        .collect()
}

/// One token, partial blocks of every size the kernels stream (32, 64, 128 rows), one
/// block, several, and the diagonal in every position.
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

/// Random bf16 q, k, v and dout of `shape` on the GPU (seeds `seed` and `seed + 1`), and
/// the Hopper forward's output and log-sum-exp for them.
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
#[ignore = "needs a Hopper GPU (compute capability 9.0)"]
fn hopper_backward_is_within_twice_by_hand_error_in_every_rung_and_shape() {
    let gpu = Gpu::shared().expect("a GPU");
    let mut seed = 700;
    for (dtype, d) in [Dtype::Bf16, Dtype::F16]
        .into_iter()
        .flat_map(|dtype| HEAD_DIMS.map(|d| (dtype, d)))
    {
        for &(b, h, t) in &SHAPES {
            seed += 1;
            let shape = Shape::new(b, h, t, d);
            let [q, k, v] = random_qkv(shape, seed);
            let dout = random_normal(shape, seed + 99);
            // the reference sees exactly the values the GPU saw
            let [qr, kr, vr, dr] =
                [&q, &k, &v, &dout].map(|x| round_array(x.view(), dtype));
            let want = backward_f64(qr.view(), kr.view(), vr.view(), dr.view()).unwrap();
            let hand = backward_by_hand_low_precision(
                q.view(),
                k.view(),
                v.view(),
                dout.view(),
                dtype,
            );
            let hand = [&hand.dq, &hand.dk, &hand.dv];
            let want = [&want.dq, &want.dk, &want.dv];
            let (dq, dk, dv, ddo) = (
                up(gpu, &q, dtype),
                up(gpu, &k, dtype),
                up(gpu, &v, dtype),
                up(gpu, &dout, dtype),
            );
            let fwd = forward::forward(gpu, &dq, &dk, &dv).unwrap();
            for configs in every_rung(d) {
                let grads =
                    backward::backward_with(gpu, configs, &dq, &dk, &dv, &fwd, &ddo)
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

/// In the two passes every block writes only its own rows: two runs give the same bits.
#[test]
#[ignore = "needs a Hopper GPU (compute capability 9.0)"]
fn hopper_backward_in_two_passes_is_deterministic() {
    let gpu = Gpu::shared().expect("a GPU");
    for d in HEAD_DIMS {
        let shape = Shape::new(2, 3, 1000, d);
        let [q, k, v] = random_qkv(shape, 3);
        let dout = random_normal(shape, 4);
        let [q, k, v, dout] = [&q, &k, &v, &dout].map(|x| up(gpu, x, Dtype::Bf16));
        let fwd = forward::forward(gpu, &q, &k, &v).unwrap();
        let configs = BackwardKernels::two_passes(shape);
        let run = || {
            download(
                gpu,
                &backward::backward_with(gpu, configs, &q, &k, &v, &fwd, &dout).unwrap(),
            )
        };
        let (first, again) = (run(), run());
        assert_eq!(first, again, "{shape}: two runs differ");
    }
}

/// The registry's `cuda_hopper` backward on host arrays, and its refusals: bad shapes
/// before any GPU work, and a head dim the kernels lack by name.
#[test]
#[ignore = "needs a Hopper GPU (compute capability 9.0)"]
fn hopper_backward_on_host_arrays_refuses_what_it_cannot_take() {
    let shape = Shape::new(1, 2, 40, 96);
    let [q, k, v] = random_qkv(shape, 1);
    let fwd = step01_forward(&q, &k, &v);
    let dout = random_normal(shape, 2);
    match hopper_backward(q.view(), k.view(), v.view(), &fwd, dout.view(), Dtype::Bf16) {
        Err(e @ AttnError::UnsupportedHeadDim { .. }) => {
            assert!(e.to_string().contains("64, 128"), "{e}")
        }
        other => panic!("head dim 96: {:?}", other.map(|_| ())),
    }
    let wrong = random_normal(Shape::new(1, 2, 41, 96), 2);
    assert!(
        hopper_backward(
            q.view(),
            k.view(),
            v.view(),
            &fwd,
            wrong.view(),
            Dtype::Bf16
        )
        .is_err()
    );
}

fn step01_forward(
    q: &Array4<f32>,
    k: &Array4<f32>,
    v: &Array4<f32>,
) -> flash_core::Attention {
    step04_backward::forward(q.view(), k.view(), v.view()).unwrap()
}

/// Without a GPU (or without a Hopper one), the backward is an error that says what it
/// needs, not a panic; with a Hopper GPU it runs. Checked on every machine.
#[test]
fn no_gpu_is_an_error_not_a_panic() {
    let hopper = Gpu::shared().is_ok_and(|gpu| forward::check_hopper(gpu).is_ok());
    let shape = Shape::new(1, 1, 8, 64);
    let [q, k, v] = random_qkv(shape, 1);
    let fwd = step01_forward(&q, &k, &v);
    let dout = random_normal(shape, 2);
    match hopper_backward(q.view(), k.view(), v.view(), &fwd, dout.view(), Dtype::Bf16) {
        Ok(_) => assert!(hopper, "the Hopper backward ran without a Hopper GPU"),
        Err(e) => {
            assert!(!hopper, "on a Hopper GPU: {e}");
            assert!(
                e.to_string().contains("GPU") || e.to_string().contains("CUDA"),
                "{e}"
            );
        }
    }
}

/// The one-pass backward adds dQ into f32 sums in the order blocks finish: dK and dV are
/// the same bits run to run, dQ may differ in its last bits, by no more than one rounding
/// step.
#[test]
#[ignore = "needs a Hopper GPU (compute capability 9.0)"]
fn one_pass_backward_differs_run_to_run_only_in_dqs_rounding() {
    let gpu = Gpu::shared().expect("a GPU");
    for d in [64, 128] {
        let ([q, k, v, dout], fwd) = bf16_inputs(gpu, Shape::new(2, 3, 1000, d), 5);
        for configs in one_pass(d) {
            let run = || {
                download(
                    gpu,
                    &backward::backward_with(gpu, configs, &q, &k, &v, &fwd, &dout)
                        .unwrap(),
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
}

/// `[batch, heads, tokens, d]` tensors side by side as rows of heads, one row per token:
/// `[batch, tokens, parts · heads, d]` (the trainer's fused projection for q, k and v; the
/// rows its output projection reads for one part).
fn rows_of(parts: &[&Array4<f32>]) -> Array4<f32> {
    let views: Vec<_> = parts
        .iter()
        .map(|x| x.view().permuted_axes([0, 2, 1, 3]))
        .collect();
    ndarray::concatenate(Axis(2), &views).unwrap()
}

fn ptr(gpu: &Gpu, x: &DeviceTensor) -> u64 {
    x.data.device_ptr(gpu.stream()).0
}

/// The trainer's path: q, k and v read from one buffer holding a row of their heads per
/// token (the fused projection), the output written as rows of heads (what the output
/// projection reads), dO read from such rows, and the gradients written into one fused
/// buffer. The same bits as `forward_with` and `backward_with` on `[batch, heads, tokens,
/// d]` tensors, where the passes are deterministic.
#[test]
#[ignore = "needs a Hopper GPU (compute capability 9.0)"]
fn strided_inputs_and_outputs_give_the_same_bits() {
    let gpu = Gpu::shared().expect("a GPU");
    for d in [64, 128] {
        let shape = Shape::new(2, 3, 300, d);
        let (b, h, t) = (shape.batch, shape.heads, shape.tokens);
        let [q, k, v] = random_qkv(shape, 11);
        let dout = random_normal(shape, 12);
        let [tq, tk, tv, tdout] = [&q, &k, &v, &dout].map(|x| up(gpu, x, Dtype::Bf16));
        let fwd = forward::forward(gpu, &tq, &tk, &tv).unwrap();
        let fused = up(gpu, &rows_of(&[&q, &k, &v]), Dtype::Bf16);
        let dout_rows = up(gpu, &rows_of(&[&dout]), Dtype::Bf16);
        let zeros = |s: Shape| DeviceTensor {
            data: gpu.stream().alloc_zeros::<u16>(s.len()).unwrap(),
            shape: s,
            dtype: Dtype::Bf16,
        };
        let out_rows = zeros(Shape::new(b, t, h, d));
        let lse = gpu.stream().alloc_zeros::<f32>(b * h * t).unwrap();
        let lse_ptr = lse.device_ptr(gpu.stream()).0;
        let third = (h * d * 2) as u64; // bytes
        let in_fused = |base: u64| {
            [0, 1, 2].map(|i| Strided {
                ptr: base + i * third,
                layout: Layout::fused_rows(shape),
            })
        };
        let [sq, sk, sv] = in_fused(ptr(gpu, &fused));
        let out = Strided {
            ptr: ptr(gpu, &out_rows),
            layout: Layout::rows(shape),
        };
        assert_eq!(
            Layout::fused_rows(shape).span(shape),
            fused.data.len() - 2 * h * d
        );
        assert_eq!(Layout::rows(shape).span(shape), out_rows.data.len());
        // SAFETY: each tensor's span ends within its buffer; the output and lse are apart
        // from each other and from the inputs
        unsafe {
            forward::forward_into(
                gpu,
                ForwardKernel::for_shape(shape, shape.heads),
                shape,
                Dtype::Bf16,
                [sq, sk, sv],
                out,
                lse_ptr,
            )
            .unwrap();
        }
        let want_out = gpu.download(&fwd.out).unwrap();
        let got_out = gpu.download(&out_rows).unwrap();
        assert_eq!(
            got_out,
            want_out.view().permuted_axes([0, 2, 1, 3]),
            "d{d}: output"
        );
        let want_lse = gpu.stream().clone_dtoh(&fwd.lse).unwrap();
        assert_eq!(
            gpu.stream().clone_dtoh(&lse).unwrap(),
            want_lse,
            "d{d}: lse"
        );

        for configs in every_rung(d) {
            let want = download(
                gpu,
                &backward::backward_with(gpu, configs, &tq, &tk, &tv, &fwd, &tdout)
                    .unwrap(),
            );
            let grads = zeros(fused.shape);
            let [gq, gk, gv] = in_fused(ptr(gpu, &grads));
            let inputs = BackwardInputs {
                q: sq,
                k: sk,
                v: sv,
                out,
                dout: Strided {
                    ptr: ptr(gpu, &dout_rows),
                    layout: Layout::rows(shape),
                },
                lse: lse_ptr,
            };
            // SAFETY: as above; the gradients' thirds are apart (a token's heads of q, k
            // and v sit side by side) and apart from every input
            unsafe {
                backward::backward_into(
                    gpu,
                    configs,
                    shape,
                    Dtype::Bf16,
                    inputs,
                    [gq.ptr, gk.ptr, gv.ptr],
                    Layout::fused_rows(shape),
                )
                .unwrap();
            }
            let got = gpu.download(&grads).unwrap();
            // dq may differ in its last bits where one pass adds it in the order blocks
            // finish
            let tolerance = if configs.dkdv.pass == BackwardPass::OnePass {
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

/// A layout that does not fit the shape, or an address TMA cannot read from, is refused
/// before anything is launched.
#[test]
#[ignore = "needs a Hopper GPU (compute capability 9.0)"]
fn strided_entry_points_refuse_what_the_kernels_cannot_take() {
    let gpu = Gpu::shared().expect("a GPU");
    let shape = Shape::new(1, 2, 64, 64);
    let ([q, k, v, dout], fwd) = bf16_inputs(gpu, shape, 1);
    let at = |x: &DeviceTensor, layout| Strided {
        ptr: ptr(gpu, x),
        layout,
    };
    let heads = Layout::heads(shape);
    let inputs = BackwardInputs {
        q: at(&q, heads),
        k: at(&k, heads),
        v: at(&v, heads),
        out: at(&fwd.out, heads),
        dout: at(&dout, heads),
        lse: fwd.lse.device_ptr(gpu.stream()).0,
    };
    let configs = BackwardKernels::for_shape(Shape::new(1, 3, 64, 64));
    // SAFETY: each call is refused before any launch, so nothing is read or written
    unsafe {
        let wrong_heads = Layout::heads(Shape::new(1, 3, 64, 64));
        let e = backward::backward_into(
            gpu,
            configs,
            shape,
            Dtype::Bf16,
            inputs,
            [0; 3],
            wrong_heads,
        )
        .unwrap_err();
        assert!(e.to_string().contains("3 heads"), "{e}");
        let mut off = inputs;
        off.k.ptr += 2;
        let e =
            backward::backward_into(gpu, configs, shape, Dtype::Bf16, off, [0; 3], heads)
                .unwrap_err();
        assert!(e.to_string().contains("multiples of 16"), "{e}");
        let e = forward::forward_into(
            gpu,
            ForwardKernel::for_shape(Shape::new(1, 3, 64, 64), 3),
            shape,
            Dtype::Bf16,
            [off.q, off.k, off.v],
            off.out,
            off.lse,
        )
        .unwrap_err();
        assert!(e.to_string().contains("k at"), "{e}");
    }
}
