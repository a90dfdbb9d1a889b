//! `IsolatedEngine`: the HTTP process's handle on an engine in a child process. A supervisor
//! thread reads the child's frames and routes them (acknowledgements to the submitting call,
//! outputs to their streams, metrics to the mirror the server reads); when the socket ends
//! it reaps the child, fails every open request with an error output saying how the child
//! died, and starts it again (within the restart limit) while new requests wait. LoRA
//! adapters are loaded into the child by path (`LoadAdapter`); the proxy remembers them and
//! loads them into a restarted child before it takes requests again.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use ferrite_engine::{Finished, Limits, Metrics as EngineMetrics, Output, Request, RequestId};
use ferrite_models::lora::LoraAdapter;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::protocol::{metric_fields, read_frame, write_frame, FromWorker, ToWorker};
use super::{MAX_RESTARTS, RESTART_WINDOW};
use crate::error::ApiError;
use crate::pool::{EngineBackend, EngineHealth, EngineStream};

/// How to start the child: this program with these arguments, to which `--socket PATH` is
/// added.
#[derive(Debug, Clone)]
pub struct WorkerCommand {
    pub program: PathBuf,
    pub args: Vec<String>,
}

/// How long a request waits for a restarting engine.
const RESTART_WAIT: Duration = Duration::from_secs(600);

/// How long an unloaded engine's child may take to exit before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(10);

pub struct IsolatedEngine {
    limits: Limits,
    metrics: Arc<EngineMetrics>,
    shared: Arc<Shared>,
    supervisor: Option<JoinHandle<()>>,
}

struct Shared {
    name: String,
    link: Mutex<Link>,
    changed: Condvar,
    next_id: AtomicU64,
    metrics: Arc<EngineMetrics>,
    /// Set when the engine is unloaded: the child's exit is no crash.
    closing: AtomicBool,
}

struct Link {
    health: EngineHealth,
    writer: Option<UnixStream>,
    pid: Option<u32>,
    streams: HashMap<RequestId, Open>,
    /// Submissions and adapter commands waiting for the child's answer, by id.
    pending: HashMap<u64, mpsc::Sender<Result<(), ApiError>>>,
    /// How long the last restart took (crash seen → child ready).
    last_restart: Option<Duration>,
    /// The LoRA adapters loaded into the child (name, PEFT directory), for a restarted one.
    adapters: Vec<(String, PathBuf)>,
}

/// A request in flight: where its outputs go and which of its choices have not finished.
struct Open {
    tx: UnboundedSender<Output>,
    unfinished: BTreeSet<usize>,
}

/// The outputs of one request served by a child; dropping it cancels the request there.
pub struct RemoteStream {
    id: RequestId,
    rx: UnboundedReceiver<Output>,
    shared: Arc<Shared>,
}

impl RemoteStream {
    pub async fn next(&mut self) -> Option<Output> {
        self.rx.recv().await
    }
}

impl Drop for RemoteStream {
    fn drop(&mut self) {
        let mut link = self.shared.link();
        if link.streams.remove(&self.id).is_some() {
            if let Some(w) = link.writer.as_mut() {
                // A child that is gone has dropped the request already.
                let _ = write_frame(w, &ToWorker::Cancel { id: self.id });
            }
        }
    }
}

