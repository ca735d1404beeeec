//! Compiling CubeCL kernels to PTX with NVRTC and loading them, once per kernel id.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::PathBuf;

use cubecl_common::backtrace::BackTrace;
use cubecl_core::ExecutionMode;
use cubecl_core::ir::DeviceProperties;
use cubecl_core::prelude::CubeDim;
use cubecl_core::server::{LaunchError, ResourceLimitError};
use cubecl_runtime::compiler::{CompilationError, CubeTask};
use cubecl_runtime::id::KernelId;
use cubecl_runtime::validation::{validate_cube_dim, validate_units};
use cudarc::driver::sys::{CUfunction, CUfunction_attribute};

use super::CudaCompiler;
use cubecl_cpp::shared::CompilationOptions;

/// A kernel ready to launch.
#[derive(Debug, Clone, Copy)]
pub struct LoadedKernel {
    pub function: CUfunction,
    pub cube_dim: CubeDim,
    pub shared_memory: usize,
}

/// The kernels loaded on one device.
#[derive(Debug)]
pub struct Modules {
    arch: u32,
    options: CompilationOptions,
    kernels: HashMap<KernelId, LoadedKernel>,
}

fn compilation_error(reason: String) -> LaunchError {
    CompilationError::Generic {
        reason,
        backtrace: BackTrace::capture(),
    }
    .into()
}

/// `$CUDA_PATH` or `/usr/local/cuda`: NVRTC needs the toolkit headers.
fn cuda_root() -> PathBuf {
    std::env::var_os("CUDA_PATH")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/local/cuda"))
}

impl Modules {
    /// An empty cache for compute capability `arch`.
    pub fn new(arch: u32, options: CompilationOptions) -> Self {
        Self {
            arch,
            options,
            kernels: HashMap::new(),
        }
    }

    /// How kernels are compiled here.
    pub fn options(&self) -> &CompilationOptions {
        &self.options
    }

    /// The loaded kernel for `id`, compiling `task` on first use.
    pub fn get_or_load(
        &mut self,
        id: &KernelId,
        task: &dyn CubeTask<CudaCompiler>,
        mode: ExecutionMode,
        properties: &DeviceProperties,
    ) -> Result<LoadedKernel, LaunchError> {
        if let Some(kernel) = self.kernels.get(id) {
            return Ok(*kernel);
        }
        validate_cube_dim(properties, id)?;
        validate_units(properties, id)?;
        let compiled = task.compile(
            &mut Default::default(),
            &self.options,
            mode,
            task.address_type(),
        )?;
        let shared_memory = compiled.repr.as_ref().map_or(0, |r| r.shared_memory_size());
        let max = properties.hardware.max_shared_memory_size;
        if shared_memory > max {
            return Err(ResourceLimitError::SharedMemory {
                requested: shared_memory,
                max,
                backtrace: BackTrace::capture(),
            }
            .into());
        }
        let source = with_min_cubes(&compiled.entrypoint_name, &compiled.source);
        let ptx = self.compile_ptx(&source)?;
        dump(&compiled.entrypoint_name, &compiled.source, &ptx);
        let function = load(&ptx, &compiled.entrypoint_name, shared_memory)?;
        let kernel = LoadedKernel {
            function,
            cube_dim: compiled.cube_dim,
            shared_memory,
        };
        self.kernels.insert(id.clone(), kernel);
        Ok(kernel)
    }

    /// CUDA C++ to PTX for this GPU (`sm_90a` on Hopper, to allow its special instructions).
    fn compile_ptx(&self, source: &str) -> Result<Vec<std::ffi::c_char>, LaunchError> {
        let suffix = if self.arch >= 90 { "a" } else { "" };
        let arch = format!("--gpu-architecture=sm_{}{suffix}", self.arch);
        let include = cuda_root().join("include");
        let cccl = include.join("cccl");
        let include = format!("--include-path={}", include.display());
        let cccl_option = format!("--include-path={}", cccl.display());
        let mut options = vec![arch.as_str(), include.as_str(), "-lineinfo"];
        if cccl.exists() {
            options.push(cccl_option.as_str());
        }
        let source = CString::new(source).map_err(|e| compilation_error(e.to_string()))?;
        // SAFETY: NVRTC FFI on a program we create, compile, read and destroy here.
        unsafe {
            use cudarc::nvrtc::result as nvrtc;
            let program = nvrtc::create_program(source.as_c_str(), None)
                .map_err(|e| compilation_error(format!("nvrtcCreateProgram: {e:?}")))?;
            let compiled = nvrtc::compile_program(program, &options);
            let result = match compiled {
                Ok(()) => nvrtc::get_ptx(program)
                    .map_err(|e| compilation_error(format!("nvrtcGetPTX: {e:?}"))),
                Err(e) => {
                    let log = nvrtc::get_program_log(program)
                        .map(|log| CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned())
                        .unwrap_or_default();
                    Err(compilation_error(format!(
                        "NVRTC failed ({e:?}) for {}:\n{log}\n[source]\n{}",
                        self.arch,
                        source.to_string_lossy()
                    )))
                }
            };
            let _ = nvrtc::destroy_program(program);
            result
        }
    }
}

/// Kernels that need more cubes resident on an SM than the registers they would be given
/// allow: each entry point's prefix, and the cubes an SM should hold. CubeCL writes
/// `__launch_bounds__(threads)`; the second argument, a minimum of cubes per SM, makes the
/// register allocator fit that many.
const MIN_CUBES_PER_SM: [(&str, u32); 1] = [
    // Both layouts of a blockwise FP8 cast: 89 registers a thread left 2 cubes of 256
    // threads an SM to hide the loads across the kernel's two barriers.
    ("quantize_both_kernel", 3),
];

