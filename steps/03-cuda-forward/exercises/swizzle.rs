//! Chapter 3's CPU exercise: the swizzle of a tile in shared memory. Write `swizzled`, then
//! check it:
//!
//! ```sh
//! cargo run -p step03-cuda-forward --bin exercise -- swizzle
//! ```
//!
//! `git checkout steps/03-cuda-forward/exercises` brings the template back.

// the parameters are unused until the body is written
#![allow(unused_variables)]

/// The offset, in elements (16-bit values), of 16-byte chunk `chunk` of row `row` in a tile
/// of `head_dim`-wide rows (32, 64 or 128 values: 4, 8 or 16 chunks a row), swizzled as
/// the kernels store their tiles: each chunk stays in its row, and the chunk one `ldmatrix`
/// matrix reads from each of 8 consecutive rows lands in a different group of 4 banks.
pub fn swizzled(row: usize, chunk: usize, head_dim: usize) -> usize {
    todo!("the row's start, plus the chunk's new place in the row (8 values a chunk)")
}
