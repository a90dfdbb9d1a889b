//! Start-up kernel compilation: our `.cu` sources through NVRTC for the device's architecture,
//! cached on disk.
//!
//! Each source (with the shared `common.cuh` prepended) is one module; `quant.cuh` (with the
//! experts' `moe_gemm.cuh`) is one module per GGUF block type it is instantiated for and one per
//! MLX code width, and two more for the experts' products over bf16 weights (`moe_bf16`) and
//! FP8 rows (`moe_fp8`, with `moe_fp8.cuh`); each
//! attention kernel is one module per KV cache format (`kv_format.cuh`, with `KV_FMT` defined).
//! For an architecture NVRTC knows (sm_90a on Hopper) it yields a cubin; for a newer device it
//! yields PTX for the newest architecture NVRTC has, which the driver compiles. Images are cached under
//! `$FERRITE_HOME/kernels/` keyed by the SHA-256 of (module name, full source, options, NVRTC
//! version); a file is `sha256(image) ‖ image`, written to a temporary name and renamed, so a
//! torn or corrupt file is a miss, never a bad load. A cache that cannot be written costs
//! only the next start's compile time, and the report says why.

use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};
use std::time::Instant;

use cudarc::nvrtc::{result as nvrtc, sys};
use sha2::{Digest, Sha256};

use super::error::{CudaError, CudaResult};

const COMMON: &str = include_str!("kernels/common.cuh");

/// One kernel module: a name and its source (without the common prelude).
pub(crate) struct Source {
    pub name: &'static str,
    pub code: &'static str,
}

macro_rules! sources {
    ($($name:literal),* $(,)?; quant: $($q:literal),* $(,)?; kv: $(($kv:literal, $file:literal, $fmt:literal)),* $(,)?) => {
        &[
            $(Source { name: $name, code: include_str!(concat!("kernels/", $name, ".cu")) },)*
            // One module per block type (GGUF, MLX code width): the shared sources instantiated
            // for it (its matrix kernels and the routed experts' products).
            $(Source {
                name: concat!("quant_", $q),
                code: concat!(
                    include_str!("kernels/quant.cuh"),
                    include_str!("kernels/moe_gemm.cuh"),
                    "\nQUANT_KERNELS(", $q, ")\nMOE_KERNELS(", $q, ")\n"
                ),
            },)*
            // The routed experts' products over bf16 weights.
            Source {
                name: "moe_bf16",
                code: concat!(
                    include_str!("kernels/quant.cuh"),
                    include_str!("kernels/moe_gemm.cuh"),
                    "\nMOE_KERNELS(bf16w)\n"
                ),
            },
            // The routed experts' products over FP8 rows (e4m3 codes and their scale runs).
            Source {
                name: "moe_fp8",
                code: concat!(
                    include_str!("kernels/quant.cuh"),
                    include_str!("kernels/moe_gemm.cuh"),
                    include_str!("kernels/moe_fp8.cuh"),
                    "\nMOE_KERNELS(e4m3_rows)\n"
                ),
            },
            // The KV write kernels (every format).
            Source {
                name: "kv_write",
                code: concat!(include_str!("kernels/kv_format.cuh"), include_str!("kernels/kv_write.cu")),
            },
            // One module per attention kernel and KV cache format (`KV_FMT`, kv_format.cuh), the
            // same kernel names in each.
            $(Source {
                name: $kv,
                code: concat!("#define KV_FMT ", $fmt, "\n", include_str!("kernels/kv_format.cuh"),
                    include_str!(concat!("kernels/", $file, ".cu"))),
            },)*
        ]
    };
}

pub(crate) const SOURCES: &[Source] = sources![
    "embedding",
    "norm",
    "rope",
    "activation",
    "copy",
    "sampling",
    "init",
    "gemv",
    "gemma",
    "moe",
    "lora",
    "fp8",
    "deltanet";
    quant: "q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k", "mlx4", "mlx8";
    // Formats in `KV_FORMATS` order: bf16, int8, int4, fp8.
    kv: ("paged_attention", "paged_attention", "0"),
        ("paged_attention_int8", "paged_attention", "1"),
        ("paged_attention_int4", "paged_attention", "2"),
        ("paged_attention_fp8", "paged_attention", "3"),
        ("prefill_attention", "prefill_attention", "0"),
        ("prefill_attention_int8", "prefill_attention", "1"),
        ("prefill_attention_int4", "prefill_attention", "2"),
        ("prefill_attention_fp8", "prefill_attention", "3"),
];

/// What NVRTC is asked to produce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    /// The `--gpu-architecture` value: `sm_90a`, `sm_89`, or `compute_NN` for PTX.
    pub arch: String,
    /// A cubin (sm_*) rather than PTX (compute_*).
    pub cubin: bool,
}

/// A compiled module, ready for the driver.
pub(crate) enum Image {
    Cubin(Vec<u8>),
    Ptx(String),
}

