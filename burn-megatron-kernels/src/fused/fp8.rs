//! The FP8 linear layers' casts: the largest magnitude of a tensor (its *amax*, from which the
//! scale is computed on the device) and the scaled, saturating cast to E4M3 or E5M2, row-major
//! or transposed (cuBLASLt's FP8 GEMM takes both operands K-contiguous, so the weight gradient's
//! operands are the transposed casts of `x` and `dy`).
//!
//! The FP8 values are stored as bytes: Burn 0.21 has no FP8 dtype, so a quantised tensor is a
//! `U8` tensor that only the FP8 GEMM (`cuda::gemm::gemm_fp8`) reads. The casts compute the
//! bits themselves (`fp8_bits`), so they run on any runtime with 8-bit storage.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, zeros_client};
use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::{ElemType, FloatKind, UIntKind};
use cubecl::prelude::*;

use super::vectors::{THREADS, launch_shape, vector_width};

/// An FP8 format (OCP 8-bit floating point).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Kind {
    /// 4 exponent bits, 3 mantissa bits, largest finite value 448: activations and weights.
    E4M3,
    /// 5 exponent bits, 2 mantissa bits, largest finite value 57 344: gradients.
    E5M2,
}

impl Fp8Kind {
    /// The largest finite value.
    pub const fn max(self) -> f32 {
        match self {
            Fp8Kind::E4M3 => 448.0,
            Fp8Kind::E5M2 => 57344.0,
        }
    }

    /// The value of the FP8 bits `bits` (NaN for a NaN encoding): for host-side checks.
    pub fn decode(self, bits: u8) -> f64 {
        match self {
            Fp8Kind::E4M3 => cubecl::e4m3::from_bits(bits).to_f64(),
            Fp8Kind::E5M2 => cubecl::e5m2::from_bits(bits).to_f64(),
        }
    }

    /// The bits of `x` saturated to `±max` and rounded to the nearest value (ties to even), as
    /// [`quantize`] computes them: the host-side reference.
    pub fn encode(self, x: f64) -> u8 {
        let max = self.max() as f64;
        let x = if x > max {
            max
        } else if x < -max {
            -max
        } else {
            x
        };
        match self {
            Fp8Kind::E4M3 => cubecl::e4m3::from_f64(x).to_bits(),
            Fp8Kind::E5M2 => cubecl::e5m2::from_f64(x).to_bits(),
        }
    }
}

/// What a cast writes: FP8 bits, or (on a runtime without FP8 conversions) the values the
/// rounding would start from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CastTarget {
    /// The FP8 bits of `kind` in a `U8` tensor: what the FP8 GEMM reads.
    Fp8(Fp8Kind),
    /// `x · scale` saturated to `±max`, unrounded, in an f32 tensor: the same kernels, tiles
    /// and layouts with any bound, for the tests.
    F32 {
        /// The saturation bound (an FP8 format's [`Fp8Kind::max`] in the tests).
        max: f32,
    },
    /// The FP8 bits of `kind`, one a `u32`: the same kernels on a runtime without 8-bit
    /// storage (WGSL: lavapipe in CI), where the tests check the bits.
    Fp8InU32(Fp8Kind),
}

impl From<Fp8Kind> for CastTarget {
    fn from(kind: Fp8Kind) -> Self {
        CastTarget::Fp8(kind)
    }
}

impl CastTarget {
    pub(super) fn max(self) -> f32 {
        match self {
            CastTarget::Fp8(kind) | CastTarget::Fp8InU32(kind) => kind.max(),
            CastTarget::F32 { max } => max,
        }
    }

    /// The element the cast kernels write: the FP8 bits (see [`fp8_bits`]) as `u8` or `u32`,
    /// or the values as f32.
    pub(super) fn storage(self) -> StorageType {
        let elem = match self {
            CastTarget::Fp8(_) => ElemType::UInt(UIntKind::U8),
            CastTarget::Fp8InU32(_) => ElemType::UInt(UIntKind::U32),
            CastTarget::F32 { .. } => ElemType::Float(FloatKind::F32),
        };
        StorageType::Scalar(elem)
    }

    /// Whether the target's FP8 bits are E5M2's (`Some(false)`: E4M3's; `None`: values).
    pub(super) fn is_e5m2(self) -> Option<bool> {
        match self {
            CastTarget::Fp8(kind) | CastTarget::Fp8InU32(kind) => Some(kind == Fp8Kind::E5M2),
            CastTarget::F32 { .. } => None,
        }
    }

    /// What the cast kernels write ([`encode`]): values, or the bits of a format.
    fn format(self) -> u32 {
        match self {
            CastTarget::Fp8(kind) | CastTarget::Fp8InU32(kind) => match kind {
                Fp8Kind::E4M3 => E4M3_BITS,
                Fp8Kind::E5M2 => E5M2_BITS,
            },
            CastTarget::F32 { .. } => VALUES,
        }
    }

    pub(super) fn dtype(self) -> DType {
        match self {
            CastTarget::Fp8(_) => DType::U8,
            CastTarget::Fp8InU32(_) => DType::U32,
            CastTarget::F32 { .. } => DType::F32,
        }
    }
}

/// Cubes of the amax's first stage at most: each thread walks the tensor with a grid-wide
/// stride, so that the second stage has few partial maxima to reduce.
const AMAX_CUBES: usize = 1024;

/// The largest of the cube's `best` values (bits of non-negative f32s, which order as
/// integers), by a tree in shared memory; valid in the cube's first thread. The cube has
/// [`THREADS`] threads (a power of two), in one dimension or two.
#[cube]
pub(super) fn cube_max(best: u32) -> u32 {
    let tid = UNIT_POS as usize;
    let mut shared = SharedMemory::<u32>::new(THREADS as usize);
    shared[tid] = best;
    sync_cube();
    // From the cube's size, not the `THREADS` constant: a loop may only change a runtime value.
    let mut step = CUBE_DIM as usize / 2;
    while step > 0 {
        // Nested, not `&&`: a kernel evaluates both sides, and the right one would read past
        // the shared memory for `tid >= step`.
        #[allow(clippy::collapsible_if)]
        if tid < step {
            if shared[tid + step] > shared[tid] {
                shared[tid] = shared[tid + step];
            }
        }
        sync_cube();
        step /= 2;
    }
    shared[0]
}

