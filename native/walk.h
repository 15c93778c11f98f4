/* The annotation walkers' object walk (compiled into cachedarrays._records; see walk.c). */
#ifndef CA_WALK_H
#define CA_WALK_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* walk(xs, found, containers, kinds, kind_of, slots_of): annotations._walk. */
PyObject *ca_walk(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif
