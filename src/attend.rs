//! The `attend` command: run one method on q, k and v read from `.npy` files and write what
//! it computes as `.npy` files, so anyone can check our results against their own
//! framework.
//!
//! ```text
//! flash-attention attend --method naive --q q.npy --k k.npy --v v.npy [--dout dout.npy]
//! --out-dir DIR
//! ```
//!
//! writes `DIR/out.npy` (`[batch, heads, tokens, head_dim]`) and `DIR/lse.npy` (`[batch,
//! heads, tokens]`, the natural-log log-sum-exp of each row of scores), and with `--dout`
//! also `dq.npy`, `dk.npy` and `dv.npy`.
//!
//! With `--mask SPEC` (`sliding:1024`, `documents:FILE,softcap:30`...) // [step 09]
//! step 09's masked attention runs on the method's device, and k and v // [step 09]
//! may be longer than q and have fewer heads. // [step 09]
//! // [step 09]
//! ## Layout
//!
//! - [`AttendArgs`]: what the command line gives.
//! - [`attend`]: checks everything it can before any work (the method, its backward, the
//!   files and their shapes, the output folder), then runs the method and writes the
//!   files, all of them or none ([`files::Staged`]): a run that fails half-way leaves the
//!   previous run's results as they were, never some of them replaced.

use std::fs;
use std::path::{Path, PathBuf};

use flash_core::files;
use ndarray::{Array4, ArrayViewD};

use crate::methods; // [step 04]
use crate::methods::{Describe, Dtype, Entry, Method};
use crate::npy;

/// The `attend` command's arguments.
#[derive(Clone, Debug)]
pub struct AttendArgs {
    /// What `--method` named, resolved: a method or (from step 08) a decoder.
    pub method: Entry,
    pub q: PathBuf,
    pub k: PathBuf,
    pub v: PathBuf,
    // [step 03]
    /// The element type to compute in, for a method that takes more than one (the GPU
    /// methods: bf16, the default, or f16); None for the method's default.
    pub dtype: Option<Dtype>,
    // [/step 03]
    // [step 04]
    /// The gradient of the loss with respect to the output; asks for the backward pass.
    pub dout: Option<PathBuf>,
    // [/step 04]
    // [step 09]
    /// A mask and a score function as `--mask` takes them ([`step09_masks::MaskSpec`]):
    /// step 09's masked attention runs on the method's device in its place.
    pub mask: Option<String>,
    // [/step 09]
    pub out_dir: PathBuf,
}

/// Runs the method and writes its results; returns the paths written.
pub fn attend(args: &AttendArgs) -> Result<Vec<PathBuf>, String> {
    files::check_output_dir("--out-dir", &args.out_dir).map_err(|e| e.to_string())?;
    #[allow(unused_mut)] // the backward's files join them from step 04 on
    let mut names = vec!["out.npy", "lse.npy"];
    // [step 04]
    if args.dout.is_some() {
        names.extend(["dq.npy", "dk.npy", "dv.npy"]);
    }
    // [/step 04]
    // a folder where an output goes would stop the renames half-way: refused now
    for name in names {
        let path = args.out_dir.join(name);
        if path.is_dir() {
            return Err(format!(
                "{}: --out-dir holds a folder named {name}, where this run writes a file; \
                 move it away",
                path.display()
            ));
        }
    }
    // the element type to compute in: the method's default unless --dtype asks for another
    let dtype = args.method.dtypes()[0];
    // [step 03]
    if let Some(dtype) = args.dtype {
        check_dtype(args.method, dtype)?;
    }
    let dtype = args.dtype.unwrap_or(dtype);
    // [/step 03]
    match args.method {
        Entry::Method(method) => run(method, dtype, args),
        Entry::Decoder(decoder) => decode(decoder, dtype, args), // [step 08]
    }
}

