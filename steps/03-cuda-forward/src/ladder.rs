//! The ladder: one causal forward written five times, each kernel one idea faster than the
//! one before it, the way llm.c's `dev/cuda` and siboehm's SGEMM kernels teach. Every rung
//! takes the same `[batch, heads, tokens, head_dim]` bf16 or f16 tensors and writes the
//! same output and natural log-sum-exp, so the tests hold each one to the same rule and the
//! benchmark can time each one on the same inputs.
//!
//! | rung | kernel | what changed |
//! | --- | --- | --- |
//! | 1 [`Rung::Rows`] | `kernels/ladder_1_rows.cu` | chapter 2's loop, one thread per query row, f32, keys read from global memory one at a time |
//! | 2 [`Rung::Shared`] | `kernels/ladder_2_shared.cu` | keys and values staged through shared memory 64 at a time, copied once per block of 128 rows |
//! | 3 [`Rung::Mma`] | `kernels/ladder_3_mma.cu` | `mma.sync` on the tensor cores, 128 × 128 tiles, fragments built with plain loads from tiles stored row by row; copies and products take turns |
//! | 4 [`Rung::Ldmatrix`] | `kernels/ladder_4_ldmatrix.cu` | fragments by `ldmatrix` from swizzled tiles: fewer loads, no bank conflicts |
//! | 5 [`Rung::Flash`] | `kernels/flash_forward.cu` | `cp.async` copies of the next block overlap the products on this one; every head's longest query blocks first |
//!
//! ## Layout
//!
//! - [`Rung`]: which kernel, its file, entry point, head dims and NVRTC compilation.
//! - [`Gpu::ladder_forward_into`], [`Gpu::ladder_forward`]: a rung on device tensors;
//!   [`Gpu::ladder_attention`]: on host arrays, as [`Gpu::attention`] is for rung 5.

use std::hash::{Hash, Hasher};

use std::borrow::Cow;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use flash_core::{Attention, AttnError, check_qkv};
use ndarray::ArrayView4;

use crate::gpu::{self, DeviceTensor, Dtype, Gpu, KernelSpec, device_error};
use crate::kernel::{self, BLOCK_M, ForwardKernel, ForwardLaunch, M_TILES, THREADS, WARPS};
use crate::{DeviceAttention, check_device, check_output};

/// Rung 1's source (with `tensor_cores.cuh` in front, for the 16-bit conversions and
/// `ex2`).
pub const LADDER_1_ROWS_CU: &str = concat!(
    include_str!("../kernels/tensor_cores.cuh"),
    include_str!("../kernels/ladder_1_rows.cu")
);
/// Rung 2's source.
pub const LADDER_2_SHARED_CU: &str = concat!(
    include_str!("../kernels/tensor_cores.cuh"),
    include_str!("../kernels/ladder_2_shared.cu")
);
/// Rung 3's source.
pub const LADDER_3_MMA_CU: &str = concat!(
    include_str!("../kernels/tensor_cores.cuh"),
    include_str!("../kernels/ladder_mma.cuh"),
    include_str!("../kernels/ladder_3_mma.cu")
);
/// Rung 4's source.
pub const LADDER_4_LDMATRIX_CU: &str = concat!(
    include_str!("../kernels/tensor_cores.cuh"),
    include_str!("../kernels/ladder_mma.cuh"),
    include_str!("../kernels/ladder_4_ldmatrix.cu")
);

/// Query rows (one a thread) per thread block of rungs 1 and 2.
pub const ROWS_BLOCK_M: usize = 128;
/// Keys and values rung 2 stages in shared memory at a time: 32 KiB of f32 at head dim 64,
/// within the 48 KiB a block may take without asking.
pub const SHARED_BLOCK_N: usize = 64;

/// A rung of the ladder of forward kernels, slowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rung {
    /// One thread per query row, f32, keys and values read from global memory one at a
    /// time.
    Rows,
    /// As [`Rung::Rows`], with keys and values staged through shared memory a block at a
    /// time.
    Shared,
    /// Tensor cores (`mma.sync`), fragments by plain loads from tiles stored row by row,
    /// copies and products in turn.
    Mma,
    /// As [`Rung::Mma`], with fragments by `ldmatrix` from swizzled tiles.
    Ldmatrix,
    /// The step's kernel, `flash_forward.cu`: copies overlapped with the products, longest
    /// query blocks first.
    Flash,
}

