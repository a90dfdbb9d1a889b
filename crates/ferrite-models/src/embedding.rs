//! `EmbeddingHead`: how a model turns the final hidden states of an input into one embedding —
//! pooling (mean, first token or last token), the dense projections after it and the L2
//! normalisation — read from the model's files.
//!
//! A sentence-transformers directory says it in `modules.json`: a `Transformer` (the model
//! itself), a `Pooling` module (`1_Pooling/config.json`), optional `Dense` modules (each a
//! `config.json` and a `model.safetensors` holding `linear.weight`), and optional `Normalize`;
//! `sentence_bert_config.json`'s `max_seq_length` is the longest input it feeds the model
//! (longer texts are truncated to it, as sentence-transformers does). Without those files, a
//! decoder saved as a bare backbone (`architectures: ["Qwen3Model"]`, no LM head: the
//! Qwen3-Embedding style) pools its last token and normalises, and a bidirectional one
//! (`BertModel`) takes the mean, as sentence-transformers does with a plain transformers
//! model. A model whose files say neither does not embed.
//!
//! Truncating an embedding to fewer `dimensions` (Matryoshka) is allowed where the model was
//! trained for it: config.json's `matryoshka_dimensions` (those sizes) or `is_matryoshka`
//! (any size), and EmbeddingGemma (a bidirectional `gemma3_text`), whose model card gives
//! 768, 512, 256 and 128 but whose files do not.

use std::path::Path;

use ferrite_runtime::{ForwardBatch, Result as RtResult, RuntimeError};
use serde_json::Value;

use crate::blocks::Linear;
use crate::error::{LoadError, Result};
use crate::safetensors::SafetensorsDir;
use crate::weights::{WeightLayout, WeightSource, Weights};

/// How the hidden states of an input's tokens become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Pooling {
    /// The mean over every token.
    Mean,
    /// The first token (BERT's `[CLS]`).
    Cls,
    /// The last token (decoder embedders).
    Last,
}

/// What a model's embeddings are, for a server to validate requests against.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EmbeddingSpec {
    /// Length of an embedding.
    pub dimensions: usize,
    pub pooling: Pooling,
    /// Embeddings are L2-normalised.
    pub normalized: bool,
    /// Sizes an embedding may be truncated to (Matryoshka): None, not at all; an empty list,
    /// any size up to `dimensions`.
    pub matryoshka: Option<Vec<usize>>,
    /// The longest input, in tokens with the special ones, that sentence-transformers feeds
    /// the model (`max_seq_length`): text inputs are truncated to it.
    pub max_tokens: Option<usize>,
}

impl EmbeddingSpec {
    /// Whether an embedding may be truncated to `n` values; the error says what may.
    pub fn check_truncation(&self, n: usize) -> std::result::Result<(), String> {
        match &self.matryoshka {
            _ if n == self.dimensions => Ok(()),
            None => Err(format!("this model's embeddings have {} dimensions and cannot be truncated", self.dimensions)),
            Some(_) if n == 0 || n > self.dimensions => {
                Err(format!("dimensions must be between 1 and {}, got {n}", self.dimensions))
            }
            Some(dims) if !dims.is_empty() && !dims.contains(&n) => {
                Err(format!("this model's embeddings can be truncated to {dims:?} dimensions, not {n}"))
            }
            Some(_) => Ok(()),
        }
    }
}

/// A `Dense` module: `act(x Wᵀ + b)`.
struct Dense {
    linear: Linear,
    tanh: bool,
}

pub struct EmbeddingHead {
    spec: EmbeddingSpec,
    dense: Vec<Dense>,
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| LoadError::format(path, format!("invalid JSON: {e}")))
}

