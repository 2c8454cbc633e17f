//! `cargo bench -p step09-masks`: the CPU forward and backward of step 09 with several
//! masks on one shape (one sequence, 12 heads, 2,048 tokens, head dim 64), the block mask
//! made once outside the timed loop, as a kernel would use it. Throughput is the scores the
//! mask lets through times four FLOPs per head-dim element (`4·d·visible`, the forward's
//! count for the work that is kept), so criterion's "elem/s" reads as FLOP/s of useful work:
//! a mask that skips well keeps it near causal's.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use flash_core::Shape;
use flash_core::inputs::{random_normal, random_qkv};
use step09_masks::{BlockMask, BlockSizes, Documents, Mask, ScoreMod};
use step09_masks::{backward_with, forward_with};

const TOKENS: usize = 2048;

fn masks() -> Vec<(Mask, ScoreMod)> {
    let documents = Documents::from_lengths(&[256; TOKENS / 256]).expect("lengths of 256");
    vec![
        (Mask::Causal, ScoreMod::None),
        (Mask::Sliding { window: 256 }, ScoreMod::None),
        (Mask::Documents(documents), ScoreMod::None),
        (Mask::Causal, ScoreMod::SoftCap { cap: 30.0 }),
    ]
}

fn masked(c: &mut Criterion) {
    let shape = Shape::new(1, 12, TOKENS, 64);
    let [q, k, v] = random_qkv(shape, 0);
    let dout = random_normal(shape, 1);
    let dims = (1, 12, TOKENS, TOKENS);
    let mut group = c.benchmark_group("masked");
    group.sample_size(10);
    for (mask, score) in masks() {
        let name = format!("{},{}", mask.name(), score.name());
        let bm = BlockMask::new(&mask, dims, BlockSizes::default()).expect("a valid mask");
        let flops = 4 * bm.visible() * shape.head_dim as u64;
        group.throughput(Throughput::Elements(flops));
        let (q, k, v) = (q.view(), k.view(), v.view());
        group.bench_function(BenchmarkId::new("forward", &name), |b| {
            b.iter(|| forward_with(q, k, v, &bm, &score).unwrap())
        });
        let (fwd, _) = forward_with(q, k, v, &bm, &score).unwrap();
        // the backward's five products where the forward has two
        group.throughput(Throughput::Elements(flops * 5 / 2));
        group.bench_function(BenchmarkId::new("backward", &name), |b| {
            b.iter(|| backward_with(q, k, v, &fwd, dout.view(), &bm, &score).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, masked);
criterion_main!(benches);
