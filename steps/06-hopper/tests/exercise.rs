//! The exercise checker can tell right from wrong: it accepts the layout the kernels use
//! (the solution), and refuses the template as shipped (a `todo!()`), a layout whose rows
//! leave their quad, and layouts that keep every rule but are not the hardware's. None of
//! them reads `exercises/`, so these keep passing once a reader has filled the template in.
//! The layout itself is held to the kernels' text, which computes the same indices.

use step06_hopper::exercise::{WIDTHS, accumulator_element, check};

#[test]
fn the_layout_is_the_kernels() {
    let forward = include_str!("../kernels/forward.cuh");
    let rung_1 = include_str!("../kernels/forward_1_wgmma.cu");
    for (text, line) in [
        (
            forward,
            "const int key = first_key + 8 * j + 2 * (lane % 4) + (e % 2);",
        ),
        (
            forward,
            "if (key > r0 + 8 * (e / 2)) sc[4 * j + e] = -INFINITY;",
        ),
        (rung_1, "const int r0 = first_row + warp * 16 + lane / 4;"),
    ] {
        assert!(
            text.contains(line),
            "the kernels no longer say `{line}`: bring exercise::accumulator_element up to date"
        );
    }
}

#[test]
fn the_checker_accepts_the_solution() {
    assert_eq!(check(&accumulator_element), Ok(WIDTHS.len()));
}

#[test]
fn the_checker_refuses_the_template() {
    let e = check(&|_, _, _| todo!()).unwrap_err();
    assert!(e.why.contains("not yet implemented"), "{e}");
}

#[test]
fn the_checker_refuses_rows_spread_over_lanes_8_apart() {
    // lane % 8 and lane / 8 where the hardware has lane / 4 and lane % 4: row r's threads
    // are lanes r, r + 8, r + 16, r + 24, four quads where one shuffle pair reaches one
    let e = check(&|thread, register, _| {
        let (warp, lane, j, e) = (thread / 32, thread % 32, register / 4, register % 4);
        (
            16 * warp + lane % 8 + 8 * (e / 2),
            8 * j + 2 * (lane / 8) + e % 2,
        )
    })
    .unwrap_err();
    assert!(e.why.contains("one quad of 4 threads"), "{e}");
}

#[test]
fn the_checker_refuses_a_row_major_layout() {
    // thread t holds half of row t / 2: every rule kept, but not where wgmma writes
    let e = check(&|thread, register, n| {
        let at = thread * n / 2 + register;
        (at / n, at % n)
    })
    .unwrap_err();
    assert!(e.why.contains("the hardware's"), "{e}");
}

#[test]
fn the_checker_refuses_a_layout_that_is_not_the_hardwares() {
    // rows r and r + 8 swapped between e < 2 and e ≥ 2: every rule kept
    let e = check(&|thread, register, n| {
        let (row, column) = accumulator_element(thread, register ^ 2, n);
        (row, column)
    })
    .unwrap_err();
    assert!(e.why.contains("the hardware's"), "{e}");
}
