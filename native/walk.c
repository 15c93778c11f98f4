/* The annotation walkers' object walk (cachedarrays.annotations._walk), compiled into
 * cachedarrays._records.
 *
 * walk(xs, found, containers, kinds, kind_of, slots_of) visits everything reachable from the
 * items of the sequence xs, each container once, with an explicit stack, in the order the
 * Python definition in the module docstring of annotations._walk gives:
 *
 * - kinds maps a type to its kind (the numbers below, which mirror annotations.py); a type
 *   missing from it is classified by kind_of(type), which also records it there;
 * - slots_of(type) gives the slot descriptors of an object's class;
 * - without containers (None): found[id(a._obj)] = the first CachedArray a met on each object;
 * - with it: found[id(a)] = [a, n] for every CachedArray, n the references to it the walk met,
 *   and containers[id(c)] = [c, n] likewise for every container that holds something to walk.
 *
 * Every object on the stack holds a reference, so nothing the walk is about to visit can be
 * freed under it, whatever the callbacks do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "walk.h"

enum { K_ARRAY, K_LEAF, K_SEQ, K_DICT, K_FUNC, K_CELL, K_SET, K_METHOD, K_PARTIAL, K_SKIP, K_OBJ };

/* ---- a set of addresses (the containers already walked) ---------------------------------- */

typedef struct {
    uintptr_t *slots;       /* 0: empty */
    size_t mask, used;
} AddrSet;

