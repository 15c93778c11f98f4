/* cachedarrays._records: the manager's per-array records (Region, Object) as C types.
 *
 * Every array the library hands out has one Object and at least one Region; making and
 * dropping them is on the path of every NumPy call that returns an array. As C types their
 * construction and the Object's finalizer cost a fraction of the Python versions', with the
 * same attributes (read and written from Python as before). The Python classes in
 * cachedarrays.manager subclass these and add the properties and reprs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <time.h>
#include <structmember.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#define NO_IMPORT_UFUNC                              /* the ufunc struct only, not its API */
#include <numpy/ufuncobject.h>

#include "select.h"
#include "walk.h"

/* ---- garbage collection, shared by both records ---------------------------------------------- */

/* A record is PyObject_HEAD, then PyObject * fields only, then the weak-reference list: its
 * fields are the pointers between the head and the type's tp_weaklistoffset. */
static PyObject **
record_fields(PyObject *self, Py_ssize_t *n)
{
    *n = (Py_TYPE(self)->tp_weaklistoffset - (Py_ssize_t)sizeof(PyObject)) /
         (Py_ssize_t)sizeof(PyObject *);
    return (PyObject **)((char *)self + sizeof(PyObject));
}

static int
record_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_ssize_t n;
    PyObject **f = record_fields(self, &n);
    for (Py_ssize_t i = 0; i < n; i++)
        Py_VISIT(f[i]);
    return 0;
}

static int
record_clear(PyObject *self)
{
    Py_ssize_t n;
    PyObject **f = record_fields(self, &n);
    for (Py_ssize_t i = 0; i < n; i++)
        Py_CLEAR(f[i]);
    return 0;
}

static void
record_dealloc(PyObject *self)
{
    PyObject_GC_UnTrack(self);
    if (*(PyObject **)((char *)self + Py_TYPE(self)->tp_weaklistoffset) != NULL)
        PyObject_ClearWeakRefs(self);
    record_clear(self);
    Py_TYPE(self)->tp_free(self);
}


/* ---- state records: the attributes C reads on every call, as fields --------------------------
 *
 * Manager, Telemetry, Device and Heap subclass these, so the attributes the hot path reads
 * (the manager's flags and tables, the telemetry counters, a device's heap, a heap's handle)
 * live in C fields. Python reads and writes them as before (they are member slots); C reads
 * them without an attribute lookup once it has checked that the instance's type resolves each
 * name to the record's own slot (no subclass shadows it with a property). */

#define MAX_STATE 24

typedef struct {
    PyObject_HEAD
    PyObject *f[MAX_STATE];                          /* only the first n of a kind are used */
} StateRecord;

typedef struct {
    PyTypeObject *type;
    const char *const *names;
    int n;
    PyObject *interned[MAX_STATE];
    PyMemberDef members[MAX_STATE + 1];
    PyTypeObject *checked;                           /* the last subtype found to be plain */
} StateKind;

static const char *const manager_names[] = {
    "closed", "_gate", "_closing", "_lock", "_cond", "_dropped", "_dependents", "_debug",
    "_deferred", "_copies", "_reading", "_ids", "_last_id", "_objects", "_ref", "_observers",
    "fast", "_by_offset", "telemetry", "policy", "recomputing"};
static const char *const telemetry_names[] = {"_names", "_log"};
static const char *const device_names[] = {"name", "heap", "_mm"};
static const char *const heap_names[] = {"_addr"};
static const char *const lru_names[] = {"recent", "soft"};

#define STATE_TYPE(var, pyname, doc, count)                                                     \
    static PyTypeObject var = {                                                                 \
        PyVarObject_HEAD_INIT(NULL, 0)                                                          \
        .tp_name = "cachedarrays._records." pyname,                                             \
        .tp_doc = doc,                                                                          \
        .tp_basicsize = sizeof(PyObject) + (count + 1) * sizeof(PyObject *),                   \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,               \
        .tp_new = PyType_GenericNew,                                                            \
        .tp_dealloc = record_dealloc,                                                           \
        .tp_traverse = record_traverse,                                                         \
        .tp_clear = record_clear,                                                               \
        .tp_weaklistoffset = sizeof(PyObject) + count * sizeof(PyObject *),                    \
    }
#define COUNT(a) ((int)(sizeof a / sizeof *a))
STATE_TYPE(ManagerRecordType, "ManagerRecord", "The manager's state the hot path reads.",
           COUNT(manager_names));
/* Telemetry's allocation counters, per device (at most TEL_DEVICES, in the order of the
 * record's _names): plain integers after the record's fields, so the common allocation and free
 * paths count without a dict or an int object. Python reads and writes them through a
 * memoryview of the record. */
#define TEL_DEVICES 4
enum { TC_ALLOCS, TC_FREES, TC_CURRENT, TC_PEAK, TC_KINDS };
typedef struct { long long n[TC_KINDS][TEL_DEVICES]; } TelCounts;
#define TEL_FIELDS_SIZE (sizeof(PyObject) + (COUNT(telemetry_names) + 1) * sizeof(PyObject *))
#define TEL_COUNTS(o) ((TelCounts *)((char *)(o) + TEL_FIELDS_SIZE))

/* The buffer protocol: memoryview(telemetry) is the counter block (writable int64 bytes:
 * [allocs, frees, current, peak] x TEL_DEVICES), and it keeps the telemetry alive. */
static int
telemetry_getbuffer(PyObject *self, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, self, (void *)TEL_COUNTS(self), sizeof(TelCounts), 0, flags);
}

static PyBufferProcs telemetry_buffer = {.bf_getbuffer = telemetry_getbuffer};

static PyTypeObject TelemetryRecordType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cachedarrays._records.TelemetryRecord",
    .tp_doc = "The telemetry counters of allocations.",
    .tp_basicsize = TEL_FIELDS_SIZE + sizeof(TelCounts),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = record_dealloc,
    .tp_traverse = record_traverse,
    .tp_clear = record_clear,
    .tp_weaklistoffset = sizeof(PyObject) + COUNT(telemetry_names) * sizeof(PyObject *),
    .tp_as_buffer = &telemetry_buffer,
};
STATE_TYPE(DeviceRecordType, "DeviceRecord", "A device's name, heap and mapping.",
           COUNT(device_names));
STATE_TYPE(HeapRecordType, "HeapRecord", "A native heap's handle.", COUNT(heap_names));
STATE_TYPE(LRURecordType, "LRURecord", "The LRU policy's two recency tiers.", COUNT(lru_names));

enum { K_MANAGER, K_TELEMETRY, K_DEVICE, K_HEAP, K_LRU };             /* kinds[] order */
enum { M_CLOSED, M_GATE, M_CLOSING, M_LOCK, M_COND, M_DROPPED, M_DEPENDENTS, M_DEBUG, M_DEFERRED,
       M_COPIES, M_READING, M_IDS, M_LAST_ID, M_OBJECTS, M_REF, M_OBSERVERS, M_FAST, M_BY_OFFSET,
       M_TELEMETRY, M_POLICY, M_RECOMPUTING };   /* manager_names order */
enum { TEL_NAMES, TEL_LOG };
enum { D_NAME, D_HEAP, D_MM };
enum { H_ADDR };
enum { L_RECENT, L_SOFT };

_Static_assert(M_RECOMPUTING + 1 == COUNT(manager_names) &&
               TEL_LOG + 1 == COUNT(telemetry_names) &&
               D_MM + 1 == COUNT(device_names) && H_ADDR + 1 == COUNT(heap_names) &&
               L_SOFT + 1 == COUNT(lru_names),
               "the field enums follow the name tables");

static StateKind kinds[] = {
    {&ManagerRecordType, manager_names, COUNT(manager_names)},
    {&TelemetryRecordType, telemetry_names, COUNT(telemetry_names)},
    {&DeviceRecordType, device_names, COUNT(device_names)},
    {&HeapRecordType, heap_names, COUNT(heap_names)},
    {&LRURecordType, lru_names, COUNT(lru_names)},
};

static int
state_types_ready(void)
{
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
        StateKind *sk = &kinds[k];
        for (int i = 0; i < sk->n; i++) {
            if ((sk->interned[i] = PyUnicode_InternFromString(sk->names[i])) == NULL)
                return -1;
            sk->members[i] = (PyMemberDef){(char *)sk->names[i], T_OBJECT_EX,
                                           (Py_ssize_t)(sizeof(PyObject) + i * sizeof(PyObject *)),
                                           0, NULL};
        }
        sk->type->tp_members = sk->members;
        if (PyType_Ready(sk->type) < 0)
            return -1;
    }
    return 0;
}

/* The kind of o's type when every field name resolves to the record's own slot, else NULL. */
static StateKind *
state_kind(PyObject *o)
{
    PyTypeObject *t = Py_TYPE(o);
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++)     /* before any subtype check: */
        if (t == kinds[k].checked)       /* a policy's type was 4 PyType_IsSubtype, ~200 instr */
            return &kinds[k];
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
        StateKind *sk = &kinds[k];
        if (!PyType_IsSubtype(t, sk->type))
            continue;
        for (int i = 0; i < sk->n; i++) {
            PyObject *d = _PyType_Lookup(t, sk->interned[i]);
            if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type) ||
                    ((PyMemberDescrObject *)d)->d_member != &sk->members[i])
                return NULL;
        }
        sk->checked = t;
        return sk;
    }
    return NULL;
}

/* getattr(o, name), reading a state record's field directly. A new reference. */
static PyObject *
get(PyObject *o, PyObject *name)
{
    StateKind *sk = state_kind(o);
    if (sk != NULL)
        for (int i = 0; i < sk->n; i++)
            if (sk->interned[i] == name) {
                PyObject *v = ((StateRecord *)o)->f[i];
                if (v != NULL)
                    return Py_NewRef(v);
                break;                               /* unset: the usual AttributeError */
            }
    return PyObject_GetAttr(o, name);
}

/* get(o, name) for field i of kind k (the kinds table's order). A new reference. */
static inline PyObject *
getf(PyObject *o, int k, int i, PyObject *name)
{
    if (Py_TYPE(o) == kinds[k].checked || state_kind(o) == &kinds[k]) {
        PyObject *v = ((StateRecord *)o)->f[i];
        if (v != NULL)
            return Py_NewRef(v);
    }
    return PyObject_GetAttr(o, name);
}

/* setattr(o, name, v), writing a state record's field directly. */
static int
set(PyObject *o, PyObject *name, PyObject *v)
{
    StateKind *sk = state_kind(o);
    if (sk != NULL)
        for (int i = 0; i < sk->n; i++)
            if (sk->interned[i] == name) {
                Py_XSETREF(((StateRecord *)o)->f[i], Py_NewRef(v));
                return 0;
            }
    return PyObject_SetAttr(o, name, v);
}

static PyObject *deque_type, *deque_append;          /* collections.deque and its append */

/* PyObject_IsTrue, without its calls through the type's slots for the flags and tables the hot
 * path reads (True, False, None, and exact dicts, tuples, lists, sets and deques). */
static inline int
truth(PyObject *v)
{
    if (v == Py_False || v == Py_None)
        return 0;
    if (v == Py_True)
        return 1;
    if (PyDict_CheckExact(v))            /* the manager's tables: their sizes, without a call */
        return PyDict_GET_SIZE(v) != 0;
    if (PyAnySet_CheckExact(v))
        return PySet_GET_SIZE(v) != 0;
    if (PyTuple_CheckExact(v) || PyList_CheckExact(v) ||
            Py_IS_TYPE(v, (PyTypeObject *)deque_type))        /* variable-size: ob_size */
        return Py_SIZE(v) != 0;
    return PyObject_IsTrue(v);
}

/* ---- Region -------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *device;
    PyObject *offset;
    PyObject *nbytes;
    PyObject *owner;
    PyObject *dirty;
    PyObject *freed;
    PyObject *buffer;
    PyObject *weakrefs;
} RegionRecord;

static inline void
set_field(PyObject **slot, PyObject *value)
{
    PyObject *old = *slot;
    Py_INCREF(value);
    *slot = value;
    Py_XDECREF(old);
}

/* Region(device, offset, nbytes, owner, buffer=None): buffer, for a region of nbytes > 0, is
 * the device's mapping (buffer if given, else device.buffer); None for an empty region. */
static int
region_fill(RegionRecord *self, PyObject *device, PyObject *offset, PyObject *nbytes,
            PyObject *owner, PyObject *buffer)
{
    int has_bytes = PyObject_IsTrue(nbytes);
    if (has_bytes < 0)
        return -1;
    PyObject *mapping;
    if (!has_bytes) {
        mapping = Py_NewRef(Py_None);
    } else if (buffer != Py_None) {
        mapping = Py_NewRef(buffer);
    } else {
        mapping = PyObject_GetAttrString(device, "buffer");
        if (mapping == NULL)
            return -1;
    }
    set_field(&self->device, device);
    set_field(&self->offset, offset);
    set_field(&self->nbytes, nbytes);
    set_field(&self->owner, owner);
    set_field(&self->dirty, Py_False);
    set_field(&self->freed, Py_False);
    set_field(&self->buffer, mapping);
    Py_DECREF(mapping);
    return 0;
}

static int
region_init(RegionRecord *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"device", "offset", "nbytes", "owner", "buffer", NULL};
    PyObject *device, *offset, *nbytes, *owner, *buffer = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|O:Region", names, &device, &offset,
                                     &nbytes, &owner, &buffer))
        return -1;
    return region_fill(self, device, offset, nbytes, owner, buffer);
}

static PyMemberDef region_members[] = {
    {"device", T_OBJECT_EX, offsetof(RegionRecord, device), 0, "the device holding the block"},
    {"offset", T_OBJECT_EX, offsetof(RegionRecord, offset), 0,
     "heap block offset; -1 for a zero-byte region"},
    {"nbytes", T_OBJECT_EX, offsetof(RegionRecord, nbytes), 0, "bytes of data"},
    {"owner", T_OBJECT_EX, offsetof(RegionRecord, owner), 0, "id of the parent object"},
    {"_dirty", T_OBJECT_EX, offsetof(RegionRecord, dirty), 0, NULL},
    {"freed", T_OBJECT_EX, offsetof(RegionRecord, freed), 0, "the block was given back"},
    {"_buffer", T_OBJECT_EX, offsetof(RegionRecord, buffer), 0,
     "the device's mapping; None once freed or if empty"},
    {NULL}
};

static PyTypeObject RegionRecordType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cachedarrays._records.RegionRecord",
    .tp_doc = "The fields of a Region (a contiguous block on one device, owned by one object).",
    .tp_basicsize = sizeof(RegionRecord),
    .tp_itemsize = 0,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)region_init,
    .tp_dealloc = record_dealloc,
    .tp_traverse = record_traverse,
    .tp_clear = record_clear,
    .tp_members = region_members,
    .tp_weaklistoffset = offsetof(RegionRecord, weakrefs),
};

/* ---- Object -------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *id;
    PyObject *nbytes;
    PyObject *primary;
    PyObject *regions;
    PyObject *pins;
    PyObject *freed;
    PyObject *manager;
    PyObject *version;
    PyObject *dropped;
    PyObject *chain;
    PyObject *weakrefs;
} ObjectRecord;

static PyObject *str_closed, *str_deferred, *str_append, *zero;

static int
object_fill(ObjectRecord *self, PyObject *manager, PyObject *id, PyObject *nbytes,
            PyObject *primary, PyObject *device_name)
{
    PyObject *regions = PyDict_New();
    if (regions == NULL)
        return -1;
    if (primary != Py_None && PyDict_SetItem(regions, device_name, primary) < 0) {
        Py_DECREF(regions);
        return -1;
    }
    set_field(&self->id, id);
    set_field(&self->nbytes, nbytes);
    set_field(&self->primary, primary);
    set_field(&self->regions, regions);
    Py_DECREF(regions);
    set_field(&self->pins, zero);
    set_field(&self->freed, Py_False);
    set_field(&self->manager, manager);
    set_field(&self->version, zero);
    set_field(&self->dropped, Py_False);
    set_field(&self->chain, Py_None);
    return 0;
}

/* Object(manager_ref, obj_id, nbytes, primary=None, device_name=None) */
static int
object_init(ObjectRecord *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"manager_ref", "obj_id", "nbytes", "primary", "device_name", NULL};
    PyObject *manager, *id, *nbytes, *primary = Py_None, *device_name = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|OO:Object", names, &manager, &id, &nbytes,
                                     &primary, &device_name))
        return -1;
    return object_fill(self, manager, id, nbytes, primary, device_name);
}

/* The finalizer only queues: the manager frees the regions at its next call (as a finalizer
 * may run on any thread, at any point, it takes no lock). */
static void
object_finalize(ObjectRecord *self)
{
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    PyObject *m = NULL, *closed = NULL, *deferred = NULL, *entry = NULL, *res = NULL;
    if (self->freed == NULL || self->manager == NULL || self->id == NULL)
        goto done;                                   /* never initialised: nothing to queue */
    int freed = truth(self->freed);
    if (freed != 0)
        goto fail_or_done;
    if (PyWeakref_CheckRefExact(self->manager))    /* the weak reference to the manager */
        m = Py_NewRef(PyWeakref_GET_OBJECT(self->manager));
    else if ((m = PyObject_CallNoArgs(self->manager)) == NULL)
        goto fail;
    if (m == Py_None)
        goto done;
    closed = getf(m, K_MANAGER, M_CLOSED, str_closed);
    if (closed == NULL)
        goto fail;
    int is_closed = truth(closed);
    if (is_closed != 0)
        goto fail_or_done;
    deferred = getf(m, K_MANAGER, M_DEFERRED, str_deferred);
    if (deferred == NULL)
        goto fail;
    entry = PyTuple_Pack(3, self->id, self->regions ? self->regions : Py_None,
                         self->primary ? self->primary : Py_None);
    if (entry == NULL)
        goto fail;
    if (Py_IS_TYPE(deferred, (PyTypeObject *)deque_type)) {
        PyObject *a[2] = {deferred, entry};         /* deque.append, without the lookup */
        res = PyObject_Vectorcall(deque_append, a, 2, NULL);
    } else {
        res = PyObject_CallMethodOneArg(deferred, str_append, entry);
    }
    if (res == NULL)
        goto fail;
    goto done;
fail_or_done:
    if (!PyErr_Occurred())
        goto done;
fail:
    PyErr_WriteUnraisable((PyObject *)self);
done:
    Py_XDECREF(m);
    Py_XDECREF(closed);
    Py_XDECREF(deferred);
    Py_XDECREF(entry);
    Py_XDECREF(res);
    PyErr_Restore(exc_type, exc_value, exc_tb);
}

static PyMemberDef object_members[] = {
    {"id", T_OBJECT_EX, offsetof(ObjectRecord, id), 0, "the object's id in its manager"},
    {"nbytes", T_OBJECT_EX, offsetof(ObjectRecord, nbytes), 0, "bytes of data"},
    {"primary", T_OBJECT_EX, offsetof(ObjectRecord, primary), 0,
     "the region with the newest data"},
    {"regions", T_OBJECT_EX, offsetof(ObjectRecord, regions), 0,
     "device name -> Region (primary and linked regions)"},
    {"_pins", T_OBJECT_EX, offsetof(ObjectRecord, pins), 0, NULL},
    {"freed", T_OBJECT_EX, offsetof(ObjectRecord, freed), 0, "every region was given back"},
    {"_manager", T_OBJECT_EX, offsetof(ObjectRecord, manager), 0, NULL},
    {"version", T_OBJECT_EX, offsetof(ObjectRecord, version), 0,
     "how many kernels wrote the object"},
    {"dropped", T_OBJECT_EX, offsetof(ObjectRecord, dropped), 0,
     "the data was let go, to be rebuilt from its chain"},
    {"chain", T_OBJECT_EX, offsetof(ObjectRecord, chain), 0,
     "lineage: the recipes that made the data"},
    {NULL}
};

static PyTypeObject ObjectRecordType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cachedarrays._records.ObjectRecord",
    .tp_doc = "The fields of an Object (what the program holds: a primary region and linked "
              "regions), and its finalizer.",
    .tp_basicsize = sizeof(ObjectRecord),
    .tp_itemsize = 0,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)object_init,
    .tp_dealloc = record_dealloc,
    .tp_traverse = record_traverse,
    .tp_clear = record_clear,
    .tp_finalize = (destructor)object_finalize,
    .tp_members = object_members,
    .tp_weaklistoffset = offsetof(ObjectRecord, weakrefs),
};

/* ---- constructors for the hot path ---------------------------------------------------------- */

/* A new instance of cls (RegionRecord or a subclass) without the generic call machinery. */
static PyObject *
new_instance(PyObject *cls, PyTypeObject *base, const char *what)
{
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, base)) {
        PyErr_Format(PyExc_TypeError, "%s: cls must be a subclass of %s", what, base->tp_name);
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)cls;
    return type->tp_alloc(type, 0);
}

