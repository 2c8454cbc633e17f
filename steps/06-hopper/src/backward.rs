//! The backward's host side: δ, then the kernels of a [`BackwardKernels`]: rung 1's two
//! passes (dK and dV per block of keys, then dQ per block of queries), or rung 2's one.

use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use flash_core::{AttnError, Shape};
use step03_cuda_forward::DeviceAttention;
use step03_cuda_forward::gpu::{DeviceTensor, Dtype, Gpu, alloc_error, device_error};
use step04_backward::cuda::{DeviceGrads, check_backward_device};

use crate::forward::{self, TensorMap, check_hopper, tensor_map};
use crate::kernel::{BackwardKernel, BackwardKernels, BackwardPass};
use crate::layout::{Layout, Strided, TmaRank};

/// The gradients of q, k and v with the Hopper kernels, given the forward's output and
/// log-sum-exp and the output's gradient `dout`, as `cuda_hopper` runs them
/// ([`BackwardKernels::for_shape`]): one pass, whose dq may differ run to run in its last
/// bits; [`backward_with`] and [`BackwardKernels::two_passes`] give the same bits every
/// time.
pub fn backward(
    gpu: &Gpu,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<DeviceGrads, AttnError> {
    let kernels = BackwardKernels::for_shape(q.shape);
    backward_with(gpu, kernels, q, k, v, fwd, dout)
}

/// What both entry points check before anything is allocated or launched: a Hopper GPU, the
/// backward's inputs of one shape on the device, and the forward's checks (a head dim the
/// kernels take, at most 65,535 heads). The shape.
fn check_inputs(
    gpu: &Gpu,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<Shape, AttnError> {
    check_hopper(gpu)?;
    let shape = check_backward_device(q, k, v, fwd, dout)?;
    forward::check_shape(shape)?;
    Ok(shape)
}

/// [`backward`] with the given kernels.
pub fn backward_with(
    gpu: &Gpu,
    kernels: BackwardKernels,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<DeviceGrads, AttnError> {
    let shape = check_inputs(gpu, q, k, v, fwd, dout)?;
    // SAFETY: both passes together (or the one pass and hopper_dq_convert) write
    // every row of dq, dk and dv before anything reads them (an empty shape has none)
    let mut grads = unsafe { DeviceGrads::alloc(gpu, shape, q.dtype) }?;
    if shape.is_empty() {
        return Ok(grads);
    }
    let stream = gpu.stream();
    let layout = Layout::heads(shape);
    let tensor = |x: &DeviceTensor| Strided {
        ptr: x.data.device_ptr(stream).0,
        layout: Layout::heads(x.shape),
    };
    let inputs = BackwardInputs {
        q: tensor(q),
        k: tensor(k),
        v: tensor(v),
        out: tensor(&fwd.out),
        dout: tensor(dout),
        lse: fwd.lse.device_ptr(stream).0,
    };
    let (dq, _dq) = grads.dq.data.device_ptr_mut(stream);
    let (dk, _dk) = grads.dk.data.device_ptr_mut(stream);
    let (dv, _dv) = grads.dv.data.device_ptr_mut(stream);
    // SAFETY: the inputs were checked to hold the shape's values in one dtype, contiguous;
    // the three gradients were just allocated for the shape in q's dtype, apart, and live
    // (with their guards) until the launches are queued; every allocation is 256-byte
    // aligned
    unsafe {
        launch_passes(gpu, kernels, shape, q.dtype, inputs, [dq, dk, dv], layout)?;
    }
    drop((_dq, _dk, _dv));
    // [step 08]
    // grouped-query attention: dk and dv were written for each query head; each group's
    // are summed into its head of k and v
    if k.shape.heads != shape.heads {
        grads.dk = step04_backward::cuda::sum_groups(gpu, &grads.dk, k.shape)?;
        grads.dv = step04_backward::cuda::sum_groups(gpu, &grads.dv, k.shape)?;
    }
    // [/step 08]
    Ok(grads)
}

/// The backward's inputs, wherever they are: q, k, v, the forward's output and its gradient
/// dO, and the forward's log-sum-exp (`[batch · heads, tokens]` f32).
#[derive(Clone, Copy, Debug)]
pub struct BackwardInputs {
    pub q: Strided,
    pub k: Strided,
    pub v: Strided,
    pub out: Strided,
    pub dout: Strided,
    pub lse: u64,
}

/// [`backward_with`] reading its inputs where their layouts say and writing dq, dk and dv
/// where `layout` says, from the device addresses `[dq, dk, dv]`: for example from the
/// trainer's fused projection and the rows of its output projection, and straight into the
/// fused projection's gradient.
///
/// TMA reads q, k, v and dO: their addresses and strides must be multiples of 16 bytes; the
/// kernels read the output and write the gradients in pairs of values: 4 bytes. All are
/// checked, with each layout's heads and token stride.
///
/// # Safety
/// Each address must point into a live allocation on this GPU's context, in `dtype`, with
/// [`Layout::span`] values for `shape` from it inside that allocation (`lse`: `batch ·
/// heads · tokens` f32), alive until the stream has run the kernels; the values `layout`
/// reaches from the three gradients' addresses must not overlap one another or any input.
pub unsafe fn backward_into(
    gpu: &Gpu,
    kernels: BackwardKernels,
    shape: Shape,
    dtype: Dtype,
    inputs: BackwardInputs,
    grads: [u64; 3],
    layout: Layout,
) -> Result<(), AttnError> {
    check_hopper(gpu)?;
    forward::check_shape(shape)?;
    let i = inputs;
    // k's and v's shape: q's
    let kv = shape;
    // [step 08]
    // or q's with fewer heads, as their layouts say, each shared by a group of q's heads
    // (dk and dv are written for every query head, as `layout` says)
    let kv = flash_core::check::grouped_kv(kv, i.k.layout.heads.max(0) as usize)?;
    // [/step 08]
    for (x, s, name) in [(i.q, shape, "q"), (i.k, kv, "k"), (i.v, kv, "v")] {
        x.layout.check(s, x.ptr, 16, name)?;
    }
    i.dout.layout.check(shape, i.dout.ptr, 16, "dout")?;
    i.out
        .layout
        .check(shape, i.out.ptr, 4, "the forward's output")?;
    for (ptr, name) in grads.iter().zip(["dq", "dk", "dv"]) {
        layout.check(shape, *ptr, 4, name)?;
    }
    forward::check_lse(i.lse)?;
    if shape.is_empty() {
        return Ok(());
    }
    // SAFETY: the caller's promise
    unsafe { launch_passes(gpu, kernels, shape, dtype, inputs, grads, layout) }
}

/// δ, then the passes, writing to `grads` as `layout` says: the body of [`backward_with`]
/// and [`backward_into`], after their checks (every layout fits the shape; it is not
/// empty).
///
/// # Safety
/// As [`backward_into`].
unsafe fn launch_passes(
    gpu: &Gpu,
    kernels: BackwardKernels,
    shape: Shape,
    dtype: Dtype,
    inputs: BackwardInputs,
    [dq, dk, dv]: [u64; 3],
    layout: Layout,
) -> Result<(), AttnError> {
    let d = shape.head_dim;
    let i = inputs;
    let rank = TmaRank::of(&[i.q.layout, i.k.layout, i.v.layout, i.dout.layout], shape);
    // a module per kernel, shape and rank; δ's kernel, and the one pass's dQ conversion,
    // are in the first kernel's module, under the same key, so the module is compiled once
    let function = |k: BackwardKernel, entry: &str| {
        gpu.kernel(&k.build(dtype, d, rank), entry, k.smem_bytes(d))
    };
    // every kernel's grid, and its limits (checked as its module is compiled), before
    // anything is launched
    for k in kernels.kernels() {
        k.grid(shape)?;
        function(k, k.pass.entry())?;
    }
    let stream = gpu.stream();
    let tokens = shape.tokens as i32;
    // k's and v's shape: q's
    let kv = shape;
    // [step 08]
    // or q's with fewer heads, as their layouts say: each serves q_per_kv query heads
    let kv = Shape {
        heads: i.k.layout.heads as usize,
        ..kv
    };
    let q_per_kv = (shape.heads / kv.heads) as i32;
    // [/step 08]

    // SAFETY: the output and dO hold the shape's values where their layouts say (the
    // caller's promise)
    let delta = unsafe {
        launch_delta(
            gpu,
            &function(kernels.dkdv, "hopper_delta")?,
            inputs.out,
            inputs.dout,
            shape,
        )?
    };

    let scale = 1.0 / (d as f32).sqrt();
    let scale_log2 = shape.scale_log2();
    // SAFETY: the caller's promise
    let prepare = |k: BackwardKernel, qdo_rows: usize, kv_rows: usize| unsafe {
        prepare_pass(
            function(k, k.pass.entry())?,
            k,
            dtype,
            rank,
            i,
            [shape, kv],
            [qdo_rows, kv_rows],
        )
    };

    // dK and dV (and with one pass dQ's sums): the block's keys and values, the queries and
    // dO streamed
    let k = kernels.dkdv;
    let (f, config, maps) = prepare(k, k.stream, k.block_rows())?;
    let dq_accum = dq_sums(gpu, k, shape)?;
    let mut launch = stream.launch_builder(&f);
    for map in &maps {
        launch.arg(map);
    }
    launch.arg(&inputs.lse).arg(&delta);
    launch.arg(&dk).arg(&dv).arg(&layout);
    if let Some(acc) = &dq_accum {
        launch.arg(acc);
    }
    launch
        .arg(&q_per_kv) // [step 08]
        .arg(&tokens)
        .arg(&scale_log2)
        .arg(&scale);
    // SAFETY: the maps read within q, k, v and dO (rows past a head's end read as zeros),
    // lse and δ hold a value a row; each block writes dk and dv for its own keys below
    // `tokens` only, where layout puts them (within its span: the caller's promise), and
    // with one pass adds into dq_accum's values of the query blocks that see them; the grid
    // is one block per block of keys of each head, its y at most 65,535 (checked above)
    unsafe { launch.launch(config) }.map_err(device_error("launching hopper_dkdv"))?;

    if let Some(acc) = &dq_accum {
        // SAFETY: acc holds dq_accum_len values for the shape; dq is where layout puts
        // the shape's values (the caller's promise)
        unsafe {
            launch_dq_convert(
                gpu,
                &function(k, "hopper_dq_convert")?,
                acc,
                dq,
                layout,
                shape,
                scale,
            )?;
        }
    }

    // dQ: the block's queries and dO, the keys and values streamed
    if let Some(k) = kernels.dq {
        let (f, config, maps) = prepare(k, k.block_rows(), k.stream)?;
        let mut launch = stream.launch_builder(&f);
        for map in &maps {
            launch.arg(map);
        }
        launch.arg(&inputs.lse).arg(&delta);
        launch.arg(&dq).arg(&layout);
        launch
            .arg(&q_per_kv) // [step 08]
            .arg(&tokens)
            .arg(&scale_log2)
            .arg(&scale);
        // SAFETY: as for dkdv; each block writes dq for its own queries below `tokens` only
        unsafe { launch.launch(config) }.map_err(device_error("launching hopper_dq"))?;
    }
    Ok(())
}

/// A kernel's function `f`, with the register check of its producer warpgroup, its launch
/// shape, and the maps of q, k, v and dO (q's `shape` and k's and v's `kv`), in boxes of
/// `qdo_rows` rows (q, dO) and `kv_rows` rows (k, v).
///
/// # Safety
/// As [`backward_into`], for `i`.
unsafe fn prepare_pass(
    f: CudaFunction,
    k: BackwardKernel,
    dtype: Dtype,
    rank: TmaRank,
    i: BackwardInputs,
    [shape, kv]: [Shape; 2],
    [qdo_rows, kv_rows]: [usize; 2],
) -> Result<(CudaFunction, LaunchConfig, [TensorMap; 4]), AttnError> {
    k.check_registers(&f)?;
    let config = LaunchConfig {
        grid_dim: k.grid(shape)?,
        block_dim: (k.threads(), 1, 1),
        shared_mem_bytes: k.smem_bytes(shape.head_dim),
    };
    // SAFETY: the caller's promise
    let maps = unsafe {
        [
            tensor_map(i.q, dtype, shape, qdo_rows, rank)?,
            tensor_map(i.k, dtype, kv, kv_rows, rank)?,
            tensor_map(i.v, dtype, kv, kv_rows, rank)?,
            tensor_map(i.dout, dtype, shape, qdo_rows, rank)?,
        ]
    };
    Ok((f, config, maps))
}

/// The one pass's f32 dQ sums, starting at zero (None for two passes).
fn dq_sums(
    gpu: &Gpu,
    k: BackwardKernel,
    shape: Shape,
) -> Result<Option<CudaSlice<f32>>, AttnError> {
    match k.pass {
        BackwardPass::OnePass => {
            let n = k.dq_accum_len(shape);
            Ok(Some(gpu.stream().alloc_zeros::<f32>(n).map_err(
                alloc_error("the backward's f32 dq sums", n as u128 * 4),
            )?))
        }
        _ => Ok(None),
    }
}

/// δ = Σ_d dO·O for every row (`hopper_delta`, `f`, of a backward module): the forward's
/// output and its gradient read where their layouts say; δ is `[batch · heads, tokens]`, a
/// warp a row, eight rows of one head a block.
///
/// # Safety
/// `out` and `dout` must hold `shape`'s values where their layouts say, in live allocations
/// on this GPU's context, until the stream has run the kernel.
pub unsafe fn launch_delta(
    gpu: &Gpu,
    f: &CudaFunction,
    out: Strided,
    dout: Strided,
    shape: Shape,
) -> Result<CudaSlice<f32>, AttnError> {
    let stream = gpu.stream();
    let rows = shape.batch * shape.heads * shape.tokens;
    let tokens = shape.tokens as i32;
    // SAFETY: the kernel writes every row's δ before anything reads it
    let mut delta = unsafe { stream.alloc::<f32>(rows) }
        .map_err(alloc_error("the backward's δ", rows as u128 * 4))?;
    let mut launch = stream.launch_builder(f);
    launch
        .arg(&out.ptr)
        .arg(&out.layout)
        .arg(&dout.ptr)
        .arg(&dout.layout)
        .arg(&mut delta)
        .arg(&tokens);
    let config = LaunchConfig {
        grid_dim: (
            shape.tokens.div_ceil(8) as u32,
            (shape.batch * shape.heads) as u32,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the output and dO hold the shape's values where their layouts say (the
    // caller's promise); each warp reads one row of each and writes that row's δ, for
    // tokens below `tokens`; the grid's y is at most 65,535 (check_shape), its x at most
    // 2^27 (check_shape's 2^30 tokens)
    unsafe { launch.launch(config) }.map_err(device_error("launching hopper_delta"))?;
    Ok(delta)
}

/// dq = 16-bit(acc · scale) where `layout` puts it (`hopper_dq_convert`, `f`, of a one-pass
/// module), from the one pass's f32 sums for queries of `shape`; a thread takes eight values.
///
/// # Safety
/// `acc` must hold the one pass's `dq_accum_len(shape)` sums; `dq` must point at a live
/// allocation on this GPU's context holding `shape`'s values where `layout` says.
pub unsafe fn launch_dq_convert(
    gpu: &Gpu,
    f: &CudaFunction,
    acc: &CudaSlice<f32>,
    dq: u64,
    layout: Layout,
    shape: Shape,
    scale: f32,
) -> Result<(), AttnError> {
    let tokens = shape.tokens as i32;
    let items = (acc.len() / 8) as i64;
    let mut launch = gpu.stream().launch_builder(f);
    launch
        .arg(acc)
        .arg(&dq)
        .arg(&layout)
        .arg(&tokens)
        .arg(&items)
        .arg(&scale);
    let config = LaunchConfig {
        grid_dim: ((items as u64).div_ceil(256).min(65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: acc holds 64 rows of every block of 64 queries, eight values for each of
    // `items` threads (the head dim is 64 or 128); each thread reads its own values and
    // writes them to dq where layout puts them, for rows below `tokens` only, within its
    // span (the caller's promise)
    unsafe { launch.launch(config) }
        .map_err(device_error("launching hopper_dq_convert"))?;
    Ok(())
}
