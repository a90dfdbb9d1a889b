//! Full-precision twin pools of a quantized host KV cache, and the one conversion of a row's
//! blocks into the quantized pools at its delayed start.
//!
//! A row with a delayed quantized start (`--quantized-kv-start N`) keeps f16 KV for its first
//! N positions. Its blocks then live in twin pools beside each layer's own (`LayerKv::full`,
//! f16 whatever the layer's type, with block ids of their own: `full_blocks` per group, none
//! for a recurrent group, whose state slots hold no KV and serve the row on both sides), and
//! the rows of a step say which pools their block ids index (`RowSpan::full_precision`); a
//! step's writes and attention read each row's own pools, so rows before and after their
//! transition share a batch. When the row passes N its blocks are converted once
//! (`convert_blocks`): each value is stored as a write of its f16 value would store it (the
//! same codes as quantize-on-write of the f16-rounded value, a key less the layer's key
//! offset), so a row that turned during
//! decode holds exactly what a fresh prefill that turned at N holds. The engine then releases
//! the twin blocks.
//!
//! A device cache has no twin pools yet: `add_full_precision` refuses it, naming the missing
//! conversion kernel (the same `(group, [(from, to)])` interface fits a CUDA kernel that
//! quantizes given bf16 blocks into given quantized blocks).

use half::f16;

use crate::error::{Result, RuntimeError};
use crate::kv::{KvCache, KvDtype, KvPool, LayerKv, Storage};

impl KvCache {
    /// Give every layer f16 twin pools of `group_blocks[g]` blocks in group `g`; a recurrent
    /// group (state slots, no KV layer) takes 0: its state holds no quantized KV. An error for
    /// a device cache, for a cache that has them already, or for counts per group that do not
    /// match the layout.
    pub fn add_full_precision(&mut self, group_blocks: &[usize]) -> Result<()> {
        let groups = self.group_blocks().len();
        let Storage::Host(layers) = &mut self.storage else {
            return Err(RuntimeError::Unsupported(
                "a delayed quantized KV start (--quantized-kv-start) runs on the CPU only so far: the GPU has no \
                 kernel converting full-precision blocks into quantized ones"
                    .into(),
            ));
        };
        let has_kv = |g: usize| layers.iter().any(|l| l.spec.group == g);
        if group_blocks.len() != groups || (0..groups).any(|g| (group_blocks[g] > 0) != has_kv(g)) {
            return Err(RuntimeError::Shape(format!(
                "full-precision KV pools need blocks for each of {groups} groups but a recurrent one's, got \
                 {group_blocks:?}"
            )));
        }
        if !self.full_blocks.is_empty() {
            return Err(RuntimeError::Shape("the KV cache has full-precision pools already".into()));
        }
        let bs = self.block_size;
        for l in layers.iter_mut() {
            let n = group_blocks[l.spec.group] * bs * l.spec.n_kv_heads * l.spec.head_dim;
            let pool = || KvPool::zeroed(KvDtype::F16, n);
            l.full = Some(Box::new(LayerKv::new(l.spec, pool(), pool())));
        }
        self.full_blocks = group_blocks.to_vec();
        Ok(())
    }

    /// Blocks per group of the full-precision twin pools (empty without them).
    pub fn full_precision_blocks(&self) -> &[usize] {
        &self.full_blocks
    }

    /// For each `(from, to)` of `moves`: block `to` of `group` in the cache's own pools takes
    /// the values of block `from` of the twin pools, stored as a write of them would store
    /// them (quantized from their f16 values in a quantized layer, copied in an f16 one).
    pub fn convert_blocks(&mut self, group: usize, moves: &[(u32, u32)]) -> Result<()> {
        let full = self.full_blocks.get(group).copied().unwrap_or(0);
        for &(from, to) in moves {
            self.check_block(group, to as usize)?;
            if from as usize >= full {
                return Err(RuntimeError::Shape(format!(
                    "full-precision KV block {from} of group {group} does not exist"
                )));
            }
        }
        let bs = self.block_size;
        let Storage::Host(layers) = &mut self.storage else {
            return Err(RuntimeError::Unsupported("full-precision KV blocks on a device".into()));
        };
        let mut values = Vec::new();
        for l in layers.iter_mut().filter(|l| l.spec.group == group) {
            let Some(twin) = l.full.take() else {
                return Err(RuntimeError::Shape("a KV layer without full-precision pools".into()));
            };
            let result = moves.iter().try_for_each(|&(from, to)| -> Result<()> {
                let (src, dst) = (twin.block_range(bs, from as usize), l.block_range(bs, to as usize));
                l.populate_to(dst.end);
                widen(&twin.k, src.clone(), &mut values)?;
                if let (Some(mu), KvPool::Quant(_)) = (&l.key_offset, &l.k) {
                    // `[kv_head][slot][head_dim]`: value j is channel j % hd of head j / (bs · hd).
                    let hd = l.spec.head_dim;
                    values.iter_mut().enumerate().for_each(|(j, x)| *x -= mu[j / (bs * hd) * hd + j % hd]);
                }
                store(&mut l.k, dst.start, &values)?;
                widen(&twin.v, src, &mut values)?;
                store(&mut l.v, dst.start, &values)
            });
            l.full = Some(twin);
            result?;
        }
        Ok(())
    }
}

/// `out` = the values `range` of an f16 twin pool, as f32.
fn widen(pool: &KvPool, range: std::ops::Range<usize>, out: &mut Vec<f32>) -> Result<()> {
    let KvPool::F16(v) = pool else {
        return Err(RuntimeError::Shape("a full-precision KV pool that is not f16".into()));
    };
    out.clear();
    out.extend(v[range].iter().map(|x| x.to_f32()));
    Ok(())
}

