//! The precision of a request's KV: what the engine's pools offer (`KvChoices`), how a
//! request's `kv_cache_dtype` / `quantized_kv_start` resolve against them (`resolve`), and
//! how the cache's bytes split between the quantized pools and their full-precision twins.
//!
//! A cache holds one type (`--kv-cache-dtype`); a quantized one started with
//! `--quantized-kv-start N > 0` also keeps full-precision (f16) twin pools for rows before
//! their start. What a request may ask:
//! - nothing, or `auto`: the engine's type, turning quantized at the engine's start;
//! - the cache's own quantized type (`int8` on an int8 cache) with any `quantized_kv_start`
//!   (0: quantized from its first position);
//! - full precision (`f16` or `bf16`: the cache's full-precision type): it never turns.
//!
//! A start past 0 and full precision need the twin pools: on a quantized cache without them
//! (started with start 0) a request may only run quantized from its first position, and on a
//! full-precision cache only at full precision. Anything else (another quantized type, fp8 on
//! the CPU, a start on a full-precision cache) is refused with a message naming what the
//! cache serves. Each part of a request must also fit its pools: the positions before its
//! start the twins, the rest the quantized pools.
//!
//! The twins hold `max_num_seqs × N` positions (every running row before the engine's start),
//! at most half of each group's bytes; the quantized pools take the rest. A recurrent group
//! (the state slots of a hybrid model's linear-attention layers) holds no quantized KV and
//! gets no twins: all its bytes stay its own, and a row keeps its slots through its start.

use ferrite_models::model::CausalLm;
use ferrite_runtime::{KvCache, KvLayout};

use crate::config::EngineConfig;
use crate::error::EngineError;
use crate::kv::{KvManager, NEVER};
use crate::request::{KvPrecision, RequestParams};

/// The request fields a refusal names.
const DTYPE: &str = "kv_cache_dtype";
const START: &str = "quantized_kv_start";

/// What a request may choose of the KV cache's precision (`Limits::kv`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvChoices {
    /// The cache's quantized type (`int8`, `int4`); None when it holds full precision.
    pub quantized: Option<String>,
    /// What the cache holds, for messages (`int8/g64`).
    pub scheme: String,
    /// The start of a request that sets none (0 without twins).
    pub default_start: usize,
    /// Positions the full-precision twin pools hold (0: there are none).
    pub full_precision_tokens: usize,
}

impl KvChoices {
    /// The choices of a cache of `cfg`'s scheme, which `description` names, whose blocks
    /// `kvm` manages.
    pub(crate) fn new(cfg: &EngineConfig, description: String, kvm: &KvManager) -> KvChoices {
        let quantized = cfg.kv_scheme.dtype.quantized().map(|(bits, _)| format!("int{}", bits.bits()));
        KvChoices {
            quantized,
            scheme: description,
            default_start: if kvm.has_full_precision() { cfg.quantized_kv_start } else { 0 },
            full_precision_tokens: kvm.full_precision_capacity_tokens(),
        }
    }

    /// What the pools hold, for reports: the scheme, and the f16 part of a delayed start.
    pub fn describe(&self) -> String {
        match (self.default_start, self.full_precision_tokens) {
            (_, 0) => self.scheme.clone(),
            (n, f) => format!("{} (f16 for a sequence's first {n} positions; f16 pools of {f} tokens)", self.scheme),
        }
    }

    /// What a request may ask of this cache, for messages.
    fn offer(&self) -> String {
        match (&self.quantized, self.full_precision_tokens) {
            (None, _) => format!(
                "this engine's KV cache is {}: a request may ask kv_cache_dtype 'f16' (or 'auto') \
                                  and no quantized_kv_start",
                self.scheme
            ),
            (Some(q), 0) => format!(
                "this engine's KV cache is {} with no full-precision pools (start it with --quantized-kv-start N > \
                 0 for them): a request may ask kv_cache_dtype '{q}' (or 'auto') with quantized_kv_start 0",
                self.scheme
            ),
            (Some(q), _) => format!(
                "this engine's KV cache is {} with full-precision pools: a request may ask kv_cache_dtype '{q}' (or \
                 'auto') with any quantized_kv_start, or 'f16' for full precision",
                self.scheme
            ),
        }
    }

    fn refuse(&self, param: &'static str, what: String) -> EngineError {
        EngineError::KvPrecision { param, message: format!("{what}: {}", self.offer()) }
    }

