//! The host's half of a paged cache: which pages of the pool hold each sequence's tokens,
//! how many tokens each sequence holds, and which pages are free. Pure bookkeeping, with no
//! GPU in it: [`PagedKvCache`](crate::cuda::PagedKvCache) keeps a [`PageTable`] and copies
//! its table to the device when it changes, and the tests check it on any machine.
//!
//! ## Layout
//!
//! - [`PageTable`]: `[batch, max_pages]` page indices (`-1` where a sequence has no page
//!   yet), each sequence's length, and a free list: a sequence that grows past its last
//!   page takes the next free one, and [`PageTable::release`] gives its pages back.
//! - [`check_table`]: a table's entries name pages of the pool, each page one sequence's,
//!   as many as each sequence's tokens need; run whenever the table changes, before the
//!   kernels read it.

use flash_core::AttnError;
use flash_core::inputs::SplitMix64;

use crate::kernel::check_page_size;

/// Tokens per page of this step's paged caches: the model's and the registry's
/// `flash_decode_paged`.
pub const PAGE_SIZE: usize = 64;

/// Which pages hold each sequence's tokens: token `t` of sequence `b` is row
/// `t % page_size` of page `table[b · max_pages + t / page_size]`.
///
/// Invariants, kept by every method: each sequence has exactly the pages its length needs
/// (`⌈len / page_size⌉`, the first entries of its row, the rest `-1`); a page is one
/// sequence's or free, never both; lengths are at most `max_len`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageTable {
    page_size: usize,
    /// Pages in the pool.
    pool: usize,
    /// Tokens a sequence may hold.
    max_len: usize,
    /// A row of the table: the pages of a sequence of `max_len` tokens.
    max_pages: usize,
    table: Vec<i32>,
    lens: Vec<usize>,
    /// The free pages; a sequence that needs one takes the last.
    free: Vec<i32>,
    /// One page a sequence from the start, `max_len` long: a contiguous cache, whose pages
    /// are never handed out or given back.
    contiguous: bool,
}

impl PageTable {
    /// An empty table for `batch` sequences of at most `max_len` tokens in pages of
    /// `page_size` tokens, from a pool of `pool` pages, all free; pages are handed out in
    /// the pool's order (0, 1, 2, ...) until [`PageTable::shuffle_free`] changes it.
    pub fn new(
        batch: usize,
        max_len: usize,
        page_size: usize,
        pool: usize,
    ) -> Result<PageTable, AttnError> {
        check_page_size(page_size)?;
        if page_size == 0 {
            return Err(AttnError::Unsupported {
                what: "a paged cache with pages of 0 tokens".into(),
            });
        }
        check_counts(batch, max_len)?;
        if pool == 0 || pool > i32::MAX as usize {
            return Err(AttnError::Unsupported {
                what: format!(
                    "a pool of {pool} pages: a paged cache takes 1 to 2^31 - 1 pages \
                     ({} for {batch} sequences of {max_len} tokens)",
                    batch * max_len.div_ceil(page_size)
                ),
            });
        }
        let max_pages = max_len.div_ceil(page_size);
        Ok(PageTable {
            page_size,
            pool,
            max_len,
            max_pages,
            table: vec![-1; batch * max_pages],
            lens: vec![0; batch],
            free: (0..pool as i32).rev().collect(),
            contiguous: false,
        })
    }

    /// A contiguous cache's table: sequence `b`'s tokens are page `b`, one page of
    /// `max_len` tokens, its own from the start.
    pub fn contiguous(batch: usize, max_len: usize) -> Result<PageTable, AttnError> {
        check_counts(batch, max_len)?;
        Ok(PageTable {
            page_size: max_len,
            pool: batch,
            max_len,
            max_pages: 1,
            table: (0..batch as i32).collect(),
            lens: vec![0; batch],
            free: Vec::new(),
            contiguous: true,
        })
    }

