//! Chapter 9's CPU exercise: a dilated sliding window, written by the reader in
//! `exercises/dilated.rs` and checked by `masks-exercise dilated`.
//!
//! The checker asks the reader's function about every (query, key) pair of small windows
//! and dilations against the definition, then runs the CPU forward with it as a custom mask
//! (grouped heads, fewer queries than keys, block sizes that leave partial tiles) and holds
//! the output to FlashAttention's rule against the `f64` reference of the definition.

use flash_core::exercise::{NotYet, attempt, twice, within};
use flash_core::inputs::random_normal;
use flash_core::reference::error;

use crate::block::{BlockMask, BlockSizes};
use crate::mask::{CustomMask, Mask, ScoreMod, Varies};
use crate::reference::{attention_by_hand, attention_f64};

/// The exercise's function: `(q, k, window, dilation)`, positions absolute.
pub type DilatedFn = fn(usize, usize, usize, usize) -> bool;

/// Where the solution is.
pub const SOLUTION: &str =
    "steps/09-masks/src/dilated.rs (chapter 9, Exercises, under Solution)";

/// `f` as a custom mask for `window` and `dilation`: the same for every sequence and head.
pub fn dilated_mask(f: DilatedFn, window: usize, dilation: usize) -> Mask {
    let name = format!("dilated:{window}x{dilation}");
    let mask = CustomMask::new(name, move |_, _, q, k| f(q, k, window, dilation));
    Mask::Custom(mask.varying(Varies {
        batch: false,
        head: false,
    }))
}

/// A shape as (batch, heads, kv heads, queries, keys, head dim).
type Dims = (usize, usize, usize, usize, usize, usize);

/// The forward cases: the shape, the window, the dilation and the tiles' sizes.
const FORWARD_CASES: [(Dims, usize, usize, (usize, usize)); 3] = [
    ((1, 4, 2, 50, 77, 16), 4, 3, (16, 8)),
    ((2, 2, 1, 33, 33, 8), 8, 2, (5, 7)),
    ((1, 3, 3, 1, 40, 32), 2, 7, (64, 64)),
];

/// Checks `f` (the reader's `dilated`): the definition on every pair of positions below 40
/// for windows 1 to 5 and dilations 1 to 4, then the CPU forward with it against the `f64`
/// reference. The number of cases, or the first that fails and why.
pub fn check_dilated(f: DilatedFn) -> Result<usize, NotYet> {
    let solution = crate::dilated::dilated;
    let mut cases = 0;
    for window in 1..=5 {
        for dilation in 1..=4 {
            let case = format!("window {window}, dilation {dilation}");
            let wrong = attempt(&case, || {
                (0..40usize)
                    .flat_map(|q| (0..40usize).map(move |k| (q, k)))
                    .find(|&(q, k)| {
                        f(q, k, window, dilation) != solution(q, k, window, dilation)
                    })
            })?;
            if let Some((q, k)) = wrong {
                let want = solution(q, k, window, dilation);
                return Err(NotYet::new(
                    case,
                    format!(
                        "dilated(q = {q}, k = {k}, window = {window}, dilation = \
                         {dilation}) is {}, where the definition gives {want} (k ≤ q, q − \
                         k < window · dilation, q − k a multiple of dilation)",
                        !want
                    ),
                ));
            }
            cases += 1;
        }
    }
    for (n, ((b, h, kvh, tq, tk, d), window, dilation, (queries, keys))) in
        FORWARD_CASES.into_iter().enumerate()
    {
        let blocks = BlockSizes { queries, keys };
        let case = format!(
            "the CPU forward with your mask, window {window}, dilation {dilation}, {b} × \
             {h} heads on {kvh} kv heads, {tq} queries on {tk} keys, head dim {d}, tiles \
             of {} × {}",
            blocks.queries, blocks.keys
        );
        let seed = 9100 + 3 * n as u64;
        let q = random_normal(flash_core::Shape::new(b, h, tq, d), seed);
        let k = random_normal(flash_core::Shape::new(b, kvh, tk, d), seed + 1);
        let v = random_normal(flash_core::Shape::new(b, kvh, tk, d), seed + 2);
        let truth = dilated_mask(solution, window, dilation);
        let none = ScoreMod::None;
        let reference = attention_f64(q.view(), k.view(), v.view(), &truth, &none)
            .expect("seeded inputs of a valid shape");
        let by_hand = attention_by_hand(q.view(), k.view(), v.view(), &truth, &none)
            .expect("seeded inputs of a valid shape");
        let allowed = twice(error(&by_hand.out, &reference.out).max_abs, 1.0);
        let yours = dilated_mask(f, window, dilation);
        let got = attempt(&case, || {
            let block_mask = BlockMask::new(&yours, (b, h, tq, tk), blocks)?;
            crate::cpu::forward_with(q.view(), k.view(), v.view(), &block_mask, &none)
        })?
        .map_err(|e| NotYet::new(&case, format!("the forward refused it: {e}")))?;
        let out: Vec<f32> = got.0.out.iter().copied().collect();
        let want: Vec<f64> = reference.out.iter().copied().collect();
        let rule = "twice the error of attention by hand in f32";
        within(&case, "out (flattened)", &out, &want, allowed, rule)?;
        cases += 1;
    }
    Ok(cases)
}

/// The solution of the GPU exercise, `src/dilated.cu`.
pub const CUDA_SOLUTION: &str =
    "steps/09-masks/src/dilated.cu (chapter 9, Exercises, under Solution)";

/// The solution's CUDA, for the test that holds the checker to it.
pub const DILATED_CU: &str = include_str!("dilated.cu");

/// The windows the GPU checker tries: (window, dilation).
pub const GPU_WINDOWS: [(usize, usize); 3] = [(4, 3), (16, 8), (64, 2)];

/// A reader's CUDA `mask_mod` (`source`, which reads WINDOW and DILATION) checked on the GPU:
/// for each of [`GPU_WINDOWS`], the masked forward and backward with it, on a shape with
/// grouped heads and fewer queries than keys, against the `f64` reference of the definition
/// by FlashAttention's rule. The number of windows checked, or the first that is not yet right
/// and why.
pub fn check_dilated_cuda(
    gpu: &step03_cuda_forward::gpu::Gpu,
    source: &str,
) -> Result<usize, NotYet> {
    let case = crate::rule::GpuCase {
        batch: 1,
        heads: 2,
        kv_heads: 1,
        tq: 200,
        tk: 300,
        d: 64,
    };
    for (n, (window, dilation)) in GPU_WINDOWS.into_iter().enumerate() {
        let what = format!("window {window}, dilation {dilation}");
        let solution = crate::dilated::dilated;
        let cuda =
            format!("#define WINDOW {window}\n#define DILATION {dilation}\n{source}");
        let mask = Mask::Custom(
            CustomMask::new(format!("dilated:{window}x{dilation}"), move |_, _, q, k| {
                solution(q, k, window, dilation)
            })
            .with_cuda(cuda)
            .varying(Varies {
                batch: false,
                head: false,
            }),
        );
        crate::rule::check_on_gpu(
            gpu,
            case,
            &mask,
            &crate::mask::ScoreMod::None,
            step03_cuda_forward::gpu::Dtype::Bf16,
            90 + n as u64,
        )
        .map_err(|why| NotYet::new(what, why))?;
    }
    Ok(GPU_WINDOWS.len())
}
