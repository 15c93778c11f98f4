"""cffi ABI-mode binding to exactly the part of the oneDNN 3.2 C API the oneDNN backend uses.

The declarations mirror oneapi/dnnl/dnnl.h and dnnl_types.h of oneDNN 3.2; enums are 32-bit
ints in the C ABI, so they are declared as ``int`` typedefs and their values (checked against
the 3.2 headers with a compiled probe) live in the constants below.
"""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys

import cffi

log = logging.getLogger(__name__)

CDEF = """
typedef int dnnl_status_t;
typedef int dnnl_data_type_t;
typedef int dnnl_format_tag_t;
typedef int dnnl_engine_kind_t;
typedef int dnnl_prop_kind_t;
typedef int dnnl_alg_kind_t;
typedef int dnnl_query_t;
typedef int dnnl_scratchpad_mode_t;
typedef int64_t dnnl_dim_t;
typedef dnnl_dim_t dnnl_dims_t[12];

typedef struct dnnl_engine *dnnl_engine_t;
typedef struct dnnl_stream *dnnl_stream_t;
typedef struct dnnl_memory_desc *dnnl_memory_desc_t;
typedef const struct dnnl_memory_desc *const_dnnl_memory_desc_t;
typedef struct dnnl_memory *dnnl_memory_t;
typedef struct dnnl_primitive_desc *dnnl_primitive_desc_t;
typedef const struct dnnl_primitive_desc *const_dnnl_primitive_desc_t;
typedef struct dnnl_primitive_attr *dnnl_primitive_attr_t;
typedef const struct dnnl_primitive_attr *const_dnnl_primitive_attr_t;
typedef struct dnnl_post_ops *dnnl_post_ops_t;
typedef const struct dnnl_post_ops *const_dnnl_post_ops_t;
typedef struct dnnl_primitive *dnnl_primitive_t;
typedef const struct dnnl_primitive *const_dnnl_primitive_t;

typedef struct {
    int arg;
    dnnl_memory_t memory;
} dnnl_exec_arg_t;

typedef struct {
    int major;
    int minor;
    int patch;
    const char *hash;
    unsigned cpu_runtime;
    unsigned gpu_runtime;
} dnnl_version_t;

const dnnl_version_t *dnnl_version(void);

dnnl_status_t dnnl_engine_create(dnnl_engine_t *engine, dnnl_engine_kind_t kind, size_t index);
dnnl_status_t dnnl_engine_destroy(dnnl_engine_t engine);
dnnl_status_t dnnl_stream_create(dnnl_stream_t *stream, dnnl_engine_t engine, unsigned flags);
dnnl_status_t dnnl_stream_wait(dnnl_stream_t stream);
dnnl_status_t dnnl_stream_destroy(dnnl_stream_t stream);

dnnl_status_t dnnl_memory_desc_create_with_tag(dnnl_memory_desc_t *memory_desc, int ndims,
        const dnnl_dims_t dims, dnnl_data_type_t data_type, dnnl_format_tag_t tag);
dnnl_status_t dnnl_memory_desc_create_with_strides(dnnl_memory_desc_t *memory_desc, int ndims,
        const dnnl_dims_t dims, dnnl_data_type_t data_type, const dnnl_dims_t strides);
dnnl_status_t dnnl_memory_desc_destroy(dnnl_memory_desc_t memory_desc);
dnnl_status_t dnnl_memory_desc_reshape(dnnl_memory_desc_t *out_memory_desc,
        const_dnnl_memory_desc_t in_memory_desc, int ndims, const dnnl_dims_t dims);
size_t dnnl_memory_desc_get_size(const_dnnl_memory_desc_t memory_desc);
int dnnl_memory_desc_equal(const_dnnl_memory_desc_t lhs, const_dnnl_memory_desc_t rhs);
dnnl_status_t dnnl_memory_desc_query(const_dnnl_memory_desc_t memory_desc, dnnl_query_t what,
        void *result);

dnnl_status_t dnnl_memory_create(dnnl_memory_t *memory, const_dnnl_memory_desc_t memory_desc,
        dnnl_engine_t engine, void *handle);
dnnl_status_t dnnl_memory_set_data_handle(dnnl_memory_t memory, void *handle);
dnnl_status_t dnnl_memory_destroy(dnnl_memory_t memory);

dnnl_status_t dnnl_primitive_attr_create(dnnl_primitive_attr_t *attr);
dnnl_status_t dnnl_primitive_attr_destroy(dnnl_primitive_attr_t attr);
dnnl_status_t dnnl_primitive_attr_set_scratchpad_mode(dnnl_primitive_attr_t attr,
        dnnl_scratchpad_mode_t mode);
dnnl_status_t dnnl_primitive_attr_set_post_ops(dnnl_primitive_attr_t attr,
        const_dnnl_post_ops_t post_ops);
dnnl_status_t dnnl_post_ops_create(dnnl_post_ops_t *post_ops);
dnnl_status_t dnnl_post_ops_destroy(dnnl_post_ops_t post_ops);
dnnl_status_t dnnl_post_ops_append_eltwise(dnnl_post_ops_t post_ops, dnnl_alg_kind_t alg_kind,
        float alpha, float beta);

dnnl_status_t dnnl_primitive_desc_destroy(dnnl_primitive_desc_t primitive_desc);
const_dnnl_memory_desc_t dnnl_primitive_desc_query_md(const_dnnl_primitive_desc_t primitive_desc,
        dnnl_query_t what, int index);
dnnl_status_t dnnl_primitive_desc_query(const_dnnl_primitive_desc_t primitive_desc,
        dnnl_query_t what, int index, void *result);
dnnl_status_t dnnl_primitive_create(dnnl_primitive_t *primitive,
        const_dnnl_primitive_desc_t primitive_desc);
dnnl_status_t dnnl_primitive_execute(const_dnnl_primitive_t primitive, dnnl_stream_t stream,
        int nargs, const dnnl_exec_arg_t *args);
dnnl_status_t dnnl_primitive_destroy(dnnl_primitive_t primitive);

dnnl_status_t dnnl_convolution_forward_primitive_desc_create(
        dnnl_primitive_desc_t *primitive_desc, dnnl_engine_t engine,
        dnnl_prop_kind_t prop_kind, dnnl_alg_kind_t alg_kind,
        const_dnnl_memory_desc_t src_desc, const_dnnl_memory_desc_t weights_desc,
        const_dnnl_memory_desc_t bias_desc, const_dnnl_memory_desc_t dst_desc,
        const dnnl_dims_t strides, const dnnl_dims_t dilates,
        const dnnl_dims_t padding_l, const dnnl_dims_t padding_r,
        const_dnnl_primitive_attr_t attr);
dnnl_status_t dnnl_convolution_backward_data_primitive_desc_create(
        dnnl_primitive_desc_t *primitive_desc, dnnl_engine_t engine,
        dnnl_alg_kind_t alg_kind, const_dnnl_memory_desc_t diff_src_desc,
        const_dnnl_memory_desc_t weights_desc, const_dnnl_memory_desc_t diff_dst_desc,
        const dnnl_dims_t strides, const dnnl_dims_t dilates,
        const dnnl_dims_t padding_l, const dnnl_dims_t padding_r,
        const_dnnl_primitive_desc_t hint_fwd_pd, const_dnnl_primitive_attr_t attr);
dnnl_status_t dnnl_convolution_backward_weights_primitive_desc_create(
        dnnl_primitive_desc_t *primitive_desc, dnnl_engine_t engine,
        dnnl_alg_kind_t alg_kind, const_dnnl_memory_desc_t src_desc,
        const_dnnl_memory_desc_t diff_weights_desc, const_dnnl_memory_desc_t diff_bias_desc,
        const_dnnl_memory_desc_t diff_dst_desc, const dnnl_dims_t strides,
        const dnnl_dims_t dilates, const dnnl_dims_t padding_l, const dnnl_dims_t padding_r,
        const_dnnl_primitive_desc_t hint_fwd_pd, const_dnnl_primitive_attr_t attr);

dnnl_status_t dnnl_pooling_forward_primitive_desc_create(
        dnnl_primitive_desc_t *primitive_desc, dnnl_engine_t engine,
        dnnl_prop_kind_t prop_kind, dnnl_alg_kind_t alg_kind,
        const_dnnl_memory_desc_t src_desc, const_dnnl_memory_desc_t dst_desc,
        const dnnl_dims_t strides, const dnnl_dims_t kernel, const dnnl_dims_t dilation,
        const dnnl_dims_t padding_l, const dnnl_dims_t padding_r,
        const_dnnl_primitive_attr_t attr);
dnnl_status_t dnnl_pooling_backward_primitive_desc_create(
        dnnl_primitive_desc_t *primitive_desc, dnnl_engine_t engine,
        dnnl_alg_kind_t alg_kind, const_dnnl_memory_desc_t diff_src_desc,
        const_dnnl_memory_desc_t diff_dst_desc, const dnnl_dims_t strides,
        const dnnl_dims_t kernel, const dnnl_dims_t dilation,
        const dnnl_dims_t padding_l, const dnnl_dims_t padding_r,
        const_dnnl_primitive_desc_t hint_fwd_pd, const_dnnl_primitive_attr_t attr);

dnnl_status_t dnnl_batch_normalization_forward_primitive_desc_create(
        dnnl_primitive_desc_t *primitive_desc, dnnl_engine_t engine,
        dnnl_prop_kind_t prop_kind, const_dnnl_memory_desc_t src_desc,
        const_dnnl_memory_desc_t dst_desc, float epsilon, unsigned flags,
        const_dnnl_primitive_attr_t attr);
dnnl_status_t dnnl_batch_normalization_backward_primitive_desc_create(
        dnnl_primitive_desc_t *primitive_desc, dnnl_engine_t engine,
        dnnl_prop_kind_t prop_kind, const_dnnl_memory_desc_t diff_src_desc,
        const_dnnl_memory_desc_t diff_dst_desc, const_dnnl_memory_desc_t src_desc,
        float epsilon, unsigned flags, const_dnnl_primitive_desc_t hint_fwd_pd,
        const_dnnl_primitive_attr_t attr);

dnnl_status_t dnnl_eltwise_forward_primitive_desc_create(
        dnnl_primitive_desc_t *primitive_desc, dnnl_engine_t engine,
        dnnl_prop_kind_t prop_kind, dnnl_alg_kind_t alg_kind,
        const_dnnl_memory_desc_t src_desc, const_dnnl_memory_desc_t dst_desc,
        float alpha, float beta, const_dnnl_primitive_attr_t attr);
dnnl_status_t dnnl_eltwise_backward_primitive_desc_create(
        dnnl_primitive_desc_t *primitive_desc, dnnl_engine_t engine,
        dnnl_alg_kind_t alg_kind, const_dnnl_memory_desc_t diff_src_desc,
        const_dnnl_memory_desc_t diff_dst_desc, const_dnnl_memory_desc_t data_desc,
        float alpha, float beta, const_dnnl_primitive_desc_t hint_fwd_pd,
        const_dnnl_primitive_attr_t attr);

dnnl_status_t dnnl_inner_product_forward_primitive_desc_create(
        dnnl_primitive_desc_t *primitive_desc, dnnl_engine_t engine,
        dnnl_prop_kind_t prop_kind, const_dnnl_memory_desc_t src_desc,
        const_dnnl_memory_desc_t weights_desc, const_dnnl_memory_desc_t bias_desc,
        const_dnnl_memory_desc_t dst_desc, const_dnnl_primitive_attr_t attr);
dnnl_status_t dnnl_inner_product_backward_data_primitive_desc_create(
        dnnl_primitive_desc_t *primitive_desc, dnnl_engine_t engine,
        const_dnnl_memory_desc_t diff_src_desc, const_dnnl_memory_desc_t weights_desc,
        const_dnnl_memory_desc_t diff_dst_desc, const_dnnl_primitive_desc_t hint_fwd_pd,
        const_dnnl_primitive_attr_t attr);
dnnl_status_t dnnl_inner_product_backward_weights_primitive_desc_create(
        dnnl_primitive_desc_t *primitive_desc, dnnl_engine_t engine,
        const_dnnl_memory_desc_t src_desc, const_dnnl_memory_desc_t diff_weights_desc,
        const_dnnl_memory_desc_t diff_bias_desc, const_dnnl_memory_desc_t diff_dst_desc,
        const_dnnl_primitive_desc_t hint_fwd_pd, const_dnnl_primitive_attr_t attr);

dnnl_status_t dnnl_matmul_primitive_desc_create(
        dnnl_primitive_desc_t *primitive_desc, dnnl_engine_t engine,
        const_dnnl_memory_desc_t src_desc, const_dnnl_memory_desc_t weights_desc,
        const_dnnl_memory_desc_t bias_desc, const_dnnl_memory_desc_t dst_desc,
        const_dnnl_primitive_attr_t attr);

dnnl_status_t dnnl_binary_primitive_desc_create(
        dnnl_primitive_desc_t *primitive_desc, dnnl_engine_t engine,
        dnnl_alg_kind_t alg_kind, const_dnnl_memory_desc_t src0_desc,
        const_dnnl_memory_desc_t src1_desc, const_dnnl_memory_desc_t dst_desc,
        const_dnnl_primitive_attr_t attr);

dnnl_status_t dnnl_reorder_primitive_desc_create(
        dnnl_primitive_desc_t *reorder_primitive_desc,
        const_dnnl_memory_desc_t src_desc, dnnl_engine_t src_engine,
        const_dnnl_memory_desc_t dst_desc, dnnl_engine_t dst_engine,
        const_dnnl_primitive_attr_t attr);
"""