impl EmbeddingHead {
    /// The head of the HF directory `dir` (whose config.json is `config`, with `hidden`-wide
    /// states, attending `causal`ly or both ways), or None when its files say it does not embed.
    pub fn from_model_dir(dir: &Path, config: &Value, hidden: usize, causal: bool) -> Result<Option<EmbeddingHead>> {
        let matryoshka = matryoshka(config);
        let max_tokens = max_seq_length(dir)?;
        let modules = dir.join("modules.json");
        if !modules.is_file() {
            let arch = config.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str).unwrap_or("");
            if !arch.ends_with("Model") {
                return Ok(None);
            }
            let (pooling, normalized) = if causal { (Pooling::Last, true) } else { (Pooling::Mean, false) };
            let spec = EmbeddingSpec { dimensions: hidden, pooling, normalized, matryoshka, max_tokens };
            return Ok(Some(EmbeddingHead { spec, dense: Vec::new() }));
        }
        let list = read_json(&modules)?;
        let bad = |m: String| LoadError::format(&modules, m);
        let list = list.as_array().ok_or_else(|| bad("not a list of modules".into()))?;
        let (mut pooling, mut dense, mut normalized, mut width) = (None, Vec::new(), false, hidden);
        for m in list {
            let kind = m.get("type").and_then(Value::as_str).unwrap_or("");
            let sub = dir.join(m.get("path").and_then(Value::as_str).unwrap_or(""));
            match kind.rsplit('.').next().unwrap_or("") {
                "Transformer" => {}
                "Pooling" => pooling = Some(read_pooling(&sub.join("config.json"), hidden)?),
                "Dense" => {
                    let d = Dense::load(&sub, width)?;
                    width = d.linear.out_features();
                    dense.push(d);
                }
                "Normalize" => normalized = true,
                _ => return Err(bad(format!("module type '{kind}' is not supported"))),
            }
        }
        let pooling = pooling.ok_or_else(|| bad("no Pooling module".into()))?;
        let spec = EmbeddingSpec { dimensions: width, pooling, normalized, matryoshka, max_tokens };
        Ok(Some(EmbeddingHead { spec, dense }))
    }

    pub fn spec(&self) -> &EmbeddingSpec {
        &self.spec
    }

    /// One embedding per row of `batch` from `states` (`[tokens, hidden]`, after the final
    /// norm). Every row must hold its whole input.
    pub fn embed(&self, states: &[f32], hidden: usize, batch: &ForwardBatch) -> RtResult<Vec<Vec<f32>>> {
        let mut pooled = Vec::with_capacity(batch.rows.len() * hidden);
        for row in &batch.rows {
            if row.first_position() != 0 || row.query_len == 0 {
                return Err(RuntimeError::Shape("an embedding row must hold its whole input in one step".into()));
            }
            let token = |i: usize| &states[(row.query_start + i) * hidden..(row.query_start + i + 1) * hidden];
            match self.spec.pooling {
                Pooling::Cls => pooled.extend_from_slice(token(0)),
                Pooling::Last => pooled.extend_from_slice(token(row.query_len - 1)),
                Pooling::Mean => {
                    let mut sum = vec![0f64; hidden];
                    for i in 0..row.query_len {
                        sum.iter_mut().zip(token(i)).for_each(|(s, &x)| *s += f64::from(x));
                    }
                    pooled.extend(sum.iter().map(|s| (s / row.query_len as f64) as f32));
                }
            }
        }
        let rows = batch.rows.len();
        for d in &self.dense {
            pooled = d.linear.forward(&pooled, rows)?;
            if d.tanh {
                pooled.iter_mut().for_each(|v| *v = v.tanh());
            }
        }
        let width = self.spec.dimensions;
        let mut out: Vec<Vec<f32>> = pooled.chunks_exact(width).map(<[f32]>::to_vec).collect();
        if self.spec.normalized {
            out.iter_mut().for_each(|v| normalize(v));
        }
        Ok(out)
    }
}

/// Scale `v` to unit L2 norm (a zero vector stays zero).
pub fn normalize(v: &mut [f32]) {
    let norm = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x = (f64::from(*x) / norm) as f32);
    }
}

/// The Matryoshka sizes config.json declares, or EmbeddingGemma's.
fn matryoshka(config: &Value) -> Option<Vec<usize>> {
    if let Some(dims) = config.get("matryoshka_dimensions").and_then(Value::as_array) {
        return Some(dims.iter().filter_map(Value::as_u64).map(|d| d as usize).collect());
    }
    if config.get("is_matryoshka").and_then(Value::as_bool) == Some(true) {
        return Some(Vec::new());
    }
    let gemma = config.get("model_type").and_then(Value::as_str) == Some("gemma3_text");
    let bidirectional = config.get("use_bidirectional_attention").and_then(Value::as_bool) == Some(true);
    (gemma && bidirectional).then(|| vec![768, 512, 256, 128])
}