/// Stage one: `max |x|` over each cube's share of `x`, as f32 bits, into `partials[cube]`. A
/// NaN's magnitude has larger bits than infinity's, so a tensor holding a NaN has a NaN amax.
#[cube(launch)]
fn amax_partials_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    partials: &mut Tensor<u32>,
    vectors: u32,
    #[define(F)] _dtype: StorageType,
) {
    let stride = CUBE_COUNT_X * CUBE_DIM_X;
    let mut i = CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X;
    let mut best = 0u32;
    while i < vectors {
        let v = x[i as usize];
        #[unroll]
        for k in 0..N::value() {
            let bits = u32::reinterpret(f32::abs(f32::cast_from(v[k])));
            if bits > best {
                best = bits;
            }
        }
        i += stride;
    }
    let total = cube_max(best);
    if UNIT_POS_X == 0 {
        partials[CUBE_POS_X as usize] = total;
    }
}

/// The largest of the `count` partial maxima, by one cube: valid in its first thread.
#[cube]
fn partials_max(partials: &Tensor<u32>, count: u32) -> u32 {
    let mut i = UNIT_POS_X;
    let mut best = 0u32;
    while i < count {
        let bits = partials[i as usize];
        if bits > best {
            best = bits;
        }
        i += CUBE_DIM_X;
    }
    cube_max(best)
}

/// Stage two: the largest of the `count` partial maxima, by one cube, into `out[0]`.
#[cube(launch)]
fn amax_total_kernel(partials: &Tensor<u32>, out: &mut Tensor<u32>, count: u32) {
    let total = partials_max(partials, count);
    if UNIT_POS_X == 0 {
        out[0] = total;
    }
}

/// Stage two of [`amax_scale`]: [`amax_total_kernel`]'s amax into `out[0]`, and from it, in
/// the same thread, the tensorwise scale and its reciprocal (as [`tensorwise_scale_kernel`]).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn amax_total_scale_kernel(
    partials: &Tensor<u32>,
    out: &mut Tensor<u32>,
    scale: &mut Tensor<f32>,
    scale_inv: &mut Tensor<f32>,
    count: u32,
    max: f32,
    factor: f32,
    largest: f32,
    infinity: f32,
) {
    let total = partials_max(partials, count);
    if UNIT_POS_X == 0 {
        out[0] = total;
        let s = scale_or(f32::reinterpret(total), 1.0, max, factor, largest, infinity);
        scale[0] = s;
        scale_inv[0] = 1.0 / s;
    }
}

/// An empty `[len]` tensor of `dtype` on `x`'s device.
fn empty_like<R: CubeRuntime>(x: &CubeTensor<R>, len: usize, dtype: DType) -> CubeTensor<R> {
    empty_device_contiguous_dtype::<R>(
        x.client.clone(),
        x.device.clone(),
        Shape::from(vec![len]),
        dtype,
    )
}

/// Stage one of the amax on a non-empty contiguous `x`: the cubes' partial maxima (`[cubes]`
/// u32, the bits of non-negative f32s) and their count.
fn launch_partials<R: CubeRuntime>(x: CubeTensor<R>) -> (CubeTensor<R>, usize) {
    let numel = x.meta.shape().num_elements();
    let width = vector_width(&[&x]);
    let vectors = numel / width;
    let cubes = vectors.div_ceil(THREADS as usize).clamp(1, AMAX_CUBES);
    let partials = empty_like(&x, cubes, DType::U32);
    let dtype = x.dtype.into();
    amax_partials_kernel::launch::<R>(
        &x.client.clone(),
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_1d(THREADS),
        width,
        x.into_tensor_arg(),
        partials.clone().into_tensor_arg(),
        vectors as u32,
        dtype,
    );
    (partials, cubes)
}

/// [`amax`] and the [`tensorwise_scale`] from it in the amax's two launches:
/// `(amax, scale, 1 / scale)`, each `[1]` f32, the same bits as the two functions give, for a
/// cast whose amax needs no reduction over other ranks.
pub fn amax_scale<R: CubeRuntime>(
    x: CubeTensor<R>,
    max: f32,
    margin: i32,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let x = into_contiguous(x);
    if x.meta.shape().num_elements() == 0 {
        let amax = amax(x);
        let (scale, scale_inv) = tensorwise_scale(amax.clone(), max, margin);
        return (amax, scale, scale_inv);
    }
    let mut out = empty_like(&x, 1, DType::U32);
    let (scale, scale_inv) = (empty_like(&x, 1, DType::F32), empty_like(&x, 1, DType::F32));
    let client = x.client.clone();
    let (partials, cubes) = launch_partials(x);
    amax_total_scale_kernel::launch::<R>(
        &client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(THREADS),
        partials.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        scale.clone().into_tensor_arg(),
        scale_inv.clone().into_tensor_arg(),
        cubes as u32,
        max,
        2f32.powi(-margin),
        f32::MAX,
        f32::INFINITY,
    );
    // The same four bytes, read as the f32 they are the bits of.
    out.dtype = DType::F32;
    (out, scale, scale_inv)
}

/// `max |x|` of a float tensor as a `[1]` f32 tensor on its device (NaN if `x` holds a NaN),
/// with no host synchronisation, and the same bits on every run (no atomics).
pub fn amax<R: CubeRuntime>(x: CubeTensor<R>) -> CubeTensor<R> {
    let x = into_contiguous(x);
    if x.meta.shape().num_elements() == 0 {
        return zeros_client::<R>(
            x.client.clone(),
            x.device.clone(),
            Shape::from(vec![1]),
            DType::F32,
        );
    }
    let mut out = empty_like(&x, 1, DType::U32);
    let client = x.client.clone();
    let (partials, cubes) = launch_partials(x);
    amax_total_kernel::launch::<R>(
        &client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(THREADS),
        partials.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        cubes as u32,
    );
    // The same four bytes, read as the f32 they are the bits of.
    out.dtype = DType::F32;
    out
}

#[cube(launch)]
fn tensorwise_scale_kernel(
    amax: &Tensor<f32>,
    scale: &mut Tensor<f32>,
    scale_inv: &mut Tensor<f32>,
    max: f32,
    factor: f32,
    largest: f32,
    infinity: f32,
) {
    if ABSOLUTE_POS == 0 {
        let s = scale_or(amax[0], 1.0, max, factor, largest, infinity);
        scale[0] = s;
        scale_inv[0] = 1.0 / s;
    }
}