# dnnl_status_t
STATUS_NAMES = {
    0: "dnnl_success", 1: "dnnl_out_of_memory", 2: "dnnl_invalid_arguments",
    3: "dnnl_unimplemented", 4: "dnnl_last_impl_reached", 5: "dnnl_runtime_error",
    6: "dnnl_not_required", 7: "dnnl_invalid_graph", 8: "dnnl_invalid_graph_op",
    9: "dnnl_invalid_shape", 10: "dnnl_invalid_data_type",
}
SUCCESS = 0

# dnnl_data_type_t
DT_F32, DT_S32, DT_S8, DT_U8 = 3, 4, 5, 6
# dnnl_format_tag_t (plain tags; `any` lets the primitive choose)
TAG_ANY, TAG_A, TAG_AB, TAG_ABCD = 1, 2, 3, 5
TAG_X, TAG_NC, TAG_OI, TAG_NCHW, TAG_OIHW = TAG_A, TAG_AB, TAG_AB, TAG_ABCD, TAG_ABCD
TAG_NCHW16C = 78  # dnnl_nChw16c == dnnl_aBcd16b: channels blocked by 16
TAG_NHWC = 22  # dnnl_nhwc == dnnl_acdb: channels last
# dnnl_engine_kind_t, stream flags
ENGINE_CPU = 1
STREAM_DEFAULT_FLAGS = 1
# dnnl_prop_kind_t
FORWARD_TRAINING, FORWARD_INFERENCE = 64, 96
BACKWARD, BACKWARD_DATA, BACKWARD_WEIGHTS = 128, 160, 192
# dnnl_alg_kind_t
CONVOLUTION_DIRECT, CONVOLUTION_AUTO = 1, 3
ELTWISE_RELU = 32
BINARY_ADD = 0x1FFF0
POOLING_MAX, POOLING_AVG_INCLUDE_PADDING, POOLING_AVG_EXCLUDE_PADDING = 511, 767, 1023
# dnnl_normalization_flags_t
USE_GLOBAL_STATS, USE_SCALE, USE_SHIFT = 0x1, 0x2, 0x4
# dnnl_scratchpad_mode_t
SCRATCHPAD_LIBRARY, SCRATCHPAD_USER = 0, 1
# dnnl_query_t
QUERY_IMPL_INFO_STR = 8
QUERY_EXEC_ARG_MD = 255
QUERY_SRC_MD, QUERY_DIFF_SRC_MD, QUERY_WEIGHTS_MD, QUERY_DIFF_WEIGHTS_MD = 129, 130, 131, 132
QUERY_DST_MD, QUERY_DIFF_DST_MD, QUERY_WORKSPACE_MD, QUERY_SCRATCHPAD_MD = 133, 134, 135, 136
QUERY_NDIMS_S32, QUERY_DIMS, QUERY_DATA_TYPE = 256, 257, 258
# DNNL_ARG_*
ARG_SRC, ARG_SRC_1, ARG_DST, ARG_WEIGHTS, ARG_BIAS = 1, 2, 17, 33, 41
ARG_MEAN, ARG_VARIANCE, ARG_SCALE, ARG_SHIFT = 49, 50, 51, 52
ARG_WORKSPACE, ARG_SCRATCHPAD = 64, 80
ARG_DIFF_SRC, ARG_DIFF_DST, ARG_DIFF_WEIGHTS, ARG_DIFF_BIAS = 129, 145, 161, 169
ARG_DIFF_SCALE, ARG_DIFF_SHIFT = 255, 256
ARG_FROM, ARG_TO = ARG_SRC, ARG_DST

