//! The exercise checker can tell right from wrong: it accepts rung 1's own kernel (the
//! solution) and refuses rung 1 with its rescale taken out. Neither reads the template in
//! `exercises/`, so both keep passing once a reader has filled it in. Ignored where there
//! is no GPU.

use step03_cuda_forward::exercise::{self, Exercise};
use step03_cuda_forward::gpu::Gpu;

/// The line of rung 1 that shrinks what was summed so far when a new maximum comes.
const RESCALE: &str = "const float correction = fast_exp2((m - m_new) * scale_log2);";

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_checker_accepts_the_solution() {
    let gpu = Gpu::new().expect("a GPU");
    let checks = exercise::check(&gpu, Exercise::Rows, Exercise::Rows.solution(), |c| {
        println!("{c}")
    })
    .unwrap();
    assert_eq!(checks.len(), 2 * exercise::CASES.len());
    for check in checks {
        check.verdict().unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_checker_refuses_a_kernel_without_its_rescale() {
    let gpu = Gpu::new().expect("a GPU");
    let solution = Exercise::Rows.solution();
    assert!(solution.contains(RESCALE), "rung 1 no longer has {RESCALE}");
    let broken = solution.replace(RESCALE, "const float correction = 1.f;");
    let checks =
        exercise::check(&gpu, Exercise::Rows, &broken, |c| println!("{c}")).unwrap();
    let refused = checks.iter().filter(|c| c.verdict().is_err()).count();
    assert!(refused > 0, "every case passed without the rescale");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_checker_reports_a_kernel_that_does_not_compile() {
    let gpu = Gpu::new().expect("a GPU");
    let broken = Exercise::Rows
        .solution()
        .replace(RESCALE, "const float correction = ;");
    let err = exercise::check(&gpu, Exercise::Rows, &broken, |_| {})
        .expect_err("a syntax error is refused");
    assert!(err.to_string().contains("NVRTC could not compile"), "{err}");
}

// The CPU exercise: the checker accepts the kernels' swizzle, and refuses the template as
// shipped (a `todo!()`), a tile left unswizzled, and the XOR with row mod 8 at every head
// dim, which at head dim 32 moves chunks out of their row. Neither reads the template.

use step03_cuda_forward::exercise::{SWIZZLE_HEAD_DIMS, check_swizzle, swizzled};
use step03_cuda_forward::kernel::TENSOR_CORES_CUH;

#[test]
fn the_rust_swizzle_is_the_kernels() {
    for line in [
        "#define SWIZZLE (CHUNKS < 8 ? CHUNKS : 8)",
        "return row * HEAD_DIM + ((chunk ^ (row & (SWIZZLE - 1))) << 3);",
    ] {
        assert!(
            TENSOR_CORES_CUH.contains(line),
            "tensor_cores.cuh no longer says `{line}`: bring exercise::swizzled up to date"
        );
    }
}

#[test]
fn the_cpu_checker_accepts_the_solution() {
    assert_eq!(check_swizzle(&swizzled), Ok(SWIZZLE_HEAD_DIMS.len()));
}

#[test]
fn the_cpu_checker_refuses_the_template() {
    let e = check_swizzle(&|_, _, _| todo!()).unwrap_err();
    assert!(e.why.contains("not yet implemented"), "{e}");
}

#[test]
fn the_cpu_checker_refuses_an_unswizzled_tile() {
    let e = check_swizzle(&|row, chunk, head_dim| row * head_dim + chunk * 8).unwrap_err();
    assert!(e.case.starts_with("head dim 64"), "{e}");
    assert!(e.why.contains("takes 8 turns"), "{e}");
}

#[test]
fn the_cpu_checker_refuses_row_mod_8_at_head_dim_32() {
    let e =
        check_swizzle(&|row, chunk, head_dim| row * head_dim + ((chunk ^ (row % 8)) << 3))
            .unwrap_err();
    assert!(e.case.starts_with("head dim 32"), "{e}");
    assert!(e.why.contains("outside the row"), "{e}");
}
