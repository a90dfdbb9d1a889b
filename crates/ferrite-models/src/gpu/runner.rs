//! The step machinery every CUDA model shares, around a family's decoder (`Layers`): the
//! workspace sized once from the engine's `StepLimits`, the per-step inputs and attention
//! metadata (one per KV group) and a family's own per-step inputs, CUDA-graph capture and
//! replay of decode steps, the LM head (gather of the rows that want logits, f32 logits,
//! optional scale and softcap) and the argmax, and the `CausalLm` interface.
//!
//! All buffers of a step live in the workspace, so the decode loop allocates nothing. A
//! uniform step — every row the same number of query tokens (1 to `MAX_GRAPH_QUERY`), logits
//! at every token: pure decode, or speculative and fill verify rows of one proposal length —
//! replays a CUDA graph captured per (`Padding`, context bucket, step variant —
//! `Layers::upload_step`: with LoRA launches or without): the rows are padded to a row bucket
//! with empty rows of the same query length (no context, no KV slot, no state, no adapter;
//! every per-step input is written for the padded shape before the replay), block tables are
//! padded to the context bucket, and decode's split-K plans cover it. Other steps (prefill
//! chunks, mixed batches, verify rows of different lengths, which padding would not make
//! uniform) run eagerly. Decode and verify share this one path; only decode (one query token
//! a row) takes the split-K decode kernel, longer rows the variable-length prefill kernel,
//! eager or replayed alike, so a replay gives the eager step's bits at the same rows.
//!
//! An argmax or sampled step comes back queued (`Pending::is_queued`): its picks are copied
//! into page-locked host memory behind it and read when the handle is resolved, so the
//! engine schedules the next step while the device runs this one. The next step may take its
//! input ids straight from the picks still on the device (`ForwardBatch::carried`), before
//! the host has read them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ferrite_runtime::cpu::AttentionParams;
use ferrite_runtime::cuda::ops::{
    self, ArgmaxScratch, AttentionMeta, DecodePlan, DecodeScratch, Matrix, SampledDev, SamplingParamsDev,
};
use ferrite_runtime::cuda::{CudaSlice, CudaView, Gpu, Graph, HostBuf};
use ferrite_runtime::sampling::{LogitEdit, RowSampler, RowSampling};
use ferrite_runtime::{ForwardBatch, KvCache, KvDtype, KvLayout, KvScheme, Padding, Result as RtResult, RuntimeError};
use half::bf16;

use super::lora::LoraShapes;
use crate::config::ModelConfig;
use crate::error::LoadError;
use crate::lora::LoraAdapter;
use crate::model::{CausalLm, Pending, QueuedStep, StepLimits, StepOutput, Want};

/// Row counts a graph is captured for; larger uniform steps run eagerly.
const ROW_BUCKETS: [usize; 19] = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512];
/// The most query tokens a row of a replayed step has (a verify row: the pending token and 16
/// proposed ones).
pub const MAX_GRAPH_QUERY: usize = 17;
/// The smallest context bucket of a decode graph (contexts round up to a power of two).
const MIN_CONTEXT_BUCKET: usize = 256;

