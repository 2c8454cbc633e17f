//! The solution of chapter 9's exercise: a dilated sliding window.

// ANCHOR: dilated
/// Whether query position `q` sees key `k` in a sliding window of `window` keys taken every
/// `dilation`-th key: causal, `q − k < window · dilation`, and `q − k` a multiple of
/// `dilation` (so the query sees itself, and `window` keys in all when there are enough).
pub fn dilated(q: usize, k: usize, window: usize, dilation: usize) -> bool {
    k <= q && q - k < window * dilation && (q - k).is_multiple_of(dilation)
}
// ANCHOR_END: dilated
