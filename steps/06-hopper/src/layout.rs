//! Where a tensor's values are: the kernels read q, k, v, the output and its gradient, and
//! write the output and the gradients, at any strides between batches, heads and tokens, so
//! that a caller whose tensors live in other buffers (the trainer's fused projection, the rows
//! its output projection reads) hands them over without a copy.

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

// SAFETY: plain integers, laid out as the kernels' struct (three 8-byte fields, a 4-byte one
// and its padding: 32 bytes, as the assertion below checks)
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
    /// One row per token of q's, k's and v's heads side by side, `[batch · tokens, 3 · heads ·
    /// head_dim]`, from each third's first column: the layout of the trainer's fused projection
    /// (and of its gradient).
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

    /// That this layout fits `s` (its heads, a token's values not overlapping the next's, no
    /// negative stride) and that the address and strides are multiples of `align` bytes, of
    /// which 16-bit values: 16 for what TMA reads (its rule for addresses and strides), 4 for
    /// what the kernels write or read in pairs. `what` names the tensor.
    pub fn check(&self, s: Shape, ptr: u64, align: u64, what: &str) -> Result<(), AttnError> {
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
