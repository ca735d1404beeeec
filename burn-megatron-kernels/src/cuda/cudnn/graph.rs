//! A small builder over cuDNN's backend (graph) API: tensors, pointwise, reduction, matmul and
//! reshape operations, an operation graph, the heuristics' first engine that accepts it, and its
//! execution on a stream.
//!
//! cuDNN's fused engines (flash attention among them) are found by pattern: the graph must
//! have the shape an engine recognises. [`super::attention`] builds the graphs; this file only
//! speaks the API. Every descriptor is destroyed when dropped; a [`Plan`] keeps the ones its
//! execution plan was built from.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cudnn::sys::{
    self, cudnnBackendAttributeName_t as Attr, cudnnBackendAttributeType_t as Ty,
    cudnnBackendDescriptorType_t as Kind,
};

/// What cuDNN said, with the call that failed.
pub(crate) type CudnnResult<T> = Result<T, String>;

/// `status` as a result naming `what`, with cuDNN's own last message when it has one.
pub(crate) fn check(status: sys::cudnnStatus_t, what: &str) -> CudnnResult<()> {
    if status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    let mut message = [0 as core::ffi::c_char; 512];
    // SAFETY: cuDNN writes at most `max_size` bytes, NUL-terminated.
    let detail = unsafe {
        sys::cudnnGetLastErrorString(message.as_mut_ptr(), message.len());
        std::ffi::CStr::from_ptr(message.as_ptr())
            .to_string_lossy()
            .into_owned()
    };
    Err(match detail.is_empty() {
        true => format!("{what}: {status:?}"),
        false => format!("{what}: {status:?} ({detail})"),
    })
}

/// One backend descriptor, destroyed on drop.
pub(crate) struct Descriptor {
    raw: sys::cudnnBackendDescriptor_t,
    kind: Kind,
}

// SAFETY: descriptors are used by one thread at a time (the device thread).
unsafe impl Send for Descriptor {}

impl Drop for Descriptor {
    fn drop(&mut self) {
        // SAFETY: created by cudnnBackendCreateDescriptor and destroyed once.
        unsafe {
            sys::cudnnBackendDestroyDescriptor(self.raw);
        }
    }
}

impl Descriptor {
    pub(crate) fn new(kind: Kind) -> CudnnResult<Self> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: cuDNN writes a new descriptor into `raw`.
        check(
            unsafe { sys::cudnnBackendCreateDescriptor(kind, &mut raw) },
            &format!("creating a {kind:?}"),
        )?;
        Ok(Self { raw, kind })
    }

    /// Sets attribute `name` to `values`, whose element type cuDNN knows as `ty`.
    pub(crate) fn set<T: Copy>(&self, name: Attr, ty: Ty, values: &[T]) -> CudnnResult<()> {
        // SAFETY: `values` holds `len` elements of the type `ty` names (the callers pair them).
        let status = unsafe {
            sys::cudnnBackendSetAttribute(
                self.raw,
                name,
                ty,
                values.len() as i64,
                values.as_ptr() as *const c_void,
            )
        };
        check(status, &format!("setting {name:?} of a {:?}", self.kind))
    }

    fn set_descriptor(&self, name: Attr, value: &Descriptor) -> CudnnResult<()> {
        self.set(name, Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR, &[value.raw])
    }

    pub(crate) fn finalize(&self) -> CudnnResult<()> {
        // SAFETY: a descriptor we own.
        check(
            unsafe { sys::cudnnBackendFinalize(self.raw) },
            &format!("finalizing a {:?}", self.kind),
        )
    }
}

/// Element types of graph tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum DataType {
    Half,
    BFloat16,
    Float,
    Int32,
    Boolean,
}

impl DataType {
    fn raw(self) -> sys::cudnnDataType_t {
        use sys::cudnnDataType_t::*;
        match self {
            Self::Half => CUDNN_DATA_HALF,
            Self::BFloat16 => CUDNN_DATA_BFLOAT16,
            Self::Float => CUDNN_DATA_FLOAT,
            Self::Int32 => CUDNN_DATA_INT32,
            Self::Boolean => CUDNN_DATA_BOOLEAN,
        }
    }
}

/// A tensor of a graph, by unique id.
pub(crate) type Uid = i64;

/// The dimensions and strides of a 4D graph tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Layout {
    pub dims: [i64; 4],
    pub strides: [i64; 4],
}

impl Layout {
    /// Row-major (the last dimension contiguous) `dims`.
    pub(crate) fn packed(dims: [i64; 4]) -> Self {
        let strides = [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1];
        Self { dims, strides }
    }