impl Rung {
    /// Every rung, in the order of the ladder.
    pub const ALL: [Rung; 5] = [
        Rung::Rows,
        Rung::Shared,
        Rung::Mma,
        Rung::Ldmatrix,
        Rung::Flash,
    ];

    /// The method name the registry lists the rung under.
    pub fn name(self) -> &'static str {
        match self {
            Rung::Rows => "cuda_rows",
            Rung::Shared => "cuda_shared",
            Rung::Mma => "cuda_mma",
            Rung::Ldmatrix => "cuda_ldmatrix",
            Rung::Flash => "cuda_flash",
        }
    }

    /// The rung with this method name.
    pub fn by_name(name: &str) -> Option<Rung> {
        Rung::ALL.into_iter().find(|r| r.name() == name)
    }

    /// 1 to 5.
    pub fn number(self) -> usize {
        self as usize + 1
    }

    /// The kernel's file, under the crate's folder.
    pub fn file(self) -> &'static str {
        match self {
            Rung::Rows => "kernels/ladder_1_rows.cu",
            Rung::Shared => "kernels/ladder_2_shared.cu",
            Rung::Mma => "kernels/ladder_3_mma.cu",
            Rung::Ldmatrix => "kernels/ladder_4_ldmatrix.cu",
            Rung::Flash => "kernels/flash_forward.cu",
        }
    }

    /// The kernel's entry point.
    pub fn entry(self) -> &'static str {
        match self {
            Rung::Rows => "ladder_rows",
            Rung::Shared => "ladder_shared",
            Rung::Mma => "ladder_mma",
            Rung::Ldmatrix => "ladder_ldmatrix",
            Rung::Flash => kernel::FLASH_FORWARD,
        }
    }

    /// What this rung changes from the one before, in a line (for the registry and tables).
    pub fn describe(self) -> &'static str {
        match self {
            Rung::Rows => {
                "ladder rung 1: chapter 2's loop on the GPU, one thread per query row, f32, keys and values read from global memory one at a time"
            }
            Rung::Shared => {
                "ladder rung 2: rung 1 with keys and values staged through shared memory, 64 at a time, once per block of 128 rows"
            }
            Rung::Mma => {
                "ladder rung 3: the products on the tensor cores (mma.sync), fragments by plain loads from tiles stored row by row; copies and products take turns"
            }
            Rung::Ldmatrix => {
                "ladder rung 4: rung 3 with fragments by ldmatrix from swizzled tiles, free of bank conflicts"
            }
            Rung::Flash => {
                "ladder rung 5: the step's kernel, cp.async copies overlapped with the products, every head's longest query blocks first"
            }
        }
    }

    /// The head dims the rung is compiled for. Rungs 1 and 2 keep a row of q and one of the
    /// output in one thread's registers, 2·head_dim of them in f32: at 128 that is more
    /// than the 255 a thread can have, so they stop at 64.
    pub fn head_dims(self) -> &'static [usize] {
        match self {
            Rung::Rows | Rung::Shared => &[32, 64],
            Rung::Mma | Rung::Ldmatrix | Rung::Flash => &kernel::HEAD_DIMS,
        }
    }

    /// An [`AttnError::UnsupportedHeadDim`] naming the head dims the rung takes, or `Ok`.
    pub fn check_head_dim(self, head_dim: usize) -> Result<(), AttnError> {
        if self.head_dims().contains(&head_dim) {
            Ok(())
        } else {
            Err(AttnError::UnsupportedHeadDim {
                head_dim,
                supported: self
                    .head_dims()
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
        }
    }

    /// Threads per block, query rows per block and dynamic shared memory in bytes, for a
    /// head dim.
    fn launch_shape(self, head_dim: usize) -> (u32, usize, u32) {
        match self {
            Rung::Rows | Rung::Shared => (ROWS_BLOCK_M as u32, ROWS_BLOCK_M, 0),
            Rung::Mma | Rung::Ldmatrix => {
                // a tile of q and one stage of k and v (rung 5 keeps two), of the keys rung
                // 5 computes on at a time
                let smem = (BLOCK_M + 2 * kernel::sub_n(head_dim)) * head_dim * 2;
                (THREADS, BLOCK_M, smem as u32)
            }
            Rung::Flash => {
                let launch = ForwardLaunch::for_head_dim(head_dim);
                (launch.threads, launch.block_m, launch.smem_bytes)
            }
        }
    }

    /// The rung's kernel file alone, without the `tensor_cores.cuh` that NVRTC compiles in
    /// front of it: what chapter 3's exercise asks a reader to write again for rung 1.
    pub fn kernel_file(self) -> &'static str {
        match self {
            Rung::Rows => include_str!("../kernels/ladder_1_rows.cu"),
            Rung::Shared => include_str!("../kernels/ladder_2_shared.cu"),
            Rung::Mma => include_str!("../kernels/ladder_3_mma.cu"),
            Rung::Ldmatrix => include_str!("../kernels/ladder_4_ldmatrix.cu"),
            Rung::Flash => include_str!("../kernels/flash_forward.cu"),
        }
    }

    /// Compiles the rung's kernel for one dtype and head dim, for `arch` (`sm_90` on an
    /// H200); without NVRTC, the error that says so.
    pub fn compile(
        self,
        dtype: Dtype,
        head_dim: usize,
        arch: &'static str,
    ) -> Result<Ptx, AttnError> {
        match self.ladder_source() {
            Some(source) => self.compile_source(source, dtype, head_dim, arch),
            None => {
                self.check_head_dim(head_dim)?;
                gpu::compile(&ForwardKernel::new(dtype, head_dim), arch)
            }
        }
    }

    /// The source NVRTC compiles for rungs 1 to 4 (`tensor_cores.cuh` and the rung's file);
    /// none for rung 5, whose kernel and options are [`kernel::ForwardKernel`]'s.
    fn ladder_source(self) -> Option<&'static str> {
        match self {
            Rung::Rows => Some(LADDER_1_ROWS_CU),
            Rung::Shared => Some(LADDER_2_SHARED_CU),
            Rung::Mma => Some(LADDER_3_MMA_CU),
            Rung::Ldmatrix => Some(LADDER_4_LDMATRIX_CU),
            Rung::Flash => None,
        }
    }

    /// Compiles `source`, a kernel with this rung's entry point and parameters (its own
    /// file or a reader's, with `tensor_cores.cuh` in front), with the `-D` options the
    /// rung's own kernel gets. Rungs 1 to 4: rung 5's options are [`ForwardKernel`]'s.
    pub fn compile_source(
        self,
        source: &str,
        dtype: Dtype,
        head_dim: usize,
        arch: &'static str,
    ) -> Result<Ptx, AttnError> {
        gpu::compile(
            &LadderKernel {
                rung: self,
                source,
                dtype,
                head_dim,
            },
            arch,
        )
    }
}