static PyObject *
make_region(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "region(cls, device, offset, nbytes, owner, buffer) takes 6 "
                     "arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *self = new_instance(args[0], &RegionRecordType, "region");
    if (self == NULL)
        return NULL;
    if (region_fill((RegionRecord *)self, args[1], args[2], args[3], args[4], args[5]) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return self;
}

static PyObject *
make_object(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "object(cls, manager_ref, obj_id, nbytes, primary, "
                     "device_name) takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *self = new_instance(args[0], &ObjectRecordType, "object");
    if (self == NULL)
        return NULL;
    if (object_fill((ObjectRecord *)self, args[1], args[2], args[3], args[4], args[5]) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return self;
}

/* ---- the manager's commonest steps --------------------------------------------------------- */

typedef int64_t (*heap_alloc_fn)(void *, uint64_t, uint64_t);
typedef int (*heap_free_fn)(void *, int64_t, uint64_t);
static heap_alloc_fn heap_alloc;
static heap_free_fn heap_free;
static PyObject *region_cls, *object_cls;        /* cachedarrays.manager.Region and Object */

static PyObject *s_fast, *s_heap, *s_addr, *s_last_id, *s_ids, *s_name, *s_mm, *s_ref,
                *s_objects, *s_by_offset, *s_telemetry, *s_log, *s_on_alloc, *s_on_free, *s_try_alloc, *s_free, *s_quick_free,
                *s_popleft, *s_copies, *s_observers, *s_dropped, *s_dependents, *s_debug,
                *s_policy, *s_forget, *s_release, *one, *s_lock, *s_acquire, *s_release_lock,
                *s_gate, *s_kernels_in_fast, *s_reading, *s_read_use, *s_write_use,
                *s_new_in_fast, *s_fast_first, *s_allocate, *s_live, *s_kview, *s_closing,
                *s_cond, *s_notify_all, *s_call, *s_recent, *s_soft, *s_move_to_end,
                *odict_move_to_end, *deque_popleft,
                *ufunc_type, *np_maximum, *np_minimum,
                *s_recomputing, *s_nout, *s_signature, *s_dunder_name, *s_use,
                *s_record, *s_scopes, *s_scope_opened, *s_fresh, *s_view, *s_readonly_buffer, *s_pop,
                *s_release_objs, *s_dirty, *s_markdirty, *s_manager,
                *out_kw;                                                /* out_kw: ("out",) */

static int
intern_names(void)
{
#define NAME(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1
    NAME(s_fast, "fast"); NAME(s_heap, "heap"); NAME(s_addr, "_addr");
    NAME(s_last_id, "_last_id"); NAME(s_ids, "_ids"); NAME(s_name, "name"); NAME(s_mm, "_mm");
    NAME(s_ref, "_ref"); NAME(s_objects, "_objects"); NAME(s_by_offset, "_by_offset");
    NAME(s_telemetry, "telemetry"); NAME(s_log, "_log");
    NAME(s_on_alloc, "on_alloc"); NAME(s_on_free, "on_free"); NAME(s_try_alloc, "try_alloc");
    NAME(s_free, "free"); NAME(s_quick_free, "quick_free"); NAME(s_popleft, "popleft");
    NAME(s_copies, "_copies"); NAME(s_observers, "_observers"); NAME(s_dropped, "_dropped");
    NAME(s_dependents, "_dependents"); NAME(s_debug, "_debug"); NAME(s_policy, "policy");
    NAME(s_forget, "forget"); NAME(s_release, "_release");
    NAME(s_lock, "_lock"); NAME(s_acquire, "acquire"); NAME(s_release_lock, "release");
    NAME(s_gate, "_gate"); NAME(s_kernels_in_fast, "kernels_in_fast");
    NAME(s_reading, "_reading"); NAME(s_read_use, "read_use"); NAME(s_write_use, "write_use");
    NAME(s_new_in_fast, "new_in_fast"); NAME(s_fast_first, "fast_first");
    NAME(s_allocate, "allocate"); NAME(s_live, "_live"); NAME(s_kview, "_kview");
    NAME(s_call, "__call__"); NAME(s_closing, "_closing"); NAME(s_cond, "_cond");
    NAME(s_notify_all, "notify_all"); NAME(s_recent, "recent"); NAME(s_soft, "soft");
    NAME(s_move_to_end, "move_to_end"); NAME(s_recomputing, "recomputing");
    NAME(s_nout, "nout"); NAME(s_use, "use"); NAME(s_signature, "signature");
    NAME(s_dunder_name, "__name__");
    NAME(s_record, "record"); NAME(s_scopes, "_scopes"); NAME(s_scope_opened, "scope_opened"); NAME(s_fresh, "_fresh");
    NAME(s_view, "_view"); NAME(s_readonly_buffer, "readonly_buffer"); NAME(s_pop, "pop");
    NAME(s_release_objs, "release"); NAME(s_dirty, "_dirty"); NAME(s_markdirty, "markdirty");
    NAME(s_manager, "manager");
#undef NAME
    if ((out_kw = Py_BuildValue("(s)", "out")) == NULL ||
            (odict_move_to_end = PyObject_GetAttr((PyObject *)&PyODict_Type, s_move_to_end)) == NULL)
        return -1;
    PyObject *collections = PyImport_ImportModule("collections");
    if (collections == NULL)
        return -1;
    deque_type = PyObject_GetAttrString(collections, "deque");
    Py_DECREF(collections);
    if (deque_type == NULL || (deque_popleft = PyObject_GetAttr(deque_type, s_popleft)) == NULL ||
            (deque_append = PyObject_GetAttrString(deque_type, "append")) == NULL)
        return -1;
    PyObject *numpy = PyImport_ImportModule("numpy");
    if (numpy == NULL)
        return -1;
    ufunc_type = PyObject_GetAttrString(numpy, "ufunc");
    np_maximum = PyObject_GetAttrString(numpy, "maximum");
    np_minimum = PyObject_GetAttrString(numpy, "minimum");
    Py_DECREF(numpy);
    if (ufunc_type == NULL || np_maximum == NULL || np_minimum == NULL)
        return -1;
    return (one = PyLong_FromLong(1)) == NULL ? -1 : 0;
}

/* bind(alloc_address, free_address, Region, Object): the native heap's ca_heap_alloc and
 * ca_heap_free, and the manager's record classes. */
static PyObject *
bind(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "bind(alloc_address, free_address, Region, Object)");
        return NULL;
    }
    void *a = PyLong_AsVoidPtr(args[0]), *f = PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyType_Check(args[2]) || !PyType_IsSubtype((PyTypeObject *)args[2], &RegionRecordType) ||
            !PyType_Check(args[3]) ||
            !PyType_IsSubtype((PyTypeObject *)args[3], &ObjectRecordType)) {
        PyErr_SetString(PyExc_TypeError, "bind: Region and Object must subclass the records");
        return NULL;
    }
    heap_alloc = (heap_alloc_fn)a;
    heap_free = (heap_free_fn)f;
    Py_XSETREF(region_cls, Py_NewRef(args[2]));
    Py_XSETREF(object_cls, Py_NewRef(args[3]));
    Py_RETURN_NONE;
}

/* Telemetry.on_alloc / on_free, done on the record's counters when no event log is open (and
 * the telemetry is a plain record that knows the device); else the Python method runs. */
static int
count(PyObject *m, PyObject *name, PyObject *nbytes, PyObject *oid, int alloc)
{
    int rc = -1;
    PyObject *tel = getf(m, K_MANAGER, M_TELEMETRY, s_telemetry), *log = NULL, *names = NULL,
             *v = NULL;
    if (tel == NULL || (log = getf(tel, K_TELEMETRY, TEL_LOG, s_log)) == NULL)
        goto out;
    Py_ssize_t dev = -1;
    if (log == Py_None && state_kind(tel) == &kinds[K_TELEMETRY] &&
            (names = ((StateRecord *)tel)->f[TEL_NAMES]) != NULL && PyTuple_CheckExact(names)) {
        Py_ssize_t n = PyTuple_GET_SIZE(names);
        for (Py_ssize_t i = 0; i < n && i < TEL_DEVICES && dev < 0; i++)
            if (PyTuple_GET_ITEM(names, i) == name)
                dev = i;
        for (Py_ssize_t i = 0; i < n && i < TEL_DEVICES && dev < 0; i++) {
            int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(names, i), name, Py_EQ);
            if (eq < 0)
                goto out;
            if (eq)
                dev = i;
        }
    }
    if (dev < 0) {
        v = PyObject_CallMethodObjArgs(tel, alloc ? s_on_alloc : s_on_free, name, nbytes, oid,
                                       NULL);
        rc = v == NULL ? -1 : 0;
        goto out;
    }
    long long nb = PyLong_AsLongLong(nbytes);
    if (nb == -1 && PyErr_Occurred())
        goto out;
    TelCounts *c = TEL_COUNTS(tel);
    if (alloc) {
        c->n[TC_ALLOCS][dev] += 1;
        c->n[TC_CURRENT][dev] += nb;
        if (c->n[TC_CURRENT][dev] > c->n[TC_PEAK][dev])
            c->n[TC_PEAK][dev] = c->n[TC_CURRENT][dev];
    } else {
        c->n[TC_FREES][dev] += 1;
        c->n[TC_CURRENT][dev] -= nb;
    }
    rc = 0;
out:
    Py_XDECREF(tel); Py_XDECREF(log); Py_XDECREF(v);
    return rc;
}

#if PY_VERSION_HEX >= 0x030D0000
#define lookup_attr PyObject_GetOptionalAttr
#else
#define lookup_attr _PyObject_LookupAttr
#endif

/* ---- the default policy's per-use hooks ------------------------------------------------------ */

/* LRU's read_use, new_in_fast and forget (cachedarrays.policies.lru), bound by bind_lru. When a
 * policy's method is one of these (not overridden in a subclass or on the instance), the C paths
 * do its OrderedDict operations themselves instead of running its Python frame. */
enum { HOOK_READ_USE, HOOK_NEW_IN_FAST, HOOK_FORGET, HOOK_WRITE_USE, N_HOOKS };
static PyObject *lru_hooks[N_HOOKS];
static PyObject *markdirty_fn;                       /* Manager.markdirty */

/* bind_lru(read_use, new_in_fast, forget, write_use, markdirty): LRU's own functions and
 * Manager.markdirty. */
static PyObject *
bind_lru(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != N_HOOKS + 1) {
        PyErr_SetString(PyExc_TypeError, "bind_lru(read_use, new_in_fast, forget, write_use, "
                        "markdirty)");
        return NULL;
    }
    for (int i = 0; i <= N_HOOKS; i++)
        if (!PyFunction_Check(args[i])) {
            PyErr_SetString(PyExc_TypeError, "bind_lru: expected five Python functions");
            return NULL;
        }
    for (int i = 0; i < N_HOOKS; i++)
        Py_XSETREF(lru_hooks[i], Py_NewRef(args[i]));
    Py_XSETREF(markdirty_fn, Py_NewRef(args[N_HOOKS]));
    Py_RETURN_NONE;
}

/* The policy's tier (field i of an LRU record, or the attribute name), a new reference; NULL
 * without an error when it is missing or not exactly an OrderedDict (the caller runs the Python
 * method instead). */
static PyObject *
lru_table(PyObject *policy, int i, PyObject *name)
{
    PyObject *t;
    if (Py_TYPE(policy) == kinds[K_LRU].checked || state_kind(policy) == &kinds[K_LRU]) {
        t = Py_XNewRef(((StateRecord *)policy)->f[i]);
    } else if (lookup_attr(policy, name, &t) < 0) {
        return NULL;
    }
    if (t != NULL && !PyODict_CheckExact(t))
        Py_CLEAR(t);
    return t;
}

/* The hook's body for an LRU policy: 1 done, 0 not done (no error: run the method), -1 error.
 * arg is the Object (read_use, new_in_fast) or the object's id (forget). */
static int
lru_hook(PyObject *policy, int which, PyObject *arg)
{
    PyObject *oid = which == HOOK_FORGET ? arg : ((ObjectRecord *)arg)->id;
    if (oid == NULL)
        return 0;
    Py_INCREF(oid);                     /* a property of the policy may rebind obj.id */
    int rc = -1;
    PyObject *recent = lru_table(policy, L_RECENT, s_recent), *soft = NULL, *t;
    if (recent == NULL) {
        rc = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    if (which != HOOK_NEW_IN_FAST && (soft = lru_table(policy, L_SOFT, s_soft)) == NULL) {
        rc = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    int in_recent = PyDict_Contains(recent, oid);
    if (in_recent < 0)
        goto done;
    if (which == HOOK_NEW_IN_FAST) {                    /* self.recent[obj.id] = None */
        rc = PyODict_SetItem(recent, oid, Py_None) < 0 ? -1 : 1;
    } else if (which == HOOK_READ_USE) {                /* move to the most recent end */
        if (in_recent) {
            PyObject *args[2] = {recent, oid};      /* OrderedDict.move_to_end(recent, oid) */
            t = PyObject_Vectorcall(odict_move_to_end, args, 2, NULL);
            rc = t == NULL ? -1 : 1;
            Py_XDECREF(t);
        } else {
            int in_soft = PyDict_Contains(soft, oid);
            if (in_soft < 0 || (in_soft && (PyODict_DelItem(soft, oid) < 0 ||
                                            PyODict_SetItem(recent, oid, Py_None) < 0)))
                goto done;
            rc = 1;
        }
    } else {                                            /* forget: out of both tiers */
        int in_soft = 0;
        if ((in_recent && PyODict_DelItem(recent, oid) < 0) ||
                (PyDict_GET_SIZE(soft) && (in_soft = PyDict_Contains(soft, oid)) < 0) ||
                (in_soft && PyODict_DelItem(soft, oid) < 0))
            goto done;
        rc = 1;
    }
done:
    Py_DECREF(oid);
    Py_XDECREF(recent);
    Py_XDECREF(soft);
    return rc;
}

/* 1 when o's attribute name resolves to fn itself: its type resolves it to that function and
 * the instance's __dict__ does not shadow it. 0 when not, -1 on error. */
static int
resolves_to(PyObject *o, PyObject *name, PyObject *fn)
{
    if (fn == NULL || _PyType_Lookup(Py_TYPE(o), name) != fn)
        return 0;
    PyObject *d = PyObject_GenericGetDict(o, NULL);
    if (d == NULL) {                                  /* no __dict__: nothing can shadow it */
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 1;
    }
    int shadowed = PyDict_Contains(d, name);
    Py_DECREF(d);
    return shadowed < 0 ? -1 : !shadowed;
}

/* 1 when policy's attribute name is LRU's hook which itself, 0 when not, -1 on error. */
static int
is_lru_hook(PyObject *policy, int which, PyObject *name)
{
    return resolves_to(policy, name, lru_hooks[which]);
}

/* The pending exception came from policy's hook name: add the note that names them
 * (cachedarrays.errors.note_policy_error). Keeps the exception; a failure to note is dropped. */
static void
note_hook(PyObject *policy, PyObject *name)
{
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    PyErr_NormalizeException(&et, &ev, &etb);
    if (ev != NULL && etb != NULL)
        PyException_SetTraceback(ev, etb);
    PyObject *mod = ev == NULL ? NULL : PyImport_ImportModule("cachedarrays.errors"), *t = NULL;
    if (mod != NULL)
        t = PyObject_CallMethod(mod, "note_policy_error", "OOO", ev, policy, name);
    Py_XDECREF(mod);
    Py_XDECREF(t);
    if (t == NULL)
        PyErr_Clear();
    PyErr_Restore(et, ev, etb);
}

/* policy.<name>(arg), the hook which of LRU's run in C (lru_hook) when the method is LRU's own.
 * Returns 0, or -1 with an exception set. */
static int
policy_hook(PyObject *policy, int which, PyObject *name, PyObject *arg)
{
    int own = is_lru_hook(policy, which, name);
    if (own < 0)
        return -1;
    if (own) {
        int done = lru_hook(policy, which, arg);
        if (done != 0)
            return done < 0 ? -1 : 0;
    }
    PyObject *t = PyObject_CallMethodOneArg(policy, name, arg);
    if (t == NULL) {
        note_hook(policy, name);
        return -1;
    }
    Py_DECREF(t);
    return 0;
}

/* 1 when LRU's own write_use of policy on obj (of manager m) may run in C: markdirty is
 * Manager's own on m, the policy's manager is m (or a proxy of it), and obj's primary is a
 * region whose _dirty is the record's field. 0 when not, -1 on error. */
static int
plain_write_use(PyObject *policy, PyObject *m, PyObject *obj)
{
    int own = is_lru_hook(policy, HOOK_WRITE_USE, s_write_use);
    if (own <= 0)
        return own;
    PyObject *r = ((ObjectRecord *)obj)->primary, *d;
    if (r == NULL || !PyObject_TypeCheck(r, &RegionRecordType) ||
            (d = _PyType_Lookup(Py_TYPE(r), s_dirty)) == NULL ||
            !Py_IS_TYPE(d, &PyMemberDescr_Type) ||
            ((PyMemberDescrObject *)d)->d_member->offset != offsetof(RegionRecord, dirty))
        return 0;
    if ((own = resolves_to(m, s_markdirty, markdirty_fn)) <= 0)
        return own;
    PyObject *pm;
    if (lookup_attr(policy, s_manager, &pm) < 0)
        return -1;
    int same = pm != NULL && (pm == m || (PyWeakref_CheckProxy(pm) &&
                                          PyWeakref_GET_OBJECT(pm) == m));
    Py_XDECREF(pm);
    return same;
}

/* policy.write_use(obj) for an object of manager m. LRU's own runs in C when plain_write_use
 * allows: m.markdirty(obj.primary), then the policy's read_use(obj), without their two Python
 * frames (x[1:5] = 0 at n=10: 9,850 instructions a call before, 7,990 after). 0, or -1 with an
 * exception set. */
static int
write_use_hook(PyObject *policy, PyObject *m, PyObject *obj)
{
    int plain = plain_write_use(policy, m, obj);
    if (plain < 0)
        return -1;
    if (plain) {
        set_field(&((RegionRecord *)((ObjectRecord *)obj)->primary)->dirty, Py_True);
        return policy_hook(policy, HOOK_READ_USE, s_read_use, obj);
    }
    PyObject *t = PyObject_CallMethodOneArg(policy, s_write_use, obj);
    if (t == NULL)
        note_hook(policy, s_write_use);
    Py_XDECREF(t);
    return t == NULL ? -1 : 0;
}

/* ---- the manager's lock ----------------------------------------------------------------------
 *
 * A re-entrant lock with threading.RLock's interface (acquire, release, the context manager and
 * what threading.Condition uses), whose owner the C paths take and give back without a Python
 * call: RLock.acquire parses its arguments on every call (about 430 instructions of the 2 to 4
 * lock calls each NumPy call on an array makes). */

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    unsigned long owner;                 /* the holding thread's ident, when count > 0 */
    unsigned long count;                 /* how many times the owner holds it */
    PyObject *weakrefs;
} LockObject;

static PyTypeObject LockType;

/* Wait for the raw lock without the GIL: timeout in seconds, < 0 for ever. Signals arriving
 * meanwhile run their handlers (an exception from one ends the wait). PY_LOCK_ACQUIRED,
 * PY_LOCK_FAILURE (timed out) or PY_LOCK_INTR with an exception set. */
static PyLockStatus
lock_wait(PyThread_type_lock lock, double timeout)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    double deadline = t.tv_sec + t.tv_nsec * 1e-9 + timeout;
    for (;;) {
        PY_TIMEOUT_T us = timeout < 0 ? -1 : (PY_TIMEOUT_T)(timeout * 1e6);
        PyLockStatus r;
        Py_BEGIN_ALLOW_THREADS
        r = PyThread_acquire_lock_timed(lock, us, 1);
        Py_END_ALLOW_THREADS
        if (r != PY_LOCK_INTR)
            return r;
        if (Py_MakePendingCalls() < 0 || PyErr_CheckSignals() < 0)
            return PY_LOCK_INTR;
        if (timeout >= 0) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            timeout = deadline - (t.tv_sec + t.tv_nsec * 1e-9);
            if (timeout <= 0)
                return PyThread_acquire_lock_timed(lock, 0, 0);
        }
    }
}

/* Take the lock (timeout as lock_wait's; 0 without blocking). 1 taken, 0 not, -1 error. */
static int
lock_take(LockObject *self, double timeout)
{
    unsigned long me = PyThread_get_thread_ident();
    if (self->count > 0 && self->owner == me) {
        if (self->count == ULONG_MAX) {
            PyErr_SetString(PyExc_OverflowError, "Internal lock count overflowed");
            return -1;
        }
        self->count++;
        return 1;
    }
    PyLockStatus r = PyThread_acquire_lock_timed(self->lock, 0, 0);
    if (r != PY_LOCK_ACQUIRED && timeout != 0)
        r = lock_wait(self->lock, timeout);
    if (r == PY_LOCK_INTR)
        return -1;
    if (r != PY_LOCK_ACQUIRED)
        return 0;
    self->owner = me;
    self->count = 1;
    return 1;
}

