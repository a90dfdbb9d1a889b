//! The child process's side of `--isolate`: serve one loaded `Engine` over the socket to the
//! HTTP process until that closes it. Each accepted request's outputs are forwarded by a task
//! of their own; a `Cancel` drops the request's stream, which aborts it in the engine. LoRA
//! adapters are read and attached (or unloaded) on the blocking pool, so outputs keep flowing
//! meanwhile.

use std::collections::HashMap;
use std::io;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use ferrite_engine::Engine;
use ferrite_models::lora::{LoraAdapter, MAX_LORA_RANK};
use tokio::task::AbortHandle;

use super::protocol::{metric_fields, read_frame, write_frame, FromWorker, ToWorker, METRICS_EVERY};
use crate::error::ApiError;

/// Frames to the HTTP process, one at a time.
#[derive(Clone)]
struct Sender(Arc<Mutex<UnixStream>>);

impl Sender {
    fn send(&self, msg: &FromWorker) -> io::Result<()> {
        let mut socket = self.0.lock().map_err(|_| io::Error::other("the socket writer panicked"))?;
        write_frame(&mut *socket, msg)
    }
}

/// Announce `engine` as ready on `socket` and serve it until the HTTP process goes away.
pub fn serve_engine(engine: Engine, socket: UnixStream) -> io::Result<()> {
    let engine = Arc::new(engine);
    let out = Sender(Arc::new(Mutex::new(socket.try_clone()?)));
    out.send(&FromWorker::Ready { limits: engine.limits().clone() })?;
    let (commands_tx, mut commands) = tokio::sync::mpsc::unbounded_channel();
    let mut reader = socket;
    std::thread::Builder::new().name("ferrite-worker-read".into()).spawn(move || {
        while let Ok(Some(cmd)) = read_frame::<ToWorker>(&mut reader) {
            if commands_tx.send(cmd).is_err() {
                break;
            }
        }
    })?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
    runtime.block_on(async move {
        let mut forwarding: HashMap<u64, AbortHandle> = HashMap::new();
        let mut report = tokio::time::interval(METRICS_EVERY);
        loop {
            tokio::select! {
                cmd = commands.recv() => match cmd {
                    None => return Ok(()),
                    Some(ToWorker::Submit { id, request }) => match engine.submit(*request) {
                        Err(e) => out.send(&FromWorker::Rejected { id, error: ApiError::from(e).into() })?,
                        Ok(mut stream) => {
                            out.send(&FromWorker::Accepted { id })?;
                            let out = out.clone();
                            let task = tokio::spawn(async move {
                                while let Some(output) = stream.next().await {
                                    if out.send(&FromWorker::Output { id, output }).is_err() {
                                        break;
                                    }
                                }
                            });
                            forwarding.insert(id, task.abort_handle());
                        }
                    },
                    Some(ToWorker::Cancel { id }) => {
                        if let Some(task) = forwarding.remove(&id) {
                            task.abort();
                        }
                    }
                    Some(ToWorker::LoadAdapter { id, name, path }) => answer(&engine, &out, id, move |engine| {
                        // The HTTP process checked the rank against `--max-lora-rank` already.
                        let lora = LoraAdapter::load(&path, MAX_LORA_RANK).map_err(|e| {
                            ApiError::bad_request(format!("cannot load the LoRA adapter '{name}': {e}"))
                                .with_code("invalid_adapter")
                        })?;
                        Ok(engine.load_adapter(&name, Arc::new(lora))?)
                    }),
                    Some(ToWorker::UnloadAdapter { id, name }) => {
                        answer(&engine, &out, id, move |engine| Ok(engine.unload_adapter(&name)?))
                    }
                },
                _ = report.tick() => {
                    forwarding.retain(|_, task| !task.is_finished());
                    let values = metric_fields(engine.metrics()).iter().map(|v| v.load(Relaxed)).collect();
                    out.send(&FromWorker::Metrics { values })?;
                }
            }
        }
    })
}

/// Run an adapter command on the blocking pool and answer `id` once it is done.
fn answer(
    engine: &Arc<Engine>,
    out: &Sender,
    id: u64,
    work: impl FnOnce(&Engine) -> Result<(), ApiError> + Send + 'static,
) {
    let (engine, out) = (engine.clone(), out.clone());
    tokio::task::spawn_blocking(move || {
        let error = work(&engine).err().map(|e| e.with_param("lora_name").into());
        // A closed socket ends the serving loop anyway.
        let _ = out.send(&FromWorker::AdapterDone { id, error });
    });
}
