//! `GpuLlama`: the llama family (llama, mistral, qwen2; SmolLM2, Llama 3.x, Qwen 2.5 shapes)
//! on one CUDA device, behind the same `CausalLm` interface as the CPU model.
//!
//! A step is: embedding gather → per layer [RMSNorm (fused with the residual add) → fused
//! QKV GEMM (+bias) → RoPE on q and k in place with the KV write (one kernel) → paged
//! attention (in decode, one kernel: the attention rotates q and the new key and stores K and
//! V itself) → output GEMM → RMSNorm + residual → fused gate-up GEMM → SwiGLU (one kernel in
//! decode) → down GEMM] → final norm → gather of the rows that want logits → LM head GEMM (f32
//! logits) → argmax, or after the step the rows' own sampling (`forward_sampled`: logit edits,
//! temperature, top-k/top-p/min-p, log-probabilities). Activations are bf16, every kernel
//! computes in f32, GEMMs accumulate in f32.
//!
//! All buffers of a step live in a `Workspace` sized once from the engine's `StepLimits`, so
//! the decode loop allocates nothing. Pure decode steps (one query token per row, logits for
//! every row) replay a CUDA graph captured per (row bucket, context bucket): the rows are
//! padded to the bucket with empty rows, block tables are padded to the context bucket, and
//! the split-K plan covers it. Other steps (prefill chunks, mixed batches) run eagerly.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ferrite_runtime::cpu::AttentionParams;
use ferrite_runtime::cuda::ops::{
    self, AttentionMeta, DecodePlan, DecodeScratch, GatedActivation, RopeShape, SampledDev, SamplingParamsDev,
};
use ferrite_runtime::cuda::{CudaSlice, CudaView, DevicePtr, Gpu, Graph};
use ferrite_runtime::sampling::{LogitEdit, RowSampler, RowSampling, SampledToken};
use ferrite_runtime::{ForwardBatch, KvCache, KvGroupKind, KvLayout, Result as RtResult, RuntimeError};
use half::bf16;

use super::weights::{qkv_rows, LlamaWeights};
use crate::config::{Activation, ModelConfig};
use crate::error::{LoadError, Result};
use crate::model::{CausalLm, StepLimits};

/// Row counts a decode graph is captured for; larger decode steps run eagerly.
const ROW_BUCKETS: [usize; 19] = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512];
/// The smallest context bucket of a decode graph (contexts round up to a power of two).
const MIN_CONTEXT_BUCKET: usize = 256;

pub struct GpuLlama {
    cfg: ModelConfig,
    layout: KvLayout,
    params: AttentionParams,
    act: GatedActivation,
    gpu: Arc<Gpu>,
    w: LlamaWeights,
    inv_freq: CudaSlice<f32>,
    rope_scaling: f32,
    graphs_enabled: AtomicBool,
    device_sampling: AtomicBool,
    state: Mutex<State>,
}

/// What a step needs besides the weights; behind a lock because `forward` takes `&self`.
struct State {
    ws: Option<Workspace>,
    /// Captured decode graphs by (rows, context bucket).
    graphs: HashMap<(usize, usize), Graph>,
    /// The KV cache the graphs write (`KvCache::id`): another cache means capturing again.
    graph_kv: u64,
}

/// Every activation buffer of a step, sized for the largest step.
struct Workspace {
    tokens: usize,
    rows: usize,
    /// Block-table entries a row can have.
    blocks: usize,
    /// A step's token ids, positions and logits rows, one copy: `[tokens | tokens | rows]`
    /// for the step's (padded) token count (see `step_inputs`).
    inputs: CudaSlice<u32>,
    /// The residual stream `[tokens, hidden]`.
    x: CudaSlice<bf16>,
    /// Normed activations `[tokens, hidden]`.
    h: CudaSlice<bf16>,
    qkv: CudaSlice<bf16>,
    attn: CudaSlice<bf16>,
    /// Output of a block (attention or MLP) before its residual add.
    o: CudaSlice<bf16>,
    gate_up: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    /// The gathered rows that want logits `[rows, hidden]`, their f32 logits and argmax.
    picked: CudaSlice<bf16>,
    logits: CudaSlice<f32>,
    next: CudaSlice<u32>,
    meta: AttentionMeta,
    scratch: DecodeScratch,
    /// Device sampling: the rows' parameters and edits in, the picks out (grown, by
    /// doubling, to the most edits and alternatives a step has asked for).
    sampling: SamplingParamsDev,
    sampled: SampledDev,
}