/* Give the lock back once. 0, or -1 (RuntimeError) when this thread does not hold it. */
static int
lock_give(LockObject *self)
{
    if (self->count == 0 || self->owner != PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return -1;
    }
    if (--self->count == 0) {
        self->owner = 0;
        PyThread_release_lock(self->lock);
    }
    return 0;
}

static PyObject *
lock_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "ManagerLock() takes no arguments");
        return NULL;
    }
    LockObject *self = (LockObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if ((self->lock = PyThread_allocate_lock()) == NULL) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_MemoryError, "cannot allocate a lock");
        return NULL;
    }
    return (PyObject *)self;
}

static void
lock_dealloc(LockObject *self)
{
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    if (self->lock != NULL) {
        if (self->count > 0)
            PyThread_release_lock(self->lock);
        PyThread_free_lock(self->lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* acquire(blocking=True, timeout=-1), as RLock.acquire. */
static PyObject *
lock_acquire_method(LockObject *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"blocking", "timeout", NULL};
    int blocking = 1;
    double timeout = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|pd:acquire", names, &blocking, &timeout))
        return NULL;
    if (!blocking && timeout != -1) {
        PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
        return NULL;
    }
    if (timeout < 0 && timeout != -1) {
        PyErr_SetString(PyExc_ValueError, "timeout value must be a non-negative number");
        return NULL;
    }
    if (timeout > (double)PY_TIMEOUT_MAX * 1e-6) {
        PyErr_SetString(PyExc_OverflowError, "timeout value is too large");
        return NULL;
    }
    int r = lock_take(self, blocking ? timeout : 0);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

static PyObject *
lock_enter(LockObject *self, PyObject *unused)
{
    int r = lock_take(self, -1);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

static PyObject *
lock_release_method(LockObject *self, PyObject *unused)
{
    if (lock_give(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
lock_exit(LockObject *self, PyObject *args)
{
    return lock_release_method(self, NULL);
}

static PyObject *
lock_is_owned(LockObject *self, PyObject *unused)
{
    return PyBool_FromLong(self->count > 0 && self->owner == PyThread_get_thread_ident());
}

/* For threading.Condition.wait: let go of every level of the lock; the state to restore. */
static PyObject *
lock_release_save(LockObject *self, PyObject *unused)
{
    if (self->count == 0) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return NULL;
    }
    unsigned long count = self->count, owner = self->owner;
    self->count = 0;
    self->owner = 0;
    PyThread_release_lock(self->lock);
    return Py_BuildValue("kk", count, owner);
}

static PyObject *
lock_acquire_restore(LockObject *self, PyObject *args)
{
    unsigned long count, owner;
    if (!PyArg_ParseTuple(args, "(kk):_acquire_restore", &count, &owner))
        return NULL;
    PyLockStatus r = PyThread_acquire_lock_timed(self->lock, 0, 0);
    if (r != PY_LOCK_ACQUIRED) {
        Py_BEGIN_ALLOW_THREADS
        r = PyThread_acquire_lock_timed(self->lock, -1, 0);
        Py_END_ALLOW_THREADS
    }
    if (r != PY_LOCK_ACQUIRED) {
        PyErr_SetString(PyExc_RuntimeError, "couldn't acquire lock");
        return NULL;
    }
    self->owner = owner;
    self->count = count;
    Py_RETURN_NONE;
}

static PyObject *
lock_repr(LockObject *self)
{
    return PyUnicode_FromFormat("<%s %s object owner=%lu count=%lu at %p>",
                                self->count ? "locked" : "unlocked", Py_TYPE(self)->tp_name,
                                self->count ? self->owner : 0UL, self->count, self);
}

static PyMethodDef lock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))lock_acquire_method, METH_VARARGS | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1): as threading.RLock.acquire."},
    {"release", (PyCFunction)lock_release_method, METH_NOARGS,
     "release(): as threading.RLock.release."},
    {"__enter__", (PyCFunction)lock_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)lock_exit, METH_VARARGS, NULL},
    {"_is_owned", (PyCFunction)lock_is_owned, METH_NOARGS, NULL},
    {"_release_save", (PyCFunction)lock_release_save, METH_NOARGS, NULL},
    {"_acquire_restore", (PyCFunction)lock_acquire_restore, METH_VARARGS, NULL},
    {NULL}
};

static PyTypeObject LockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cachedarrays._records.ManagerLock",
    .tp_doc = "ManagerLock(): the manager's re-entrant lock (threading.RLock's interface), "
              "taken by the C paths without a Python call.",
    .tp_basicsize = sizeof(LockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = lock_new,
    .tp_dealloc = (destructor)lock_dealloc,
    .tp_repr = (reprfunc)lock_repr,
    .tp_methods = lock_methods,
    .tp_weaklistoffset = offsetof(LockObject, weakrefs),
};

/* The manager's lock: acquire (1) or release (0), in C for a ManagerLock. 0, or -1 with an
 * exception set. */
static int
lock_call(PyObject *lock, int acquire)
{
    if (Py_IS_TYPE(lock, &LockType))
        return acquire ? (lock_take((LockObject *)lock, -1) < 0 ? -1 : 0)
                       : lock_give((LockObject *)lock);
    PyObject *t = PyObject_CallMethodNoArgs(lock, acquire ? s_acquire : s_release_lock);
    Py_XDECREF(t);
    return t == NULL ? -1 : 0;
}

static void *
heap_handle(PyObject *heap)
{
    PyObject *addr = getf(heap, K_HEAP, H_ADDR, s_addr);
    if (addr == NULL)
        return NULL;
    void *h = PyLong_AsVoidPtr(addr);
    Py_DECREF(addr);
    return h;
}

/* create_fast(m, nbytes): Manager._create_fast. */
static PyObject *
create_fast(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "create_fast(manager, nbytes)");
        return NULL;
    }
    if (region_cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "create_fast: bind() was not called");
        return NULL;
    }
    PyObject *m = args[0], *nbytes = args[1], *result = NULL;
    PyObject *dev = NULL, *heap = NULL, *last = NULL, *owner = NULL, *offset = NULL,
             *ids = NULL, *oid = NULL, *name = NULL, *mm = NULL, *region = NULL, *ref = NULL,
             *obj = NULL, *objects = NULL, *wr = NULL, *by_offset = NULL;
    if ((dev = getf(m, K_MANAGER, M_FAST, s_fast)) == NULL ||
            (heap = getf(dev, K_DEVICE, D_HEAP, s_heap)) == NULL)
        goto out;
    if (heap == Py_None) {
        result = Py_NewRef(Py_None);
        goto out;
    }
    if ((last = getf(m, K_MANAGER, M_LAST_ID, s_last_id)) == NULL ||
            (owner = PyNumber_Add(last, one)) == NULL)
        goto out;
    void *h = heap_handle(heap);
    if (h == NULL && PyErr_Occurred())
        goto out;
    uint64_t nb = PyLong_AsUnsignedLongLong(nbytes), own = PyLong_AsUnsignedLongLong(owner);
    if (PyErr_Occurred())
        goto out;
    int64_t r = h != NULL ? heap_alloc(h, nb, own) : -1;
    offset = r >= 0 ? PyLong_FromLongLong(r)
                    : PyObject_CallMethodObjArgs(heap, s_try_alloc, nbytes, owner, NULL);
    if (offset == NULL)
        goto out;
    if (offset == Py_None) {
        result = Py_NewRef(Py_None);
        goto out;
    }
    if ((ids = getf(m, K_MANAGER, M_IDS, s_ids)) == NULL || (oid = PyIter_Next(ids)) == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "the manager's id counter ran out");
        goto out;
    }
    if (set(m, s_last_id, oid) < 0 || (name = getf(dev, K_DEVICE, D_NAME, s_name)) == NULL ||
            (mm = getf(dev, K_DEVICE, D_MM, s_mm)) == NULL)
        goto out;
    if ((region = ((PyTypeObject *)region_cls)->tp_alloc((PyTypeObject *)region_cls, 0)) == NULL ||
            region_fill((RegionRecord *)region, dev, offset, nbytes, oid, mm) < 0)
        goto out;
    set_field(&((RegionRecord *)region)->dirty, Py_True);
    if ((ref = getf(m, K_MANAGER, M_REF, s_ref)) == NULL ||
            (obj = ((PyTypeObject *)object_cls)->tp_alloc((PyTypeObject *)object_cls, 0)) == NULL ||
            object_fill((ObjectRecord *)obj, ref, oid, nbytes, region, name) < 0)
        goto out;
    if ((objects = getf(m, K_MANAGER, M_OBJECTS, s_objects)) == NULL ||
            (wr = PyWeakref_NewRef(obj, NULL)) == NULL ||
            PyObject_SetItem(objects, oid, wr) < 0)
        goto out;
    if ((by_offset = getf(m, K_MANAGER, M_BY_OFFSET, s_by_offset)) == NULL)
        goto out;
    PyObject *blocks = PyObject_GetItem(by_offset, name);
    if (blocks == NULL)
        goto out;
    int bad = PyObject_SetItem(blocks, offset, region);
    Py_DECREF(blocks);
    if (bad < 0 || count(m, name, nbytes, oid, 1) < 0)
        goto out;
    result = Py_NewRef(obj);
out:
    Py_XDECREF(dev); Py_XDECREF(heap); Py_XDECREF(last); Py_XDECREF(owner); Py_XDECREF(offset);
    Py_XDECREF(ids); Py_XDECREF(oid); Py_XDECREF(name); Py_XDECREF(mm); Py_XDECREF(region);
    Py_XDECREF(ref); Py_XDECREF(obj); Py_XDECREF(objects); Py_XDECREF(wr); Py_XDECREF(by_offset);
    return result;
}

/* 1 when attribute attr of o is truthy, 0 when not, -1 on error. */
static int
attr_true(PyObject *o, PyObject *attr)
{
    PyObject *v = get(o, attr);
    if (v == NULL)
        return -1;
    int t = truth(v);
    Py_DECREF(v);
    return t;
}

/* attr_true for the manager's field i (manager_names order). */
static int
manager_true(PyObject *m, int i)
{
    PyObject *v = getf(m, K_MANAGER, i, kinds[K_MANAGER].interned[i]);
    if (v == NULL)
        return -1;
    int t = truth(v);
    Py_DECREF(v);
    return t;
}

/* Whether a queued entry takes the common path: one region, its primary, live and not empty,
 * on a heap, and nothing else under way (no copy, observer, dropped object, dependents, debug
 * poisoning; the manager open). Returns the heap (a new reference), Py_None (borrowed: take
 * the general path) or NULL on error. */
static PyObject *
common_heap(PyObject *m, PyObject *regions, PyObject *primary, PyObject **dev_name)
{
    if (!PyDict_Check(regions) || PyDict_GET_SIZE(regions) != 1 ||
            !PyObject_TypeCheck(primary, &RegionRecordType))
        return Py_None;
    RegionRecord *r = (RegionRecord *)primary;
    if (r->freed == NULL || r->nbytes == NULL || r->device == NULL)
        return Py_None;
    int t = truth(r->freed);
    if (t != 0)
        return t < 0 ? NULL : Py_None;
    if ((t = PyObject_IsTrue(r->nbytes)) <= 0)
        return t < 0 ? NULL : Py_None;
    static const int busy[] = {M_COPIES, M_OBSERVERS, M_DROPPED, M_DEPENDENTS, M_CLOSED};
    for (size_t i = 0; i < sizeof busy / sizeof *busy; i++)
        if ((t = manager_true(m, busy[i])) != 0)
            return t < 0 ? NULL : Py_None;
    PyObject *debug = getf(m, K_MANAGER, M_DEBUG, s_debug);
    if (debug == NULL)
        return NULL;
    Py_DECREF(debug);
    if (debug != Py_None)
        return Py_None;
    PyObject *heap = getf(r->device, K_DEVICE, D_HEAP, s_heap);
    if (heap == NULL)
        return NULL;
    PyObject *name = getf(r->device, K_DEVICE, D_NAME, s_name);
    if (name == NULL) {
        Py_DECREF(heap);
        return NULL;
    }
    PyObject *only = PyDict_GetItemWithError(regions, name);
    if (heap == Py_None || only != primary) {
        Py_DECREF(heap);
        Py_DECREF(name);
        return PyErr_Occurred() ? NULL : Py_None;
    }
    *dev_name = name;
    return heap;
}

/* Free the primary region of a queued entry (the common path of Manager._drain). */
static int
free_common(PyObject *m, PyObject *obj_id, RegionRecord *r, PyObject *heap, PyObject *name)
{
    int rc = -1;
    PyObject *res = NULL, *by_offset = NULL, *blocks = NULL, *objects = NULL, *policy = NULL;
    void *h = heap_handle(heap);
    if (h == NULL && PyErr_Occurred())
        return -1;
    int64_t off = PyLong_AsLongLong(r->offset);
    uint64_t owner = PyLong_AsUnsignedLongLong(obj_id);
    if (PyErr_Occurred())
        return -1;
    if (h == NULL)                                   /* a closed heap: its own error */
        res = PyObject_CallMethodObjArgs(heap, s_quick_free, r->offset, obj_id, NULL);
    else if (heap_free(h, off, owner) != 0)          /* refused: free() raises the reason */
        res = PyObject_CallMethodObjArgs(heap, s_free, r->offset, obj_id, NULL);
    else
        res = Py_NewRef(Py_None);
    if (res == NULL)
        goto out;
    if ((by_offset = getf(m, K_MANAGER, M_BY_OFFSET, s_by_offset)) == NULL ||
            (blocks = PyObject_GetItem(by_offset, name)) == NULL)
        goto out;
    if (PyDict_Check(blocks)) {
        if (PyDict_DelItem(blocks, r->offset) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_KeyError))
                goto out;
            PyErr_Clear();
        }
    }
    set_field(&r->freed, Py_True);
    set_field(&r->buffer, Py_None);
    if (count(m, name, r->nbytes, obj_id, 0) < 0)
        goto out;
    if ((objects = getf(m, K_MANAGER, M_OBJECTS, s_objects)) == NULL)
        goto out;
    if (PyDict_Check(objects) && PyDict_DelItem(objects, obj_id) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError))
            goto out;
        PyErr_Clear();
    }
    Py_CLEAR(res);
    if ((policy = getf(m, K_MANAGER, M_POLICY, s_policy)) == NULL ||
            policy_hook(policy, HOOK_FORGET, s_forget, obj_id) < 0)
        goto out;
    rc = 0;
out:
    Py_XDECREF(res); Py_XDECREF(by_offset); Py_XDECREF(blocks); Py_XDECREF(objects);
    Py_XDECREF(policy);
    return rc;
}

/* Release the manager's lock, keeping any pending exception (a failed release is then
 * reported as unraisable). 0, or -1 with the release's error set when none was pending. */
static int
unlock_keeping_error(PyObject *lock)
{
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    int rc = 0;
    if (lock_call(lock, 0) < 0) {
        if (et != NULL)
            PyErr_WriteUnraisable(lock);
        else
            rc = -1;
    }
    if (et != NULL)
        PyErr_Restore(et, ev, etb);
    return rc;
}

/* free_fast(m, obj): Manager.free_object's common path: obj live, unpinned, its one region a
 * live, non-empty primary on a heap and nothing else under way (common_heap). Returns True
 * when it freed obj, False when the caller takes the general path (nothing done then). */
static PyObject *drain(PyObject *module, PyObject *m);

static PyObject *
free_fast(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "free_fast(manager, obj)");
        return NULL;
    }
    PyObject *m = args[0], *res = NULL, *t;
    if (!PyObject_TypeCheck(args[1], &ObjectRecordType))
        Py_RETURN_FALSE;
    ObjectRecord *obj = (ObjectRecord *)args[1];
    PyObject *lock = getf(m, K_MANAGER, M_LOCK, s_lock);
    if (lock == NULL)
        return NULL;
    if (lock_call(lock, 1) < 0) {
        Py_DECREF(lock);
        return NULL;
    }
    Py_INCREF(obj);
    PyObject *primary = obj->primary ? Py_NewRef(obj->primary) : NULL;
    int freed = obj->freed == NULL ? 1 : truth(obj->freed);
    int pinned = obj->pins == NULL ? 1 : PyObject_IsTrue(obj->pins);
    if (freed < 0 || pinned < 0)
        goto out;
    PyObject *ref = getf(m, K_MANAGER, M_REF, s_ref);
    if (ref == NULL)
        goto out;
    Py_DECREF(ref);                                 /* the manager holds it */
    if (freed || pinned || primary == NULL || obj->regions == NULL || obj->id == NULL ||
            obj->manager != ref) {
        res = Py_NewRef(Py_False);                  /* the general path raises */
        goto out;
    }
    PyObject *name = NULL, *heap = common_heap(m, obj->regions, primary, &name);
    if (heap == NULL)
        goto out;
    if (heap == Py_None) {
        res = Py_NewRef(Py_False);
        goto out;
    }
    PyObject *oid = Py_NewRef(obj->id), *regions = Py_NewRef(obj->regions);
    int rc = free_common(m, oid, (RegionRecord *)primary, heap, name);
    Py_DECREF(heap);
    Py_DECREF(name);
    Py_DECREF(oid);
    if (rc == 0 || ((RegionRecord *)primary)->freed == Py_True) {
        /* its region went: obj is freed even if the policy's forget then raised */
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        PyObject *empty = PyDict_New();
        if (empty == NULL) {
            rc = -1;
            Py_XDECREF(et); Py_XDECREF(ev); Py_XDECREF(etb);
        } else {
            if (PyDict_Check(regions))
                PyDict_Clear(regions);
            set_field(&obj->freed, Py_True);
            set_field(&obj->primary, Py_None);
            Py_XSETREF(obj->regions, empty);
            set_field(&obj->chain, Py_None);
            PyErr_Restore(et, ev, etb);
        }
    }
    Py_DECREF(regions);
    if (rc < 0)
        goto out;
    if (manager_true(m, M_DEFERRED) > 0) {
        if ((t = drain(module, m)) == NULL)
            goto out;
        Py_DECREF(t);
    }
    if (!PyErr_Occurred())
        res = Py_NewRef(Py_True);
out:
    Py_XDECREF(primary);
    Py_DECREF(obj);
    if (unlock_keeping_error(lock) < 0)
        Py_CLEAR(res);
    Py_DECREF(lock);
    return res;
}

/* drain(m): Manager._drain. Entries that do not take the common path go to m._release. */
static PyObject *
drain(PyObject *module, PyObject *m)
{
    PyObject *deferred = getf(m, K_MANAGER, M_DEFERRED, str_deferred);
    if (deferred == NULL)
        return NULL;
    int is_deque = Py_IS_TYPE(deferred, (PyTypeObject *)deque_type);
    for (;;) {                           /* a deque's length is its size field: no call */
        Py_ssize_t n = is_deque ? Py_SIZE(deferred) : PyObject_Length(deferred);
        if (n <= 0) {
            Py_DECREF(deferred);
            if (n < 0)
                return NULL;
            Py_RETURN_NONE;
        }
        PyObject *entry = Py_IS_TYPE(deferred, (PyTypeObject *)deque_type)
                              ? PyObject_Vectorcall(deque_popleft, &deferred, 1, NULL)
                              : PyObject_CallMethodNoArgs(deferred, s_popleft);
        if (entry == NULL)
            break;
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3) {
            PyErr_SetString(PyExc_TypeError, "a queued free must be (id, regions, primary)");
            Py_DECREF(entry);
            break;
        }
        PyObject *obj_id = PyTuple_GET_ITEM(entry, 0), *regions = PyTuple_GET_ITEM(entry, 1),
                 *primary = PyTuple_GET_ITEM(entry, 2), *name = NULL;
        PyObject *heap = common_heap(m, regions, primary, &name);
        int rc;
        if (heap == NULL) {
            rc = -1;
        } else if (heap == Py_None) {
            PyObject *values = PyMapping_Values(regions), *res = NULL;
            if (values != NULL)
                res = PyObject_CallMethodObjArgs(m, s_release, obj_id, values, primary, NULL);
            rc = res == NULL ? -1 : 0;
            Py_XDECREF(values);
            Py_XDECREF(res);
        } else {
            rc = free_common(m, obj_id, (RegionRecord *)primary, heap, name);
            Py_DECREF(heap);
            Py_DECREF(name);
        }
        Py_DECREF(entry);
        if (rc < 0)
            break;
    }
    Py_DECREF(deferred);
    return NULL;
}