/// `max / amax · factor`, at most `largest`, or `fallback` where `amax` is zero, NaN or
/// infinite: the scale both recipes compute, in the compositions' order of operations.
#[cube]
fn scale_or(amax: f32, fallback: f32, max: f32, factor: f32, largest: f32, infinity: f32) -> f32 {
    let mut s = max / amax * factor;
    if s > largest {
        s = largest;
    }
    // A NaN fails both comparisons.
    if !(amax > 0.0 && amax < infinity) {
        s = fallback;
    }
    s
}

/// The tensorwise scale of a cast to `max` (the format's largest value) from the tensor's
/// `amax` (`[1]` f32): `max / amax · 2^-margin`, at most `f32::MAX`, or 1 where the amax is
/// zero, NaN or infinite; and its reciprocal, the GEMM's dequantising factor,
/// `(scale, 1 / scale)`. One thread of one kernel, the same operations in the same order as
/// the composition of Burn operations it replaces (about eleven launches).
pub fn tensorwise_scale<R: CubeRuntime>(
    amax: CubeTensor<R>,
    max: f32,
    margin: i32,
) -> (CubeTensor<R>, CubeTensor<R>) {
    assert_eq!(amax.dtype, DType::F32, "the amax is f32");
    assert_eq!(amax.meta.shape().num_elements(), 1, "one amax");
    let (client, device) = (amax.client.clone(), amax.device.clone());
    let one = || {
        empty_device_contiguous_dtype::<R>(
            client.clone(),
            device.clone(),
            Shape::from(vec![1]),
            DType::F32,
        )
    };
    let (scale, scale_inv) = (one(), one());
    tensorwise_scale_kernel::launch::<R>(
        &client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(1),
        into_contiguous(amax).into_tensor_arg(),
        scale.clone().into_tensor_arg(),
        scale_inv.clone().into_tensor_arg(),
        max,
        2f32.powi(-margin),
        f32::MAX,
        f32::INFINITY,
    );
    (scale, scale_inv)
}

#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn delayed_update_kernel(
    amax: &Tensor<f32>,
    history: &Tensor<f32>,
    scale: &Tensor<f32>,
    new_history: &mut Tensor<f32>,
    new_scale: &mut Tensor<f32>,
    len: u32,
    max: f32,
    factor: f32,
    largest: f32,
    infinity: f32,
    #[comptime] most_recent: bool,
) {
    let a = amax[0];
    // A NaN fails the comparison: neither it nor an infinity is recorded.
    let finite = a < infinity;
    let mut best = 0u32;
    let mut i = UNIT_POS_X;
    while i < len {
        let index = i as usize;
        let mut value = history[index];
        if finite {
            if i == 0 {
                value = a;
            } else {
                value = history[index - 1];
            }
        }
        new_history[index] = value;
        // Amaxes are non-negative: their bits order as their values.
        let bits = u32::reinterpret(value);
        if bits > best {
            best = bits;
        }
        i += CUBE_DIM_X;
    }
    let total = cube_max(best);
    if UNIT_POS_X == 0 {
        let mut chosen = f32::reinterpret(total);
        if most_recent {
            chosen = new_history[0];
        }
        let previous = scale[0];
        let mut s = scale_or(chosen, previous, max, factor, largest, infinity);
        if !finite {
            s = previous;
        }
        new_scale[0] = s;
    }
}

/// Delayed scaling's update after a cast, in one kernel of one cube: `amax` (`[1]` f32) enters
/// the `history` (`[len]` f32, newest first) at the front and the oldest entry drops out, and
/// the next scale is `max / chosen · 2^-margin` (at most `f32::MAX`) from the new history's
/// largest amax (or, with `most_recent`, its newest), or `scale` (`[1]` f32) where that amax is
/// zero; a NaN or infinite `amax` changes neither. Returns `(history, scale)`, new tensors: the
/// same operations in the same order as the composition of Burn operations it replaces (about
/// fifteen launches).
pub fn delayed_update<R: CubeRuntime>(
    history: CubeTensor<R>,
    scale: CubeTensor<R>,
    amax: CubeTensor<R>,
    max: f32,
    margin: i32,
    most_recent: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    for (t, what) in [(&history, "history"), (&scale, "scale"), (&amax, "amax")] {
        assert_eq!(t.dtype, DType::F32, "the {what} is f32");
    }
    assert_eq!(amax.meta.shape().num_elements(), 1, "one amax");
    assert_eq!(scale.meta.shape().num_elements(), 1, "one scale");
    let len = history.meta.shape().num_elements();
    assert!(len > 0, "a history of at least one amax");
    let (client, device) = (history.client.clone(), history.device.clone());
    let new_history = empty_device_contiguous_dtype::<R>(
        client.clone(),
        device.clone(),
        Shape::from(vec![len]),
        DType::F32,
    );
    let new_scale = empty_device_contiguous_dtype::<R>(
        client.clone(),
        device,
        Shape::from(vec![1]),
        DType::F32,
    );
    delayed_update_kernel::launch::<R>(
        &client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(THREADS),
        into_contiguous(amax).into_tensor_arg(),
        into_contiguous(history).into_tensor_arg(),
        into_contiguous(scale).into_tensor_arg(),
        new_history.clone().into_tensor_arg(),
        new_scale.clone().into_tensor_arg(),
        len as u32,
        max,
        2f32.powi(-margin),
        f32::MAX,
        f32::INFINITY,
        most_recent,
    );
    (new_history, new_scale)
}

/// `x · scale` saturated to `±max`; a NaN stays a NaN (a clamp would turn it into `-max`).
#[cube]
pub(super) fn scaled(x: f32, scale: f32, max: f32) -> f32 {
    let y = x * scale;
    let mut out = y;
    if y > max {
        out = max;
    }
    if y < -max {
        out = -max;
    }
    out
}

/// [`CastTarget::format`]: the cast writes the scaled values (`f32`, unrounded).
const VALUES: u32 = 0;
/// [`CastTarget::format`]: the cast writes E4M3 bits (`u8`).
const E4M3_BITS: u32 = 1;
/// [`CastTarget::format`]: the cast writes E5M2 bits (`u8`).
const E5M2_BITS: u32 = 2;