/// What start-up compilation did.
#[derive(Debug, Clone)]
pub struct CompileReport {
    pub arch: String,
    pub nvrtc_version: (i32, i32),
    /// Modules compiled by NVRTC in this process.
    pub compiled: usize,
    /// Modules read from the disk cache.
    pub cached: usize,
    /// Wall time until every module was an image (compiled in parallel, or read).
    pub seconds: f64,
    pub cache_dir: Option<PathBuf>,
    /// Why the cache was not used or not written, when that happened.
    pub cache_note: Option<String>,
}

/// `$FERRITE_HOME/kernels` (`FERRITE_HOME` defaults to `~/.cache/ferrite`).
pub fn default_kernel_cache_dir() -> PathBuf {
    let home = std::env::var_os("FERRITE_HOME").map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(".")).join(".cache").join("ferrite")
    });
    home.join("kernels")
}

pub(crate) fn nvrtc_version() -> CudaResult<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-pointers to live integers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result().map_err(|e| CudaError::Nvrtc(e.to_string()))?;
    Ok((major, minor))
}

fn supported_archs() -> CudaResult<Vec<i32>> {
    let mut n = 0;
    // SAFETY: out-pointers sized by the count NVRTC reports first.
    unsafe {
        sys::nvrtcGetNumSupportedArchs(&mut n).result().map_err(|e| CudaError::Nvrtc(e.to_string()))?;
        let mut archs = vec![0; n.max(0) as usize];
        sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()).result().map_err(|e| CudaError::Nvrtc(e.to_string()))?;
        Ok(archs)
    }
}

/// The target for a device of compute capability `(major, minor)`.
pub(crate) fn target_for(cc: (i32, i32)) -> CudaResult<Target> {
    let want = cc.0 * 10 + cc.1;
    let archs = supported_archs()?;
    if archs.contains(&want) {
        // The `a` variant unlocks Hopper's own instructions (wgmma, setmaxnreg).
        let suffix = if want == 90 { "a" } else { "" };
        return Ok(Target { arch: format!("sm_{want}{suffix}"), cubin: true });
    }
    match archs.iter().copied().filter(|&a| a <= want).max() {
        Some(a) => Ok(Target { arch: format!("compute_{a}"), cubin: false }),
        None => {
            Err(CudaError::Unsupported(format!("compute capability {}.{} is older than NVRTC supports", cc.0, cc.1)))
        }
    }
}

fn options(target: &Target) -> Vec<String> {
    vec![format!("--gpu-architecture={}", target.arch), "-std=c++17".into()]
}

/// Compile every module for `target`, reading and filling the cache in `cache_dir`.
pub(crate) fn build_all(target: &Target, cache_dir: Option<&Path>) -> CudaResult<(Vec<Image>, CompileReport)> {
    let start = Instant::now();
    let version = nvrtc_version()?;
    let mut note = None;
    let dir = cache_dir.and_then(|d| match std::fs::create_dir_all(d) {
        Ok(()) => Some(d),
        Err(e) => {
            note = Some(format!("kernel cache {} unusable: {e}", d.display()));
            None
        }
    });
    let results: Vec<CudaResult<(Image, bool, Option<String>)>> = std::thread::scope(|s| {
        let handles: Vec<_> =
            SOURCES.iter().map(|src| s.spawn(move || load_or_compile(src, target, version, dir))).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(CudaError::Nvrtc("a compile thread panicked".into()))))
            .collect()
    });
    let mut images = Vec::with_capacity(results.len());
    let (mut compiled, mut cached) = (0, 0);
    for r in results {
        let (image, hit, why) = r?;
        if hit {
            cached += 1;
        } else {
            compiled += 1;
        }
        note = note.or(why);
        images.push(image);
    }
    let report = CompileReport {
        arch: target.arch.clone(),
        nvrtc_version: version,
        compiled,
        cached,
        seconds: start.elapsed().as_secs_f64(),
        cache_dir: dir.map(Path::to_path_buf),
        cache_note: note,
    };
    Ok((images, report))
}

/// The module's image from the cache (`true`) or from NVRTC (`false`), and a note when the
/// cache could not be written.
fn load_or_compile(
    src: &Source,
    target: &Target,
    version: (i32, i32),
    dir: Option<&Path>,
) -> CudaResult<(Image, bool, Option<String>)> {
    let code = format!("{COMMON}\n{}", src.code);
    let opts = options(target);
    let mut h = Sha256::new();
    for part in [src.name, &code, &opts.join(" "), &format!("nvrtc {}.{}", version.0, version.1)] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    let key: String = h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect();
    let ext = if target.cubin { "cubin" } else { "ptx" };
    let path = dir.map(|d| d.join(format!("{}-{}-{key}.{ext}", src.name, target.arch)));
    if let Some(bytes) = path.as_deref().and_then(read_checked) {
        return Ok((to_image(bytes, target.cubin)?, true, None));
    }
    let bytes = compile(src.name, &code, &opts, target)?;
    let note = path.and_then(|p| write_atomic(&p, &bytes).err().map(|e| format!("kernel cache {}: {e}", p.display())));
    Ok((to_image(bytes, target.cubin)?, false, note))
}

