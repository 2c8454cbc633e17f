//! Compiles the masked kernels with every built-in mask and score function through NVRTC
//! and assembles each with `ptxas -v`, printing registers, shared memory and spills; exits
//! non-zero on a failed compile or a spill that is not on the list below. For `--arch`
//! (`sm_90`, as `sm_90a`, by default) the Hopper kernels and the Ampere ones, then for
//! `sm_80` the Ampere ones and the block mask again: the Ampere kernels run on both. Needs
//! no GPU: CI runs it with NVRTC and ptxas from PyPI, as step 06's `hopper-kernel-check`.
//!
//! `cargo run -p step09-masks --bin masks-kernel-check [-- --ptxas PATH]`

use clap::Parser;
use flash_core::Shape;
use std::process::ExitCode;
use step03_cuda_forward::gpu::{Dtype, compile};
use step03_cuda_forward::ptxas::{self, Variant};
use step06_hopper::layout::TmaRank;
use step09_masks::cuda::{
    BlockMaskKernel, GpuMask, MaskedBackwardKernel, MaskedForwardKernel, backward_kernels,
    forward_kernel,
};
use step09_masks::cuda_ampere::{BLOCK_ROWS, HEAD_DIMS, MaskedAmpereKernel, Pass};
use step09_masks::exercise::DILATED_CU;
use step09_masks::{CustomMask, Documents, Mask, ScoreMod};

/// Every built-in mask and score function in the masked forward and backward (bf16, both
/// head dims, TMA rank 3), the causal mask also in f16 and with rank-4 maps, and each
/// mask's block-mask kernels.
#[derive(Parser, Debug)]
#[command(name = "masks-kernel-check")]
struct Args {
    #[command(flatten)]
    flags: ptxas::Flags,
}

/// The kernels that spill, what they spill (entry point, bytes stored, bytes loaded) and
/// why that is accepted. The one-pass backward with a score function holds the function's
/// temporaries beside Sᵀ, dPᵀ, dK and dV, a few registers over what its consumers have
/// (step 06's shape, 232 a thread): a few words, to memory L1 keeps. The forward with a
/// window or documents on rung 4 at head dim 64 (three warpgroups, 128 registers a thread
/// as ptxas plans it) keeps one word of its lower bounds in memory from before the loop
/// over the blocks to after it: one store and one load a thread.
#[rustfmt::skip]
const EXPECTED_SPILLS: &[(&str, &str, u64, u64)] = &[
    ("backward_bf16_d64_causal+softcap",         "masked_dkdv",    8, 12),
    ("backward_bf16_d128_causal+softcap",        "masked_dkdv",   72, 76),
    ("forward_bf16_d64_sliding_rung4",           "masked_forward", 4,  4),
    ("forward_bf16_d64_documents_rung4",         "masked_forward", 4,  4),
];

fn masks() -> Vec<(&'static str, Mask, ScoreMod)> {
    let docs = Documents::from_lengths(&[100, 200, 724]).expect("lengths of at least 1");
    let dilated = Mask::Custom(CustomMask::new("dilated", |_, _, q, k| k <= q).with_cuda(
        format!("#define WINDOW 16\n#define DILATION 8\n{DILATED_CU}"),
    ));
    vec![
        ("causal", Mask::Causal, ScoreMod::None),
        ("full", Mask::Full, ScoreMod::None),
        ("sliding", Mask::Sliding { window: 1024 }, ScoreMod::None),
        ("prefix", Mask::PrefixLm { prefix: 1024 }, ScoreMod::None),
        ("documents", Mask::Documents(docs), ScoreMod::None),
        (
            "causal+softcap",
            Mask::Causal,
            ScoreMod::SoftCap { cap: 30.0 },
        ),
        ("causal+alibi", Mask::Causal, ScoreMod::Alibi { heads: 12 }),
        // a user's mask, asked score by score: the exercise's dilated window
        ("custom", dilated, ScoreMod::None),
    ]
}

fn main() -> ExitCode {
    let Args { mut flags } = Args::parse();
    if flags.arch == "sm_90" {
        flags.arch = "sm_90a".into();
    }
    let hopper = flags.arch == "sm_90a";
    let ampere = ptxas::Flags {
        arch: "sm_80".into(),
        ptxas: flags.ptxas.clone(),
        verbose: flags.verbose,
    };
    let first = ptxas::main(flags, |arch| {
        let mut kernels = if hopper {
            hopper_kernels(arch)
        } else {
            Vec::new()
        };
        kernels.extend(ampere_kernels(arch));
        kernels
    });
    if !hopper {
        return first;
    }
    // the Ampere kernels for Ampere too, whatever the first pass found
    let second = ptxas::main(ampere, ampere_kernels);
    if first == ExitCode::SUCCESS {
        second
    } else {
        first
    }
}

