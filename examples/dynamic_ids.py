"""Why tables of raw ids matter: a click stream whose ids keep changing (issue 42).

Run: `python -m examples.dynamic_ids` (about a minute on 2 CPU cores) or
`python examples/dynamic_ids.py --quick` (a few seconds, for the tests).

The stream. Users and items are born in cohorts, one cohort a phase, live `LIFE` phases
and fade out (an id's popularity halves with each phase of age, then it is gone for
good); within the live ids popularity is heavy-tailed (Pareto weights). Every id has a
hidden truth: a bias and an 8-dimensional vector, and an event (user, item) is a click
with probability `sigmoid(c + b_u + b_i + <p_u, q_i>)`. Ids reach the model as raw 64-bit
hashes of their index (splitmix64), as a production log would carry them.

The model. `logit = c + e_u[0] + e_i[0] + <e_u[1:], e_i[1:]>`, a 9-wide embedding a
table, Adagrad on the rows, SGD on `c`, batches of 1,024 events in stream order. The
same model is trained three ways on the same events with **the same capacity**
(`CAPACITY` rows a table):

- `modulo`: the raw id modulo the table size, a plain table: what people do today;
- `lru`, `lfu`: `TableConfig(id_map=DynamicIds(eviction=...))`, the raw ids themselves.

Progressive validation: every batch is scored before the model trains on it, so each
phase's log-loss and AUC are those of the model of the stream so far on ids and events
it has not trained on yet (new ids included). `truth` is the generator's own
probabilities: the best any model can do.

The sizes, and why the difference is real. About `LIVE_FRACTION` = 0.73 of a table's
capacity is alive at any time, while the stream's whole vocabulary grows by a cohort
(a quarter of the capacity) every phase, to several times the capacity. Hashed modulo
the capacity, the live ids land on the rows like balls in bins: about half of them
share their row with another live id (1 - exp(-0.73)) and read a blend of both
truths; every new id also starts from whatever a dead id left in its row. The dynamic
map gives every live id a row of its own, starts it from a fresh initial row, and
evicts the rows of faded ids (the least recently / least frequently used) to make room:
its evictions per phase are about a cohort once the table is full. The gap is largest
in the phases after the table fills. If the live ids outgrew the capacity, the map
would evict live ids too and the gap would narrow: the map buys exactness for the ids
that fit, not more rows.

A run (2026-12-04, the 2-core host, 44 s; means over phases 1-11): AUC modulo 0.690,
lru 0.728, lfu 0.707 (truth 0.842); log-loss 0.583 / 0.569 / 0.578 (truth 0.453). LFU
without aging suits a drifting stream badly: faded ids keep their high use counts, so
the rows just given to new ids are the least frequently used and go first (165k
evictions against LRU's 16k, most of them ids still alive, admitted again).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):  # `python examples/dynamic_ids.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

DIM = 9  # the model's embedding width: a bias and 8 factors
TRUE_K = 8  # the generator's factors
LIFE = 3  # phases an id lives
LIVE_FRACTION = 0.73  # live ids / capacity (a cohort a phase, LIFE cohorts alive)
BATCH = 1024
CONTENDERS = ("modulo", "lru", "lfu")

# (capacity a table, phases, events a phase)
SIZES = {"full": (4096, 12, 40 * BATCH), "quick": (1024, 5, 8 * BATCH)}


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The ids' 64-bit hashes (as int64: any value, negative ones included)."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))).view(np.int64)


class Population:
    """One kind of id (users or items): cohorts of `cohort` ids a phase, each with a
    hidden bias and vector, a popularity weight that halves with each phase of age."""

    def __init__(self, rng, cohort: int, phases: int, salt: int):
        n = cohort * (phases + LIFE)
        self.cohort = cohort
        self.bias = rng.normal(0.0, 1.0, n)
        self.vec = rng.normal(0.0, TRUE_K**-0.25, (n, TRUE_K))
        self.weight = rng.pareto(1.2, n) + 1.0
        self.raw = splitmix64(np.arange(n, dtype=np.uint64) + np.uint64(salt << 40))

    def draw(self, rng, phase: int, size: int) -> np.ndarray:
        """`size` indices of live ids at `phase` (cohorts phase-LIFE+1 .. phase)."""
        first = max(0, phase - LIFE + 1) * self.cohort
        idx = np.arange(first, (phase + 1) * self.cohort)
        age = phase - idx // self.cohort
        p = self.weight[idx] * 0.5**age
        return rng.choice(idx, size=size, p=p / p.sum())


def make_stream(seed: int, capacity: int, phases: int, events: int):
    """Per phase: (user raw ids, item raw ids, clicks, true probabilities, new ids)."""
    rng = np.random.default_rng(seed)
    cohort = int(LIVE_FRACTION * capacity / LIFE)
    users = Population(rng, cohort, phases, salt=1)
    items = Population(rng, cohort, phases, salt=2)
    out = []
    for p in range(phases):
        u, i = users.draw(rng, p, events), items.draw(rng, p, events)
        logit = -1.0 + users.bias[u] + items.bias[i] + (users.vec[u] * items.vec[i]).sum(1)
        prob = 1.0 / (1.0 + np.exp(-logit))
        click = (rng.random(events) < prob).astype(np.float32)
        out.append((users.raw[u], items.raw[i], click, prob, 2 * cohort))
    return out


def log_loss(y: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def auc(y: np.ndarray, p: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties averaged)."""
    order = np.argsort(p, kind="stable")
    ranks = np.empty(p.size)
    sp = p[order]
    ranks[order] = np.arange(1, p.size + 1)
    # average the ranks of tied scores
    _, first, counts = np.unique(sp, return_index=True, return_counts=True)
    for f, c in zip(first[counts > 1], counts[counts > 1]):
        ranks[order[f : f + c]] = f + (c + 1) / 2
    pos = y > 0.5
    n1, n0 = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