fn to_image(bytes: Vec<u8>, cubin: bool) -> CudaResult<Image> {
    if cubin {
        Ok(Image::Cubin(bytes))
    } else {
        String::from_utf8(bytes).map(Image::Ptx).map_err(|_| CudaError::Nvrtc("PTX is not UTF-8".into()))
    }
}

fn read_checked(path: &Path) -> Option<Vec<u8>> {
    let data = std::fs::read(path).ok()?;
    let (sum, body) = data.split_at_checked(32)?;
    (Sha256::digest(body).as_slice() == sum).then(|| body.to_vec())
}

fn write_atomic(path: &Path, body: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut data = Sha256::digest(body).to_vec();
    data.extend_from_slice(body);
    std::fs::write(&tmp, &data)?;
    std::fs::rename(&tmp, path)
}

/// Destroys an NVRTC program when dropped.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by `create_program` and is destroyed once, here.
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

fn c_text(raw: &[c_char]) -> String {
    // SAFETY: NVRTC returns NUL-terminated text; an empty buffer has no text.
    if raw.is_empty() {
        return String::new();
    }
    unsafe { CStr::from_ptr(raw.as_ptr()) }.to_string_lossy().into_owned()
}

/// NVRTC-compile one module to cubin or PTX bytes.
fn compile(name: &str, code: &str, opts: &[String], target: &Target) -> CudaResult<Vec<u8>> {
    let nul = |what: &str| CudaError::Nvrtc(format!("{what} of {name} holds a NUL byte"));
    let src = CString::new(code).map_err(|_| nul("source"))?;
    let cname = CString::new(format!("{name}.cu")).map_err(|_| nul("name"))?;
    let prog = Program(nvrtc::create_program(&src, Some(&cname)).map_err(|e| CudaError::Nvrtc(e.to_string()))?);
    // SAFETY: `prog` is a live program; the option strings hold no NUL (built above).
    let compiled = unsafe { nvrtc::compile_program(prog.0, opts) };
    if compiled.is_err() {
        // SAFETY: as above.
        let log = unsafe { nvrtc::get_program_log(prog.0) }.map(|l| c_text(&l)).unwrap_or_default();
        return Err(CudaError::Compile { module: name.into(), arch: target.arch.clone(), log });
    }
    let err = |e: nvrtc::NvrtcError| CudaError::Nvrtc(format!("{name}: {e}"));
    if target.cubin {
        let mut size = 0usize;
        // SAFETY: out-pointer, then a buffer of the size NVRTC reported.
        unsafe {
            sys::nvrtcGetCUBINSize(prog.0, &mut size).result().map_err(err)?;
            let mut bin = vec![0u8; size];
            sys::nvrtcGetCUBIN(prog.0, bin.as_mut_ptr() as *mut c_char).result().map_err(err)?;
            Ok(bin)
        }
    } else {
        // SAFETY: `prog` compiled successfully.
        let ptx = unsafe { nvrtc::get_ptx(prog.0) }.map_err(err)?;
        Ok(c_text(&ptx).into_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every module compiles for the H200's target, and a second build reads them all back
    /// from the cache. Runs where NVRTC can be loaded (no GPU needed); skips elsewhere.
    /// `FERRITE_EXPECT_NVRTC` ("13.0") names the NVRTC version the run must have loaded
    /// (scripts/test.sh runs this test with two).
    #[test]
    fn kernels_compile_for_sm90a_and_cache() {
        // SAFETY: a dlopen attempt by name.
        if !unsafe { sys::is_culib_present() } {
            eprintln!("SKIP kernels_compile_for_sm90a_and_cache: NVRTC (libnvrtc.so) is not loadable here");
            return;
        }
        if let Ok(want) = std::env::var("FERRITE_EXPECT_NVRTC") {
            let (major, minor) = nvrtc_version().unwrap();
            assert_eq!(format!("{major}.{minor}"), want, "LD_LIBRARY_PATH loaded another NVRTC");
        }
        let dir = std::env::temp_dir().join(format!("ferrite-kernel-cache-test-{}", std::process::id()));
        let target = Target { arch: "sm_90a".into(), cubin: true };
        let (images, cold) = build_all(&target, Some(&dir)).unwrap();
        assert_eq!((images.len(), cold.compiled, cold.cached), (SOURCES.len(), SOURCES.len(), 0), "{cold:?}");
        assert!(images.iter().all(|i| matches!(i, Image::Cubin(b) if !b.is_empty())));
        let (_, warm) = build_all(&target, Some(&dir)).unwrap();
        assert_eq!((warm.compiled, warm.cached), (0, SOURCES.len()), "{warm:?}");
        eprintln!("NVRTC {:?}: cold {:.2} s, cached {:.3} s", cold.nvrtc_version, cold.seconds, warm.seconds);
        // A corrupt file is a miss, not a bad image.
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            std::fs::write(entry.path(), b"garbage").unwrap();
        }
        let (_, again) = build_all(&target, Some(&dir)).unwrap();
        assert_eq!(again.compiled, SOURCES.len());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
