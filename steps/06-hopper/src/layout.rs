//! Where a tensor's values are: the kernels read q, k, v, the output and its gradient, and
//! write the output and the gradients, at any strides between batches, heads and tokens, so
//! that a caller whose tensors live in other buffers (the trainer's fused projection, the
//! rows its output projection reads) hands them over without a copy.

use cudarc::driver::DeviceRepr;
use flash_core::{AttnError, Shape};

/// The strides, in values, between batches, heads and tokens (a token's head-dim values
/// contiguous), and the heads per batch; the kernels' `Layout` (hopper.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub batch: i64,
    pub head: i64,
    pub token: i64,
    pub heads: i32,
    /// The 4 bytes the C struct ends with (its size is a multiple of its 8-byte alignment),
    /// zero rather than left to chance when the struct is copied to the kernel.
    _pad: i32,
}

// SAFETY: plain integers, laid out as the kernels' struct (three 8-byte fields, a 4-byte
// one and its padding: 32 bytes, as the assertion below checks)
unsafe impl DeviceRepr for Layout {}
const _: () = assert!(std::mem::size_of::<Layout>() == 32);

/// A tensor on the device: the address of its first value and where the others are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    pub ptr: u64,
    pub layout: Layout,
}

impl Layout {
    /// The layout of `[batch, heads, tokens, head_dim]` values at these strides.
    pub fn new(s: Shape, batch: i64, head: i64, token: i64) -> Self {
        Layout {
            batch,
            head,
            token,
            heads: s.heads as i32,
            _pad: 0,
        }
    }

    /// `[batch, heads, tokens, head_dim]`, contiguous: the layout of a `DeviceTensor`.
    pub fn heads(s: Shape) -> Self {
        let (h, t, d) = (s.heads as i64, s.tokens as i64, s.head_dim as i64);
        Layout::new(s, h * t * d, t * d, d)
    }

    // ANCHOR: fused_rows
    /// One row per token of q's, k's and v's heads side by side, `[batch · tokens, 3 ·
    /// heads · head_dim]`, from each third's first column: the layout of the trainer's
    /// fused projection (and of its gradient).
    pub fn fused_rows(s: Shape) -> Self {
        let row = 3 * (s.heads * s.head_dim) as i64;
        Layout::new(s, s.tokens as i64 * row, s.head_dim as i64, row)
    }

    /// One row per token of every head, `[batch · tokens, heads · head_dim]`: the layout of
    /// the rows the trainer's output projection reads (the attention's output, and its
    /// gradient).
    pub fn rows(s: Shape) -> Self {
        let row = (s.heads * s.head_dim) as i64;
        Layout::new(s, s.tokens as i64 * row, s.head_dim as i64, row)
    }
    // ANCHOR_END: fused_rows

    // [step 08]
    /// [`Layout::fused_rows`] when k and v have `kv_heads` heads each (grouped-query
    /// attention): rows of `(heads + 2 · kv_heads) · head_dim` values, of which this layout
    /// reads `of` heads (q's `s.heads`, or k's or v's `kv_heads`).
    pub fn fused_grouped(s: Shape, kv_heads: usize, of: usize) -> Self {
        let row = ((s.heads + 2 * kv_heads) * s.head_dim) as i64;
        let tensor = Shape::new(s.batch, of, s.tokens, s.head_dim);
        Layout::new(tensor, s.tokens as i64 * row, s.head_dim as i64, row)
    }
    // [/step 08]

    /// The values a tensor spans from its first: the last one's offset, plus one.
    pub fn span(&self, s: Shape) -> usize {
        if s.is_empty() {
            return 0;
        }
        let last = (s.batch as i64 - 1) * self.batch
            + (s.heads as i64 - 1) * self.head
            + (s.tokens as i64 - 1) * self.token
            + s.head_dim as i64;
        last as usize
    }

