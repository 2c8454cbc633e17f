//! Chapter 6's exercise, on the CPU: which element of a `wgmma` accumulator each thread's
//! register holds, written by the reader in `exercises/accumulator.rs`. The checker asks it
//! for every register of every thread of a warpgroup and holds the answer to the rules the
//! kernels rely on (the tile covered once, a warp's own 16 rows, a row within one quad of
//! threads) and then to the layout itself ([`accumulator_element`]), which the kernels'
//! mask, softmax and stores assume. The `hopper-exercise` binary runs it on the reader's
//! file.
//!
//! Chapter 6.1's, also on the CPU: which stage and which barrier phases a block of the
//! backward's stream of q and dO waits for, written in `exercises/stream_waits.rs` and
//! checked by what the waits would do on the barriers ([`check_waits`]), then against
//! `backward.cuh`'s own ([`stream_waits`]).

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

// Chapter 6.1's exercise: the waits of a stream through a ring of stages behind mbarriers.

/// Where the second exercise's solution is.
pub const WAITS_SOLUTION: &str = "stream_waits in steps/06-hopper/src/exercise.rs \
     (chapter 6.1, Exercises, under Solution)";

/// What block `n` of a stream does in a ring of stages: the stage it goes through, the
/// parity the consumers wait for on `full[stage]`, and the parity the producer waits for on
/// `empty[stage]` before it copies (`None`: no wait).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waits {
    pub stage: usize,
    pub full_parity: u32,
    pub empty_parity: Option<u32>,
}

/// The stage counts the checker tries, and the blocks of each stream.
pub const WAIT_STAGES: [usize; 3] = [2, 3, 4];
pub const WAIT_BLOCKS: usize = 40;

// ANCHOR: stream_waits
/// `backward.cuh`'s waits for block `n` of a stream through `stages` buffers: it is the
/// `k`-th block through stage `n mod stages`, `k = ⌊n / stages⌋`. The consumers wait for
/// `full`'s phase `k`, parity `k mod 2`; the producer, from the second round on, for
/// `empty`'s phase `k − 1`, which the consumers of block `n − stages` complete.
pub fn stream_waits(n: usize, stages: usize) -> Waits {
    let k = n / stages;
    Waits {
        stage: n % stages,
        full_parity: (k % 2) as u32,
        empty_parity: (k > 0).then(|| ((k - 1) % 2) as u32),
    }
}
// ANCHOR_END: stream_waits

/// Whether a wait for `parity` returns on a barrier that has completed `completed` phases:
/// once the last completed phase has that parity. A new barrier (`completed` 0) is in phase
/// 0, and a wait for parity 1 returns at once, as for a phase before it.
fn passes(completed: usize, parity: u32) -> bool {
    (completed % 2) as u32 != parity
}

/// Checks `waits_of` (the reader's) on streams of [`WAIT_BLOCKS`] blocks through each of
/// [`WAIT_STAGES`] stages, by what its waits would do. In order: the stage is one of the
/// ring's, and the blocks of a round take different stages; the producer's wait for block
/// `n` holds while the stage's previous block is still being read and returns once its
/// consumers release it (or, where the stage is new, returns at once or is not made); the
/// consumers' wait holds until the copy of block `n` lands and then returns; last, the
/// stage and parities are `backward.cuh`'s. The number of stage counts, or the first block
/// that fails and why.
pub fn check_waits(waits_of: &dyn Fn(usize, usize) -> Waits) -> Result<usize, NotYet> {
    for stages in WAIT_STAGES {
        let mut got = Vec::new();
        for n in 0..WAIT_BLOCKS {
            let at = format!("{stages} stages, block {n}");
            let w = attempt(&at, || waits_of(n, stages))?;
            if w.stage >= stages {
                let why = format!(
                    "stage {}, where the ring has stages 0 to {}",
                    w.stage,
                    stages - 1
                );
                return Err(NotYet::new(at, why));
            }
            got.push(w);
        }
        for (n, w) in got.iter().enumerate() {
            let at = format!("{stages} stages, block {n}");
            let round = n - n % stages;
            if let Some(m) = (round..n).find(|&m| got[m].stage == w.stage) {
                let why = format!(
                    "stage {}, which block {m} of the same round holds: {stages} blocks in \
                     flight need {stages} different stages",
                    w.stage
                );
                return Err(NotYet::new(at, why));
            }
            // k: the blocks that went through this stage before block n
            let before: Vec<usize> = (0..n).filter(|&m| got[m].stage == w.stage).collect();
            let k = before.len();
            match (w.empty_parity, before.last()) {
                (None, Some(&m)) => {
                    let why = format!(
                        "no wait before the copy, where stage {} still holds block {m}, which \
                         the consumers may still be reading",
                        w.stage
                    );
                    return Err(NotYet::new(at, why));
                }
                (Some(p), Some(&m)) if passes(k - 1, p) => {
                    let why = format!(
                        "the producer's wait on empty[{}] for parity {p} returns before the \
                         consumers release block {m}: the copy would overwrite it",
                        w.stage
                    );
                    return Err(NotYet::new(at, why));
                }
                (Some(p), Some(&m)) if !passes(k, p) => {
                    let why = format!(
                        "the producer's wait on empty[{}] for parity {p} would not return \
                         once the consumers release block {m}: it waits forever",
                        w.stage
                    );
                    return Err(NotYet::new(at, why));
                }
                (Some(p), None) if !passes(0, p) => {
                    let why = format!(
                        "the producer waits on a new barrier, empty[{}], for parity {p}: \
                         phase 0 completes only when a block's consumers release the stage, \
                         and none has gone through it, so it waits forever",
                        w.stage
                    );
                    return Err(NotYet::new(at, why));
                }
                _ => {}
            }
            let p = w.full_parity;
            if passes(k, p) {
                let why = format!(
                    "the consumers' wait on full[{}] for parity {p} returns before block {n}'s \
                     copy lands (phase {k} of that barrier): they would read {}",
                    w.stage,
                    before
                        .last()
                        .map_or("an empty stage".into(), |m| format!("block {m}"))
                );
                return Err(NotYet::new(at, why));
            }
            if !passes(k + 1, p) {
                let why = format!(
                    "the consumers' wait on full[{}] for parity {p} would not return once \
                     block {n}'s copy lands: they wait forever",
                    w.stage
                );
                return Err(NotYet::new(at, why));
            }
            let want = stream_waits(n, stages);
            if *w != want {
                let why = format!("{w:?}, where backward.cuh's is {want:?}");
                return Err(NotYet::new(at, why));
            }
        }
    }
    Ok(WAIT_STAGES.len())
}