/// A method's run: q, k and v of one shape `[batch, heads, tokens, head_dim]`; writes
/// `out.npy` and `lse.npy`, and with `--dout` the gradients.
fn run(
    method: &dyn Method,
    dtype: Dtype,
    args: &AttendArgs,
) -> Result<Vec<PathBuf>, String> {
    // [step 09]
    // the mask brings its own backward: no method's is needed for --dout
    if let Some(spec) = &args.mask {
        return masked(method.device(), dtype, spec, args);
    }
    // [/step 09]
    // [step 04]
    if args.dout.is_some() && !method.has_backward() {
        let with: Vec<_> = methods::all()
            .into_iter()
            .filter(|m| m.has_backward())
            .map(|m| m.name())
            .collect();
        return Err(format!(
            "--dout asks for the backward pass, and method {:?} has none; {}",
            method.name(),
            if with.is_empty() {
                "no method in this build has one yet".to_string()
            } else {
                format!("methods with a backward pass: {}", with.join(", "))
            }
        ));
    }
    // [/step 04]

    let q = npy::read_f32_4d(&args.q).map_err(|e| e.to_string())?;
    let k = npy::read_f32_4d(&args.k).map_err(|e| e.to_string())?;
    let v = npy::read_f32_4d(&args.v).map_err(|e| e.to_string())?;
    same_shape(&args.k, &k, &args.q, &q)?;
    same_shape(&args.v, &v, &args.q, &q)?;
    // [step 04]
    let dout = match &args.dout {
        Some(path) => {
            let d = npy::read_f32_4d(path).map_err(|e| e.to_string())?;
            same_shape(path, &d, &args.q, &q)?;
            // refused before the forward runs, not after it (the backward would refuse it)
            flash_core::check_finite("dout", &d.view())
                .map_err(|e| format!("{}: {e}", path.display()))?;
            Some(d)
        }
        None => None,
    };
    // [/step 04]

    // everything is computed before anything is written: a backward that refuses its dout
    // leaves no out.npy of this run beside the gradients of the last one
    let result = method
        .forward(q.view(), k.view(), v.view(), dtype)
        .map_err(|e| format!("{} failed: {e}", method.name()))?;
    // [step 04]
    let grads = match &dout {
        Some(dout) => Some(
            method
                .backward(q.view(), k.view(), v.view(), &result, dout.view(), dtype)
                .map_err(|e| format!("{} backward failed: {e}", method.name()))?,
        ),
        None => None,
    };
    // [/step 04]
    #[allow(unused_mut)] // the backward's files join them from step 04 on
    let mut outputs = vec![
        ("out.npy", result.out.view().into_dyn()),
        ("lse.npy", result.lse.view().into_dyn()),
    ];
    // [step 04]
    if let Some(g) = &grads {
        outputs.extend([
            ("dq.npy", g.dq.view().into_dyn()),
            ("dk.npy", g.dk.view().into_dyn()),
            ("dv.npy", g.dv.view().into_dyn()),
        ]);
    }
    // [/step 04]
    write_all(&args.out_dir, outputs)
}

/// Each array as `dir/name`, the folder made if need be, all of them or none; their paths.
fn write_all(
    dir: &Path,
    outputs: Vec<(&str, ArrayViewD<f32>)>,
) -> Result<Vec<PathBuf>, String> {
    fs::create_dir_all(dir)
        .map_err(|e| format!("--out-dir {}: cannot create it: {e}", dir.display()))?;
    let mut staged = files::Staged::new();
    let mut written = Vec::new();
    for (name, a) in outputs {
        let path = dir.join(name);
        staged
            .add(&path, |w| npy::write_f32_to(w, a))
            .map_err(|e| format!("{e}; no file of this run was written"))?;
        written.push(path);
    }
    staged
        .commit()
        .map_err(|e| format!("{e}: it and the outputs after it are the last run's"))?;
    Ok(written)
}

