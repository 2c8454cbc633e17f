//! `cargo bench -p step01-naive`: attention by hand on the tutorial's CPU shape (one
//! sequence, 12 heads, head dim 64) at lengths short enough for criterion's many samples.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use flash_core::Shape;
use flash_core::inputs::random_qkv;
use step01_naive::attention;

fn by_hand(c: &mut Criterion) {
    let mut group = c.benchmark_group("naive");
    group.sample_size(10);
    for tokens in [256, 512, 1024] {
        let shape = Shape::new(1, 12, tokens, 64);
        let [q, k, v] = random_qkv(shape, 0);
        group.throughput(Throughput::Elements(shape.forward_flops() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(tokens), &tokens, |b, _| {
            b.iter(|| attention(q.view(), k.view(), v.view()).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, by_hand);
criterion_main!(benches);
