//! Checkpoints as safetensors files: every weight under its GPT-2 name, the optimizer's two
//! moments under `adamw.m.` and `adamw.v.` and that name, and the model's configuration,
//! the optimizer's settings and the step in the header's metadata. Numbers are stored as
//! they are in memory, little-endian `f32`, so a checkpoint round-trips bit for bit and
//! PyTorch reads it with `safetensors.torch.load_file`.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::path::Path;

use flash_core::files;
use ndarray::ArrayViewD;
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo};

use crate::TrainError;
use crate::model::{Config, Params};
use crate::optim::{AdamW, AdamWSettings};
use crate::train::Trainer;

/// What a checkpoint holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    pub params: Params<f32>,
    /// Absent from a checkpoint saved for sampling only.
    pub opt: Option<AdamW>,
    /// Steps trained so far.
    pub step: usize,
}

impl From<Trainer> for Checkpoint {
    /// Everything needed to go on training: weights, optimizer, step.
    fn from(t: Trainer) -> Checkpoint {
        Checkpoint {
            params: t.params,
            opt: Some(t.opt),
            step: t.step,
        }
    }
}

/// Floats a buffer of a checkpoint's bytes holds: a tensor is written in pieces of this
/// many, so a save never holds more than one piece's copy beside the weights.
const PIECE: usize = 1 << 16;

/// Writes `x` as little-endian bytes, a piece at a time.
fn write_le(w: &mut dyn Write, x: &[f32]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(4 * PIECE.min(x.len()));
    for piece in x.chunks(PIECE) {
        buf.clear();
        buf.extend(piece.iter().flat_map(|v| v.to_le_bytes()));
        w.write_all(&buf)?;
    }
    Ok(())
}

impl Checkpoint {
    /// Writes the checkpoint to `path`, whole or not at all ([`files::write_atomic_with`]):
    /// a save that fails half-way (a full disk, a file-size limit, a second Ctrl-C) leaves
    /// the checkpoint that was there before as it was. The tensors stream to the file one
    /// after another, in the layout and order (by name) that `safetensors::serialize`
    /// gives them, without a second copy of the model in memory.
    pub fn save(&self, path: &Path) -> Result<(), TrainError> {
        self.save_with(path, &[])
    }