/// What a cast writes for `y` ([`scaled`]: within `±max`, or NaN): `y` itself as `Q = f32`
/// ([`VALUES`]), or its FP8 bits as `Q = u8` or `u32` ([`fp8_bits`]).
#[cube]
#[allow(unused_assignments)]
fn encode<Q: Numeric>(y: f32, #[comptime] format: u32) -> Q {
    let mut out = Q::cast_from(0u32);
    if comptime!(format == VALUES) {
        out = Q::cast_from(y);
    } else {
        out = Q::cast_from(fp8_bits(y, comptime!(format == E5M2_BITS)));
    }
    out
}

/// The E4M3 (or, with `e5m2`, E5M2) bits of `y`, which [`scaled`] kept within the format's
/// largest finite value or left NaN: rounded to the nearest, ties to even, in integer and f32
/// arithmetic. CUDA's conversion without saturation (what CubeCL emits) takes a software path
/// through f64 that made the casts compute-bound; the hardware instruction only exists
/// saturating, which CubeCL does not emit. The bits are those of [`Fp8Kind::encode`] (CUDA's
/// conversion), NaN included.
#[cube]
#[allow(unused_assignments)]
pub(super) fn fp8_bits(y: f32, #[comptime] e5m2: bool) -> u32 {
    let bits = u32::reinterpret(y);
    let sign = (bits >> 24) & 0x80;
    let a = bits & 0x7FFF_FFFF;
    let mut code = 0u32;
    if comptime!(e5m2) {
        if a > 0x7F80_0000 {
            // NaN: the two highest bits of its payload kept, as CUDA's conversion does.
            code = 0x7E | ((a >> 21) & 3);
        } else if a < 0x3880_0000 {
            // Below 2^-14, the subnormals' step 2^-16 is the unit in the last place of 2^7:
            // the addition rounds to it (ties to even).
            code = u32::reinterpret(f32::abs(y) + f32::new(128.0)) - 0x4300_0000;
        } else {
            // Round the f32 mantissa to 2 bits (ties to even), rebias the exponent.
            code = ((a + 0xF_FFFF + ((a >> 21) & 1)) >> 21) - ((127 - 15) << 2);
        }
    } else if a > 0x7F80_0000 {
        code = 0x7F;
    } else if a < 0x3C80_0000 {
        // Below 2^-6, the step 2^-9 is the unit in the last place of 2^14.
        code = u32::reinterpret(f32::abs(y) + f32::new(16384.0)) - 0x4680_0000;
    } else {
        code = ((a + 0x7_FFFF + ((a >> 20) & 1)) >> 20) - ((127 - 7) << 3);
    }
    sign | code
}

#[cube(launch)]
fn quantize_kernel<F: Float, Q: Numeric, N: Size>(
    x: &Tensor<Vector<F, N>>,
    scale: &Tensor<f32>,
    out: &mut Tensor<Vector<Q, N>>,
    vectors: u32,
    max: f32,
    #[comptime] format: u32,
    #[define(F, Q)] _dtypes: [StorageType; 2],
) {
    let i = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X;
    if i >= vectors {
        terminate!();
    }
    let s = scale[0];
    let v = x[i as usize];
    let mut q = Vector::<Q, N>::empty();
    #[unroll]
    for k in 0..N::value() {
        q[k] = encode::<Q>(scaled(f32::cast_from(v[k]), s, max), format);
    }
    out[i as usize] = q;
}

/// Side of the square tiles the transposed cast moves through shared memory.
const TILE: usize = 32;
/// Rows of a tile each thread handles (the cube is `TILE × TILE / ROWS_PER_THREAD`).
const ROWS_PER_THREAD: usize = 4;
const _: () = assert!(TILE * TILE / ROWS_PER_THREAD == THREADS as usize);

/// `out[c, r] = cast(x[r, c] · scale)` for `x: [rows, cols]`, one `TILE × TILE` tile a cube:
/// read along `x`'s rows, written along `out`'s rows, through shared memory (a padded row
/// keeps the column reads free of bank conflicts).
#[cube(launch)]
fn quantize_transposed_kernel<F: Float, Q: Numeric>(
    x: &Tensor<F>,
    scale: &Tensor<f32>,
    out: &mut Tensor<Q>,
    rows: u32,
    cols: u32,
    max: f32,
    #[comptime] format: u32,
    #[define(F, Q)] _dtypes: [StorageType; 2],
) {
    let mut tile = SharedMemory::<f32>::new(TILE * (TILE + 1));
    let s = scale[0];
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let row0 = CUBE_POS_Y as usize * TILE;
    let col0 = CUBE_POS_X as usize * TILE;
    let (rows, cols) = (rows as usize, cols as usize);
    let step = TILE / ROWS_PER_THREAD;
    #[unroll]
    for j in 0..ROWS_PER_THREAD {
        let r = row0 + ty + j * step;
        let c = col0 + tx;
        if r < rows && c < cols {
            tile[(ty + j * step) * (TILE + 1) + tx] =
                scaled(f32::cast_from(x[r * cols + c]), s, max);
        }
    }
    sync_cube();
    #[unroll]
    for j in 0..ROWS_PER_THREAD {
        // Row `c` of `out`, its column `r`.
        let c = col0 + ty + j * step;
        let r = row0 + tx;
        if r < rows && c < cols {
            out[c * rows + r] = encode::<Q>(tile[tx * (TILE + 1) + ty + j * step], format);
        }
    }
}

