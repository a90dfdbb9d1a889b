//! Where a sequence's outputs go (`Sink`): its request's channel. Driven on the caller's
//! thread, a core sends into it at once. The threaded `Engine` hands every send to one
//! streaming thread instead (`Streamer`), so a step never pays for waking the receivers —
//! a system call each time a receiver sleeps, one per row and step when every client waits
//! on its own thread (`ferrite bench throughput`), which at 256 rows took half of the engine
//! thread's time. All outputs of all requests pass through that thread's one queue in the
//! order they were sent, so each request's outputs keep theirs.

use std::sync::mpsc;

use tokio::sync::mpsc::UnboundedSender;

use crate::request::Output;

/// The receiver of a request's outputs is gone: its caller disconnected.
#[derive(Debug)]
pub(crate) struct Gone;

/// The queue of the thread that delivers outputs into their requests' channels; the thread
/// ends when the last handle is dropped.
#[derive(Clone)]
pub(crate) struct Streamer(mpsc::Sender<(UnboundedSender<Output>, Output)>);

impl Streamer {
    pub fn spawn() -> std::io::Result<Streamer> {
        let (tx, rx) = mpsc::channel::<(UnboundedSender<Output>, Output)>();
        std::thread::Builder::new().name("ferrite-stream".into()).spawn(move || {
            for (sink, out) in rx {
                // A receiver dropped since the send was queued: the next send finds it gone.
                let _ = sink.send(out);
            }
        })?;
        Ok(Streamer(tx))
    }
}

/// A sequence's output channel, and the streaming thread that writes into it, if any.
#[derive(Clone)]
pub(crate) struct Sink {
    tx: UnboundedSender<Output>,
    streamer: Option<Streamer>,
}

impl Sink {
    pub fn new(tx: UnboundedSender<Output>, streamer: Option<Streamer>) -> Sink {
        Sink { tx, streamer }
    }

    /// Send `out` (at once, or queued for the streaming thread); `Gone` when the receiver is.
    pub fn send(&self, out: Output) -> Result<(), Gone> {
        match &self.streamer {
            Some(_) if self.tx.is_closed() => Err(Gone),
            Some(s) => s.0.send((self.tx.clone(), out)).map_err(|_| Gone),
            None => self.tx.send(out).map_err(|_| Gone),
        }
    }
}
