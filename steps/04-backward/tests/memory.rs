//! The blockwise backward allocates nothing of size T×T: its peak memory grows with T, the
//! backward by hand's with T². Measured by counting every allocation of this test process.
//!
//! One test in this file on purpose: the counter is global to the process, and tests of one
//! file run on parallel threads.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use flash_core::Shape;
use flash_core::inputs::{random_normal, random_qkv};
use step04_backward::{backward, backward_by_hand, forward};

/// The system allocator, keeping the bytes in use and their high-water mark.
struct Counting;

static IN_USE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = IN_USE.fetch_add(layout.size(), Relaxed) + layout.size();
            PEAK.fetch_max(now, Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) };
        IN_USE.fetch_sub(layout.size(), Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Bytes allocated by `f` at its peak, beyond what was in use before it ran.
fn peak_of<T>(f: impl FnOnce() -> T) -> usize {
    let before = IN_USE.load(Relaxed);
    PEAK.store(before, Relaxed);
    let out = f();
    let peak = PEAK.load(Relaxed) - before;
    drop(out);
    peak
}

#[test]
fn the_blockwise_backward_keeps_no_table() {
    let mut peaks = Vec::new();
    for tokens in [512, 2048] {
        let shape = Shape::new(1, 2, tokens, 16);
        let [q, k, v] = random_qkv(shape, 1);
        let dout = random_normal(shape, 2);
        let fwd = forward(q.view(), k.view(), v.view()).unwrap();
        // the first call also starts rayon's threads; measure the second
        backward(q.view(), k.view(), v.view(), &fwd, dout.view()).unwrap();
        let blockwise =
            peak_of(|| backward(q.view(), k.view(), v.view(), &fwd, dout.view()));
        let by_hand =
            peak_of(|| backward_by_hand(q.view(), k.view(), v.view(), &fwd, dout.view()));
        let grads = 3 * shape.len() * 4; // dq, dk and dv
        let table = 2 * tokens * tokens * 4; // one [b, h, T, T] table of f32
        println!(
            "T = {tokens}: blockwise {blockwise} B, by hand {by_hand} B; gradients {grads} B, one table {table} B"
        );
        // by hand: the gradients and its two tables, P and dP
        assert!(
            by_hand >= grads + 2 * table,
            "by hand at T = {tokens}: {by_hand} B"
        );
        // blockwise: the gradients, δ, at most three more copies of dQ (one per extra run
        // of key blocks) and at most 512 KiB per thread (the 128×128 blocks P and dS, 128
        // KiB, and the buffers the products pack their operands into), whatever the length;
        // far below one table
        let per_thread = 512 * 1024;
        let threads = rayon::current_num_threads();
        let delta = shape.batch * shape.heads * tokens * 4;
        let dq_copies = 3 * shape.len() * 4;
        assert!(
            blockwise <= grads + delta + dq_copies + threads * per_thread
                && blockwise < table,
            "blockwise at T = {tokens}: {blockwise} B with {threads} threads; one table is {table} B"
        );
        peaks.push(blockwise);
    }
    // four times the tokens: about four times the memory (a little more here, as the head
    // is cut into more runs of key blocks, each with its dQ), where a table takes sixteen
    // times
    assert!(peaks[1] <= 5 * peaks[0], "peaks {peaks:?}");
}