PACKAGES = "onednn-cpu-gomp and onednn-devel-cpu-gomp (oneDNN 3.2, pip install onednn-cpu-gomp==2023.2.0 onednn-devel-cpu-gomp==2023.2.0)"


class OneDNNNotFoundError(ImportError):
    """libdnnl could not be loaded; the message lists the paths tried and the packages to install."""


class OneDNNError(RuntimeError):
    """A oneDNN C call returned a status other than dnnl_success."""

    def __init__(self, function: str, status: int, detail: str = ""):
        self.function = function
        self.status = status
        self.status_name = STATUS_NAMES.get(status, f"unknown status {status}")
        msg = f"{function} failed with {self.status_name}"
        super().__init__(msg + (f" ({detail})" if detail else ""))


ffi = cffi.FFI()
ffi.cdef(CDEF)


def candidate_paths() -> list[str]:
    """Library locations tried in order: the active prefix's lib/, then the linker's search."""
    paths = [os.path.join(sys.prefix, "lib", "libdnnl.so.3"), os.path.join(sys.prefix, "lib", "libdnnl.so")]
    found = ctypes.util.find_library("dnnl")
    if found:
        paths.append(found)
    return paths


def load_library():
    """dlopen libdnnl (oneDNN 3.x) or raise OneDNNNotFoundError naming paths and packages."""
    tried = []
    for path in candidate_paths():
        tried.append(path)
        if os.path.isabs(path) and not os.path.exists(path):
            continue
        try:
            lib = ffi.dlopen(path)
        except OSError as exc:
            log.debug("could not dlopen %s: %s", path, exc)
            continue
        version = lib.dnnl_version()
        if version.major != 3:
            log.debug("skipping %s: oneDNN %d.%d, need 3.x", path, version.major, version.minor)
            continue
        log.debug("loaded oneDNN %d.%d.%d from %s", version.major, version.minor, version.patch, path)
        return lib
    raise OneDNNNotFoundError(
        f"oneDNN 3.x library (libdnnl.so.3) not found; tried {tried or ['<no candidates>']}. "
        f"Install the packages {PACKAGES} into this environment ({sys.prefix})."
    )


def check(lib, function: str, *args, detail: str = ""):
    """Call lib.<function>(*args) and raise OneDNNError unless it returns dnnl_success."""
    status = getattr(lib, function)(*args)
    if status != SUCCESS:
        raise OneDNNError(function, status, detail)
