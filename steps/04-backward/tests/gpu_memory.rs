//! The GPU memory of the two backwards: the stream-ordered pool's high-water mark over one
//! call. A test binary of its own, so that no other test allocates in the same process
//! while the mark is read. Ignored where there is no GPU.

use flash_core::Shape;
use flash_core::inputs::{random_normal, random_qkv};
use ndarray::Array4;
use step03_cuda_forward::gpu::{Dtype, Gpu};
use step04_backward::cuda::DeviceBackwardFn;
use step04_backward::cuda_by_hand;

#[test]
#[ignore = "needs a CUDA GPU"]
fn backward_by_hand_holds_two_tables_where_the_kernels_hold_none() {
    let gpu = Gpu::new().expect("a GPU");
    let shape = Shape::new(2, 3, 2048, 64);
    let [q, k, v] = random_qkv(shape, 9);
    let dout = random_normal(shape, 10);
    let up = |x: &Array4<f32>| gpu.upload(x.view(), Dtype::Bf16).unwrap();
    let (q, k, v, dout) = (up(&q), up(&k), up(&v), up(&dout));
    let fwd = gpu.by_hand(&q, &k, &v).unwrap();
    let peak = |backward: DeviceBackwardFn| {
        let (_, peak) = gpu
            .peak_allocated(|| backward(&gpu, &q, &k, &v, &fwd, &dout).map(drop))
            .unwrap();
        peak
    };
    let (Some(by_hand), Some(kernels)) = (
        peak(cuda_by_hand::backward),
        peak(step04_backward::cuda::backward),
    ) else {
        panic!(
            "this driver has no stream-ordered memory pool (CUDA 11.2 and newer have one): no peak to check"
        );
    };
    let table = (shape.batch * shape.heads * shape.tokens * shape.tokens * 2) as u64;
    let exact = cuda_by_hand::backward_bytes(shape) as u64;
    println!(
        "{shape}: backward by hand {by_hand} bytes (its allocations: {exact}), kernels {kernels}; a table is {table}"
    );
    // the pool may round each allocation up; cuBLAS's workspace is its own
    assert!(
        by_hand >= 2 * table && by_hand <= exact + (64 << 20),
        "by hand's peak {by_hand} is not two tables and the gradients ({exact})"
    );
    assert!(
        kernels < table / 4,
        "the kernels' peak {kernels} is not far below one table ({table})"
    );
}