impl Workspace {
    fn new(gpu: &Gpu, cfg: &ModelConfig, tokens: usize, rows: usize, max_blocks: usize) -> RtResult<Workspace> {
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        let rows = rows.max(1);
        let tokens = tokens.max(rows);
        let bf = |n: usize| gpu.alloc::<bf16>(n);
        Ok(Workspace {
            tokens,
            rows,
            blocks: max_blocks,
            inputs: gpu.alloc(2 * tokens + rows)?,
            x: bf(tokens * d)?,
            h: bf(tokens * d)?,
            qkv: bf(tokens * qkv_rows(cfg))?,
            attn: bf(tokens * cfg.num_heads * hd)?,
            o: bf(tokens * d)?,
            gate_up: bf(tokens * 2 * cfg.intermediate_size)?,
            act: bf(tokens * cfg.intermediate_size)?,
            picked: bf(rows * d)?,
            logits: gpu.alloc(rows * cfg.vocab_size)?,
            next: gpu.alloc(rows)?,
            meta: AttentionMeta::with_capacity(gpu, rows, tokens, max_blocks)?,
            scratch: DecodeScratch::new(gpu, rows, cfg.num_heads, hd, 1)?,
            sampling: SamplingParamsDev::with_capacity(gpu, rows, 0)?,
            sampled: SampledDev::new(gpu, rows)?,
        })
    }
}

/// Why a config cannot run on this path, if it cannot.
pub fn unsupported(cfg: &ModelConfig) -> Option<String> {
    use crate::config::Architecture as A;
    if !matches!(cfg.arch, A::Llama | A::Mistral | A::Qwen2) {
        return Some(format!("the {} architecture has no CUDA path yet", cfg.arch.name()));
    }
    if cfg.qk_norm {
        return Some("q/k norms have no CUDA path yet".into());
    }
    if cfg.rope.is_dynamic() {
        return Some("dynamic NTK RoPE has no CUDA path yet".into());
    }
    if ![64, 128, 256].contains(&cfg.head_dim) {
        return Some(format!("head_dim {} has no CUDA attention kernel (64, 128, 256)", cfg.head_dim));
    }
    None
}