    /// [`Checkpoint::save`] with more entries in the header's metadata: the trainer keeps
    /// the run's settings and its corpus's fingerprint there, so that a resumed run can say
    /// where it differs from the run that saved.
    pub fn save_with(
        &self,
        path: &Path,
        extra: &[(&str, String)],
    ) -> Result<(), TrainError> {
        fn named<'a>(
            prefix: &str,
            p: &'a Params<f32>,
        ) -> Vec<(String, ArrayViewD<'a, f32>)> {
            let tensors = p.tensors().into_iter();
            tensors
                .map(|(name, t)| (format!("{prefix}{name}"), t))
                .collect()
        }
        let mut tensors = named("", &self.params);
        if let Some(opt) = &self.opt {
            tensors.extend(named("adamw.m.", &opt.m));
            tensors.extend(named("adamw.v.", &opt.v));
        }
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        let mut offset = 0;
        let infos = tensors
            .iter()
            .map(|(name, t)| {
                let info = TensorInfo {
                    dtype: Dtype::F32,
                    shape: t.shape().to_vec(),
                    data_offsets: (offset, offset + 4 * t.len()),
                };
                offset += 4 * t.len();
                (name.clone(), info)
            })
            .collect();
        let json = |v: serde_json::Result<String>| v.expect("plain structs serialise");
        let mut meta = HashMap::from([
            ("format".to_string(), "step05-train".to_string()),
            (
                "config".to_string(),
                json(serde_json::to_string(&self.params.config)),
            ),
            ("step".to_string(), self.step.to_string()),
        ]);
        if let Some(opt) = &self.opt {
            meta.insert("adamw".into(), json(serde_json::to_string(&opt.settings)));
            meta.insert("adamw.t".into(), opt.t.to_string());
        }
        for (key, value) in extra {
            meta.insert(key.to_string(), value.clone());
        }
        let bad = |e: String| TrainError::Checkpoint(format!("{}: {e}", path.display()));
        let header = Metadata::new(Some(meta), infos).map_err(|e| bad(e.to_string()))?;
        let mut header = json(serde_json::to_string(&header)).into_bytes();
        // safetensors' header: its length as a little-endian u64, then JSON padded with
        // spaces to a multiple of 8 bytes, so the tensors that follow are aligned
        header.resize(header.len().next_multiple_of(8), b' ');
        files::write_atomic_with(path, |w| {
            w.write_all(&(header.len() as u64).to_le_bytes())?;
            w.write_all(&header)?;
            for (_, t) in &tensors {
                write_le(w, t.as_slice().expect("standard layout"))?;
            }
            Ok(())
        })
        .map_err(TrainError::from)
    }

    /// Reads a checkpoint that [`Checkpoint::save`] wrote.
    pub fn load(path: &Path) -> Result<Checkpoint, TrainError> {
        let bytes = fs::read(path).map_err(|e| TrainError::io(path, e))?;
        let bad =
            |why: String| TrainError::Checkpoint(format!("{}: {why}", path.display()));
        let (_, header) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| bad(format!("not safetensors: {e}")))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let get = |key: &str| {
            meta.get(key).ok_or_else(|| {
                bad(format!(
                    "no `{key}` in its metadata: not a checkpoint of this trainer"
                ))
            })
        };
        let config: Config = serde_json::from_str(get("config")?)
            .map_err(|e| bad(format!("its config does not parse: {e}")))?;
        config.check()?;
        let step: usize = get("step")?
            .parse()
            .map_err(|e| bad(format!("its step does not parse: {e}")))?;
        let file = SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
        let read = |prefix: &str| -> Result<Params<f32>, TrainError> {
            let mut p = Params::<f32>::zeros(config);
            for (name, mut t) in p.tensors_mut() {
                let full = format!("{prefix}{name}");
                let view = file
                    .tensor(&full)
                    .map_err(|e| bad(format!("{full}: {e}")))?;
                if view.dtype() != Dtype::F32 || view.shape() != t.shape() {
                    return Err(bad(format!(
                        "{full} is {:?} {:?}, but a model of {config:?} has it f32 {:?}",
                        view.dtype(),
                        view.shape(),
                        t.shape()
                    )));
                }
                let values = view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()));
                for (i, (dst, v)) in t.iter_mut().zip(values).enumerate() {
                    // a NaN or an infinity trains and samples garbage without an error:
                    // refused here, where the file can be named
                    if !v.is_finite() {
                        return Err(bad(format!(
                            "{full}[{i}] is {v}: the checkpoint holds a non-finite number \
                             (the run that wrote it diverged, or the file is damaged); \
                             resume or sample from an earlier checkpoint"
                        )));
                    }
                    *dst = v;
                }
            }
            Ok(p)
        };
        let params = read("")?;
        let opt = match meta.get("adamw") {
            None => None,
            Some(settings) => {
                let settings: AdamWSettings =
                    serde_json::from_str(settings).map_err(|e| {
                        bad(format!("its optimizer settings do not parse: {e}"))
                    })?;
                let t = get("adamw.t")?
                    .parse()
                    .map_err(|e| bad(format!("adamw.t does not parse: {e}")))?;
                Some(AdamW {
                    settings,
                    m: read("adamw.m.")?,
                    v: read("adamw.v.")?,
                    t,
                })
            }
        };
        Ok(Checkpoint { params, opt, step })
    }

    /// The metadata of the checkpoint at `path` (its configuration, step, and what
    /// [`Checkpoint::save_with`] added), read from its header alone.
    pub fn metadata(path: &Path) -> Result<HashMap<String, String>, TrainError> {
        use std::io::Read;
        let bad =
            |why: String| TrainError::Checkpoint(format!("{}: {why}", path.display()));
        let mut file = fs::File::open(path).map_err(|e| TrainError::io(path, e))?;
        let mut n = [0u8; 8];
        file.read_exact(&mut n)
            .map_err(|e| TrainError::io(path, e))?;
        let n = u64::from_le_bytes(n);
        let len = file.metadata().map_err(|e| TrainError::io(path, e))?.len();
        // the header's length is checked against the file's before it is allocated
        if n > len.saturating_sub(8) {
            return Err(bad(format!(
                "its header says {n} bytes, but the file has {len}: not safetensors"
            )));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header)
            .map_err(|e| TrainError::io(path, e))?;
        let header: serde_json::Value = serde_json::from_slice(&header)
            .map_err(|e| bad(format!("its header is not JSON: {e}")))?;
        let meta = header.get("__metadata__").cloned().unwrap_or_default();
        Ok(serde_json::from_value(meta).unwrap_or_default())
    }

    /// An error unless the checkpoint's model has the configuration `want`.
    pub fn check_config(&self, want: &Config) -> Result<(), TrainError> {
        let have = &self.params.config;
        if have != want {
            return Err(TrainError::Checkpoint(format!(
                "the checkpoint is a model of {have:?}, not of the {want:?} asked for; \
                 leave out the model's flags to take the checkpoint's"
            )));
        }
        Ok(())
    }
}