/// `x · scale` cast to `kind` with saturation to `±kind.max()` (round to nearest even; a NaN
/// stays NaN), as a `U8` tensor of FP8 bits: `[r, c]`, or its transpose `[c, r]` with
/// `transpose`, contiguous. `x` is a 2D f32, f16 or bf16 tensor, `scale` an f32 `[1]` tensor on
/// the device. `kind` may also be a [`CastTarget::F32`] (the same kernels, unrounded) or
/// [`CastTarget::Fp8InU32`]. The row-major cast writes a vector of bytes a thread; the
/// transposed one 8 or 4 bytes a thread where both sides are multiples of that (8 × 8 blocks
/// transposed in registers, or 64 × 64 tiles through shared memory at 4), else one.
pub fn quantize<R: CubeRuntime>(
    x: CubeTensor<R>,
    scale: &CubeTensor<R>,
    kind: impl Into<CastTarget>,
    transpose: bool,
) -> CubeTensor<R> {
    let kind = kind.into();
    let x = into_contiguous(x);
    let dims = x.meta.shape().to_vec();
    assert_eq!(dims.len(), 2, "the FP8 cast takes a matrix");
    let (rows, cols) = (dims[0], dims[1]);
    let out_shape = if transpose {
        vec![cols, rows]
    } else {
        vec![rows, cols]
    };
    let out = empty_device_contiguous_dtype::<R>(
        x.client.clone(),
        x.device.clone(),
        Shape::from(out_shape),
        kind.dtype(),
    );
    if rows * cols == 0 {
        return out;
    }
    let dtypes = [x.dtype.into(), kind.storage()];
    let client = x.client.clone();
    let vector = tile_vector(&x, rows, cols).filter(|_| transpose);
    if let Some(vector) = vector {
        // `row` and `partials` are not written: placeholders for the kernel's arguments.
        let unused = empty_device_contiguous_dtype::<R>(
            client.clone(),
            x.device.clone(),
            Shape::from(vec![vector]),
            kind.dtype(),
        );
        let partials = empty_device_contiguous_dtype::<R>(
            client.clone(),
            x.device.clone(),
            Shape::from(vec![1]),
            DType::U32,
        );
        launch_vectorised(
            BothKernel::for_vector(vector),
            x,
            vector,
            scale,
            kind,
            &unused,
            &out,
            &partials,
            false,
            false,
            VECTOR_CUBES,
        );
    } else if transpose {
        quantize_transposed_kernel::launch::<R>(
            &client,
            CubeCount::Static(cols.div_ceil(TILE) as u32, rows.div_ceil(TILE) as u32, 1),
            CubeDim::new_2d(TILE as u32, (TILE / ROWS_PER_THREAD) as u32),
            x.into_tensor_arg(),
            scale.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            rows as u32,
            cols as u32,
            kind.max(),
            kind.format(),
            dtypes,
        );
    } else {
        let width = vector_width(&[&x]);
        let vectors = rows * cols / width;
        quantize_kernel::launch::<R>(
            &client,
            launch_shape(vectors),
            CubeDim::new_1d(THREADS),
            width,
            x.into_tensor_arg(),
            scale.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            vectors as u32,
            kind.max(),
            kind.format(),
            dtypes,
        );
    }
    out
}

/// Cubes of the fused cast at most: each walks tiles with a grid-wide stride, so that its
/// amax leaves few partial maxima (a few waves of cubes on an H100 or H200).
const BOTH_CUBES: usize = 4096;

/// Both casts of `x: [rows, cols]` from one read of it: `row[r, c]` and `transposed[c, r]`
/// are `cast(x[r, c] · scale)`, the bits [`quantize_kernel`] and
/// [`quantize_transposed_kernel`] write. Each cube walks `TILE × TILE` tiles with a grid-wide
/// stride: it reads a tile along `x`'s rows, writes the row-major bytes at once and the
/// transposed ones through shared memory. With `with_amax`, `max |x|` over the cube's tiles
/// (f32 bits, as [`amax_partials_kernel`] computes it) goes to `partials[cube]`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn quantize_both_kernel<F: Float, Q: Numeric>(
    x: &Tensor<F>,
    scale: &Tensor<f32>,
    row: &mut Tensor<Q>,
    transposed: &mut Tensor<Q>,
    partials: &mut Tensor<u32>,
    rows: u32,
    cols: u32,
    max: f32,
    #[comptime] with_amax: bool,
    #[comptime] format: u32,
    #[define(F, Q)] _dtypes: [StorageType; 2],
) {
    let mut tile = SharedMemory::<f32>::new(TILE * (TILE + 1));
    let s = scale[0];
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let col_tiles = cols.div_ceil(TILE as u32);
    let tiles = col_tiles * rows.div_ceil(TILE as u32);
    let (rows, cols) = (rows as usize, cols as usize);
    let step = TILE / ROWS_PER_THREAD;
    let mut best = 0u32;
    // The same tile count for every thread of a cube: the `sync_cube`s below are uniform.
    let mut t = CUBE_POS_X;
    while t < tiles {
        let row0 = (t / col_tiles) as usize * TILE;
        let col0 = (t % col_tiles) as usize * TILE;
        #[unroll]
        for j in 0..ROWS_PER_THREAD {
            let r = row0 + ty + j * step;
            let c = col0 + tx;
            if r < rows && c < cols {
                let v = f32::cast_from(x[r * cols + c]);
                if with_amax {
                    let bits = u32::reinterpret(f32::abs(v));
                    if bits > best {
                        best = bits;
                    }
                }
                let y = scaled(v, s, max);
                row[r * cols + c] = encode::<Q>(y, format);
                tile[(ty + j * step) * (TILE + 1) + tx] = y;
            }
        }
        sync_cube();
        #[unroll]
        for j in 0..ROWS_PER_THREAD {
            // Row `c` of `transposed`, its column `r`.
            let c = col0 + ty + j * step;
            let r = row0 + tx;
            if r < rows && c < cols {
                transposed[c * rows + r] =
                    encode::<Q>(tile[tx * (TILE + 1) + ty + j * step], format);
            }
        }
        // The next tile overwrites the shared memory this one's columns were read from.
        sync_cube();
        t += CUBE_COUNT_X;
    }
    if with_amax {
        let total = cube_max(best);
        if UNIT_POS == 0 {
            partials[CUBE_POS_X as usize] = total;
        }
    }
}

/// Side of the square tiles the vectorised casts move through shared memory.
const VECTOR_TILE: usize = 64;
/// Elements a thread reads, and FP8 bytes it writes, at once in the vectorised casts, widest
/// first: 8 (16-byte bf16 reads) where the shape and the runtime allow, else 4.
const VECTORS: [usize; 2] = [8, 4];
/// Cubes of the vectorised casts at most: a cube a tile up to every runtime's limit on a
/// grid's first dimension, beyond which each cube walks tiles with a grid-wide stride. A
/// cube a tile (16 384 for a `[16384, 4096]` activation) ran the cast of both layouts in 173
/// µs on an H200 against 290 µs with 1 024 cubes each walking 16 tiles.
const VECTOR_CUBES: usize = 65_535;
/// Passes of a cube's threads over a tile's rows (`ROW_PASSES`) and down its columns: a
/// `VECTOR_TILE`-square tile is `VECTOR_TILE / vector` vectors wide and as many tall.
const fn tile_passes(vector: usize) -> usize {
    VECTOR_TILE / (THREADS as usize / (VECTOR_TILE / vector))
}
const _: () = {
    let mut i = 0;
    while i < VECTORS.len() {
        let vector = VECTORS[i];
        assert!(
            (THREADS as usize).is_multiple_of(VECTOR_TILE / vector)
                && (VECTOR_TILE * VECTOR_TILE).is_multiple_of(THREADS as usize * vector)
                && tile_passes(vector) >= 1
        );
        i += 1;
    }
};

