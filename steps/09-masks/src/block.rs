//! The block mask: each tile of (a block of queries, a block of keys) classified once, so
//! that a kernel never loads an empty tile and evaluates the mask only in partial ones
//! (FlexAttention's `create_block_mask`).
//!
//! A tile is *empty* when no query of its block sees any of its keys, *full* when every
//! query sees every key, *partial* otherwise. A score function does not change the class:
//! it is applied to every score of a full tile too. Causal attention's diagonal tiles are
//! the partial ones the reader already knows from step 02.
//!
//! ## Layout
//!
//! One *table* per sequence and per head that the mask varies with ([`Mask::varies_with`]),
//! one in all for a mask that varies with neither; table `t` of sequence `b`, query head
//! `h` is [`BlockMask::table`]. With `tables` tables, `m` query blocks and `n` key blocks,
//! every array is row-major:
//!
//! - `tiles`: `[tables, m, n]`, a [`Tile`] as `u8` (0 empty, 1 partial, 2 full).
//! - `kv_count`: `[tables, m]`, the non-empty key blocks of each query block.
//! - `kv_index`: `[tables, m, n]`, their indices, ascending, in the first `kv_count`
//!   places of the row (the rest −1).
//! - `kv_full`: `[tables, m, n]`, 1 where the key block in that place is full, else 0.
//! - `q_count`, `q_index`, `q_full`: the transpose for the backward, `[tables, n]` and
//!   `[tables, n, m]`: for each key block, the query blocks that see any of it.
//!
//! These are FlexAttention's `kv_num_blocks`, `kv_indices` (with the full blocks flagged in
//! place rather than in a second list) and their transposes, `q_num_blocks`, `q_indices`.

use std::fmt::Write;

use flash_core::AttnError;

use crate::mask::{Mask, Varies};

/// How many queries and how many keys one tile holds (FlexAttention's `Q_BLOCK_SIZE`,
/// `KV_BLOCK_SIZE`). Any sizes of at least 1 give the same answer up to rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSizes {
    pub queries: usize,
    pub keys: usize,
}

impl Default for BlockSizes {
    /// 64 × 64, step 02's block.
    fn default() -> Self {
        BlockSizes {
            queries: 64,
            keys: 64,
        }
    }
}

/// A tile's class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Tile {
    Empty = 0,
    Partial = 1,
    Full = 2,
}

/// The tiles of one mask for one shape, and the lists the kernels read.
#[derive(Clone, Debug)]
pub struct BlockMask {
    mask: Mask,
    blocks: BlockSizes,
    batch: usize,
    heads: usize,
    q_tokens: usize,
    kv_tokens: usize,
    varies: Varies,
    q_blocks: usize,
    kv_blocks: usize,
    /// Scores each table's mask lets through, `[tables]`.
    visible: Vec<u64>,
    tiles: Vec<u8>,
    kv_count: Vec<i32>,
    kv_index: Vec<i32>,
    kv_full: Vec<u8>,
    q_count: Vec<i32>,
    q_index: Vec<i32>,
    q_full: Vec<u8>,
}

impl BlockMask {
    // ANCHOR: block_mask
    /// Classifies every tile of `mask` for `batch` sequences and `heads` query heads of
    /// `q_tokens` queries (the last ones) against `kv_tokens` keys. A built-in mask counts
    /// each row's keys as an interval ([`Mask::row_keys`]); a custom one is asked about
    /// every (query, key) pair once.
    pub fn new(
        mask: &Mask,
        (batch, heads, q_tokens, kv_tokens): (usize, usize, usize, usize),
        blocks: BlockSizes,
    ) -> Result<BlockMask, AttnError> {
        if blocks.queries == 0 || blocks.keys == 0 {
            return Err(AttnError::Unsupported {
                what: format!("block sizes {blocks:?}: both must be at least 1"),
            });
        }
        if q_tokens > kv_tokens {
            return Err(AttnError::Unsupported {
                what: format!(
                    "{q_tokens} queries on {kv_tokens} keys: the queries are the last \
                     tokens, so there can be no more of them than keys"
                ),
            });
        }
        mask.check(batch, kv_tokens)?;
        let varies = mask.varies_with();
        let (q_blocks, kv_blocks) = (
            q_tokens.div_ceil(blocks.queries),
            kv_tokens.div_ceil(blocks.keys),
        );
        let (bt, ht) = (
            if varies.batch { batch } else { batch.min(1) },
            if varies.head { heads } else { heads.min(1) },
        );
        let tables = bt * ht;
        let offset = kv_tokens - q_tokens;
        let mut visible = vec![0u64; tables];
        // seen[tile]: the scores of each tile of one table the mask lets through
        let mut tiles = Vec::with_capacity(tables * q_blocks * kv_blocks);
        let mut seen = vec![0usize; q_blocks * kv_blocks];
        for b in 0..bt {
            for h in 0..ht {
                seen.fill(0);
                for i in 0..q_tokens {
                    let (qp, row) = (i + offset, i / blocks.queries);
                    let count = &mut seen[row * kv_blocks..(row + 1) * kv_blocks];
                    match mask.row_keys(b, qp, kv_tokens) {
                        Some((lo, hi)) => {
                            // the interval lo..hi, cut at the key blocks' edges
                            let mut k = lo;
                            while k < hi {
                                let end = ((k / blocks.keys + 1) * blocks.keys).min(hi);
                                count[k / blocks.keys] += end - k;
                                k = end;
                            }
                        }
                        None => {
                            for k in 0..kv_tokens {
                                count[k / blocks.keys] +=
                                    usize::from(mask.allows(b, h, qp, k));
                            }
                        }
                    }
                }
                visible[b * ht + h] = seen.iter().map(|&n| n as u64).sum();
                for (t, &n) in seen.iter().enumerate() {
                    let (i, j) = (t / kv_blocks, t % kv_blocks);
                    let rows = (q_tokens - i * blocks.queries).min(blocks.queries);
                    let cols = (kv_tokens - j * blocks.keys).min(blocks.keys);
                    tiles.push(if n == 0 {
                        Tile::Empty
                    } else if n == rows * cols {
                        Tile::Full
                    } else {
                        Tile::Partial
                    } as u8);
                }
            }
        }
        let (kv_count, kv_index, kv_full) =
            lists(&tiles, tables, q_blocks, kv_blocks, false);
        let (q_count, q_index, q_full) = lists(&tiles, tables, q_blocks, kv_blocks, true);
        Ok(BlockMask {
            mask: mask.clone(),
            blocks,
            batch,
            heads,
            q_tokens,
            kv_tokens,
            varies,
            q_blocks,
            kv_blocks,
            visible,
            tiles,
            kv_count,
            kv_index,
            kv_full,
            q_count,
            q_index,
            q_full,
        })
    }
    // ANCHOR_END: block_mask

