//! `Engine`: one thread per loaded model owns the model, the KV cache and the scheduler
//! (`EngineCore`). Requests arrive on a channel, each with its own output channel; dropping a
//! `RequestStream` (a client that went away) aborts its request within one step. A request's
//! output constraint is compiled on the caller's thread, so a bad grammar fails `submit`, as
//! does a request for a LoRA adapter that is not loaded. Adapters are loaded and unloaded on
//! the engine thread, between steps (`load_adapter`, `unload_adapter`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use ferrite_models::lora::LoraAdapter;
use ferrite_models::model::CausalLm;
use ferrite_models::tokenizer::Tokenizer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::config::{EngineConfig, Limits};
use crate::core::{AdapterNames, EngineCore};
use crate::error::EngineError;
use crate::metrics::Metrics;
use crate::request::{Finished, Output, Request, RequestId};
use crate::structured::{Grammars, Guide};

enum Command {
    Add(RequestId, Box<Request>, Option<Box<Guide>>, tokio::sync::mpsc::UnboundedSender<Output>),
    Abort(RequestId),
    LoadAdapter(String, Arc<LoraAdapter>, mpsc::Sender<Result<(), EngineError>>),
    UnloadAdapter(String, mpsc::Sender<Result<(), EngineError>>),
}

pub struct Engine {
    tx: Option<mpsc::Sender<Command>>,
    limits: Limits,
    metrics: Arc<Metrics>,
    grammars: Arc<Grammars>,
    adapters: AdapterNames,
    next_id: AtomicU64,
    thread: Option<JoinHandle<()>>,
}

/// The outputs of one request, in order; the last output of each choice has `finished`.
pub struct RequestStream {
    pub id: RequestId,
    rx: UnboundedReceiver<Output>,
    tx: mpsc::Sender<Command>,
}

impl RequestStream {
    /// Wait for the next output (from synchronous code). `None` once the engine is gone.
    pub fn blocking_next(&mut self) -> Option<Output> {
        self.rx.blocking_recv()
    }

    /// Wait for the next output (from async code).
    pub async fn next(&mut self) -> Option<Output> {
        self.rx.recv().await
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        // Finished requests ignore this.
        let _ = self.tx.send(Command::Abort(self.id));
    }
}

impl Engine {
    pub fn start(
        model: Arc<dyn CausalLm>,
        tokenizer: Option<Arc<Tokenizer>>,
        eos: Vec<u32>,
        cfg: &EngineConfig,
    ) -> Result<Engine, EngineError> {
        let mut core = EngineCore::new(model, tokenizer, eos, cfg)?;
        core.stream_from_thread()?;
        let limits = core.limits().clone();
        let metrics = core.metrics();
        let grammars = core.grammars();
        let adapters = core.adapter_names();
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("ferrite-engine".into())
            .spawn(move || run(core, rx))
            .map_err(|e| EngineError::Config(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine {
            tx: Some(tx),
            limits,
            metrics,
            grammars,
            adapters,
            next_id: AtomicU64::new(1),
            thread: Some(thread),
        })
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Validate and queue a request. Bad requests fail here, before reaching the engine.
    pub fn submit(&self, req: Request) -> Result<RequestStream, EngineError> {
        self.limits.validate(&req)?;
        if let Some(name) = &req.params.adapter {
            if !self.adapters.read().unwrap_or_else(|e| e.into_inner()).contains(name) {
                return Err(EngineError::UnknownAdapter(name.clone()));
            }
        }
        let guide = req.params.constraint.as_ref().map(|c| self.grammars.compile(c).map(Box::new)).transpose()?;
        let tx = self.tx.as_ref().ok_or(EngineError::Stopped)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (out_tx, out_rx) = unbounded_channel();
        tx.send(Command::Add(id, Box::new(req), guide, out_tx)).map_err(|_| EngineError::Stopped)?;
        Ok(RequestStream { id, rx: out_rx, tx: tx.clone() })
    }

    /// Load `adapter` under `name` (blocking until the engine thread has attached it).
    pub fn load_adapter(&self, name: &str, adapter: Arc<LoraAdapter>) -> Result<(), EngineError> {
        self.ask(|reply| Command::LoadAdapter(name.to_string(), adapter, reply))
    }

    /// Unload the adapter `name`; refused while a sequence runs through it.
    pub fn unload_adapter(&self, name: &str) -> Result<(), EngineError> {
        self.ask(|reply| Command::UnloadAdapter(name.to_string(), reply))
    }

    /// The names of the loaded adapters.
    pub fn adapters(&self) -> Vec<String> {
        let mut names: Vec<String> = self.adapters.read().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect();
        names.sort();
        names
    }

    /// Send the command `make` builds around a reply channel and wait for the reply.
    fn ask(&self, make: impl FnOnce(mpsc::Sender<Result<(), EngineError>>) -> Command) -> Result<(), EngineError> {
        let tx = self.tx.as_ref().ok_or(EngineError::Stopped)?;
        let (reply, answer) = mpsc::channel();
        tx.send(make(reply)).map_err(|_| EngineError::Stopped)?;
        answer.recv().map_err(|_| EngineError::Stopped)?
    }

    pub fn abort(&self, id: RequestId) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Command::Abort(id));
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Closing the channel ends the loop once in-flight work is done.
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn apply(core: &mut EngineCore, cmd: Command) {
    match cmd {
        Command::Add(id, req, guide, sink) => {
            if let Err(e) = core.add_guided(id, *req, guide.map(|g| *g), sink.clone()) {
                // Validated at submit; reaching here means something changed under it (its
                // adapter was unloaded in between): the request ends with the error.
                let out = Output::end(0, Finished::error(e.to_string(), Default::default()), 0);
                let _ = sink.send(out);
            }
        }
        Command::Abort(id) => core.abort(id),
        Command::LoadAdapter(name, adapter, reply) => {
            let _ = reply.send(core.load_adapter(&name, &adapter));
        }
        Command::UnloadAdapter(name, reply) => {
            let _ = reply.send(core.unload_adapter(&name));
        }
    }
}

fn run(mut core: EngineCore, rx: mpsc::Receiver<Command>) {
    let mut open = true;
    loop {
        if core.has_work() {
            loop {
                match rx.try_recv() {
                    Ok(cmd) => apply(&mut core, cmd),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            if let Err(e) = core.step() {
                eprintln!("ferrite-engine: step failed: {e}");
            }
        } else if open {
            match rx.recv() {
                Ok(cmd) => apply(&mut core, cmd),
                Err(_) => open = false,
            }
        } else {
            return;
        }
    }
}