/// [`quantize_both_kernel`] (or, without `with_row`, [`quantize_transposed_kernel`]) with each
/// thread reading `N` consecutive elements of a row and writing `N` bytes at once in each
/// layout, for `rows` and `cols` multiples of `N`: a byte a thread left the memory system
/// idle (0.75 TB/s on an H200). A `VECTOR_TILE`-square tile is read as vectors along `x`'s
/// rows, every load of the tile issued before any is used; each vector is converted once, its
/// bytes written row-major at once and kept in shared memory (a quarter of the f32 values'
/// bytes, and no second conversion), then read back down the tile's columns as vectors of the
/// transposed layout. The same bits as the scalar kernels.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
fn quantize_tiles_kernel<F: Float, Q: Numeric, N: Size>(
    x: &Tensor<Vector<F, N>>,
    scale: &Tensor<f32>,
    row: &mut Tensor<Vector<Q, N>>,
    transposed: &mut Tensor<Vector<Q, N>>,
    partials: &mut Tensor<u32>,
    rows: u32,
    cols: u32,
    max: f32,
    #[comptime] with_row: bool,
    #[comptime] with_amax: bool,
    #[comptime] passes: usize,
    #[comptime] format: u32,
    #[define(F, Q)] _dtypes: [StorageType; 2],
) {
    let mut tile = SharedMemory::<Q>::new(VECTOR_TILE * (VECTOR_TILE + 1));
    let s = scale[0];
    let n = N::value();
    // A tile row (and column) is `per_row` vectors, one a thread; a pass covers `lines` rows
    // (or columns), and `passes` of them the tile.
    let per_row = VECTOR_TILE / n;
    let lines = THREADS as usize / per_row;
    let tid = UNIT_POS as usize;
    let (lane, line) = (tid % per_row, tid / per_row);
    let col_tiles = cols.div_ceil(VECTOR_TILE as u32);
    let tiles = col_tiles * rows.div_ceil(VECTOR_TILE as u32);
    let (rows, cols) = (rows as usize, cols as usize);
    // Vectors in a row of `x` (and `row`), and in a row of `transposed`.
    let (x_vectors, t_vectors) = (cols / n, rows / n);
    let mut best = 0u32;
    let mut loaded = Array::<Vector<F, N>>::new(passes);
    // The same tile count for every thread of a cube: the `sync_cube`s below are uniform.
    let mut t = CUBE_POS_X;
    while t < tiles {
        let row0 = (t / col_tiles) as usize * VECTOR_TILE;
        let col0 = (t % col_tiles) as usize * VECTOR_TILE;
        let c = col0 + lane * n;
        #[unroll]
        for p in 0..passes {
            let r = row0 + line + p * lines;
            // `cols` is a multiple of `n`: the vector lies wholly inside or outside.
            if r < rows && c < cols {
                loaded[p] = x[r * x_vectors + c / n];
            }
        }
        #[unroll]
        for p in 0..passes {
            let tile_row = line + p * lines;
            let r = row0 + tile_row;
            if r < rows && c < cols {
                let v = loaded[p];
                let mut q = Vector::<Q, N>::empty();
                #[unroll]
                for k in 0..n {
                    let e = f32::cast_from(v[k]);
                    if with_amax {
                        let bits = u32::reinterpret(f32::abs(e));
                        if bits > best {
                            best = bits;
                        }
                    }
                    q[k] = encode::<Q>(scaled(e, s, max), format);
                }
                #[unroll]
                for k in 0..n {
                    tile[tile_row * (VECTOR_TILE + 1) + lane * n + k] = q[k];
                }
                if with_row {
                    row[r * x_vectors + c / n] = q;
                }
            }
        }
        sync_cube();
        let r = row0 + lane * n;
        #[unroll]
        for p in 0..passes {
            // Row `c` of `transposed`, its columns `r..r + n`.
            let tile_col = line + p * lines;
            let c = col0 + tile_col;
            if r < rows && c < cols {
                let mut y = Vector::<Q, N>::empty();
                #[unroll]
                for k in 0..n {
                    y[k] = tile[(lane * n + k) * (VECTOR_TILE + 1) + tile_col];
                }
                transposed[c * t_vectors + r / n] = y;
            }
        }
        // The next tile overwrites the shared memory this one's columns were read from.
        sync_cube();
        t += CUBE_COUNT_X;
    }
    if with_amax {
        let total = cube_max(best);
        if UNIT_POS == 0 {
            partials[CUBE_POS_X as usize] = total;
        }
    }
}

/// The cubes the tile kernel takes over `x: [rows, cols]`, at most `max_cubes`.
fn tile_cubes(rows: usize, cols: usize, max_cubes: usize) -> usize {
    (rows.div_ceil(VECTOR_TILE) * cols.div_ceil(VECTOR_TILE)).min(max_cubes)
}

/// The widest of [`VECTORS`] that [`quantize_tiles_kernel`] can take `x: [rows, cols]` in:
/// both sides its multiples (the vectors of both layouts stay inside their rows) and `x`
/// readable in vectors of that width; `None` for the scalar kernels.
fn tile_vector<R: CubeRuntime>(x: &CubeTensor<R>, rows: usize, cols: usize) -> Option<usize> {
    let readable = vector_width(&[x]);
    VECTORS.into_iter().find(|&vector| {
        rows.is_multiple_of(vector) && cols.is_multiple_of(vector) && readable >= vector
    })
}

/// Vector blocks of the block kernel's rows that one plane (32 threads) covers: its threads
/// hold `ROW_LANES` consecutive row blocks by `32 / ROW_LANES` consecutive column blocks, so
/// that each transposed store of a plane writes `ROW_LANES · vector` consecutive bytes of a
/// row of the transposed layout (a whole 32-byte sector at 8), and each load reads
/// `32 / ROW_LANES` consecutive vectors of a row of `x`.
const ROW_LANES: usize = 4;
/// Column blocks a plane covers (see [`ROW_LANES`]).
const COL_LANES: usize = 32 / ROW_LANES;