impl GpuLlama {
    /// A model of `cfg` with weights `w` already on `gpu`.
    pub fn new(cfg: ModelConfig, w: LlamaWeights, gpu: Arc<Gpu>) -> Result<GpuLlama> {
        if let Some(why) = unsupported(&cfg) {
            return Err(LoadError::Other(why));
        }
        let kind = match cfg.sliding_window {
            Some(window) => KvGroupKind::Sliding { window },
            None => KvGroupKind::Full,
        };
        let layout = KvLayout::uniform(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kind);
        let params = AttentionParams {
            n_heads: cfg.num_heads,
            n_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
            window: cfg.sliding_window,
            softcap: None,
        };
        let rope = cfg.rope.rope_for(0);
        let act = match cfg.hidden_act {
            Activation::Silu => GatedActivation::Silu,
            Activation::GeluTanh => GatedActivation::GeluTanh,
        };
        Ok(GpuLlama {
            layout,
            params,
            act,
            inv_freq: gpu.upload(&rope.inv_freq)?,
            rope_scaling: rope.attention_scaling,
            graphs_enabled: AtomicBool::new(true),
            device_sampling: AtomicBool::new(true),
            state: Mutex::new(State { ws: None, graphs: HashMap::new(), graph_kv: 0 }),
            cfg,
            w,
            gpu,
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Device bytes of the weights.
    pub fn weight_bytes(&self) -> usize {
        self.w.bytes
    }

    /// Replay CUDA graphs for decode steps (the default) or run every step eagerly.
    pub fn set_cuda_graphs(&self, on: bool) {
        self.graphs_enabled.store(on, Ordering::Relaxed);
    }

    /// Sample on the device (the default) or hand the engine logits to sample on the host.
    pub fn set_device_sampling(&self, on: bool) {
        self.device_sampling.store(on, Ordering::Relaxed);
    }

    fn lock(&self) -> RtResult<std::sync::MutexGuard<'_, State>> {
        self.state.lock().map_err(|_| RuntimeError::Shape("the CUDA model's state was poisoned by a panic".into()))
    }

    /// Block-table entries per row for contexts up to `context` (its bucket).
    fn table_len(context: usize, block_size: usize) -> usize {
        context_bucket(context).div_ceil(block_size.max(1))
    }

    /// A workspace for steps of `tokens` tokens, `rows` rows and `blocks` table entries a
    /// row (at least), replacing a smaller one (which drops the graphs captured over it).
    fn ensure(&self, st: &mut State, tokens: usize, rows: usize, blocks: usize) -> RtResult<()> {
        let (t0, r0, b0) = st.ws.as_ref().map_or((0, 0, 0), |w| (w.tokens, w.rows, w.blocks));
        if tokens <= t0 && rows <= r0 && blocks <= b0 {
            return Ok(());
        }
        st.graphs.clear();
        st.ws = None;
        self.gpu.synchronize()?;
        let ws = Workspace::new(&self.gpu, &self.cfg, tokens.max(t0), rows.max(r0), blocks.max(b0))?;
        st.ws = Some(ws);
        Ok(())
    }

    /// Queue one step over the inputs already in `ws` (`tokens` query tokens, `out_rows`
    /// rows wanting logits): the layers, the LM head and the argmax. `plan` is given for a
    /// decode step (one query token a row): its attention uses that split (a graph's fixed
    /// one) and rotates q and the new keys itself.
    fn queue_step(
        &self,
        ws: &mut Workspace,
        kv: &mut KvCache,
        tokens: usize,
        out_rows: usize,
        plan: Option<DecodePlan>,
    ) -> RtResult<()> {
        let gpu = &*self.gpu;
        let cfg = &self.cfg;
        let (d, v, inter) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let (q_w, qkv_w) = (nh * hd, qkv_rows(cfg));
        let eps = cfg.rms_norm_eps;
        let [ids, positions, logit_rows] = step_inputs(&ws.inputs, tokens, out_rows)?;
        ops::embedding(gpu, &*self.w.embed, (v, d), &ids, tokens, 1.0, &mut ws.x)?;
        for (i, l) in self.w.layers.iter().enumerate() {
            if i == 0 {
                ops::rms_norm(gpu, &ws.x, None, &l.attn_norm, (tokens, d), eps, 0.0, &mut ws.h)?;
            } else {
                ops::rms_norm(gpu, &ws.o, Some(&mut ws.x), &l.attn_norm, (tokens, d), eps, 0.0, &mut ws.h)?;
            }
            let bias = l.qkv_bias.as_ref().map(|b| b as &dyn DevicePtr<bf16>);
            ops::linear(gpu, &ws.h, &l.qkv, bias, &mut ws.qkv, (tokens, qkv_w, d))?;
            let layer_kv = kv.device_layer_mut(i)?;
            let p = &self.params;
            if let Some(plan) = plan {
                // Decode: the attention kernel rotates q and the new keys and stores K and V.
                let rope = (&self.inv_freq, self.rope_scaling);
                let (meta, scratch) = (&ws.meta, &mut ws.scratch);
                ops::decode_attention_rope(
                    gpu,
                    &ws.qkv,
                    qkv_w,
                    meta,
                    layer_kv,
                    p,
                    rope,
                    plan,
                    scratch,
                    &mut ws.attn,
                    q_w,
                )?;
            } else {
                let shape = RopeShape { tokens, n_heads: nh + nkv, head_dim: hd, stride: qkv_w };
                let store = Some((&ws.meta, &mut *layer_kv));
                ops::rope(gpu, &mut ws.qkv, &positions, &self.inv_freq, self.rope_scaling, shape, store)?;
                ops::attention(gpu, &ws.qkv, qkv_w, &ws.meta, layer_kv, p, None, &mut ws.scratch, &mut ws.attn, q_w)?;
            }
            ops::linear(gpu, &ws.attn, &l.o, None, &mut ws.o, (tokens, d, q_w))?;
            ops::rms_norm(gpu, &ws.o, Some(&mut ws.x), &l.ffn_norm, (tokens, d), eps, 0.0, &mut ws.h)?;
            ops::linear_gated(gpu, self.act, &ws.h, &l.gate_up, &mut ws.gate_up, &mut ws.act, (tokens, inter, d))?;
            ops::linear(gpu, &ws.act, &l.down, None, &mut ws.o, (tokens, d, inter))?;
        }
        if out_rows == 0 {
            // A prefill chunk that ends no prompt: only its KV was wanted.
            return Ok(());
        }
        ops::rms_norm(gpu, &ws.o, Some(&mut ws.x), &self.w.final_norm, (tokens, d), eps, 0.0, &mut ws.h)?;
        // The rows that want logits, gathered by the embedding kernel over the normed rows.
        ops::embedding(gpu, &ws.h, (tokens, d), &logit_rows, out_rows, 1.0, &mut ws.picked)?;
        ops::linear::<f32>(gpu, &ws.picked, &*self.w.lm_head, None, &mut ws.logits, (out_rows, v, d))?;
        ops::argmax(gpu, &ws.logits, (out_rows, v, v), &mut ws.next)?;
        Ok(())
    }

    /// Copy the step's inputs into `ws`: ids and positions padded to `rows` one-token rows
    /// when the batch has fewer (a graph bucket), the logits rows, and the attention
    /// metadata (tables `stride` apart when given).
    fn upload_inputs(
        &self,
        ws: &mut Workspace,
        batch: &ForwardBatch,
        block_size: usize,
        rows: usize,
        stride: Option<usize>,
    ) -> RtResult<()> {
        let gpu = &*self.gpu;
        let pad = rows.saturating_sub(batch.rows.len());
        let tokens = batch.num_tokens() + pad;
        let mut host = Vec::with_capacity(2 * tokens + batch.logits_indices.len() + pad);
        for v in [&batch.tokens, &batch.positions] {
            host.extend_from_slice(v);
            host.resize(host.len() + pad, 0);
        }
        host.extend(batch.logits_indices.iter().map(|&i| i as u32));
        host.extend((batch.num_tokens()..tokens).map(|i| i as u32));
        gpu.upload_into(&host, &mut ws.inputs)?;
        ws.meta.update(gpu, batch, 0, block_size, rows, stride)?;
        Ok(())
    }

    /// A scratch for a decode step of `rows` rows in `plan`'s splits (a larger one drops the
    /// graphs captured over the old).
    fn ensure_scratch(&self, st: &mut State, rows: usize, plan: DecodePlan) -> RtResult<()> {
        let cfg = &self.cfg;
        let ws = st.ws.as_mut().ok_or_else(no_workspace)?;
        if !ws.scratch.fits(rows, cfg.num_heads, cfg.head_dim, plan.splits) {
            st.graphs.clear();
            ws.scratch = DecodeScratch::new(&self.gpu, rows, cfg.num_heads, cfg.head_dim, plan.splits)?;
        }
        Ok(())
    }

    fn run_eager(&self, st: &mut State, batch: &ForwardBatch, kv: &mut KvCache) -> RtResult<()> {
        let rows = batch.rows.len();
        let ws = st.ws.as_mut().ok_or_else(no_workspace)?;
        self.upload_inputs(ws, batch, kv.block_size(), rows, None)?;
        // Decode splits keys as a graph of the same rows would, so both give the same bits.
        let plan = if ws.meta.max_query <= 1 {
            let plan = DecodePlan::new(&self.gpu, rows, &self.params, context_bucket(ws.meta.max_context));
            self.ensure_scratch(st, rows, plan)?;
            Some(plan)
        } else {
            None
        };
        let ws = st.ws.as_mut().ok_or_else(no_workspace)?;
        self.queue_step(ws, kv, batch.num_tokens(), batch.logits_indices.len(), plan)
    }

    /// A pure decode step of `batch` padded to `bucket` rows, by graph replay (captured on
    /// first use of its (bucket, context bucket)).
    fn run_graph(&self, st: &mut State, batch: &ForwardBatch, kv: &mut KvCache, bucket: usize) -> RtResult<()> {
        let longest = batch.rows.iter().map(|r| r.context_len).max().unwrap_or(0);
        let context = context_bucket(longest);
        let block_size = kv.block_size();
        let stride = context.div_ceil(block_size);
        if st.graph_kv != kv.id() {
            st.graphs.clear();
            st.graph_kv = kv.id();
        }
        let plan = DecodePlan::new(&self.gpu, bucket, &self.params, context);
        self.ensure_scratch(st, bucket, plan)?;
        let State { ws, graphs, .. } = st;
        let ws = ws.as_mut().ok_or_else(no_workspace)?;
        self.upload_inputs(ws, batch, block_size, bucket, Some(stride))?;
        if let Some(graph) = graphs.get(&(bucket, context)) {
            return Ok(graph.replay()?);
        }
        // First use: run it eagerly (this step's result; it also builds the cuBLASLt plans
        // outside the capture), then capture the same work for the next steps.
        self.queue_step(ws, kv, bucket, bucket, Some(plan))?;
        let graph = self.gpu.capture(|| self.queue_step(ws, kv, bucket, bucket, Some(plan)))?;
        graphs.insert((bucket, context), graph);
        Ok(())
    }

    /// Run `batch`; afterwards the first `logits_indices.len()` rows of the workspace's
    /// `logits` and `next` hold its logits and greedy ids.
    fn run(&self, batch: &ForwardBatch, kv: &mut KvCache) -> RtResult<std::sync::MutexGuard<'_, State>> {
        let (tokens, rows, out_rows) = (batch.num_tokens(), batch.rows.len(), batch.logits_indices.len());
        if tokens == 0 || batch.logits_indices.iter().any(|&i| i >= tokens) {
            return Err(RuntimeError::Shape(format!(
                "a step of {tokens} tokens with logits rows {:?}",
                batch.logits_indices
            )));
        }
        if let Some(&t) = batch.tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(RuntimeError::Shape(format!("token {t} is outside the vocabulary of {}", self.cfg.vocab_size)));
        }
        let longest = batch.rows.iter().map(|r| r.context_len).max().unwrap_or(0);
        let mut st = self.lock()?;
        self.ensure(&mut st, tokens, rows.max(out_rows), Self::table_len(longest, kv.block_size()))?;
        let capacity = st.ws.as_ref().map_or(0, |w| w.rows);
        let decode = self.graphs_enabled.load(Ordering::Relaxed)
            && out_rows == rows
            && batch.rows.iter().all(|r| r.query_len == 1)
            && batch.logits_indices.iter().copied().eq(0..rows);
        match ROW_BUCKETS.iter().copied().find(|&b| b >= rows).filter(|&b| decode && b <= capacity) {
            Some(bucket) => self.run_graph(&mut st, batch, kv, bucket)?,
            None => self.run_eager(&mut st, batch, kv)?,
        }
        Ok(st)
    }
}