impl Shared {
    fn link(&self) -> MutexGuard<'_, Link> {
        self.link.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl IsolatedEngine {
    /// Start the child for the model `name` and wait until its engine is ready.
    pub fn spawn(name: &str, command: WorkerCommand) -> Result<IsolatedEngine, String> {
        let (child, socket, limits) = start_child(&command)?;
        let metrics = Arc::new(EngineMetrics::default());
        let reader = socket.try_clone().map_err(|e| format!("cannot share the engine socket: {e}"))?;
        let shared = Arc::new(Shared {
            name: name.to_string(),
            link: Mutex::new(Link {
                health: EngineHealth::Running,
                writer: Some(socket),
                pid: Some(child.id()),
                streams: HashMap::new(),
                pending: HashMap::new(),
                last_restart: None,
                adapters: Vec::new(),
            }),
            changed: Condvar::new(),
            next_id: AtomicU64::new(1),
            metrics: metrics.clone(),
            closing: AtomicBool::new(false),
        });
        let s = shared.clone();
        let supervisor = std::thread::Builder::new()
            .name(format!("ferrite-supervise-{name}"))
            .spawn(move || supervise(&s, &command, child, reader))
            .map_err(|e| format!("cannot start the supervisor thread: {e}"))?;
        Ok(IsolatedEngine { limits, metrics, shared, supervisor: Some(supervisor) })
    }

    /// How long the last restart after a crash took.
    pub fn last_restart(&self) -> Option<Duration> {
        self.shared.link().last_restart
    }

    /// Wait until the engine is running (or down), for at most `timeout`.
    pub fn wait_running(&self, timeout: Duration) -> EngineHealth {
        let link = self.shared.link();
        let (link, _) = self
            .shared
            .changed
            .wait_timeout_while(link, timeout, |l| l.health == EngineHealth::Restarting)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        link.health.clone()
    }
}

impl EngineBackend for IsolatedEngine {
    fn limits(&self) -> &Limits {
        &self.limits
    }

    fn metrics(&self) -> &Arc<EngineMetrics> {
        &self.metrics
    }

    fn health(&self) -> EngineHealth {
        self.shared.link().health.clone()
    }

    fn pid(&self) -> Option<u32> {
        self.shared.link().pid
    }