/// [`quantize_tiles_kernel`]'s casts without shared memory: each thread casts an `N × N`
/// block of `x` (`N` rows of one `N`-vector each, all loaded before any is used), writes its
/// rows as `N`-byte vectors and its columns, transposed in registers, as `N`-byte vectors of
/// the transposed layout. No cube synchronises, and a plane's stores fill whole sectors (see
/// [`ROW_LANES`]). `rows` and `cols` are multiples of `N`; threads walk the blocks with a
/// grid-wide stride. The same bits as the scalar kernels; with `with_amax` each cube's
/// `max |x|` (f32 bits) goes to `partials[cube]`.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
fn quantize_blocks_kernel<F: Float, Q: Numeric, N: Size>(
    x: &Tensor<Vector<F, N>>,
    scale: &Tensor<f32>,
    row: &mut Tensor<Vector<Q, N>>,
    transposed: &mut Tensor<Vector<Q, N>>,
    partials: &mut Tensor<u32>,
    rows: u32,
    cols: u32,
    max: f32,
    #[comptime] with_row: bool,
    #[comptime] with_amax: bool,
    #[comptime] block: usize,
    #[comptime] format: u32,
    #[define(F, Q)] _dtypes: [StorageType; 2],
) {
    let s = scale[0];
    let (rows, cols) = (rows as usize, cols as usize);
    // Vectors in a row of `x` (and `row`), and in a row of `transposed`: the blocks.
    let (col_blocks, row_blocks) = (cols / block, rows / block);
    let col_groups = col_blocks.div_ceil(COL_LANES);
    let tasks = row_blocks.div_ceil(ROW_LANES) * col_groups * 32;
    let mut best = 0u32;
    let mut loaded = Array::<Vector<F, N>>::new(block);
    let mut cast = Array::<Vector<Q, N>>::new(block);
    let stride = (CUBE_COUNT_X * CUBE_DIM_X) as usize;
    let mut i = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    while i < tasks {
        let (lane, plane) = (i % 32, i / 32);
        let rb = (plane / col_groups) * ROW_LANES + lane % ROW_LANES;
        let cb = (plane % col_groups) * COL_LANES + lane / ROW_LANES;
        if rb < row_blocks && cb < col_blocks {
            let r0 = rb * block;
            #[unroll]
            for j in 0..block {
                loaded[j] = x[(r0 + j) * col_blocks + cb];
            }
            #[unroll]
            for j in 0..block {
                let v = loaded[j];
                let mut q = Vector::<Q, N>::empty();
                #[unroll]
                for k in 0..block {
                    let e = f32::cast_from(v[k]);
                    if with_amax {
                        let bits = u32::reinterpret(f32::abs(e));
                        if bits > best {
                            best = bits;
                        }
                    }
                    q[k] = encode::<Q>(scaled(e, s, max), format);
                }
                if with_row {
                    row[(r0 + j) * col_blocks + cb] = q;
                }
                cast[j] = q;
            }
            // Column `cb · block + k` of the block is row `cb · block + k` of `transposed`,
            // its elements `r0..r0 + block`.
            #[unroll]
            for k in 0..block {
                let mut t = Vector::<Q, N>::empty();
                #[unroll]
                for j in 0..block {
                    let q = cast[j];
                    t[j] = q[k];
                }
                transposed[(cb * block + k) * row_blocks + rb] = t;
            }
        }
        i += stride;
    }
    if with_amax {
        let total = cube_max(best);
        if UNIT_POS == 0 {
            partials[CUBE_POS_X as usize] = total;
        }
    }
}

/// The cubes the block kernel takes over `x: [rows, cols]` in vectors of `vector`, at most
/// `max_cubes`.
fn block_cubes(rows: usize, cols: usize, vector: usize, max_cubes: usize) -> usize {
    let planes = (rows / vector).div_ceil(ROW_LANES) * (cols / vector).div_ceil(COL_LANES);
    (planes * 32).div_ceil(THREADS as usize).clamp(1, max_cubes)
}

/// Launches `kernel` over `x: [rows, cols]` in vectors of `vector` (see [`tile_vector`]), in
/// at most `max_cubes` cubes; `row` is written with `with_row`, `partials` (one a cube) with
/// `with_amax`. Returns the cubes.
#[allow(clippy::too_many_arguments)]
fn launch_vectorised<R: CubeRuntime>(
    kernel: BothKernel,
    x: CubeTensor<R>,
    vector: usize,
    scale: &CubeTensor<R>,
    target: CastTarget,
    row: &CubeTensor<R>,
    transposed: &CubeTensor<R>,
    partials: &CubeTensor<R>,
    with_row: bool,
    with_amax: bool,
    max_cubes: usize,
) -> usize {
    let dims = x.meta.shape().to_vec();
    let (rows, cols) = (dims[0], dims[1]);
    let cubes = kernel.cubes(rows, cols, vector, max_cubes);
    let dtypes = [x.dtype.into(), target.storage()];
    let client = x.client.clone();
    let (count, dim) = (
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_1d(THREADS),
    );
    let (x, scale) = (x.into_tensor_arg(), scale.clone().into_tensor_arg());
    let (row, transposed) = (
        row.clone().into_tensor_arg(),
        transposed.clone().into_tensor_arg(),
    );
    let partials = partials.clone().into_tensor_arg();
    let (rows, cols, max, format) = (rows as u32, cols as u32, target.max(), target.format());
    // SAFETY: every read and write is guarded by its tile's bounds, or its block's indices,
    // against `rows` and `cols` (the tensors' shapes; both multiples of `vector`), and
    // `partials` holds a value per cube where `with_amax` writes it (the lavapipe tests run
    // ragged shapes, several cubes' walks and the default grid, with both kernels).
    unsafe {
        match kernel {
            BothKernel::Tiles => quantize_tiles_kernel::launch_unchecked::<R>(
                &client,
                count,
                dim,
                vector,
                x,
                scale,
                row,
                transposed,
                partials,
                rows,
                cols,
                max,
                with_row,
                with_amax,
                tile_passes(vector),
                format,
                dtypes,
            ),
            BothKernel::Blocks => quantize_blocks_kernel::launch_unchecked::<R>(
                &client, count, dim, vector, x, scale, row, transposed, partials, rows, cols, max,
                with_row, with_amax, vector, format, dtypes,
            ),
        }
    };
    cubes
}

/// The casts [`quantize_both`] returns.
#[derive(Debug, Clone)]
pub struct BothCasts<R: CubeRuntime> {
    /// `[r, c]`: [`quantize`]'s row-major output.
    pub row: CubeTensor<R>,
    /// `[c, r]`: [`quantize`]'s transposed output.
    pub transposed: CubeTensor<R>,
    /// [`amax`] of the input, `[1]` f32, where asked for.
    pub amax: Option<CubeTensor<R>>,
}

