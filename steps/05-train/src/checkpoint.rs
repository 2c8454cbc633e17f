//! Checkpoints as safetensors files: every weight under its GPT-2 name, the optimizer's two
//! moments under `adamw.m.` and `adamw.v.` and that name, and the model's configuration,
//! the optimizer's settings and the step in the header's metadata. Numbers are stored as
//! they are in memory, little-endian `f32`, so a checkpoint round-trips bit for bit and
//! PyTorch reads it with `safetensors.torch.load_file`.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::TrainError;
use crate::model::{Config, Params};
use crate::optim::{AdamW, AdamWSettings};

/// What a checkpoint holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    pub params: Params<f32>,
    /// Absent from a checkpoint saved for sampling only.
    pub opt: Option<AdamW>,
    /// Steps trained so far.
    pub step: usize,
}

fn le_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

impl Checkpoint {
    /// Writes the checkpoint to `path`.
    pub fn save(&self, path: &Path) -> Result<(), TrainError> {
        let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        let mut add = |prefix: &str, p: &Params<f32>| {
            for (name, t) in p.tensors() {
                let data = le_bytes(t.as_slice().expect("standard layout"));
                tensors.push((format!("{prefix}{name}"), t.shape().to_vec(), data));
            }
        };
        add("", &self.params);
        if let Some(opt) = &self.opt {
            add("adamw.m.", &opt.m);
            add("adamw.v.", &opt.v);
        }
        let views = tensors
            .iter()
            .map(|(name, shape, data)| {
                let view =
                    TensorView::new(Dtype::F32, shape.clone(), data).expect("sizes agree");
                (name.clone(), view)
            })
            .collect::<Vec<_>>();
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
        let bytes = safetensors::serialize(views, Some(meta))
            .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", path.display())))?;
        fs::write(path, bytes).map_err(|e| TrainError::io(path, e))
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
                for (dst, v) in t.iter_mut().zip(values) {
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
