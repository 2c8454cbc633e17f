//! `cargo bench -p step06-hopper`: the Hopper forward kernel, and its backward after it, on
//! the tutorial's GPU shape (4 sequences, 12 heads, bf16) at head dims 64 and 128, at
//! lengths short enough for criterion's many samples, in the kernels `cuda_hopper` picks.
//! Throughput is FlashAttention's causal FLOP count, so criterion's "elem/s" reads as
//! FLOP/s. Without a Hopper GPU it says so and measures nothing.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use flash_core::Shape;
use flash_core::inputs::{random_normal, random_qkv};
use step03_cuda_forward::gpu::{Dtype, Gpu};
use step06_hopper::backward;
use step06_hopper::forward;
use step06_hopper::kernel::{ForwardKernel, HEAD_DIMS};

fn hopper(c: &mut Criterion) {
    let gpu = match Gpu::new().and_then(|gpu| forward::check_hopper(&gpu).map(|()| gpu)) {
        Ok(gpu) => gpu,
        Err(e) => {
            eprintln!("no Hopper benchmark: {e}");
            return;
        }
    };
    for d in HEAD_DIMS {
        let mut fwd_group = c.benchmark_group(format!("cuda_hopper d{d}"));
        for tokens in [1024, 2048, 4096] {
            let shape = Shape::new(4, 12, tokens, d);
            let [q, k, v] = random_qkv(shape, 0);
            let up = |x: &ndarray::Array4<f32>| gpu.upload(x.view(), Dtype::Bf16).unwrap();
            let (q, k, v) = (up(&q), up(&k), up(&v));
            let mut out = gpu.alloc_output(shape, Dtype::Bf16).unwrap();
            let kernel = ForwardKernel::for_shape(shape, shape.heads);
            fwd_group.throughput(Throughput::Elements(shape.forward_flops() as u64));
            fwd_group.bench_with_input(
                BenchmarkId::from_parameter(tokens),
                &tokens,
                |b, _| {
                    b.iter(|| {
                        forward::forward_with(&gpu, kernel, &q, &k, &v, &mut out).unwrap();
                        gpu.stream().synchronize().unwrap();
                    })
                },
            );
        }
        fwd_group.finish();
        let mut bwd_group = c.benchmark_group(format!("cuda_hopper backward d{d}"));
        for tokens in [1024, 2048, 4096] {
            let shape = Shape::new(4, 12, tokens, d);
            let [q, k, v] = random_qkv(shape, 0);
            let up = |x: &ndarray::Array4<f32>| gpu.upload(x.view(), Dtype::Bf16).unwrap();
            let (q, k, v, dout) = (up(&q), up(&k), up(&v), up(&random_normal(shape, 1)));
            let fwd = forward::forward(&gpu, &q, &k, &v).unwrap();
            bwd_group.throughput(Throughput::Elements(shape.backward_flops() as u64));
            bwd_group.bench_with_input(
                BenchmarkId::from_parameter(tokens),
                &tokens,
                |b, _| {
                    b.iter(|| {
                        backward::backward(&gpu, &q, &k, &v, &fwd, &dout).unwrap();
                        gpu.stream().synchronize().unwrap();
                    })
                },
            );
        }
        bwd_group.finish();
    }
}

criterion_group!(benches, hopper);
criterion_main!(benches);