/* ---- a ufunc into a new array: Manager.run's common path and the result's CachedArray ------- */

static PyTypeObject *view_cls;                     /* cachedarrays.array.CachedArray */
static PyObject *ndarray_cls, *header, *open_scopes, *record_new_fn, *plans;
static PyObject *from_ndarray_fn;                  /* cachedarrays.array.from_ndarray */
static long long short_bytes;                   /* cachedarrays.pinning.SHORT_BYTES */
static Py_ssize_t off_obj, off_m, off_shape, off_dtype, off_strides, off_offset, off_vc,
                  off_base;

/* The offset of the slot `name` of type t (a T_OBJECT_EX member descriptor), or -1. */
static Py_ssize_t
slot_offset(PyTypeObject *t, const char *name)
{
    PyObject *d = PyObject_GetAttrString((PyObject *)t, name);
    if (d == NULL)
        return -1;
    Py_ssize_t off = -1;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *def = ((PyMemberDescrObject *)d)->d_member;
        if (def->type == T_OBJECT_EX && !(def->flags & READONLY))
            off = def->offset;
    }
    Py_DECREF(d);
    if (off < 0)
        PyErr_Format(PyExc_TypeError, "bind_views: %s.%s is not a writable slot", t->tp_name,
                     name);
    return off;
}

/* bind_views(CachedArray, ndarray, HEADER, OPEN_SCOPES, record_new, from_ndarray): what run_ufunc
 * needs to make a result: the array type (its slots), numpy's ndarray, the heap's block header
 * size, the open-scope counter and the hook that records a new object in open scopes; and what
 * run_method copies an array result with. */
static PyObject *
bind_views(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "bind_views(CachedArray, ndarray, HEADER, OPEN_SCOPES, "
                        "record_new, from_ndarray)");
        return NULL;
    }
    if (!PyType_Check(args[0]) || !PyType_Check(args[1]) || !PyLong_Check(args[2]) ||
            !PyList_Check(args[3]) || !PyCallable_Check(args[4]) || !PyCallable_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "bind_views: expected two types, an int, a list and two "
                        "callables");
        return NULL;
    }
    PyTypeObject *t = (PyTypeObject *)args[0];
    Py_ssize_t o[8];
    const char *names[8] = {"_obj", "_m", "_shape", "_dtype", "_strides", "_offset", "_vc",
                            "_base"};
    for (int i = 0; i < 8; i++)
        if ((o[i] = slot_offset(t, names[i])) < 0)
            return NULL;
    off_obj = o[0]; off_m = o[1]; off_shape = o[2]; off_dtype = o[3]; off_strides = o[4];
    off_offset = o[5]; off_vc = o[6]; off_base = o[7];
    Py_XSETREF(view_cls, (PyTypeObject *)Py_NewRef(args[0]));
    Py_XSETREF(ndarray_cls, Py_NewRef(args[1]));
    Py_XSETREF(header, Py_NewRef(args[2]));
    Py_XSETREF(open_scopes, Py_NewRef(args[3]));
    Py_XSETREF(record_new_fn, Py_NewRef(args[4]));
    Py_XSETREF(from_ndarray_fn, Py_NewRef(args[5]));
    Py_RETURN_NONE;
}

static void plan_cache_clear(void);

/* bind_plans(PLANS, SHORT_BYTES): for fast_ufunc, cachedarrays.ufuncs' plans ((ufunc, operand
 * kinds) -> (dtype, itemsize, name, {shape: (strides, nbytes)}), or False) and the largest
 * kernel it runs under the manager's lock. */
static PyObject *
bind_plans(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyDict_Check(args[0]) || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "bind_plans(PLANS: dict, SHORT_BYTES: int)");
        return NULL;
    }
    long long sb = PyLong_AsLongLong(args[1]);
    if (sb == -1 && PyErr_Occurred())
        return NULL;
    Py_XSETREF(plans, Py_NewRef(args[0]));
    plan_cache_clear();
    short_bytes = sb;
    Py_RETURN_NONE;
}


#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

/* o._pins += delta (an ObjectRecord). */
static int
add_pins(PyObject *o, long delta)
{
    ObjectRecord *r = (ObjectRecord *)o;
    PyObject *pins = r->pins ? r->pins : zero, *now;
    long n;
    if (PyLong_CheckExact(pins) && (n = PyLong_AsLong(pins)) >= 0 && n < 1L << 30) {
        now = PyLong_FromLong(n + delta);         /* a small int: no int for delta, no add */
    } else {
        PyErr_Clear();
        PyObject *d = PyLong_FromLong(delta);
        if (d == NULL)
            return -1;
        now = PyNumber_Add(pins, d);
        Py_DECREF(d);
    }
    if (now == NULL)
        return -1;
    Py_XSETREF(r->pins, now);
    return 0;
}

/* Pin the object o (an ObjectRecord) after Manager._live has checked it when it is freed (the
 * error names the use after free). 0, or -1 with an exception set and o not pinned. */
static int
pin_live(PyObject *m, PyObject *o)
{
    ObjectRecord *r = (ObjectRecord *)o;
    int freed = r->freed == NULL ? 0 : truth(r->freed);
    if (freed < 0)
        return -1;
    if (freed) {
        PyObject *t = PyObject_CallMethodOneArg(m, s_live, o);
        if (t == NULL)
            return -1;
        Py_DECREF(t);
    }
    return add_pins(o, 1);
}

/* Unpin held[0:n], keeping any pending exception. */
static void
unpin_all(PyObject **held, Py_ssize_t n)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    for (Py_ssize_t i = 0; i < n; i++)
        if (add_pins(held[i], -1) < 0)
            PyErr_WriteUnraisable(held[i]);
    PyErr_Restore(t, v, tb);
}

/* The view a kernel uses for operand x: x._kview(), with its cached view taken in C when the
 * primary region is still where the cache says. A new reference. */
static PyObject *
kernel_view(PyObject *x)
{
    PyObject *obj = SLOT(x, off_obj), *c = SLOT(x, off_vc);
    if (obj != NULL && PyObject_TypeCheck(obj, &ObjectRecordType) && c != NULL &&
            PyTuple_CheckExact(c) && PyTuple_GET_SIZE(c) == 3) {
        PyObject *r = ((ObjectRecord *)obj)->primary;
        if (r != NULL && PyTuple_GET_ITEM(c, 0) == r &&
                PyObject_TypeCheck(r, &RegionRecordType)) {
            PyObject *off = ((RegionRecord *)r)->offset, *cached = PyTuple_GET_ITEM(c, 1);
            Py_INCREF(c);
            int same = off == cached ? 1 : off == NULL ? 0 :
                       PyObject_RichCompareBool(cached, off, Py_EQ);
            PyObject *view = same > 0 ? Py_NewRef(PyTuple_GET_ITEM(c, 2)) : NULL;
            Py_DECREF(c);
            if (same < 0)
                return NULL;
            if (same)
                return view;
        }
    }
    return PyObject_CallMethodNoArgs(x, s_kview);
}

/* np.ndarray(shape, dtype, buffer, start, strides) through NumPy's C API: the array's base is
 * buffer (held, as the Python constructor holds it, without a buffer export), its data the
 * bytes at start. The constructor's own checks are kept: the bytes must lie within the buffer,
 * which must be writable when writable is set (else the array is read-only). Anything else (a dtype that is not a descriptor, a shape that is not
 * a tuple of ints, too many dimensions) goes to the Python constructor. A new reference. */
static PyObject *
buffer_array_ex(PyObject *shape, PyObject *dtype, PyObject *buffer, PyObject *start,
                PyObject *strides, int writable)
{
    Py_ssize_t nd = PyTuple_Check(shape) ? PyTuple_GET_SIZE(shape) : -1;
    if (nd < 0 || nd > NPY_MAXDIMS || !PyArray_DescrCheck(dtype) || !PyTuple_Check(strides) ||
            PyTuple_GET_SIZE(strides) != nd || !PyLong_CheckExact(start))
        goto python;
    npy_intp dims[NPY_MAXDIMS], st[NPY_MAXDIMS];
    Py_ssize_t lo = 0, hi = 0, first = PyLong_AsSsize_t(start), span;
    int empty = 0;
    if (first == -1 && PyErr_Occurred()) {
        PyErr_Clear();                                  /* the constructor's own error */
        goto python;
    }
    for (Py_ssize_t i = 0; i < nd; i++) {
        PyObject *d = PyTuple_GET_ITEM(shape, i), *t = PyTuple_GET_ITEM(strides, i);
        if (!PyLong_CheckExact(d) || !PyLong_CheckExact(t))
            goto python;
        dims[i] = PyLong_AsSsize_t(d);
        st[i] = PyLong_AsSsize_t(t);
        if ((dims[i] == -1 || st[i] == -1) && PyErr_Occurred()) {
            PyErr_Clear();
            goto python;
        }
        if (dims[i] < 0)
            goto python;
        if (dims[i] == 0) {
            empty = 1;
            continue;
        }
        if (__builtin_mul_overflow(st[i], dims[i] - 1, &span) ||
                __builtin_add_overflow(span > 0 ? hi : lo, span, span > 0 ? &hi : &lo))
            goto python;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(buffer, &b, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        goto python;
    }
    char *base = b.buf;
    Py_ssize_t len = b.len, item = PyDataType_ELSIZE((PyArray_Descr *)dtype);
    PyBuffer_Release(&b);
    if (first < 0 || first > len ||
            (!empty && (first + lo < 0 || hi > len - item || first + hi > len - item)))
        goto python;                                   /* the constructor's own error */
    Py_INCREF(dtype);                                  /* the call steals it */
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, (PyArray_Descr *)dtype, (int)nd, dims, st,
                                         base + first, writable ? NPY_ARRAY_WRITEABLE : 0, NULL);
    if (arr != NULL && PyArray_SetBaseObject((PyArrayObject *)arr, Py_NewRef(buffer)) < 0)
        Py_CLEAR(arr);                                 /* (SetBaseObject took the reference) */
    return arr;
python:;
    PyObject *a[5] = {shape, dtype, buffer, start, strides};
    return PyObject_Vectorcall(ndarray_cls, a, 5, NULL);
}

/* buffer_array_ex over a writable buffer. */
static PyObject *
buffer_array(PyObject *shape, PyObject *dtype, PyObject *buffer, PyObject *start,
             PyObject *strides)
{
    return buffer_array_ex(shape, dtype, buffer, start, strides, 1);
}

/* The new CachedArray over obj (shape, dtype, C strides, offset 0) and its kernel view. */
static PyObject *
new_view(PyObject *m, PyObject *obj, PyObject *shape, PyObject *dtype, PyObject *strides,
         PyObject **view)
{
    PyObject *res = view_cls->tp_alloc(view_cls, 0);
    if (res == NULL)
        return NULL;
    SLOT(res, off_obj) = Py_NewRef(obj);
    SLOT(res, off_m) = Py_NewRef(m);
    SLOT(res, off_shape) = Py_NewRef(shape);
    SLOT(res, off_dtype) = Py_NewRef(dtype);
    SLOT(res, off_strides) = Py_NewRef(strides);
    SLOT(res, off_offset) = Py_NewRef(zero);
    SLOT(res, off_vc) = Py_NewRef(Py_None);
    SLOT(res, off_base) = Py_NewRef(Py_None);           /* a new array owns its object */
    PyObject *r = ((ObjectRecord *)obj)->primary;
    if (r != NULL && PyObject_TypeCheck(r, &RegionRecordType) &&
            ((RegionRecord *)r)->buffer != NULL && ((RegionRecord *)r)->buffer != Py_None &&
            ((RegionRecord *)r)->offset != NULL) {
        RegionRecord *rr = (RegionRecord *)r;
        PyObject *start = PyNumber_Add(rr->offset, header);
        if (start == NULL)
            goto fail;
        *view = buffer_array(shape, dtype, rr->buffer, start, strides);
        Py_DECREF(start);
        if (*view == NULL)
            goto fail;
        PyObject *c = PyTuple_Pack(3, r, rr->offset, *view);
        if (c == NULL) {
            Py_CLEAR(*view);
            goto fail;
        }
        Py_SETREF(SLOT(res, off_vc), c);
    } else if ((*view = PyObject_CallMethodNoArgs(res, s_kview)) == NULL) {
        goto fail;
    }
    return res;
fail:
    Py_DECREF(res);
    return NULL;
}

/* 1 when the manager has something under way that Manager.run's general path handles (closing,
 * observers, background copies, dropped objects or their dependents, a policy that stages
 * kernels in fast memory), 0 when not, -1 on error. */
static int
run_busy(PyObject *m, PyObject *policy)
{
    static const int busy[] = {M_GATE, M_OBSERVERS, M_COPIES, M_DROPPED, M_DEPENDENTS};
    for (size_t i = 0; i < sizeof busy / sizeof *busy; i++) {
        int t = manager_true(m, busy[i]);
        if (t != 0)
            return t;
    }
    PyObject *k;
    if (lookup_attr(policy, s_kernels_in_fast, &k) < 0)
        return -1;
    if (k == NULL)
        return 0;
    int t = PyObject_IsTrue(k);
    Py_DECREF(k);
    return t;
}

/* With the manager's lock held: the manager's policy (a new reference in *policy) once the
 * queue of frees is drained, when the manager has nothing under way (run_busy; with
 * recomputing, no rerun of a recorded kernel either). 1 ready, 0 busy (*policy NULL), -1 on
 * error. */
static int
ready_policy(PyObject *module, PyObject *m, int recomputing, PyObject **policy)
{
    PyObject *p = getf(m, K_MANAGER, M_POLICY, s_policy), *t;
    *policy = NULL;
    if (p == NULL)
        return -1;
    int busy = run_busy(m, p);
    if (busy == 0 && recomputing)
        busy = manager_true(m, M_RECOMPUTING);
    int pending = busy == 0 ? manager_true(m, M_DEFERRED) : 0;
    if (busy != 0 || pending < 0) {
        Py_DECREF(p);
        return busy > 0 ? 0 : -1;
    }
    if (pending) {
        Py_DECREF(p);
        if ((t = drain(module, m)) == NULL)
            return -1;
        Py_DECREF(t);
        if ((p = getf(m, K_MANAGER, M_POLICY, s_policy)) == NULL)
            return -1;
    }
    *policy = p;
    return 1;
}

/* Wake a close waiting for pins to drain (the manager's condition) when the manager is
 * closing. 0, or -1 with an exception set. */
static int
notify_if_closing(PyObject *m)
{
    int closing = manager_true(m, M_CLOSING);
    if (closing <= 0)
        return closing;
    PyObject *cond = getf(m, K_MANAGER, M_COND, s_cond);
    PyObject *t = cond == NULL ? NULL : PyObject_CallMethodNoArgs(cond, s_notify_all);
    Py_XDECREF(cond);
    Py_XDECREF(t);
    return t == NULL ? -1 : 0;
}

/* 1 when ufunc is a NumPy ufunc of n_in inputs, one output and no core signature, which takes
 * its out by position: NumPy parses that faster than out= (np.add(a, b, c) 194 ns against
 * 241 ns with out=c at n=10). Not np.maximum and np.minimum, whose third positional argument
 * NumPy 2.4 deprecates. */
static inline int
out_by_position(PyObject *ufunc, Py_ssize_t n_in)
{
    if (!Py_IS_TYPE(ufunc, (PyTypeObject *)ufunc_type) || ufunc == np_maximum ||
            ufunc == np_minimum)
        return 0;
    PyUFuncObject *u = (PyUFuncObject *)ufunc;
    return u->nin == n_in && u->nout == 1 && !u->core_enabled;
}

/* 1 when new, from the policy's allocate, is what Manager._check_new accepts without a word:
 * an Object of manager m (weak reference ref) made after id last, unpinned, of nbytes, with a
 * region; 0 otherwise; -1 on error. */
static int
plain_new(PyObject *new, PyObject *ref, PyObject *last, PyObject *nbytes)
{
    if (Py_TYPE(new) != (PyTypeObject *)object_cls)
        return 0;
    ObjectRecord *r = (ObjectRecord *)new;
    if (r->manager != ref || r->primary == NULL || r->primary == Py_None || r->id == NULL ||
            r->nbytes == NULL || (r->pins != NULL && r->pins != zero && PyObject_IsTrue(r->pins)))
        return PyErr_Occurred() ? -1 : 0;
    int rc = PyObject_RichCompareBool(r->id, last, Py_GT);
    return rc <= 0 ? rc : PyObject_RichCompareBool(r->nbytes, nbytes, Py_EQ);
}

/* policy.allocate(nbytes), checked as Manager.new_pinned does (Manager._check_new raises). */
static PyObject *
allocate_checked(PyObject *m, PyObject *policy, PyObject *nbytes)
{
    PyObject *last = getf(m, K_MANAGER, M_LAST_ID, s_last_id), *ref = NULL, *new = NULL, *t;
    if (last == NULL)
        return NULL;
    if ((new = PyObject_CallMethodOneArg(policy, s_allocate, nbytes)) == NULL) {
        note_hook(policy, s_allocate);
        goto fail;
    }
    if ((ref = getf(m, K_MANAGER, M_REF, s_ref)) == NULL)
        goto fail;
    int plain = plain_new(new, ref, last, nbytes);
    if (plain < 0)
        goto fail;
    if (!plain) {
        if ((t = PyObject_CallMethod(m, "_check_new", "OOO", new, nbytes, last)) == NULL)
            goto fail;
        Py_DECREF(t);
    }
    Py_DECREF(last);
    Py_DECREF(ref);
    return new;
fail:
    Py_XDECREF(last);
    Py_XDECREF(ref);
    Py_XDECREF(new);
    return NULL;
}

/* run_ufunc(m, ufunc, inputs, objs, shape, dtype, strides, nbytes, short): ufunc(*inputs) into a
 * new array of nbytes the policy places, as Manager.run(kernel, objs, (), nbytes, name, short)
 * with the kernel of cachedarrays.ufuncs._new_result: the operands pinned and reported read, the
 * new object pinned and reported written, the result a CachedArray (shape, dtype, C strides)
 * whose view the ufunc writes through (out=). Everything is unpinned when the ufunc returns or
 * raises. short: the ufunc runs under the manager's lock; otherwise the lock is let go while
 * it runs. Returns NotImplemented, having done nothing, when the manager has something under way
 * that Manager.run's general path handles.
 *
 * ufunc NULL (with nbytes): only the new array, as Manager.new_pinned + release make it.
 *
 * nbytes NULL: a call that makes no array of ours (a reduction, a ufunc with out=): ufunc(*views,
 * **kw) with the operands pinned and reported read, its result returned as it is. The last
 * len(kwnames) inputs are the keyword arguments' values. wobj (with nbytes NULL): the object
 * the call writes (out=), pinned and reported written, its lineage broken as Manager.run does
 * (version + 1, chain wname) unless the manager is recomputing. */
static PyObject *
run_core(PyObject *module, PyObject *m, PyObject *ufunc, PyObject *inputs, PyObject *objs,
         PyObject *shape, PyObject *dtype, PyObject *strides, PyObject *nbytes,
         PyObject *kwnames, PyObject *wobj, PyObject *wname, int is_short)
{
    if (!PyTuple_Check(inputs) || !PyTuple_Check(objs) || PyTuple_GET_SIZE(objs) > 8 ||
            PyTuple_GET_SIZE(inputs) > 8) {
        PyErr_SetString(PyExc_TypeError, "run_ufunc: inputs and objs must be tuples of at "
                        "most 8 items");
        return NULL;
    }
    Py_ssize_t n_objs = PyTuple_GET_SIZE(objs), n_in = PyTuple_GET_SIZE(inputs);
    Py_ssize_t n_kw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < n_objs; i++)
        if (!PyObject_TypeCheck(PyTuple_GET_ITEM(objs, i), &ObjectRecordType))
            return Py_NewRef(Py_NotImplemented);

    PyObject *lock = getf(m, K_MANAGER, M_LOCK, s_lock), *policy = NULL, *new = NULL, *res = NULL,
             *views[9] = {NULL}, *held[9];
    Py_ssize_t n_held = 0;
    int locked = 0;
    if (lock == NULL)
        return NULL;
    PyObject *t;
    if (lock_call(lock, 1) < 0)
        goto out;
    locked = 1;
    int ready = ready_policy(module, m, 0, &policy);
    if (ready <= 0) {
        if (ready == 0)
            res = Py_NewRef(Py_NotImplemented);
        goto out;
    }

    /* pin the operands and report them read */
    for (Py_ssize_t i = 0; i < n_objs; i++) {
        PyObject *o = PyTuple_GET_ITEM(objs, i);
        if (pin_live(m, o) < 0)
            goto unpin;
        held[n_held++] = o;
        if (policy_hook(policy, HOOK_READ_USE, s_read_use, o) < 0)
            goto unpin;
    }

    if (wobj != NULL) {                                  /* the written operand */
        ObjectRecord *w = (ObjectRecord *)wobj;
        if (pin_live(m, wobj) < 0)
            goto unpin;
        held[n_held++] = wobj;
        if (write_use_hook(policy, m, wobj) < 0)
            goto unpin;
        int again = manager_true(m, M_RECOMPUTING);
        if (again < 0)
            goto unpin;
        if (!again) {
            PyObject *v = PyNumber_Add(w->version ? w->version : zero, one);
            if (v == NULL)
                goto unpin;
            Py_XSETREF(w->version, v);
            set_field(&w->chain, wname);
        }
    }
    if (nbytes == NULL)
        goto kernel;

    /* the new object: in fast memory when the policy puts new objects there and it fits */
    int fits = PyObject_IsTrue(nbytes);
    if (fits > 0)
        fits = attr_true(policy, s_fast_first);
    if (fits > 0 && (fits = manager_true(m, M_READING)) >= 0)
        fits = !fits;
    if (fits > 0) {
        PyObject *debug = getf(m, K_MANAGER, M_DEBUG, s_debug);
        if (debug == NULL)
            goto unpin;
        fits = debug == Py_None;
        Py_DECREF(debug);
    }
    if (fits < 0)
        goto unpin;
    if (fits) {
        PyObject *a[2] = {m, nbytes};
        if ((new = create_fast(module, a, 2)) == NULL)
            goto unpin;
        if (new == Py_None)
            Py_CLEAR(new);
    }
    PyObject *report = s_new_in_fast;
    if (new == NULL) {
        if ((new = allocate_checked(m, policy, nbytes)) == NULL)
            goto unpin;
        report = s_write_use;
    }
    if (add_pins(new, 1) < 0)
        goto unpin;
    held[n_held++] = new;
    if (report == s_new_in_fast ? policy_hook(policy, HOOK_NEW_IN_FAST, report, new) < 0
                                : write_use_hook(policy, m, new) < 0)
        goto unpin;

    /* the kernel */
