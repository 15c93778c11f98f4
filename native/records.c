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
#include <structmember.h>

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

static int
region_traverse(RegionRecord *self, visitproc visit, void *arg)
{
    Py_VISIT(self->device);
    Py_VISIT(self->offset);
    Py_VISIT(self->nbytes);
    Py_VISIT(self->owner);
    Py_VISIT(self->dirty);
    Py_VISIT(self->freed);
    Py_VISIT(self->buffer);
    return 0;
}

static int
region_clear(RegionRecord *self)
{
    Py_CLEAR(self->device);
    Py_CLEAR(self->offset);
    Py_CLEAR(self->nbytes);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->dirty);
    Py_CLEAR(self->freed);
    Py_CLEAR(self->buffer);
    return 0;
}

static void
region_dealloc(RegionRecord *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    region_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

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
    .tp_dealloc = (destructor)region_dealloc,
    .tp_traverse = (traverseproc)region_traverse,
    .tp_clear = (inquiry)region_clear,
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
object_traverse(ObjectRecord *self, visitproc visit, void *arg)
{
    Py_VISIT(self->id);
    Py_VISIT(self->nbytes);
    Py_VISIT(self->primary);
    Py_VISIT(self->regions);
    Py_VISIT(self->pins);
    Py_VISIT(self->freed);
    Py_VISIT(self->manager);
    Py_VISIT(self->version);
    Py_VISIT(self->dropped);
    Py_VISIT(self->chain);
    return 0;
}

static int
object_clear(ObjectRecord *self)
{
    Py_CLEAR(self->id);
    Py_CLEAR(self->nbytes);
    Py_CLEAR(self->primary);
    Py_CLEAR(self->regions);
    Py_CLEAR(self->pins);
    Py_CLEAR(self->freed);
    Py_CLEAR(self->manager);
    Py_CLEAR(self->version);
    Py_CLEAR(self->dropped);
    Py_CLEAR(self->chain);
    return 0;
}

static void
object_dealloc(ObjectRecord *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    object_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

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
    .tp_dealloc = (destructor)object_dealloc,
    .tp_traverse = (traverseproc)object_traverse,
    .tp_clear = (inquiry)object_clear,
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

static PyMethodDef records_methods[] = {
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
    if (!str_closed || !str_deferred || !str_append || !zero)
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
