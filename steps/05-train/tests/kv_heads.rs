//! Grouped heads at the command line (step 08): `train --kv-heads N` refuses a count that
//! does not divide the query heads, saying which counts it accepts, before anything loads.

mod common;
use common::refused;

#[test]
fn kv_heads_that_do_not_divide_the_heads_are_refused_with_the_counts_that_do() {
    refused(&["--kv-heads", "3"], &["kv_heads 3", "heads 4", "1, 2, 4"]);
    refused(&["--kv-heads", "0"], &["kv_heads 0", "1, 2, 4"]);
    refused(
        &["--heads", "8", "--kv-heads", "3"],
        &["kv_heads 3", "heads 8", "1, 2, 4, 8"],
    );
    // the kv heads follow --heads unless given
    refused(
        &["--model", "gpt2", "--kv-heads", "5"],
        &["heads 12", "1, 2, 3, 4, 6, 12"],
    );
}