kernel:
    if (!is_short) {
        if (lock_call(lock, 0) < 0)
            goto unpin;
        locked = 0;
    }
    if (nbytes == NULL) {                                 /* a method: no new array */
        for (Py_ssize_t i = 0; i < n_in; i++) {
            PyObject *x = PyTuple_GET_ITEM(inputs, i);
            views[i] = Py_IS_TYPE(x, view_cls) ? kernel_view(x) : Py_NewRef(x);
            if (views[i] == NULL)
                goto kernel_done;
        }
        if (kwnames == out_kw && out_by_position(ufunc, n_in - 1))
            res = PyObject_Vectorcall(ufunc, views, n_in, NULL);
        else
            res = PyObject_Vectorcall(ufunc, views, n_in - n_kw, kwnames);
        goto kernel_done;
    }
    PyObject *scopes = PyList_GET_SIZE(open_scopes) ? PyList_GET_ITEM(open_scopes, 0) : NULL;
    int scoped = scopes == NULL ? 0 : PyObject_IsTrue(scopes);
    if (scoped < 0)
        goto kernel_done;
    if (scoped) {
        if ((t = PyObject_CallOneArg(record_new_fn, new)) == NULL)
            goto kernel_done;
        Py_DECREF(t);
    }
    PyObject *out_view = NULL;
    PyObject *made = new_view(m, new, shape, dtype, strides, &out_view);
    if (made == NULL)
        goto kernel_done;
    if (ufunc == NULL) {                                  /* a new array, no kernel */
        Py_DECREF(out_view);
        res = made;
        goto kernel_done;
    }
    for (Py_ssize_t i = 0; i < n_in; i++) {
        PyObject *x = PyTuple_GET_ITEM(inputs, i);
        views[i] = Py_IS_TYPE(x, view_cls) ? kernel_view(x) : Py_NewRef(x);
        if (views[i] == NULL) {
            Py_DECREF(made);
            Py_DECREF(out_view);
            goto kernel_done;
        }
    }
    views[n_in] = out_view;
    t = out_by_position(ufunc, n_in) ? PyObject_Vectorcall(ufunc, views, n_in + 1, NULL)
                                     : PyObject_Vectorcall(ufunc, views, n_in, out_kw);
    if (t == NULL) {                                      /* out=view */
        Py_DECREF(made);
        goto kernel_done;
    }
    Py_DECREF(t);
    res = made;
kernel_done:
    if (!locked) {
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        if (lock_call(lock, 1) < 0) {                /* cannot unpin without the lock */
            Py_XDECREF(et); Py_XDECREF(ev); Py_XDECREF(etb);
            Py_CLEAR(res);
            goto out;
        }
        locked = 1;
        PyErr_Restore(et, ev, etb);
        unpin_all(held, n_held);
        n_held = 0;
        PyErr_Fetch(&et, &ev, &etb);
        if (notify_if_closing(m) < 0) {
            if (et != NULL)
                PyErr_WriteUnraisable(m);
            else
                Py_CLEAR(res);
        }
        if (et != NULL)
            PyErr_Restore(et, ev, etb);
    }
unpin:
    unpin_all(held, n_held);
out:
    for (Py_ssize_t i = 0; i <= n_in && i < 9; i++)
        Py_XDECREF(views[i]);
    Py_XDECREF(new);
    Py_XDECREF(policy);
    if (locked && unlock_keeping_error(lock) < 0)
        Py_CLEAR(res);
    Py_DECREF(lock);
    return res;
}
/* run_core's result for the entry points that say "not taken" with None: NotImplemented
 * (a reference the caller passes on) becomes None. */
static PyObject *
none_if_not_taken(PyObject *res)
{
    if (res == Py_NotImplemented) {
        Py_DECREF(res);
        Py_RETURN_NONE;
    }
    return res;
}

/* run_core for a ufunc into a new array; None when not taken. */
static PyObject *
run_ufunc_core(PyObject *module, PyObject *m, PyObject *ufunc, PyObject *inputs, PyObject *objs,
               PyObject *shape, PyObject *dtype, PyObject *strides, PyObject *nbytes,
               int is_short)
{
    return none_if_not_taken(run_core(module, m, ufunc, inputs, objs, shape, dtype, strides,
                                      nbytes, NULL, NULL, NULL, is_short));
}

static PyObject *
run_ufunc(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "run_ufunc(manager, ufunc, inputs, objs, shape, dtype, "
                        "strides, nbytes, short)");
        return NULL;
    }
    if (view_cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "run_ufunc: bind_views() was not called");
        return NULL;
    }
    int is_short = PyObject_IsTrue(args[8]);
    if (is_short < 0)
        return NULL;
    return run_ufunc_core(module, args[0], args[1], args[2], args[3], args[4], args[5], args[6],
                          args[7], is_short);
}

static int
is_py_scalar(PyObject *x)
{
    PyTypeObject *t = Py_TYPE(x);
    return t == &PyLong_Type || t == &PyFloat_Type || t == &PyComplex_Type || t == &PyBool_Type;
}

/* fast_ufunc's plans by identity: (ufunc, operand kinds, shape object) -> (plan, layout), so
 * the commonest calls skip building a key tuple and two dict lookups (about 800 instructions of
 * x + y). PLANS only grows and a plan and layout are functions of their key, so an entry never
 * goes stale; it holds its key's objects, whose addresses cannot be reused meanwhile. */
#define PLAN_CACHE 16
typedef struct { PyObject *ufunc, *ka, *kb, *shape, *plan, *lay; } PlanEntry;
static PlanEntry plan_cache[PLAN_CACHE];

static PlanEntry *
plan_slot(PyObject *ufunc, PyObject *ka, PyObject *kb, PyObject *shape)
{
    uintptr_t h = ((uintptr_t)ufunc >> 4) ^ ((uintptr_t)ka >> 4) * 3 ^
                  ((uintptr_t)kb >> 4) * 5 ^ ((uintptr_t)shape >> 4) * 7;
    return &plan_cache[h % PLAN_CACHE];
}

static void
plan_cache_clear(void)
{
    for (int i = 0; i < PLAN_CACHE; i++) {
        PlanEntry *e = &plan_cache[i];
        Py_CLEAR(e->ufunc); Py_CLEAR(e->ka); Py_CLEAR(e->kb); Py_CLEAR(e->shape);
        Py_CLEAR(e->plan); Py_CLEAR(e->lay);
    }
}

/* 1 when an operand kind (a dtype, or a Python scalar's type) may key PLANS: not a dtype with
 * metadata, which compares equal to the same dtype without it (its results carry the metadata,
 * so it must not share a plain dtype's plan); 0 when it may not, -1 on error. Asked only on the
 * way to PLANS: a kind's object is in the identity cache only if it passed. */
static int
plain_kind(PyObject *k)
{
    if (PyType_Check(k))
        return 1;
    PyObject *meta = PyObject_GetAttrString(k, "metadata");
    if (meta == NULL)
        return -1;
    int plain = meta == Py_None;
    Py_DECREF(meta);
    return plain;
}

/* The plan and layout (borrowed) of ufunc on operands of kinds ka, kb (NULL: one operand) and
 * shape: 1 found, 0 not for fast_ufunc, -1 on error. */
static int
find_plan(PyObject *ufunc, PyObject *ka, PyObject *kb, PyObject *shape, PyObject **plan,
          PyObject **lay)
{
    PlanEntry *e = plan_slot(ufunc, ka, kb, shape);
    if (e->ufunc == ufunc && e->ka == ka && e->kb == kb && e->shape == shape) {
        *plan = e->plan;
        *lay = e->lay;
        return 1;
    }
    int plain = plain_kind(ka);
    if (plain > 0 && kb != NULL)
        plain = plain_kind(kb);
    if (plain <= 0)
        return plain;
    PyObject *key = kb != NULL ? PyTuple_Pack(3, ufunc, ka, kb) : PyTuple_Pack(2, ufunc, ka);
    if (key == NULL)
        return -1;
    PyObject *p = PyDict_GetItemWithError(plans, key);              /* borrowed */
    Py_DECREF(key);
    if (p == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyTuple_CheckExact(p) || PyTuple_GET_SIZE(p) != 4 || !PyTuple_CheckExact(shape) ||
            PyTuple_GET_SIZE(shape) == 0 || !PyDict_CheckExact(PyTuple_GET_ITEM(p, 3)))
        return 0;
    PyObject *l = PyDict_GetItemWithError(PyTuple_GET_ITEM(p, 3), shape);
    if (l == NULL || !PyTuple_CheckExact(l) || PyTuple_GET_SIZE(l) != 2 ||
            !PyLong_CheckExact(PyTuple_GET_ITEM(l, 1)))
        return PyErr_Occurred() ? -1 : 0;
    PlanEntry old = *e;
    *e = (PlanEntry){Py_NewRef(ufunc), Py_NewRef(ka), Py_XNewRef(kb), Py_NewRef(shape),
                     Py_NewRef(p), Py_NewRef(l)};
    *plan = p;
    *lay = l;
    Py_XDECREF(old.ufunc); Py_XDECREF(old.ka); Py_XDECREF(old.kb); Py_XDECREF(old.shape);
    Py_XDECREF(old.plan); Py_XDECREF(old.lay);
    return 1;
}

/* 1 when NumPy's order="K" layout of x (one of our arrays, of two or more dimensions) is F order
 * and not C order: x is F- and not C-contiguous, as NumPy's flags say it (dimensions of length 1
 * ignored), or not contiguous with the |strides| of its dimensions longer than 1 growing strictly
 * (a strided or reversed view of an F-ordered array): NumPy gives a ufunc on such inputs an
 * F-ordered result, which the plans' C-ordered layouts are not. */
static int
f_order_only(PyObject *x)
{
    PyObject *shape = SLOT(x, off_shape), *strides = SLOT(x, off_strides),
             *dtype = SLOT(x, off_dtype);
    if (shape == NULL || strides == NULL || dtype == NULL || !PyTuple_CheckExact(shape) ||
            !PyTuple_CheckExact(strides) || PyTuple_GET_SIZE(shape) < 2 ||
            PyTuple_GET_SIZE(strides) != PyTuple_GET_SIZE(shape))
        return 0;
    Py_ssize_t nd = PyTuple_GET_SIZE(shape), item = PyDataType_ELSIZE((PyArray_Descr *)dtype);
    Py_ssize_t c = item, f = item;
    int is_c = 1, is_f = 1;
    for (Py_ssize_t i = 0; i < nd; i++) {
        Py_ssize_t nf = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i)),
                   sf = PyLong_AsSsize_t(PyTuple_GET_ITEM(strides, i)),
                   nc = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, nd - 1 - i)),
                   sc = PyLong_AsSsize_t(PyTuple_GET_ITEM(strides, nd - 1 - i));
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        if (nf == 0)
            return 0;                                     /* empty: both orders */
        if (nf != 1) {
            is_f &= sf == f;
            f *= nf;
        }
        if (nc != 1) {
            is_c &= sc == c;
            c *= nc;
        }
    }
    if (is_c || is_f)
        return is_f && !is_c;
    Py_ssize_t prev = -1, longer = 0;
    for (Py_ssize_t i = 0; i < nd; i++) {
        Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i)),
                   s = PyLong_AsSsize_t(PyTuple_GET_ITEM(strides, i));
        if (n == 1)
            continue;
        s = s < 0 ? -s : s;
        if (s <= prev)
            return 0;
        prev = s;
        longer++;
    }
    return longer >= 2;
}

/* fast_ufunc(ufunc, inputs): ufunc(*inputs) into a new array, all in C, for the commonest
 * calls: one CachedArray, or two of one manager and one shape, or one and a Python scalar,
 * whose plan and result layout cachedarrays.ufuncs has cached. None when the call is not one
 * of those or the manager is busy: the caller takes cachedarrays.ufuncs._fast_call. */
static PyObject *
fast_ufunc_impl(PyObject *module, PyObject *ufunc, PyObject *inputs)
{
    if (view_cls == NULL || plans == NULL)
        Py_RETURN_NONE;
    PyObject *m, *shape, *ka, *kb = NULL, *objs;
    Py_ssize_t n = PyTuple_GET_SIZE(inputs);
    if (n == 2) {
        PyObject *a = PyTuple_GET_ITEM(inputs, 0), *b = PyTuple_GET_ITEM(inputs, 1);
        int ca = Py_IS_TYPE(a, view_cls), cb = Py_IS_TYPE(b, view_cls);
        PyObject *x = ca ? a : b;                        /* the (first) array */
        if (!(ca || cb) || (!(ca && cb) && !is_py_scalar(ca ? b : a)))
            Py_RETURN_NONE;
        m = SLOT(x, off_m);
        shape = SLOT(x, off_shape);
        if (m == NULL || shape == NULL)
            Py_RETURN_NONE;
        if ((!ca || f_order_only(a)) && (!cb || f_order_only(b)))
            Py_RETURN_NONE;                              /* an F-ordered result */
        if (ca && cb) {
            PyObject *bs = SLOT(b, off_shape);
            if (SLOT(b, off_m) != m || bs == NULL)
                Py_RETURN_NONE;
            int same = bs == shape ? 1 : PyObject_RichCompareBool(bs, shape, Py_EQ);
            if (same <= 0)
                return same < 0 ? NULL : Py_NewRef(Py_None);
        }
        ka = ca ? SLOT(a, off_dtype) : (PyObject *)Py_TYPE(a);
        kb = cb ? SLOT(b, off_dtype) : (PyObject *)Py_TYPE(b);
        if (ka == NULL || kb == NULL || (ca && SLOT(a, off_obj) == NULL) ||
                (cb && SLOT(b, off_obj) == NULL))
            Py_RETURN_NONE;                              /* an array made without its fields */
        objs = ca && cb ? PyTuple_Pack(2, SLOT(a, off_obj), SLOT(b, off_obj))
                        : PyTuple_Pack(1, SLOT(x, off_obj));
    } else if (n == 1 && Py_IS_TYPE(PyTuple_GET_ITEM(inputs, 0), view_cls)) {
        PyObject *a = PyTuple_GET_ITEM(inputs, 0);
        m = SLOT(a, off_m);
        shape = SLOT(a, off_shape);
        ka = SLOT(a, off_dtype);
        if (m == NULL || shape == NULL || ka == NULL || SLOT(a, off_obj) == NULL ||
                f_order_only(a))
            Py_RETURN_NONE;
        objs = PyTuple_Pack(1, SLOT(a, off_obj));
    } else {
        Py_RETURN_NONE;
    }
    if (objs == NULL)
        return NULL;
    PyObject *res = NULL, *plan, *lay;
    Py_INCREF(m);                                /* the policy's Python code may rebind x's */
    Py_INCREF(shape);                            /* fields while the call runs */
    int found = find_plan(ufunc, ka, kb, shape, &plan, &lay);
    if (found <= 0) {
        res = found < 0 ? NULL : Py_NewRef(Py_None);
        goto out;
    }
    PyObject *nbytes = PyTuple_GET_ITEM(lay, 1);
    long long nb = PyLong_AsLongLong(nbytes);
    if (nb == -1 && PyErr_Occurred())
        goto out;
    Py_INCREF(plan);                              /* the call may run Python that edits PLANS */
    Py_INCREF(lay);
    res = run_ufunc_core(module, m, ufunc, inputs, objs, shape, PyTuple_GET_ITEM(plan, 0),
                         PyTuple_GET_ITEM(lay, 0), nbytes, nb <= short_bytes);
    Py_DECREF(lay);
    Py_DECREF(plan);
out:
    Py_DECREF(objs);
    Py_DECREF(m);
    Py_DECREF(shape);
    return res;
}

/* new_array(m, shape, dtype, strides, nbytes): an uninitialised CachedArray (shape, dtype,
 * strides) of a new object of nbytes placed by the policy, as cachedarrays.creation.empty makes
 * it through Manager.new_pinned; None when the manager is busy (the caller takes that path). */
static PyObject *
new_array(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyTuple_CheckExact(args[1]) || !PyTuple_CheckExact(args[3]) ||
            !PyLong_CheckExact(args[4])) {
        PyErr_SetString(PyExc_TypeError, "new_array(manager, shape: tuple, dtype, strides: "
                        "tuple, nbytes: int)");
        return NULL;
    }
    if (view_cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "new_array: bind_views() was not called");
        return NULL;
    }
    PyObject *none = PyTuple_New(0);
    if (none == NULL)
        return NULL;
    PyObject *res = run_core(module, args[0], NULL, none, none, args[1], args[2], args[3],
                             args[4], NULL, NULL, NULL, 1);
    Py_DECREF(none);
    return none_if_not_taken(res);
}

static PyObject *
fast_ufunc(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyTuple_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "fast_ufunc(ufunc, inputs: tuple)");
        return NULL;
    }
    return fast_ufunc_impl(module, args[0], args[1]);
}

/* ---- calls that make no array of ours: out=, x op= y, x[key] = v, reductions ---------------- */

/* run_core for a call that makes no new array (nbytes NULL), short when the object sized's
 * bytes are at most SHORT_BYTES. m and wobj are held while it runs: the policy's Python code
 * may rebind the fields of the arrays they came from. */
static PyObject *
run_call(PyObject *m, PyObject *fn, PyObject *inputs, PyObject *objs, PyObject *kwnames,
         PyObject *wobj, PyObject *wname, PyObject *sized)
{
    PyObject *nb = ((ObjectRecord *)sized)->nbytes;
    long long n = nb == NULL ? -1 : PyLong_AsLongLong(nb);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    Py_INCREF(m);
    Py_XINCREF(wobj);
    PyObject *res = run_core(NULL, m, fn, inputs, objs, NULL, NULL, NULL, NULL, kwnames, wobj,
                             wname, n >= 0 && n <= short_bytes);
    Py_XDECREF(wobj);
    Py_DECREF(m);
    return res;
}

/* run_read(manager, fn, inputs, objs, short): fn(*inputs), with the CachedArrays among inputs
 * replaced by their kernel views, objs (their objects) pinned and reported read, as
 * Manager.run(kernel, objs, (), None, name, short) does; fn's result as it is. None when the
 * manager is busy (Manager.run's general path must run it). */
static PyObject *
run_read(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "run_read(manager, fn, inputs, objs, short)");
        return NULL;
    }
    if (view_cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "run_read: bind_views() was not called");
        return NULL;
    }
    int is_short = PyObject_IsTrue(args[4]);
    if (is_short < 0)
        return NULL;
    return none_if_not_taken(run_core(module, args[0], args[1], args[2], args[3], NULL, NULL,
                                      NULL, NULL, NULL, NULL, NULL, is_short));
}

/* ---- a ufunc into an existing array (out=, x op= y) ----------------------------------------- */

static PyObject *simple_ufuncs;         /* ufunc -> its __name__ if nout == 1 and no signature,
                                         * else False */

