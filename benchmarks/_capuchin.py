"""Capuchin against no management, LRU swapping, sqrt(n) checkpointing and swap-only on the
saved CNN traces (modelled): the largest batch that trains in a fixed fast budget (the paper's
Table 2) and the modelled step time at batches beyond the unmanaged maximum.

Every policy runs kernels in fast memory (the GPU rule): a batch trains when the replay of its
trace (``BatchFamily.at(batch)``: sizes and kernel times linear in the batch, from the traces
at batch 8 and 16) ends without OutOfMemoryError. The fast budget is the footprint of batch 16.
Planned policies are given the batch's own trace as profile (planned from its step 1); the plan
acts from the first step (whose new objects are the ``init:`` ones of the same sites). Each
function returns (printable lines, dict of figures); the numbers are a pure function of the
traces.
"""

import importlib.util
import os
import time

import cachedarrays as ca
from cachedarrays.policies.capuchin import Capuchin, Checkpointing, SwapOnly
from cachedarrays.sizes import format_size

_HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ("resnet50", "vgg16", "densenet121")
BUDGET_BATCH = 16                 # the fast budget: this batch's footprint
PLANNED_STEPS = 3                 # replayed steps of a planned policy (plan from step 1)
GROWTH = (1.2, 2.0)               # step times at these multiples of the unmanaged maximum
TARGET_VS_NONE, TARGET_VS_NEXT = 4.0, 1.5     # Capuchin's max batch over the others' (paper:
#                                               5.49x no management, 1.84x the next best)
KIF = {"kernels_in_fast": True}
FASTER = 20                       # kernels this many times faster than recorded (a GPU's speed)
FASTER_BATCHES = (32, 64)


def _capuchin(batch, trace):
    return Capuchin(profile=trace)


def _swap_only(batch, trace):
    return SwapOnly(profile=trace)


def _checkpoint(batch, trace):
    return Checkpointing(profile=trace)