/// The minimum of cubes per SM for `entrypoint` ([`MIN_CUBES_PER_SM`]); for those kernels,
/// `BM_MIN_CUBES_PER_SM=<n>` asks for `n` instead (0: none), to measure another.
fn min_cubes_per_sm(entrypoint: &str) -> Option<u32> {
    let (_, cubes) = MIN_CUBES_PER_SM
        .iter()
        .find(|(prefix, _)| entrypoint.starts_with(prefix))?;
    let chosen = std::env::var("BM_MIN_CUBES_PER_SM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(*cubes);
    (chosen > 0).then_some(chosen)
}

/// `source` with `entrypoint`'s `__launch_bounds__(threads)` given its minimum of cubes per SM
/// ([`min_cubes_per_sm`]); unchanged for other kernels, or where the bound is not found.
fn with_min_cubes<'a>(entrypoint: &str, source: &'a str) -> Cow<'a, str> {
    match min_cubes_per_sm(entrypoint) {
        Some(cubes) => launch_bounds_with(entrypoint, source, cubes),
        None => Cow::Borrowed(source),
    }
}

/// `source` with `__launch_bounds__(threads)` right before `entrypoint` rewritten as
/// `__launch_bounds__(threads, cubes)`.
fn launch_bounds_with<'a>(entrypoint: &str, source: &'a str, cubes: u32) -> Cow<'a, str> {
    const BOUNDS: &str = "__launch_bounds__(";
    let Some(end) = source.find(&format!("){entrypoint}")) else {
        return Cow::Borrowed(source);
    };
    let Some(start) = source[..end].rfind(BOUNDS) else {
        return Cow::Borrowed(source);
    };
    let threads = &source[start + BOUNDS.len()..end];
    if threads.is_empty() || !threads.bytes().all(|b| b.is_ascii_digit()) {
        return Cow::Borrowed(source);
    }
    Cow::Owned(format!(
        "{}{BOUNDS}{threads}, {cubes}{}",
        &source[..start],
        &source[end..]
    ))
}

/// Loads `ptx` and returns its `entrypoint`, allowed `shared_memory` bytes of dynamic shared
/// memory (set once here rather than at every launch).
fn load(
    ptx: &[std::ffi::c_char],
    entrypoint: &str,
    shared_memory: usize,
) -> Result<CUfunction, LaunchError> {
    let name = CString::new(entrypoint).map_err(|e| compilation_error(e.to_string()))?;
    // SAFETY: `ptx` is NUL-terminated PTX from NVRTC; modules stay loaded for the process.
    unsafe {
        use cudarc::driver::result as driver;
        let module = driver::module::load_data(ptx.as_ptr() as *const _)
            .map_err(|e| compilation_error(format!("cuModuleLoadData: {e:?}")))?;
        let function = driver::module::get_function(module, name)
            .map_err(|e| compilation_error(format!("cuModuleGetFunction({entrypoint}): {e:?}")))?;
        driver::function::set_function_attribute(
            function,
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared_memory as i32,
        )
        .map_err(|e| compilation_error(format!("cuFuncSetAttribute: {e:?}")))?;
        if std::env::var_os("BM_KERNEL_INFO").is_some() {
            report_resources(function, entrypoint);
        }
        Ok(function)
    }
}

/// With `BM_KERNEL_INFO` set, prints each kernel's registers a thread, spilled (local)
/// bytes a thread and static shared bytes as it is loaded: what limits its occupancy.
///
/// # Safety
/// `function` is a loaded kernel.
unsafe fn report_resources(function: CUfunction, entrypoint: &str) {
    use cudarc::driver::result::function::get_function_attribute;
    use cudarc::driver::sys::CUfunction_attribute as Attribute;
    // SAFETY: queries on a loaded function.
    let get = |attribute| unsafe { get_function_attribute(function, attribute).unwrap_or(-1) };
    eprintln!(
        "KERNEL {entrypoint}: {} registers, {} local bytes, {} static shared bytes",
        get(Attribute::CU_FUNC_ATTRIBUTE_NUM_REGS),
        get(Attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
        get(Attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
    );
}

/// With `BM_DUMP_KERNELS=<dir>`, writes each kernel's CUDA source and PTX there as it is
/// compiled (`<entry point>.cu`, `.ptx`), to read the generated code or run `ptxas -v` on it.
fn dump(entrypoint: &str, source: &str, ptx: &[std::ffi::c_char]) {
    let Some(dir) = std::env::var_os("BM_DUMP_KERNELS") else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    let ptx: Vec<u8> = ptx
        .iter()
        .map(|&c| c as u8)
        .take_while(|&c| c != 0)
        .collect();
    let name: String = entrypoint.chars().take(120).collect();
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(dir.join(format!("{name}.cu")), source);
    let _ = std::fs::write(dir.join(format!("{name}.ptx")), ptx);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_launch_bounds_get_a_minimum_of_cubes() {
        let source =
            "extern \"C\" __global__ void __launch_bounds__(256)quantize_both_kernel_f_bf16 (\n";
        assert_eq!(
            launch_bounds_with("quantize_both_kernel_f_bf16", source, 3),
            "extern \"C\" __global__ void __launch_bounds__(256, 3)quantize_both_kernel_f_bf16 (\n"
        );
        // Another kernel's name, or no bound, leaves the source as it is.
        assert_eq!(launch_bounds_with("other", source, 3), source);
        let unbounded = "extern \"C\" __global__ void quantize_both_kernel_f_bf16 (\n";
        assert_eq!(
            launch_bounds_with("quantize_both_kernel_f_bf16", unbounded, 3),
            unbounded
        );
        assert!(min_cubes_per_sm("copy_kernel_t_bf16_n_8").is_none());
    }
}