/// A model family's decoder on the device: what the shared runner cannot know.
pub trait Layers: Send + Sync {
    /// The family's activation buffers beyond `StepIo`'s.
    type Buffers: Send;
    fn config(&self) -> &ModelConfig;
    fn layout(&self) -> &KvLayout;
    /// The attention shapes of the layers (decode plans and their scratch cover each).
    fn attention(&self) -> &[AttentionParams];
    /// Buffers for steps of up to `tokens` tokens.
    fn buffers(&self, gpu: &Gpu, tokens: usize) -> RtResult<Self::Buffers>;
    /// Queue the decoder over the inputs in `io` (`tokens` query tokens): from the embedding
    /// to the residual stream after the last layer. With `decode`, attention uses its plans.
    fn queue_layers(
        &self,
        gpu: &Gpu,
        io: &mut StepIo,
        b: &mut Self::Buffers,
        kv: &mut KvCache,
        tokens: usize,
        decode: Option<Decode>,
    ) -> RtResult<()>;
    /// Queue the final norm into `io.h`.
    fn final_norm(&self, gpu: &Gpu, io: &mut StepIo, b: &mut Self::Buffers, tokens: usize) -> RtResult<()>;
    fn lm_head(&self) -> &Matrix;
    /// bf16 values of scratch quantized matrices use in steps of up to `tokens` tokens
    /// (`Matrix::scratch_len`'s most; none when every matrix is bf16).
    fn scratch_len(&self, _tokens: usize) -> usize {
        0
    }
    /// `cap * tanh(logit / cap)` on the logits (Gemma 2+).
    fn final_softcap(&self) -> Option<f32> {
        None
    }
    /// A multiplier of the logits, applied before the softcap (granite).
    fn logit_scale(&self) -> Option<f32> {
        None
    }
    /// Copy what the family's layers read of `batch` beyond `StepIo`'s inputs into `b`, for
    /// `batch` padded as `pad` says (to a graph's shape, with empty rows): before every step,
    /// outside any graph, so a replay reads the step's own values (`kv`: the cache the step
    /// runs on, whose slots a recurrent layer's rows read and write; padding rows touch none).
    /// Returns the step's variant: steps whose layers queue different work (LoRA launches or
    /// none) have different variants and never share a captured graph.
    fn upload_step(
        &self,
        _gpu: &Gpu,
        _b: &mut Self::Buffers,
        _batch: &ForwardBatch,
        _pad: Padding,
        _kv: &KvCache,
    ) -> RtResult<u64> {
        Ok(0)
    }
    /// Attach a LoRA adapter under `id` (`CausalLm::attach_lora`).
    fn attach_lora(&self, _gpu: &Gpu, _id: u32, adapter: &LoraAdapter) -> Result<(), LoadError> {
        Err(LoadError::format(&adapter.path, "this CUDA model runs no LoRA adapters"))
    }
    fn detach_lora(&self, _gpu: &Gpu, _id: u32) {}
    /// (in, out) features of each projection an adapter may adapt (`CausalLm::lora_shapes`).
    fn lora_shapes(&self) -> LoraShapes {
        Vec::new()
    }
    /// Whether a step runs on the device alone (no host round trip), so uniform steps can be
    /// captured as graphs.
    fn graph_safe(&self) -> bool {
        true
    }
}

/// A decode step's shape: every layer plans its split-K from it, the same way for a graph's
/// capture as for an eager step of the same rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decode {
    pub rows: usize,
    /// The context bucket the plan covers.
    pub context: usize,
}

impl Decode {
    pub fn plan(&self, gpu: &Gpu, p: &AttentionParams) -> DecodePlan {
        DecodePlan::new(gpu, self.rows, p, self.context)
    }
}

/// The buffers of a step every family uses, sized for the largest step.
pub struct StepIo {
    pub tokens: usize,
    pub rows: usize,
    /// Block-table entries a row can have.
    pub blocks: usize,
    /// A step's token ids, positions and logits rows, one copy: `[tokens | tokens | rows]`
    /// for the step's (padded) token count (`step_inputs` takes them apart).
    pub inputs: CudaSlice<u32>,
    /// The residual stream `[tokens, hidden]`.
    pub x: CudaSlice<bf16>,
    /// Normed activations `[tokens, hidden]`.
    pub h: CudaSlice<bf16>,
    /// The gathered rows that want logits `[rows, hidden]`, their f32 logits and argmax.
    pub picked: CudaSlice<bf16>,
    pub logits: CudaSlice<f32>,
    pub next: CudaSlice<u32>,
    /// (token index, pick row) pairs of a step's carried ids (`ForwardBatch::carried`).
    pub carried: CudaSlice<u32>,
    /// The attention metadata of each KV group.
    pub metas: Vec<AttentionMeta>,
    pub scratch: DecodeScratch,
    /// Device sampling: the rows' parameters and edits in, the picks out (grown, by
    /// doubling, to the most edits and alternatives a step has asked for).
    pub sampling: SamplingParamsDev,
    pub sampled: SampledDev,
    pub argmax: ArgmaxScratch,
    /// Where a quantized matrix is dequantized for a many-row GEMM (`Layers::scratch_len`).
    pub dequant: Option<CudaSlice<bf16>>,
}

/// The activations of a decoder layer every family has, `[tokens, width]` each.
pub struct LayerBuffers {
    pub qkv: CudaSlice<bf16>,
    pub attn: CudaSlice<bf16>,
    /// A sublayer's output before it joins the residual.
    pub o: CudaSlice<bf16>,
    pub gate_up: CudaSlice<bf16>,
    pub act: CudaSlice<bf16>,
}