    /// The position `p`'s KV turns quantized at: 0 for a full-precision cache or a row
    /// quantized from its first position, `NEVER` for a full-precision row of a quantized
    /// cache; an error names what the cache serves instead.
    pub fn resolve(&self, p: &RequestParams) -> Result<usize, EngineError> {
        let dtype = p.kv_cache_dtype.unwrap_or(KvPrecision::Auto);
        if p.embed {
            return Ok(0);
        }
        let start = match (dtype, &self.quantized) {
            (KvPrecision::Full, _) if p.quantized_kv_start.is_some() => {
                return Err(self
                    .refuse(START, "quantized_kv_start is for a quantized kv_cache_dtype, not full precision".into()))
            }
            (KvPrecision::Full, None) => return Ok(0),
            (KvPrecision::Full, Some(_)) => NEVER,
            (KvPrecision::Auto, None) if p.quantized_kv_start.is_some() => {
                return Err(self.refuse(START, "quantized_kv_start needs a quantized KV cache".into()))
            }
            (KvPrecision::Auto, None) => return Ok(0),
            (KvPrecision::Auto, Some(_)) => p.quantized_kv_start.unwrap_or(self.default_start),
            (asked, q) => match (asked.quantized_name(), q) {
                (Some(a), Some(q)) if a == q => p.quantized_kv_start.unwrap_or(self.default_start),
                (a, _) => {
                    return Err(self.refuse(DTYPE, format!("kv_cache_dtype '{}' is not served", a.unwrap_or("?"))))
                }
            },
        };
        if start > 0 && self.full_precision_tokens == 0 {
            return Err(match start {
                NEVER => self.refuse(DTYPE, "full-precision KV needs full-precision pools".into()),
                n => self.refuse(START, format!("quantized_kv_start {n} needs full-precision pools")),
            });
        }
        Ok(start)
    }

    /// Check that a sequence of `need` positions quantized from `start` fits: the part before
    /// the start the twin pools, the rest `capacity` (the quantized pools).
    pub fn check_fits(&self, need: usize, start: usize, capacity: usize) -> Result<(), EngineError> {
        let full = need.min(start);
        if start > 0 && full > self.full_precision_tokens {
            return Err(EngineError::KvTooSmall { need: full, capacity: self.full_precision_tokens });
        }
        if need > start && need > capacity {
            return Err(EngineError::KvTooSmall { need, capacity });
        }
        Ok(())
    }
}

/// The KV cache of `model` under `cfg`: `group_blocks[g]` blocks of `block_bytes[g]` bytes,
/// split between the quantized pools and the full-precision twins of a delayed start
/// (`split_blocks`). Returns it and the blocks of each part.
pub(crate) fn new_cache(
    model: &dyn CausalLm,
    cfg: &EngineConfig,
    layout: &KvLayout,
    group_blocks: &[usize],
    block_bytes: &[usize],
) -> Result<(KvCache, Vec<usize>, Vec<usize>), EngineError> {
    if cfg.quantized_kv_start > 0 && cfg.kv_scheme.dtype.quantized().is_none() {
        return Err(EngineError::Config(
            "--quantized-kv-start needs a quantized KV cache (--kv-cache-dtype int8 or int4)".into(),
        ));
    }
    let full_bytes = layout.block_bytes(cfg.block_size);
    let (own, full) = split_blocks(cfg, group_blocks, block_bytes, &full_bytes, layout.recurrent_group())?;
    let mut kv = model.new_kv_cache(&own, cfg.block_size, &cfg.kv_scheme)?;
    if !full.is_empty() {
        kv.add_full_precision(&full)?;
    }
    Ok((kv, own, full))
}