    /// The mask the tiles were classified for.
    pub fn mask(&self) -> &Mask {
        &self.mask
    }

    pub fn blocks(&self) -> BlockSizes {
        self.blocks
    }

    /// `(batch, heads, q_tokens, kv_tokens)`, the shape it was made for.
    pub fn shape(&self) -> (usize, usize, usize, usize) {
        (self.batch, self.heads, self.q_tokens, self.kv_tokens)
    }

    /// Query blocks, `⌈q_tokens / queries⌉`.
    pub fn q_blocks(&self) -> usize {
        self.q_blocks
    }

    /// Key blocks, `⌈kv_tokens / keys⌉`.
    pub fn kv_blocks(&self) -> usize {
        self.kv_blocks
    }

    /// How many tables: one per sequence and head the mask varies with.
    pub fn tables(&self) -> usize {
        self.visible.len()
    }

    /// What the tables vary with.
    pub fn varies(&self) -> Varies {
        self.varies
    }

    /// The table of sequence `b`, query head `h`.
    pub fn table(&self, b: usize, h: usize) -> usize {
        let ht = if self.varies.head { self.heads } else { 1 };
        let b = if self.varies.batch { b } else { 0 };
        let h = if self.varies.head { h } else { 0 };
        b * ht + h
    }

    /// The class of tile (query block `i`, key block `j`) of table `t`.
    pub fn tile(&self, t: usize, i: usize, j: usize) -> Tile {
        match self.tiles[(t * self.q_blocks + i) * self.kv_blocks + j] {
            0 => Tile::Empty,
            1 => Tile::Partial,
            _ => Tile::Full,
        }
    }

    /// `[tables, q_blocks, kv_blocks]`: each tile's class as `u8` (0 empty, 1 partial, 2
    /// full).
    pub fn tiles(&self) -> &[u8] {
        &self.tiles
    }

    /// `[tables, q_blocks]`: the non-empty key blocks of each query block.
    pub fn kv_count(&self) -> &[i32] {
        &self.kv_count
    }

    /// `[tables, q_blocks, kv_blocks]`: their indices, ascending, first `kv_count` places.
    pub fn kv_index(&self) -> &[i32] {
        &self.kv_index
    }

    /// `[tables, q_blocks, kv_blocks]`: 1 where the key block in that place is full.
    pub fn kv_full(&self) -> &[u8] {
        &self.kv_full
    }

    /// `[tables, kv_blocks]`: the query blocks that see any key of each key block.
    pub fn q_count(&self) -> &[i32] {
        &self.q_count
    }

    /// `[tables, kv_blocks, q_blocks]`: their indices, ascending, first `q_count` places.
    pub fn q_index(&self) -> &[i32] {
        &self.q_index
    }

    /// `[tables, kv_blocks, q_blocks]`: 1 where the query block in that place is full.
    pub fn q_full(&self) -> &[u8] {
        &self.q_full
    }