    /// The same memory with dimensions `a` and `b` swapped.
    pub(crate) fn swapped(mut self, a: usize, b: usize) -> Self {
        self.dims.swap(a, b);
        self.strides.swap(a, b);
        self
    }

    /// The layout of a `[.., .., .., 1]` per-row statistic of this layout's rows.
    pub(crate) fn rows(self) -> Self {
        let [b, h, s, _] = self.dims;
        Self {
            dims: [b, h, s, 1],
            strides: [h * s, s, 1, 1],
        }
    }
}

/// Pointwise modes the graphs use.
pub(crate) use sys::cudnnPointwiseMode_t as Pointwise;

/// Reduction modes the graphs use.
pub(crate) use sys::cudnnReduceTensorOp_t as Reduce;

/// An operation graph under construction.
#[derive(Default)]
pub(crate) struct Graph {
    tensors: HashMap<Uid, Descriptor>,
    /// Operation descriptors, in the order they were added.
    operations: Vec<Descriptor>,
    /// Pointwise, reduction and matmul descriptors the operations refer to.
    parameters: Vec<Descriptor>,
    next_virtual: Uid,
}

/// Unique ids at and above this are the graph's own virtual tensors.
const FIRST_VIRTUAL_UID: Uid = 1_000;

impl Graph {
    pub(crate) fn new() -> Self {
        Self {
            next_virtual: FIRST_VIRTUAL_UID,
            ..Self::default()
        }
    }

    fn add_tensor(
        &mut self,
        uid: Uid,
        dtype: DataType,
        layout: Layout,
        is_virtual: bool,
        by_value: bool,
    ) -> CudnnResult<Uid> {
        use Attr::*;
        let t = Descriptor::new(Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        t.set(
            CUDNN_ATTR_TENSOR_DATA_TYPE,
            Ty::CUDNN_TYPE_DATA_TYPE,
            &[dtype.raw()],
        )?;
        t.set(
            CUDNN_ATTR_TENSOR_DIMENSIONS,
            Ty::CUDNN_TYPE_INT64,
            &layout.dims,
        )?;
        t.set(
            CUDNN_ATTR_TENSOR_STRIDES,
            Ty::CUDNN_TYPE_INT64,
            &layout.strides,
        )?;
        t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, Ty::CUDNN_TYPE_INT64, &[uid])?;
        t.set(
            CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT,
            Ty::CUDNN_TYPE_INT64,
            &[16i64],
        )?;
        t.set(
            CUDNN_ATTR_TENSOR_IS_VIRTUAL,
            Ty::CUDNN_TYPE_BOOLEAN,
            &[is_virtual],
        )?;
        if by_value {
            t.set(
                CUDNN_ATTR_TENSOR_IS_BY_VALUE,
                Ty::CUDNN_TYPE_BOOLEAN,
                &[true],
            )?;
        }
        t.finalize()?;
        self.tensors.insert(uid, t);
        Ok(uid)
    }

    /// A tensor in device memory, given at execution under `uid` (below 1000).
    pub(crate) fn tensor(&mut self, uid: Uid, dtype: DataType, layout: Layout) -> CudnnResult<Uid> {
        assert!(
            uid < FIRST_VIRTUAL_UID,
            "uid {uid} is reserved for virtual tensors"
        );
        self.add_tensor(uid, dtype, layout, false, false)
    }

    /// A scalar passed by value (a host pointer at execution) under `uid`.
    pub(crate) fn scalar(&mut self, uid: Uid, dtype: DataType) -> CudnnResult<Uid> {
        assert!(
            uid < FIRST_VIRTUAL_UID,
            "uid {uid} is reserved for virtual tensors"
        );
        let layout = Layout {
            dims: [1; 4],
            strides: [1; 4],
        };
        self.add_tensor(uid, dtype, layout, false, true)
    }

    /// An intermediate that lives only inside the fused kernels.
    pub(crate) fn temporary(&mut self, dtype: DataType, layout: Layout) -> CudnnResult<Uid> {
        let uid = self.next_virtual;
        self.next_virtual += 1;
        self.add_tensor(uid, dtype, layout, true, false)
    }

    fn get(&self, uid: Uid) -> &Descriptor {
        &self.tensors[&uid]
    }

