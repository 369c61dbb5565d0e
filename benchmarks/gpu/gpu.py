"""One prepared script for a lent GPU machine (issue #14 item 3): correctness, training
step, forward and serving throughput of embedmesh on the default device, against torch
on the same GPU in the same run.

    bash benchmarks/gpu/gpu_run.sh --smoke --variants xla,pallas   # 1st call: ~3 min
    bash benchmarks/gpu/gpu_run.sh --skip-correctness              # 2nd call: ~6 min
    python benchmarks/gpu/gpu.py --out DIR --smoke --allow-cpu     # tiny sizes, CPU (CI)

(docs/gpu.md gives the device tool's calls.) Writes DIR/gpu.json (every figure) and
DIR/gpu.md (the summary table, also printed last), both rewritten whenever a child
saves a section or a correctness step and when it ends, so a call cut short still
returns what ran (marked incomplete). Exit status: 0 all well; 1 a correctness case
failed (or errored); 2 no case failed but another section errored or a variant's
correctness did not run in full (budget); 3 the pre-flight found no GPU (JAX's
default backend is not "gpu"; `--allow-cpu` runs anyway): nothing else ran. Sections
skipped by the budget are listed, never cut silently.

Each part runs in its own child process (`--worker ...`: the pre-flight, correctness
per variant, scale per variant, torch), so each system starts with the whole device and
its state is freed on exit (and before, in-process: `gc.collect()`,
`torch.cuda.empty_cache()`, jax `.delete()` and `jax.clear_caches()`). torch is
imported lazily, in its child only: where it is missing (CPU CI) its figures say "torch
not installed". Order (`plan`): correctness of each kernel variant (`xla`, `pallas`),
the first one's scale run, torch, the other kernel variants' scale runs, and the
`reference` variant (correctness, scale) last; each child is skipped when the budget
left is less than the previous one of its kind took, so the budget cuts from the end.
The embedmesh children run once per kernel variant with `EMBEDMESH_GPU_KERNELS=<variant>`
in their environment (`xla` default, `pallas`, `reference`); this script only sets the
variable, it never reads what it selects.

(a) correctness, per variant: for each of SGD, Adagrad, AdagradMomentum, Adam (lazy),
    Adam (non-lazy) and FTRL, 3 tables (sum / mean / sqrtn combiners, dims 8 / 16 / 20,
    vocabularies 101 / 53 / 29) with that optimizer, two ragged features each (one
    weighted), ids with many repeats and empty rows, fresh random inputs and activation
    gradients each step; all 18 tables in one embedding (one program per variant: half
    the compile time of one per optimizer; if it raises, one per optimizer): the lookup
    activations at each of 3 steps and the tables and slots after them, on the default
    device, against the float64 numpy reference (`tests/support/training_reference.py` for
    lookups and row gradients, `tests/device/test_optimizers.ref_update` for the optimizer
    math; if that module cannot be imported, against the same run of embedmesh on the
    CPU backend, and the output says so); then `serving_embedding_lookup` on the
    read-back (exported) tables, host path (its reused output buffers poisoned with NaN
    by a call on NaN tables first) and `jax.jit` on the device, against the float64
    reference. Relative error ||out - ref|| / ||ref|| < 1e-5 passes, NaN never.
(b) training step at scale: T tables x V rows x D float32 stacked (T*V*D < 2**31),
    batch B, ragged ids (lengths uniform 10..30, mean 20) drawn Zipf(1.05) over
    permuted ranks, sum combiner, Adagrad(lr 0.01, initial accumulator 0.1), loss
    sum_t ||act_t - R_t||^2 / 2 with a fixed random R_t [B, D] (both systems; its
    gradient act_t - R_t reads the lookup, as a real model's does). K batches are
    preprocessed before timing and rotated; host preprocessing (`enqueue`: host work +
    transfer) is timed apart: a real per-batch cost, not in the device figures.
    Timed: forward (`jax.jit(core.lookup)`), backward+update (`core.apply_gradients`
    with fixed activation gradients), and the full step (one jit: lookup, loss
    gradient, update); warm-up then the median of repeats, `jax.block_until_ready`.
    torch: T `nn.EmbeddingBag(V, D, mode="sum", sparse=True)` + `torch.optim.Adagrad`
    (same lr and initial accumulator), same ids as input+offsets, forward + backward +
    step; its forward is timed under `no_grad` (backward+update = step - forward). Also
    torch with dense gradients (`sparse=False`) and Adagrad `fused=True` (or foreach):
    the same result (untouched rows get a zero gradient, which Adagrad leaves as they
    are) but O(table) work per step.
    Bytes each pass must touch (float32 rows of 4*D bytes, ids counted as 4 bytes
    (torch reads int64 ids), metadata such as offsets or CSR pairs not counted;
    N = ids in the batch, U = distinct (table, id) rows in the batch, S = slots):
      forward          = 4*N + U*4D + T*B*4D    (ids, unique rows read, outputs written)
      backward+update  = T*B*4D + 2*U*4D*(1+S)  (act grads read; rows + slots read, written)
      step             = forward + backward+update
    divided by the pass time, against the device-to-device copy bandwidth measured
    first (bytes read + written / time of a large copy: torch `dst.copy_(src)` and jax
    `x + 1`).
(c) forward-only and serving throughput (ids/s): embedmesh's training lookup (above),
    `serving_embedding_lookup` under `jax.jit` on device tables, and torch's
    `F.embedding_bag(mode="sum")` under `no_grad` on the same ids.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path[:1]:  # the repository's embedmesh, installed or not
    sys.path.insert(0, ROOT)

TOL = 1e-5
LR = 0.01
INITIAL_ACC = 0.1
ZIPF_A = 1.05

FULL = dict(
    mode="full",
    tables=8,
    vocab=2_000_000,
    dim=128,
    batch=65_536,
    min_len=10,
    max_len=30,
    num_batches=4,
    warmup=3,
    reps=10,
    copy_bytes=4 << 30,
    copy_reps=20,
    # the second device call (docs/gpu.md): its timeout_s 420 leaves the kill grace,
    # the report and a margin; the first call (--smoke) has checked correctness already
    budget_s=330.0,
    variants="xla,pallas,reference",
    # seconds a child needs, roughly (start-up included): a child is skipped when the
    # budget left is smaller; a running child is killed at its cap (partial results kept)
    est_s=dict(correctness=75, torch=110, jax_scale=110),
    est_scale=1.0,  # of the sections' estimates inside a child
    cap_s=dict(preflight=120, correctness=150, torch=200, jax_scale=200),
    kill_grace_s=15,  # a child still running this long after its deadline is killed
)
SMOKE = dict(
    FULL,
    mode="smoke",
    tables=2,
    vocab=1000,
    dim=16,
    batch=64,
    num_batches=2,
    warmup=1,
    reps=3,
    copy_bytes=16 << 20,
    copy_reps=3,
    budget_s=180.0,  # the first device call (timeout_s 240): correctness of xla and pallas
    variants="xla",
    est_s=dict(correctness=10, torch=5, jax_scale=10),
    est_scale=0.2,
    cap_s=dict(preflight=120, correctness=120, torch=120, jax_scale=120),
)


# ---------------------------------------------------------------------------
# Shared helpers


def rates_of(mean_ids, touched):
    """`rates(med, what)`: the figures of a step of median `med` seconds that touches
    `touched[what]` bytes and looks up `mean_ids` ids."""

    def rates(med, what):
        return dict(
            ms=med * 1e3,
            ids_per_s=mean_ids / med,
            bytes_touched=touched[what],
            touched_GBps=touched[what] / med / 1e9,
        )

    return rates


def median(xs):
    return statistics.median(xs) if xs else None


def rel_err(got, want) -> float:
    """||got - want|| / ||want|| in float64; NaN for non-finite output or a zero
    reference (a check on zeros proves nothing); inf for a shape mismatch."""
    import numpy as np

    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        return math.inf
    den = float(np.linalg.norm(want))
    if not np.all(np.isfinite(got)) or den == 0.0:
        return math.nan
    return float(np.linalg.norm(got - want)) / den


def passes(err) -> bool:
    return err is not None and err < TOL  # NaN compares False


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


class Worker:
    """A child's results, written to its part file after every section."""

    def __init__(self, path, deadline, est_scale=1.0):
        self.path, self.deadline, self.est_scale = path, deadline, est_scale
        self.data = {"sections": {}, "skipped": [], "errors": []}

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self):
        write_json(self.path, self.data)

    def section(self, name, est_s, fn, *args):
        """Run `fn(*args)` -> dict unless less than `est_s` (full-size) seconds are left."""
        est_s *= self.est_scale
        if self.left() < est_s:
            self.data["skipped"].append(
                f"{name}: skipped, {self.left():.0f} s left of the budget, needs ~{est_s:.0f} s"
            )
            self.save()
            return None
        t = time.perf_counter()
        print(f"[{name}] start, {self.left():.0f} s left", flush=True)
        try:
            out = fn(*args)
        except Exception as e:  # noqa: BLE001 - report and go on with the next section
            print(f"[{name}] {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
            self.data["errors"].append(f"{name}: {type(e).__name__}: {e}")
            self.data.setdefault("tracebacks", {})[name] = traceback.format_exc()[-4000:]
            self.save()
            return None
        out = dict(out or {}, wall_s=round(time.perf_counter() - t, 2))
        print(f"[{name}] done in {out['wall_s']} s", flush=True)
        self.data["sections"][name] = out
        self.save()
        return out


def timed_median(fn, warmup, reps):
    """(median seconds, all samples) of `fn()` (which must block) after `warmup` calls."""
    for i in range(warmup):
        fn(i)
    ts = []
    for i in range(reps):
        t = time.perf_counter()
        fn(warmup + i)
        ts.append(time.perf_counter() - t)
    return median(ts), ts


# ---------------------------------------------------------------------------
# The scale workload's ids (made once by the parent, shared by every child)


def make_batches(cfg, path):
    """K batches of T features: ragged ids (int32 values, int64 lengths), Zipf over
    permuted ranks; saved to `path` (.npz). Returns per-batch counts."""
    import numpy as np

    T, V, B = cfg["tables"], cfg["vocab"], cfg["batch"]
    rng = np.random.default_rng(14)
    cdf = np.cumsum(np.arange(1, V + 1, dtype=np.float64) ** -ZIPF_A)
    cdf /= cdf[-1]
    perms = [rng.permutation(V).astype(np.int32) for _ in range(T)]
    arrays, meta = {}, []
    for k in range(cfg["num_batches"]):
        n_ids = n_unique = 0
        for t in range(T):
            lengths = rng.integers(cfg["min_len"], cfg["max_len"] + 1, B).astype(np.int64)
            r = np.minimum(np.searchsorted(cdf, rng.random(int(lengths.sum()))), V - 1)
            vals = perms[t][r]
            arrays[f"v{k}_{t}"], arrays[f"l{k}_{t}"] = vals, lengths
            n_ids += vals.size
            n_unique += int(np.unique(vals).size)
        meta.append(dict(ids=n_ids, unique_rows=n_unique))
    np.savez(path, **arrays)
    return meta


def load_batches(cfg):
    import numpy as np

    z = np.load(cfg["batches_path"])
    return [
        [(z[f"v{k}_{t}"], z[f"l{k}_{t}"]) for t in range(cfg["tables"])]
        for k in range(cfg["num_batches"])
    ]


def bytes_touched(cfg, ids, unique_rows, num_slots):
    """The minimal bytes of each pass (see the module docstring)."""
    row = 4 * cfg["dim"]
    outputs = cfg["tables"] * cfg["batch"] * row
    fwd = 4 * ids + unique_rows * row + outputs
    bwd = outputs + 2 * unique_rows * row * (1 + num_slots)
    return dict(forward=fwd, backward_update=bwd, step=fwd + bwd)


# ---------------------------------------------------------------------------
# (a) correctness


OPTIMIZER_CASES = [
    ("SGD", "SGD", dict(learning_rate=0.2)),
    ("Adagrad", "Adagrad", dict(learning_rate=0.3, initial_accumulator_value=0.2)),
    (
        "AdagradMomentum",
        "AdagradMomentum",
        dict(
            learning_rate=0.2,
            momentum=0.5,
            use_nesterov=True,
            exponent=3.0,
            beta2=0.9,
            epsilon=1e-3,
        ),
    ),
    ("Adam(lazy)", "Adam", dict(learning_rate=0.05, beta_1=0.8, beta_2=0.9, epsilon=1e-3)),
    ("Adam(non-lazy)", "Adam", dict(learning_rate=0.05, lazy_adam=False, beta_1=0.5)),
    (
        "FTRL",
        "FTRL",
        dict(
            learning_rate=0.5,
            l1_regularization_strength=0.01,
            l2_regularization_strength=0.1,
            beta=0.1,
        ),
    ),
]
COMBINERS = ("sum", "mean", "sqrtn")
CASE_TABLES = {"sum": (101, 8), "mean": (53, 16), "sqrtn": (29, 20)}  # vocab, dim
CASE_BATCH = 16
CASE_STEPS = 3


def _case_batch(rng, feats):
    import numpy as np

    import embedmesh as em

    inputs, weights = {}, {}
    for name, f in feats.items():
        V = f.table.vocabulary_size
        lengths = rng.integers(0, 7, CASE_BATCH)  # empty rows included
        n = int(lengths.sum())
        hot = rng.integers(0, 4, n)  # many repeats, within and across samples
        ids = np.where(rng.random(n) < 0.5, hot, rng.integers(0, V, n)).astype(np.int64)
        r = em.RaggedTensor.from_row_lengths(ids, lengths)
        inputs[name] = r
        weights[name] = (
            em.RaggedTensor(rng.uniform(0.1, 2.0, n).astype(np.float32), r.row_splits)
            if name.endswith("_w")
            else None
        )
    return inputs, weights


def _references():
    """(tests/support/training_reference, tests/device/test_optimizers or None, what the
    checks compare against): without test_optimizers the tables and slots are compared
    with the same run of embedmesh on the CPU backend."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
    sys.path.insert(0, os.path.join(ROOT, "tests", "device"))  # test_optimizers
    import training_reference as ref

    try:
        import test_optimizers as topt

        ref_kind = (
            "float64 numpy (tests/support/training_reference.py, "
            "tests/device/test_optimizers.ref_update)"
        )
    except Exception as e:  # noqa: BLE001 - any import failure: use the CPU backend instead
        topt = None
        ref_kind = (
            f"lookups: float64 numpy (tests/support/training_reference.py); tables and slots: the "
            f"same run of embedmesh on the CPU backend (test_optimizers not importable: "
            f"{type(e).__name__}: {e})"
        )
    return ref, topt, ref_kind


def _f64_of(emb):
    """(tables, slots) of `emb` by table name, as float64 numpy."""
    import numpy as np

    v = emb.variables
    return (
        {t.name: np.asarray(d["parameters"], np.float64) for t, d in v.items()},
        {
            t.name: {k: np.asarray(a, np.float64) for k, a in d.items() if k != "parameters"}
            for t, d in v.items()
        },
    )


class _Checks:
    """What every correctness group shares: the child, the references, the meshes (a CPU
    one where the CPU run is the reference) and the cases published so far."""

    def __init__(self, w: Worker, ref, topt, dev, mesh, cpu_mesh, cases: list):
        self.w, self.ref, self.topt, self.cases = w, ref, topt, cases
        self.dev, self.mesh, self.cpu_mesh = dev, mesh, cpu_mesh


class _Group:
    """One embedding holding a table per (optimizer case, combiner), each table with
    its own optimizer: one program per variant, every optimizer's update in it. `check`
    runs it: the lookups of each step, the tables and slots after them, then serving."""

    KEYS = ("lookup", "table", "slots", "serving_host", "serving_device")

    def __init__(self, checks: _Checks, group, seed):
        import numpy as np

        import embedmesh as em
        from embedmesh.host.preprocess import Capacity

        self.checks = checks
        self.tables, self.feats, self.key_of, self.opt_of = {}, {}, {}, {}
        for i, label, cls_name, kwargs in group:
            opt = getattr(em, cls_name)(**kwargs)
            hp = {f.name: getattr(opt, f.name) for f in dataclasses.fields(opt)}
            hp["lr_spec"] = ("const", kwargs["learning_rate"])
            for c, (v, d) in CASE_TABLES.items():
                name = f"t{i}_{c}"
                self.tables[name] = em.TableConfig(v, d, combiner=c, name=name, optimizer=opt)
                self.opt_of[name] = (cls_name, hp, opt)
                self.key_of[name] = (label, c)
                for kind in ("w", "u"):  # weighted, unweighted
                    self.feats[f"f{i}_{c}_{kind}"] = em.FeatureConfig(self.tables[name])
        self.rng = np.random.default_rng(seed)
        make = lambda m: em.MeshEmbedding(
            self.feats, mesh=m, capacities=Capacity(1024, 512), seed=seed
        )
        self.emb = make(checks.mesh)
        self.emb.build()
        self.cpu_emb = None
        if checks.cpu_mesh is not None:
            self.cpu_emb = make(checks.cpu_mesh)
            self.cpu_emb.build()
        self.ref_tabs, self.ref_slots = _f64_of(self.emb)
        self.res = {k: dict.fromkeys(self.KEYS) for k in self.key_of.values()}
        self.first = len(checks.cases)

    def check(self):
        try:
            for step in range(CASE_STEPS):
                self.step(step)
                self.publish(f"lookups of {step + 1} of {CASE_STEPS} steps checked")
            got_tabs, got_slots = _f64_of(self.emb)
            for tname in self.tables:
                self.worst(tname, "table", rel_err(got_tabs[tname], self.ref_tabs[tname]))
                for k in self.ref_slots[tname]:
                    want = self.ref_slots[tname][k]
                    self.worst(tname, "slots", rel_err(got_slots[tname][k], want))
            self.publish("serving lookups not checked")
            self.serving()
        finally:
            for e in (self.emb, self.cpu_emb):
                if e is not None:
                    _free_jax(e.state.tables, e.state.slots)
        self.publish()

    def publish(self, incomplete=None):
        """The group's cases as measured so far, saved (a child killed at its cap
        keeps them): `passed` is None while `incomplete` says what is missing."""
        cases = self.checks.cases
        del cases[self.first :]
        for tname, (label, c) in self.key_of.items():
            r = self.res[(label, c)]
            ok = all(passes(r[k]) for k in self.KEYS if k != "slots")
            has_slots = bool(self.opt_of[tname][2].slot_initial_values)
            ok = ok and (passes(r["slots"]) if has_slots else r["slots"] is None)
            case = dict(optimizer=label, combiner=c, passed=bool(ok), rel_err=r)
            if incomplete:
                case.update(passed=None, incomplete=incomplete)
            cases.append(case)
        self.checks.w.save()

    def worst(self, tname, what, err):
        r = self.res[self.key_of[tname]]
        old = r[what]
        r[what] = err if (old is None or not (err <= old)) else old  # NaN stays

    def step(self, step):
        """One training step: its lookups against the reference's, then the same update
        on the reference (float64 numpy, or embedmesh on the CPU)."""
        import jax
        import numpy as np

        ref, feats = self.checks.ref, self.feats
        inputs, weights = _case_batch(self.rng, feats)
        acts, preserved = self.emb(inputs, weights)
        lays = []
        for name, f in feats.items():
            lay = ref.layout(f, inputs[name], weights[name])
            lays.append((name, f.table.name, lay))
            want = ref.activation(self.ref_tabs[f.table.name], lay)
            self.worst(f.table.name, "lookup", rel_err(np.asarray(acts[name]), want))
        dacts = {n: self.rng.normal(size=a.shape).astype(np.float32) for n, a in acts.items()}
        self.emb.apply_gradients(
            {n: jax.device_put(v, self.checks.dev) for n, v in dacts.items()}, preserved
        )
        if self.checks.topt is not None:
            self.reference_update(lays, dacts, step)
        else:
            _, cpu_pre = self.cpu_emb(inputs, weights)
            self.cpu_emb.apply_gradients(dacts, cpu_pre)
            self.ref_tabs, self.ref_slots = _f64_of(self.cpu_emb)

    def reference_update(self, lays, dacts, step):
        """The step's update of the float64 tables and slots (test_optimizers.ref_update)."""
        import numpy as np

        grads = self.checks.ref.row_gradients(lays, dacts)
        ref_tabs, ref_slots = self.ref_tabs, self.ref_slots
        for tname, per_id in grads.items():
            cls_name, hp, opt = self.opt_of[tname]
            if not getattr(opt, "lazy_adam", True):  # every row moves
                zero = np.zeros(ref_tabs[tname].shape[1])
                V = ref_tabs[tname].shape[0]
                per_id = {i: per_id.get(i, zero) for i in range(V)}
            ids = sorted(per_id)
            g = np.stack([per_id[i] for i in ids])
            s = {k: v[ids] for k, v in ref_slots[tname].items()}
            new_w, _, new_s, _ = self.checks.topt.ref_update(
                cls_name, hp, ref_tabs[tname][ids], s, g, step
            )
            ref_tabs[tname][ids] = new_w
            for k in new_s:
                ref_slots[tname][k][ids] = new_s[k]

    def serving(self):
        """Serving on the read-back (exported) tables: host path, and jax.jit on the
        device, against the float64 reference."""
        import jax
        import numpy as np

        import embedmesh as em

        feats, dev, ref = self.feats, self.checks.dev, self.checks.ref
        inputs, weights = _case_batch(self.rng, feats)
        exported = self.emb.embedding_tables
        # poison: the host path reuses freed output buffers; fill them with NaN first
        nan = {t: np.full(v.shape, np.nan, v.dtype) for t, v in exported.items()}
        poisoned = em.serving_embedding_lookup(inputs, weights, nan, feats)
        del poisoned
        gc.collect()
        host = em.serving_embedding_lookup(inputs, weights, exported, feats)
        serve = jax.jit(lambda i, wt, t: em.serving_embedding_lookup(i, wt, t, feats))
        on_dev = serve(
            jax.device_put(inputs, dev),
            jax.device_put(weights, dev),
            jax.device_put(exported, dev),
        )
        for name, f in feats.items():
            lay = ref.layout(f, inputs[name], weights[name])
            want = ref.activation(np.asarray(exported[f.table], np.float64), lay)
            for what, out in (("serving_host", host), ("serving_device", on_dev)):
                self.worst(f.table.name, what, rel_err(np.asarray(out[name]), want))