    /// That this layout fits `s` (its heads, a token's values not overlapping the next's,
    /// no negative stride) and that the address and strides are multiples of `align` bytes,
    /// of which 16-bit values: 16 for what TMA reads (its rule for addresses and strides),
    /// 4 for what the kernels write or read in pairs. `what` names the tensor.
    pub fn check(
        &self,
        s: Shape,
        ptr: u64,
        align: u64,
        what: &str,
    ) -> Result<(), AttnError> {
        if self.heads as usize != s.heads
            || self.token < s.head_dim as i64
            || self.head < 0
            || self.batch < 0
        {
            return Err(AttnError::Unsupported {
                what: format!(
                    "{what}: a layout of {} heads and {} values a token for {s}",
                    self.heads, self.token
                ),
            });
        }
        let strides = [self.batch, self.head, self.token];
        if !ptr.is_multiple_of(align)
            || strides
                .iter()
                .any(|&x| !((2 * x) as u64).is_multiple_of(align))
        {
            return Err(AttnError::Unsupported {
                what: format!(
                    "{what} at {ptr:#x} with strides {strides:?} values: the kernels need the address and the strides' bytes to be multiples of {align}"
                ),
            });
        }
        Ok(())
    }
}

/// How a launch's tensor maps address a head's rows, a compile-time choice of its kernels
/// (`TMA_RANK`): with every layout of the launch keeping one head after another at the same
/// distance across batches (a `[batch, heads, tokens, head_dim]` tensor, or one batch),
/// batches and heads merge into one dimension of the maps, and the kernels ask TMA for
/// boxes in three coordinates, as they did before layouts; otherwise in four.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TmaRank {
    Three,
    Four,
}

impl TmaRank {
    /// The rank the tensors `layouts` of shape `s` can be read with.
    pub fn of(layouts: &[Layout], s: Shape) -> Self {
        let merges = |l: &Layout| s.batch <= 1 || l.batch == s.heads as i64 * l.head;
        if layouts.iter().all(merges) {
            TmaRank::Three
        } else {
            TmaRank::Four
        }
    }

    /// The kernels' compile option.
    pub fn define(self) -> String {
        format!("-DTMA_RANK={}", self.rank())
    }

    pub fn rank(self) -> u32 {
        match self {
            TmaRank::Three => 3,
            TmaRank::Four => 4,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_maps_merge_batches_and_heads_only_where_the_layout_allows() {
        let s = Shape::new(2, 3, 300, 64);
        assert_eq!(TmaRank::of(&[Layout::heads(s)], s), TmaRank::Three);
        assert_eq!(TmaRank::of(&[Layout::fused_rows(s)], s), TmaRank::Four);
        assert_eq!(
            TmaRank::of(&[Layout::heads(s), Layout::rows(s)], s),
            TmaRank::Four
        );
        // one batch: every layout is one head after another
        let one = Shape::new(1, 3, 300, 64);
        assert_eq!(TmaRank::of(&[Layout::fused_rows(one)], one), TmaRank::Three);
    }

    #[test]
    fn a_layout_is_checked_against_its_shape_and_the_alignment() {
        let s = Shape::new(2, 3, 300, 64);
        let l = Layout::fused_rows(s);
        assert_eq!(l.span(s), (2 * 300 - 1) * 3 * 3 * 64 + 2 * 64 + 64);
        assert!(l.check(s, 4096, 16, "q").is_ok());
        let e = l.check(s, 4096 + 4, 16, "q").unwrap_err().to_string();
        assert!(e.contains("multiples of 16"), "{e}");
        assert!(l.check(s, 4096 + 4, 4, "the output").is_ok());
        let e = l
            .check(Shape::new(2, 4, 300, 64), 4096, 16, "k")
            .unwrap_err()
            .to_string();
        assert!(e.contains("3 heads"), "{e}");
    }

    // [step 08]
    #[test]
    fn grouped_rows_are_the_fused_rows_without_the_shared_heads() {
        let s = Shape::new(2, 4, 300, 64);
        // one kv head per query head: the fused rows
        assert_eq!(Layout::fused_grouped(s, 4, 4), Layout::fused_rows(s));
        // 4 query heads on 1 kv head: rows of 6 heads; k's layout has one head
        let k = Layout::fused_grouped(s, 1, 1);
        assert_eq!((k.token, k.head, k.heads), (6 * 64, 64, 1));
        assert_eq!(k.batch, 300 * 6 * 64);
        let kv = Shape::new(2, 1, 300, 64);
        assert!(k.check(kv, 4096, 16, "k").is_ok());
        assert!(k.check(s, 4096, 16, "k").is_err());
    }
    // [/step 08]
}
