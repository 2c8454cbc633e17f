//! The block masks chapter 9 draws: three documents packed into one sequence of 256 tokens,
//! and a sliding window, in tiles of 32 × 32. The book's
//! `book/src/output/block-mask.txt` is this program's output under the command that prints
//! it (`tests/book_output.rs` checks that it still is).
//!
//! `cargo run -p step09-masks --example block-picture`

use step09_masks::{BlockMask, BlockSizes, Documents, Mask};

/// The pictures, each under a line that names the mask.
pub fn pictures() -> String {
    let blocks = BlockSizes {
        queries: 32,
        keys: 32,
    };
    let documents = Documents::from_lengths(&[100, 60, 96]).expect("lengths of at least 1");
    let mut text = String::new();
    for (about, mask) in [
        (
            "documents of 100, 60 and 96 tokens packed into one sequence of 256",
            Mask::Documents(documents),
        ),
        (
            "a sliding window of 64 keys over 256 tokens",
            Mask::Sliding { window: 64 },
        ),
    ] {
        let block_mask =
            BlockMask::new(&mask, (1, 1, 256, 256), blocks).expect("a valid mask");
        text += &format!("\n{about}:\n\n{}", block_mask.picture(0));
    }
    text
}

#[allow(dead_code)]
fn main() {
    print!("{}", pictures());
}
