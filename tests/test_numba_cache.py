"""Every cached numba kernel of the package has cache files of its own.

numba names a cached kernel's files after its function's qualified name and first line, so
two kernels made from one function (a parallel kernel and its serial twin) would share them,
and whichever compiled first would serve both: the cache copies of the embedding cache ran
on one thread after the tests had compiled their serial twins first.
"""

import importlib
import pkgutil

from numba.core.dispatcher import Dispatcher

# The package's roots: models and policies live in folders of their own.
ROOTS = ("cachedarrays", "cachedarrays.models", "cachedarrays.policies")


def _package_modules():
    names = []
    for root in ROOTS:
        package = importlib.import_module(root)
        names.append(root)
        names += [info.name for info in pkgutil.walk_packages(package.__path__, root + ".")]
    modules = []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except ImportError:          # an optional extra (dask, torch) that is not installed
            continue
    return modules


def test_each_cached_kernel_has_its_own_cache_files():
    seen = {}
    count = 0
    for module in _package_modules():
        for attr, value in list(vars(module).items()):
            if not isinstance(value, Dispatcher) or value._cache is None:
                continue
            files = getattr(value._cache, "_cache_file", None)
            if files is None:           # cache=False: a no-op cache
                continue
            key = (value._cache._cache_path, files._index_name)
            owner = f"{module.__name__}.{attr}"
            if key in seen and seen[key][0] is not value:
                raise AssertionError(f"{owner} and {seen[key][1]} share the cache file "
                                     f"{files._index_name}: compile one from its own function")
            seen.setdefault(key, (value, owner))
            count += 1
    assert count >= 20          # the walk found the package's kernels


def test_a_serial_twin_is_a_kernel_of_its_own():
    from cachedarrays.models.dlrm import _head
    from cachedarrays.models.dlrm import embedding as E
    from cachedarrays.models.dlrm import model as M

    pairs = [(E, "_place_rows"), (E, "_drop_slots"), (E, "_copy_slots"), (M, "_dot_forward"),
             (M, "_dot_backward"), (_head, "_output_layer_backward")]
    for module, name in pairs:
        parallel, serial = getattr(module, name), getattr(module, name + "_serial")
        assert parallel.targetoptions.get("parallel") and not serial.targetoptions.get("parallel")
        assert serial.py_func.__qualname__ == name + "_serial"
        assert serial.py_func.__code__.co_code == parallel.py_func.__code__.co_code