    /// `y = mode(inputs…)`: one input (`exp`, `log`, `gen_index`, …), two (`x op b`) or three
    /// (`binary_select`: `t ? x : b`), computed in `compute`. `axis` is `gen_index`'s.
    pub(crate) fn pointwise(
        &mut self,
        mode: Pointwise,
        compute: DataType,
        inputs: &[Uid],
        y: Uid,
        axis: Option<i64>,
    ) -> CudnnResult<()> {
        use Attr::*;
        let desc = Descriptor::new(Kind::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
        desc.set(
            CUDNN_ATTR_POINTWISE_MODE,
            Ty::CUDNN_TYPE_POINTWISE_MODE,
            &[mode],
        )?;
        desc.set(
            CUDNN_ATTR_POINTWISE_MATH_PREC,
            Ty::CUDNN_TYPE_DATA_TYPE,
            &[compute.raw()],
        )?;
        if let Some(axis) = axis {
            desc.set(CUDNN_ATTR_POINTWISE_AXIS, Ty::CUDNN_TYPE_INT64, &[axis])?;
        }
        desc.finalize()?;
        let op = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
        op.set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &desc)?;
        op.set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, self.get(inputs[0]))?;
        if let Some(&b) = inputs.get(1) {
            op.set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, self.get(b))?;
        }
        if let Some(&t) = inputs.get(2) {
            op.set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, self.get(t))?;
        }
        op.set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, self.get(y))?;
        op.finalize()?;
        self.parameters.push(desc);
        self.operations.push(op);
        Ok(())
    }

    /// `y = reduce(x)` over the dimensions where `y` is smaller, in f32.
    pub(crate) fn reduction(&mut self, mode: Reduce, x: Uid, y: Uid) -> CudnnResult<()> {
        use Attr::*;
        let desc = Descriptor::new(Kind::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
        desc.set(
            CUDNN_ATTR_REDUCTION_OPERATOR,
            Ty::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE,
            &[mode],
        )?;
        desc.set(
            CUDNN_ATTR_REDUCTION_COMP_TYPE,
            Ty::CUDNN_TYPE_DATA_TYPE,
            &[DataType::Float.raw()],
        )?;
        desc.finalize()?;
        let op = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
        op.set_descriptor(CUDNN_ATTR_OPERATION_REDUCTION_DESC, &desc)?;
        op.set_descriptor(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, self.get(x))?;
        op.set_descriptor(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, self.get(y))?;
        op.finalize()?;
        self.parameters.push(desc);
        self.operations.push(op);
        Ok(())
    }

    /// `c = a · b` over the last two dimensions, batched over the first two, in f32.
    pub(crate) fn matmul(&mut self, a: Uid, b: Uid, c: Uid) -> CudnnResult<()> {
        use Attr::*;
        let desc = Descriptor::new(Kind::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
        desc.set(
            CUDNN_ATTR_MATMUL_COMP_TYPE,
            Ty::CUDNN_TYPE_DATA_TYPE,
            &[DataType::Float.raw()],
        )?;
        desc.finalize()?;
        let op = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
        op.set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_ADESC, self.get(a))?;
        op.set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_BDESC, self.get(b))?;
        op.set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_CDESC, self.get(c))?;
        op.set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_DESC, &desc)?;
        op.finalize()?;
        self.parameters.push(desc);
        self.operations.push(op);
        Ok(())
    }

    /// `y` is `x` seen with another layout (a transpose, for the engines).
    pub(crate) fn reshape(&mut self, x: Uid, y: Uid) -> CudnnResult<()> {
        use Attr::*;
        let op = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
        op.set_descriptor(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, self.get(x))?;
        op.set_descriptor(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, self.get(y))?;
        op.finalize()?;
        self.operations.push(op);
        Ok(())
    }

    /// The operation graph, and the first engine configuration of cuDNN's heuristics that
    /// builds an execution plan for it.
    pub(crate) fn build(self, handle: sys::cudnnHandle_t) -> CudnnResult<Plan> {
        use Attr::*;
        let graph = Descriptor::new(Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph.set(
            CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
            Ty::CUDNN_TYPE_HANDLE,
            &[handle],
        )?;
        let ops: Vec<_> = self.operations.iter().map(|op| op.raw).collect();
        graph.set(
            CUDNN_ATTR_OPERATIONGRAPH_OPS,
            Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            &ops,
        )?;
        graph.finalize()?;

        let heuristics = Descriptor::new(Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
        heuristics.set_descriptor(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &graph)?;
        heuristics.set(
            CUDNN_ATTR_ENGINEHEUR_MODE,
            Ty::CUDNN_TYPE_HEUR_MODE,
            &[sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A],
        )?;
        heuristics.finalize()?;
        let mut count = 0i64;
        // SAFETY: asks for the number of results only.
        check(
            unsafe {
                sys::cudnnBackendGetAttribute(
                    heuristics.raw,
                    CUDNN_ATTR_ENGINEHEUR_RESULTS,
                    Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                    0,
                    &mut count,
                    std::ptr::null_mut(),
                )
            },
            "counting the heuristics' engine configurations",
        )?;
        let configs = (0..count)
            .map(|_| Descriptor::new(Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
            .collect::<CudnnResult<Vec<_>>>()?;
        let mut raw: Vec<_> = configs.iter().map(|c| c.raw).collect();
        // SAFETY: `raw` holds `count` created engine-configuration descriptors to fill.
        check(
            unsafe {
                sys::cudnnBackendGetAttribute(
                    heuristics.raw,
                    CUDNN_ATTR_ENGINEHEUR_RESULTS,
                    Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                    count,
                    &mut count,
                    raw.as_mut_ptr() as *mut c_void,
                )
            },
            "reading the heuristics' engine configurations",
        )?;
        let mut refusals = Vec::new();
        for config in configs.into_iter().take(count as usize) {
            match plan_for(handle, &config) {
                Ok((plan, workspace_bytes)) => {
                    return Ok(Plan {
                        plan,
                        workspace_bytes,
                        _config: config,
                        _graph: graph,
                        _tensors: self.tensors,
                        _operations: self.operations,
                        _parameters: self.parameters,
                    });
                }
                Err(why) => refusals.push(why),
            }
        }
        Err(format!(
            "no cuDNN engine takes this graph ({count} configurations tried{})",
            refusals
                .first()
                .map(|w| format!("; the first said: {w}"))
                .unwrap_or_default()
        ))
    }
}

fn plan_for(handle: sys::cudnnHandle_t, config: &Descriptor) -> CudnnResult<(Descriptor, usize)> {
    use Attr::*;
    let plan = Descriptor::new(Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
    plan.set(
        CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
        Ty::CUDNN_TYPE_HANDLE,
        &[handle],
    )?;
    plan.set_descriptor(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, config)?;
    plan.finalize()?;
    let (mut workspace, mut got) = (0i64, 0i64);
    // SAFETY: one int64 is read into `workspace`.
    check(
        unsafe {
            sys::cudnnBackendGetAttribute(
                plan.raw,
                CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                Ty::CUDNN_TYPE_INT64,
                1,
                &mut got,
                &mut workspace as *mut i64 as *mut c_void,
            )
        },
        "reading an execution plan's workspace size",
    )?;
    Ok((plan, workspace.max(0) as usize))
}

/// An execution plan and everything it was built from.
pub(crate) struct Plan {
    plan: Descriptor,
    /// Bytes of scratch memory the engine needs at execution.
    pub workspace_bytes: usize,
    _config: Descriptor,
    _graph: Descriptor,
    _tensors: HashMap<Uid, Descriptor>,
    _operations: Vec<Descriptor>,
    _parameters: Vec<Descriptor>,
}

impl Plan {
    /// Runs the plan on `handle`'s stream with `pointers` for the graph's non-virtual tensors
    /// (device pointers; host pointers for scalars passed by value).
    ///
    /// # Safety
    /// Each pointer must address memory of the size and type its tensor was declared with,
    /// and `workspace` at least [`Plan::workspace_bytes`] of device memory, until the stream
    /// has run the plan.
    pub(crate) unsafe fn execute(
        &self,
        handle: sys::cudnnHandle_t,
        pointers: &[(Uid, *mut c_void)],
        workspace: *mut c_void,
    ) -> CudnnResult<()> {
        use Attr::*;
        let pack = Descriptor::new(Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        let uids: Vec<Uid> = pointers.iter().map(|p| p.0).collect();
        let data: Vec<*mut c_void> = pointers.iter().map(|p| p.1).collect();
        pack.set(
            CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
            Ty::CUDNN_TYPE_INT64,
            &uids,
        )?;
        pack.set(
            CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
            Ty::CUDNN_TYPE_VOID_PTR,
            &data,
        )?;
        pack.set(
            CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            Ty::CUDNN_TYPE_VOID_PTR,
            &[workspace],
        )?;
        pack.finalize()?;
        // SAFETY: the caller's contract.
        check(
            unsafe { sys::cudnnBackendExecute(handle, self.plan.raw, pack.raw) },
            "executing a cuDNN plan",
        )
    }
}