/* The name of a ufunc with one output and no core signature (a new reference), or False. */
static PyObject *
simple_ufunc_name(PyObject *ufunc)
{
    if (simple_ufuncs == NULL && (simple_ufuncs = PyDict_New()) == NULL)
        return NULL;
    PyObject *v = PyDict_GetItemWithError(simple_ufuncs, ufunc);
    if (v != NULL)
        return Py_NewRef(v);
    if (PyErr_Occurred())
        return NULL;
    PyObject *nout = NULL, *sig = NULL, *name = NULL;
    if (lookup_attr(ufunc, s_nout, &nout) < 0 || lookup_attr(ufunc, s_signature, &sig) < 0 ||
            lookup_attr(ufunc, s_dunder_name, &name) < 0)
        goto out;
    int one_out = nout != NULL && PyLong_CheckExact(nout) && PyLong_AsLong(nout) == 1;
    v = one_out && sig == Py_None && name != NULL && PyUnicode_Check(name) ? name : Py_False;
    if (PyDict_GET_SIZE(simple_ufuncs) < 1024 && PyDict_SetItem(simple_ufuncs, ufunc, v) < 0)
        v = NULL;
    Py_XINCREF(v);
out:
    Py_XDECREF(nout); Py_XDECREF(sig); Py_XDECREF(name);
    return v;
}

/* ufunc(*inputs, out=out) for a CachedArray out, as cachedarrays.ufuncs._fast_general does it
 * through Manager.run: every array input a CachedArray of out's manager and shape (at least
 * one), the others Python or NumPy scalars; the inputs pinned and reported read, out pinned and
 * reported written. Returns out, or None, having done nothing, when the call is not of that
 * kind or the manager is busy. */
static PyObject *
fast_into(PyObject *ufunc, PyObject *const *inputs, Py_ssize_t n_in, PyObject *out)
{
    if (view_cls == NULL || !Py_IS_TYPE(out, view_cls) || n_in < 1 || n_in > 6)
        Py_RETURN_NONE;
    PyObject *m = SLOT(out, off_m), *shape = SLOT(out, off_shape), *wobj = SLOT(out, off_obj);
    if (m == NULL || shape == NULL || wobj == NULL ||
            !PyObject_TypeCheck(wobj, &ObjectRecordType) || !PyTuple_CheckExact(shape) ||
            PyTuple_GET_SIZE(shape) == 0)
        Py_RETURN_NONE;
    PyObject *ro[6];
    Py_ssize_t n_objs = 0;
    for (Py_ssize_t i = 0; i < n_in; i++) {
        PyObject *x = inputs[i];
        if (Py_IS_TYPE(x, view_cls)) {
            PyObject *xs = SLOT(x, off_shape), *o = SLOT(x, off_obj);
            if (SLOT(x, off_m) != m || xs == NULL || o == NULL)
                Py_RETURN_NONE;
            int same = xs == shape ? 1 : PyObject_RichCompareBool(xs, shape, Py_EQ);
            if (same <= 0)
                return same < 0 ? NULL : Py_NewRef(Py_None);
            ro[n_objs++] = o;
        } else if (!is_py_scalar(x) && !PyArray_IsScalar(x, Generic)) {
            Py_RETURN_NONE;
        }
    }
    if (n_objs == 0)
        Py_RETURN_NONE;
    PyObject *name = simple_ufunc_name(ufunc);
    if (name == NULL)
        return NULL;
    if (name == Py_False) {
        Py_DECREF(name);
        Py_RETURN_NONE;
    }
    PyObject *all = PyTuple_New(n_in + 1), *objs = PyTuple_New(n_objs), *res = NULL;
    if (all != NULL && objs != NULL) {
        for (Py_ssize_t i = 0; i < n_in; i++)
            PyTuple_SET_ITEM(all, i, Py_NewRef(inputs[i]));
        PyTuple_SET_ITEM(all, n_in, Py_NewRef(out));
        for (Py_ssize_t i = 0; i < n_objs; i++)
            PyTuple_SET_ITEM(objs, i, Py_NewRef(ro[i]));
        res = run_call(m, ufunc, all, objs, out_kw, wobj, name, wobj);
    }
    Py_XDECREF(all);
    Py_XDECREF(objs);
    Py_DECREF(name);
    res = none_if_not_taken(res);
    if (res == NULL || res == Py_None)
        return res;
    Py_DECREF(res);                                      /* NumPy's return: out's view */
    return Py_NewRef(out);
}

static PyObject *
fast_into_entry(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyTuple_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "fast_into(ufunc, inputs: tuple, out)");
        return NULL;
    }
    return fast_into(args[0], &PyTuple_GET_ITEM(args[1], 0), PyTuple_GET_SIZE(args[1]),
                     args[2]);
}

/* ---- __array_ufunc__: the commonest calls in C ---------------------------------------------- */

static PyObject *array_ufunc_fallback;

/* CachedArray.__array_ufunc__(ufunc, method, *inputs, **kwargs): fast_ufunc for a plain call
 * (method "__call__", no keywords), else the general handler (NEP 13). */
static PyObject *
view_array_ufunc(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs >= 3 && kwnames != NULL && PyTuple_GET_SIZE(kwnames) == 1 &&
            PyUnicode_Check(args[1]) &&
            (args[1] == s_call || PyUnicode_Compare(args[1], s_call) == 0) &&
            PyUnicode_Check(PyTuple_GET_ITEM(kwnames, 0)) &&
            PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "out") == 0 &&
            PyTuple_CheckExact(args[nargs]) && PyTuple_GET_SIZE(args[nargs]) == 1) {
        PyObject *res = fast_into(args[0], args + 2, nargs - 2, PyTuple_GET_ITEM(args[nargs], 0));
        if (res != Py_None)
            return res;                                  /* out, or NULL: an error */
        Py_DECREF(res);
    }
    if (nargs >= 3 && kwnames == NULL && PyUnicode_Check(args[1]) &&
            (args[1] == s_call || PyUnicode_Compare(args[1], s_call) == 0)) {
        PyObject *inputs = PyTuple_New(nargs - 2);
        if (inputs == NULL)
            return NULL;
        for (Py_ssize_t i = 2; i < nargs; i++)
            PyTuple_SET_ITEM(inputs, i - 2, Py_NewRef(args[i]));
        PyObject *res = fast_ufunc_impl(NULL, args[0], inputs);
        Py_DECREF(inputs);
        if (res != Py_None)
            return res;
        Py_DECREF(res);
    }
    Py_ssize_t n = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[16], **all = n + 1 <= 16 ? small : PyMem_Malloc((n + 1) * sizeof(PyObject *));
    if (all == NULL)
        return PyErr_NoMemory();
    all[0] = self;
    for (Py_ssize_t i = 0; i < n; i++)
        all[i + 1] = args[i];
    PyObject *res = PyObject_Vectorcall(array_ufunc_fallback, all, nargs + 1, kwnames);
    if (all != small)
        PyMem_Free(all);
    return res;
}

static PyMethodDef array_ufunc_def = {
    "__array_ufunc__", (PyCFunction)(void (*)(void))view_array_ufunc,
    METH_FASTCALL | METH_KEYWORDS,
    "NEP 13: ufuncs on CachedArrays, the commonest calls in C and the rest by the general "
    "handler."};

/* A method of CachedArray (def) whose C body sends what it does not take to fallback, kept in
 * *slot. what names the caller in errors. */
static PyObject *
method_with_fallback(const char *what, PyMethodDef *def, PyObject **slot, PyObject *fallback)
{
    if (view_cls == NULL) {
        PyErr_Format(PyExc_RuntimeError, "%s: bind_views() was not called", what);
        return NULL;
    }
    if (!PyCallable_Check(fallback)) {
        PyErr_Format(PyExc_TypeError, "%s(fallback): fallback must be callable", what);
        return NULL;
    }
    Py_XSETREF(*slot, Py_NewRef(fallback));
    return PyDescr_NewMethod(view_cls, def);
}

/* array_ufunc(fallback): the method CachedArray.__array_ufunc__, calling fallback(self, ufunc,
 * method, *inputs, **kwargs) for calls fast_ufunc does not take. */
static PyObject *
make_array_ufunc(PyObject *module, PyObject *fallback)
{
    return method_with_fallback("array_ufunc", &array_ufunc_def, &array_ufunc_fallback, fallback);
}

/* ---- operators: x + y and the others, in C ------------------------------------------------- */

/* An arithmetic operator of CachedArray: ufunc(self, other) (reflected: ufunc(other, self);
 * unary: ufunc(self)) by fast_ufunc, or fallback(*args) for any call fast_ufunc does not take.
 * A method descriptor, so Python calls it with self and no bound method in between. */
typedef struct {
    PyObject_HEAD
    PyObject *ufunc;
    PyObject *fallback;
    int kind;                  /* 0 forward, 1 reflected, 2 unary, 3 a method (a reduction),
                                * 4 in place, 5 x[key] = scalar */
    vectorcallfunc vectorcall;
} OperatorObject;


/* 1 when x is an argument run_method hands to the ndarray method as it is: not one of our
 * arrays, nor a list or tuple (which may hold some), nor an ndarray (which may be an out= given
 * by position, to be returned as it is). */
static int
plain_argument(PyObject *x)
{
    return !PyObject_TypeCheck(x, view_cls) && !PyArray_Check(x) && !PyList_Check(x)
        && !PyTuple_Check(x);
}

/* x.<method>(*args, **kw) for a CachedArray x, as CachedArray's reduction methods do: the ndarray
 * method on x's pinned view, a 0-d result as its scalar, another array copied into a new
 * CachedArray (from_ndarray). NotImplemented when the call is not of that kind (an out=, an
 * array or sequence argument, too many arguments) or the manager is busy. */
/* 1 when key is a basic index: an int, a slice, Ellipsis, None or a tuple of these. */
static int
basic_key(PyObject *key)
{
    if (PyLong_CheckExact(key) || PySlice_Check(key) || key == Py_Ellipsis || key == Py_None)
        return 1;
    if (!PyTuple_CheckExact(key))
        return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(key); i++) {
        PyObject *k = PyTuple_GET_ITEM(key, i);
        if (!(PyLong_CheckExact(k) || PySlice_Check(k) || k == Py_Ellipsis || k == Py_None))
            return 0;
    }
    return 1;
}

/* x[key] = value for a basic key and a scalar value, as CachedArray.__setitem__ does it through
 * Manager.run: x pinned and reported written, then setitem(view, key, value). None when written,
 * NotImplemented when the call is not of that kind or the manager is busy. */
static PyObject *
run_setitem(PyObject *setitem, PyObject *x, PyObject *key, PyObject *value)
{
    if (!basic_key(key) || !(is_py_scalar(value) || PyArray_IsScalar(value, Generic)))
        return Py_NewRef(Py_NotImplemented);
    PyObject *m = SLOT(x, off_m), *obj = SLOT(x, off_obj);
    if (m == NULL || obj == NULL || !PyObject_TypeCheck(obj, &ObjectRecordType))
        return Py_NewRef(Py_NotImplemented);
    PyObject *inputs = PyTuple_Pack(3, x, key, value), *objs = PyTuple_New(0), *res = NULL;
    if (inputs != NULL && objs != NULL)
        res = run_call(m, setitem, inputs, objs, NULL, obj, s_use, obj);
    Py_XDECREF(inputs);
    Py_XDECREF(objs);
    return res;
}

static PyObject *
run_method(PyObject *method, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *x = args[0];
    Py_ssize_t n_kw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (from_ndarray_fn == NULL || nargs + n_kw > 8)
        return Py_NewRef(Py_NotImplemented);
    for (Py_ssize_t i = 1; i < nargs + n_kw; i++)
        if (!plain_argument(args[i]))
            return Py_NewRef(Py_NotImplemented);
    for (Py_ssize_t i = 0; i < n_kw; i++) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, i);
        if (PyUnicode_Check(k) && PyUnicode_CompareWithASCIIString(k, "out") == 0)
            return Py_NewRef(Py_NotImplemented);
    }
    PyObject *m = SLOT(x, off_m), *obj = SLOT(x, off_obj);
    if (m == NULL || obj == NULL || !PyObject_TypeCheck(obj, &ObjectRecordType))
        return Py_NewRef(Py_NotImplemented);
    PyObject *inputs = PyTuple_New(nargs + n_kw), *objs = NULL, *res = NULL;
    if (inputs == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < nargs + n_kw; i++)
        PyTuple_SET_ITEM(inputs, i, Py_NewRef(args[i]));
    Py_INCREF(m);                          /* from_ndarray's manager, after the call */
    if ((objs = PyTuple_Pack(1, obj)) != NULL)
        res = run_call(m, method, inputs, objs, kwnames, NULL, NULL, obj);
    Py_DECREF(inputs);
    Py_XDECREF(objs);
    if (res != NULL && PyArray_CheckExact(res)) {
        if (PyArray_NDIM((PyArrayObject *)res) == 0) {
            res = PyArray_Return((PyArrayObject *)res);           /* r[()] (steals res) */
        } else {
            PyObject *a[2] = {m, res};
            Py_SETREF(res, PyObject_Vectorcall(from_ndarray_fn, a, 2, NULL));
        }
    }
    Py_DECREF(m);
    return res;
}

static PyObject *
operator_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    OperatorObject *op = (OperatorObject *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (op->kind == 5) {                                 /* x[key] = scalar */
        if (kwnames == NULL && nargs == 3 && view_cls != NULL && Py_IS_TYPE(args[0], view_cls)) {
            PyObject *res = run_setitem(op->ufunc, args[0], args[1], args[2]);
            if (res != Py_NotImplemented)
                return res;                              /* None, or NULL: an error */
            Py_DECREF(res);
        }
        return PyObject_Vectorcall(op->fallback, args, nargsf, kwnames);
    }
    if (op->kind == 4) {                                 /* x op= y: into x */
        if (kwnames == NULL && nargs == 2 && view_cls != NULL && Py_IS_TYPE(args[0], view_cls)) {
            PyObject *res = fast_into(op->ufunc, args, 2, args[0]);
            if (res != Py_None)
                return res;
            Py_DECREF(res);
        }
        return PyObject_Vectorcall(op->fallback, args, nargsf, kwnames);
    }
    if (op->kind == 3) {
        if (nargs >= 1 && view_cls != NULL && Py_IS_TYPE(args[0], view_cls)) {
            PyObject *res = run_method(op->ufunc, args, nargs, kwnames);
            if (res != Py_NotImplemented)
                return res;                              /* the result, or NULL: an error */
            Py_DECREF(res);
        }
        return PyObject_Vectorcall(op->fallback, args, nargsf, kwnames);
    }
    if (kwnames == NULL && nargs == (op->kind == 2 ? 1 : 2) && view_cls != NULL &&
            Py_IS_TYPE(args[0], view_cls)) {
        PyObject *inputs = op->kind == 0 ? PyTuple_Pack(2, args[0], args[1]) :
                           op->kind == 1 ? PyTuple_Pack(2, args[1], args[0]) :
                           PyTuple_Pack(1, args[0]);
        if (inputs == NULL)
            return NULL;
        PyObject *res = fast_ufunc_impl(NULL, op->ufunc, inputs);
        Py_DECREF(inputs);
        if (res != Py_None)
            return res;                                  /* the result, or NULL: an error */
        Py_DECREF(res);
    }
    return PyObject_Vectorcall(op->fallback, args, nargsf, kwnames);
}

static PyObject *
operator_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static int
operator_traverse(OperatorObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->ufunc);
    Py_VISIT(self->fallback);
    return 0;
}

static int
operator_clear(OperatorObject *self)
{
    Py_CLEAR(self->ufunc);
    Py_CLEAR(self->fallback);
    return 0;
}

static void
operator_dealloc(OperatorObject *self)
{
    PyObject_GC_UnTrack(self);
    operator_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
operator_name(OperatorObject *self, void *closure)
{
    return PyObject_GetAttrString(self->fallback, "__name__");
}

static PyGetSetDef operator_getset[] = {
    {"__name__", (getter)operator_name, NULL, "the operator's name", NULL},
    {NULL}
};

static PyMemberDef operator_members[] = {
    {"ufunc", T_OBJECT, offsetof(OperatorObject, ufunc), READONLY, "the ufunc it calls"},
    {"fallback", T_OBJECT, offsetof(OperatorObject, fallback), READONLY,
     "the Python operator for calls the C path does not take"},
    {NULL}
};

static PyTypeObject OperatorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cachedarrays._records.Operator",
    .tp_doc = "An arithmetic operator of CachedArray, run in C for the commonest calls.",
    .tp_basicsize = sizeof(OperatorObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(OperatorObject, vectorcall),
    .tp_descr_get = operator_get,
    .tp_dealloc = (destructor)operator_dealloc,
    .tp_traverse = (traverseproc)operator_traverse,
    .tp_clear = (inquiry)operator_clear,
    .tp_getset = operator_getset,
    .tp_members = operator_members,
};

/* operator(ufunc, fallback, kind): kind 0 (x op y), 1 (y op x, reflected), 2 (op x), 3 (a
 * method of CachedArray: x.method(...), run_method with the ndarray method given as ufunc),
 * 4 (x op= y: fast_into x) or 5 (x[key] = scalar: run_setitem with operator.setitem). */
static PyObject *
make_operator(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyCallable_Check(args[0]) || !PyCallable_Check(args[1]) ||
            !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "operator(ufunc, fallback, kind: 0 to 5)");
        return NULL;
    }
    long kind = PyLong_AsLong(args[2]);
    if (kind < 0 || kind > 5) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "operator: kind must be 0 (forward), 1 (reflected), "
                            "2 (unary), 3 (method), 4 (in place) or 5 (setitem)");
        return NULL;
    }
    OperatorObject *op = PyObject_GC_New(OperatorObject, &OperatorType);
    if (op == NULL)
        return NULL;
    op->ufunc = Py_NewRef(args[0]);
    op->fallback = Py_NewRef(args[1]);
    op->kind = (int)kind;
    op->vectorcall = operator_vectorcall;
    PyObject_GC_Track(op);
    return (PyObject *)op;
}

/* ---- basic indexing: x[key] as a view, in C ------------------------------------------------ */

static PyObject *getitem_fallback;                 /* CachedArray's general __getitem__ */

/* The view x[key] selects when key is an int, a slice, or a tuple of them (one per leading
 * dimension) that leaves at least one dimension: the same arithmetic as NumPy's basic
 * indexing. NULL with no error set when key is anything else (or x has no memory). */
static PyObject *
basic_view(PyObject *x, PyObject *key)
{
    /* x's fields, held while the key's __index__ (any Python code) runs */
    PyObject *f[6] = {SLOT(x, off_obj), SLOT(x, off_shape), SLOT(x, off_strides),
                      SLOT(x, off_offset), SLOT(x, off_m), SLOT(x, off_dtype)};
    for (int i = 0; i < 6; i++)
        if (f[i] == NULL)
            return NULL;
    PyObject *obj = f[0], *shape = f[1], *strides = f[2], *offset = f[3];
    if (!PyObject_TypeCheck(obj, &ObjectRecordType) || ((ObjectRecord *)obj)->primary == NULL ||
            ((ObjectRecord *)obj)->primary == Py_None || !PyTuple_CheckExact(shape) ||
            !PyTuple_CheckExact(strides) || PyTuple_GET_SIZE(shape) != PyTuple_GET_SIZE(strides) ||
            !PyLong_CheckExact(offset))
        return NULL;
    Py_ssize_t nd = PyTuple_GET_SIZE(shape),
               nk = PyTuple_CheckExact(key) ? PyTuple_GET_SIZE(key) : 1;
    if (nk > nd || nd > 64)
        return NULL;
    for (int i = 0; i < 6; i++)
        Py_INCREF(f[i]);
    Py_INCREF(key);
    PyObject *new_shape = NULL, *new_strides = NULL, *new_off = NULL, *res = NULL;
    Py_ssize_t dims[64], steps[64], n_out = 0, off = PyLong_AsSsize_t(offset);
    if (off == -1 && PyErr_Occurred())
        goto decline;
    for (Py_ssize_t i = 0; i < nd; i++) {
        Py_ssize_t len = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i)),
                   st = PyLong_AsSsize_t(PyTuple_GET_ITEM(strides, i));
        if ((len == -1 || st == -1) && PyErr_Occurred())
            goto decline;
        if (i >= nk) {
            dims[n_out] = len;
            steps[n_out++] = st;
            continue;
        }
        PyObject *k = PyTuple_CheckExact(key) ? PyTuple_GET_ITEM(key, i) : key;
        if (PySlice_Check(k)) {
            Py_ssize_t start, stop, step;
            if (PySlice_Unpack(k, &start, &stop, &step) < 0)
                goto out;                                /* the error NumPy gives (step 0) */
            Py_ssize_t n = PySlice_AdjustIndices(len, &start, &stop, step);
            if (n == 0) {                                /* NumPy's rule for an empty slice */
                start = 0;
                step = 1;
            }
            off += start * st;
            dims[n_out] = n;
            steps[n_out++] = st * step;
        } else if (PyLong_CheckExact(k)) {
            Py_ssize_t j = PyLong_AsSsize_t(k);
            if (j == -1 && PyErr_Occurred())
                goto decline;
            if (j < 0)
                j += len;
            if (j < 0 || j >= len)
                goto out;                                /* NumPy raises its IndexError */
            off += j * st;
        } else {
            goto out;
        }
    }
    if (n_out == 0)
        goto out;                                        /* a scalar: not a view */
    if ((new_shape = PyTuple_New(n_out)) == NULL || (new_strides = PyTuple_New(n_out)) == NULL ||
            (new_off = PyLong_FromSsize_t(off)) == NULL)
        goto out;
    for (Py_ssize_t i = 0; i < n_out; i++) {
        PyObject *d = PyLong_FromSsize_t(dims[i]), *t = PyLong_FromSsize_t(steps[i]);
        if (d == NULL || t == NULL) {
            Py_XDECREF(d);
            Py_XDECREF(t);
            goto out;
        }
        PyTuple_SET_ITEM(new_shape, i, d);
        PyTuple_SET_ITEM(new_strides, i, t);
    }
    PyTypeObject *type = Py_TYPE(x);
    if ((res = type->tp_alloc(type, 0)) == NULL)
        goto out;
    SLOT(res, off_obj) = Py_NewRef(obj);
    SLOT(res, off_m) = Py_NewRef(f[4]);
    SLOT(res, off_shape) = Py_NewRef(new_shape);
    SLOT(res, off_dtype) = Py_NewRef(f[5]);
    SLOT(res, off_strides) = Py_NewRef(new_strides);
    SLOT(res, off_offset) = Py_NewRef(new_off);
    SLOT(res, off_vc) = Py_NewRef(Py_None);
    /* a view: its base is the array that owns the object (x's own base, or x) */
    PyObject *owner = SLOT(x, off_base);
    SLOT(res, off_base) = Py_NewRef(owner != NULL && owner != Py_None ? owner : x);
    goto out;