impl LayerBuffers {
    /// Room for `tokens` tokens of q/k/v rows `qkv` wide, attention outputs `attn` wide, the
    /// hidden size `hidden` and an MLP `inter` wide.
    pub fn new(gpu: &Gpu, tokens: usize, qkv: usize, attn: usize, hidden: usize, inter: usize) -> RtResult<Self> {
        let bf = |n: usize| gpu.alloc::<bf16>(tokens * n);
        Ok(LayerBuffers { qkv: bf(qkv)?, attn: bf(attn)?, o: bf(hidden)?, gate_up: bf(2 * inter)?, act: bf(inter)? })
    }
}

/// The ids, positions and logits rows of a step of `tokens` tokens and `out_rows` logits rows
/// in a workspace's `inputs`.
pub fn step_inputs(inputs: &CudaSlice<u32>, tokens: usize, out_rows: usize) -> RtResult<[CudaView<'_, u32>; 3]> {
    let part = |range: std::ops::Range<usize>| {
        inputs.try_slice(range.clone()).ok_or_else(|| {
            RuntimeError::Shape(format!("step inputs {range:?} outside the workspace's {}", inputs.len()))
        })
    };
    Ok([part(0..tokens)?, part(tokens..2 * tokens)?, part(2 * tokens..2 * tokens + out_rows)?])
}

/// The largest heads and head width over `attention`.
fn widest(attention: &[AttentionParams]) -> (usize, usize) {
    let heads = attention.iter().map(|p| p.n_heads).max().unwrap_or(1);
    (heads, attention.iter().map(|p| p.head_dim).max().unwrap_or(1))
}

impl StepIo {
    fn new<L: Layers>(layers: &L, gpu: &Gpu, tokens: usize, rows: usize, max_blocks: usize) -> RtResult<StepIo> {
        let cfg = layers.config();
        let d = cfg.hidden_size;
        let rows = rows.max(1);
        let tokens = tokens.max(rows);
        let bf = |n: usize| gpu.alloc::<bf16>(n);
        let (heads, hd) = widest(layers.attention());
        let metas = (0..layers.layout().groups.len().max(1))
            .map(|_| AttentionMeta::with_capacity(gpu, rows, tokens, max_blocks))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(StepIo {
            tokens,
            rows,
            blocks: max_blocks,
            inputs: gpu.alloc(2 * tokens + rows)?,
            x: bf(tokens * d)?,
            h: bf(tokens * d)?,
            picked: bf(rows * d)?,
            logits: gpu.alloc(rows * cfg.vocab_size)?,
            next: gpu.alloc(rows)?,
            carried: gpu.alloc(2 * rows)?,
            metas,
            scratch: DecodeScratch::new(gpu, rows, heads, hd, 1)?,
            sampling: SamplingParamsDev::with_capacity(gpu, rows, 0)?,
            sampled: SampledDev::new(gpu, rows)?,
            argmax: ArgmaxScratch::new(gpu, rows)?,
            dequant: match layers.scratch_len(tokens) {
                0 => None,
                n => Some(bf(n)?),
            },
        })
    }
}

/// What a step needs besides the weights; behind a lock because `step` takes `&self`.
struct State<B> {
    ws: Option<(StepIo, B)>,
    /// Captured graphs by (padded shape, context bucket, step variant).
    graphs: HashMap<(Padding, usize, u64), Graph>,
    /// The KV cache the graphs write (`KvCache::id`): another cache means capturing again.
    graph_kv: u64,
    /// Where the last step left picks on the device that a carried step may read.
    picks: Option<OnDevice>,
}

/// Page-locked host buffers of resolved steps, for the next ones to land in.
type Spare = Arc<Mutex<Vec<HostBuf<u32>>>>;

/// A queued step (the `Pending` handle's inside): where its picks land on the host, and how
/// to read them. Its buffer goes back to the spares once read (or dropped unread: the next
/// copy into it waits for this one).
struct Queued {
    landing: Option<HostBuf<u32>>,
    rows: usize,
    /// Sampled picks: their (rows, alternatives) and the alternatives each row keeps.
    sampled: Option<((usize, usize), Vec<usize>)>,
    spare: Spare,
}