/// The ids, positions and logits rows of a step of `tokens` tokens and `out_rows` logits rows
/// in a workspace's `inputs`.
fn step_inputs(inputs: &CudaSlice<u32>, tokens: usize, out_rows: usize) -> RtResult<[CudaView<'_, u32>; 3]> {
    let part = |range: std::ops::Range<usize>| {
        inputs.try_slice(range.clone()).ok_or_else(|| {
            RuntimeError::Shape(format!("step inputs {range:?} outside the workspace's {}", inputs.len()))
        })
    };
    Ok([part(0..tokens)?, part(tokens..2 * tokens)?, part(2 * tokens..2 * tokens + out_rows)?])
}

/// The context a decode plan (and a graph) is built for: `longest` rounded up to a power of
/// two, at least `MIN_CONTEXT_BUCKET`.
fn context_bucket(longest: usize) -> usize {
    longest.max(MIN_CONTEXT_BUCKET).next_power_of_two()
}

fn no_workspace() -> RuntimeError {
    RuntimeError::Shape("the CUDA model has no workspace".into())
}

impl CausalLm for GpuLlama {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn kv_layout(&self) -> KvLayout {
        self.layout.clone()
    }

    fn forward(&self, batch: &ForwardBatch, kv: &mut KvCache) -> RtResult<Vec<f32>> {
        let st = self.run(batch, kv)?;
        let ws = st.ws.as_ref().ok_or_else(no_workspace)?;
        let n = batch.logits_indices.len() * self.cfg.vocab_size;
        if n == 0 {
            // Nothing to copy back: the step stays queued (a later step's copy waits for it).
            return Ok(Vec::new());
        }
        Ok(self.gpu.download(&ws.logits.slice(..n))?)
    }