/// Store `values` at `off` in `pool` as a KV write would (rounded to its type).
fn store(pool: &mut KvPool, off: usize, values: &[f32]) -> Result<()> {
    let outside = || RuntimeError::Shape(format!("KV conversion: values at {off} are outside the cache"));
    match pool {
        KvPool::F32(p) => p.get_mut(off..off + values.len()).ok_or_else(outside)?.copy_from_slice(values),
        KvPool::F16(p) => {
            let dst = p.get_mut(off..off + values.len()).ok_or_else(outside)?;
            dst.iter_mut().zip(values).for_each(|(d, &x)| *d = f16::from_f32(x));
        }
        KvPool::Quant(q) => {
            if !q.write(off, values) {
                return Err(outside());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use half::f16;

    use crate::kv::{KvDtype, KvGroupKind, KvLayerSpec, KvLayout, KvPool, KvScheme, KvSkip};
    use crate::KvCache;

    /// A converted block holds what writing its f16 values into the quantized pool holds (keys
    /// less the layer's key offset), in every layer (an f16 layer kept by
    /// `--kv-cache-skip-layers` gets a copy), and nothing else moves.
    #[test]
    fn a_converted_block_holds_what_a_write_of_its_f16_values_holds() {
        let layout = KvLayout {
            groups: vec![KvGroupKind::Full],
            layers: vec![KvLayerSpec { n_kv_heads: 2, head_dim: 32, group: 0 }; 2],
            states: Vec::new(),
        };
        let scheme = KvScheme { dtype: KvDtype::Int8 { group: 16 }, skip: KvSkip::List(vec![1]) };
        let mut kv = KvCache::with_scheme(&layout, &[3], 4, &scheme).unwrap();
        assert!(kv.convert_blocks(0, &[(0, 0)]).is_err(), "no twin pools yet");
        kv.add_full_precision(&[2]).unwrap();
        assert!(kv.add_full_precision(&[2]).is_err());
        let n = 4 * 2 * 32;
        let values: Vec<f32> = (0..2 * n).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.173).collect();
        for i in 0..2 {
            let l = kv.layer_mut(i).unwrap();
            let twin = l.full.as_mut().unwrap();
            for pool in [&mut twin.k, &mut twin.v] {
                let KvPool::F16(p) = pool else { panic!("twin pools are f16") };
                p.iter_mut().zip(&values).for_each(|(d, &x)| *d = f16::from_f32(x));
            }
        }
        // Layer 0's keys are stored less an offset per head and channel; layer 1 is f16 and
        // keeps none.
        let mu: Vec<f32> = (0..2 * 32).map(|i| (i % 7) as f32 * 3.5 - 9.0).collect();
        kv.set_key_offsets(&[Some(mu.clone()), Some(mu.clone())]).unwrap();
        assert!(kv.layer_mut(1).unwrap().key_offset.is_none());
        kv.convert_blocks(0, &[(1, 2)]).unwrap();
        let rounded: Vec<f32> = values[n..].iter().map(|&x| f16::from_f32(x).to_f32()).collect();
        // Block layout `[head][slot][head_dim]`: value j is channel j % 32 of head j / (4 · 32).
        let shifted: Vec<f32> = rounded.iter().enumerate().map(|(j, x)| x - mu[j / 128 * 32 + j % 32]).collect();
        let written = |values: &[f32]| {
            let mut pool = KvPool::zeroed(KvDtype::Int8 { group: 16 }, 3 * n);
            let KvPool::Quant(q) = &mut pool else { unreachable!() };
            assert!(q.write(2 * n, values));
            pool.to_f32()
        };
        let l0 = kv.layer_mut(0).unwrap();
        assert_eq!(l0.k.to_f32(), written(&shifted));
        assert_eq!(l0.v.to_f32(), written(&rounded));
        let l1 = kv.layer_mut(1).unwrap().k.to_f32();
        assert_eq!(l1[2 * n..], rounded[..]);
        assert!(l1[..2 * n].iter().all(|&x| x == 0.0), "other blocks are untouched");
        assert!(kv.convert_blocks(0, &[(2, 0)]).is_err(), "twin block 2 does not exist");
        assert!(kv.convert_blocks(0, &[(0, 3)]).is_err(), "block 3 does not exist");
    }

    /// A recurrent group (no KV layer) takes no twin blocks; every group with KV layers does.
    #[test]
    fn a_recurrent_group_gets_no_twins() {
        let layout = KvLayout {
            groups: vec![KvGroupKind::Full, KvGroupKind::Recurrent],
            layers: vec![KvLayerSpec { n_kv_heads: 2, head_dim: 32, group: 0 }],
            states: Vec::new(),
        };
        let scheme = KvScheme { dtype: KvDtype::Int8 { group: 16 }, skip: KvSkip::None };
        let mut kv = KvCache::with_scheme(&layout, &[3, 2], 4, &scheme).unwrap();
        assert!(kv.add_full_precision(&[2, 1]).is_err(), "twins for state slots");
        assert!(kv.add_full_precision(&[0, 0]).is_err(), "no twins for the KV layers");
        assert!(kv.add_full_precision(&[2]).is_err(), "a count per group");
        kv.add_full_precision(&[2, 0]).unwrap();
        assert_eq!(kv.full_precision_blocks(), &[2, 0]);
        assert!(kv.convert_blocks(1, &[]).is_ok(), "nothing to convert in the recurrent group");
    }
}
