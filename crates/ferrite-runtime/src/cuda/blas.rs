//! Dense GEMMs through cuBLASLt: `y[m, n] = x[m, k] · W[n, k]ᵀ (+ bias)`, W in the Hugging
//! Face layout (row-major `[out, in]`), bf16 inputs, f32 accumulation, bf16 or f32 output; or
//! FP8 (e4m3) inputs with a scale per output feature and one per token (cuBLASLt's outer-vector
//! scaling: `y[t, j] = sx[t] · sw[j] · Σ x[t, ·] W[j, ·]`), bf16 output (Hopper and Ada).
//!
//! cuBLASLt is column-major, so the product is computed as `yᵀ = W · xᵀ`: A = W read
//! transposed (stored k × n, ld k), B = xᵀ (k × m, ld k), D = yᵀ (n × m, ld n); the bias is
//! the epilogue's per-row (per output feature) vector. Descriptors, layouts and the heuristic's
//! algorithm are built once per shape and kept (a plan), so a call is one `cublasLtMatmul` on
//! the stream — cheap, and capturable in a CUDA graph. One 32 MiB workspace serves all calls.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use half::bf16;

use super::error::{CudaError, CudaResult};

/// NVIDIA's recommended cuBLASLt workspace on Hopper.
const WORKSPACE_BYTES: usize = 32 << 20;
/// `cublasOperation_t` values (the type lives in cuBLAS proper, which we do not load).
const CUBLAS_OP_N: i32 = 0;
const CUBLAS_OP_T: i32 = 1;

/// An element type cuBLASLt can write (and read a bias in).
pub trait GemmOutput: DeviceRepr {
    #[doc(hidden)]
    const TYPE: sys::cudaDataType;
}

impl GemmOutput for bf16 {
    const TYPE: sys::cudaDataType = sys::cudaDataType::CUDA_R_16BF;
}

impl GemmOutput for f32 {
    const TYPE: sys::cudaDataType = sys::cudaDataType::CUDA_R_32F;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PlanKey {
    m: usize,
    n: usize,
    k: usize,
    out: i32,
    bias: bool,
    /// e4m3 inputs with outer-vector scales (bf16 otherwise).
    fp8: bool,
}

/// The scales of an FP8 product: one per token of x (`m`) and one per row of W (`n`).
pub struct Fp8Scales {
    pub x: u64,
    pub w: u64,
}

/// The cuBLASLt objects of one GEMM shape; destroyed on drop.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the handles are plain cuBLASLt objects with no thread affinity; `Blas` only touches
// them under its mutex.
unsafe impl Send for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each object was created by this plan and is destroyed once.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

pub(crate) struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
    plans: Mutex<HashMap<PlanKey, Plan>>,
}

// SAFETY: the handle is used under the plans mutex (every matmul holds it).
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        if let Ok(mut plans) = self.plans.lock() {
            plans.clear();
        }
        // SAFETY: the handle was created in `new` and is destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> CudaResult<()> {
    Ok(lt::set_matmul_desc_attribute(desc, attr, v as *const T as *const c_void, size_of::<T>())?)
}

impl Blas {
    pub fn new(stream: Arc<CudaStream>) -> CudaResult<Blas> {
        let handle = lt::create_handle()?;
        let workspace = stream.alloc_zeros::<u8>(WORKSPACE_BYTES)?;
        Ok(Blas { handle, workspace, stream, plans: Mutex::new(HashMap::new()) })
    }

