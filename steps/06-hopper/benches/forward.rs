//! `cargo bench -p step06-hopper`: the Hopper forward kernel on the tutorial's GPU shape (4
//! sequences, 12 heads, head dim 64, bf16) at lengths short enough for criterion's many samples,
//! in the block shape `cuda_hopper` picks for each. Throughput is FlashAttention's causal FLOP
//! count, so criterion's "elem/s" reads as FLOP/s. Without a Hopper GPU it says so and measures
//! nothing.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use flash_core::Shape;
use flash_core::inputs::random_qkv;
use step03_cuda_forward::{Dtype, Gpu};
use step06_hopper::forward::{self, HopperConfig};

fn hopper(c: &mut Criterion) {
    let gpu = match Gpu::new().and_then(|gpu| forward::check_hopper(&gpu).map(|()| gpu)) {
        Ok(gpu) => gpu,
        Err(e) => {
            eprintln!("no Hopper benchmark: {e}");
            return;
        }
    };
    let mut group = c.benchmark_group("cuda_hopper");
    for tokens in [1024, 2048, 4096] {
        let shape = Shape::new(4, 12, tokens, 64);
        let [q, k, v] = random_qkv(shape, 0);
        let up = |x: &ndarray::Array4<f32>| gpu.upload(x.view(), Dtype::Bf16).unwrap();
        let (q, k, v) = (up(&q), up(&k), up(&v));
        let mut out = gpu.alloc_output(shape, Dtype::Bf16).unwrap();
        let config = HopperConfig::for_tokens(tokens);
        group.throughput(Throughput::Elements(shape.forward_flops() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(tokens), &tokens, |b, _| {
            b.iter(|| {
                forward::forward_with(&gpu, config, &q, &k, &v, &mut out).unwrap();
                gpu.stream().synchronize().unwrap();
            })
        });
    }
    group.finish();
}

criterion_group!(benches, hopper);
criterion_main!(benches);