def _one_by_one(checks: _Checks, group):
    """The groups of one optimizer each, after the joint one raised: each as the budget
    allows, a crash a failed case."""
    w, cases = checks.w, checks.cases
    last = 5.0  # a case needs about as long as the one before
    for i, label, cls_name, kwargs in group:
        if w.left() < 1.3 * last:
            w.data["skipped"].append(
                f"correctness {label}: skipped, {w.left():.0f} s left of the child's budget"
            )
            continue
        t_case, first = time.perf_counter(), len(cases)
        try:
            _Group(checks, [(i, label, cls_name, kwargs)], seed=100 + i).check()
        except Exception as e:  # noqa: BLE001 - a crash is a failed case, reported
            del cases[first:]  # what it published before the crash
            for c in COMBINERS:
                cases.append(
                    dict(
                        optimizer=label,
                        combiner=c,
                        passed=False,
                        error=f"{type(e).__name__}: {e}",
                    )
                )
            w.data["tracebacks"][label] = traceback.format_exc()[-4000:]
        last = time.perf_counter() - t_case
        w.save()


def run_correctness(w: Worker, cfg):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    ref, topt, ref_kind = _references()
    dev = jax.devices()[0]
    mesh = Mesh(np.array([dev]), ("x",))
    cpu_mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("x",)) if topt is None else None
    w.data["reference"] = ref_kind
    w.data["device"] = f"{dev.device_kind} ({dev.platform})"
    cases = w.data.setdefault("cases", [])
    checks = _Checks(w, ref, topt, dev, mesh, cpu_mesh, cases)

    t0 = time.perf_counter()
    group = [(i, *case) for i, case in enumerate(OPTIMIZER_CASES)]
    print(f"[correctness] reference: {ref_kind}", flush=True)
    try:
        _Group(checks, group, seed=100).check()
        w.data["programs"] = "one embedding, a table per optimizer x combiner"
    except Exception:  # noqa: BLE001 - isolate it: one embedding per optimizer
        w.data.setdefault("tracebacks", {})["all optimizers at once"] = traceback.format_exc()[
            -4000:
        ]
        w.data["programs"] = "one embedding per optimizer (the joint one raised, see tracebacks)"
        del cases[:]
        w.save()
        _one_by_one(checks, group)
    w.data["sections"]["correctness"] = dict(wall_s=round(time.perf_counter() - t0, 2))
    w.save()