    fn plan(&self, key: PlanKey) -> CudaResult<Plan> {
        use sys::cublasLtMatmulDescAttributes_t as D;
        let bf = sys::cudaDataType::CUDA_R_16BF;
        let out = if key.out == 0 { bf } else { sys::cudaDataType::CUDA_R_32F };
        let input = if key.fp8 { sys::cudaDataType::CUDA_R_8F_E4M3 } else { bf };
        let (m, n, k) = (key.m as u64, key.n as u64, key.k as u64);
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)?;
        // Own the objects at once, so an error below frees what exists.
        let mut plan = Plan {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        plan.a = lt::create_matrix_layout(input, k, n, k as i64)?;
        plan.b = lt::create_matrix_layout(input, k, m, k as i64)?;
        plan.d = lt::create_matrix_layout(out, n, m, n as i64)?;
        let epilogue = if key.bias {
            sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS
        } else {
            sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT
        };
        // SAFETY: live descriptors; each value has the type its attribute expects.
        unsafe {
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &CUBLAS_OP_T)?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &CUBLAS_OP_N)?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &(epilogue as u32))?;
            if key.fp8 {
                // A is W (its outer dimension the output features), B is xᵀ (the tokens).
                let outer = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F as u32;
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer)?;
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer)?;
                // Hopper's fast FP8 accumulation: the products' f32 sums are not promoted
                // every few k-steps (rel. error 2.1e-3 against 1.7e-3 measured on an H100 at
                // k = 4096, far under the per-token e4m3 rounding of x).
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &1i8)?;
                // The heuristic refuses scaled inputs without scale pointers (each call sets
                // its own): any device address stands in.
                let stand_in = self.workspace.device_ptr(&self.stream).0;
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &stand_in)?;
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &stand_in)?;
            }
            let pref = lt::create_matmul_pref()?;
            let ws = WORKSPACE_BYTES;
            let found = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const usize as *const c_void,
                size_of::<usize>(),
            )
            .and_then(|()| lt::get_matmul_algo_heuristic(self.handle, desc, plan.a, plan.b, plan.d, plan.d, pref));
            let _ = lt::destroy_matmul_pref(pref);
            plan.algo = found?.algo;
        }
        Ok(plan)
    }

    /// `y[m, n] = x[m, k] · w[n, k]ᵀ (+ bias[n])`, all row-major and contiguous.
    pub fn linear<O: GemmOutput>(
        &self,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        bias: Option<&dyn DevicePtr<O>>,
        y: &mut impl DevicePtrMut<O>,
        (m, n, k): (usize, usize, usize),
    ) -> CudaResult<()> {
        if x.len() < m * k || w.len() < n * k {
            return Err(CudaError::Shape(format!("linear m={m} n={n} k={k}: x {} w {}", x.len(), w.len())));
        }
        let s = &*self.stream;
        self.matmul(x.device_ptr(s).0, w.device_ptr(s).0, None, bias, y, (m, n, k))
    }

    /// `y[m, n] = (sx[m] · sw[n]ᵀ) ∘ (x[m, k] · w[n, k]ᵀ)` over e4m3 codes (x and w at the
    /// device addresses `x` and `w`, each 16-byte aligned, `m·k` and `n·k` bytes; the f32
    /// scales at `scales`), bf16 out (`O` must be bf16). cuBLASLt takes no bias epilogue with
    /// scaled FP8 inputs (INVALID_VALUE on an H100, cuBLAS 13.1) and no `n` off a multiple of
    /// 8 (NOT_SUPPORTED): `Self::fp8_shape` says which shapes it runs.
    pub fn linear_fp8<O: GemmOutput>(
        &self,
        (x, w): (u64, u64),
        scales: Fp8Scales,
        y: &mut impl DevicePtrMut<O>,
        (m, n, k): (usize, usize, usize),
    ) -> CudaResult<()> {
        if O::TYPE != sys::cudaDataType::CUDA_R_16BF {
            return Err(CudaError::Unsupported("an FP8 product with f32 output".into()));
        }
        if !Self::fp8_shape(n, k) || !x.is_multiple_of(16) || !w.is_multiple_of(16) {
            return Err(CudaError::Shape(format!("FP8 linear m={m} n={n} k={k}: shape or 16-byte alignment")));
        }
        self.matmul::<O>(x, w, Some(scales), None, y, (m, n, k))
    }

    /// Whether `linear_fp8` runs `n` outputs over `k` inputs: n a multiple of 8, k of 16.
    pub fn fp8_shape(n: usize, k: usize) -> bool {
        n.is_multiple_of(8) && k.is_multiple_of(16)
    }

    #[allow(clippy::too_many_arguments)]
    fn matmul<O: GemmOutput>(
        &self,
        xp: u64,
        wp: u64,
        scales: Option<Fp8Scales>,
        bias: Option<&dyn DevicePtr<O>>,
        y: &mut impl DevicePtrMut<O>,
        (m, n, k): (usize, usize, usize),
    ) -> CudaResult<()> {
        if m == 0 || n == 0 || k == 0 {
            return Err(CudaError::Shape(format!("linear of shape m={m} n={n} k={k}")));
        }
        if y.len() < m * n || bias.is_some_and(|b| b.len() < n) {
            return Err(CudaError::Shape(format!(
                "linear m={m} n={n} k={k}: y {} bias {:?}",
                y.len(),
                bias.map(|b| b.len())
            )));
        }
        let key = PlanKey {
            m,
            n,
            k,
            out: if O::TYPE == sys::cudaDataType::CUDA_R_16BF { 0 } else { 1 },
            bias: bias.is_some(),
            fp8: scales.is_some(),
        };
        let mut plans = self.plans.lock().map_err(|_| CudaError::Unsupported("cuBLASLt plans poisoned".into()))?;
        let plan = match plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(self.plan(key)?),
        };
        let (alpha, beta) = (1f32, 0f32);
        let s = &*self.stream;
        let ws = self.workspace.device_ptr(s).0;
        let yp = y.device_ptr_mut(s).0;
        // SAFETY: the plan's layouts match the checked buffer lengths; the bias and scale
        // pointers are set under the lock, right before the call that reads them.
        unsafe {
            use sys::cublasLtMatmulDescAttributes_t as D;
            if let Some(b) = bias {
                set_desc(plan.desc, D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &b.device_ptr(s).0)?;
            }
            if let Some(sc) = scales {
                set_desc(plan.desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sc.w)?;
                set_desc(plan.desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sc.x)?;
            }
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                wp as *const c_void,
                plan.a,
                xp as *const c_void,
                plan.b,
                yp as *const c_void,
                plan.d,
                yp as *mut c_void,
                plan.d,
                &plan.algo,
                ws as *mut c_void,
                WORKSPACE_BYTES,
                self.stream.cu_stream() as sys::cudaStream_t,
            )?;
        }
        Ok(())
    }
}