impl QueuedStep for Queued {
    fn wait(self: Box<Self>) -> RtResult<StepOutput> {
        let landing = self.landing.as_ref().ok_or_else(|| RuntimeError::Shape("a queued step read twice".into()))?;
        Ok(match (&self.sampled, self.rows) {
            (None, 0) => StepOutput::Ids(Vec::new()),
            (Some(_), 0) => StepOutput::Sampled(Vec::new()),
            (None, _) => StepOutput::Ids(landing.wait()?.to_vec()),
            (Some((shape, top)), _) => StepOutput::Sampled(SampledDev::parse(landing.wait()?, *shape, top)?),
        })
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        if let (Some(buf), Ok(mut spare)) = (self.landing.take(), self.spare.lock()) {
            spare.push(buf);
        }
    }
}

/// Which buffer holds the last step's picks, and for how many rows.
#[derive(Debug, Clone, Copy)]
enum OnDevice {
    Argmax(usize),
    Sampled(usize),
}

/// A model on one CUDA device: a family's `Layers` run by the shared step machinery.
pub struct GpuModel<L: Layers> {
    layers: L,
    gpu: Arc<Gpu>,
    weight_bytes: usize,
    graphs_enabled: AtomicBool,
    device_sampling: AtomicBool,
    /// Steps run by replaying a captured graph (`graph_replays`).
    replays: AtomicU64,
    state: Mutex<State<L::Buffers>>,
    spare: Spare,
}

impl<L: Layers> GpuModel<L> {
    /// A model of `layers` (weights already on `gpu`, `weight_bytes` of them).
    pub(crate) fn from_layers(layers: L, gpu: Arc<Gpu>, weight_bytes: usize) -> GpuModel<L> {
        GpuModel {
            layers,
            gpu,
            weight_bytes,
            graphs_enabled: AtomicBool::new(true),
            device_sampling: AtomicBool::new(true),
            replays: AtomicU64::new(0),
            state: Mutex::new(State { ws: None, graphs: HashMap::new(), graph_kv: 0, picks: None }),
            spare: Spare::default(),
        }
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Device bytes of the weights.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Replay CUDA graphs for uniform steps (decode, verify; the default) or run every step
    /// eagerly.
    pub fn set_cuda_graphs(&self, on: bool) {
        self.graphs_enabled.store(on, Ordering::Relaxed);
    }

    /// How many steps so far replayed a captured graph (a step that captures one runs eagerly
    /// and does not count).
    pub fn graph_replays(&self) -> u64 {
        self.replays.load(Ordering::Relaxed)
    }

    /// Sample on the device (the default) or hand the engine logits to sample on the host.
    pub fn set_device_sampling(&self, on: bool) {
        self.device_sampling.store(on, Ordering::Relaxed);
    }

    fn lock(&self) -> RtResult<std::sync::MutexGuard<'_, State<L::Buffers>>> {
        self.state.lock().map_err(|_| RuntimeError::Shape("the CUDA model's state was poisoned by a panic".into()))
    }

    /// Block-table entries per row for contexts up to `context` (its bucket).
    fn table_len(context: usize, block_size: usize) -> usize {
        context_bucket(context).div_ceil(block_size.max(1))
    }

    /// A workspace for steps of `tokens` tokens, `rows` rows and `blocks` table entries a
    /// row (at least), replacing a smaller one (which drops the graphs captured over it).
    fn ensure(&self, st: &mut State<L::Buffers>, tokens: usize, rows: usize, blocks: usize) -> RtResult<()> {
        let (t0, r0, b0) = st.ws.as_ref().map_or((0, 0, 0), |(w, _)| (w.tokens, w.rows, w.blocks));
        if tokens <= t0 && rows <= r0 && blocks <= b0 {
            return Ok(());
        }
        st.graphs.clear();
        st.ws = None;
        self.gpu.synchronize()?;
        let io = StepIo::new(&self.layers, &self.gpu, tokens.max(t0), rows.max(r0), blocks.max(b0))?;
        let b = self.layers.buffers(&self.gpu, io.tokens)?;
        st.ws = Some((io, b));
        Ok(())
    }

