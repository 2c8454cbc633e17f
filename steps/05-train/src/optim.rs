//! AdamW, the learning rate's schedule and gradient clipping: GPT-2's recipe as nanoGPT and
//! llm.c train it.

use serde::{Deserialize, Serialize};

use crate::model::{Config, Params};

/// The optimizer's settings.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWSettings {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Applied to matrices only (the embeddings and the four weights of a block), not to
    /// biases or LayerNorm gains, as nanoGPT does.
    pub weight_decay: f32,
}

impl Default for AdamWSettings {
    /// β = (0.9, 0.95), ε = 1e-8, weight decay 0.1: GPT-3's values (Brown et al. 2020, §B),
    /// which nanoGPT and llm.c train GPT-2 with.
    fn default() -> Self {
        AdamWSettings {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

// ANCHOR: adamw
/// AdamW (Loshchilov & Hutter 2019): Adam's step, and the weights shrunk by `lr·λ` apart
/// from the gradient.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    pub settings: AdamWSettings,
    /// The running mean of the gradients, the running mean of their squares.
    pub m: Params<f32>,
    pub v: Params<f32>,
    /// Steps taken so far: the bias correction divides by `1 − βᵗ`.
    pub t: u64,
}

impl AdamW {
    pub fn new(config: Config, settings: AdamWSettings) -> Self {
        AdamW {
            settings,
            m: Params::zeros(config),
            v: Params::zeros(config),
            t: 0,
        }
    }

    /// One step of every weight along its gradient, at learning rate `lr`.
    pub fn step(&mut self, params: &mut Params<f32>, grads: &Params<f32>, lr: f32) {
        self.t += 1;
        let AdamWSettings {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.settings;
        let c1 = 1.0 - beta1.powi(self.t as i32);
        let c2 = 1.0 - beta2.powi(self.t as i32);
        let tensors = params
            .tensors_mut()
            .into_iter()
            .zip(grads.tensors())
            .zip(self.m.tensors_mut())
            .zip(self.v.tensors_mut());
        for ((((_, mut w), (_, g)), (_, mut m)), (_, mut v)) in tensors {
            let decay = if w.ndim() == 2 { weight_decay } else { 0.0 };
            let (w, g) = (w.as_slice_mut().unwrap(), g.as_slice().unwrap());
            let (m, v) = (m.as_slice_mut().unwrap(), v.as_slice_mut().unwrap());
            for i in 0..w.len() {
                m[i] = beta1 * m[i] + (1.0 - beta1) * g[i];
                v[i] = beta2 * v[i] + (1.0 - beta2) * g[i] * g[i];
                let (m_hat, v_hat) = (m[i] / c1, v[i] / c2);
                w[i] -= lr * (m_hat / (v_hat.sqrt() + eps) + decay * w[i]);
            }
        }
    }
}
// ANCHOR_END: adamw

// ANCHOR: schedule
/// The learning rate: a linear warm-up to `max` over `warmup` steps, then a cosine from
/// `max` down to `min` at the last step (nanoGPT's `get_lr`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub max: f32,
    pub min: f32,
    pub warmup: usize,
    pub steps: usize,
}

impl Schedule {
    /// The rate of step `step`, counted from 0.
    pub fn lr(&self, step: usize) -> f32 {
        if step < self.warmup {
            return self.max * (step + 1) as f32 / self.warmup as f32;
        }
        let decay_steps = self.steps.saturating_sub(self.warmup).max(1);
        let progress = ((step - self.warmup) as f32 / decay_steps as f32).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f32::consts::PI * progress).cos());
        self.min + cosine * (self.max - self.min)
    }
}
// ANCHOR_END: schedule

/// The gradients' global norm `√(Σ g²)` over every tensor; when it is above `max_norm`
/// every gradient is scaled down by `max_norm / norm`, so a rare large batch cannot throw
/// the weights far. Returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut Params<f32>, max_norm: f32) -> f32 {
    let sum: f64 = grads
        .tensors()
        .iter()
        .flat_map(|(_, t)| t.iter())
        .map(|&g| (g as f64) * (g as f64))
        .sum();
    let norm = sum.sqrt() as f32;
    if norm > max_norm {
        let scale = max_norm / norm;
        for (_, mut t) in grads.tensors_mut() {
            t.mapv_inplace(|g| g * scale);
        }
    }
    norm
}