/// One build of rungs 1 to 4: the rung, its source (the rung's own file or a reader's,
/// with `tensor_cores.cuh` in front), the dtype and the head dim.
#[derive(Clone, Copy, Debug)]
pub struct LadderKernel<'a> {
    pub rung: Rung,
    pub source: &'a str,
    pub dtype: Dtype,
    pub head_dim: usize,
}

impl KernelSpec for LadderKernel<'_> {
    fn name(&self) -> String {
        let (entry, dtype) = (self.rung.entry(), self.dtype.name());
        format!("{entry}_{dtype}_d{}.cu", self.head_dim)
    }

    fn source(&self) -> Cow<'_, str> {
        self.source.into()
    }

    fn defines(&self) -> Vec<String> {
        let mut defines = match self.rung {
            Rung::Rows => vec![format!("-DBLOCK_M={ROWS_BLOCK_M}")],
            Rung::Shared => vec![
                format!("-DBLOCK_M={ROWS_BLOCK_M}"),
                format!("-DBLOCK_N={SHARED_BLOCK_N}"),
            ],
            Rung::Mma | Rung::Ldmatrix | Rung::Flash => {
                // the final kernel's tile, so that rungs 3, 4 and 5 differ only in how they
                // read fragments, how they copy and in what order: rungs 3 and 4 copy the
                // keys rung 5 computes on at a time (all of a block up to head dim 64, half
                // of one at 128)
                vec![
                    format!("-DWARPS={WARPS}"),
                    format!("-DM_TILES={M_TILES}"),
                    format!("-DBLOCK_N={}", kernel::sub_n(self.head_dim)),
                ]
            }
        };
        defines.extend([
            format!("-DHEAD_DIM={}", self.head_dim),
            format!("-DIS_BF16={}", (self.dtype == Dtype::Bf16) as u8),
        ]);
        defines
    }

    /// A head dim the rung takes; rungs 1 to 4 only (rung 5 is a [`ForwardKernel`]).
    fn check(&self) -> Result<(), AttnError> {
        self.rung.check_head_dim(self.head_dim)?;
        if self.rung == Rung::Flash {
            return Err(AttnError::Unsupported {
                what: "a kernel of another source is for rungs 1 to 4; rung 5 is compiled by ForwardKernel".into(),
            });
        }
        Ok(())
    }

    /// The name and the source's hash: a reader's kernel is compiled apart from the
    /// rung's own.
    fn key(&self) -> String {
        let mut hasher = std::hash::DefaultHasher::new();
        self.source.hash(&mut hasher);
        format!("{} {:016x}", self.name(), hasher.finish())
    }
}