/// The Ampere kernels for every mask, in bf16 at both head dims, the causal mask also in
/// f16, and the block mask's kernels for their blocks of 128 queries (two warpgroups' worth).
fn ampere_kernels(arch: &'static str) -> Vec<Variant> {
    let mut kernels = Vec::new();
    for (name, mask, score) in masks() {
        let gm = match GpuMask::new(&mask, &score) {
            Ok(gm) => gm,
            Err(e) => {
                kernels.push(Variant::used(format!("ampere_mask_{name}"), Err(e)));
                continue;
            }
        };
        let wgs = BLOCK_ROWS / 64;
        kernels.push(Variant::used(
            format!("ampere_block_mask_{name}_wgs{wgs}"),
            compile(&BlockMaskKernel { mask: &gm, wgs }, arch),
        ));
        let dtypes: &[Dtype] = if name == "causal" {
            &[Dtype::Bf16, Dtype::F16]
        } else {
            &[Dtype::Bf16]
        };
        for &dtype in dtypes {
            for head_dim in HEAD_DIMS {
                let tag = format!("{}_d{head_dim}_{name}", dtype.name());
                let forward = MaskedAmpereKernel {
                    pass: Pass::Forward,
                    mask: &gm,
                    dtype,
                    head_dim,
                };
                let backward = MaskedAmpereKernel {
                    pass: Pass::Backward,
                    mask: &gm,
                    dtype,
                    head_dim,
                };
                kernels.push(Variant::used(
                    format!("ampere_forward_{tag}"),
                    compile(&forward, arch),
                ));
                kernels.push(Variant::used(
                    format!("ampere_backward_{tag}"),
                    compile(&backward, arch),
                ));
            }
        }
    }
    let listed: Vec<_> = EXPECTED_SPILLS
        .iter()
        .filter(|s| s.0.starts_with("ampere_"))
        .copied()
        .collect();
    ptxas::with_listed_spills(kernels, &listed)
}

/// Step 06's masked kernels for every mask (sm_90a only).
fn hopper_kernels(arch: &'static str) -> Vec<Variant> {
    let mut kernels = Vec::new();
    for (name, mask, score) in masks() {
        let gm = match GpuMask::new(&mask, &score) {
            Ok(gm) => gm,
            Err(e) => {
                kernels.push(Variant::used(format!("mask_{name}"), Err(e)));
                continue;
            }
        };
        let variants: &[(Dtype, TmaRank)] = if name == "causal" {
            &[
                (Dtype::Bf16, TmaRank::Three),
                (Dtype::F16, TmaRank::Three),
                (Dtype::Bf16, TmaRank::Four),
            ]
        } else {
            &[(Dtype::Bf16, TmaRank::Three)]
        };
        let mut seen = Vec::new();
        for d in [64, 128] {
            // both lengths: at head dim 64 the causal forward changes rung past 4,096
            for t in [4096, 16384] {
                let q = Shape::new(4, 12, t, d);
                let fk = forward_kernel(q, 12, gm.weight);
                if seen.contains(&(d, fk)) {
                    continue;
                }
                seen.push((d, fk));
                let wgs = fk.warpgroups;
                kernels.push(Variant::used(
                    format!("block_mask_{name}_d{d}_wgs{wgs}"),
                    compile(&BlockMaskKernel { mask: &gm, wgs }, arch),
                ));
                for &(dtype, rank) in variants {
                    let tag = format!(
                        "{}_d{d}_{name}{}",
                        dtype.name(),
                        if rank == TmaRank::Four { "_rank4" } else { "" }
                    );
                    let forward = MaskedForwardKernel {
                        mask: &gm,
                        kernel: fk,
                        dtype,
                        head_dim: d,
                        rank,
                    };
                    let fname = format!("forward_{tag}_rung{}", fk.rung.number());
                    kernels.push(Variant::used(fname, compile(&forward, arch)));
                    if t != 4096 {
                        continue;
                    }
                    let backward = MaskedBackwardKernel {
                        mask: &gm,
                        kernels: backward_kernels(q),
                        dtype,
                        head_dim: d,
                        rank,
                    };
                    let bname = format!("backward_{tag}");
                    kernels.push(Variant::used(bname, compile(&backward, arch)));
                }
            }
        }
    }
    let listed: Vec<_> = EXPECTED_SPILLS
        .iter()
        .filter(|s| !s.0.starts_with("ampere_"))
        .copied()
        .collect();
    ptxas::with_listed_spills(kernels, &listed)
}