// [step 03]
/// That the method or decoder computes in `dtype`: an error naming it, its device and the
/// dtypes it takes if not.
pub fn check_dtype(entry: Entry, dtype: Dtype) -> Result<(), String> {
    let takes = entry.dtypes();
    if takes.contains(&dtype) {
        return Ok(());
    }
    let names: Vec<&str> = takes.iter().map(|d| d.name()).collect();
    Err(format!(
        "--dtype {dtype}: {} {:?} runs on {} and computes in {}",
        entry.kind(),
        entry.name(),
        entry.device(),
        names.join(" or ")
    ))
}
// [/step 03]

// [step 08]
/// A decoder's run: q `[batch, q_heads, q_rows, head_dim]` against the cache, k and v
/// `[batch, kv_heads, context, head_dim]`; writes `out.npy` (q's shape) and `lse.npy`
/// (`[batch, q_heads, q_rows]`). The decoder itself refuses shapes that do not fit
/// together, naming the value and what is accepted.
fn decode(
    decoder: &dyn methods::Decoder,
    dtype: Dtype,
    args: &AttendArgs,
) -> Result<Vec<PathBuf>, String> {
    if args.dout.is_some() {
        return Err(format!(
            "--dout asks for the backward pass, and {:?} is a decoder, for inference: it has \
             none",
            decoder.name()
        ));
    }
    // [step 09]
    if args.mask.is_some() {
        return Err(crate::cli::masked_decoder(decoder.name()));
    }
    // [/step 09]
    let q = npy::read_f32_4d(&args.q).map_err(|e| e.to_string())?;
    let k = npy::read_f32_4d(&args.k).map_err(|e| e.to_string())?;
    let v = npy::read_f32_4d(&args.v).map_err(|e| e.to_string())?;
    if k.shape() != v.shape() {
        return Err(format!(
            "{}: shape {:?} differs from {}'s {:?}; the cache's k and v share one shape \
             [batch, kv_heads, context, head_dim]",
            args.v.display(),
            v.shape(),
            args.k.display(),
            k.shape()
        ));
    }
    let result = decoder
        .decode(q.view(), k.view(), v.view(), dtype)
        .map_err(|e| format!("{} failed: {e}", decoder.name()))?;
    write_all(
        &args.out_dir,
        vec![
            ("out.npy", result.out.view().into_dyn()),
            ("lse.npy", result.lse.view().into_dyn()),
        ],
    )
}
// [/step 08]

