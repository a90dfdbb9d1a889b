//! Accuracy of the fast CPU kernels on real weights: SmolLM2-135M-Instruct (Q4_1 layers, Q8_0
//! embeddings/head), teacher-forced over a public-domain English text of more than 512 tokens.
//!
//! The exact reference path (`KernelMode::Reference`: weights dequantized to f32, f32
//! products) runs the whole text as one prefill and gives the reference next-token
//! distributions. The fast path (`KernelMode::Auto`) runs it twice: as one prefill (f32 panels
//! over exactly dequantized weights) and token by token (8-bit activations, integer block
//! dot products, split-K decode attention). Each must pick the reference's argmax at ≥ 98 % of
//! positions with a mean KL(reference ‖ fast) ≤ 0.01 nats per token.
//!
//! One test per file: the kernel mode is process-wide.

use ferrite_models::model::{CausalLm, Pending, Want};
use ferrite_models::{paths, registry};
use ferrite_runtime::batch::RowLogits;
use ferrite_runtime::cpu::{set_kernel_mode, KernelMode};
use ferrite_runtime::{ForwardBatch, KvCache};

/// The Declaration of Independence (1776), opening, and the Gettysburg Address (1863).
const TEXT: &str = "When in the Course of human events, it becomes necessary for one people to dissolve the \
political bands which have connected them with another, and to assume among the powers of the earth, the \
separate and equal station to which the Laws of Nature and of Nature's God entitle them, a decent respect to \
the opinions of mankind requires that they should declare the causes which impel them to the separation.

We hold these truths to be self-evident, that all men are created equal, that they are endowed by their \
Creator with certain unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness. \
That to secure these rights, Governments are instituted among Men, deriving their just powers from the \
consent of the governed, That whenever any Form of Government becomes destructive of these ends, it is the \
Right of the People to alter or to abolish it, and to institute new Government, laying its foundation on \
such principles and organizing its powers in such form, as to them shall seem most likely to effect their \
Safety and Happiness. Prudence, indeed, will dictate that Governments long established should not be changed \
for light and transient causes; and accordingly all experience hath shewn, that mankind are more disposed to \
suffer, while evils are sufferable, than to right themselves by abolishing the forms to which they are \
accustomed. But when a long train of abuses and usurpations, pursuing invariably the same Object evinces a \
design to reduce them under absolute Despotism, it is their right, it is their duty, to throw off such \
Government, and to provide new Guards for their future security. Such has been the patient sufferance of \
these Colonies; and such is now the necessity which constrains them to alter their former Systems of \
Government. The history of the present King of Great Britain is a history of repeated injuries and \
usurpations, all having in direct object the establishment of an absolute Tyranny over these States. To \
prove this, let Facts be submitted to a candid world.

Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in \
Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great \
civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. We \
are met on a great battle-field of that war. We have come to dedicate a portion of that field, as a final \
resting place for those who here gave their lives that that nation might live. It is altogether fitting \
and proper that we should do this. But, in a larger sense, we can not dedicate, we can not consecrate, we \
can not hallow this ground. The brave men, living and dead, who struggled here, have consecrated it, far \
above our poor power to add or detract. The world will little note, nor long remember what we say here, \
but it can never forget what they did here. It is for us the living, rather, to be dedicated here to the \
unfinished work which they who fought here have thus far so nobly advanced. It is rather for us to be \
here dedicated to the great task remaining before us, that from these honored dead we take increased \
devotion to that cause for which they gave the last full measure of devotion, that we here highly resolve \
that these dead shall not have died in vain, that this nation, under God, shall have a new birth of \
freedom, and that government of the people, by the people, for the people, shall not perish from the earth.";

const BLOCK: usize = 16;

fn cache(model: &dyn CausalLm, positions: usize) -> (KvCache, Vec<Vec<u32>>) {
    let layout = model.kv_layout();
    let blocks = positions.div_ceil(BLOCK);
    let kv = KvCache::new(&layout, &vec![blocks; layout.groups.len()], BLOCK).expect("kv cache");
    let tables = vec![(0..blocks as u32).collect(); layout.groups.len()];
    (kv, tables)
}

/// Logits after every token, from one forward over the whole text.
fn prefill(model: &dyn CausalLm, tokens: &[u32]) -> Vec<f32> {
    let (mut kv, tables) = cache(model, tokens.len());
    let mut batch = ForwardBatch::default();
    batch.push_row(tokens, tokens.len(), tables, RowLogits::All);
    model.step(&batch, &mut kv, Want::Logits).and_then(Pending::logits).expect("forward")
}

/// Logits after every token, one decode step per token.
fn decode(model: &dyn CausalLm, tokens: &[u32]) -> Vec<f32> {
    let (mut kv, tables) = cache(model, tokens.len());
    let mut logits = Vec::new();
    for (i, &t) in tokens.iter().enumerate() {
        let mut batch = ForwardBatch::default();
        batch.push_row(&[t], i + 1, tables.clone(), RowLogits::Last);
        logits.extend(model.step(&batch, &mut kv, Want::Logits).and_then(Pending::logits).expect("forward"));
    }
    logits
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    x.iter().map(|&v| v as f64 - lse).collect()
}

fn argmax(x: &[f32]) -> usize {
    x.iter().enumerate().fold(0, |best, (i, &v)| if v > x[best] { i } else { best })
}

/// (argmax agreement, mean KL(reference ‖ fast) in nats) over all positions.
fn compare(reference: &[f32], fast: &[f32], vocab: usize) -> (f64, f64) {
    let (mut agree, mut kl) = (0usize, 0f64);
    let positions = reference.len() / vocab;
    for (r, f) in reference.chunks_exact(vocab).zip(fast.chunks_exact(vocab)) {
        agree += usize::from(argmax(r) == argmax(f));
        let (lr, lf) = (log_softmax(r), log_softmax(f));
        kl += lr.iter().zip(&lf).map(|(a, b)| a.exp() * (a - b)).sum::<f64>();
    }
    (agree as f64 / positions as f64, kl / positions as f64)
}

#[test]
fn fast_kernels_match_the_reference_on_smollm2() {
    let path = registry::resolve("smollm2", &paths::models_dir()).expect("smollm2 (run `ferrite pull smollm2`)");
    let loaded = ferrite_models::load(&path).expect("load");
    let tokens = loaded.tokenizer.as_ref().expect("tokenizer").encode(TEXT, true).expect("encode");
    assert!(tokens.len() >= 512, "only {} tokens", tokens.len());
    let model = loaded.model.as_ref();
    let vocab = model.config().vocab_size;

    set_kernel_mode(KernelMode::Reference);
    let reference = prefill(model, &tokens);
    set_kernel_mode(KernelMode::Auto);
    let level = KernelMode::Auto.level().map_or("reference", |l| l.name());
    for (how, fast) in [("prefill", prefill(model, &tokens)), ("decode", decode(model, &tokens))] {
        let (agree, kl) = compare(&reference, &fast, vocab);
        println!(
            "smollm2 {how} ({level}) vs reference over {} tokens: argmax agreement {:.2} %, mean KL {kl:.2e} nats",
            tokens.len(),
            100.0 * agree
        );
        assert!(agree >= 0.98, "{how}: argmax agreement {agree}");
        assert!(kl <= 0.01, "{how}: mean KL {kl}");
    }
}