decline:                                                 /* not an error: the general method */
    PyErr_Clear();
out:
    Py_XDECREF(new_shape);
    Py_XDECREF(new_strides);
    Py_XDECREF(new_off);
    for (int i = 0; i < 6; i++)
        Py_DECREF(f[i]);
    Py_DECREF(key);
    return res;
}

/* CachedArray.__getitem__: a basic-indexing view in C, anything else by the general method. */
static PyObject *
view_getitem(PyObject *self, PyObject *key)
{
    PyObject *res = basic_view(self, key);
    if (res != NULL || PyErr_Occurred())
        return res;
    return PyObject_CallFunctionObjArgs(getitem_fallback, self, key, NULL);
}

static PyMethodDef getitem_def = {
    "__getitem__", (PyCFunction)view_getitem, METH_O,
    "x[key]: a view for basic indexing (ints and slices), else NumPy's indexing on the pinned "
    "bytes."};

/* getitem(fallback): the method CachedArray.__getitem__, calling fallback(self, key) for keys
 * that are not basic indexing. */
static PyObject *
make_getitem(PyObject *module, PyObject *fallback)
{
    return method_with_fallback("getitem", &getitem_def, &getitem_fallback, fallback);
}

/* ---- np.where's select -------------------------------------------------------------------- */

/* An operand of select: a C-contiguous array of out's dtype with n elements (step 1) or one
 * (step 0, a scalar); its data, or NULL with an exception set. */
static const void *
select_operand(PyObject *a, PyArrayObject *out, npy_intp n, const char *what, int *step)
{
    if (!PyArray_Check(a) || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)a) ||
            !PyArray_EquivTypes(PyArray_DESCR((PyArrayObject *)a), PyArray_DESCR(out))) {
        PyErr_Format(PyExc_TypeError, "select: %s must be a C-contiguous array of out's dtype",
                     what);
        return NULL;
    }
    npy_intp size = PyArray_SIZE((PyArrayObject *)a);
    if (size != n && size != 1) {
        PyErr_Format(PyExc_ValueError, "select: %s has %zd elements; out has %zd (give as many, "
                     "or one for a scalar)", what, (Py_ssize_t)size, (Py_ssize_t)n);
        return NULL;
    }
    *step = size == n && n != 1;
    return PyArray_DATA((PyArrayObject *)a);
}

/* Whether [a, a + an) and [b, b + bn) share a byte. */
static int
overlaps(const char *a, npy_intp an, const char *b, npy_intp bn)
{
    return an > 0 && bn > 0 && a < b + bn && b < a + an;
}

/* select(cond, x, y, *, out): out[i] = x[i] if cond[i] else y[i], branch-free (np.where's
 * three-argument form). cond: a C-contiguous bool array of out's size; x and y: C-contiguous
 * arrays of out's dtype, of out's size or of one element (a scalar). out may be x or y; no
 * other overlap with out. Returns out. */
static PyObject *
select_entry(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs != 3 || kwnames == NULL || PyTuple_GET_SIZE(kwnames) != 1 ||
            PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "out") != 0) {
        PyErr_SetString(PyExc_TypeError, "select(cond, x, y, *, out)");
        return NULL;
    }
    PyObject *o = args[3];
    if (!PyArray_Check(o) || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)o) ||
            !PyArray_ISWRITEABLE((PyArrayObject *)o) ||
            PyDataType_REFCHK(PyArray_DESCR((PyArrayObject *)o))) {
        PyErr_SetString(PyExc_TypeError, "select: out must be a writable, C-contiguous array "
                        "without object fields");
        return NULL;
    }
    PyArrayObject *out = (PyArrayObject *)o, *c = (PyArrayObject *)args[0];
    npy_intp n = PyArray_SIZE(out), size = PyArray_ITEMSIZE(out);
    if (!PyArray_Check(args[0]) || PyArray_TYPE(c) != NPY_BOOL || !PyArray_IS_C_CONTIGUOUS(c) ||
            PyArray_SIZE(c) != n) {
        PyErr_Format(PyExc_TypeError, "select: cond must be a C-contiguous bool array of %zd "
                     "elements", (Py_ssize_t)n);
        return NULL;
    }
    int xstep, ystep;
    const void *x = select_operand(args[1], out, n, "x", &xstep);
    if (x == NULL)
        return NULL;
    const void *y = select_operand(args[2], out, n, "y", &ystep);
    if (y == NULL)
        return NULL;
    const char *od = PyArray_DATA(out);
    npy_intp ob = n * size;
    if (overlaps(od, ob, PyArray_DATA(c), n) ||                 /* out may be x or y itself */
            ((x != od || !xstep) && overlaps(od, ob, x, xstep ? ob : size)) ||
            ((y != od || !ystep) && overlaps(od, ob, y, ystep ? ob : size))) {
        PyErr_SetString(PyExc_ValueError, "select: out overlaps an operand");
        return NULL;
    }
    if (ob >= (1 << 16)) {
        Py_BEGIN_ALLOW_THREADS
        ca_select(PyArray_DATA(out), PyArray_DATA(c), x, xstep, y, ystep, (uint64_t)n,
                  (uint64_t)size);
        Py_END_ALLOW_THREADS
    } else {
        ca_select(PyArray_DATA(out), PyArray_DATA(c), x, xstep, y, ystep, (uint64_t)n,
                  (uint64_t)size);
    }
    return Py_NewRef(o);
}

static PyObject *
select_isa(PyObject *module, PyObject *unused)
{
    return PyUnicode_FromString(ca_select_isa());
}

static PyObject *
set_select_isa(PyObject *module, PyObject *name)
{
    const char *s = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    if (s == NULL || ca_select_set_isa(s) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "select ISA %R is not available on this CPU (use "
                     "'avx512', 'avx2' or 'sse2')", name);
        return NULL;
    }
    Py_RETURN_NONE;
}


/* ---- ca.compute's common path ----------------------------------------------------------------
 *
 * cachedarrays.scopes.compute, for the call that has neither rng nor touched and whose operands
 * are None or CachedArrays of one manager with nothing under way (run_busy) and no rerun of a
 * recorded kernel in progress: the same steps as Manager.acquire, the views, the open scope
 * and Manager.release, without the Python calls in between. */

/* 1 when strides are the contiguous strides of shape for item (C order, or F order with
 * fortran), as cachedarrays.layout.contiguous_strides gives them; 0 when not; -1 when the
 * tuples are not plain (the caller does not take the path). */
static int
contiguous_like(PyObject *shape, PyObject *strides, Py_ssize_t item, int fortran)
{
    Py_ssize_t nd = PyTuple_GET_SIZE(shape);
    if (!PyTuple_CheckExact(strides) || PyTuple_GET_SIZE(strides) != nd)
        return -1;
    Py_ssize_t step = item;
    for (Py_ssize_t k = 0; k < nd; k++) {
        Py_ssize_t i = fortran ? k : nd - 1 - k;
        PyObject *ps = PyTuple_GET_ITEM(strides, i), *pd = PyTuple_GET_ITEM(shape, i);
        if (!PyLong_CheckExact(ps) || !PyLong_CheckExact(pd))
            return -1;
        Py_ssize_t st = PyLong_AsSsize_t(ps), d = PyLong_AsSsize_t(pd);
        if ((st == -1 || d == -1) && PyErr_Occurred()) {
            PyErr_Clear();
            return -1;
        }
        if (st != step)
            return 0;
        if (__builtin_mul_overflow(step, d > 1 ? d : 1, &step))
            return -1;
    }
    return 1;
}

/* cachedarrays.scopes._covers for x (a CachedArray): 1 when a write through it replaces every
 * byte of its object, 0 when not, -1 when its fields are not plain (the path is not taken). */
static int
covers(PyObject *x, ObjectRecord *obj)
{
    PyObject *shape = SLOT(x, off_shape), *dtype = SLOT(x, off_dtype),
             *strides = SLOT(x, off_strides), *offset = SLOT(x, off_offset);
    if (shape == NULL || !PyTuple_CheckExact(shape) || dtype == NULL ||
            !PyArray_DescrCheck(dtype) || offset == NULL || !PyLong_CheckExact(offset) ||
            obj->nbytes == NULL || !PyLong_CheckExact(obj->nbytes))
        return -1;
    Py_ssize_t item = PyDataType_ELSIZE((PyArray_Descr *)dtype), n = item;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); i++) {
        PyObject *pd = PyTuple_GET_ITEM(shape, i);
        Py_ssize_t d = PyLong_CheckExact(pd) ? PyLong_AsSsize_t(pd) : -1;
        if (d < 0 || __builtin_mul_overflow(n, d, &n)) {
            PyErr_Clear();
            return -1;
        }
    }
    Py_ssize_t off = PyLong_AsSsize_t(offset), nb = PyLong_AsSsize_t(obj->nbytes);
    if ((off == -1 || nb == -1) && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    if (off != 0 || n != nb)
        return 0;
    if (n == 0)                 /* an empty view of an empty object, whatever its strides */
        return 1;
    int c = contiguous_like(shape, strides, item, 0);
    if (c != 0)
        return c;
    return contiguous_like(shape, strides, item, 1);
}

/* x._view(readonly) for a CachedArray x whose object is pinned: an ndarray over its primary
 * region's bytes, a read-only one built on the device's read-only buffer (so that NumPy will
 * not make it writable). A region without a buffer goes through the method. */
static PyObject *
operand_view(PyObject *x, int readonly)
{
    ObjectRecord *obj = (ObjectRecord *)SLOT(x, off_obj);
    PyObject *r = obj->primary, *shape = SLOT(x, off_shape), *dtype = SLOT(x, off_dtype),
             *strides = SLOT(x, off_strides), *offset = SLOT(x, off_offset);
    if (r == NULL || !PyObject_TypeCheck(r, &RegionRecordType) || shape == NULL ||
            dtype == NULL || strides == NULL || offset == NULL)
        goto python;
    RegionRecord *rr = (RegionRecord *)r;
    if (rr->buffer == NULL || rr->buffer == Py_None || rr->offset == NULL || rr->device == NULL)
        goto python;
    PyObject *a = PyNumber_Add(rr->offset, header);
    if (a == NULL)
        return NULL;
    PyObject *start = PyNumber_Add(a, offset);
    Py_DECREF(a);
    if (start == NULL)
        return NULL;
    PyObject *buf = readonly ? PyObject_GetAttr(rr->device, s_readonly_buffer)
                             : Py_NewRef(rr->buffer);
    PyObject *view = buf == NULL ? NULL
                                 : buffer_array_ex(shape, dtype, buf, start, strides, !readonly);
    Py_XDECREF(buf);
    Py_DECREF(start);
    return view;
python:
    return PyObject_CallMethodOneArg(x, s_view, readonly ? Py_True : Py_False);
}

/* Manager.release(objs) for held[0:n], keeping any pending exception: unpinned here unless
 * observers or new objects awaiting their own release need the method. Called without the
 * lock. */
static void
release_pins(PyObject *m, PyObject *lock, PyObject **held, Py_ssize_t n)
{
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    if (lock_call(lock, 1) < 0) {
        PyErr_WriteUnraisable(m);
        goto out;
    }
    PyObject *fresh = PyObject_GetAttr(m, s_fresh);
    int general = fresh == NULL ? -1 : PyObject_IsTrue(fresh);
    Py_XDECREF(fresh);
    if (general == 0)
        general = manager_true(m, M_OBSERVERS);
    if (general > 0) {
        PyObject *list = PyList_New(n), *t = NULL;
        if (list != NULL) {
            for (Py_ssize_t i = 0; i < n; i++)
                PyList_SET_ITEM(list, i, Py_NewRef(held[i]));
            t = PyObject_CallMethodOneArg(m, s_release_objs, list);
            Py_DECREF(list);
        }
        if (t == NULL)
            PyErr_WriteUnraisable(m);
        Py_XDECREF(t);
    } else {
        if (general < 0)
            PyErr_WriteUnraisable(m);
        unpin_all(held, n);
        if (notify_if_closing(m) < 0)
            PyErr_WriteUnraisable(m);
    }
    if (lock_call(lock, 0) < 0)
        PyErr_WriteUnraisable(lock);
out:
    PyErr_Restore(et, ev, etb);
}

#define COMPUTE_MAX 16

/* The operands of a kernel taken in C (ca.compute's and ca.kernel's common calls). */
typedef struct {
    PyObject *ops[COMPUTE_MAX];              /* reads then writes: None or CachedArray (held) */
    Py_ssize_t n, nr;
    PyObject *m;                             /* their manager (borrowed from an operand) */
    PyObject *robjs, *wobjs;                 /* lists of the objects read and written */
    PyObject *scope;                         /* ((object, shape), ...) for Manager._scopes */
    PyObject *lock;
    PyObject *held[COMPUTE_MAX];             /* objects pinned (borrowed from robjs/wobjs) */
    Py_ssize_t n_held;
} Operands;

static void
operands_clear(Operands *o)
{
    for (Py_ssize_t i = 0; i < o->n; i++)
        Py_DECREF(o->ops[i]);
    o->n = 0;
    Py_CLEAR(o->robjs);
    Py_CLEAR(o->wobjs);
    Py_CLEAR(o->scope);
    Py_CLEAR(o->lock);
}

/* Finish with o: release the pins it holds (unless the caller keeps them, keep) and its
 * references. Returns result, or None when the call was not taken (got 0, no error). */
static PyObject *
operands_done(Operands *o, int got, int keep, PyObject *result)
{
    if (o->n_held && !keep)
        release_pins(o->m, o->lock, o->held, o->n_held);
    operands_clear(o);
    if (got == 0 && !PyErr_Occurred())
        Py_RETURN_NONE;
    return result;
}

/* Take reads and writes (tuples or lists): 1 when every operand is None or a CachedArray (not
 * a subclass) of one manager, with at least one array; 0 when not (nothing taken); -1 on
 * error. Fills o (operands_clear releases it in every case). */
static int
operands_gather(Operands *o, PyObject *reads, PyObject *writes)
{
    memset(o, 0, sizeof *o);
    if (view_cls == NULL || !(PyTuple_CheckExact(reads) || PyList_CheckExact(reads)) ||
            !(PyTuple_CheckExact(writes) || PyList_CheckExact(writes)))
        return 0;
    Py_ssize_t nr = PySequence_Fast_GET_SIZE(reads), nw = PySequence_Fast_GET_SIZE(writes);
    if (nr + nw == 0 || nr + nw > COMPUTE_MAX)
        return 0;
    for (Py_ssize_t i = 0; i < nr + nw; i++)     /* a kernel may change the lists it was given */
        o->ops[o->n++] = Py_NewRef(i < nr ? PySequence_Fast_GET_ITEM(reads, i)
                                          : PySequence_Fast_GET_ITEM(writes, i - nr));
    o->nr = nr;
    Py_ssize_t arrays = 0;
    for (Py_ssize_t i = 0; i < o->n; i++) {
        PyObject *x = o->ops[i];
        if (x == Py_None)
            continue;
        if (Py_TYPE(x) != view_cls)
            return 0;
        PyObject *obj = SLOT(x, off_obj), *xm = SLOT(x, off_m);
        if (obj == NULL || !PyObject_TypeCheck(obj, &ObjectRecordType) || xm == NULL ||
                ((ObjectRecord *)obj)->id == NULL || SLOT(x, off_shape) == NULL ||
                SLOT(x, off_dtype) == NULL || SLOT(x, off_strides) == NULL ||
                SLOT(x, off_offset) == NULL)
            return 0;
        if (o->m == NULL)
            o->m = xm;
        else if (xm != o->m)
            return 0;
        arrays++;
    }
    if (o->m == NULL)
        return 0;
    if ((o->robjs = PyList_New(0)) == NULL || (o->wobjs = PyList_New(0)) == NULL ||
            (o->scope = PyTuple_New(arrays)) == NULL)
        return -1;
    for (Py_ssize_t i = 0, k = 0; i < o->n; i++) {
        PyObject *x = o->ops[i];
        if (x == Py_None)
            continue;
        PyObject *obj = SLOT(x, off_obj);
        if (PyList_Append(i < nr ? o->robjs : o->wobjs, obj) < 0)
            return -1;
        PyObject *h = PyTuple_Pack(2, obj, SLOT(x, off_shape));
        if (h == NULL)
            return -1;
        PyTuple_SET_ITEM(o->scope, k++, h);
    }
    return 1;
}

/* Manager.acquire(reads, writes, name, None, recipe) for the gathered operands, when the
 * manager has nothing under way: 1 done (every operand pinned, in o->held), 0 not taken
 * (nothing done), -1 error (nothing left pinned). recipe NULL: the lineage of the writes
 * breaks (each write occurrence adds one to the version and sets the chain to name). */
static int
operands_acquire(Operands *o, PyObject *module, PyObject *name, PyObject *recipe)
{
    PyObject *m = o->m, *policy = NULL, *t;
    int rc = -1;
    if ((o->lock = getf(m, K_MANAGER, M_LOCK, s_lock)) == NULL || lock_call(o->lock, 1) < 0)
        return -1;
    int ready = ready_policy(module, m, 1, &policy);
    if (ready <= 0) {
        rc = ready;
        goto out;
    }
    for (int pass = 0; pass < 2; pass++) {       /* reads, then writes, as Manager._pin_all */
        PyObject *list = pass ? o->wobjs : o->robjs;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
            PyObject *obj = PyList_GET_ITEM(list, i);
            if (pin_live(m, obj) < 0)
                goto unpin;
            o->held[o->n_held++] = obj;
            if (pass == 0) {
                if (policy_hook(policy, HOOK_READ_USE, s_read_use, obj) < 0)
                    goto unpin;
            } else if (write_use_hook(policy, m, obj) < 0) {
                goto unpin;
            }
        }
    }
    if (PyList_GET_SIZE(o->wobjs)) {
        if (recipe != NULL) {
            if ((t = PyObject_CallMethodObjArgs(recipe, s_record, o->robjs, o->wobjs,
                                                NULL)) == NULL)
                goto unpin;
            Py_DECREF(t);
        } else {
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o->wobjs); i++) {
                ObjectRecord *w = (ObjectRecord *)PyList_GET_ITEM(o->wobjs, i);
                PyObject *v = PyNumber_Add(w->version ? w->version : zero, one);
                if (v == NULL)
                    goto unpin;
                Py_XSETREF(w->version, v);
                set_field(&w->chain, name);
            }
        }
    }
    rc = 1;
    goto out;
unpin:
    unpin_all(o->held, o->n_held);
    o->n_held = 0;
out:
    Py_XDECREF(policy);
    if (unlock_keeping_error(o->lock) < 0) {
        if (rc != 1) {
            PyErr_WriteUnraisable(o->lock);
        } else {                                 /* cannot keep pins without the lock's word */
            unpin_all(o->held, o->n_held);
            o->n_held = 0;
            rc = -1;
        }
    }
    return rc;
}

