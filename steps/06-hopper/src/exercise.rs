//! Chapter 6's exercise, on the CPU: which element of a `wgmma` accumulator each thread's
//! register holds, written by the reader in `exercises/accumulator.rs`. The checker asks it
//! for every register of every thread of a warpgroup and holds the answer to the rules the
//! kernels rely on (the tile covered once, a warp's own 16 rows, a row within one quad of
//! threads) and then to the layout itself ([`accumulator_element`]), which the kernels'
//! mask, softmax and stores assume. The `hopper-exercise` binary runs it on the reader's
//! file.

use flash_core::exercise::{NotYet, attempt};

/// Where the solution is.
pub const SOLUTION: &str = "accumulator_element in steps/06-hopper/src/exercise.rs \
     (chapter 6, Exercises, under Solution)";

/// The widths N of the m64nNk16 accumulators the kernels use: 64 (a half of the output at
/// head dim 128, the whole of it at 64) and 128 (a block of scores).
pub const WIDTHS: [usize; 2] = [64, 128];

/// Threads of a warpgroup.
pub const THREADS: usize = 128;

// ANCHOR: accumulator_element
/// The element `(row, column)` of a 64 × `n` `wgmma` accumulator that register `register`
/// (0 to n/2 − 1) of thread `thread` (0 to 127) of the warpgroup holds: warp w holds rows
/// 16w to 16w + 15, each thread two of them, r and r + 8, and register 4j + e is row
/// r + 8⌊e/2⌋, column 8j + 2(lane mod 4) + (e mod 2). The PTX ISA's layout for the
/// m64nNk16 accumulator; `forward.cuh`'s `mask` and rung 1's consumer compute the same.
pub fn accumulator_element(thread: usize, register: usize, n: usize) -> (usize, usize) {
    let _ = n; // every width lays its columns out alike, 8 per group of 4 registers
    let (warp, lane) = (thread / 32, thread % 32);
    let (j, e) = (register / 4, register % 4);
    let row = 16 * warp + lane / 4 + 8 * (e / 2);
    let column = 8 * j + 2 * (lane % 4) + e % 2;
    (row, column)
}
// ANCHOR_END: accumulator_element

/// Checks `element` (the reader's `accumulator_element`) on every register of every thread
/// at each width, in an order that says which rule breaks: the element lies in the 64 × n
/// tile; no element is held twice (so, with 128 · n/2 registers, every one is held once);
/// warp w holds only rows 16w to 16w + 15, which is what a warp of a `wgmma` can reach; the
/// four threads that hold a row are one quad, lanes 4q to 4q + 3 of a warp, so that two
/// shuffles finish a row's maximum and sum; and last the layout is the hardware's. The
/// number of widths, or the first rule broken.
pub fn check(
    element: &dyn Fn(usize, usize, usize) -> (usize, usize),
) -> Result<usize, NotYet> {
    let mut tiles = Vec::new();
    for n in WIDTHS {
        let case = format!("m64n{n}k16 ({} registers a thread)", n / 2);
        // holder[row][column]: the (thread, register) that holds it
        let mut holder = vec![vec![None::<(usize, usize)>; n]; 64];
        for thread in 0..THREADS {
            for register in 0..n / 2 {
                let at = format!("{case}, thread {thread}, register {register}");
                let (row, column) = attempt(&at, || element(thread, register, n))?;
                if row >= 64 || column >= n {
                    return Err(NotYet::new(
                        at,
                        format!("element ({row}, {column}) lies outside the 64 × {n} tile"),
                    ));
                }
                if let Some((t, r)) = holder[row][column] {
                    return Err(NotYet::new(
                        at,
                        format!(
                            "element ({row}, {column}) is held already, by thread {t}'s \
                             register {r}: each element must be held exactly once"
                        ),
                    ));
                }
                holder[row][column] = Some((thread, register));
                let warp = thread / 32;
                if row / 16 != warp {
                    return Err(NotYet::new(
                        at,
                        format!(
                            "row {row} belongs to warp {}, but thread {thread} is in warp \
                             {warp}: warp w of a warpgroup holds rows 16w to 16w + 15",
                            row / 16
                        ),
                    ));
                }
            }
        }
        for (row, holders) in holder.iter().enumerate() {
            let quads: Vec<usize> = holders.iter().flatten().map(|&(t, _)| t / 4).collect();
            if let Some(other) = quads.iter().find(|&&q| q != quads[0]) {
                return Err(NotYet::new(
                    format!("{case}, row {row}"),
                    format!(
                        "held by threads {} to {} and {} to {}: a row must lie within one \
                         quad of 4 threads, which two shuffles (xor 1, xor 2) can reduce",
                        4 * quads[0],
                        4 * quads[0] + 3,
                        4 * other,
                        4 * other + 3
                    ),
                ));
            }
        }
        tiles.push((n, case));
    }
    for (n, case) in tiles {
        for thread in 0..THREADS {
            for register in 0..n / 2 {
                let yours = element(thread, register, n);
                let hardware = accumulator_element(thread, register, n);
                if yours != hardware {
                    return Err(NotYet::new(
                        format!("{case}, thread {thread}, register {register}"),
                        format!(
                            "element {yours:?}, the hardware's {hardware:?}: your layout keeps \
                             the rules, but wgmma writes the accumulator its own way"
                        ),
                    ));
                }
            }
        }
    }
    Ok(WIDTHS.len())
}