// [step 09]
/// A masked run: q `[batch, heads, tq, head_dim]` against k and v `[batch, kv_heads, tk,
/// head_dim]`, `tq ≤ tk` (q's rows are the last `tq` of the `tk` positions) and `kv_heads`
/// dividing `heads`; the mask and score function of `spec`, resolved against that shape.
/// Step 09's masked attention runs on `device`: on the CPU its blockwise forward and
/// backward, on the GPU its Hopper kernels on a Hopper and the ones made from steps 03 and
/// 04's on any other GPU from Ampere. Writes `out.npy` and `lse.npy` (q's rows), and
/// with `--dout` (q's shape) `dq.npy` of q's shape and `dk.npy`, `dv.npy` of k's.
fn masked(
    device: methods::Device,
    dtype: Dtype,
    spec: &str,
    args: &AttendArgs,
) -> Result<Vec<PathBuf>, String> {
    let spec = step09_masks::MaskSpec::parse(spec).map_err(|e| e.to_string())?;
    let q = npy::read_f32_4d(&args.q).map_err(|e| e.to_string())?;
    let k = npy::read_f32_4d(&args.k).map_err(|e| e.to_string())?;
    let v = npy::read_f32_4d(&args.v).map_err(|e| e.to_string())?;
    let (batch, heads, _, _) = q.dim();
    // a documents file must cover k's positions; ALiBi takes q's head count
    let (mask, score) = spec
        .resolve(batch, heads, k.dim().2)
        .map_err(|e| e.to_string())?;
    let dout = match &args.dout {
        Some(path) => {
            let d = npy::read_f32_4d(path).map_err(|e| e.to_string())?;
            same_shape(path, &d, &args.q, &q)?;
            flash_core::check_finite("dout", &d.view())
                .map_err(|e| format!("{}: {e}", path.display()))?;
            Some(d)
        }
        None => None,
    };
    let failed = |e: flash_core::AttnError| format!("--mask {:?}: {e}", spec.text());
    let (result, grads) = match device {
        methods::Device::Cpu => {
            let fwd = step09_masks::forward(q.view(), k.view(), v.view(), &mask, &score)
                .map_err(failed)?;
            let grads = match &dout {
                Some(d) => Some(
                    step09_masks::backward(
                        q.view(),
                        k.view(),
                        v.view(),
                        &fwd,
                        d.view(),
                        &mask,
                        &score,
                    )
                    .map_err(failed)?,
                ),
                None => None,
            };
            (fwd, grads)
        }
        _ => masked_on_gpu([&q, &k, &v], dout.as_ref(), &mask, &score, dtype)
            .map_err(failed)?,
    };
    let mut outputs = vec![
        ("out.npy", result.out.view().into_dyn()),
        ("lse.npy", result.lse.view().into_dyn()),
    ];
    if let Some(g) = &grads {
        outputs.extend([
            ("dq.npy", g.dq.view().into_dyn()),
            ("dk.npy", g.dk.view().into_dyn()),
            ("dv.npy", g.dv.view().into_dyn()),
        ]);
    }
    write_all(&args.out_dir, outputs)
}

/// The masked forward (and with `dout` the backward) on GPU 0 in `dtype`: the block mask
/// made on the GPU for this shape, then step 09's kernels over it; the results widened back
/// to `f32`.
fn masked_on_gpu(
    [q, k, v]: [&Array4<f32>; 3],
    dout: Option<&Array4<f32>>,
    mask: &step09_masks::Mask,
    score: &step09_masks::ScoreMod,
    dtype: Dtype,
) -> Result<(flash_core::Attention, Option<methods::Grads>), flash_core::AttnError> {
    use step09_masks::cuda::{self, DeviceMask, GpuMask};
    // refused here as the CPU refuses them: a NaN would spread through a block of keys
    for (name, x) in [("q", q), ("k", k), ("v", v)] {
        flash_core::check_finite(name, &x.view())?;
    }
    let (batch, heads, tq, d) = q.dim();
    let tk = k.dim().2;
    cuda::check_mask(mask, score, batch, heads, tk)?;
    let gpu = step03_cuda_forward::gpu::Gpu::shared()?;
    let device_mask =
        DeviceMask::new(gpu, &GpuMask::new(mask, score)?, batch, heads, tq, tk, d)?;
    let up = |x: &Array4<f32>| gpu.upload(x.view(), dtype);
    let (q, k, v) = (up(q)?, up(k)?, up(v)?);
    let fwd = cuda::forward(gpu, &q, &k, &v, &device_mask)?;
    let grads = match dout {
        Some(dout) => {
            let g = cuda::backward(gpu, &q, &k, &v, &fwd, &up(dout)?, &device_mask)?;
            Some(methods::Grads {
                dq: gpu.download(&g.dq)?,
                dk: gpu.download(&g.dk)?,
                dv: gpu.download(&g.dv)?,
            })
        }
        None => None,
    };
    Ok((gpu.download_attention(&fwd)?, grads))
}
// [/step 09]

