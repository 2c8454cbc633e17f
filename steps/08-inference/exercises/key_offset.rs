//! Chapter 8's exercise: a token's place in a paged cache. Write `key_offset`, then check
//! it:
//!
//! ```sh
//! cargo run -p step08-inference --bin decode-exercise -- key-offset
//! ```
//!
//! `git checkout steps/08-inference/exercises` brings the template back.

// the parameters are unused until the body is written
#![allow(unused_variables)]

use step08_inference::exercise::{Pool, Table};

/// Where the `pool.head_dim` values of token `t` of kv head `kvh` of sequence `b` start in
/// the pool, counted in values from the pool's start; `None` where sequence `b` does not
/// hold token `t` (`t ≥ table.lens[b]`). The pool is `[pages, kv_heads, page_size,
/// head_dim]`, row-major; entry `p` of sequence `b` in the table,
/// `table.entries[b · table.max_pages + p]`, is the page that holds its tokens
/// `p · page_size` to `(p + 1) · page_size − 1` (`-1` where it has no page yet).
pub fn key_offset(
    pool: &Pool,
    table: &Table,
    b: usize,
    kvh: usize,
    t: usize,
) -> Option<usize> {
    todo!("the table's entry for the token's page, then the token's row in that page")
}