    fn forward_greedy(&self, batch: &ForwardBatch, kv: &mut KvCache) -> RtResult<Vec<u32>> {
        let st = self.run(batch, kv)?;
        let ws = st.ws.as_ref().ok_or_else(no_workspace)?;
        if batch.logits_indices.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self.gpu.download(&ws.next.slice(..batch.logits_indices.len()))?)
    }

    fn samples_on_device(&self) -> bool {
        self.device_sampling.load(Ordering::Relaxed)
    }

    fn forward_sampled(
        &self,
        batch: &ForwardBatch,
        kv: &mut KvCache,
        rows: &[RowSampler],
    ) -> RtResult<Vec<SampledToken>> {
        let n = batch.logits_indices.len();
        if rows.len() != n {
            return Err(RuntimeError::Shape(format!("{} samplers for {n} logits rows", rows.len())));
        }
        let mut st = self.run(batch, kv)?;
        if n == 0 {
            return Ok(Vec::new());
        }
        let ws = st.ws.as_mut().ok_or_else(no_workspace)?;
        let v = self.cfg.vocab_size;
        let params: Vec<RowSampling> = rows.iter().map(|r| r.params).collect();
        let edits: Vec<(usize, LogitEdit)> =
            rows.iter().enumerate().flat_map(|(i, r)| r.edits.iter().map(move |&e| (i, e))).collect();
        let top: Vec<usize> = rows.iter().map(|r| r.top_logprobs).collect();
        let most = top.iter().copied().max().unwrap_or(0);
        ws.sampling.update(&self.gpu, &params, &edits, most, v)?;
        ops::pick(&self.gpu, &mut ws.logits.slice_mut(..n * v), (v, v), &ws.sampling, &mut ws.sampled)?;
        Ok(ws.sampled.download(&self.gpu, &top)?)
    }

    fn uses_host_pool(&self) -> bool {
        false
    }

    fn prepare(&self, limits: &StepLimits) -> RtResult<()> {
        let mut st = self.lock()?;
        let blocks = Self::table_len(limits.max_model_len, limits.block_size);
        self.ensure(&mut st, limits.max_tokens, limits.max_rows, blocks)
    }

    fn free_kv_memory(&self) -> RtResult<Option<usize>> {
        Ok(Some(self.gpu.memory()?.0))
    }

    fn kv_block_bytes(&self, block_size: usize) -> Vec<usize> {
        self.layout.block_bytes_of(block_size, std::mem::size_of::<bf16>())
    }

    fn new_kv_cache(&self, group_blocks: &[usize], block_size: usize) -> RtResult<KvCache> {
        KvCache::on_device(&self.gpu, &self.layout, group_blocks, block_size)
    }
}