    /// Queue one step over the inputs already in the workspace (`tokens` query tokens,
    /// `out_rows` rows wanting logits): the layers, the LM head and the argmax.
    fn queue_compute(
        &self,
        (io, b): &mut (StepIo, L::Buffers),
        kv: &mut KvCache,
        tokens: usize,
        out_rows: usize,
        decode: Option<Decode>,
    ) -> RtResult<()> {
        let gpu = &*self.gpu;
        let cfg = self.layers.config();
        let (d, v) = (cfg.hidden_size, cfg.vocab_size);
        self.layers.queue_layers(gpu, io, b, kv, tokens, decode)?;
        if out_rows == 0 {
            // A prefill chunk that ends no prompt: only its KV was wanted.
            return Ok(());
        }
        self.layers.final_norm(gpu, io, b, tokens)?;
        // The rows that want logits, gathered by the embedding kernel over the normed rows.
        let [_, _, logit_rows] = step_inputs(&io.inputs, tokens, out_rows)?;
        ops::embedding(gpu, &io.h, (tokens, d), &logit_rows, out_rows, 1.0, &mut io.picked)?;
        self.layers.lm_head().linear::<f32>(gpu, &io.picked, None, &mut io.logits, (out_rows, v, d), None)?;
        let (scale, cap) = (self.layers.logit_scale(), self.layers.final_softcap());
        if scale.is_some() || cap.is_some() {
            ops::scale_softcap(gpu, &mut io.logits, out_rows * v, scale.unwrap_or(1.0), cap)?;
        }
        ops::argmax(gpu, &io.logits, (out_rows, v, v), &mut io.argmax, &mut io.next)?;
        Ok(())
    }

    /// Copy the step's inputs into `io`: ids and positions padded as `pad` says (zeros), the
    /// logits rows (then every padding token), and the attention metadata of every KV group
    /// (tables `stride` apart when given); then the carried ids from the last step's picks on
    /// the device (`from`).
    fn upload_inputs(
        &self,
        io: &mut StepIo,
        batch: &ForwardBatch,
        block_size: usize,
        pad: Padding,
        stride: Option<usize>,
        from: Option<OnDevice>,
    ) -> RtResult<()> {
        let (gpu, carried) = (&*self.gpu, &batch.carried);
        let (extra, tokens) = (pad.extra_tokens(batch), pad.tokens(batch));
        let mut host = Vec::with_capacity(2 * tokens + batch.logits_indices.len() + extra);
        for v in [&batch.tokens, &batch.positions] {
            host.extend_from_slice(v);
            host.resize(host.len() + extra, 0);
        }
        host.extend(batch.logits_indices.iter().map(|&i| i as u32));
        host.extend((batch.num_tokens()..tokens).map(|i| i as u32));
        gpu.upload_into(&host, &mut io.inputs)?;
        // A recurrent group's tables name state slots, not the positions' KV blocks.
        let recurrent = self.layers.layout().recurrent_group();
        for (group, meta) in io.metas.iter_mut().enumerate().filter(|(g, _)| Some(*g) != recurrent) {
            meta.update(gpu, batch, group, block_size, pad, stride)?;
        }
        if carried.is_empty() {
            return Ok(());
        }
        let pairs: Vec<u32> = carried.iter().flat_map(|&(t, r)| [t as u32, r as u32]).collect();
        gpu.upload_into(&pairs, &mut io.carried)?;
        let picks = match from {
            Some(OnDevice::Argmax(_)) => io.next.slice(..),
            Some(OnDevice::Sampled(_)) => io.sampled.tokens(),
            None => return Err(RuntimeError::Shape("carried ids without a step's picks on the device".into())),
        };
        Ok(ops::carry_picks(gpu, &picks, &io.carried, carried.len(), &mut io.inputs)?)
    }

    /// A scratch for a decode step of `decode`'s shape under every layer's plan (a larger
    /// one drops the graphs captured over the old).
    fn ensure_scratch(&self, st: &mut State<L::Buffers>, decode: Decode) -> RtResult<()> {
        let attention = self.layers.attention();
        let splits = attention.iter().map(|p| decode.plan(&self.gpu, p).splits).max().unwrap_or(1);
        let (heads, hd) = widest(attention);
        let (io, _) = st.ws.as_mut().ok_or_else(no_workspace)?;
        if !io.scratch.fits(decode.rows, heads, hd, splits) {
            st.graphs.clear();
            io.scratch = DecodeScratch::new(&self.gpu, decode.rows, heads, hd, splits)?;
        }
        Ok(())
    }