/// `max_seq_length` of `dir/sentence_bert_config.json`, if the file gives one.
fn max_seq_length(dir: &Path) -> Result<Option<usize>> {
    let path = dir.join("sentence_bert_config.json");
    if !path.is_file() {
        return Ok(None);
    }
    match read_json(&path)?.get("max_seq_length") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Ok(Some(n as usize)),
            _ => Err(LoadError::format(&path, format!("max_seq_length is {v} (expected a positive integer)"))),
        },
    }
}

/// `1_Pooling/config.json`: exactly one of the mean, CLS and last-token modes.
fn read_pooling(path: &Path, hidden: usize) -> Result<Pooling> {
    let v = read_json(path)?;
    let bad = |m: String| LoadError::format(path, m);
    let on = |k: &str| v.get(k).and_then(Value::as_bool) == Some(true);
    if let Some(d) = v.get("word_embedding_dimension").and_then(Value::as_u64) {
        if d as usize != hidden {
            return Err(bad(format!("word_embedding_dimension {d} differs from the model's hidden size {hidden}")));
        }
    }
    if v.get("include_prompt").and_then(Value::as_bool) == Some(false) {
        return Err(bad("include_prompt = false is not supported".into()));
    }
    for k in ["pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens"] {
        if on(k) {
            return Err(bad(format!("{k} is not supported")));
        }
    }
    let modes = [
        ("pooling_mode_mean_tokens", Pooling::Mean),
        ("pooling_mode_cls_token", Pooling::Cls),
        ("pooling_mode_lasttoken", Pooling::Last),
    ];
    let chosen: Vec<Pooling> = modes.iter().filter(|(k, _)| on(k)).map(|(_, p)| *p).collect();
    match chosen[..] {
        [p] => Ok(p),
        _ => Err(bad("exactly one of the mean, CLS and last-token pooling modes must be set".into())),
    }
}

impl Dense {
    /// The Dense module in `dir`, reading `inp`-wide vectors.
    fn load(dir: &Path, inp: usize) -> Result<Dense> {
        let cfg_path = dir.join("config.json");
        let cfg = read_json(&cfg_path)?;
        let bad = |m: String| LoadError::format(&cfg_path, m);
        let get = |k: &str| cfg.get(k).and_then(Value::as_u64).map(|x| x as usize);
        let (Some(i), Some(out)) = (get("in_features"), get("out_features")) else {
            return Err(bad("in_features and out_features are required".into()));
        };
        if i != inp {
            return Err(bad(format!("in_features {i}, but the module before gives {inp}")));
        }
        let tanh = match cfg.get("activation_function").and_then(Value::as_str).unwrap_or("") {
            "torch.nn.modules.linear.Identity" => false,
            "torch.nn.modules.activation.Tanh" => true,
            other => return Err(bad(format!("activation_function '{other}' is not supported"))),
        };
        let bias = cfg.get("bias").and_then(Value::as_bool).unwrap_or(true);
        let w = Weights::new(WeightSource::Safetensors(SafetensorsDir::open(dir)?), WeightLayout::default());
        Ok(Dense { linear: Linear::load(&w, "linear", out, inp, bias)?, tanh })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_follows_the_matryoshka_sizes() {
        let spec = |m| EmbeddingSpec {
            dimensions: 768,
            pooling: Pooling::Mean,
            normalized: true,
            matryoshka: m,
            max_tokens: None,
        };
        assert!(spec(None).check_truncation(768).is_ok());
        assert!(spec(None).check_truncation(256).unwrap_err().contains("cannot be truncated"));
        let gemma = spec(Some(vec![768, 512, 256, 128]));
        assert!(gemma.check_truncation(256).is_ok());
        assert!(gemma.check_truncation(300).unwrap_err().contains("[768, 512, 256, 128]"));
        assert!(spec(Some(vec![])).check_truncation(300).is_ok());
        assert!(spec(Some(vec![])).check_truncation(0).is_err());
        assert!(spec(Some(vec![])).check_truncation(1000).is_err());
    }
}