class Contender:
    """The model on one kind of table; `step` scores a batch, then trains on it."""

    def __init__(self, kind: str, capacity: int, seed: int):
        import jax
        import jax.numpy as jnp

        import embedmesh as em

        self.kind = kind
        self.capacity = capacity
        id_map = None if kind == "modulo" else em.DynamicIds(eviction=kind, admit_after=1)

        def init(key, shape, dtype):  # small random rows (a fresh row of the map too)
            return 0.1 * jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype)

        tables = {
            name: em.TableConfig(
                capacity,
                DIM,
                initializer=init,
                combiner="sum",
                name=name,
                id_map=id_map,
            )
            for name in ("user", "item")
        }
        features = {n: em.FeatureConfig(t, name=n) for n, t in tables.items()}
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))  # one device
        self.emb = em.MeshEmbedding(
            features,
            em.Adagrad(0.1),
            mesh=mesh,
            seed=seed,
            capacities=em.Capacity(2 * BATCH, 2 * BATCH),  # both tables may share a stack
        )
        self.emb.build()
        self.bias = jnp.zeros((), jnp.float32)

        def loss(acts, bias, y):
            u, i = acts["user"], acts["item"]
            logit = bias + u[:, 0] + i[:, 0] + (u[:, 1:] * i[:, 1:]).sum(1)
            per = jnp.maximum(logit, 0) - logit * y + jnp.log1p(jnp.exp(-jnp.abs(logit)))
            return per.sum(), jax.nn.sigmoid(logit)  # summed: O(1) gradients a row

        grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)

        @jax.jit
        def train(acts, bias, y):
            (_, prob), (g_acts, g_bias) = grad(acts, bias, y)
            return prob, g_acts, bias - 0.05 * g_bias / y.shape[0]

        self._train = train
        self.admissions = self.evictions = 0

    def step(self, users: np.ndarray, items: np.ndarray, y: np.ndarray) -> np.ndarray:
        import embedmesh as em

        if self.kind == "modulo":
            cap = np.uint64(self.capacity)
            users = (users.view(np.uint64) % cap).astype(np.int64)
            items = (items.view(np.uint64) % cap).astype(np.int64)
        splits = np.arange(users.size + 1)
        feats = {"user": em.RaggedTensor(users, splits), "item": em.RaggedTensor(items, splits)}
        acts, preserved = self.emb(feats)
        prob, g_acts, self.bias = self._train(acts, self.bias, y)
        self.emb.apply_gradients(g_acts, preserved)
        if self.kind != "modulo":
            stats = self.emb.last_stats
            for name in ("user", "item"):
                self.admissions += stats[name].id_map["admissions"]
                self.evictions += stats[name].id_map["evictions"]
        return np.asarray(prob)