    fn run_eager(&self, st: &mut State<L::Buffers>, batch: &ForwardBatch, kv: &mut KvCache) -> RtResult<()> {
        let (rows, pad) = (batch.rows.len(), Padding::none(batch));
        let from = st.picks;
        let (io, b) = st.ws.as_mut().ok_or_else(no_workspace)?;
        self.upload_inputs(io, batch, kv.block_size(), pad, None, from)?;
        self.layers.upload_step(&self.gpu, b, batch, pad, kv)?;
        // Decode splits keys as a graph of the same rows would, so both give the same bits.
        let decode = if io.metas[0].max_query <= 1 {
            let decode = Decode { rows, context: context_bucket(io.metas[0].max_context) };
            self.ensure_scratch(st, decode)?;
            Some(decode)
        } else {
            None
        };
        let ws = st.ws.as_mut().ok_or_else(no_workspace)?;
        self.queue_compute(ws, kv, batch.num_tokens(), batch.logits_indices.len(), decode)
    }

    /// A uniform step of `batch` (decode or verify: logits at every token) padded to `pad`,
    /// by graph replay (captured on first use of its (padding, context bucket, variant)).
    fn run_graph(
        &self,
        st: &mut State<L::Buffers>,
        batch: &ForwardBatch,
        kv: &mut KvCache,
        pad: Padding,
    ) -> RtResult<()> {
        let longest = batch.rows.iter().map(|r| r.context_len).max().unwrap_or(0);
        let context = context_bucket(longest);
        let block_size = kv.block_size();
        let stride = context.div_ceil(block_size);
        if st.graph_kv != kv.id() {
            st.graphs.clear();
            st.graph_kv = kv.id();
        }
        // Decode rows take the split-K decode kernel under a plan for the bucket; longer rows
        // the prefill kernel, whose work per row does not depend on the others.
        let decode = (pad.query == 1).then_some(Decode { rows: pad.rows, context });
        if let Some(decode) = decode {
            self.ensure_scratch(st, decode)?;
        }
        let State { ws, graphs, picks, .. } = st;
        let ws = ws.as_mut().ok_or_else(no_workspace)?;
        self.upload_inputs(&mut ws.0, batch, block_size, pad, Some(stride), *picks)?;
        let variant = self.layers.upload_step(&self.gpu, &mut ws.1, batch, pad, kv)?;
        let key = (pad, context, variant);
        if let Some(graph) = graphs.get(&key) {
            graph.replay()?;
            self.replays.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        // First use: run it eagerly (this step's result; it also builds the cuBLASLt plans
        // outside the capture), then capture the same work for the next steps.
        let tokens = pad.rows * pad.query;
        self.queue_compute(ws, kv, tokens, tokens, decode)?;
        let graph = self.gpu.capture(|| self.queue_compute(ws, kv, tokens, tokens, decode))?;
        graphs.insert(key, graph);
        Ok(())
    }

    /// Run `batch` (its `carried` ids from the last step's picks); afterwards the first
    /// `logits_indices.len()` rows of the workspace's `logits` and `next` hold its logits and
    /// greedy ids.
    fn run(&self, batch: &ForwardBatch, kv: &mut KvCache) -> RtResult<std::sync::MutexGuard<'_, State<L::Buffers>>> {
        let carried = &batch.carried[..];
        let (tokens, rows, out_rows) = (batch.num_tokens(), batch.rows.len(), batch.logits_indices.len());
        if tokens == 0 || batch.logits_indices.iter().any(|&i| i >= tokens) {
            return Err(RuntimeError::Shape(format!(
                "a step of {tokens} tokens with logits rows {:?}",
                batch.logits_indices
            )));
        }
        let vocab = self.layers.config().vocab_size;
        if let Some(&t) = batch.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(RuntimeError::Shape(format!("token {t} is outside the vocabulary of {vocab}")));
        }
        let longest = batch.rows.iter().map(|r| r.context_len).max().unwrap_or(0);
        let mut st = self.lock()?;
        if !carried.is_empty() {
            let from = match st.picks {
                Some(OnDevice::Argmax(n) | OnDevice::Sampled(n)) => n,
                None => 0,
            };
            if let Some(&(t, r)) = carried.iter().find(|&&(t, r)| t >= tokens || r >= from) {
                return Err(RuntimeError::Shape(format!(
                    "carried pick {r} of {from} into token {t} of a step of {tokens}"
                )));
            }
        }
        let table = Self::table_len(longest, kv.block_size());
        let (t0, r0, b0) = st.ws.as_ref().map_or((0, 0, 0), |(w, _)| (w.tokens, w.rows, w.blocks));
        if !carried.is_empty() && (tokens > t0 || rows.max(out_rows) > r0 || table > b0) {
            // A new workspace would not hold the picks the step reads.
            return Err(RuntimeError::Shape("a step with carried ids outgrows the workspace (see `prepare`)".into()));
        }
        self.ensure(&mut st, tokens, rows.max(out_rows), table)?;
        match self.graph_padding(&st, batch) {
            Some(pad) => self.run_graph(&mut st, batch, kv, pad)?,
            None => self.run_eager(&mut st, batch, kv)?,
        }
        // Until a step records where its picks are, none is on the device to carry.
        st.picks = None;
        Ok(st)
    }

    /// The shape `batch` replays a graph at, when it is uniform — every row `q` query tokens
    /// (1 to `MAX_GRAPH_QUERY`), logits at every token, in order — and its row bucket fits the
    /// workspace; None: it runs eagerly. Rows of different lengths stay eager: padding a short
    /// row's query would read keys past its context.
    fn graph_padding(&self, st: &State<L::Buffers>, batch: &ForwardBatch) -> Option<Padding> {
        let q = batch.rows.first()?.query_len;
        let uniform = (1..=MAX_GRAPH_QUERY).contains(&q)
            && batch.rows.iter().all(|r| r.query_len == q)
            && batch.logits_indices.iter().copied().eq(0..batch.num_tokens());
        if !(uniform && self.graphs_enabled.load(Ordering::Relaxed) && self.layers.graph_safe()) {
            return None;
        }
        let (io, _) = st.ws.as_ref()?;
        let rows = ROW_BUCKETS.iter().copied().find(|&b| b >= batch.rows.len())?;
        // The padded step's tokens all want logits: they must fit both the token and the
        // logits rows of the workspace.
        (rows * q <= io.rows.min(io.tokens)).then_some(Padding { rows, query: q })
    }

    /// Run `batch` and copy its logits to the host.
    fn logits(&self, batch: &ForwardBatch, kv: &mut KvCache) -> RtResult<Vec<f32>> {
        let st = self.run(batch, kv)?;
        let (io, _) = st.ws.as_ref().ok_or_else(no_workspace)?;
        let n = batch.logits_indices.len() * self.layers.config().vocab_size;
        if n == 0 {
            // Nothing to copy back: the step stays queued (a later step's copy waits for it).
            return Ok(Vec::new());
        }
        Ok(self.gpu.download(&io.logits.slice(..n))?)
    }

    /// Queue `batch` with its logits rows picked on the device — the argmax, or as
    /// `samplers` says (one per row) — and their picks copied to the host behind it.
    fn queue(&self, batch: &ForwardBatch, kv: &mut KvCache, samplers: Option<&[RowSampler]>) -> RtResult<Pending> {
        let n = batch.logits_indices.len();
        if let Some(rows) = samplers.filter(|rows| rows.len() != n) {
            return Err(RuntimeError::Shape(format!("{} samplers for {n} logits rows", rows.len())));
        }
        let mut guard = self.run(batch, kv)?;
        let st = &mut *guard;
        let spare = self.spare.lock().ok().and_then(|mut s| s.pop());
        let mut landing = match spare {
            Some(buf) => buf,
            None => self.gpu.host_buf(2 * n.max(1))?,
        };
        let (io, _) = st.ws.as_mut().ok_or_else(no_workspace)?;
        let mut sampled = None;
        if n > 0 {
            match samplers {
                None => {
                    self.gpu.copy_to_host(&io.next.slice(..n), &mut landing)?;
                    st.picks = Some(OnDevice::Argmax(n));
                }
                Some(rows) => {
                    let v = self.layers.config().vocab_size;
                    let params: Vec<RowSampling> = rows.iter().map(|r| r.params).collect();
                    let edits: Vec<(usize, LogitEdit)> =
                        rows.iter().enumerate().flat_map(|(i, r)| r.edits.iter().map(move |&e| (i, e))).collect();
                    let top: Vec<usize> = rows.iter().map(|r| r.top_logprobs).collect();
                    let most = top.iter().copied().max().unwrap_or(0);
                    io.sampling.update(&self.gpu, &params, &edits, most, v)?;
                    ops::pick(&self.gpu, &mut io.logits.slice_mut(..n * v), (v, v), &io.sampling, &mut io.sampled)?;
                    self.gpu.copy_to_host(&io.sampled.picks(), &mut landing)?;
                    sampled = Some((io.sampled.shape(), top));
                    st.picks = Some(OnDevice::Sampled(n));
                }
            }
        }
        Ok(Pending::queued(Queued { landing: Some(landing), rows: n, sampled, spare: self.spare.clone() }))
    }
}

