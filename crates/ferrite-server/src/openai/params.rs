//! The request fields chat and completions share — model, sampling, stops, `n`, streaming —
//! and their translation into the engine's `RequestParams`. Fields absent from a request take
//! the model's `generation_config` defaults (its temperature only when it samples,
//! `GenerationDefaults::sampling_temperature`, as the CLI reads it), then OpenAI's. vLLM's extras (`top_k`, `min_p`,
//! `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`) are accepted too, and
//! structured output: `response_format` or vLLM's `guided_*` fields (`structured`). ferrite's
//! own extensions: `fill`, and the KV precision `kv_cache_dtype` / `quantized_kv_start`
//! (`ferrite_engine::kv_precision` says what a request may ask).

use std::collections::HashMap;

use ferrite_engine::{Constraint, FillMode, KvPrecision, RequestParams, SamplingParams};
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;
use crate::state::ModelInfo;
use crate::structured::{self, GuidedFields};

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Default, Deserialize)]
pub struct CommonParams {
    pub model: Option<String>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
    pub stop: Option<StopField>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub n: Option<usize>,
    pub max_tokens: Option<usize>,
    pub min_tokens: Option<usize>,
    pub ignore_eos: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub response_format: Option<Value>,
    /// Fill mode (ferrite extension): "off", "strict" or "echo"; absent = the server's default.
    pub fill: Option<String>,
    /// KV precision (ferrite extension): "auto", "f16" / "bf16" (full precision) or the KV
    /// cache's quantized type ("int8", "int4"); absent = the server's.
    pub kv_cache_dtype: Option<String>,
    /// The position the request's KV turns quantized at (ferrite extension); absent = the
    /// server's `--quantized-kv-start`.
    pub quantized_kv_start: Option<usize>,
    /// vLLM's guided decoding (`structured::GuidedFields`). Fields of their own rather than a
    /// flattened struct: `flatten` would buffer every unknown field of the body.
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_grammar: Option<String>,
    pub guided_choice: Option<Vec<String>>,
}

impl CommonParams {
    /// The output constraint: `response_format` or one `guided_*` field, not both.
    pub fn constraint(&self) -> Result<Option<Constraint>, ApiError> {
        let format = match &self.response_format {
            Some(f) => structured::from_format(f, "response_format")?,
            None => None,
        };
        let guided = GuidedFields {
            guided_json: self.guided_json.as_ref(),
            guided_regex: self.guided_regex.as_deref(),
            guided_grammar: self.guided_grammar.as_deref(),
            guided_choice: self.guided_choice.as_deref(),
        };
        match (format, guided.constraint()?) {
            (Some(_), Some((_, field))) => {
                Err(ApiError::invalid_param(field, format!("{field} and a json response_format cannot both be set")))
            }
            (Some(c), None) | (None, Some((c, _))) => Ok(Some(c)),
            (None, None) => Ok(None),
        }
    }

    pub fn streaming(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|o| o.include_usage)
    }

    /// The engine parameters; `max_tokens` and `logprobs` are resolved by the endpoint.
    pub fn to_request_params(
        &self,
        model: &ModelInfo,
        max_tokens: Option<usize>,
        logprobs: Option<usize>,
    ) -> Result<RequestParams, ApiError> {
        let d = &model.defaults;
        let mut logit_bias = Vec::new();
        for (key, &bias) in self.logit_bias.iter().flatten() {
            let token = key.trim().parse::<u32>().map_err(|_| {
                ApiError::invalid_param("logit_bias", format!("logit_bias keys must be token ids, got '{key}'"))
            })?;
            logit_bias.push((token, bias));
        }
        logit_bias.sort_unstable_by_key(|&(t, _)| t);
        let sampling = SamplingParams {
            temperature: self.temperature.or(d.sampling_temperature()).unwrap_or(1.0),
            top_k: self.top_k.map_or(d.top_k.unwrap_or(0), |k| k.max(0) as usize),
            top_p: self.top_p.or(d.top_p).unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            seed: self.seed.map_or_else(rand::random, |s| s as u64),
            repetition_penalty: self.repetition_penalty.or(d.repetition_penalty).unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            logit_bias,
        };
        let fill = match self.fill.as_deref() {
            None => None,
            Some(f) => Some(f.parse::<FillMode>().map_err(|e| ApiError::invalid_param("fill", e))?),
        };
        let kv_cache_dtype = match self.kv_cache_dtype.as_deref() {
            None => None,
            Some(d) => Some(d.parse::<KvPrecision>().map_err(|e| ApiError::invalid_param("kv_cache_dtype", e))?),
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(v)) => v.clone(),
        };
        Ok(RequestParams {
            sampling,
            max_tokens,
            min_tokens: self.min_tokens.unwrap_or(0),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            stop,
            logprobs,
            n: self.n.unwrap_or(1),
            fill,
            constraint: self.constraint()?,
            // Set from the lease on the model the request named (`App::generate`).
            adapter: None,
            embed: false,
            kv_cache_dtype,
            quantized_kv_start: self.quantized_kv_start,
        })
    }
}
