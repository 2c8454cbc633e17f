//! What chapter 9 shows as "run this, you will see this": `book/src/output/block-mask.txt`
//! is the command on its first line and what it prints after it, and must be what it prints
//! now. `UPDATE_BOOK_OUTPUT=1` writes it instead of comparing.

use std::path::Path;

#[path = "../examples/block-picture.rs"]
mod block_picture;

#[test]
fn the_book_shows_what_block_picture_prints() {
    let command = "$ cargo run -p step09-masks --example block-picture";
    let shown = format!("{command}\n{}", block_picture::pictures());
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../book/src/output/block-mask.txt");
    if std::env::var_os("UPDATE_BOOK_OUTPUT").is_some() {
        std::fs::write(&path, &shown).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == shown,
        "book/src/output/block-mask.txt differs from what the example prints now: run \
         `UPDATE_BOOK_OUTPUT=1 cargo test -p step09-masks --test book_output` to update \
         it\n --- now:\n{shown}"
    );
}
