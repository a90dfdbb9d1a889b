//! Rows whose KV turned quantized at their delayed start in this schedule: their blocks'
//! values go from the full-precision twin pools into the blocks the transition gave them
//! (`kv/transition.rs`), before the step that reads them is built.

use super::EngineCore;
use crate::error::EngineError;

impl EngineCore {
    /// Convert the blocks of the rows that turned quantized this schedule into their new
    /// blocks, then release the full-precision ones (`kv/transition.rs`). Their hash chains
    /// start over, so what they publish to the SSD tier does too.
    pub(super) fn convert_turned(&mut self) -> Result<(), EngineError> {
        for s in &mut self.sched.running {
            let moves = s.kv.pending_moves();
            if moves.iter().all(Vec::is_empty) {
                continue;
            }
            let converted = moves.iter().enumerate().try_for_each(|(g, m)| self.kv.convert_blocks(g, m));
            self.kvm.end_transition(&mut s.kv);
            s.tier.published = 0;
            converted?;
            self.metrics.add_transition(moves.iter().map(Vec::len).sum::<usize>() as u64);
        }
        Ok(())
    }
}