# ---------------------------------------------------------------------------
# (b), (c): embedmesh at scale


def _free_jax(*trees):
    import jax

    for tree in trees:
        for x in jax.tree_util.tree_leaves(tree):
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
    gc.collect()
    jax.clear_caches()


def memory_stats(dev):
    """The device allocator's figures (bytes in use, peak, limit) where it has them."""
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend has them
        return None
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "bytes_reserved")
    return {k: stats[k] for k in keys if k in stats} or None


def _jax_copy_bandwidth(cfg):
    """The device's copy bandwidth: bytes read + written by jit(x + 1) over copy_bytes."""
    import jax
    import jax.numpy as jnp

    n = cfg["copy_bytes"] // 4
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)  # one read, one write: a copy XLA cannot elide
    med, _ = timed_median(lambda i: f(x).block_until_ready(), 2, cfg["copy_reps"])
    _free_jax(x)
    return dict(bytes=2 * n * 4, median_s=med, GBps=2 * n * 4 / med / 1e9, how="jit(x + 1)")


def _jax_build(holder, fc, feats, mesh):
    """The embedding built (timed) and every batch preprocessed (enqueue, timed); the
    embedding and the batches' CSRs left in `holder`."""
    import jax

    import embedmesh as em
    from embedmesh.layout.stacking import plan_stacking

    caps = em.compute_sparse_core_stats(
        feats, plan_stacking(fc, 1), num_devices_local=1
    ).capacities()
    opt = em.Adagrad(learning_rate=LR, initial_accumulator_value=INITIAL_ACC)
    emb = em.MeshEmbedding(fc, opt, mesh=mesh, capacities=caps)
    t = time.perf_counter()
    emb.build()  # jax.random initializer, on the device
    jax.block_until_ready(emb.state)
    build_s = time.perf_counter() - t
    shapes = {s: list(a.shape) for s, a in emb.state.tables.items()}
    for s, a in emb.state.tables.items():
        assert a.size < 2**31, (s, a.shape)
    emb.enqueue(feats[0])  # warms the preprocessing (numba compiles at first use)
    enq = []
    csrs = []
    for f in feats:
        t = time.perf_counter()
        csrs.append(jax.block_until_ready(emb.enqueue(f)))
        enq.append(time.perf_counter() - t)
    holder.update(emb=emb, csrs=csrs)
    state_bytes = sum(
        x.nbytes for x in jax.tree_util.tree_leaves((emb.state.tables, emb.state.slots))
    )
    return dict(
        build_s=build_s,
        stacks=shapes,
        state_bytes=state_bytes,
        capacities={s: str(c) for s, c in caps.items()},
        host_preprocess_s=median(enq),
        host_preprocess_samples_s=enq,
        host_preprocess_note="enqueue = host preprocessing + transfer; a real per-batch "
        "cost, kept out of the device step times below (K batches made before timing)",
    )