/// [`quantize`] in both layouts from one read of `x` (one kernel writing both, the same bits
/// as two [`quantize`] calls; 8 or 4 bytes at once where both sides are multiples of that,
/// as [`quantize`]'s transposed cast, else a byte a thread), and with `with_amax` the input's [`amax`]
/// from the same pass (partial maxima per cube, then [`amax`]'s second stage; no atomics, the
/// same bits): for delayed scaling, whose scale comes from a history and whose amax is only
/// recorded.
pub fn quantize_both<R: CubeRuntime>(
    x: CubeTensor<R>,
    scale: &CubeTensor<R>,
    kind: impl Into<CastTarget>,
    with_amax: bool,
) -> BothCasts<R> {
    quantize_both_in_cubes(x, scale, kind, with_amax, VECTOR_CUBES)
}

/// The vectorised kernel that casts both layouts (where the sides are multiples of a vector).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BothKernel {
    /// [`quantize_tiles_kernel`]: tiles through shared memory.
    Tiles,
    /// [`quantize_blocks_kernel`]: blocks transposed in registers.
    Blocks,
}

impl BothKernel {
    /// The faster kernel for vectors of `vector` elements, as measured on an H200 (2026-11-28,
    /// both layouts of a bf16 `[16384, 4096]`): blocks at 8 (100 µs against the tiles' 113,
    /// with the amax 123 against 165), whose transposed stores then fill whole sectors; tiles
    /// at 4 (210 µs against 321).
    fn for_vector(vector: usize) -> Self {
        match vector {
            8 => BothKernel::Blocks,
            _ => BothKernel::Tiles,
        }
    }

    /// The cubes this kernel takes over `x: [rows, cols]` in vectors of `vector`, at most
    /// `max_cubes`.
    fn cubes(self, rows: usize, cols: usize, vector: usize, max_cubes: usize) -> usize {
        match self {
            BothKernel::Tiles => tile_cubes(rows, cols, max_cubes),
            BothKernel::Blocks => block_cubes(rows, cols, vector, max_cubes),
        }
    }
}

/// [`quantize_both`] with the vectorised kernel in at most `max_cubes` cubes, each walking
/// several tiles or blocks where the tensor has more: for the tests, whose shapes stay far
/// below the default bound.
#[doc(hidden)]
pub fn quantize_both_in_cubes<R: CubeRuntime>(
    x: CubeTensor<R>,
    scale: &CubeTensor<R>,
    kind: impl Into<CastTarget>,
    with_amax: bool,
    max_cubes: usize,
) -> BothCasts<R> {
    quantize_both_with(x, scale, kind, with_amax, None, max_cubes)
}

/// [`quantize_both_in_cubes`] with the vectorised `kernel` whatever the vector: for the
/// tests, which check both kernels.
#[doc(hidden)]
pub fn quantize_both_by<R: CubeRuntime>(
    x: CubeTensor<R>,
    scale: &CubeTensor<R>,
    kind: impl Into<CastTarget>,
    with_amax: bool,
    kernel: BothKernel,
    max_cubes: usize,
) -> BothCasts<R> {
    quantize_both_with(x, scale, kind, with_amax, Some(kernel), max_cubes)
}

fn quantize_both_with<R: CubeRuntime>(
    x: CubeTensor<R>,
    scale: &CubeTensor<R>,
    kind: impl Into<CastTarget>,
    with_amax: bool,
    kernel: Option<BothKernel>,
    max_cubes: usize,
) -> BothCasts<R> {
    let kind = kind.into();
    let x = into_contiguous(x);
    let dims = x.meta.shape().to_vec();
    assert_eq!(dims.len(), 2, "the FP8 cast takes a matrix");
    let (rows, cols) = (dims[0], dims[1]);
    let (client, device) = (x.client.clone(), x.device.clone());
    let tensor = |dims: Vec<usize>, dtype: DType| {
        empty_device_contiguous_dtype::<R>(client.clone(), device.clone(), Shape::from(dims), dtype)
    };
    let row = tensor(vec![rows, cols], kind.dtype());
    let transposed = tensor(vec![cols, rows], kind.dtype());
    if rows * cols == 0 {
        let amax = with_amax.then(|| {
            zeros_client::<R>(
                client.clone(),
                device.clone(),
                Shape::from(vec![1]),
                DType::F32,
            )
        });
        return BothCasts {
            row,
            transposed,
            amax,
        };
    }
    let vector = tile_vector(&x, rows, cols);
    let kernel = vector.map(|vector| kernel.unwrap_or(BothKernel::for_vector(vector)));
    let cubes = match (vector, kernel) {
        (Some(vector), Some(kernel)) => kernel.cubes(rows, cols, vector, max_cubes),
        _ => (rows.div_ceil(TILE) * cols.div_ceil(TILE)).min(BOTH_CUBES),
    };
    // Unread without the amax: a placeholder for the kernel's argument.
    let partials = tensor(vec![if with_amax { cubes } else { 1 }], DType::U32);
    if let (Some(vector), Some(kernel)) = (vector, kernel) {
        let launched = launch_vectorised(
            kernel,
            x,
            vector,
            scale,
            kind,
            &row,
            &transposed,
            &partials,
            true,
            with_amax,
            max_cubes,
        );
        debug_assert_eq!(launched, cubes);
    } else {
        let dtypes = [x.dtype.into(), kind.storage()];
        quantize_both_kernel::launch::<R>(
            &client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_2d(TILE as u32, (TILE / ROWS_PER_THREAD) as u32),
            x.into_tensor_arg(),
            scale.clone().into_tensor_arg(),
            row.clone().into_tensor_arg(),
            transposed.clone().into_tensor_arg(),
            partials.clone().into_tensor_arg(),
            rows as u32,
            cols as u32,
            kind.max(),
            with_amax,
            kind.format(),
            dtypes,
        );
    }
    let amax = with_amax.then(|| {
        let mut out = tensor(vec![1], DType::U32);
        amax_total_kernel::launch::<R>(
            &client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(THREADS),
            partials.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            cubes as u32,
        );
        out.dtype = DType::F32;
        out
    });
    BothCasts {
        row,
        transposed,
        amax,
    }
}