/// Split the cache into `group_blocks[g]` quantized blocks (each `block_bytes[g]` bytes, the
/// whole budget) into quantized blocks and full-precision twin blocks (`full_bytes[g]` bytes
/// each) per group: none without a start; else the twins take `max_num_seqs × start`
/// positions, at most half of the bytes — but for the recurrent group `state`, which keeps
/// all its blocks and gets no twin. An error when a part gets no block.
pub(crate) fn split_blocks(
    cfg: &EngineConfig,
    group_blocks: &[usize],
    block_bytes: &[usize],
    full_bytes: &[usize],
    state: Option<usize>,
) -> Result<(Vec<usize>, Vec<usize>), EngineError> {
    let start = cfg.quantized_kv_start;
    if start == 0 {
        return Ok((group_blocks.to_vec(), Vec::new()));
    }
    let per_row = start.div_ceil(cfg.block_size);
    let (mut own, mut full) = (Vec::new(), Vec::new());
    for (g, ((&n, &b), &f)) in group_blocks.iter().zip(block_bytes).zip(full_bytes).enumerate() {
        if Some(g) == state {
            own.push(n);
            full.push(0);
            continue;
        }
        let budget = n * b;
        let twins = (cfg.max_num_seqs * per_row).min(budget / 2 / f.max(1));
        let rest = (budget - twins * f) / b.max(1);
        if twins == 0 || rest == 0 {
            return Err(EngineError::Config(format!(
                "the KV cache of {budget} bytes holds no full-precision block beside the quantized ones (a block takes \
                 {f} bytes in f16, {b} quantized): give it more memory or drop --quantized-kv-start"
            )));
        }
        own.push(rest);
        full.push(twins);
    }
    Ok((own, full))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choices(quantized: Option<&str>, full: usize) -> KvChoices {
        KvChoices {
            quantized: quantized.map(String::from),
            scheme: quantized.unwrap_or("f16").into(),
            default_start: if full > 0 { 32 } else { 0 },
            full_precision_tokens: full,
        }
    }

    fn ask(dtype: Option<&str>, start: Option<usize>) -> RequestParams {
        RequestParams {
            kv_cache_dtype: dtype.map(|d| d.parse().expect("known dtype")),
            quantized_kv_start: start,
            ..Default::default()
        }
    }

    #[test]
    fn requests_choose_the_caches_type_full_precision_or_a_start_when_twins_exist() {
        let (int8, bare, f16) = (choices(Some("int8"), 4096), choices(Some("int8"), 0), choices(None, 0));
        assert_eq!(int8.resolve(&ask(None, None)).unwrap(), 32);
        assert_eq!(int8.resolve(&ask(Some("auto"), Some(7))).unwrap(), 7);
        assert_eq!(int8.resolve(&ask(Some("int8"), Some(0))).unwrap(), 0);
        assert_eq!(int8.resolve(&ask(Some("f16"), None)).unwrap(), NEVER);
        assert_eq!(int8.resolve(&ask(Some("bf16"), None)).unwrap(), NEVER);
        assert_eq!(bare.resolve(&ask(Some("int8"), None)).unwrap(), 0);
        assert_eq!(f16.resolve(&ask(Some("f16"), None)).unwrap(), 0);
        let refused = |c: &KvChoices, d, s, want: &str| {
            let e = c.resolve(&ask(d, s)).expect_err("refused").to_string();
            assert!(e.contains(want) && e.contains("a request may ask"), "{e}");
        };
        refused(&int8, Some("int4"), None, "'int4' is not served");
        refused(&int8, Some("fp8"), None, "'fp8' is not served");
        refused(&int8, Some("f16"), Some(3), "not full precision");
        refused(&bare, Some("f16"), None, "full-precision KV needs full-precision pools");
        refused(&bare, None, Some(5), "quantized_kv_start 5 needs full-precision pools");
        refused(&f16, Some("int8"), None, "'int8' is not served");
        refused(&f16, None, Some(0), "needs a quantized KV cache");
        assert!("int9".parse::<KvPrecision>().unwrap_err().contains("auto, f16, bf16, int8, int4, fp8"));
    }

    #[test]
    fn each_part_of_a_sequence_must_fit_its_pools() {
        let c = choices(Some("int8"), 100);
        assert!(c.check_fits(150, 100, 200).is_ok());
        assert!(c.check_fits(150, NEVER, 200).is_err(), "150 full-precision positions in 100");
        assert!(c.check_fits(90, NEVER, 10).is_ok(), "a row that never turns needs no quantized room");
        assert!(c.check_fits(250, 50, 200).is_err(), "250 positions in 200 quantized ones");
        assert!(c.check_fits(250, 0, 300).is_ok());
    }

    #[test]
    fn twins_take_the_engines_start_for_every_row_at_most_half_the_bytes() {
        let cfg = EngineConfig { quantized_kv_start: 40, max_num_seqs: 4, block_size: 16, ..Default::default() };
        // 1000 blocks of 20 bytes; twins of 32 bytes: 4 rows × 3 blocks.
        let (own, full) = split_blocks(&cfg, &[1000], &[20], &[32], None).unwrap();
        assert_eq!((own, full), (vec![(20_000 - 12 * 32) / 20], vec![12]));
        let (own, full) = split_blocks(&cfg, &[10], &[20], &[32], None).unwrap();
        assert_eq!((own, full), (vec![(200 - 3 * 32) / 20], vec![3]), "at most half of 200 bytes");
        assert!(split_blocks(&cfg, &[1], &[20], &[32], None).is_err());
        // A recurrent group keeps its state slots, however few, and gets no twin.
        let (own, full) = split_blocks(&cfg, &[1000, 1], &[20, 5000], &[32, 5000], Some(1)).unwrap();
        assert_eq!((own, full), (vec![(20_000 - 12 * 32) / 20, 1], vec![12, 0]));
        let off = EngineConfig { quantized_kv_start: 0, ..cfg };
        assert_eq!(split_blocks(&off, &[10], &[20], &[32], None).unwrap(), (vec![10], vec![]));
    }
}
