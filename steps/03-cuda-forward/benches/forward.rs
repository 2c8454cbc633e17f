//! `cargo bench -p step03-cuda-forward`: the forward kernel on the tutorial's GPU shape (4
//! sequences, 12 heads, head dim 64, bf16) at lengths short enough for criterion's many
//! samples. Without a GPU it says so and measures nothing.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use flash_core::Shape;
use flash_core::inputs::random_qkv;
use step03_cuda_forward::gpu::{Dtype, Gpu};

fn forward(c: &mut Criterion) {
    let gpu = match Gpu::new() {
        Ok(gpu) => gpu,
        Err(e) => {
            eprintln!("no GPU benchmark: {e}");
            return;
        }
    };
    let mut group = c.benchmark_group("cuda_flash");
    for tokens in [1024, 2048, 4096] {
        let shape = Shape::new(4, 12, tokens, 64);
        let [q, k, v] = random_qkv(shape, 0);
        let up = |x: &ndarray::Array4<f32>| gpu.upload(x.view(), Dtype::Bf16).unwrap();
        let (q, k, v) = (up(&q), up(&k), up(&v));
        let mut out = gpu.alloc_output(shape, Dtype::Bf16).unwrap();
        group.throughput(Throughput::Elements(shape.forward_flops() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(tokens), &tokens, |b, _| {
            b.iter(|| {
                gpu.forward_into(&q, &k, &v, &mut out).unwrap();
                gpu.stream().synchronize().unwrap();
            })
        });
    }
    group.finish();
}

criterion_group!(benches, forward);
criterion_main!(benches);