# (label, policy for max_batch, policy_options, steps replayed)
POLICIES = (("no management", "fast-only", KIF, None),
            ("LRU swapping", "lru", KIF, None),
            ("sqrt(n) checkpointing", _checkpoint, None, PLANNED_STEPS),
            ("swap-only", _swap_only, None, PLANNED_STEPS),
            ("Capuchin", _capuchin, None, PLANNED_STEPS))


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_capuchin_bench{name}",
                                                  os.path.join(_HERE, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_capacity = _load("_capacity")


def families(models=MODELS, folder=None, log=print):
    """{model: BatchFamily} from the saved traces (recorded when missing or mismatched)."""
    bench = _load("policies")
    folder = folder or bench.DEFAULT_TRACES
    return {n: bench.family(n, folder, log) for n in models}


def max_batches(fams, budget_batch=BUDGET_BATCH):
    """The largest batch of each model under each policy in the footprint of budget_batch.
    Figures: {model: {"fast": bytes, "batch": {label: max batch}, "error": {label: message at
    the smallest failing batch}}}."""
    lines, fig = [], {}
    lines.append(f"Largest batch that trains in the batch-{budget_batch} footprint "
                 f"(kernels in fast memory; modelled replays)")
    labels = [p[0] for p in POLICIES]
    lines.append(f"  {'model':<12} {'fast':>10} " + " ".join(f"{lab:>22}" for lab in labels))
    for name, fam in fams.items():
        fast = fam.footprint(budget_batch)
        row, errors = {}, {}
        for label, policy, options, steps in POLICIES:
            b, info = _capacity.max_batch(fam, policy, fast, policy_options=options, steps=steps)
            row[label], errors[label] = b, info["error"]
        fig[name] = {"fast": fast, "batch": row, "error": errors,
                     "persistent": persistent_bytes(fam.at(budget_batch, steps=2))}
        lines.append(f"  {name:<12} {format_size(fast):>10} " +
                     " ".join(f"{row[lab]:>22}" for lab in labels))
    lines.append("")
    lines.append("  Weights, gradients and optimizer state (alive across steps): " +
                 ", ".join(f"{n} {format_size(f['persistent'])} "
                           f"({f['persistent'] / f['fast']:.0%} of the budget)"
                           for n, f in fig.items()) + ".")
    lines.append("  Planned policies get the batch's trace as profile (the static graph), so their "
                 "plans act from the first step; checkpointing never swaps, so it is bounded by "
                 "the weights plus the checkpoints and one segment's activations.")
    for name, f in fig.items():
        lines += verdict(name, f)
    return lines, fig


def persistent_bytes(trace, step=1):
    """Bytes of the objects made before a step and alive after it."""
    from cachedarrays.stepprofile import StepProfile
    p = StepProfile.of(trace, step)
    return sum(nb for sid, nb in p.objects.items()
               if sid not in p.alloc_at and sid not in p.free_at)


def verdict(name, f):
    """Lines: Capuchin's max batch over no management and over the next best, and why a
    target is missed."""
    row = f["batch"]
    cap, none = row["Capuchin"], row["no management"]
    others = {k: v for k, v in row.items() if k != "Capuchin"}
    nxt_label = max(others, key=lambda k: (others[k], k))
    nxt = others[nxt_label]
    vs_none = cap / none if none else float("inf")
    vs_next = cap / nxt if nxt else float("inf")
    ok_none, ok_next = vs_none >= TARGET_VS_NONE, vs_next >= TARGET_VS_NEXT
    out = [f"  {name}: Capuchin {cap} = {vs_none:.2f}x no management "
           f"({'PASS' if ok_none else 'FAIL'} >= {TARGET_VS_NONE}x), {vs_next:.2f}x the next "
           f"best, {nxt_label} {nxt} ({'PASS' if ok_next else 'FAIL'} >= {TARGET_VS_NEXT}x)"]
    if not (ok_none and ok_next):
        err = f["error"].get("Capuchin")
        if err:
            out.append(f"    Capuchin's first failing batch: {err}")
        if not ok_next and nxt >= cap:
            out.append(f"    {nxt_label} reaches the same limit: what stops both is a single "
                       "kernel's operands (or the objects no plan can move out) outgrowing "
                       "fast memory, not the bytes the other kernels keep")
        elif not ok_next:
            out.append(f"    {nxt_label} fails first at: {f['error'].get(nxt_label)}")
    return out


def step_times(fams, batches, growth=GROWTH, budget_batch=BUDGET_BATCH, extra=None):
    """Modelled last-step time over ideal (fast-only time of that batch) per policy at
    growth x the unmanaged maximum batch (and at extra[model], when given). batches: {model:
    max batch with no management}. Figures: {model: {batch: {label: ratio or None (does not
    train)}}}."""
    import cachedarrays as ca
    lines, fig = [], {}
    lines.append("Modelled step time over ideal (fast-only time at that batch) beyond the "
                 "unmanaged maximum and at the largest batch all swapping policies train; "
                 "'-' = does not train")
    labels = [p[0] for p in POLICIES[1:]]
    lines.append(f"  {'model':<12} {'batch':>14} " + " ".join(f"{lab:>22}" for lab in labels))
    for name, fam in fams.items():
        fast = fam.footprint(budget_batch)
        base = batches[name]
        fig[name] = {}
        points = [(max(1, round(base * g)), f"{g:g}x") for g in growth]
        if extra and extra.get(name):
            points.append((extra[name], "swap max"))
        for b, tag in points:
            row = {}
            for label, policy, options, steps in POLICIES[1:]:
                try:
                    row[label] = _capacity.step_ratio(fam, b, policy, fast,
                                                      policy_options=options, steps=steps)
                except ca.OutOfMemoryError:
                    row[label] = None
            fig[name][b] = row
            cells = " ".join(f"{'-' if row[lab] is None else f'{row[lab]:.2f}x':>22}"
                             for lab in labels)
            lines.append(f"  {name:<12} {f'{b} ({tag})':>14} {cells}")
    return lines, fig


def faster_kernels(fams, speed=FASTER, batches=FASTER_BATCHES, budget_batch=BUDGET_BATCH):
    """Swap-only against Capuchin with kernels `speed` times faster than recorded (the same
    links): swaps no longer hide, and recomputation pays. (lines, {model: {batch: row}})."""
    lines = [f"Kernels {speed}x faster than recorded (a GPU's speed against the same links; "
             "modelled step time over ideal, recomputes chosen):",
             f"  {'model':<12} {'batch':>6} {'swap-only':>10} {'Capuchin':>10} {'recomputes':>11}"
             f" {'speedup':>8}"]
    fig = {}
    for name, fam in fams.items():
        fast = fam.footprint(budget_batch)
        fig[name] = {}
        for b in batches:
            t = fam.at(b, steps=PLANNED_STEPS).copy()
            t.times = [x / speed for x in t.times]
            row = {}
            for lab, cls in (("swap-only", SwapOnly), ("Capuchin", Capuchin)):
                pol = cls(profile=t)
                try:
                    row[lab] = ca.replay(t, pol, fast=fast, profile="optane").ratio
                except ca.OutOfMemoryError:
                    row[lab] = float("nan")
                row[lab + " recomputes"] = pol.info.get("recomputes", 0)
            fig[name][b] = row
            lines.append(f"  {name:<12} {b:>6} {row['swap-only']:>9.3f}x {row['Capuchin']:>9.3f}x"
                         f" {row['Capuchin recomputes']:>11} "
                         f"{row['swap-only'] / row['Capuchin']:>7.3f}x")
    return lines, fig


def main(models=MODELS, folder=None, out=print):
    fams = families(models, folder, log=out)
    t0 = time.perf_counter()
    lines, table = max_batches(fams)
    for line in lines:
        out(line)
    swap_max = {n: min(f["batch"][k] for k in ("LRU swapping", "swap-only", "Capuchin"))
                for n, f in table.items()}
    lines, times = step_times(fams, {n: f["batch"]["no management"] for n, f in table.items()},
                              extra=swap_max)
    for line in lines:
        out(line)
    lines, faster = faster_kernels(fams)
    for line in lines:
        out(line)
    out(f"[wall] max batch and step times in {time.perf_counter() - t0:.1f} s")
    return {"max_batch": table, "step_time": times, "faster_kernels": faster}


if __name__ == "__main__":
    main()
