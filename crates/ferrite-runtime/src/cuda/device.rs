//! Which device runs the model: `--device auto|cpu|cuda[:N]`, and whether CUDA is here at all.
//!
//! The CUDA libraries are loaded at run time, so a binary built without CUDA runs on any
//! machine; on one without the NVIDIA driver, asking for CUDA is a clean error and `auto`
//! falls back to the CPU.

use std::fmt;
use std::str::FromStr;

use super::error::{CudaError, CudaResult};

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// CUDA device 0 when one is present, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda(usize),
}

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceChoice {
    type Err = CudaError;

    fn from_str(s: &str) -> CudaResult<DeviceChoice> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" | "gpu" => Ok(DeviceChoice::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| CudaError::BadDevice(s.to_string())),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// Error unless the CUDA driver library can be loaded and has the entry points start-up calls
/// (checked before any driver call: cudarc panics on a missing library or symbol, we must not;
/// a stub `libcuda.so` without them is reported, not run).
pub(crate) fn check_driver() -> CudaResult<()> {
    // SAFETY: only tries to dlopen the driver library by its usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::Unavailable("the NVIDIA driver library (libcuda.so) was not found".into()));
    }
    for symbol in ["cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDevicePrimaryCtxRetain"] {
        // SAFETY: the library is present (checked above), so `culib` loads it without
        // panicking; looking a symbol up calls nothing.
        let found = unsafe { cudarc::driver::sys::culib().get::<unsafe extern "C" fn()>(symbol.as_bytes()) }.is_ok();
        if !found {
            return Err(CudaError::Unavailable(format!(
                "the NVIDIA driver library (libcuda.so) has no {symbol}: a stub or broken driver install"
            )));
        }
    }
    Ok(())
}

/// Error unless NVRTC and cuBLASLt can be loaded too.
pub(crate) fn check_libraries() -> CudaResult<()> {
    check_driver()?;
    // SAFETY: as above, a dlopen attempt by name.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::Unavailable("NVRTC (libnvrtc.so) was not found".into()));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        return Err(CudaError::Unavailable("cuBLASLt (libcublasLt.so) was not found".into()));
    }
    Ok(())
}

/// Number of CUDA devices; an error when the driver is missing or fails to initialize.
pub fn cuda_device_count() -> CudaResult<usize> {
    check_driver()?;
    cudarc::driver::result::init()?;
    Ok(cudarc::driver::result::device::get_count()?.max(0) as usize)
}

/// (free, total) bytes of CUDA device `ordinal`'s memory, from a context opened for the query
/// alone (no kernels are compiled); an error naming what is missing when there is no such
/// device or no driver.
pub fn device_memory(ordinal: usize) -> CudaResult<(usize, usize)> {
    let count = cuda_device_count()?;
    if ordinal >= count {
        return Err(CudaError::NoSuchDevice { ordinal, count });
    }
    let ctx = cudarc::driver::CudaContext::new(ordinal)?;
    Ok(ctx.mem_get_info()?)
}

/// Resolve a choice to a device: `auto` is `cuda:0` when a CUDA device is present (the
/// driver and libraries load and report at least one device), the CPU otherwise.
pub fn resolve_device(choice: DeviceChoice) -> CudaResult<Device> {
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Auto => {
            let present = check_libraries().is_ok() && cuda_device_count().is_ok_and(|n| n > 0);
            Ok(if present { Device::Cuda(0) } else { Device::Cpu })
        }
        DeviceChoice::Cuda(ordinal) => {
            check_libraries()?;
            let count = cuda_device_count()?;
            if ordinal >= count {
                return Err(CudaError::NoSuchDevice { ordinal, count });
            }
            Ok(Device::Cuda(ordinal))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_choices() {
        assert_eq!("auto".parse::<DeviceChoice>().unwrap(), DeviceChoice::Auto);
        assert_eq!("CPU".parse::<DeviceChoice>().unwrap(), DeviceChoice::Cpu);
        assert_eq!("cuda".parse::<DeviceChoice>().unwrap(), DeviceChoice::Cuda(0));
        assert_eq!("cuda:3".parse::<DeviceChoice>().unwrap(), DeviceChoice::Cuda(3));
        for bad in ["cuda:", "cuda:x", "tpu", "cuda:-1"] {
            assert!(matches!(bad.parse::<DeviceChoice>(), Err(CudaError::BadDevice(_))), "{bad}");
        }
    }

    #[test]
    fn resolving_never_panics() {
        // On a machine without CUDA, auto is the CPU and an explicit CUDA device is an error;
        // with CUDA, both name a device.
        match resolve_device(DeviceChoice::Auto).unwrap() {
            Device::Cpu => assert!(resolve_device(DeviceChoice::Cuda(0)).is_err()),
            Device::Cuda(0) => assert_eq!(resolve_device(DeviceChoice::Cuda(0)).unwrap(), Device::Cuda(0)),
            other => panic!("auto resolved to {other}"),
        }
        assert_eq!(resolve_device(DeviceChoice::Cpu).unwrap(), Device::Cpu);
        assert!(resolve_device(DeviceChoice::Cuda(1 << 20)).is_err());
    }
}