impl Gpu {
    /// Runs a rung of the ladder: causal attention and each row's log-sum-exp, into a new
    /// output.
    pub fn ladder_forward(
        &self,
        rung: Rung,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
    ) -> Result<DeviceAttention, AttnError> {
        let mut result = self.alloc_output(q.shape, q.dtype)?;
        self.ladder_forward_into(rung, q, k, v, &mut result)?;
        Ok(result)
    }

    /// [`Gpu::ladder_forward`] into buffers allocated before (what a benchmark times). Rung
    /// 5 is [`Gpu::forward_into`] itself.
    pub fn ladder_forward_into(
        &self,
        rung: Rung,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        result: &mut DeviceAttention,
    ) -> Result<(), AttnError> {
        match rung.ladder_source() {
            Some(source) => self.ladder_forward_from(rung, source, q, k, v, result),
            None => self.forward_into(q, k, v, result),
        }
    }

    /// [`Gpu::ladder_forward_into`] with the rung's kernel compiled from `source` (with
    /// `tensor_cores.cuh` in front) instead of its own file, with the same `-D` options and
    /// launch: chapter 3's exercise runs a reader's rung 1 so. Rungs 1 to 4.
    pub fn ladder_forward_from(
        &self,
        rung: Rung,
        source: &str,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        result: &mut DeviceAttention,
    ) -> Result<(), AttnError> {
        // a head dim no kernel takes is refused naming the head dims this rung takes
        let shape = check_device(q, k, v).map_err(|e| match e {
            AttnError::UnsupportedHeadDim { head_dim, .. } => {
                rung.check_head_dim(head_dim).err().unwrap_or(e)
            }
            e => e,
        })?;
        crate::same_heads(q, k, "the ladder's kernels")?; // [step 08]
        rung.check_head_dim(shape.head_dim)?;
        check_output(shape, q.dtype, result)?;
        if shape.is_empty() {
            return Ok(());
        }
        let (threads, block_m, smem) = rung.launch_shape(shape.head_dim);
        let spec = LadderKernel {
            rung,
            source,
            dtype: q.dtype,
            head_dim: shape.head_dim,
        };
        let f = self.kernel(&spec, rung.entry(), smem)?;
        // one block per block_m queries of each head, head after head
        let blocks = gpu::grid_blocks(shape, block_m)?;
        let config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        };
        let tokens = shape.tokens as i32;
        let scale_log2 = shape.scale_log2();
        let mut launch = self.stream().launch_builder(&f);
        launch
            .arg(&q.data)
            .arg(&k.data)
            .arg(&v.data)
            .arg(&mut result.out.data)
            .arg(&mut result.lse)
            .arg(&tokens)
            .arg(&scale_log2);
        // SAFETY: check_device proved q, k, v hold batch·heads·tokens·head_dim values of
        // one dtype and a head dim the kernel is compiled for; check_output that out and
        // lse match them; the grid covers tokens in blocks of block_m for every head, and
        // each kernel writes only rows below `tokens`; smem is what the kernel's tiles
        // take.
        unsafe { launch.launch(config) }
            .map_err(device_error("launching a ladder kernel"))?;
        Ok(())
    }

    /// Host-side entry point for a rung, as [`Gpu::attention`] is for rung 5: rounds `f32`
    /// inputs to `dtype`, runs [`Gpu::ladder_forward`] and returns the output widened back
    /// to `f32`.
    pub fn ladder_attention(
        &self,
        rung: Rung,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        // a head dim the rung does not take is refused before anything is copied
        rung.check_head_dim(check_qkv(&q, &k, &v)?.head_dim)?;
        self.on_host(q, k, v, dtype, |q, k, v| self.ladder_forward(rung, q, k, v))
    }

    /// [`Gpu::ladder_attention`] with the rung's kernel compiled from `source`
    /// ([`Gpu::ladder_forward_from`]).
    pub fn ladder_attention_from(
        &self,
        rung: Rung,
        source: &str,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        rung.check_head_dim(check_qkv(&q, &k, &v)?.head_dim)?;
        self.on_host(q, k, v, dtype, |q, k, v| {
            let mut result = self.alloc_output(q.shape, q.dtype)?;
            self.ladder_forward_from(rung, source, q, k, v, &mut result)?;
            Ok(result)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rungs_have_distinct_names_files_and_entry_points() {
        for (i, a) in Rung::ALL.iter().enumerate() {
            assert_eq!(a.number(), i + 1);
            assert_eq!(Rung::by_name(a.name()), Some(*a));
            for b in &Rung::ALL[i + 1..] {
                assert_ne!(a.name(), b.name());
                assert_ne!(a.file(), b.file());
                assert_ne!(a.entry(), b.entry());
            }
        }
        assert_eq!(Rung::by_name("cuda_nothing"), None);
    }

    #[test]
    fn each_source_defines_its_entry_point() {
        for (rung, source) in [
            (Rung::Rows, LADDER_1_ROWS_CU),
            (Rung::Shared, LADDER_2_SHARED_CU),
            (Rung::Mma, LADDER_3_MMA_CU),
            (Rung::Ldmatrix, LADDER_4_LDMATRIX_CU),
            (Rung::Flash, kernel::FLASH_FORWARD_CU),
        ] {
            assert!(
                source.contains(&format!("{}(", rung.entry())),
                "{} has no entry point {}",
                rung.file(),
                rung.entry()
            );
        }
    }

    #[test]
    fn a_head_dim_a_rung_does_not_take_is_refused_with_what_it_takes() {
        let err = Rung::Rows.check_head_dim(128).unwrap_err();
        assert!(
            matches!(err, AttnError::UnsupportedHeadDim { head_dim: 128, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("supported: 32, 64"), "{err}");
        assert!(Rung::Shared.check_head_dim(48).is_err());
        assert!(Rung::Mma.check_head_dim(128).is_ok());
        assert!(Rung::Ldmatrix.check_head_dim(128).is_ok());
        for rung in Rung::ALL {
            assert!(rung.check_head_dim(64).is_ok());
            assert!(rung.compile(Dtype::Bf16, 96, "sm_90").is_err());
        }
    }

    /// Compiles every rung with NVRTC for sm_90 where NVRTC can be opened, and where it
    /// cannot, checks that each compile is the error that says so rather than a panic
    /// inside cudarc; kernel-check (in CI, with NVRTC) also assembles them and checks for
    /// spills.
    #[test]
    fn every_rung_compiles_or_says_that_nvrtc_is_missing() {
        let present = gpu::nvrtc_present();
        let missing = gpu::missing_nvrtc().to_string();
        for rung in Rung::ALL {
            for &head_dim in rung.head_dims() {
                for dtype in [Dtype::Bf16, Dtype::F16] {
                    let what = format!("{} {} d{head_dim}", rung.name(), dtype.name());
                    match rung.compile(dtype, head_dim, "sm_90") {
                        Ok(_) => assert!(present, "{what} compiled without NVRTC"),
                        Err(e) if present => panic!("{what}: {e}"),
                        Err(e) => assert_eq!(e.to_string(), missing, "{what}"),
                    }
                }
            }
        }
    }
}