def run(args) -> dict:
    capacity, phases, events = SIZES["quick" if args.quick else "full"]
    stream = make_stream(args.seed, capacity, phases, events)
    contenders = [Contender(k, capacity, args.seed) for k in args.contenders]
    cohort = stream[0][4] // 2
    print(
        f"capacity {capacity} rows a table (user, item), dim {DIM}; a cohort of {cohort} new "
        f"ids a kind a phase, each alive {LIFE} phases (~{LIFE * cohort} live = "
        f"{LIFE * cohort / capacity:.2f} of the capacity); {phases} phases x {events:,} "
        f"events; batches of {BATCH}, each scored before it is trained on"
    )
    names = ["truth", *args.contenders]
    head = " | ".join(f"{n:>6s}" for n in names)
    print(
        f"\nphase | ids seen | log-loss: {head} | AUC: {head} | evictions: "
        + " | ".join(f"{n:>6s}" for n in args.contenders if n != "modulo")
    )
    per_phase = {n: [] for n in names}
    seen = 0
    t0 = time.perf_counter()
    for p, (users, items, y, prob, new) in enumerate(stream):
        seen += new
        preds = {"truth": prob}
        evicted = {}
        for c in contenders:
            before = c.evictions
            out = []
            for s in range(0, events, BATCH):
                sl = slice(s, s + BATCH)
                out.append(c.step(users[sl], items[sl], y[sl]))
            preds[c.kind] = np.concatenate(out)
            evicted[c.kind] = c.evictions - before
        row = {n: (log_loss(y, preds[n]), auc(y, preds[n])) for n in names}
        for n in names:
            per_phase[n].append(row[n])
        ll = " | ".join(f"{row[n][0]:6.4f}" for n in names)
        au = " | ".join(f"{row[n][1]:6.4f}" for n in names)
        ev = " | ".join(f"{evicted[n]:6d}" for n in args.contenders if n != "modulo")
        print(f"{p:5d} | {seen:8d} | log-loss: {ll} | AUC: {au} | evictions: {ev}")
    print(f"({time.perf_counter() - t0:.0f} s)")

    # the summary: phases 1.. (phase 0 is every contender's cold start)
    print(
        f"\nsummary over phases 1-{phases - 1} (progressive validation; {seen} ids in all, "
        f"capacity {capacity} a table)"
    )
    print("contender | log-loss | AUC    | admissions | evictions")
    summary = {}
    by_kind = {c.kind: c for c in contenders}
    for n in names:
        ll = float(np.mean([r[0] for r in per_phase[n][1:]]))
        au = float(np.mean([r[1] for r in per_phase[n][1:]]))
        c = by_kind.get(n)
        adm = "-" if c is None or n == "modulo" else str(c.admissions)
        ev = "-" if c is None or n == "modulo" else str(c.evictions)
        summary[n] = (ll, au)
        print(f"{n:9s} | {ll:8.4f} | {au:6.4f} | {adm:>10s} | {ev:>9s}")
    return summary


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small stream (seconds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        type=lambda s: s.split(","),
        help="a comma-separated subset of " + ",".join(CONTENDERS),
    )
    return ap.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
