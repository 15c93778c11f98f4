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
#include <stdint.h>
#include <structmember.h>

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
    int freed = PyObject_IsTrue(self->freed);
    if (freed != 0)
        goto fail_or_done;
    m = PyObject_CallNoArgs(self->manager);          /* the weak reference to the manager */
    if (m == NULL)
        goto fail;
    if (m == Py_None)
        goto done;
    closed = PyObject_GetAttr(m, str_closed);
    if (closed == NULL)
        goto fail;
    int is_closed = PyObject_IsTrue(closed);
    if (is_closed != 0)
        goto fail_or_done;
    deferred = PyObject_GetAttr(m, str_deferred);
    if (deferred == NULL)
        goto fail;
    entry = PyTuple_Pack(3, self->id, self->regions ? self->regions : Py_None,
                         self->primary ? self->primary : Py_None);
    if (entry == NULL)
        goto fail;
    res = PyObject_CallMethodOneArg(deferred, str_append, entry);
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
                *s_objects, *s_by_offset, *s_telemetry, *s_log, *s_allocs, *s_frees, *s_current,
                *s_peak, *s_on_alloc, *s_on_free, *s_try_alloc, *s_free, *s_quick_free,
                *s_popleft, *s_copies, *s_observers, *s_dropped, *s_dependents, *s_debug,
                *s_policy, *s_forget, *s_release, *one;

static int
intern_names(void)
{
#define NAME(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1
    NAME(s_fast, "fast"); NAME(s_heap, "heap"); NAME(s_addr, "_addr");
    NAME(s_last_id, "_last_id"); NAME(s_ids, "_ids"); NAME(s_name, "name"); NAME(s_mm, "_mm");
    NAME(s_ref, "_ref"); NAME(s_objects, "_objects"); NAME(s_by_offset, "_by_offset");
    NAME(s_telemetry, "telemetry"); NAME(s_log, "_log"); NAME(s_allocs, "allocs");
    NAME(s_frees, "frees"); NAME(s_current, "current"); NAME(s_peak, "peak");
    NAME(s_on_alloc, "on_alloc"); NAME(s_on_free, "on_free"); NAME(s_try_alloc, "try_alloc");
    NAME(s_free, "free"); NAME(s_quick_free, "quick_free"); NAME(s_popleft, "popleft");
    NAME(s_copies, "_copies"); NAME(s_observers, "_observers"); NAME(s_dropped, "_dropped");
    NAME(s_dependents, "_dependents"); NAME(s_debug, "_debug"); NAME(s_policy, "policy");
    NAME(s_forget, "forget"); NAME(s_release, "_release");
#undef NAME
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

/* d[key] += delta (delta may be negative); returns the new value (a new reference). */
static PyObject *
add_to_item(PyObject *d, PyObject *key, PyObject *delta, int subtract)
{
    PyObject *old = PyObject_GetItem(d, key);
    if (old == NULL)
        return NULL;
    PyObject *now = subtract ? PyNumber_Subtract(old, delta) : PyNumber_Add(old, delta);
    Py_DECREF(old);
    if (now == NULL || PyObject_SetItem(d, key, now) < 0) {
        Py_XDECREF(now);
        return NULL;
    }
    return now;
}

/* Telemetry.on_alloc / on_free, inlined when no event log is open. */
static int
count(PyObject *m, PyObject *name, PyObject *nbytes, PyObject *oid, int alloc)
{
    int rc = -1;
    PyObject *tel = PyObject_GetAttr(m, s_telemetry), *log = NULL, *d = NULL, *v = NULL,
             *cur = NULL, *peak = NULL, *top = NULL;
    if (tel == NULL || (log = PyObject_GetAttr(tel, s_log)) == NULL)
        goto out;
    if (log != Py_None) {
        v = PyObject_CallMethodObjArgs(tel, alloc ? s_on_alloc : s_on_free, name, nbytes, oid,
                                       NULL);
        rc = v == NULL ? -1 : 0;
        goto out;
    }
    if ((d = PyObject_GetAttr(tel, alloc ? s_allocs : s_frees)) == NULL ||
            (v = add_to_item(d, name, one, 0)) == NULL)
        goto out;
    Py_CLEAR(d);
    if ((d = PyObject_GetAttr(tel, s_current)) == NULL ||
            (cur = add_to_item(d, name, nbytes, !alloc)) == NULL)
        goto out;
    if (alloc) {
        if ((peak = PyObject_GetAttr(tel, s_peak)) == NULL ||
                (top = PyObject_GetItem(peak, name)) == NULL)
            goto out;
        int above = PyObject_RichCompareBool(cur, top, Py_GT);
        if (above < 0 || (above && PyObject_SetItem(peak, name, cur) < 0))
            goto out;
    }
    rc = 0;
out:
    Py_XDECREF(tel); Py_XDECREF(log); Py_XDECREF(d); Py_XDECREF(v); Py_XDECREF(cur);
    Py_XDECREF(peak); Py_XDECREF(top);
    return rc;
}

static void *
heap_handle(PyObject *heap)
{
    PyObject *addr = PyObject_GetAttr(heap, s_addr);
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
    if ((dev = PyObject_GetAttr(m, s_fast)) == NULL || (heap = PyObject_GetAttr(dev, s_heap)) == NULL)
        goto out;
    if (heap == Py_None) {
        result = Py_NewRef(Py_None);
        goto out;
    }
    if ((last = PyObject_GetAttr(m, s_last_id)) == NULL || (owner = PyNumber_Add(last, one)) == NULL)
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
    if ((ids = PyObject_GetAttr(m, s_ids)) == NULL || (oid = PyIter_Next(ids)) == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "the manager's id counter ran out");
        goto out;
    }
    if (PyObject_SetAttr(m, s_last_id, oid) < 0 || (name = PyObject_GetAttr(dev, s_name)) == NULL ||
            (mm = PyObject_GetAttr(dev, s_mm)) == NULL)
        goto out;
    if ((region = ((PyTypeObject *)region_cls)->tp_alloc((PyTypeObject *)region_cls, 0)) == NULL ||
            region_fill((RegionRecord *)region, dev, offset, nbytes, oid, mm) < 0)
        goto out;
    set_field(&((RegionRecord *)region)->dirty, Py_True);
    if ((ref = PyObject_GetAttr(m, s_ref)) == NULL ||
            (obj = ((PyTypeObject *)object_cls)->tp_alloc((PyTypeObject *)object_cls, 0)) == NULL ||
            object_fill((ObjectRecord *)obj, ref, oid, nbytes, region, name) < 0)
        goto out;
    if ((objects = PyObject_GetAttr(m, s_objects)) == NULL || (wr = PyWeakref_NewRef(obj, NULL)) == NULL ||
            PyObject_SetItem(objects, oid, wr) < 0)
        goto out;
    if ((by_offset = PyObject_GetAttr(m, s_by_offset)) == NULL)
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
    PyObject *v = PyObject_GetAttr(o, attr);
    if (v == NULL)
        return -1;
    int t = PyObject_IsTrue(v);
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
    int t = PyObject_IsTrue(r->freed);
    if (t != 0)
        return t < 0 ? NULL : Py_None;
    if ((t = PyObject_IsTrue(r->nbytes)) <= 0)
        return t < 0 ? NULL : Py_None;
    PyObject *busy[] = {s_copies, s_observers, s_dropped, s_dependents, str_closed};
    for (size_t i = 0; i < sizeof busy / sizeof *busy; i++)
        if ((t = attr_true(m, busy[i])) != 0)
            return t < 0 ? NULL : Py_None;
    PyObject *debug = PyObject_GetAttr(m, s_debug);
    if (debug == NULL)
        return NULL;
    Py_DECREF(debug);
    if (debug != Py_None)
        return Py_None;
    PyObject *heap = PyObject_GetAttr(r->device, s_heap);
    if (heap == NULL)
        return NULL;
    PyObject *name = PyObject_GetAttr(r->device, s_name);
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
    if ((by_offset = PyObject_GetAttr(m, s_by_offset)) == NULL ||
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
    if ((objects = PyObject_GetAttr(m, s_objects)) == NULL)
        goto out;
    if (PyDict_Check(objects) && PyDict_DelItem(objects, obj_id) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError))
            goto out;
        PyErr_Clear();
    }
    Py_CLEAR(res);
    if ((policy = PyObject_GetAttr(m, s_policy)) == NULL ||
            (res = PyObject_CallMethodOneArg(policy, s_forget, obj_id)) == NULL)
        goto out;
    rc = 0;
