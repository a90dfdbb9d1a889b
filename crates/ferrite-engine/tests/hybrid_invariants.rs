//! Engine invariants on the hybrid linear-attention fixtures on the CPU executor
//! (`common::hybrid` says which; `cuda_hybrid` runs them on the GPU).

mod common;

use common::hybrid;
use ferrite_runtime::cuda::DeviceChoice;

#[test]
fn chunked_prefill_equals_whole_prefill() {
    hybrid::chunked_prefill_equals_whole_prefill(DeviceChoice::Cpu);
}

#[test]
fn prefix_hit_equals_cold_run() {
    hybrid::prefix_hit_equals_cold_run(DeviceChoice::Cpu);
}

#[test]
fn batched_equals_alone() {
    hybrid::batched_equals_alone(DeviceChoice::Cpu);
}

#[test]
fn speculation_and_fill_equal_plain_decoding_at_temperature_0() {
    hybrid::speculation_and_fill_equal_plain_decoding_at_temperature_0(DeviceChoice::Cpu);
}

#[test]
fn preemption_equals_uninterrupted() {
    hybrid::preemption_equals_uninterrupted(DeviceChoice::Cpu);
}

#[test]
fn n_choices_are_reproducible() {
    hybrid::n_choices_are_reproducible(DeviceChoice::Cpu);
}

#[test]
fn random_arrivals_and_aborts_leak_nothing() {
    hybrid::random_arrivals_and_aborts_leak_nothing(DeviceChoice::Cpu);
}

#[test]
fn host_ram_restores_the_state_snapshot() {
    hybrid::host_ram_restores_the_state_snapshot(DeviceChoice::Cpu);
}

#[test]
fn the_ssd_restores_the_state_snapshot_after_a_restart() {
    hybrid::the_ssd_restores_the_state_snapshot_after_a_restart(DeviceChoice::Cpu);
}

#[test]
fn a_corrupt_snapshot_on_the_ssd_falls_back_to_the_one_before() {
    hybrid::a_corrupt_snapshot_on_the_ssd_falls_back_to_the_one_before(DeviceChoice::Cpu);
}