/* The views of the acquired operands (reads read-only) into views[0:o->n]; 0, or -1 with
 * every view made so far released. */
static int
operands_views(Operands *o, PyObject **views)
{
    for (Py_ssize_t i = 0; i < o->n; i++) {
        PyObject *x = o->ops[i];
        views[i] = x == Py_None ? Py_NewRef(Py_None) : operand_view(x, i < o->nr);
        if (views[i] == NULL) {
            while (i--)
                Py_CLEAR(views[i]);
            return -1;
        }
    }
    return 0;
}

/* The base a sealed view v gets in place of none: v is an empty view, whose (unused) data NumPy
 * allocated, so v owns it, and NumPy lets an array that owns its data be made writable. The
 * allocation goes to a holder array, which frees it as v would have; v then owns nothing and
 * its base, a 1-tuple holding the holder, exports no buffer. NULL (an exception set) if the
 * holder cannot be made; (None,) for a view that neither owns its data nor has a base. */
static PyObject *
view_disown(PyArrayObject *v)
{
    PyArrayObject_fields *f = (PyArrayObject_fields *)v;
    if (!PyArray_CHKFLAGS(v, NPY_ARRAY_OWNDATA))
        return PyTuple_Pack(1, Py_None);
    if (f->mem_handler == NULL || PyArray_SIZE(v) != 0) {
        PyErr_SetString(PyExc_TypeError, "seal_view: a view that owns data of its own");
        return NULL;
    }
    npy_intp zero = 0;
    Py_INCREF(f->descr);
    PyObject *holder = PyArray_NewFromDescr(&PyArray_Type, f->descr, 1, &zero, NULL, f->data,
                                            0, NULL);
    if (holder == NULL)
        return NULL;
    PyObject *t = PyTuple_Pack(1, holder);
    Py_DECREF(holder);
    if (t == NULL)
        return NULL;
    PyArrayObject_fields *h = (PyArrayObject_fields *)holder;
    h->mem_handler = f->mem_handler;          /* both empty: NumPy frees one byte either way */
    f->mem_handler = NULL;
    PyArray_ENABLEFLAGS((PyArrayObject *)holder, NPY_ARRAY_OWNDATA);
    PyArray_CLEARFLAGS(v, NPY_ARRAY_OWNDATA);
    return t;
}

/* Make view v read-only for good: clear its WRITEABLE flag and put its base (the device's
 * mapping, whose buffer is writable) in a 1-tuple. The tuple keeps the mapping alive but
 * exports no buffer, so NumPy, which finds a writable buffer at the end of a view's bases
 * before it sets WRITEABLE, refuses to make v (or a view made from it later) writable again.
 * An empty view, which has no base, gets one from view_disown; a view already sealed (its
 * base a tuple) only loses the flag. Keeps any pending exception; if the tuple cannot be
 * made, the flag alone is cleared. */
static void
view_seal(PyArrayObject *v)
{
    PyArray_CLEARFLAGS(v, NPY_ARRAY_WRITEABLE);
    PyArrayObject_fields *f = (PyArrayObject_fields *)v;
    PyObject *base = f->base;
    if (base != NULL && PyTuple_CheckExact(base))
        return;
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    PyObject *t = base == NULL ? view_disown(v) : PyTuple_Pack(1, base);
    if (t == NULL)
        PyErr_Clear();
    else {
        f->base = t;
        Py_XDECREF(base);
    }
    PyErr_Restore(et, ev, etb);
}

/* Seal views[0:n] (None entries skipped): a scope's writable views, when it ends, so that a
 * view kept past its scope refuses writes instead of writing into memory the array may have
 * left. */
static void
views_close(PyObject *const *views, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyArray_Check(views[i]))
            view_seal((PyArrayObject *)views[i]);
}

/* seal_view(v): view_seal for the scopes written in Python; anything but an ndarray is left
 * alone. */
static PyObject *
seal_view(PyObject *module, PyObject *v)
{
    if (PyArray_Check(v))
        view_seal((PyArrayObject *)v);
    Py_RETURN_NONE;
}

/* Manager.scope_opened(key, scope) for the calling thread: the scope recorded under the
 * thread's key, which the manager watches so that a thread that ends inside it is seen at
 * close (the Python scopes go through the same method). */
static int
scope_open(PyObject *m, PyObject *key, PyObject *scope)
{
    PyObject *r = PyObject_CallMethodObjArgs(m, s_scope_opened, key, scope, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* Manager.scope_closed(key), keeping any pending exception. */
static void
scope_close(PyObject *m, PyObject *key)
{
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    PyObject *scopes = PyObject_GetAttr(m, s_scopes);
    PyObject *t = scopes == NULL ? NULL
                                 : PyObject_CallMethodObjArgs(scopes, s_pop, key, Py_None, NULL);
    if (t == NULL)
        PyErr_WriteUnraisable(m);
    Py_XDECREF(t);
    Py_XDECREF(scopes);
    PyErr_Restore(et, ev, etb);
}

/* compute_fast(name, fn, reads, writes, Recipe): ca.compute's common path (see above); (fn's
 * result,), or None when the call is not one it takes (nothing has been done then). */
static PyObject *
compute_fast(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "compute_fast(name, fn, reads, writes, Recipe)");
        return NULL;
    }
    PyObject *name = args[0], *fn = args[1];
    if (!PyCallable_Check(fn))
        Py_RETURN_NONE;
    Operands o;
    PyObject *views[COMPUTE_MAX], *argl = NULL, *partial = NULL, *recipe = NULL, *res = NULL;
    int got = operands_gather(&o, args[2], args[3]), opened = 0, have_views = 0;
    if (got <= 0)
        goto done;
    got = -1;

    /* the recipe: each operand's (id, is_write, dtype, shape, strides, offset) */
    if ((argl = PyList_New(o.n)) == NULL || (partial = PyList_New(0)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < o.n; i++) {
        PyObject *x = o.ops[i];
        if (x == Py_None) {
            PyList_SET_ITEM(argl, i, Py_NewRef(Py_None));
            continue;
        }
        ObjectRecord *obj = (ObjectRecord *)SLOT(x, off_obj);
        int write = i >= o.nr;
        if (write) {
            int c = covers(x, obj);
            if (c < 0) {
                got = 0;
                goto done;
            }
            if (!c && PyList_Append(partial, obj->id) < 0)
                goto done;
        }
        PyObject *a = PyTuple_Pack(6, obj->id, write ? Py_True : Py_False, SLOT(x, off_dtype),
                                   SLOT(x, off_shape), SLOT(x, off_strides),
                                   SLOT(x, off_offset));
        if (a == NULL)
            goto done;
        PyList_SET_ITEM(argl, i, a);
    }
    Py_SETREF(partial, PyList_AsTuple(partial));
    if (partial == NULL)
        goto done;
    PyObject *ra[7] = {name, fn, argl, Py_None, Py_None, Py_None, partial};
    if ((recipe = PyObject_Vectorcall(args[4], ra, 7, NULL)) == NULL)
        goto done;

    if ((got = operands_acquire(&o, module, name, recipe)) <= 0)
        goto done;
    got = -1;
    if (operands_views(&o, views) < 0)
        goto done;
    have_views = 1;
    if (scope_open(o.m, recipe, o.scope) < 0)
        goto done;
    opened = 1;
    PyObject *out = PyObject_Vectorcall(fn, views, o.n, NULL);
    if (out == NULL) {                       /* half written: no recipe describes it */
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        PyObject *msg = PyUnicode_FromFormat("kernel %R raised an exception while writing it",
                                             name);
        PyObject *chain = msg == NULL ? NULL : PyTuple_Pack(1, msg);
        Py_XDECREF(msg);
        if (chain == NULL)
            PyErr_WriteUnraisable(fn);
        else
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o.wobjs); i++)
                set_field(&((ObjectRecord *)PyList_GET_ITEM(o.wobjs, i))->chain, chain);
        Py_XDECREF(chain);
        PyErr_Restore(et, ev, etb);
        goto done;
    }
    res = PyTuple_Pack(1, out);
    Py_DECREF(out);
done:
    if (opened)
        scope_close(o.m, recipe);
    if (have_views) {
        views_close(views + o.nr, o.n - o.nr);
        for (Py_ssize_t i = 0; i < o.n; i++)
            Py_DECREF(views[i]);
    }
    Py_XDECREF(argl);
    Py_XDECREF(partial);
    Py_XDECREF(recipe);
    return operands_done(&o, got, 0, res);
}

/* kernel_enter(key, name, reads, writes): ca.kernel's __enter__ for the common call (no
 * touched; operands of one manager with nothing under way): pins and reports the operands,
 * breaks the lineage of the writes and opens the scope key. Returns (views, (manager, held,
 * write views)) with held the pinned objects, for kernel_exit, or None when not taken
 * (nothing done). */
static PyObject *
kernel_enter(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "kernel_enter(key, name, reads, writes)");
        return NULL;
    }
    Operands o;
    PyObject *views[COMPUTE_MAX], *res = NULL, *list = NULL, *held = NULL, *wviews = NULL;
    int got = operands_gather(&o, args[2], args[3]);
    if (got > 0)
        got = operands_acquire(&o, module, args[1], NULL);
    if (got <= 0)
        goto done;
    if (operands_views(&o, views) < 0)
        goto done;
    if ((list = PyList_New(o.n)) == NULL) {
        for (Py_ssize_t i = 0; i < o.n; i++)
            Py_DECREF(views[i]);
        goto done;
    }
    for (Py_ssize_t i = 0; i < o.n; i++)
        PyList_SET_ITEM(list, i, views[i]);
    if ((held = PyTuple_New(o.n_held)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < o.n_held; i++)
        PyTuple_SET_ITEM(held, i, Py_NewRef(o.held[i]));
    if ((wviews = PyList_GetSlice(list, o.nr, o.n)) == NULL)
        goto done;
    Py_SETREF(wviews, PyList_AsTuple(wviews));
    if (wviews == NULL)
        goto done;
    if (scope_open(o.m, args[0], o.scope) < 0)
        goto done;
    PyObject *exit_args = PyTuple_Pack(3, o.m, held, wviews);
    res = exit_args == NULL ? NULL : PyTuple_Pack(2, list, exit_args);
    Py_XDECREF(exit_args);
    if (res == NULL)
        scope_close(o.m, args[0]);
done:
    Py_XDECREF(list);
    Py_XDECREF(held);
    Py_XDECREF(wviews);
    return operands_done(&o, got, res != NULL, res);
}

/* kernel_exit(key, manager, held, write views): ca.kernel's __exit__ after kernel_enter:
 * makes the write views read-only, closes the scope and releases the pins
 * (Manager.scope_closed and Manager.release). */
static PyObject *
kernel_exit(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyTuple_CheckExact(args[2]) || PyTuple_GET_SIZE(args[2]) > COMPUTE_MAX ||
            !PyTuple_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "kernel_exit(key, manager, held: tuple, write views: tuple)");
        return NULL;
    }
    PyObject *m = args[1], *lock = getf(m, K_MANAGER, M_LOCK, s_lock);
    if (lock == NULL)
        return NULL;
    views_close(&PyTuple_GET_ITEM(args[3], 0), PyTuple_GET_SIZE(args[3]));
    scope_close(m, args[0]);
    Py_ssize_t n = PyTuple_GET_SIZE(args[2]);
    PyObject *held[COMPUTE_MAX];
    for (Py_ssize_t i = 0; i < n; i++)
        held[i] = PyTuple_GET_ITEM(args[2], i);
    release_pins(m, lock, held, n);
    Py_DECREF(lock);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* element_offsets(arrays): each ndarray's first byte in elements (of arrays[0]'s itemsize) from
 * arrays[0]'s, modulo 2**64, as a uint64 array; None when a gap is not a whole number of
 * elements. For kernels that read several arrays through the first one's flat buffer: the
 * addresses without building each array's __array_interface__ (2.5 us apiece on a slow CPU). */
static PyObject *
element_offsets(PyObject *module, PyObject *arrays)
{
    PyObject *seq = PySequence_Fast(arrays, "element_offsets: expected a sequence of "
                                    "numpy.ndarray");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyArray_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "element_offsets: item %zd is a %.100s, not a "
                         "numpy.ndarray", i, Py_TYPE(items[i])->tp_name);
            Py_DECREF(seq);
            return NULL;
        }
    npy_intp dims = n;
    PyObject *out = PyArray_SimpleNew(1, &dims, NPY_UINT64);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    if (n > 0) {
        uint64_t *o = (uint64_t *)PyArray_DATA((PyArrayObject *)out);
        uintptr_t first = (uintptr_t)PyArray_DATA((PyArrayObject *)items[0]);
        intptr_t item = (intptr_t)PyArray_ITEMSIZE((PyArrayObject *)items[0]);
        for (Py_ssize_t i = 0; i < n; i++) {
            intptr_t gap = (intptr_t)((uintptr_t)PyArray_DATA((PyArrayObject *)items[i]) - first);
            if (item <= 0 || gap % item != 0) {
                Py_DECREF(out);
                Py_DECREF(seq);
                Py_RETURN_NONE;
            }
            o[i] = (uint64_t)(gap / item);               /* a negative gap wraps, mod 2**64 */
        }
    }
    Py_DECREF(seq);
    return out;
}

static PyMethodDef records_methods[] = {
    {"element_offsets", (PyCFunction)element_offsets, METH_O,
     "element_offsets(arrays): each ndarray's start in elements from the first's, modulo "
     "2**64 (uint64 array), or None when a gap is not a whole number of elements."},
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(alloc_address, free_address, Region, Object): the native heap's alloc and free "
     "functions and the manager's record classes, for create_fast and drain."},
    {"compute_fast", (PyCFunction)(void (*)(void))compute_fast, METH_FASTCALL,
     "compute_fast(name, fn, reads, writes, Recipe): ca.compute's common path; (fn's result,), "
     "or None when not taken."},
    {"kernel_enter", (PyCFunction)(void (*)(void))kernel_enter, METH_FASTCALL,
     "kernel_enter(key, name, reads, writes): ca.kernel's common __enter__; (views, (manager, "
     "held)), or None when not taken."},
    {"kernel_exit", (PyCFunction)(void (*)(void))kernel_exit, METH_FASTCALL,
     "kernel_exit(key, manager, held, write views): ca.kernel's __exit__ after kernel_enter."},
    {"seal_view", (PyCFunction)seal_view, METH_O,
     "seal_view(v): make a closing scope's writable ndarray view read-only for good."},
    {"free_fast", (PyCFunction)(void (*)(void))free_fast, METH_FASTCALL,
     "free_fast(manager, obj): Manager.free_object's common path; False when not taken."},
    {"create_fast", (PyCFunction)(void (*)(void))create_fast, METH_FASTCALL,
     "create_fast(manager, nbytes): Manager._create_fast."},
    {"drain", (PyCFunction)drain, METH_O, "drain(manager): Manager._drain."},
    {"new_array", (PyCFunction)(void (*)(void))new_array, METH_FASTCALL,
     "new_array(manager, shape, dtype, strides, nbytes): an uninitialised array; None when the "
     "manager is busy."},
    {"fast_into", (PyCFunction)(void (*)(void))fast_into_entry, METH_FASTCALL,
     "fast_into(ufunc, inputs, out): ufunc(*inputs, out=out) in C; None when not taken."},
    {"bind_lru", (PyCFunction)(void (*)(void))bind_lru, METH_FASTCALL,
     "bind_lru(read_use, new_in_fast, forget, write_use, markdirty): LRU's hooks, run in C for "
     "LRU policies, and Manager.markdirty."},
    {"bind_views", (PyCFunction)(void (*)(void))bind_views, METH_FASTCALL,
     "bind_views(CachedArray, ndarray, HEADER, OPEN_SCOPES, record_new, from_ndarray): what "
     "run_ufunc, run_method and getitem need."},
    {"bind_plans", (PyCFunction)(void (*)(void))bind_plans, METH_FASTCALL,
     "bind_plans(PLANS, SHORT_BYTES): what fast_ufunc needs."},
    {"getitem", (PyCFunction)make_getitem, METH_O,
     "getitem(fallback): CachedArray.__getitem__ (basic indexing in C, other keys by "
     "fallback(self, key))."},
    {"array_ufunc", (PyCFunction)make_array_ufunc, METH_O,
     "array_ufunc(fallback): CachedArray.__array_ufunc__ (the commonest calls in C, the rest by "
     "fallback(self, ufunc, method, *inputs, **kwargs))."},
    {"operator", (PyCFunction)(void (*)(void))make_operator, METH_FASTCALL,
     "operator(ufunc, fallback, kind): a CachedArray operator (kind 0 x op y, 1 reflected, 2 "
     "unary) running the commonest calls in C and any other by fallback."},
    {"fast_ufunc", (PyCFunction)(void (*)(void))fast_ufunc, METH_FASTCALL,
     "fast_ufunc(ufunc, inputs): the commonest ufunc calls on CachedArrays, all in C; None when "
     "the call is not one of them."},
    {"run_ufunc", (PyCFunction)(void (*)(void))run_ufunc, METH_FASTCALL,
     "run_ufunc(manager, ufunc, inputs, objs, shape, dtype, strides, nbytes, short): a ufunc "
     "into a new, policy-placed CachedArray (Manager.run's common path); None when the "
     "manager's general path must run it."},
    {"select", (PyCFunction)(void (*)(void))select_entry, METH_FASTCALL | METH_KEYWORDS,
     "select(cond, x, y, *, out): out[i] = x[i] if cond[i] else y[i], branch-free (np.where's "
     "three-argument form; x and y of out's dtype, each of out's size or one element)."},
    {"walk", (PyCFunction)(void (*)(void))ca_walk, METH_FASTCALL,
     "walk(xs, found, containers, kinds, kind_of, slots_of): the annotation walkers' object "
     "walk (cachedarrays.annotations._walk)."},
    {"select_isa", (PyCFunction)select_isa, METH_NOARGS,
     "select_isa(): the instruction set select's loops use: 'avx512', 'avx2' or 'sse2'."},
    {"set_select_isa", (PyCFunction)set_select_isa, METH_O,
     "set_select_isa(name): force select's instruction set (for tests and benchmarks)."},
    {"run_read", (PyCFunction)(void (*)(void))run_read, METH_FASTCALL,
     "run_read(manager, fn, inputs, objs, short): fn(*inputs) on the CachedArrays' views with "
     "objs pinned and reported read (Manager.run's common path, no new array); None when the "
     "manager's general path must run it."},
    {"region", (PyCFunction)(void (*)(void))make_region, METH_FASTCALL,
     "region(cls, device, offset, nbytes, owner, buffer): cls(device, offset, nbytes, owner, "
     "buffer), made without the generic call machinery (the manager's hot path)."},
    {"object", (PyCFunction)(void (*)(void))make_object, METH_FASTCALL,
     "object(cls, manager_ref, obj_id, nbytes, primary, device_name): cls(manager_ref, obj_id, "
     "nbytes, primary, device_name), made without the generic call machinery."},
    {NULL}
};

/* ---- module -------------------------------------------------------------------------------- */

static struct PyModuleDef records_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cachedarrays._records",
    .m_doc = "The manager's per-array records as C types.",
    .m_size = -1,
    .m_methods = records_methods,
};

PyMODINIT_FUNC
PyInit__records(void)
{
    import_array();
    str_closed = PyUnicode_InternFromString("closed");
    str_deferred = PyUnicode_InternFromString("_deferred");
    str_append = PyUnicode_InternFromString("append");
    zero = PyLong_FromLong(0);
    if (!str_closed || !str_deferred || !str_append || !zero || intern_names() < 0)
        return NULL;
    if (PyType_Ready(&RegionRecordType) < 0 || PyType_Ready(&ObjectRecordType) < 0 ||
            state_types_ready() < 0 || PyType_Ready(&OperatorType) < 0 ||
            PyType_Ready(&LockType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&records_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "RegionRecord", (PyObject *)&RegionRecordType) < 0 ||
            PyModule_AddObjectRef(m, "ObjectRecord", (PyObject *)&ObjectRecordType) < 0 ||
            PyModule_AddObjectRef(m, "ManagerRecord", (PyObject *)&ManagerRecordType) < 0 ||
            PyModule_AddObjectRef(m, "TelemetryRecord", (PyObject *)&TelemetryRecordType) < 0 ||
            PyModule_AddObjectRef(m, "DeviceRecord", (PyObject *)&DeviceRecordType) < 0 ||
            PyModule_AddObjectRef(m, "HeapRecord", (PyObject *)&HeapRecordType) < 0 ||
            PyModule_AddObjectRef(m, "LRURecord", (PyObject *)&LRURecordType) < 0 ||
            PyModule_AddObjectRef(m, "ManagerLock", (PyObject *)&LockType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