out:
    Py_XDECREF(res); Py_XDECREF(by_offset); Py_XDECREF(blocks); Py_XDECREF(objects);
    Py_XDECREF(policy);
    return rc;
}

/* drain(m): Manager._drain. Entries that do not take the common path go to m._release. */
static PyObject *
drain(PyObject *module, PyObject *m)
{
    PyObject *deferred = PyObject_GetAttr(m, str_deferred);
    if (deferred == NULL)
        return NULL;
    for (;;) {
        Py_ssize_t n = PyObject_Length(deferred);
        if (n <= 0) {
            Py_DECREF(deferred);
            if (n < 0)
                return NULL;
            Py_RETURN_NONE;
        }
        PyObject *entry = PyObject_CallMethodNoArgs(deferred, s_popleft);
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

static PyMethodDef records_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(alloc_address, free_address, Region, Object): the native heap's alloc and free "
     "functions and the manager's record classes, for create_fast and drain."},
    {"create_fast", (PyCFunction)(void (*)(void))create_fast, METH_FASTCALL,
     "create_fast(manager, nbytes): Manager._create_fast."},
    {"drain", (PyCFunction)drain, METH_O, "drain(manager): Manager._drain."},
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
    str_closed = PyUnicode_InternFromString("closed");
    str_deferred = PyUnicode_InternFromString("_deferred");
    str_append = PyUnicode_InternFromString("append");
    zero = PyLong_FromLong(0);
    if (!str_closed || !str_deferred || !str_append || !zero || intern_names() < 0)
        return NULL;
    if (PyType_Ready(&RegionRecordType) < 0 || PyType_Ready(&ObjectRecordType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&records_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "RegionRecord", (PyObject *)&RegionRecordType) < 0 ||
            PyModule_AddObjectRef(m, "ObjectRecord", (PyObject *)&ObjectRecordType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