static int
addrset_init(AddrSet *s)
{
    s->mask = 255;
    s->used = 0;
    s->slots = PyMem_Calloc(s->mask + 1, sizeof(uintptr_t));
    if (s->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static size_t
addr_hash(uintptr_t a)
{
    uint64_t h = (uint64_t)a * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 17);
}

/* 1 if a was already in the set, 0 if it was added, -1 on error. */
static int
addrset_add(AddrSet *s, uintptr_t a)
{
    size_t i = addr_hash(a) & s->mask;
    while (s->slots[i]) {
        if (s->slots[i] == a)
            return 1;
        i = (i + 1) & s->mask;
    }
    s->slots[i] = a;
    if (++s->used * 2 > s->mask) {
        size_t size = (s->mask + 1) * 2;
        uintptr_t *old = s->slots, oldsize = s->mask + 1;
        s->slots = PyMem_Calloc(size, sizeof(uintptr_t));
        if (s->slots == NULL) {
            s->slots = old;
            PyErr_NoMemory();
            return -1;
        }
        s->mask = size - 1;
        for (size_t k = 0; k < oldsize; k++) {
            if (old[k]) {
                size_t j = addr_hash(old[k]) & s->mask;
                while (s->slots[j])
                    j = (j + 1) & s->mask;
                s->slots[j] = old[k];
            }
        }
        PyMem_Free(old);
    }
    return 0;
}

/* ---- the stack -------------------------------------------------------------------------- */

typedef struct {
    PyObject **items;       /* each holds a reference */
    Py_ssize_t n, cap;
} Stack;

static int
stack_push(Stack *st, PyObject *x)
{
    if (st->n == st->cap) {
        Py_ssize_t cap = st->cap ? 2 * st->cap : 64;
        PyObject **items = PyMem_Realloc(st->items, (size_t)cap * sizeof(PyObject *));
        if (items == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        st->items = items;
        st->cap = cap;
    }
    Py_INCREF(x);
    st->items[st->n++] = x;
    return 0;
}

static void
stack_clear(Stack *st)
{
    while (st->n)
        Py_DECREF(st->items[--st->n]);
    PyMem_Free(st->items);
    st->items = NULL;
    st->cap = 0;
}

/* ---- the walk --------------------------------------------------------------------------- */

typedef struct {
    PyObject *found, *containers, *kinds, *kind_of, *slots_of;
    AddrSet seen;
    Stack stack;
    PyObject *bare;         /* list of ids of containers holding nothing to walk */
} Walk;

static PyObject *str_obj, *str_dict, *str_keywords, *str_args, *str_func, *str_values;

/* The kind of type t, or -1 on error. */
static int
kind_of(Walk *w, PyTypeObject *t)
{
    PyObject *k = PyDict_GetItemWithError(w->kinds, (PyObject *)t);
    if (k == NULL) {
        if (PyErr_Occurred())
            return -1;
        k = PyObject_CallOneArg(w->kind_of, (PyObject *)t);
        if (k == NULL)
            return -1;
        long v = PyLong_AsLong(k);
        Py_DECREF(k);
        return v == -1 && PyErr_Occurred() ? -1 : (int)v;
    }
    return (int)PyLong_AsLong(k);
}

/* Push y unless it is a leaf (0), or -1 on error. */
static int
push_unless_leaf(Walk *w, PyObject *y)
{
    int k = kind_of(w, Py_TYPE(y));
    if (k < 0)
        return -1;
    return k == K_LEAF ? 0 : stack_push(&w->stack, y);
}

/* d[key] = [x, 1], or its count + 1 if present. */
static int
count_ref(PyObject *d, PyObject *key, PyObject *x)
{
    PyObject *e = PyDict_GetItemWithError(d, key);
    if (e == NULL) {
        if (PyErr_Occurred())
            return -1;
        PyObject *one = PyLong_FromLong(1);
        if (one == NULL)
            return -1;
        PyObject *pair = PyList_New(2);
        if (pair == NULL) {
            Py_DECREF(one);
            return -1;
        }
        Py_INCREF(x);
        PyList_SET_ITEM(pair, 0, x);
        PyList_SET_ITEM(pair, 1, one);
        int r = PyDict_SetItem(d, key, pair);
        Py_DECREF(pair);
        return r;
    }
    if (!PyList_CheckExact(e) || PyList_GET_SIZE(e) != 2) {
        PyErr_SetString(PyExc_TypeError, "walk: a count entry is not a [object, count] list");
        return -1;
    }
    Py_ssize_t count = PyLong_AsSsize_t(PyList_GET_ITEM(e, 1));
    if (count == -1 && PyErr_Occurred())
        return -1;
    PyObject *n = PyLong_FromSsize_t(count + 1);
    if (n == NULL)
        return -1;
    return PyList_SetItem(e, 1, n);
}

/* Count a container met by the walk (containers only), keyed by its address. */
static int
count_container(Walk *w, PyObject *x, PyObject *key)
{
    return w->containers == Py_None ? 0 : count_ref(w->containers, key, x);
}

static int
visit_array(Walk *w, PyObject *x)
{
    if (w->containers == Py_None) {
        PyObject *obj = PyObject_GetAttr(x, str_obj);
        if (obj == NULL)
            return -1;
        PyObject *key = PyLong_FromVoidPtr(obj);
        Py_DECREF(obj);             /* the array keeps its object */
        if (key == NULL)
            return -1;
        int r = PyDict_SetDefault(w->found, key, x) == NULL ? -1 : 0;
        Py_DECREF(key);
        return r;
    }
    PyObject *key = PyLong_FromVoidPtr(x);
    if (key == NULL)
        return -1;
    int r = count_ref(w->found, key, x);
    Py_DECREF(key);
    return r;
}

static int
visit_function(Walk *w, PyObject *x)
{
    PyObject *kwd = PyFunction_GET_KW_DEFAULTS(x);
    if (kwd != NULL && PyObject_IsTrue(kwd) > 0 && stack_push(&w->stack, kwd) < 0)
        return -1;
    PyObject *defaults = PyFunction_GET_DEFAULTS(x);
    if (defaults != NULL && PyObject_IsTrue(defaults) > 0 && stack_push(&w->stack, defaults) < 0)
        return -1;
    PyObject *closure = PyFunction_GET_CLOSURE(x);
    if (closure == NULL || !PyTuple_Check(closure))
        return 0;
    Py_INCREF(closure);
    int r = 0;
    for (Py_ssize_t i = PyTuple_GET_SIZE(closure) - 1; i >= 0 && r == 0; i--) {
        /* A cell is a container of its own (closures may share one): count it, and follow it
         * once, here as when met on the stack. */
        PyObject *cell = PyTuple_GET_ITEM(closure, i);
        PyObject *key = PyLong_FromVoidPtr(cell);
        if (key == NULL) {
            r = -1;
            break;
        }
        r = count_container(w, cell, key);
        Py_DECREF(key);
        if (r < 0)
            break;
        int seen = addrset_add(&w->seen, (uintptr_t)cell);
        if (seen != 0) {
            r = seen < 0 ? -1 : 0;
            continue;
        }
        if (!PyCell_Check(cell))
            continue;
        PyObject *y = PyCell_GET(cell);
        if (y == NULL)                          /* an empty cell */
            continue;
        Py_INCREF(y);
        r = push_unless_leaf(w, y);             /* a captured session, module or flag: skip */
        Py_DECREF(y);
    }
    Py_DECREF(closure);
    return r;
}

/* A list's or tuple's items, or a dict's values, pushed last to first (so the first is
 * walked first); an empty one is noted in bare. */
static int
visit_items(Walk *w, PyObject *x, int kind, PyObject *key)
{
    PyObject *items;
    if (kind == K_DICT)
        items = PyDict_CheckExact(x) ? PyDict_Values(x) : PyObject_CallMethodNoArgs(x, str_values);
    else if (PyList_Check(x))
        items = PyList_GetSlice(x, 0, PyList_GET_SIZE(x));     /* a snapshot */
    else {
        Py_INCREF(x);
        items = x;
    }
    if (items == NULL)
        return -1;
    PyObject *seq = PySequence_Fast(items, "walk: values are not iterable");
    Py_DECREF(items);
    if (seq == NULL)
        return -1;
    Py_ssize_t before = w->stack.n;
    int r = 0;
    for (Py_ssize_t i = PySequence_Fast_GET_SIZE(seq) - 1; i >= 0 && r == 0; i--)
        r = push_unless_leaf(w, PySequence_Fast_GET_ITEM(seq, i));
    Py_DECREF(seq);
    if (r == 0 && w->containers != Py_None && w->stack.n == before)
        r = PyList_Append(w->bare, key);
    return r;
}

static int
push_attr(Walk *w, PyObject *x, PyObject *name)
{
    PyObject *y = PyObject_GetAttr(x, name);
    if (y == NULL)
        return -1;
    int r = stack_push(&w->stack, y);
    Py_DECREF(y);
    return r;
}

/* Instance attributes live in __dict__ or in slots (dataclasses included); a slot is read
 * through its own descriptor, so a property of the same name is not mistaken for it. */
static int
visit_object(Walk *w, PyObject *x, PyTypeObject *t)
{
    if (t->tp_dictoffset) {
        PyObject *d = PyObject_GetAttr(x, str_dict);
        if (d == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return -1;
            PyErr_Clear();
        }
        else {
            int r = PyDict_CheckExact(d) ? stack_push(&w->stack, d) : 0;
            Py_DECREF(d);
            if (r < 0)
                return -1;
        }
    }
    PyObject *slots = PyObject_CallOneArg(w->slots_of, (PyObject *)t);
    if (slots == NULL)
        return -1;
    PyObject *seq = PySequence_Fast(slots, "walk: slots_of must return a sequence");
    Py_DECREF(slots);
    if (seq == NULL)
        return -1;
    int r = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && r == 0; i++) {
        PyObject *descr = PySequence_Fast_GET_ITEM(seq, i);
        descrgetfunc get = Py_TYPE(descr)->tp_descr_get;
        if (get == NULL)
            continue;
        PyObject *y = get(descr, x, (PyObject *)t);
        if (y == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {    /* else: an unset slot */
                r = -1;
                break;
            }
            PyErr_Clear();
            continue;
        }
        r = push_unless_leaf(w, y);             /* a name, a number, None: nothing to walk */
        Py_DECREF(y);
    }
    Py_DECREF(seq);
    return r;
}

static int
visit(Walk *w, PyObject *x)
{
    PyTypeObject *t = Py_TYPE(x);
    int k = kind_of(w, t);
    if (k < 0)
        return -1;
    if (k == K_ARRAY)
        return visit_array(w, x);
    if (k == K_LEAF)
        return 0;
    PyObject *key = PyLong_FromVoidPtr(x);
    if (key == NULL)
        return -1;
    int r = count_container(w, x, key);
    if (r == 0) {
        int seen = addrset_add(&w->seen, (uintptr_t)x);
        if (seen != 0)
            r = seen < 0 ? -1 : 0;
        else
            switch (k) {
            case K_FUNC:
                r = visit_function(w, x);
                break;
            case K_SEQ:
            case K_DICT:
                r = visit_items(w, x, k, key);
                break;
            case K_CELL: {
                PyObject *y = PyCell_Check(x) ? PyCell_GET(x) : NULL;
                r = y == NULL ? 0 : stack_push(&w->stack, y);
                break;
            }
            case K_SET: {
                PyObject *it = PyObject_GetIter(x);
                if (it == NULL) {
                    r = -1;
                    break;
                }
                PyObject *y;
                while (r == 0 && (y = PyIter_Next(it)) != NULL) {
                    r = stack_push(&w->stack, y);
                    Py_DECREF(y);
                }
                Py_DECREF(it);
                if (r == 0 && PyErr_Occurred())
                    r = -1;
                break;
            }
            case K_METHOD:
                r = stack_push(&w->stack, PyMethod_GET_FUNCTION(x));
                if (r == 0)
                    r = stack_push(&w->stack, PyMethod_GET_SELF(x));
                break;
            case K_PARTIAL:
                r = push_attr(w, x, str_keywords);
                if (r == 0)
                    r = push_attr(w, x, str_args);
                if (r == 0)
                    r = push_attr(w, x, str_func);
                break;
            case K_SKIP:
                break;
            default:
                r = visit_object(w, x, t);
            }
    }
    Py_DECREF(key);
    return r;
}

static int
intern_names(void)
{
    if (str_obj != NULL)
        return 0;
    str_obj = PyUnicode_InternFromString("_obj");
    str_dict = PyUnicode_InternFromString("__dict__");
    str_keywords = PyUnicode_InternFromString("keywords");
    str_args = PyUnicode_InternFromString("args");
    str_func = PyUnicode_InternFromString("func");
    str_values = PyUnicode_InternFromString("values");
    return str_obj && str_dict && str_keywords && str_args && str_func && str_values ? 0 : -1;
}

PyObject *
ca_walk(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "walk(xs, found, containers, kinds, kind_of, slots_of) takes 6 arguments");
        return NULL;
    }
    Walk w = {0};
    w.found = args[1];
    w.containers = args[2];
    w.kinds = args[3];
    w.kind_of = args[4];
    w.slots_of = args[5];
    if (!PyDict_Check(w.found) || !(w.containers == Py_None || PyDict_Check(w.containers)) ||
            !PyDict_Check(w.kinds) || !PyCallable_Check(w.kind_of) ||
            !PyCallable_Check(w.slots_of)) {
        PyErr_SetString(PyExc_TypeError, "walk: found and kinds must be dicts, containers a dict "
                        "or None, kind_of and slots_of callables");
        return NULL;
    }
    if (intern_names() < 0)
        return NULL;
    PyObject *xs = PySequence_Fast(args[0], "walk: xs must be a sequence");
    if (xs == NULL)
        return NULL;
    w.bare = PyList_New(0);
    int r = w.bare == NULL ? -1 : addrset_init(&w.seen);
    for (Py_ssize_t i = PySequence_Fast_GET_SIZE(xs) - 1; i >= 0 && r == 0; i--)
        r = stack_push(&w.stack, PySequence_Fast_GET_ITEM(xs, i));
    Py_DECREF(xs);
    while (r == 0 && w.stack.n) {
        PyObject *x = w.stack.items[--w.stack.n];       /* the stack's reference, now ours */
        r = visit(&w, x);
        Py_DECREF(x);
    }
    if (r == 0 && w.containers != Py_None) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(w.bare) && r == 0; i++)
            r = PyDict_DelItem(w.containers, PyList_GET_ITEM(w.bare, i));
    }
    stack_clear(&w.stack);
    PyMem_Free(w.seen.slots);
    Py_XDECREF(w.bare);
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}
