//! `cargo bench -p step04-backward`: the backward by hand and the blockwise backward on the
//! tutorial's CPU shape (one sequence, 12 heads, head dim 64), at lengths short enough for
//! criterion's many samples. The forward is run once, outside the timing; the throughput is
//! the backward's FLOP count, 2.5 × the forward's (FlashAttention's count).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use flash_core::inputs::{random_normal, random_qkv};
use step04_backward::{BackwardFn, Shape, backward, backward_by_hand, forward};

fn backwards(c: &mut Criterion) {
    let methods: [(&str, BackwardFn); 2] =
        [("by_hand", backward_by_hand), ("blockwise", backward)];
    for (name, method) in methods {
        let mut group = c.benchmark_group(format!("backward/{name}"));
        group.sample_size(10);
        for tokens in [256, 512, 1024] {
            let shape = Shape::new(1, 12, tokens, 64);
            let [q, k, v] = random_qkv(shape, 0);
            let dout = random_normal(shape, 3);
            let fwd = forward(q.view(), k.view(), v.view()).unwrap();
            group.throughput(Throughput::Elements(shape.backward_flops() as u64));
            group.bench_with_input(BenchmarkId::from_parameter(tokens), &tokens, |b, _| {
                b.iter(|| method(q.view(), k.view(), v.view(), &fwd, dout.view()).unwrap())
            });
        }
        group.finish();
    }
}

criterion_group!(benches, backwards);
criterion_main!(benches);