    /// The key blocks query block `i` of table `t` visits, ascending, each with whether it
    /// is full.
    pub fn kv_blocks_of(
        &self,
        t: usize,
        i: usize,
    ) -> impl Iterator<Item = (usize, bool)> + '_ {
        let row = t * self.q_blocks + i;
        let at = row * self.kv_blocks;
        (0..self.kv_count[row] as usize)
            .map(move |n| (self.kv_index[at + n] as usize, self.kv_full[at + n] == 1))
    }

    /// The query blocks that see key block `j` of table `t`, ascending, each with whether
    /// the tile is full.
    pub fn q_blocks_of(
        &self,
        t: usize,
        j: usize,
    ) -> impl Iterator<Item = (usize, bool)> + '_ {
        let row = t * self.kv_blocks + j;
        let at = row * self.q_blocks;
        (0..self.q_count[row] as usize)
            .map(move |n| (self.q_index[at + n] as usize, self.q_full[at + n] == 1))
    }

    /// How many sequence-heads each table stands for.
    fn weight(&self) -> u64 {
        let b = if self.varies.batch { 1 } else { self.batch };
        let h = if self.varies.head { 1 } else { self.heads };
        (b * h) as u64
    }

    /// Scores the mask lets through, over every sequence and head.
    pub fn visible(&self) -> u64 {
        self.visible.iter().sum::<u64>() * self.weight()
    }

    /// The fraction of all `batch·heads·tq·tk` scores the mask lets through.
    pub fn density(&self) -> f64 {
        let all = (self.batch * self.heads * self.q_tokens * self.kv_tokens) as f64;
        if all == 0.0 {
            0.0
        } else {
            self.visible() as f64 / all
        }
    }

    /// Tiles the kernels compute (full and partial), and the partial ones, over every
    /// sequence and head.
    pub fn computed_tiles(&self) -> (u64, u64) {
        let non_empty = self.tiles.iter().filter(|&&t| t != 0).count() as u64;
        let partial = self.tiles.iter().filter(|&&t| t == 1).count() as u64;
        (non_empty * self.weight(), partial * self.weight())
    }

    /// The fraction of all tiles computed.
    pub fn tile_density(&self) -> f64 {
        let all = self.tiles.len() as u64 * self.weight();
        if all == 0 {
            0.0
        } else {
            self.computed_tiles().0 as f64 / all as f64
        }
    }

    /// Scores in the computed tiles (every score of a full or partial tile), and in the
    /// partial ones (where the mask is evaluated), over every sequence and head.
    pub fn computed_scores(&self) -> (u64, u64) {
        let (mut all, mut partial) = (0u64, 0u64);
        for (n, &tile) in self.tiles.iter().enumerate() {
            let (i, j) = ((n / self.kv_blocks) % self.q_blocks, n % self.kv_blocks);
            let rows = (self.q_tokens - i * self.blocks.queries).min(self.blocks.queries);
            let cols = (self.kv_tokens - j * self.blocks.keys).min(self.blocks.keys);
            let area = (rows * cols) as u64;
            if tile != 0 {
                all += area;
            }
            if tile == 1 {
                partial += area;
            }
        }
        (all * self.weight(), partial * self.weight())
    }

    // ANCHOR: picture
    /// Table `t` as text: a row per query block, a character per key block, `#` full, `+`
    /// partial, `.` empty.
    pub fn picture(&self, t: usize) -> String {
        let mut s = String::new();
        for i in 0..self.q_blocks {
            for j in 0..self.kv_blocks {
                s.push(match self.tile(t, i, j) {
                    Tile::Full => '#',
                    Tile::Partial => '+',
                    Tile::Empty => '.',
                });
            }
            s.push('\n');
        }
        let table = &self.tiles[t * self.q_blocks * self.kv_blocks..]
            [..self.q_blocks * self.kv_blocks];
        let count = |class: Tile| table.iter().filter(|&&x| x == class as u8).count();
        let _ = writeln!(
            s,
            "{}: {} × {} tiles of {} × {}: {} full (#), {} partial (+), {} empty (.); \
             {:.1}% of scores visible",
            self.mask.name(),
            self.q_blocks,
            self.kv_blocks,
            self.blocks.queries,
            self.blocks.keys,
            count(Tile::Full),
            count(Tile::Partial),
            count(Tile::Empty),
            100.0 * self.visible[t] as f64 / (self.q_tokens * self.kv_tokens).max(1) as f64,
        );
        s
    }
    // ANCHOR_END: picture
}

/// The list form of `tiles`: for each query block its non-empty key blocks (or, with
/// `transpose`, for each key block its query blocks), count, indices and full flags.
fn lists(
    tiles: &[u8],
    tables: usize,
    m: usize,
    n: usize,
    transpose: bool,
) -> (Vec<i32>, Vec<i32>, Vec<u8>) {
    let (rows, cols) = if transpose { (n, m) } else { (m, n) };
    let mut count = vec![0i32; tables * rows];
    let mut index = vec![-1i32; tables * rows * cols];
    let mut full = vec![0u8; tables * rows * cols];
    for t in 0..tables {
        for r in 0..rows {
            let row = t * rows + r;
            for c in 0..cols {
                let (i, j) = if transpose { (c, r) } else { (r, c) };
                let tile = tiles[(t * m + i) * n + j];
                if tile != Tile::Empty as u8 {
                    let at = row * cols + count[row] as usize;
                    index[at] = c as i32;
                    full[at] = u8::from(tile == Tile::Full as u8);
                    count[row] += 1;
                }
            }
        }
    }
    (count, index, full)
}
