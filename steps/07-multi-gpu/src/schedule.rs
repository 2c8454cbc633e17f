//! Who holds which tokens, and which blocks meet at each step of the ring.
//!
//! The sequence is cut into `2N` chunks for `N` ranks, and rank `r` keeps chunks `r` and
//! `2N - 1 - r` (the zig-zag split): under the causal mask an early chunk sees few keys and
//! a late one many, so pairing the `r`-th earliest with the `r`-th latest gives every rank
//! the same work. Each rank keeps its queries; the keys and values travel: at step `s` rank
//! `r` holds those of rank `(r - s) mod N`, and passes them on to rank `r + 1`.
//!
//! A query chunk `i` and a key chunk `j` meet in one of three ways: `j < i`, every key is
//! before every query and the block is computed whole; `j == i`, the diagonal, with the
//! causal mask; `j > i`, no query sees any key and the block is skipped.

use std::ops::Range;

/// How a block of queries sees a block of keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Visibility {
    /// Every key comes before every query: no mask.
    Full,
    /// The same chunk: the causal mask.
    Diagonal,
    /// Every key comes after every query: nothing to compute.
    None,
}

/// The visibility of key chunk `key` from query chunk `query`.
pub fn visibility(query: usize, key: usize) -> Visibility {
    match key.cmp(&query) {
        std::cmp::Ordering::Less => Visibility::Full,
        std::cmp::Ordering::Equal => Visibility::Diagonal,
        std::cmp::Ordering::Greater => Visibility::None,
    }
}

// ANCHOR: zigzag
/// The zig-zag split of `tokens` over `ranks`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZigZag {
    pub tokens: usize,
    pub ranks: usize,
}

impl ZigZag {
    pub fn new(tokens: usize, ranks: usize) -> ZigZag {
        assert!(ranks > 0, "a ring has at least one rank");
        ZigZag { tokens, ranks }
    }

    /// `2N` chunks.
    pub fn chunks(&self) -> usize {
        2 * self.ranks
    }

    /// The tokens of chunk `c`: as even as can be, the first `tokens % 2N` chunks one
    /// longer.
    pub fn chunk(&self, c: usize) -> Range<usize> {
        let n = self.chunks();
        let (base, extra) = (self.tokens / n, self.tokens % n);
        let start = c * base + c.min(extra);
        start..start + base + usize::from(c < extra)
    }

    /// The two chunks rank `r` keeps, earlier first: `r` and `2N - 1 - r`.
    pub fn rank_chunks(&self, r: usize) -> [usize; 2] {
        [r, self.chunks() - 1 - r]
    }

    /// The positions of rank `r`'s tokens in the sequence, in the order the rank stores
    /// them.
    pub fn rank_tokens(&self, r: usize) -> Vec<usize> {
        self.rank_chunks(r)
            .into_iter()
            .flat_map(|c| self.chunk(c))
            .collect()
    }

    /// Whether every chunk has the same length (what the GPU ring needs).
    pub fn is_even(&self) -> bool {
        self.tokens.is_multiple_of(self.chunks())
    }
}
// ANCHOR_END: zigzag

// ANCHOR: ring_step
/// Whose keys and values rank `r` holds at step `s` of the ring: each step passes them on
/// to the next rank, so after `s` steps rank `r` has those that started on rank `r - s`.
pub fn visiting(r: usize, s: usize, ranks: usize) -> usize {
    (r + ranks - s % ranks) % ranks
}

/// One block to compute: the rank's query chunk `query` (0: its earlier chunk, 1: its
/// later) against the visiting key chunk `key` (likewise), seen as `how`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pair {
    pub query: usize,
    pub key: usize,
    pub how: Visibility,
}

/// The blocks rank `r` computes at step `s`: at most three, and two at every step but the
/// first (where the rank's own keys give two diagonals and one whole block).
pub fn pairs(split: &ZigZag, r: usize, s: usize) -> Vec<Pair> {
    let (mine, theirs) = (
        split.rank_chunks(r),
        split.rank_chunks(visiting(r, s, split.ranks)),
    );
    let mut out = Vec::new();
    for (query, &qc) in mine.iter().enumerate() {
        for (key, &kc) in theirs.iter().enumerate() {
            let how = visibility(qc, kc);
            if how != Visibility::None {
                out.push(Pair { query, key, how });
            }
        }
    }
    out
}
// ANCHOR_END: ring_step

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chunks_cover_the_sequence_once() {
        for tokens in [0, 1, 7, 8, 77, 300, 4096] {
            for ranks in 1..=5 {
                let split = ZigZag::new(tokens, ranks);
                let mut seen = vec![0; tokens];
                for r in 0..ranks {
                    for t in split.rank_tokens(r) {
                        seen[t] += 1;
                    }
                }
                assert!(
                    seen.iter().all(|&n| n == 1),
                    "{tokens} tokens, {ranks} ranks"
                );
                let lens: Vec<usize> =
                    (0..split.chunks()).map(|c| split.chunk(c).len()).collect();
                assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
            }
        }
    }

    #[test]
    fn every_visible_block_is_computed_once_and_the_work_is_balanced() {
        for ranks in 1..=6 {
            let split = ZigZag::new(64 * 2 * ranks, ranks);
            let mut done = vec![vec![0; split.chunks()]; split.chunks()];
            let mut work = vec![0.0; ranks];
            for (r, w) in work.iter_mut().enumerate() {
                for s in 0..ranks {
                    let theirs = split.rank_chunks(visiting(r, s, ranks));
                    for p in pairs(&split, r, s) {
                        let (qc, kc) = (split.rank_chunks(r)[p.query], theirs[p.key]);
                        assert_eq!(p.how, visibility(qc, kc));
                        done[qc][kc] += 1;
                        *w += if p.how == Visibility::Full { 1.0 } else { 0.5 };
                    }
                }
            }
            for (qc, row) in done.iter().enumerate() {
                for (kc, &n) in row.iter().enumerate() {
                    assert_eq!(
                        n,
                        usize::from(kc <= qc),
                        "query chunk {qc}, key chunk {kc}"
                    );
                }
            }
            // every rank: two diagonals and 2N - 1 whole blocks, 2N of the causal square's
            // 2N² (in whole blocks)
            assert!(work.iter().all(|&w| w == work[0]), "{work:?}");
            assert_eq!(work[0], 2.0 * ranks as f64 - 1.0 + 1.0);
        }
    }

    #[test]
    fn the_keys_go_round_the_ring() {
        for ranks in 1..=4 {
            for r in 0..ranks {
                let origins: Vec<usize> =
                    (0..ranks).map(|s| visiting(r, s, ranks)).collect();
                assert_eq!(origins[0], r);
                let mut sorted = origins.clone();
                sorted.sort();
                assert_eq!(sorted, (0..ranks).collect::<Vec<_>>());
                // what rank r holds at step s + 1 is what rank r - 1 held at step s
                for s in 0..ranks - 1 {
                    assert_eq!(
                        visiting(r, s + 1, ranks),
                        visiting((r + ranks - 1) % ranks, s, ranks)
                    );
                }
            }
        }
    }
}
