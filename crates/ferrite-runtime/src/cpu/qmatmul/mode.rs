//! Which kernels `cpu::linear` uses for non-f32 weights: a process-wide `KernelMode`, set with
//! `set_kernel_mode` or, until then, read once from the `FERRITE_KERNELS` environment variable
//! (`auto`, `avx512vnni`, `avxvnni`, `avx2`, `scalar` or `reference`; unset means `auto`).
//!
//! `Reference` is the exact path (weights dequantized to f32 by `quant::dequantize_row`, f32
//! products); the other modes run the fast kernels at one instruction-set level. A level the
//! CPU lacks falls back to the best one below it that it has.

use std::sync::atomic::{AtomicU8, Ordering};

use super::isa::Level;

/// How `cpu::linear` multiplies by quantized, f16 or bf16 weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelMode {
    /// The fast kernels at the best level this CPU has.
    Auto,
    Avx512Vnni,
    AvxVnni,
    Avx2,
    /// The fast kernels' math (15-bit activations, integer block dots) in portable Rust.
    Scalar,
    /// Dequantize weights to f32 and multiply in f32: exact, slow.
    Reference,
}

/// The variable read when no mode was set.
pub const KERNELS_ENV: &str = "FERRITE_KERNELS";

const UNSET: u8 = u8::MAX;
static MODE: AtomicU8 = AtomicU8::new(UNSET);

const MODES: [(KernelMode, &str); 6] = [
    (KernelMode::Auto, "auto"),
    (KernelMode::Avx512Vnni, "avx512vnni"),
    (KernelMode::AvxVnni, "avxvnni"),
    (KernelMode::Avx2, "avx2"),
    (KernelMode::Scalar, "scalar"),
    (KernelMode::Reference, "reference"),
];

impl KernelMode {
    pub fn name(self) -> &'static str {
        MODES.iter().find(|(m, _)| *m == self).map_or("auto", |(_, n)| n)
    }

    pub fn parse(s: &str) -> Option<KernelMode> {
        MODES.iter().find(|(_, n)| n.eq_ignore_ascii_case(s.trim())).map(|(m, _)| *m)
    }

    fn index(self) -> u8 {
        MODES.iter().position(|(m, _)| *m == self).unwrap_or(0) as u8
    }

    /// The level the fast kernels run at in this mode; `None` for `Reference`.
    pub fn level(self) -> Option<Level> {
        let wanted = match self {
            KernelMode::Auto => return Some(Level::best()),
            KernelMode::Reference => return None,
            KernelMode::Avx512Vnni => Level::Avx512Vnni,
            KernelMode::AvxVnni => Level::AvxVnni,
            KernelMode::Avx2 => Level::Avx2,
            KernelMode::Scalar => Level::Scalar,
        };
        Some(Level::ALL.into_iter().rev().find(|l| *l <= wanted && l.available()).unwrap_or(Level::Scalar))
    }
}

/// Use `mode` from now on, in every thread.
pub fn set_kernel_mode(mode: KernelMode) {
    MODE.store(mode.index(), Ordering::Relaxed);
}

/// The current mode (on first use, from `FERRITE_KERNELS`).
pub fn kernel_mode() -> KernelMode {
    let i = MODE.load(Ordering::Relaxed);
    if let Some((mode, _)) = MODES.get(usize::from(i)) {
        return *mode;
    }
    let mode = match std::env::var(KERNELS_ENV) {
        Ok(v) => KernelMode::parse(&v).unwrap_or_else(|| {
            let names: Vec<&str> = MODES.iter().map(|(_, n)| *n).collect();
            eprintln!("ferrite: ignoring {KERNELS_ENV}={v:?}; expected one of {}", names.join(", "));
            KernelMode::Auto
        }),
        Err(_) => KernelMode::Auto,
    };
    // A concurrent `set_kernel_mode` wins over the environment.
    let _ = MODE.compare_exchange(UNSET, mode.index(), Ordering::Relaxed, Ordering::Relaxed);
    MODES.get(usize::from(MODE.load(Ordering::Relaxed))).map_or(mode, |(m, _)| *m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for (mode, name) in MODES {
            assert_eq!(KernelMode::parse(name), Some(mode));
            assert_eq!(mode.name(), name);
        }
        assert_eq!(KernelMode::parse(" AVX2 "), Some(KernelMode::Avx2));
        assert_eq!(KernelMode::parse("sse"), None);
    }

    #[test]
    fn forced_levels_fall_back_to_available_ones() {
        assert_eq!(KernelMode::Reference.level(), None);
        assert_eq!(KernelMode::Scalar.level(), Some(Level::Scalar));
        for mode in [KernelMode::Auto, KernelMode::Avx512Vnni, KernelMode::AvxVnni, KernelMode::Avx2] {
            let level = mode.level().expect("a fast mode has a level");
            assert!(level.available(), "{mode:?} -> {level:?}");
        }
    }
}
