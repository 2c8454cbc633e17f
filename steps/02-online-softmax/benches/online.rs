//! `cargo bench -p step02-online-softmax`: both versions of the online softmax on the
//! tutorial's CPU shape (one sequence, 12 heads, head dim 64, causal). Throughput is
//! FlashAttention's causal FLOP count (`Shape::forward_flops`), so criterion's "elem/s"
//! reads as FLOP/s.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use flash_core::Shape;
use flash_core::inputs::random_qkv;
use step02_online_softmax::{attention, attention_loop};

fn online(c: &mut Criterion) {
    let mut group = c.benchmark_group("online");
    group.sample_size(10);
    for tokens in [1024, 2048, 4096] {
        let shape = Shape::new(1, 12, tokens, 64);
        let [q, k, v] = random_qkv(shape, 0);
        group.throughput(Throughput::Elements(shape.forward_flops() as u64));
        group.bench_with_input(BenchmarkId::new("fast", tokens), &tokens, |b, _| {
            b.iter(|| attention(q.view(), k.view(), v.view()).unwrap())
        });
    }
    for tokens in [256, 1024] {
        let shape = Shape::new(1, 12, tokens, 64);
        let [q, k, v] = random_qkv(shape, 0);
        group.throughput(Throughput::Elements(shape.forward_flops() as u64));
        group.bench_with_input(BenchmarkId::new("loop", tokens), &tokens, |b, _| {
            b.iter(|| attention_loop(q.view(), k.view(), v.view()).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, online);
criterion_main!(benches);
