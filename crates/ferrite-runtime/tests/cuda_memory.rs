//! Device memory, gated on `FERRITE_TEST_CUDA=1`: `device_memory`, the query `ferrite fit
//! --device cuda` sizes a model by (the device's total agrees with what an opened `Gpu`
//! reports, free is below it and drops by what an allocation takes, and a device past the last
//! one is an error), and whole KV blocks moved between host memory and a device cache.

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

/// Whole blocks saved from and loaded into a device cache (`KvCache::save_blocks` /
/// `load_blocks`, through device staging and `kv_blocks_move`) move exactly their bytes: two
/// KV groups of different layer shapes, more blocks than one staging batch, slots out of
/// order and blocks scattered over the pools; every other pool block keeps its values.
#[test]
fn whole_blocks_move_exactly_between_host_memory_and_a_device_cache() {
    use ferrite_runtime::kv::{KvGroupKind, KvLayerSpec, KvLayout};
    use ferrite_runtime::{BlockMove, KvCache};
    use rand::seq::SliceRandom;
    use rand::Rng;
    let test = "whole_blocks_move_exactly_between_host_memory_and_a_device_cache";
    let Some((gpu, _)) = cuda_common::gpu(test) else { return };
    let mut rng = cuda_common::rng(test);
    let layout = KvLayout {
        groups: vec![KvGroupKind::Full, KvGroupKind::Sliding { window: 8 }],
        layers: vec![
            KvLayerSpec { n_kv_heads: 2, head_dim: 16, group: 0 },
            KvLayerSpec { n_kv_heads: 1, head_dim: 32, group: 1 },
            KvLayerSpec { n_kv_heads: 2, head_dim: 16, group: 0 },
        ],
        states: Vec::new(),
    };
    let blocks = 600;
    let mut kv = KvCache::on_device(gpu, &layout, &[blocks, blocks], 4).unwrap();
    let mut before = Vec::new();
    for i in 0..layout.layers.len() {
        let l = kv.device_layer_mut(i).unwrap();
        let n = l.k.data.len() / 2;
        let (k, _) = cuda_common::rand_bf16(&mut rng, n, 1.0);
        let (v, _) = cuda_common::rand_bf16(&mut rng, n, 1.0);
        cuda_common::fill_pool(gpu, &k, &mut l.k);
        cuda_common::fill_pool(gpu, &v, &mut l.v);
        before.push((k, v));
    }
    let slots = 700;
    let mut host = kv.host_blocks(slots).unwrap();
    let payload: Vec<Vec<u8>> = (0..slots).map(|_| (0..kv.block_bytes()).map(|_| rng.random()).collect()).collect();
    for (s, p) in payload.iter().enumerate() {
        host.write(s, p).unwrap();
    }
    // 300 blocks of each group (more than one staging batch of 256), scattered, from
    // shuffled slots.
    let mut pool_blocks: Vec<usize> = (0..blocks).collect();
    pool_blocks.shuffle(&mut rng);
    let mut slot_order: Vec<usize> = (0..slots).collect();
    slot_order.shuffle(&mut rng);
    let loaded: Vec<(usize, usize)> =
        pool_blocks[..300].iter().copied().zip(slot_order[..300].iter().copied()).collect();
    let moves: Vec<BlockMove> =
        (0..2).flat_map(|group| loaded.iter().map(move |&(block, slot)| BlockMove { group, block, slot })).collect();
    kv.load_blocks(&moves, &host).unwrap();
    // Saved back into fresh slots (in one batch, both groups), they are the loaded bytes.
    let back: Vec<BlockMove> = moves
        .iter()
        .map(|m| BlockMove { slot: slot_order[300 + loaded.iter().position(|l| l.0 == m.block).unwrap()], ..*m })
        .collect();
    let mut out = kv.host_blocks(slots).unwrap();
    kv.save_blocks(&back, &mut out).unwrap();
    for (m, b) in moves.iter().zip(&back) {
        let (at, n) = (kv.group_offset(m.group), kv.group_block_bytes(m.group));
        assert_eq!(
            &out.bytes(b.slot).unwrap()[at..at + n],
            &payload[m.slot][at..at + n],
            "group {} block {}",
            m.group,
            m.block
        );
    }
    // The blocks not loaded kept their values.
    kv.fence().unwrap();
    gpu.synchronize().unwrap();
    for (i, spec) in layout.layers.iter().enumerate() {
        let per_block = spec.n_kv_heads * 4 * spec.head_dim;
        let l = kv.device_layer_mut(i).unwrap();
        let (k, v) = (cuda_common::pool_f32(gpu, &l.k), cuda_common::pool_f32(gpu, &l.v));
        let was = |x: &[half::bf16]| cuda_common::to_f32(x);
        for &b in &pool_blocks[300..] {
            let r = b * per_block..(b + 1) * per_block;
            assert_eq!(k[r.clone()], was(&before[i].0[r.clone()]), "layer {i} K block {b}");
            assert_eq!(v[r.clone()], was(&before[i].1[r]), "layer {i} V block {b}");
        }
    }
    println!("TABLE|KV block moves (device staging)|{} blocks each way, bytes exact|||", moves.len());
}
