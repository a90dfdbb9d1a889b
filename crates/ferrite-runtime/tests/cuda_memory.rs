//! `device_memory`, the query `ferrite fit --device cuda` sizes a model by, gated on
//! `FERRITE_TEST_CUDA=1`: the device's total agrees with what an opened `Gpu` reports, free is
//! below it and drops by what an allocation takes, and a device past the last one is an error.

mod cuda_common;

use ferrite_runtime::cuda::{cuda_device_count, device_memory, CudaError};

#[test]
fn device_memory_matches_the_device() {
    let Some((gpu, _)) = cuda_common::gpu("device_memory_matches_the_device") else { return };
    let (free, total) = device_memory(0).unwrap();
    assert_eq!(total, gpu.info().total_memory);
    assert!(free > 0 && free <= total, "{free} of {total}");
    // 1 GiB allocated on the device shows in the next query's free memory (from another context).
    let buf = gpu.alloc::<u8>(1 << 30).unwrap();
    gpu.synchronize().unwrap();
    let (after, _) = device_memory(0).unwrap();
    assert!(after + (1 << 30) <= free + (64 << 20), "free {free} -> {after} after 1 GiB");
    drop(buf);
    let count = cuda_device_count().unwrap();
    assert!(matches!(device_memory(count), Err(CudaError::NoSuchDevice { .. })));
}