def _jax_passes(w: Worker, cfg, holder, rates, dev):
    """The forward, backward+update and full step of `holder`'s embedding, timed, then
    its tables checked finite; the embedding and its batches freed after."""
    import jax
    import jax.numpy as jnp

    T, D, B = cfg["tables"], cfg["dim"], cfg["batch"]
    warmup, reps, K = cfg["warmup"], cfg["reps"], cfg["num_batches"]
    emb, csrs = holder["emb"], holder["csrs"]
    core = emb.core
    key = jax.random.key(1)
    R = {
        f"f{t}": jax.random.normal(jax.random.fold_in(key, t), (B, D), jnp.float32)
        for t in range(T)
    }
    lookup = jax.jit(core.lookup)
    apply = jax.jit(
        lambda st, g, c: core.apply_gradients(st, g, c, check_finite=False)[0], donate_argnums=0
    )

    def train(st, c, r):
        acts = core.lookup(st, c)
        loss, g = jax.value_and_grad(lambda a: sum(0.5 * jnp.sum((a[k] - r[k]) ** 2) for k in a))(
            acts
        )
        st, _ = core.apply_gradients(st, g, c, check_finite=False)
        return st, loss

    train = jax.jit(train, donate_argnums=0)
    state = {"st": emb.state}

    def fwd():
        med, ts = timed_median(
            lambda i: jax.block_until_ready(lookup(state["st"], csrs[i % K])), warmup, reps
        )
        return dict(rates(med, "forward"), samples_s=ts)

    def bwd():
        def one(i):
            state["st"] = apply(state["st"], R, csrs[i % K])
            jax.block_until_ready(state["st"])

        med, ts = timed_median(one, warmup, reps)
        return dict(rates(med, "backward_update"), samples_s=ts)

    def step():
        def one(i):
            state["st"], loss = train(state["st"], csrs[i % K], R)
            jax.block_until_ready((state["st"], loss))

        med, ts = timed_median(one, warmup, reps)
        return dict(rates(med, "step"), samples_s=ts)

    w.section("forward", 10, fwd)
    w.section("backward_update", 10, bwd)
    w.section("step", 15, step)
    w.data["memory_after_timing"] = memory_stats(dev)

    def finite():
        leaves = jax.tree_util.tree_leaves(state["st"])
        if not all(bool(jnp.all(jnp.isfinite(a))) for a in leaves):
            raise FloatingPointError("non-finite tables or slots after the timed steps")
        return dict(finite=True)

    w.section("tables_finite_after_timing", 0, finite)
    _free_jax(state["st"], csrs)
    holder.clear()
    state.clear()
    emb = csrs = None
    gc.collect()


