//! How `run` and `chat` sample when the user says nothing: the model's own generation
//! defaults (`generation_config.json`, read as transformers reads it: sampling only when
//! `do_sample` is true, with its temperature, top-p, top-k and repetition penalty), otherwise
//! greedy decoding. Greedy is the fallback because the small default model (SmolLM2-135M)
//! answers a factual question correctly and stops when it takes its most likely token, while
//! sampled at temperature 0.8 it wanders off (README, "First run"). Flags always win.

use ferrite_engine::SamplingParams;
use ferrite_models::load::GenerationDefaults;

use crate::session::SamplingArgs;

/// top-k and top-p of a sampled run when neither the flags nor the model give them.
const FALLBACK_TOP_K: usize = 40;
const FALLBACK_TOP_P: f32 = 0.95;

/// The sampling of one generation: flags first, then the model's defaults, then greedy;
/// `seed` supplies the seed when `--seed` is absent.
pub fn resolve(args: &SamplingArgs, model: &GenerationDefaults, seed: fn() -> u64) -> SamplingParams {
    SamplingParams {
        temperature: args.temperature.or(model.sampling_temperature()).unwrap_or(0.0),
        top_k: args.top_k.or(model.top_k).unwrap_or(FALLBACK_TOP_K),
        top_p: args.top_p.or(model.top_p).unwrap_or(FALLBACK_TOP_P),
        min_p: args.min_p.unwrap_or(0.0),
        repetition_penalty: args.repetition_penalty.or(model.repetition_penalty).unwrap_or(1.0),
        seed: args.seed.unwrap_or_else(seed),
        ..SamplingParams::default()
    }
}

/// A note for flags that the resolved sampling ignores (greedy decoding reads no top-k, top-p
/// or min-p): they concern what the user asked for.
pub fn ignored_flags_note(args: &SamplingArgs, resolved: &SamplingParams) -> Option<String> {
    if !resolved.is_greedy() {
        return None;
    }
    let given: Vec<&str> =
        [("--top-k", args.top_k.is_some()), ("--top-p", args.top_p.is_some()), ("--min-p", args.min_p.is_some())]
            .into_iter()
            .filter_map(|(flag, set)| set.then_some(flag))
            .collect();
    if given.is_empty() {
        return None;
    }
    let why = if args.temperature.is_some() { "at temperature 0" } else { "when decoding greedily (the default here)" };
    Some(format!("note: {} has no effect {why}; give --temperature T > 0 to sample", given.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> SamplingArgs {
        SamplingArgs {
            max_tokens: 16,
            temperature: None,
            top_p: None,
            top_k: None,
            repetition_penalty: None,
            min_p: None,
            seed: None,
        }
    }

    fn seven() -> u64 {
        7
    }

    #[test]
    fn greedy_without_model_defaults() {
        let p = resolve(&args(), &GenerationDefaults::default(), seven);
        assert!(p.is_greedy());
        assert_eq!((p.repetition_penalty, p.seed), (1.0, 7));
        assert_eq!(ignored_flags_note(&args(), &p), None);
    }

    #[test]
    fn a_sampling_generation_config_is_used() {
        // Qwen2.5-Instruct's generation_config.json.
        let model = GenerationDefaults {
            do_sample: Some(true),
            temperature: Some(0.7),
            top_p: Some(0.8),
            top_k: Some(20),
            repetition_penalty: Some(1.05),
            eos_token_ids: vec![],
        };
        let p = resolve(&args(), &model, seven);
        assert_eq!((p.temperature, p.top_p, p.top_k, p.repetition_penalty), (0.7, 0.8, 20, 1.05));
        // Flags win over it.
        let a = SamplingArgs { temperature: Some(0.0), top_k: Some(5), ..args() };
        let p = resolve(&a, &model, seven);
        assert!(p.is_greedy());
        assert_eq!(p.top_k, 5);
        // do_sample true without a temperature is transformers' 1.0.
        let p = resolve(&args(), &GenerationDefaults { do_sample: Some(true), ..Default::default() }, seven);
        assert_eq!((p.temperature, p.top_k, p.top_p), (1.0, FALLBACK_TOP_K, FALLBACK_TOP_P));
    }

    #[test]
    fn a_greedy_generation_config_stays_greedy() {
        // do_sample absent or false: transformers decodes greedily whatever the temperature.
        for do_sample in [None, Some(false)] {
            let model = GenerationDefaults { do_sample, temperature: Some(0.6), ..Default::default() };
            assert!(resolve(&args(), &model, seven).is_greedy(), "{do_sample:?}");
        }
    }

    #[test]
    fn flags_that_greedy_ignores_get_a_note() {
        let a = SamplingArgs { top_p: Some(0.9), min_p: Some(0.1), ..args() };
        let p = resolve(&a, &GenerationDefaults::default(), seven);
        let note = ignored_flags_note(&a, &p).expect("a note");
        assert!(note.contains("--top-p, --min-p") && note.contains("--temperature"), "{note}");
        let sampled = SamplingArgs { temperature: Some(0.5), ..a };
        assert_eq!(ignored_flags_note(&sampled, &resolve(&sampled, &GenerationDefaults::default(), seven)), None);
    }
}