    fn submit(&self, request: Request) -> Result<EngineStream, ApiError> {
        self.limits.validate(&request)?;
        let n = request.params.n;
        if self.wait_running(RESTART_WAIT) != EngineHealth::Running {
            return Err(self.unavailable());
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        let (ack_tx, ack_rx) = mpsc::channel();
        let sent = {
            let mut link = self.shared.link();
            let sent = link
                .writer
                .as_mut()
                .is_some_and(|w| write_frame(w, &ToWorker::Submit { id, request: Box::new(request) }).is_ok());
            if sent {
                link.streams.insert(id, Open { tx, unfinished: (0..n).collect() });
                link.pending.insert(id, ack_tx);
            }
            sent
        };
        if !sent {
            // The child is gone (its crash is being handled); `unavailable` takes the lock.
            return Err(self.unavailable());
        }
        let stream = RemoteStream { id, rx, shared: self.shared.clone() };
        match ack_rx.recv() {
            Ok(Ok(())) => Ok(EngineStream::Remote(stream)),
            Ok(Err(refused)) => Err(refused),
            // The child died before answering; its crash has been handled.
            Err(_) => Err(self.unavailable()),
        }
    }

    fn load_adapter(&self, name: &str, adapter: Arc<LoraAdapter>) -> Result<(), ApiError> {
        let path = adapter.path.clone();
        self.command(|id| ToWorker::LoadAdapter { id, name: name.to_string(), path: path.clone() })?;
        self.shared.link().adapters.push((name.to_string(), path));
        Ok(())
    }

    fn unload_adapter(&self, name: &str) -> Result<(), ApiError> {
        self.command(|id| ToWorker::UnloadAdapter { id, name: name.to_string() })?;
        self.shared.link().adapters.retain(|(n, _)| n != name);
        Ok(())
    }
}

impl IsolatedEngine {
    /// Send the command `make` builds around a fresh id and wait for the child's answer.
    fn command(&self, make: impl FnOnce(u64) -> ToWorker) -> Result<(), ApiError> {
        if self.wait_running(RESTART_WAIT) != EngineHealth::Running {
            return Err(self.unavailable());
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        let sent = {
            let mut link = self.shared.link();
            let sent = link.writer.as_mut().is_some_and(|w| write_frame(w, &make(id)).is_ok());
            if sent {
                link.pending.insert(id, tx);
            }
            sent
        };
        match sent.then(|| rx.recv()) {
            Some(Ok(answer)) => answer,
            // The child is gone or died before answering; its crash has been handled.
            _ => Err(self.unavailable()),
        }
    }

    fn unavailable(&self) -> ApiError {
        let why = match self.health() {
            EngineHealth::Down(why) => format!("the engine of '{}' is down: {why}", self.shared.name),
            _ => format!("the engine process of '{}' crashed; retry", self.shared.name),
        };
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, why).with_code("engine_unavailable")
    }
}

impl Drop for IsolatedEngine {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        if let Some(w) = self.shared.link().writer.take() {
            // The child ends when its socket does; the supervisor reaps it.
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
        if let Some(t) = self.supervisor.take() {
            let _ = t.join();
        }
    }
}

/// Route the child's frames until its socket ends; then reap it and restart it, or give up.
fn supervise(shared: &Shared, command: &WorkerCommand, mut child: Child, mut reader: UnixStream) {
    let mut crashes: VecDeque<Instant> = VecDeque::new();
    loop {
        while let Ok(Some(msg)) = read_frame::<FromWorker>(&mut reader) {
            route(shared, msg);
        }
        let closing = shared.closing.load(Ordering::Acquire);
        let status = reap(&mut child, closing);
        if closing {
            return;
        }
        let crashed = Instant::now();
        let why = format!("the engine process of '{}' {}", shared.name, describe(status));
        eprintln!("{why}");
        crashes.push_back(crashed);
        while crashes.front().is_some_and(|t| crashed.duration_since(*t) > RESTART_WINDOW) {
            crashes.pop_front();
        }
        let restart = crashes.len() <= MAX_RESTARTS;
        {
            let mut link = shared.link();
            fail_open(&mut link, &why);
            link.writer = None;
            link.pid = None;
            link.health = match restart {
                true => EngineHealth::Restarting,
                false => EngineHealth::Down(format!("{} crashes within {} s", crashes.len(), RESTART_WINDOW.as_secs())),
            };
        }
        shared.changed.notify_all();
        if !restart {
            eprintln!("the engine of '{}' crashed too often; it stays down", shared.name);
            return;
        }
        let started = start_child(command).and_then(|(c, mut socket, _)| {
            let mut r = socket.try_clone().map_err(|e| format!("cannot share the engine socket: {e}"))?;
            restore_adapters(shared, &mut socket, &mut r);
            Ok((c, socket, r))
        });
        let mut link = shared.link();
        match started {
            Ok((c, socket, r)) if !shared.closing.load(Ordering::Acquire) => {
                link.pid = Some(c.id());
                link.writer = Some(socket);
                link.health = EngineHealth::Running;
                link.last_restart = Some(crashed.elapsed());
                eprintln!(
                    "restarted the engine of '{}' in {:.0} ms",
                    shared.name,
                    crashed.elapsed().as_secs_f64() * 1e3
                );
                (child, reader) = (c, r);
            }
            Ok((mut c, _, _)) => {
                drop(link);
                reap(&mut c, true);
                return;
            }
            Err(e) => {
                link.health = EngineHealth::Down(format!("restarting failed: {e}"));
                drop(link);
                shared.changed.notify_all();
                return;
            }
        }
        drop(link);
        shared.changed.notify_all();
    }
}

fn route(shared: &Shared, msg: FromWorker) {
    let mut link = shared.link();
    match msg {
        FromWorker::Accepted { id } => {
            if let Some(ack) = link.pending.remove(&id) {
                let _ = ack.send(Ok(()));
            }
        }
        FromWorker::Rejected { id, error } => {
            link.streams.remove(&id);
            if let Some(ack) = link.pending.remove(&id) {
                let _ = ack.send(Err(error.into()));
            }
        }
        FromWorker::Output { id, output } => {
            let Some(open) = link.streams.get_mut(&id) else { return };
            if output.finished.is_some() {
                open.unfinished.remove(&output.choice);
            }
            let done = open.unfinished.is_empty();
            let _ = open.tx.send(output);
            if done {
                link.streams.remove(&id);
            }
        }
        FromWorker::Metrics { values } => {
            for (field, v) in metric_fields(&shared.metrics).iter().zip(values) {
                field.store(v, Ordering::Relaxed);
            }
        }
        FromWorker::AdapterDone { id, error } => {
            if let Some(ack) = link.pending.remove(&id) {
                let _ = ack.send(error.map_or(Ok(()), |e| Err(e.into())));
            }
        }
        FromWorker::Ready { .. } => {}
    }
}

/// Load the adapters the crashed child had into its successor (before it takes requests);
/// one that no longer loads is dropped with a message (its requests then get 404).
fn restore_adapters(shared: &Shared, writer: &mut UnixStream, reader: &mut UnixStream) {
    let adapters = shared.link().adapters.clone();
    for (name, path) in adapters {
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let load = ToWorker::LoadAdapter { id, name: name.clone(), path: path.clone() };
        let mut answer = None;
        if write_frame(writer, &load).is_ok() {
            while let Ok(Some(msg)) = read_frame::<FromWorker>(reader) {
                match msg {
                    FromWorker::AdapterDone { id: done, error } if done == id => {
                        answer = Some(error.map(|e| e.message));
                        break;
                    }
                    other => route(shared, other),
                }
            }
        }
        match answer {
            Some(None) => eprintln!("reloaded LoRA adapter '{name}' into the engine of '{}'", shared.name),
            Some(Some(why)) => {
                eprintln!("cannot reload LoRA adapter '{name}' into the engine of '{}': {why}", shared.name);
                shared.link().adapters.retain(|(n, _)| *n != name);
            }
            // The child died again: the routing loop sees its socket end.
            None => return,
        }
    }
}

/// End every open request of a dead child with an error output per unfinished choice.
fn fail_open(link: &mut Link, why: &str) {
    link.pending.clear();
    for (_, open) in link.streams.drain() {
        for choice in open.unfinished {
            let _ = open.tx.send(Output::end(choice, Finished::error(why.to_string(), Default::default()), 0));
        }
    }
}

/// Wait for the child to exit; one being unloaded gets `EXIT_GRACE` before it is killed, and
/// one whose socket ended while it still runs is killed at once.
fn reap(child: &mut Child, closing: bool) -> Option<ExitStatus> {
    let deadline = Instant::now() + if closing { EXIT_GRACE } else { Duration::from_millis(500) };
    while Instant::now() < deadline {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(_) => break,
        }
    }
    let _ = child.kill();
    child.wait().ok()
}

fn describe(status: Option<ExitStatus>) -> String {
    match status {
        Some(s) => match (s.code(), s.signal()) {
            (_, Some(sig)) => format!("was killed by signal {sig}"),
            (Some(code), None) => format!("exited with status {code}"),
            (None, None) => "ended".into(),
        },
        None => "ended and could not be reaped".into(),
    }
}

/// Start the child and wait for its `Ready`: (the child, its socket, its engine's limits).
fn start_child(command: &WorkerCommand) -> Result<(Child, UnixStream, Limits), String> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!(
        "ferrite-engine-{}-{}.sock",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    let accepted = accept_child(command, &listener, &path);
    let _ = std::fs::remove_file(&path);
    let (mut child, mut socket) = accepted?;
    match read_frame::<FromWorker>(&mut socket) {
        Ok(Some(FromWorker::Ready { limits })) => Ok((child, socket, limits)),
        _ => {
            let status = reap(&mut child, false);
            Err(format!("the engine process {} before it was ready", describe(status)))
        }
    }
}

fn accept_child(
    command: &WorkerCommand,
    listener: &UnixListener,
    path: &std::path::Path,
) -> Result<(Child, UnixStream), String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut child = Command::new(&command.program)
        .args(&command.args)
        .arg("--socket")
        .arg(path)
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", command.program.display()))?;
    loop {
        match listener.accept() {
            Ok((socket, _)) => {
                socket.set_nonblocking(false).map_err(|e| e.to_string())?;
                return Ok((child, socket));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(format!("the engine process {} while loading", describe(Some(status))));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("cannot accept the engine process: {e}"));
            }
        }
    }
}