/// The context a decode plan (and a graph) is built for: `longest` rounded up to a power of
/// two, at least `MIN_CONTEXT_BUCKET`.
fn context_bucket(longest: usize) -> usize {
    longest.max(MIN_CONTEXT_BUCKET).next_power_of_two()
}

fn no_workspace() -> RuntimeError {
    RuntimeError::Shape("the CUDA model has no workspace".into())
}

impl<L: Layers> GpuModel<L> {
    /// Whether this device's KV pools can hold `scheme`: bf16 (`F16`), int8, int4, and fp8
    /// from compute capability 8.9 (Ada, Hopper) on, whose instructions write e4m3.
    fn check_kv_scheme(&self, scheme: &KvScheme) -> RtResult<()> {
        let cc = self.gpu.info().compute_capability;
        match scheme.dtype {
            KvDtype::F32 => {
                Err(RuntimeError::Unsupported("an f32 KV cache on the GPU (use bf16, int8, int4 or fp8)".into()))
            }
            KvDtype::Fp8 if cc < (8, 9) => Err(RuntimeError::Unsupported(format!(
                "an fp8 KV cache needs compute capability 8.9 or newer (Ada, Hopper); this GPU is {}.{} (use int8: the \
                 same bytes a value)",
                cc.0, cc.1
            ))),
            _ => Ok(()),
        }
    }
}