    /// The free pages in an order shuffled by `seed` (Fisher–Yates), so that a sequence's
    /// pages lie out of order in the pool: what a server's pool looks like after sequences
    /// have come and gone, and what the tests and the benchmark read through.
    pub fn shuffle_free(&mut self, seed: u64) {
        let mut rng = SplitMix64::new(seed);
        for i in (1..self.free.len()).rev() {
            self.free
                .swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
    }

    // ANCHOR: grow
    /// `added[b]` more tokens at the end of sequence `b`, for every `b`: each sequence
    /// takes the free pages its new tokens need. All or nothing: on an error (a sequence
    /// past `max_len`, the pool out of pages) nothing changed. Returns whether the table
    /// did.
    pub fn grow(&mut self, added: &[usize]) -> Result<bool, AttnError> {
        let batch = self.lens.len();
        if added.len() != batch {
            return Err(AttnError::ShapeMismatch {
                what: format!(
                    "new tokens for {} sequences; the cache holds {batch}: one count a \
                     sequence",
                    added.len()
                ),
            });
        }
        let mut wanted = 0;
        for (b, (&len, &n)) in self.lens.iter().zip(added).enumerate() {
            if n > self.max_len - len {
                return Err(AttnError::Unsupported {
                    what: format!(
                        "sequence {b} holds {len} tokens and {n} more would make {}, past \
                         the cache's {} a sequence",
                        len + n,
                        self.max_len
                    ),
                });
            }
            wanted += self.missing(b, len + n).count();
        }
        if wanted > self.free.len() {
            return Err(AttnError::Unsupported {
                what: format!(
                    "{wanted} more pages of {} tokens for the new tokens, and {} of the \
                     pool's {} are free: release finished sequences, or make the cache \
                     with a larger pool",
                    self.page_size,
                    self.free.len(),
                    self.pool
                ),
            });
        }
        for (b, &n) in added.iter().enumerate() {
            let missing: Vec<usize> = self.missing(b, self.lens[b] + n).collect();
            for at in missing {
                self.table[at] = self.free.pop().expect("counted above");
            }
            self.lens[b] += n;
        }
        Ok(wanted > 0)
    }
    // ANCHOR_END: grow

    /// Empties sequence `seq`: its length 0, its pages back to the free list (a contiguous
    /// cache keeps its one page). Returns whether the table changed.
    pub fn release(&mut self, seq: usize) -> Result<bool, AttnError> {
        let batch = self.lens.len();
        if seq >= batch {
            return Err(AttnError::ShapeMismatch {
                what: format!(
                    "sequence {seq} of a cache of {batch}: sequences 0 to {}",
                    batch - 1
                ),
            });
        }
        self.lens[seq] = 0;
        if self.contiguous {
            return Ok(false);
        }
        let row = &mut self.table[seq * self.max_pages..(seq + 1) * self.max_pages];
        let held: Vec<i32> = row.iter().copied().filter(|&p| p >= 0).collect();
        row.fill(-1);
        // the last page given back is the first taken again
        self.free.extend(held.iter().rev());
        Ok(!held.is_empty())
    }

    /// Each sequence's length.
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// The longest sequence's length: the keys a split must cover.
    pub fn longest(&self) -> usize {
        self.lens.iter().copied().max().unwrap_or(0)
    }

    /// The table, `[batch, max_pages]`, `-1` where a sequence has no page.
    pub fn table(&self) -> &[i32] {
        &self.table
    }

    pub fn batch(&self) -> usize {
        self.lens.len()
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn max_pages(&self) -> usize {
        self.max_pages
    }

    pub fn max_len(&self) -> usize {
        self.max_len
    }

    pub fn pool(&self) -> usize {
        self.pool
    }

    /// Pages no sequence holds.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// [`check_table`] on this table and these lengths.
    pub fn check(&self) -> Result<(), AttnError> {
        check_table(
            &self.table,
            &self.lens,
            self.max_pages,
            self.pool,
            self.page_size,
        )
    }

    /// The table entries of sequence `b` without a page that `len` tokens need (a
    /// contiguous cache's one page is there from the start).
    fn missing(&self, b: usize, len: usize) -> impl Iterator<Item = usize> + '_ {
        let row = b * self.max_pages;
        (row..row + len.div_ceil(self.page_size)).filter(|&at| self.table[at] < 0)
    }
}

fn check_counts(batch: usize, max_len: usize) -> Result<(), AttnError> {
    if batch == 0 || max_len == 0 || max_len > i32::MAX as usize {
        return Err(AttnError::Unsupported {
            what: format!(
                "a cache of {batch} sequences of {max_len} tokens: at least one sequence, \
                 and 1 to 2^31 - 1 tokens a sequence"
            ),
        });
    }
    Ok(())
}

// ANCHOR: check_table
/// Checks a page table before the kernels read it: `table` holds a row of `max_pages`
/// entries for each sequence of `lens`; each sequence's first `⌈len / page_size⌉` entries,
/// the pages the kernels read and write, name pages of the pool, `0 .. pages`, and no page
/// is named twice (two sequences writing one page would overwrite each other's tokens).
/// Entries after those are never read (`-1`, say).
pub fn check_table(
    table: &[i32],
    lens: &[usize],
    max_pages: usize,
    pages: usize,
    page_size: usize,
) -> Result<(), AttnError> {
    if page_size == 0 || table.len() != lens.len() * max_pages {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "the page table holds {} entries for {} sequences of {max_pages} pages of \
                 {page_size} tokens; it must be [batch, max_pages], pages of a token or \
                 more",
                table.len(),
                lens.len()
            ),
        });
    }
    // for each page, the (sequence, entry) that holds it
    let mut owner: Vec<Option<(usize, usize)>> = vec![None; pages];
    for (b, &len) in lens.iter().enumerate() {
        let used = len.div_ceil(page_size);
        if used > max_pages {
            return Err(AttnError::ShapeMismatch {
                what: format!(
                    "sequence {b} holds {len} tokens, {used} pages of {page_size}, and the \
                     table's rows have {max_pages} entries"
                ),
            });
        }
        for p in 0..used {
            let entry = table[b * max_pages + p];
            if entry < 0 || entry as usize >= pages {
                return Err(AttnError::Unsupported {
                    what: format!(
                        "page table entry {p} of sequence {b} (tokens {} to {}) is page \
                         {entry}, but the pool holds {pages} pages: every page a sequence \
                         uses must be one of 0 to {}",
                        p * page_size,
                        ((p + 1) * page_size).min(len) - 1,
                        pages as i64 - 1
                    ),
                });
            }
            if let Some((b0, p0)) = owner[entry as usize].replace((b, p)) {
                return Err(AttnError::Unsupported {
                    what: format!(
                        "page {entry} is entry {p0} of sequence {b0} and entry {p} of \
                         sequence {b}: a page holds one sequence's tokens"
                    ),
                });
            }
        }
    }
    Ok(())
}
// ANCHOR_END: check_table