def _jax_serving(cfg, fc, batches, dev, mean_ids):
    """`serving_embedding_lookup` under jax.jit on device tables, the scale batches."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import embedmesh as em

    T, V, D = cfg["tables"], cfg["vocab"], cfg["dim"]
    warmup, reps, K = cfg["warmup"], cfg["reps"], cfg["num_batches"]
    key = jax.random.key(1)
    tcs = [f.table for f in fc.values()]
    tabs = {
        tc: 0.01 * jax.random.normal(jax.random.fold_in(key, 100 + t), (V, D), jnp.float32)
        for t, tc in enumerate(tcs)
    }
    ins = [
        {
            f"f{t}": em.RaggedTensor(
                jax.device_put(b[t][0], dev),
                jax.device_put(np.concatenate([[0], np.cumsum(b[t][1])]).astype(np.int32), dev),
            )
            for t in range(T)
        }
        for b in batches
    ]
    serve = jax.jit(lambda i, t: em.serving_embedding_lookup(i, None, t, fc))
    med, ts = timed_median(lambda i: jax.block_until_ready(serve(ins[i % K], tabs)), warmup, reps)
    mem = memory_stats(dev)
    _free_jax(tabs, ins)
    return dict(ms=med * 1e3, ids_per_s=mean_ids / med, samples_s=ts, memory=mem)


def run_jax_scale(w: Worker, cfg):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import embedmesh as em

    T, V, D = cfg["tables"], cfg["vocab"], cfg["dim"]
    dev = jax.devices()[0]
    w.data["device"] = f"{dev.device_kind} ({dev.platform})"
    w.data["jax"] = jax.__version__
    w.section("copy_bandwidth", 5, _jax_copy_bandwidth, cfg)

    batches = load_batches(cfg)
    meta = cfg["batch_meta"]
    fc = {
        f"f{t}": em.FeatureConfig(em.TableConfig(V, D, combiner="sum", name=f"t{t}"))
        for t in range(T)
    }
    feats = [{f"f{t}": em.RaggedTensor.from_row_lengths(*b[t]) for t in range(T)} for b in batches]
    mesh = Mesh(np.array([dev]), ("x",))
    holder: dict = {}
    if w.section("build_and_preprocess", 20, _jax_build, holder, fc, feats, mesh) is None:
        return
    ids = [m["ids"] for m in meta]
    uniq = [m["unique_rows"] for m in meta]
    mean_ids, mean_uniq = statistics.mean(ids), statistics.mean(uniq)
    touched = bytes_touched(cfg, mean_ids, mean_uniq, num_slots=1)
    w.data["workload"] = dict(ids_per_batch=mean_ids, unique_rows_per_batch=mean_uniq)
    _jax_passes(w, cfg, holder, rates_of(mean_ids, touched), dev)
    w.section("serving_jit", 20, _jax_serving, cfg, fc, batches, dev, mean_ids)


# ---------------------------------------------------------------------------
# torch peer


class _TorchPeer:
    """torch's side of the scale workload: T `nn.EmbeddingBag`s + Adagrad on the same ids
    (see the module docstring), on the GPU where there is one."""

    def __init__(self, w: Worker, cfg, torch):
        self.torch, self.cfg = torch, cfg
        self.cuda = torch.cuda.is_available()
        self.dev = torch.device("cuda" if self.cuda else "cpu")
        w.data["torch"] = torch.__version__
        w.data["device"] = torch.cuda.get_device_name(0) if self.cuda else "cpu"
        self.sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        meta = cfg["batch_meta"]
        mean_ids = statistics.mean(m["ids"] for m in meta)
        mean_uniq = statistics.mean(m["unique_rows"] for m in meta)
        self.touched = bytes_touched(cfg, mean_ids, mean_uniq, num_slots=1)
        self.rates = rates_of(mean_ids, self.touched)
        self.fused_refused = ""

    def free(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def copy_bw(self):
        torch, cfg = self.torch, self.cfg
        n = cfg["copy_bytes"] // 4
        buf = {"src": torch.randn(n, device=self.dev)}
        buf["dst"] = torch.empty_like(buf["src"])

        def one(i):
            buf["dst"].copy_(buf["src"])
            self.sync()

        med, _ = timed_median(one, 2, cfg["copy_reps"])
        buf.clear()
        self.free()
        return dict(bytes=2 * n * 4, median_s=med, GBps=2 * n * 4 / med / 1e9, how="dst.copy_(src)")

    def load(self):
        """The scale batches on the device as (ids, offsets), and the loss targets R."""
        import numpy as np

        torch, cfg, dev = self.torch, self.cfg, self.dev
        self.batches = [
            [
                (
                    torch.from_numpy(v.astype(np.int64)).to(dev),
                    torch.from_numpy(np.concatenate([[0], np.cumsum(l)[:-1]]).astype(np.int64)).to(
                        dev
                    ),
                )
                for v, l in b
            ]
            for b in load_batches(cfg)
        ]
        gen = torch.Generator(device=dev).manual_seed(1)
        self.R = [
            torch.randn(cfg["batch"], cfg["dim"], device=dev, generator=gen)
            for _ in range(cfg["tables"])
        ]

    def setup(self, sparse, fused=True):
        torch, cfg = self.torch, self.cfg
        torch.manual_seed(0)
        bags = [
            torch.nn.EmbeddingBag(
                cfg["vocab"], cfg["dim"], mode="sum", sparse=sparse, device=self.dev
            )
            for _ in range(cfg["tables"])
        ]
        params = [p for b in bags for p in b.parameters()]
        how = "sparse grads, default (single-tensor) path"
        if sparse:
            opt = torch.optim.Adagrad(params, lr=LR, initial_accumulator_value=INITIAL_ACC)
        else:
            try:
                if not fused:
                    raise RuntimeError(self.fused_refused)
                opt = torch.optim.Adagrad(
                    params, lr=LR, initial_accumulator_value=INITIAL_ACC, fused=True
                )
                how = "dense grads, fused=True"
            except (RuntimeError, ValueError) as e:
                opt = torch.optim.Adagrad(
                    params, lr=LR, initial_accumulator_value=INITIAL_ACC, foreach=True
                )
                how = f"dense grads, foreach=True (fused refused: {str(e)[:200]})"
        return bags, opt, how

    def train(self, sparse, fused=True):
        """The step timed (and with sparse gradients, the no_grad forward); dense with
        fused=True first, foreach where fused refuses at its first step."""
        torch, cfg, sync, rates = self.torch, self.cfg, self.sync, self.rates
        import torch.nn.functional as F

        T, warmup, reps, K = cfg["tables"], cfg["warmup"], cfg["reps"], cfg["num_batches"]
        batches, R = self.batches, self.R
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        m = dict(zip(("bags", "opt", "how"), self.setup(sparse, fused)))  # cleared at the end

        def one(i):
            b, bags, opt = batches[i % K], m["bags"], m["opt"]
            opt.zero_grad(set_to_none=True)
            loss = sum(0.5 * ((bags[t](*b[t]) - R[t]) ** 2).sum() for t in range(T))
            loss.backward()
            opt.step()
            sync()

        def fwd(i):
            b, bags = batches[i % K], m["bags"]
            with torch.no_grad():
                for t in range(T):
                    F.embedding_bag(b[t][0], bags[t].weight, b[t][1], mode="sum")
            sync()

        try:
            try:
                med, ts = timed_median(one, warmup, reps)
            except RuntimeError as e:
                if sparse or not fused or "fused=True" not in m["how"]:
                    raise
                self.fused_refused = f"{type(e).__name__} at step: {e}"  # e.g. unsupported here
                m.clear()
                self.free()
                return self.train(sparse, fused=False)
            out = dict(rates(med, "step"), samples_s=ts, how=m["how"])
            if sparse:
                fmed, fts = timed_median(fwd, warmup, reps)
                out["forward"] = dict(rates(fmed, "forward"), samples_s=fts)
                bu = med - fmed
                out["backward_update"] = dict(
                    ms=bu * 1e3,
                    touched_GBps=self.touched["backward_update"] / bu / 1e9 if bu > 0 else None,
                    how="step - forward",
                )
            out["tables_finite_after_timing"] = all(
                bool(torch.isfinite(b.weight).all()) for b in m["bags"]
            )
            out["peak_mem_bytes"] = torch.cuda.max_memory_allocated() if self.cuda else None
            return out
        finally:
            m.clear()
            self.free()


def run_torch(w: Worker, cfg):
    try:
        import torch
    except ImportError as e:
        w.data["skipped"].append(f"torch not installed ({e}): torch figures n/a")
        w.data["torch"] = "not installed"
        w.save()
        return
    peer = _TorchPeer(w, cfg, torch)
    w.section("copy_bandwidth", 5, peer.copy_bw)
    peer.load()
    w.section("sparse_adagrad", 20, peer.train, True)
    w.section("dense_fused_adagrad", 25, peer.train, False)


# ---------------------------------------------------------------------------
# The parent: children, budget, report


def run_preflight(w: Worker, cfg):
    """What JAX runs on here (the parent stops unless it is a GPU, or told to go on), and
    whether the Pallas kernels import; a child, so the parent never holds the GPU."""
    import jax
    import jaxlib

    w.data.update(
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        backend=jax.default_backend(),
        devices=[f"{d.device_kind} ({d.platform})" for d in jax.devices()],
    )
    w.save()  # the backend is the verdict: kept should the import below outlast the cap
    try:
        import embedmesh.device.ops.gpu.pallas  # noqa: F401 - the import is the check
    except Exception as e:  # noqa: BLE001 - the pallas variant cannot run; say why
        w.data["errors"].append(f"the Pallas kernels do not import: {type(e).__name__}: {e}")
    w.save()


POLL_S = 5.0  # how often the parent folds a running child's part file into the report


def read_part(part, status):
    data = {"sections": {}, "skipped": [], "errors": []}
    with contextlib.suppress(OSError, ValueError), open(part) as f:  # OSError: not written
        data = json.load(f)
    data["status"] = status
    return data


def run_child(kind, variant, cfg, tmp, deadline, cap_s, log, progress=None):
    """Run one child to its end, its cap or the budget's deadline (then kill it: what it
    saved is kept); `progress(data)` gets its part file whenever that changes."""
    part = os.path.join(tmp, f"{kind}-{variant or 'torch'}.json")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    if variant is not None:
        env["EMBEDMESH_GPU_KERNELS"] = variant
    child_deadline = min(deadline, time.time() + cap_s)
    cfg_path = os.path.join(tmp, "cfg.json")
    write_json(cfg_path, cfg)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--cfg", cfg_path]
    cmd += ["--part", part, "--deadline", repr(child_deadline)]
    t = time.time()
    print(
        f"[gpu.py] {kind} {variant or ''}: start ({deadline - t:.0f} s of budget left)", flush=True
    )
    status = "ok"
    kill_at = max(child_deadline, t + 1) + cfg["kill_grace_s"]
    with open(log, "a") as f:  # the child writes straight into the log: kept if all dies
        f.write(f"===== {kind} {variant or ''}\n")
        f.flush()
        start = f.tell()
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        seen = None
        while True:
            try:
                code = proc.wait(timeout=POLL_S)
                if code != 0:
                    status = f"exit status {code}"
                break
            except subprocess.TimeoutExpired:
                if time.time() > kill_at:
                    proc.kill()
                    proc.wait()
                    status = "killed: ran past its share of the budget (partial results kept)"
                    break
            with contextlib.suppress(OSError):
                mtime = os.stat(part).st_mtime_ns
                if progress is not None and mtime != seen:
                    seen = mtime
                    progress(dict(read_part(part, "running"), wall_s=round(time.time() - t, 1)))
        f.write(f"\n===== {kind} {variant or ''}: {status}\n")
    with open(log, "rb") as f:
        f.seek(start)
        out = f.read().decode(errors="replace")
    data = read_part(part, status)
    data["wall_s"] = round(time.time() - t, 1)
    if status != "ok":
        data["errors"].append(f"child {status}; output tail: {out[-1500:]}")
    print(f"[gpu.py] {kind} {variant or ''}: {status} in {data['wall_s']} s", flush=True)
    return data


def plan(variants, correctness=True):
    """The children in run order, as (kind, variant): the correctness of each kernel
    variant, the first one's scale run, torch, the other kernel variants' scale runs;
    `reference` (every op's pure-JAX reference: the baseline) last. The budget cuts from
    the end, so the main results come first."""
    kernels = [v for v in variants if v != "reference"]
    last = ["reference"] if "reference" in variants else []
    order = [("correctness", v) for v in kernels] if correctness else []
    order += [("jax_scale", v) for v in kernels[:1]] + [("torch", None)]
    order += [("jax_scale", v) for v in kernels[1:]]
    for v in last:
        order += ([("correctness", v)] if correctness else []) + [("jax_scale", v)]
    return order


def fmt(x, spec=".3g", na="n/a"):
    if x is None:
        return na
    if isinstance(x, float) and math.isnan(x):
        return "NaN"
    return format(x, spec)


def derive(report):
    """Ratios and fractions of the measured copy bandwidth."""
    bws = [
        s.get("sections", {}).get("copy_bandwidth", {}).get("GBps")
        for s in [report.get("torch") or {}, *report["scale"].values()]
    ]
    bws = [b for b in bws if b]
    copy = max(bws) if bws else None
    torch_sec = (report.get("torch") or {}).get("sections", {})
    t_step = torch_sec.get("sparse_adagrad", {})
    t_fwd = t_step.get("forward", {})
    out = {"copy_GBps": copy}
    for v, s in report["scale"].items():
        sec = s.get("sections", {})
        d = {}
        for name in ("forward", "backward_update", "step"):
            if name in sec and copy:
                d[f"{name}_fraction_of_copy_bw"] = sec[name]["touched_GBps"] / copy
        if "step" in sec and t_step.get("ids_per_s"):
            d["step_ratio_vs_torch_sparse"] = sec["step"]["ids_per_s"] / t_step["ids_per_s"]
        if "forward" in sec and t_fwd.get("ids_per_s"):
            d["forward_ratio_vs_torch"] = sec["forward"]["ids_per_s"] / t_fwd["ids_per_s"]
        if "serving_jit" in sec and t_fwd.get("ids_per_s"):
            d["serving_ratio_vs_torch"] = sec["serving_jit"]["ids_per_s"] / t_fwd["ids_per_s"]
        out[v] = d
    return out


def _md_head(report) -> list[str]:
    """The title, the run's host, budget and pre-flight, and whether it was cut short."""
    cfg = report["config"]
    L = [f"# embedmesh GPU check ({cfg['mode']} mode)", ""]
    L.append(
        f"{report['host']}; budget {cfg['budget_s']:.0f} s, used {report['elapsed_s']:.0f} s; "
        f"variants (EMBEDMESH_GPU_KERNELS): {', '.join(report['variants'])}"
    )
    pre = report.get("preflight") or {}
    L.append(
        f"pre-flight: jax {pre.get('jax', '?')}, jaxlib {pre.get('jaxlib', '?')}, default "
        f"backend {pre.get('backend', '?')}, devices {pre.get('devices', '?')}"
    )
    if report.get("aborted"):
        L += ["", f"**Aborted**: {report['aborted']}"]
    if report.get("state", "finished") != "finished":
        L += [
            "",
            f"**Incomplete** ({report['state']}): saved while the run went on; a run cut "
            "short leaves this last save.",
        ]
    return L


def _md_case_cell(x) -> str:
    """One correctness case's cell: not run, failed, partial, or ok with its worst error."""
    if x is None:
        return "not run"
    if "error" in x:
        return f"FAIL ({x['error'][:60]})"
    if x["passed"] is None:
        e = [v for v in x["rel_err"].values() if v is not None]
        return f"partial, worst {fmt(max(e, default=None), '.1e')} ({x['incomplete']})"
    e = x["rel_err"]
    worst = max((v for v in e.values() if v is not None), default=math.nan)
    if any(v is not None and math.isnan(v) for v in e.values()):
        worst = math.nan
    bad = [k for k, v in e.items() if not (k == "slots" and v is None)]
    bad = [k for k in bad if not passes(e[k])]
    return (
        ("ok " if x["passed"] else "FAIL ")
        + fmt(worst, ".1e")
        + (f" ({', '.join(bad)})" if bad else "")
    )


def _md_correctness(report) -> list[str]:
    """(a): a table of optimizer x combiner per variant."""
    L = ["", "## (a) Correctness on the default device (rel. error ||out-ref||/||ref|| < 1e-5)"]
    for v, c in report["correctness"].items():
        cases = c.get("cases", [])
        n_ok = sum(x["passed"] is True for x in cases)
        L += [
            "",
            f"**{v}** on {c.get('device', '?')}: {n_ok}/{len(cases)} cases pass "
            f"(child: {c.get('status')}; {c.get('programs', '?')}); "
            f"reference: {c.get('reference', '?')}",
            "",
            "| optimizer | " + " | ".join(COMBINERS) + " |",
            "|---|" + "---|" * len(COMBINERS),
        ]
        by = {(x["optimizer"], x["combiner"]): x for x in cases}
        for label, _, _ in OPTIMIZER_CASES:
            cells = [_md_case_cell(by.get((label, comb))) for comb in COMBINERS]
            L.append(f"| {label} | " + " | ".join(cells) + " |")
    L += ["", "cells: worst of lookup (3 steps), tables, slots, serving host and jit lookups."]
    return L


def _torch_why(report) -> str:
    """What a missing torch figure says: torch not installed, or not run."""
    why = (report.get("torch") or {}).get("torch")
    return "torch not installed" if why == "not installed" else "not run"


def _md_step_rows(report) -> list[tuple]:
    """(system, step, forward, backward_update, ratio to torch sparse, host prep s) of each
    embedmesh variant and each torch setup."""
    der = report["derived"]
    tsec = (report.get("torch") or {}).get("sections", {})
    rows = []
    for v, s in report["scale"].items():
        sec = s.get("sections", {})
        prep = sec.get("build_and_preprocess", {}).get("host_preprocess_s")
        rows.append(
            (
                f"embedmesh [{v}]",
                sec.get("step", {}),
                sec.get("forward", {}),
                sec.get("backward_update", {}),
                der.get(v, {}).get("step_ratio_vs_torch_sparse"),
                prep,
            )
        )
    why = _torch_why(report)
    base = tsec.get("sparse_adagrad", {}).get("ids_per_s")
    for name, label in (
        ("sparse_adagrad", "torch EmbeddingBag sparse + Adagrad"),
        ("dense_fused_adagrad", "torch dense grads + Adagrad (O(table) work/step)"),
    ):
        t = tsec.get(name)
        if not t:
            rows.append((f"{label}: {why}", {}, {}, {}, None, None))
            continue
        ratio = t["ids_per_s"] / base if base else None
        rows.append(
            (
                f"{label} ({t.get('how')})",
                t,
                t.get("forward", {}),
                t.get("backward_update", {}),
                ratio,
                None,
            )
        )
    return rows


def _md_step(report) -> list[str]:
    """(b): the step's times and its bytes against the copy bandwidth."""
    cfg, der = report["config"], report["derived"]
    L = [
        "",
        f"## (b) Training step: {cfg['tables']} tables x {cfg['vocab']:,} x {cfg['dim']} f32, "
        f"batch {cfg['batch']:,}, ids/sample {cfg['min_len']}..{cfg['max_len']} Zipf({ZIPF_A}), "
        "sum, Adagrad",
        "",
    ]
    wl = next((s.get("workload") for s in report["scale"].values() if s.get("workload")), None)
    if wl:
        L.append(
            f"ids per batch {wl['ids_per_batch']:,.0f}, "
            f"distinct rows {wl['unique_rows_per_batch']:,.0f}; copy bandwidth "
            f"{fmt(der.get('copy_GBps'), '.0f')} GB/s (read + write, measured here)"
        )
        L.append("")
    smoke = cfg["mode"] == "smoke"
    copy = None if smoke else der.get("copy_GBps")  # a CPU copy is no roofline
    rows = _md_step_rows(report)
    L += [
        "| system | step ms | ids/s | vs torch sparse | fwd ms | bwd+upd ms | host prep ms/batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, st, fw, bu, ratio, prep in rows:
        L.append(
            f"| {label} | {fmt(st.get('ms'))} | {fmt(st.get('ids_per_s'))} | {fmt(ratio)} "
            f"| {fmt(fw.get('ms'))} | {fmt(bu.get('ms'))} | {fmt(prep * 1e3 if prep else None)} |"
        )
    L += [
        "",
        "Bytes each pass must touch / pass time, and as a share of the copy bandwidth:",
        "",
        "| system | fwd GB/s | % copy | bwd+upd GB/s | % copy | step GB/s | % copy |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, st, fw, bu, _, _ in rows:
        cells = []
        for x in (fw, bu, st):
            g = x.get("touched_GBps")
            cells += [fmt(g), fmt(g / copy * 100 if g and copy else None, ".1f")]
        L.append(f"| {label} | " + " | ".join(cells) + " |")
    L += [
        "",
        "bytes touched: fwd 4N + U*4D + T*B*4D; bwd+upd T*B*4D + 2*U*4D*(1+slots); "
        "step = both (N ids, U distinct rows). torch bwd+upd = step - no_grad forward. "
        "'vs torch': ids/s over torch sparse Adagrad's. Host preprocessing (enqueue: host "
        "work + transfer) is a real per-batch cost on top of the device step.",
    ]
    return L


def _md_forward(report) -> list[str]:
    """(c): forward-only and serving lookups against torch's embedding_bag."""
    der = report["derived"]
    tsec = (report.get("torch") or {}).get("sections", {})
    L = [
        "",
        "## (c) Forward-only and serving lookup (same ids)",
        "",
        "| system | ms | ids/s | vs torch embedding_bag |",
        "|---|---|---|---|",
    ]
    t_fwd = tsec.get("sparse_adagrad", {}).get("forward", {})
    for v, s in report["scale"].items():
        sec, d = s.get("sections", {}), der.get(v, {})
        for name, label, r in (
            ("forward", "training lookup (jit core.lookup)", "forward_ratio_vs_torch"),
            ("serving_jit", "serving_embedding_lookup (jit)", "serving_ratio_vs_torch"),
        ):
            x = sec.get(name, {})
            L.append(
                f"| embedmesh [{v}] {label} | {fmt(x.get('ms'))} | {fmt(x.get('ids_per_s'))} "
                f"| {fmt(d.get(r))} |"
            )
    L.append(
        f"| torch F.embedding_bag sum, no_grad | {fmt(t_fwd.get('ms'))} "
        f"| {fmt(t_fwd.get('ids_per_s'))} | {'1' if t_fwd else _torch_why(report)} |"
    )
    L += [
        "",
        "torch's peer runs only the scale workload (sum, no weights); it has no sqrtn "
        "combiner and takes per-sample weights only with mode='sum', so the correctness "
        "cases (weighted mean/sqrtn) have no torch peer.",
    ]
    return L


def _md_notes(report) -> list[str]:
    """What was skipped, what errored (the run's and each child's), the exit status."""
    L = []
    notes = list(report["skipped"])
    for group in (report["correctness"], report["scale"], {"torch": report.get("torch") or {}}):
        for v, s in group.items():
            notes += [f"{v}: {x}" for x in s.get("skipped", [])]
    errors = list(report["errors"])
    for group in (report["correctness"], report["scale"], {"torch": report.get("torch") or {}}):
        for v, s in group.items():
            errors += [f"{v}: {x[:300]}" for x in s.get("errors", [])]
    if report["config"]["mode"] == "smoke":
        notes.append(
            "smoke mode: tiny sizes on this machine's default device; timings are "
            "only a liveness check, GPU figures n/a"
        )
    if notes:
        L += ["", "## Skipped", ""] + [f"- {n}" for n in notes]
    if errors:
        L += ["", "## Errors", ""] + [f"- {e}" for e in errors]
    L += ["", f"exit status: {report['exit_status']}"]
    return L


def markdown(report) -> str:
    L = _md_head(report)
    L += _md_correctness(report)
    L += _md_step(report)
    L += _md_forward(report)
    L += _md_notes(report)
    return "\n".join(L) + "\n"


def finish(report, t0, running=None):
    """Fill in the derived figures, the summary and the exit status of `report` as it
    stands; `running`: the child still going (the report is then marked incomplete)."""
    report["derived"] = derive(report)
    cases = [c for r in report["correctness"].values() for c in r.get("cases", [])]
    expected = len(OPTIMIZER_CASES) * len(COMBINERS)
    failed = [c for c in cases if c["passed"] is False]
    incomplete = [  # planned but skipped, cut short, or crashed part-way
        v
        for v in report["correctness_planned"]
        if sum(c["passed"] is not None for c in report["correctness"].get(v, {}).get("cases", []))
        < expected
    ]
    other_errors = report["errors"] + [
        e
        for g in (report["scale"], {"t": report.get("torch") or {}})
        for s in g.values()
        for e in s.get("errors", [])
    ]
    if report.get("aborted"):
        exit_status = 3
    elif failed:
        exit_status = 1
    else:
        exit_status = 2 if other_errors or incomplete or running else 0
    report["summary"] = dict(
        cases=len(cases),
        failed=[f"{c['optimizer']}/{c['combiner']}" for c in failed],
        incomplete_variants=incomplete,
    )
    report["state"] = f"running: {running}" if running else "finished"
    report["exit_status"] = exit_status
    report["elapsed_s"] = time.time() - t0
    return exit_status


def save_report(report, out) -> str:
    """Write gpu.json and gpu.md (each replaced whole); returns the markdown."""
    md = markdown(report)
    write_json(os.path.join(out, "gpu.json"), report)
    tmp = os.path.join(out, "gpu.md.tmp")
    with open(tmp, "w") as f:
        f.write(md)
    os.replace(tmp, os.path.join(out, "gpu.md"))
    return md


def _parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=False)
    p.add_argument("--smoke", action="store_true", help="tiny scale sizes (a first GPU call; CI)")
    p.add_argument("--variants", default=None, help="EMBEDMESH_GPU_KERNELS values, comma-separated")
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument(
        "--skip-correctness", action="store_true", help="scale and torch only (a second call)"
    )
    p.add_argument(
        "--allow-cpu",
        action="store_true",
        help="run where JAX's default backend is not a GPU (the CPU smoke test)",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--cfg", help=argparse.SUPPRESS)
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    return p


def run_worker(args):
    """A child (`--worker KIND`): its part, its results saved to its part file."""
    with open(args.cfg) as f:
        cfg = json.load(f)
    w = Worker(args.part, args.deadline, cfg["est_scale"])
    w.data["env_EMBEDMESH_GPU_KERNELS"] = os.environ.get("EMBEDMESH_GPU_KERNELS")
    w.save()
    fn = {
        "preflight": run_preflight,
        "correctness": run_correctness,
        "jax_scale": run_jax_scale,
        "torch": run_torch,
    }
    try:
        fn[args.worker](w, cfg)
    except Exception as e:  # noqa: BLE001 - recorded in the part file for the report
        w.data["errors"].append(f"{args.worker}: {type(e).__name__}: {e}")
        w.data.setdefault("tracebacks", {})[args.worker] = traceback.format_exc()[-4000:]
        w.save()
        raise
    w.save()
    return 0


def scale_batches(cfg, report, tmp):
    """The scale workload's batches, made once (their counts in cfg["batch_meta"], None
    where making them failed: the error in the report)."""
    t = time.time()
    cfg["batches_path"] = os.path.join(tmp, "batches.npz")
    try:
        cfg["batch_meta"] = make_batches(cfg, cfg["batches_path"])
    except Exception as e:  # noqa: BLE001
        report["errors"].append(f"making the scale batches: {type(e).__name__}: {e}")
        cfg["batch_meta"] = None
    report["config"]["batch_meta"] = cfg["batch_meta"]
    report["batches_s"] = round(time.time() - t, 1)


def run_parent(args):
    """The pre-flight, then the planned children as the budget allows, the report saved
    after each; returns the exit status."""
    t0 = time.time()
    cfg = dict(SMOKE if args.smoke else FULL)
    if args.budget_s is not None:
        cfg["budget_s"] = args.budget_s
    variants = [v for v in (args.variants or cfg["variants"]).split(",") if v]
    deadline = t0 + cfg["budget_s"]
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "children.log")
    open(log, "w").close()
    report = dict(
        config={k: v for k, v in cfg.items()},
        variants=variants,
        host=f"{platform.node()} python {platform.python_version()}",
        preflight=None,
        correctness_planned=[],
        correctness={},
        scale={},
        torch=None,
        skipped=[],
        errors=[],
    )
    est = dict(cfg["est_s"])

    def fits(kind, label):
        left = deadline - time.time()
        if left < est[kind]:
            report["skipped"].append(
                f"{label}: skipped, {left:.0f} s of the budget left, needs ~{est[kind]:.0f} s"
            )
            return False
        return True

    def learn(kind, data):
        """The next child of a kind needs about what a complete one took."""
        if data["status"] == "ok" and not data.get("skipped") and not data.get("errors"):
            est[kind] = data["wall_s"] * 1.1
        else:
            est[kind] = max(est[kind], data["wall_s"] * 1.1)

    def place(kind, variant, data):
        if kind == "torch":
            report["torch"] = data
        else:
            report["scale" if kind == "jax_scale" else kind][variant] = data

    def save(running=None):
        finish(report, t0, running)
        return save_report(report, args.out)

    with tempfile.TemporaryDirectory(prefix="embedmesh-gpu-") as tmp:
        pre = run_child("preflight", None, cfg, tmp, deadline, cfg["cap_s"]["preflight"], log)
        report["preflight"] = pre
        backend = pre.get("backend")
        report["errors"] += [f"pre-flight: {e}" for e in pre.get("errors", [])]
        if backend != "gpu" and not args.allow_cpu:
            report["aborted"] = (
                f"pre-flight: JAX's default backend is {backend!r}, not 'gpu' (devices: "
                f"{pre.get('devices')}); nothing was run. --allow-cpu runs anyway."
            )
            if backend is None:  # it never said: the child failed or ran past its cap
                report["aborted"] += f" The pre-flight child: {pre['status']}."
        order = [] if report.get("aborted") else plan(variants, not args.skip_correctness)
        report["correctness_planned"] = [v for kind, v in order if kind == "correctness"]
        save()
        for kind, v in order:
            label = f"{'scale' if kind == 'jax_scale' else kind} [{v}]" if v else kind
            if not fits(kind, label):
                continue
            if kind != "correctness" and "batch_meta" not in cfg:
                scale_batches(cfg, report, tmp)
            if kind != "correctness" and cfg["batch_meta"] is None:
                report["skipped"].append(f"{label}: skipped, no scale batches (see Errors)")
                continue
            data = run_child(
                kind,
                v,
                cfg,
                tmp,
                deadline,
                cfg["cap_s"][kind],
                log,
                progress=lambda d, kind=kind, v=v, label=label: (place(kind, v, d), save(label)),
            )
            learn(kind, data)
            place(kind, v, data)
            save()

    exit_status = finish(report, t0)
    md = save_report(report, args.out)
    print(md, flush=True)
    return exit_status


def main(argv=None):
    p = _parser()
    args = p.parse_args(argv)
    if args.worker:
        return run_worker(args)
    if not args.out:
        p.error("--out DIR is required")
    return run_parent(args)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