impl<L: Layers> CausalLm for GpuModel<L> {
    fn config(&self) -> &ModelConfig {
        self.layers.config()
    }

    fn kv_layout(&self) -> KvLayout {
        self.layers.layout().clone()
    }

    /// Logits come back at once (copied to the host); argmax and sampled picks queued.
    fn step(&self, batch: &ForwardBatch, kv: &mut KvCache, want: Want<'_>) -> RtResult<Pending> {
        let samplers = match want {
            Want::Logits => return self.logits(batch, kv).map(|l| Pending::ready(StepOutput::Logits(l))),
            Want::Argmax => None,
            Want::Sample(rows) => Some(rows),
        };
        self.queue(batch, kv, samplers)
    }

    fn samples_on_device(&self) -> bool {
        self.device_sampling.load(Ordering::Relaxed)
    }

    fn attach_lora(&self, id: u32, adapter: &LoraAdapter) -> Result<(), LoadError> {
        self.layers.attach_lora(&self.gpu, id, adapter)
    }

    fn detach_lora(&self, id: u32) {
        self.layers.detach_lora(&self.gpu, id)
    }

    fn lora_shapes(&self) -> LoraShapes {
        self.layers.lora_shapes()
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

    fn kv_block_bytes(&self, block_size: usize, scheme: &KvScheme) -> RtResult<Vec<usize>> {
        self.check_kv_scheme(scheme)?;
        // bf16 takes the default host type's (f16's) two bytes a value.
        const { assert!(std::mem::size_of::<bf16>() == std::mem::size_of::<half::f16>()) };
        let layout = self.layers.layout();
        Ok(layout.block_bytes_with(block_size, &layout.layer_dtypes(scheme)?))
    }

    fn kv_description(&self, scheme: &KvScheme) -> String {
        match scheme.dtype {
            KvDtype::F16 => "bf16".into(),
            _ => scheme.to_string(),
        }
    }

    fn new_kv_cache(&self, group_blocks: &[usize], block_size: usize, scheme: &KvScheme) -> RtResult<KvCache> {
        self.check_kv_scheme(scheme)?;
        KvCache::on_device_with_scheme(&self.gpu, self.layers.layout(), group_blocks, block_size, scheme)
    }
}