fn same_shape(
    path: &Path,
    x: &Array4<f32>,
    q_path: &Path,
    q: &Array4<f32>,
) -> Result<(), String> {
    if x.shape() == q.shape() {
        return Ok(());
    }
    Err(format!(
        "{}: shape {:?} differs from {}'s {:?}; q, k, v (and dout) must share one shape \
         [batch, heads, tokens, head_dim]",
        path.display(),
        x.shape(),
        q_path.display(),
        q.shape()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flash_core::Shape;
    use flash_core::inputs::random_qkv;

    fn setup(name: &str, shape: Shape) -> (PathBuf, AttendArgs, [Array4<f32>; 3]) {
        let dir =
            std::env::temp_dir().join(format!("attend-{name}-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let qkv = random_qkv(shape, 7);
        for (name, x) in ["q", "k", "v"].iter().zip(&qkv) {
            npy::write_f32(&dir.join(format!("{name}.npy")), x.view()).unwrap();
        }
        let args = AttendArgs {
            method: crate::methods::resolve("naive").unwrap(),
            q: dir.join("q.npy"),
            k: dir.join("k.npy"),
            v: dir.join("v.npy"),
            dtype: None, // [step 03]
            dout: None,  // [step 04]
            mask: None,  // [step 09]
            out_dir: dir.join("out"),
        };
        (dir, args, qkv)
    }

    #[test]
    fn round_trip_matches_the_in_process_result_bit_for_bit() {
        let (dir, args, [q, k, v]) = setup("round-trip", Shape::new(2, 3, 77, 16));
        let written = attend(&args).unwrap();
        assert_eq!(written.len(), 2);
        let expected = step01_naive::attention(q.view(), k.view(), v.view()).unwrap();
        let out = npy::read_f32_4d(&args.out_dir.join("out.npy")).unwrap();
        let lse = npy::read_f32(&args.out_dir.join("lse.npy")).unwrap();
        assert_eq!(out, expected.out);
        assert_eq!(lse.shape(), &[2, 3, 77]);
        assert_eq!(
            lse.into_dimensionality::<ndarray::Ix3>().unwrap(),
            expected.lse
        );
        fs::remove_dir_all(dir).unwrap();
    }

    // [step 04]
    #[test]
    fn with_dout_the_gradients_match_the_in_process_backward() {
        let m = methods::all()
            .into_iter()
            .find(|m| m.has_backward())
            .expect("step 04's methods have a backward pass");
        let shape = Shape::new(1, 2, 33, 8);
        let (dir, mut args, [q, k, v]) = setup("backward", shape);
        let dout = random_qkv(shape, 99)[0].clone();
        npy::write_f32(&dir.join("dout.npy"), dout.view()).unwrap();
        args.method = Entry::Method(m);
        args.dout = Some(dir.join("dout.npy"));
        let written = attend(&args).unwrap();
        assert_eq!(written.len(), 5);
        let dtype = m.dtypes()[0];
        let fwd = m.forward(q.view(), k.view(), v.view(), dtype).unwrap();
        let grads = m
            .backward(q.view(), k.view(), v.view(), &fwd, dout.view(), dtype)
            .unwrap();
        for (name, expected) in [("dq", &grads.dq), ("dk", &grads.dk), ("dv", &grads.dv)] {
            let got = npy::read_f32_4d(&args.out_dir.join(format!("{name}.npy"))).unwrap();
            assert_eq!(&got, expected, "{name} of {}", m.name());
        }
        fs::remove_dir_all(dir).unwrap();
    }
    // [/step 04]

    // [step 08]
    /// A decoder takes q's rows against a longer cache with fewer kv heads, and writes
    /// what step 08's function returns, bit for bit.
    #[test]
    fn a_decoder_runs_query_rows_against_a_cache() {
        let (dir, mut args, _) = setup("decoder", Shape::new(1, 2, 8, 4));
        let q = random_qkv(Shape::new(2, 4, 3, 8), 3)[0].clone();
        let [k, v, _] = random_qkv(Shape::new(2, 2, 37, 8), 4);
        for (name, x) in [("dq", &q), ("dk", &k), ("dv", &v)] {
            npy::write_f32(&dir.join(format!("{name}.npy")), x.view()).unwrap();
        }
        (args.q, args.k, args.v) =
            (dir.join("dq.npy"), dir.join("dk.npy"), dir.join("dv.npy"));
        for name in ["decode", "decode_split"] {
            args.method = methods::resolve(name).unwrap();
            let written = attend(&args).unwrap();
            assert_eq!(written.len(), 2);
            let expected = step08_inference::decode(q.view(), k.view(), v.view()).unwrap();
            let out = npy::read_f32_4d(&args.out_dir.join("out.npy")).unwrap();
            let lse = npy::read_f32(&args.out_dir.join("lse.npy")).unwrap();
            assert_eq!(out.shape(), &[2, 4, 3, 8]);
            assert_eq!(lse.shape(), &[2, 4, 3]);
            if name == "decode" {
                assert_eq!(out, expected.out);
            } else {
                // one chunk of 8,192 keys holds the whole cache: the same loop, one merge
                let diff = (&out - &expected.out)
                    .mapv(f32::abs)
                    .fold(0.0f32, |a, &b| a.max(b));
                assert!(diff < 1e-6, "{name}: {diff}");
            }
        }
        // what does not fit together is refused, naming the file or the value
        let mut bad = args.clone();
        bad.v = dir.join("q.npy");
        let err = attend(&bad).unwrap_err();
        assert!(
            err.contains("q.npy") && err.contains("k and v share one shape"),
            "{err}"
        );
        let mut bad = args.clone();
        bad.dout = Some(dir.join("dq.npy"));
        let err = attend(&bad).unwrap_err();
        assert!(err.contains("decoder") && err.contains("backward"), "{err}");
        // 3 query heads on 2 kv heads: the decoder names the counts that divide
        let q3 = random_qkv(Shape::new(2, 3, 3, 8), 5)[0].clone();
        npy::write_f32(&dir.join("q3.npy"), q3.view()).unwrap();
        let mut bad = args.clone();
        bad.q = dir.join("q3.npy");
        let err = attend(&bad).unwrap_err();
        assert!(
            err.starts_with("decode_split failed")
                && err.contains("q has 3 heads and the cache 2 kv heads")
                && err.contains("accepted for 3 query heads: 1, 3"),
            "{err}"
        );
        let mut bad = args.clone();
        bad.dtype = Some(Dtype::Bf16);
        let err = attend(&bad).unwrap_err();
        assert!(err.contains("bf16") && err.contains("f32"), "{err}");
        fs::remove_dir_all(dir).unwrap();
    }
    // [/step 08]

    #[test]
    fn bad_inputs_are_refused_with_the_file_and_what_was_expected() {
        let (dir, args, _) = setup("bad", Shape::new(1, 2, 8, 4));
        let k_other = random_qkv(Shape::new(1, 2, 9, 4), 1)[0].clone();
        npy::write_f32(&dir.join("k9.npy"), k_other.view()).unwrap();

        let mut bad = args.clone();
        bad.k = dir.join("k9.npy");
        let err = attend(&bad).unwrap_err();
        assert!(
            err.contains("k9.npy") && err.contains("[1, 2, 9, 4]") && err.contains("q.npy"),
            "{err}"
        );

        let mut bad = args.clone();
        bad.v = dir.join("nowhere.npy");
        let err = attend(&bad).unwrap_err();
        assert!(
            err.contains("nowhere.npy") && err.contains("cannot read"),
            "{err}"
        );

        // [step 04]
        // --dout for a method without a backward pass is refused before any work
        if let Some(m) = methods::all().into_iter().find(|m| !m.has_backward()) {
            let mut args = args.clone();
            args.method = Entry::Method(m);
            args.dout = Some(dir.join("q.npy"));
            let err = attend(&args).unwrap_err();
            assert!(err.contains("backward") && err.contains(m.name()), "{err}");
        }
        // [/step 04]
        fs::remove_dir_all(dir).unwrap();
    }
}
