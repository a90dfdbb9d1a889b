//! The CPU op set: plain functions over f32 activation slices and weight tensors.
//!
//! Activations are row-major `[tokens, features]` f32 slices; weights are `Tensor`s of any
//! supported dtype. Parallel loops run on the process-wide rayon pool (`threads`).

pub mod activation;
pub mod attention;
pub mod embedding;
pub mod gated_delta;
pub mod lora;
pub mod matmul;
pub mod norm;
pub mod qmatmul;
pub mod reduce;
pub mod rope;

pub use activation::{gelu_tanh_mul, silu_mul};
pub use attention::{paged_attention, write_kv, AttentionParams};
pub use embedding::embedding;
pub use lora::{lora_add, LoraPair};
pub use matmul::{linear, linear_many, prepare_linear};
pub use norm::{add_layer_norm, add_rms_norm, layer_norm, rms_norm, rms_norm_in_place};
pub use qmatmul::{kernel_mode, set_kernel_mode, KernelMode, Level};
pub use reduce::{argmax, log_softmax, softmax_in_place};
pub use rope::Rope;

/// A raw pointer that parallel workers use to write disjoint parts of one output slice.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut(pub *mut f32);
// SAFETY: every user writes a region no other worker touches, and the slice outlives the
// parallel scope that uses the pointer.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    #[inline]
    pub(crate) fn ptr(self) -> *mut f32 {
        self.0
    }
}
