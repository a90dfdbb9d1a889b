//! The hybrid linear-attention fixture qwen3_5 (gated DeltaNet layers with their recurrent
//! state in the device KV cache, gated attention outputs) on the GPU, gated by
//! `FERRITE_TEST_CUDA=1`: the engine invariants of `common::hybrid` (chunked prefill == whole,
//! prefix hit == cold, speculative decoding and fill == plain at temperature 0, batched ==
//! alone, preempted == uninterrupted, no leak, a prefix restored with its state snapshot from
//! host RAM or the SSD == cold) with the model on CUDA device 0, two runs parting only at near
//! ties. (qwen3_next routes near ties its state keeps, so `cuda_goldens` measures it; that
//! test also compares both hybrids' logits and greedy tokens with the CPU's and transformers',
//! and graph replay with eager decode.) Prefills of `DELTA_CHUNK_MIN_TOKENS` tokens or more
//! (the whole 40-token prompt, chunks of 16 and 39, the 100-token shared prompts) run the
//! chunked DeltaNet scan and shorter ones (chunks of 1, 3, 7, decode, verify spans) the
//! sequential kernel, so chunked prefill == whole also holds the two kernels to each other.

mod common;

use common::hybrid;
use common::model::cuda_enabled;
use ferrite_runtime::cuda::ops::DELTA_CHUNK_MIN_TOKENS;
use ferrite_runtime::cuda::DeviceChoice;

// The whole-prompt prefill (40 tokens) and the 16-token chunks take the chunked scan.
const _: () = assert!(DELTA_CHUNK_MIN_TOKENS <= 16, "cuda_hybrid's prefills no longer reach the chunked scan");

#[test]
fn cuda_hybrid_chunked_prefill_equals_whole_prefill() {
    if cuda_enabled("cuda_hybrid_chunked_prefill_equals_whole_prefill") {
        hybrid::chunked_prefill_equals_whole_prefill(DeviceChoice::Cuda(0));
    }
}

#[test]
fn cuda_hybrid_prefix_hit_equals_cold_run() {
    if cuda_enabled("cuda_hybrid_prefix_hit_equals_cold_run") {
        hybrid::prefix_hit_equals_cold_run(DeviceChoice::Cuda(0));
    }
}

#[test]
fn cuda_hybrid_batched_equals_alone() {
    if cuda_enabled("cuda_hybrid_batched_equals_alone") {
        hybrid::batched_equals_alone(DeviceChoice::Cuda(0));
    }
}

#[test]
fn cuda_hybrid_speculation_and_fill_equal_plain_decoding_at_temperature_0() {
    if cuda_enabled("cuda_hybrid_speculation_and_fill_equal_plain_decoding_at_temperature_0") {
        hybrid::speculation_and_fill_equal_plain_decoding_at_temperature_0(DeviceChoice::Cuda(0));
    }
}

#[test]
fn cuda_hybrid_preemption_equals_uninterrupted() {
    if cuda_enabled("cuda_hybrid_preemption_equals_uninterrupted") {
        hybrid::preemption_equals_uninterrupted(DeviceChoice::Cuda(0));
    }
}

#[test]
fn cuda_hybrid_n_choices_are_reproducible() {
    if cuda_enabled("cuda_hybrid_n_choices_are_reproducible") {
        hybrid::n_choices_are_reproducible(DeviceChoice::Cuda(0));
    }
}

#[test]
fn cuda_hybrid_random_arrivals_and_aborts_leak_nothing() {
    if cuda_enabled("cuda_hybrid_random_arrivals_and_aborts_leak_nothing") {
        hybrid::random_arrivals_and_aborts_leak_nothing(DeviceChoice::Cuda(0));
    }
}

#[test]
fn cuda_hybrid_host_ram_restores_the_state_snapshot() {
    if cuda_enabled("cuda_hybrid_host_ram_restores_the_state_snapshot") {
        hybrid::host_ram_restores_the_state_snapshot(DeviceChoice::Cuda(0));
    }
}

#[test]
fn cuda_hybrid_the_ssd_restores_the_state_snapshot_after_a_restart() {
    if cuda_enabled("cuda_hybrid_the_ssd_restores_the_state_snapshot_after_a_restart") {
        hybrid::the_ssd_restores_the_state_snapshot_after_a_restart(DeviceChoice::Cuda(0));
    }
}

#[test]
fn cuda_hybrid_a_corrupt_snapshot_on_the_ssd_falls_back_to_the_one_before() {
    if cuda_enabled("cuda_hybrid_a_corrupt_snapshot_on_the_ssd_falls_back_to_the_one_before") {
        hybrid::a_corrupt_snapshot_on_the_ssd_falls_back_to_the_one_before(DeviceChoice::Cuda(0));
    }
}
