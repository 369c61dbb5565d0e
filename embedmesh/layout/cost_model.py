"""A cost model of one training step of sharded embedding tables, and the planner's core.

Pure Python + numpy (no jax): what each sharding strategy moves and touches per device
per step, a step-time model fed by a `Machine`'s measured (or datasheet) constants, and
`plan_tables`, which picks a strategy per table.

Notation (per table, per step): N devices, b samples per device (the global batch is
N*b), L ids per sample (pooling factor), D dim, e bytes per element, rb = D*e bytes per
row, s optimizer slot tables (Adagrad: 1), V rows, 4-byte ids. `u(n)` is the expected
number of distinct ids among n ids of the table (`expected_unique`); `u_loc = u(b*L)`
(one device's batch), `u_glob = u(N*b*L)` (the global batch). All-to-all traffic is
counted without the block a device keeps for itself, so an even split over N owners
sends the fraction (N-1)/N. Pooled tables give one output row per sample, sequence
tables one per id (`out = b` or `b*L`).

What each strategy moves (per device, per step; `Load.fwd` / `Load.bwd` hold sent and
received bytes; an "owner" holds rows, a "source" holds a batch slice; in the
sharded strategies every device is both, in the placed ones the owners are a subset
and each other device is only a source):

  data_parallel   replicated table. fwd: nothing. bwd: the gradients are synchronised
                  either as a *sparse all-gather* of every device's touched rows
                  (ids + rows: sends u_loc*(4+rb) to each of N-1 peers, receives the
                  same from each; each replica then merges and applies the update to
                  all u_glob touched rows; the lookup reads u_loc distinct rows
                  from memory, its other pairs cost as buffer pairs) or as a *dense
                  ring all-reduce* of a [V, D]
                  gradient (sends and receives 2(N-1)/N * V*rb; every replica updates
                  all V rows). The cheaper of the two (by predicted time) is taken and
                  named in `StrategyCost.variant`. Memory: V*rb*(1+s) on every device
                  (+ V*rb for the dense gradient).
  table_wise      the whole table on one owner. fwd: each source sends its b*L ids (+ b
                  lengths) to the owner, the owner pools all N*b*L pairs and returns
                  [out, D] to each source. bwd: each source sends its [out, D]
                  activation gradients to the owner, which keeps the ids and pairs
                  from the lookup and updates u_glob rows.
  row_wise_rows   today's mod sharding (`embedmesh.layout.rows.ModRowLayout`). fwd: each
                  source sends its distinct ids to their owners (u_loc*(N-1)/N ids), the
                  owners gather those rows and send them back (u_loc*(N-1)/N rows), the
                  source combines its b*L pairs from them. bwd: the source sums its
                  activation gradients per distinct id and sends them to the owners
                  with the ids again (today's reference path re-exchanges the ids:
                  u_loc*(N-1)/N ids + rows); each owner merges N lists and updates its
                  u_glob/N distinct rows. With in-process CPU devices (`Link.zero_copy`)
                  the kernels read the peers' tables, pairs and gradients in place: the
                  same bytes are *logically* moved, nothing is copied, and the source
                  combines its pairs straight from the owners' tables.
  row_wise_pooled TorchRec's row-wise. fwd: each source sends its b*L*(N-1)/N ids (+ b
                  lengths per owner) to the owners, each owner pools its pairs into a
                  partial [out, D] per source and sends it back (a reduce-scatter:
                  (N-1)*out*rb each way, independent of V). bwd: every owner needs the
                  source's full [out, D] activation gradients ((N-1)*out*rb each way;
                  the ids and pairs stay with the owners from the lookup); owners
                  update u_glob/N rows.
  column_wise     the D columns split into k shards of D/k on k owners (default
                  k = min(N, D // 16)). fwd: each source sends its b*L ids (+ lengths)
                  to every column owner; each owner pools all N*b*L pairs of its columns
                  and returns [out, D/k] to each source. bwd: [out, D/k] activation
                  gradients to each column owner, which updates u_glob rows of width
                  D/k. (Per-element optimizers only: a per-row statistic such as
                  row-wise Adagrad's would need one more reduction over the k owners.)
  table_row_wise  row-wise within a group of G devices (one host: `devices_per_host`),
                  pooled: every source sends each id to the group member owning its
                  row (inter-host), members pool [N*out, D] partials, reduce-scatter them
                  inside the group (intra: (G-1)/G*N*out*rb) and send each source the
                  summed slice it owns (inter: N*out/G*rb). bwd mirrors it (activation
                  gradients in over the inter link, all-gathered in the group); members
                  update u_glob/G rows.

Step time of a device (a model, not a measurement):

  t = compute + exchange + overhead
  compute  = table_reads * t_read(rb) + buffer_pairs * t_pair(rb)
             + rows_updated * t_update(rb, s) + bytes_written / mem_bw
  t_read   = read_row_s + rb / mem_bw            (a random row of a table)
  t_pair   = pair_row_s + rb / mem_bw            (a pair's row in a local buffer: combine,
                                                  per-pair gradients, merges)
  t_update = (1+s) * (update_row_s + 2*rb / mem_bw)   (read-modify-write table + slots)
  exchange = sum over phases of max(sent, recv)_intra / intra.bandwidth
             + max(sent, recv)_inter / inter.bandwidth
             + collectives * (latency + per_peer * (peers - 1))
  overhead = step_overhead_s (per device program and step)

Links are full duplex (a phase costs its busier direction); intra- and inter-host
traffic do not overlap (conservative); a zero-copy link costs only its latency (the
bytes are read in place and their reads are in `compute`). With `host_shared` (N
in-process devices on one host's cores, as the CPU benchmark runs) the devices'
compute and overheads add up instead of running in parallel. Compute and exchange do
not overlap. Not modelled: the dense part of a model (MLPs; `Machine.dense_flops`
is only a separate helper), padding of the exchange buffers to a static capacity,
host preprocessing, caches beyond what the calibration constants absorb, contention
in the network beyond the per-link bandwidth, stragglers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

__all__ = [
    "PLACED",
    "STRATEGIES",
    "Link",
    "Load",
    "Machine",
    "Plan",
    "StrategyCost",
    "TableStats",
    "Traffic",
    "expected_unique",
    "plan_step_time",
    "plan_tables",
    "step_time",
    "strategy_cost",
    "table_wise_placement",
    "zipf_unique",
]

ID_BYTES = 4  # int32 ids and lengths
# A pair on its way to a pooling owner (`shard_program.lookup_pooled`): its id's position
# and its row in one int32, its gain; sent in the lookup and again in the update, with
# the source's distinct ids.
PAIR_BYTES = 8
STRATEGIES = (
    "data_parallel",
    "table_wise",
    "row_wise_rows",
    "row_wise_pooled",
    "column_wise",
    "table_row_wise",
)
PLACED = ("table_wise", "column_wise", "table_row_wise")  # the owners are a subset

# Below this many ranks `zipf_unique` sums exactly; above, exact head + integral tail.
EXACT_RANKS = 1 << 20
HEAD_RANKS = 1 << 16


# ---------------------------------------------------------------------------
# Tables and distinct ids


@dataclasses.dataclass(frozen=True)
class TableStats:
    """What the model needs of one table (one feature looks it up).

    `ids_per_sample`: the pooling factor L (mean ids per sample). Ids are drawn i.i.d.
    from Zipf(`zipf_a`) over the `rows` ranks (uniform when `zipf_a` is 0), in groups
    of `hot_group` ids fixed by one draw (MLPerf's synthetic multi-hot Criteo: each
    one-hot id expands to `multi_hot_size` ids by fixed offsets, so distinct ids are
    `hot_group` times the distinct draws); or `unique_fn(n_ids)` gives the expected
    distinct ids directly. `pooled`: combined to one row per sample (sum/mean/sqrtn),
    else a sequence feature (one output row per id)."""

    name: str
    rows: int
    dim: int
    bytes_per_element: int = 4
    slots: int = 1
    ids_per_sample: float = 1.0
    zipf_a: float = 1.05
    hot_group: int = 1
    unique_fn: Callable[[float], float] | None = None
    pooled: bool = True
    outputs_per_sample: float | None = None  # output rows a sample gives; None: 1 or L

    def __post_init__(self):
        if self.rows < 1 or self.dim < 1 or self.bytes_per_element < 1 or self.slots < 0:
            raise ValueError(f"table {self.name!r}: rows, dim, bytes >= 1 and slots >= 0")
        if self.ids_per_sample < 0 or self.zipf_a < 0 or self.hot_group < 1:
            raise ValueError(f"table {self.name!r}: ids_per_sample, zipf_a >= 0, hot_group >= 1")

    @property
    def row_bytes(self) -> int:
        return self.dim * self.bytes_per_element

    @property
    def table_bytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def state_bytes(self) -> int:
        """Table + optimizer slots."""
        return self.table_bytes * (1 + self.slots)


def _zipf_weights(v: np.ndarray, a: float) -> np.ndarray:
    return np.exp(-a * np.log(v))


@functools.lru_cache(maxsize=64)
def _log_miss(num_ranks: int, a: float, count: int) -> tuple:
    """(log(1 - p_v) for v = 1..count, sum of those p_v): the exact head, cached."""
    p = _zipf_weights(np.arange(1, count + 1, dtype=np.float64), a) / _zipf_norm(num_ranks, a)
    with np.errstate(divide="ignore"):  # p = 1 (one rank): log 0 = -inf, exact
        out = np.log1p(-np.minimum(p, 1.0))
    out.setflags(write=False)
    return out, float(p.sum())


@functools.lru_cache(maxsize=256)
def _zipf_norm(num_ranks: int, a: float) -> float:
    """H(V, a) = sum_{v=1}^V v^-a: exact to EXACT_RANKS, then Euler-Maclaurin."""
    if num_ranks <= EXACT_RANKS:
        return float(_zipf_weights(np.arange(1, num_ranks + 1, dtype=np.float64), a).sum())
    k = HEAD_RANKS
    head = float(_zipf_weights(np.arange(1, k + 1, dtype=np.float64), a).sum())
    # sum_{v=k+1}^{V} v^-a = int_{k}^{V} x^-a dx + (V^-a - k^-a)/2 + a/12 (k^-a-1 - V^-a-1) ...
    if abs(a - 1.0) < 1e-12:
        integral = math.log(num_ranks / k)
    else:
        integral = (num_ranks ** (1 - a) - k ** (1 - a)) / (1 - a)
    corr = (num_ranks**-a - k**-a) / 2 + a / 12 * (k ** (-a - 1) - num_ranks ** (-a - 1))
    return head + integral + corr


def _distinct_terms(n: float, p):
    """1 - (1-p)^n, accurately for tiny p."""
    with np.errstate(divide="ignore"):
        return -np.expm1(n * np.log1p(-p))


def zipf_unique(num_ranks: int, a: float, n: float, *, with_bound: bool = False):
    """Expected distinct values among `n` i.i.d. draws from Zipf(a) over `num_ranks`
    ranks (P(v) ∝ v^-a, v = 1..V; a = 0 is uniform): sum_v 1 - (1 - p_v)^n.

    Exact (vectorised) for V <= EXACT_RANKS. Above, exact over the head
    v <= HEAD_RANKS and, for the tail, with f(x) = 1 - exp(-n p(x)) decreasing in x:
    sum_{k<v<=V} f(v) lies in [I + f(V), I + f(k+1)] with I = int_{k+1}^{V} f, so the
    midpoint is taken, error <= (f(k+1) - f(V))/2 <= 1/2; replacing (1-p)^n by
    exp(-np) adds at most n * p_{k+1} * (tail mass) (since exp(-np) - (1-p)^n <= n p^2
    for p <= 1/2). I is integrated in log x with composite Simpson (4096 panels of a
    smooth integrand: numerically exact at this scale). `with_bound`: also return that
    bound (0 when exact)."""
    if n <= 0 or num_ranks < 1:
        return (0.0, 0.0) if with_bound else 0.0
    if a == 0:
        value = min(n, num_ranks * float(_distinct_terms(n, np.float64(1.0 / num_ranks))))
        return (value, 0.0) if with_bound else value
    norm = _zipf_norm(num_ranks, a)
    if num_ranks <= EXACT_RANKS:
        log_miss, _ = _log_miss(num_ranks, a, num_ranks)
        with np.errstate(invalid="ignore"):
            value = min(n, float(-np.expm1(n * log_miss).sum()))  # n < 1: a mean count
        return (value, 0.0) if with_bound else value
    k = HEAD_RANKS
    log_miss, head_mass = _log_miss(num_ranks, a, k)
    head = float(-np.expm1(n * log_miss).sum())

    def f(x):
        return -np.expm1(-n * _zipf_weights(x, a) / norm)

    lo, hi = math.log(k + 1), math.log(num_ranks)
    panels = 4096
    t = np.linspace(lo, hi, 2 * panels + 1)
    x = np.exp(t)
    y = f(x) * x  # dx = x dt
    h = (hi - lo) / (2 * panels)
    integral = float(h / 3 * (y[0] + y[-1] + 4 * y[1:-1:2].sum() + 2 * y[2:-1:2].sum()))
    f_first, f_last = float(f(np.float64(k + 1))), float(f(np.float64(num_ranks)))
    tail = integral + (f_first + f_last) / 2
    p_first = (k + 1) ** -a / norm
    tail_mass = max(0.0, 1.0 - head_mass)
    bound = (f_first - f_last) / 2 + n * p_first * tail_mass
    value = min(float(num_ranks), n, head + tail)
    return (value, bound) if with_bound else value


def expected_unique(stats: TableStats, n_ids: float) -> float:
    """Expected distinct ids of the table among `n_ids` ids (see `TableStats`)."""
    if n_ids <= 0:
        return 0.0
    if stats.unique_fn is not None:
        return float(min(stats.rows, stats.unique_fn(n_ids)))
    g = stats.hot_group
    return float(min(stats.rows, g * zipf_unique(stats.rows, stats.zipf_a, n_ids / g)))


# ---------------------------------------------------------------------------
# Machines


@dataclasses.dataclass(frozen=True)
class Link:
    """One transport: bytes/s per direction per device, the latency of one collective
    (`latency_s + per_peer_s * (peers - 1)`), and whether it copies at all."""

    name: str
    bandwidth: float
    latency_s: float
    per_peer_s: float = 0.0
    zero_copy: bool = False
    source: str = ""

    def latency(self, peers: int) -> float:
        return self.latency_s + self.per_peer_s * max(0, peers - 1)


@dataclasses.dataclass(frozen=True)
class Machine:
    """The constants of the step-time model (see the module docstring). `intra`
    connects the `devices_per_host` devices of a host, `inter` the hosts.
    `host_shared`: the devices share one host's cores (in-process CPU devices), so
    their compute adds up. `notes`: where each figure came from."""

    name: str
    read_row_s: float
    pair_row_s: float
    update_row_s: float
    mem_bw: float
    memory_per_device: float
    devices_per_host: int
    intra: Link
    inter: Link
    step_overhead_s: float = 0.0
    host_shared: bool = False
    dense_flops: float | None = None
    notes: tuple = ()

    # -- the three machines -------------------------------------------------

    @staticmethod
    def this_cpu(transport: str = "shm", **changes) -> Machine:
        """This 2-core AMD EPYC VM (23 GiB), N in-process CPU devices sharing its cores.

        Compute constants from table 3 of the training benchmark's history,
        `benchmarks/runs/train-history.md` ("Where the time goes": 1 device, 256-byte rows):
        combining pairs from a [U, D] buffer 5.4 ms
        (17.5 ns a pair, less 9.5 ns of bytes at 27 GB/s: pair_row_s 8 ns); combining
        308,894 pairs straight from the table 8.8 ms, where a lookup reads each distinct
        row from memory once and finds it in cache for its other pairs: the model's
        111,915 distinct rows (measured: 117,295) at t_read and the other pairs at
        t_pair give read_row_s 38 ns (a cold 256-byte row, 47.5 ns with its bytes: near
        the 40 ns measured in `benchmarks/runs/serving-history.md`);
        the fused backward + dedup + Adagrad update 16.8 ms = 308,894 pairs x 17.5 ns +
        117,295 rows x 97 ns, i.e. 48.5 ns per table-or-slot row (update_row_s 29.5 ns
        plus 2 x 256 B at 27 GB/s). mem_bw 27 GB/s: the write floor measured in
        `benchmarks/runs/serving-history.md`. Two constants are fitted (non-negative least
        squares, `benchmarks/scale/simulate.py --calibrate`) to the 1/2/4-device medians of
        `benchmarks/runs/train_run_2026-12-01_ndev.txt` (26.3 / 27.0 / 30.8 ms): step_overhead_s
        (per device program) came out 0 (table 3's kernels alone already predict
        26.7 ms at N=1), the shm link's per_peer_s 240 us per collective per extra
        device (4 collectives a step: ~1.0 ms per extra device, which lumps the
        rendezvous with N device programs contending for the 2 cores). Noise: the
        per-round medians of that run spread by 2-5 ms.

        `transport`: "shm" (the shared-memory kernels: zero copy), "host_shm" (2+
        processes on this host, each device's blocks copied through shared memory:
        measured 2026-12-02, `benchmarks/scale/host_link.py`, 2.5 GB/s and 20 us a call for
        messages of 0.26-4 MB; 8-16 MB ones ran at 1.0-1.8 GB/s),
        "xla" (XLA's CPU
        all_to_all in process: ~1.4 GB/s, `ops/cpu/exchange.cc`), "gloo" (2+
        processes on this host over loopback TCP: measured 2026-12-01, an all_to_all of
        [2, 60000, 64] float32 between 2 processes pinned to a core each in 71 ms, so
        14.7 MB sent per process: 0.21 GB/s; latency assumed 100 us)."""
        links = {
            "shm": Link(
                "in-process shared memory (zero copy)",
                27e9,
                0.0,
                per_peer_s=240e-6,
                zero_copy=True,
                source="latency fitted to runs/train_run_2026-12-01_ndev.txt",
            ),
            "xla": Link(
                "XLA CPU all_to_all in process",
                1.4e9,
                100e-6,
                source="embedmesh/device/ops/cpu/exchange.cc: ~1.4 GB/s; latency assumed",
            ),
            "host_shm": Link(
                "processes on one host, POSIX shared memory (two copies)",
                2.5e9,
                20e-6,
                source="measured 2026-12-02 (benchmarks/scale/host_link.py: ops.exchange between 2 "
                "pinned processes, 0.26-4 MB sent: 2.5 GB/s fitted; a 4 KB call 20 us)",
            ),
            "gloo": Link(
                "gloo, processes on one host (loopback TCP)",
                0.21e9,
                100e-6,
                source="measured 2026-12-01 (all_to_all between 2 processes); latency assumed",
            ),
        }
        link = links[transport]
        base = Machine(
            name=f"this CPU ({transport})",
            read_row_s=38e-9,
            pair_row_s=8e-9,
            update_row_s=29.5e-9,
            mem_bw=27e9,
            memory_per_device=23 * 2**30,
            devices_per_host=1 << 30,
            intra=link,
            inter=link,
            step_overhead_s=0.0,
            host_shared=True,
            notes=(
                "read/pair/update row costs: runs/train-history.md table 3 (1 device)",
                "mem_bw 27 GB/s: runs/serving-history.md write floor",
                "step_overhead_s, shm latency: fitted to train_run_2026-12-01_ndev.txt",
                f"link: {link.source}",
            ),
        )
        return dataclasses.replace(base, **changes)

    @staticmethod
    def h100_cluster(**changes) -> Machine:
        """DGX H100 nodes (8 GPUs, NVLink4, 8x ConnectX-7 400 Gb/s per node): a
        PROJECTION from datasheet figures, not measured here. HBM3 3.35 TB/s, taken as
        2.0 TB/s effective for random 256-512 B rows (~60%: an assumption); per-row
        fixed costs ~0 (latency hidden by the GPU's parallelism; 0.2 ns assumed);
        NVLink 450 GB/s per direction, ~70% achieved in all-to-all (315 GB/s); IB NDR
        50 GB/s per GPU per direction, ~80% (40 GB/s); NCCL latency 15 us intra,
        25 us + 0.3 us per peer inter (assumptions, from typical nccl-tests small-message
        figures); 80 GB HBM; dense 400 TFLOP/s achieved bf16 (~40% of 989 peak)."""
        base = Machine(
            name="DGX H100 cluster (projection)",
            read_row_s=0.2e-9,
            pair_row_s=0.1e-9,
            update_row_s=0.2e-9,
            mem_bw=2.0e12,
            memory_per_device=80e9,
            devices_per_host=8,
            intra=Link("NCCL NVLink4", 315e9, 15e-6, 0.1e-6, source="datasheet x 0.7"),
            inter=Link("NCCL InfiniBand NDR", 40e9, 25e-6, 0.3e-6, source="datasheet x 0.8"),
            step_overhead_s=50e-6,
            dense_flops=400e12,
            notes=("projection from datasheets; every constant an assumption",),
        )
        return dataclasses.replace(base, **changes)

    @staticmethod
    def h200(**changes) -> Machine:
        """H200 nodes: as `h100_cluster` with HBM3e 4.8 TB/s (2.9 TB/s effective) and
        141 GB per GPU; links alike (a projection)."""
        return dataclasses.replace(
            Machine.h100_cluster(),
            name="H200 cluster (projection)",
            mem_bw=2.9e12,
            memory_per_device=141e9,
            **changes,
        )

    @staticmethod
    def tpu_v5e(shape: tuple = (1, 1), **changes) -> Machine:
        """TPU v5e chips of a slice of `shape` (chips along each ICI axis, e.g. (4, 4)).

        Row costs from one v5e chip (benchmarks/RESULTS_tpu.md, rows moved a DMA each:
        gather 42.6 M rows/s, in-place scatter 48.8 M rows/s; a pair's row read from VMEM
        and summed ~8 ns): read_row_s 23.5 ns, pair_row_s 8 ns, update_row_s 22 ns a
        table-or-slot row (a gather and a scatter of a row with its slot in it, 44 ns,
        over its 2 arrays); `benchmarks/tpu_scale.py` measures them again in its own run
        and passes them here. HBM: 16 GB at 819 GB/s, 15.7 GiB usable (Google Cloud's
        v5e page; the chip reports 15.7 GiB). ICI: 400 GB/s bidirectional per chip over 4
        ports (the same page), so 50 GB/s per port per direction. Every chip of a slice
        is on the ICI (one link, whatever the host). An all-to-all over an a x b slice
        (b the longer side) is bound by its bisection when the slice is a mesh: a links
        cross the middle, the half of every chip's bytes bound for the other side
        crosses them, so a chip's bytes go at 4 * 50 / b GB/s (no wraparound assumed:
        conservative; a torus doubles it). Latency 10 us a collective (an assumption)."""
        dims = sorted(int(x) for x in shape if int(x) > 1) or [1]
        port = 50e9
        bandwidth = 4 * port / dims[-1] if dims[-1] > 1 else 4 * port
        ici = Link(
            f"ICI {'x'.join(map(str, shape))}",
            bandwidth,
            10e-6,
            source="cloud.google.com/tpu/docs/v5e: 400 GB/s bidirectional ICI per chip, "
            "4 ports; all-to-all at the bisection of a mesh (no wraparound)",
        )
        base = Machine(
            name=f"TPU v5e {'x'.join(map(str, shape))}",
            read_row_s=23.5e-9,
            pair_row_s=8e-9,
            update_row_s=22e-9,
            mem_bw=819e9,
            memory_per_device=15.7 * 2**30,
            devices_per_host=1 << 30,  # the ICI spans the slice
            intra=ici,
            inter=ici,
            step_overhead_s=0.0,
            notes=(
                "row costs: benchmarks/RESULTS_tpu.md (one v5e chip)",
                "HBM and ICI: cloud.google.com/tpu/docs/v5e",
                f"link: {ici.source}",
            ),
        )
        return dataclasses.replace(base, **changes)

    # -- model pieces -------------------------------------------------------

    def t_read(self, row_bytes: float) -> float:
        return self.read_row_s + row_bytes / self.mem_bw

    def t_pair(self, row_bytes: float) -> float:
        return self.pair_row_s + row_bytes / self.mem_bw

    def t_update(self, row_bytes: float, slots: int) -> float:
        return (1 + slots) * (self.update_row_s + 2 * row_bytes / self.mem_bw)


# ---------------------------------------------------------------------------
# What a strategy moves


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Network bytes of one direction of the step (forward or backward), one device."""

    sent_intra: float = 0.0
    sent_inter: float = 0.0
    recv_intra: float = 0.0
    recv_inter: float = 0.0
    collectives: int = 0
    peers: int = 1  # participants of the widest collective (for the per-peer latency)

    @property
    def sent(self) -> float:
        return self.sent_intra + self.sent_inter

    @property
    def recv(self) -> float:
        return self.recv_intra + self.recv_inter

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.sent_intra + other.sent_intra,
            self.sent_inter + other.sent_inter,
            self.recv_intra + other.recv_intra,
            self.recv_inter + other.recv_inter,
            self.collectives + other.collectives,
            max(self.peers, other.peers),
        )


def _split(sent: float, recv: float, participants: int, per_host: int, **kw) -> Traffic:
    """An all-to-all among `participants` devices spread over hosts of `per_host`: the
    share of the peers on the same host goes over the intra link."""
    if participants <= 1:  # nothing to exchange, no collective
        return Traffic()
    f_intra = (min(participants, per_host) - 1) / (participants - 1)
    return Traffic(
        sent * f_intra,
        sent * (1 - f_intra),
        recv * f_intra,
        recv * (1 - f_intra),
        peers=participants,
        **kw,
    )


@dataclasses.dataclass(frozen=True)
class Load:
    """One device's share of a table's step: traffic and memory work."""

    fwd: Traffic = Traffic()
    bwd: Traffic = Traffic()
    table_reads: float = 0.0  # random rows read from a table
    buffer_pairs: float = 0.0  # pair rows read from local buffers (combine, grads, merges)
    rows_updated: float = 0.0  # distinct rows updated (each with its slots)
    bytes_written: float = 0.0  # outputs, partials, dense gradients
    row_bytes: float = 0.0  # width of the rows touched (D/k for column shards)
    memory: float = 0.0  # table + slots (+ buffers the strategy keeps) held

    @property
    def bytes_sent(self) -> float:
        return self.fwd.sent + self.bwd.sent

    @property
    def bytes_recv(self) -> float:
        return self.fwd.recv + self.bwd.recv


@dataclasses.dataclass(frozen=True)
class StrategyCost:
    """A table under one strategy on N devices. `owner`: the whole step of a device
    holding (part of) the table, its own batch slice included; `source`: a device that
    only looks it up (equal to `owner` for the sharded strategies, where every device
    holds a share). `owners`: how many devices hold it (for table_row_wise, its group).
    `variant`: the data-parallel gradient sync chosen ("sparse"/"dense")."""

    strategy: str
    table: str
    num_devices: int
    batch_per_device: int
    owners: int
    owner: Load
    source: Load
    variant: str = ""

    @property
    def placed(self) -> bool:
        return self.strategy in PLACED and self.owners < self.num_devices


def _outputs(t: TableStats, b: int, pairs: float) -> float:
    """Output rows of b samples: one per sample (pooled) or per id, unless given (a table
    that several features read gives one row per feature)."""
    if t.outputs_per_sample is not None:
        return b * t.outputs_per_sample
    return b if t.pooled else pairs


def _pair_reads(pairs: float, distinct: float) -> tuple[float, float]:
    """(cold table reads, pair reads from cache) of `pairs` lookups of `distinct` rows:
    each distinct row comes from memory once, the other pairs find it again (so a
    16-row table read 40 times a sample costs pair reads, not 40 cold rows)."""
    cold = min(distinct, pairs)
    return cold, pairs - cold


def _dp(t: TableStats, n: int, b: int, m: Machine, variant: str | None = None) -> StrategyCost:
    L, rb = t.ids_per_sample, t.row_bytes
    pairs = b * L
    u_loc, u_glob = expected_unique(t, pairs), expected_unique(t, n * pairs)
    out = _outputs(t, b, pairs)
    fwd = Traffic()
    mem = t.state_bytes
    cold, hot = _pair_reads(pairs, u_loc)  # the lookup, from the device's own replica
    if n == 1:
        load = Load(fwd, Traffic(), cold, hot + pairs, u_loc, out * rb, rb, mem)
        return StrategyCost("data_parallel", t.name, n, b, 1, load, load, "none")
    g = m.devices_per_host
    chunk = u_loc * (ID_BYTES + rb)
    sparse = Load(
        fwd,
        _split((n - 1) * chunk, (n - 1) * chunk, n, g, collectives=1),
        cold,
        hot + pairs + n * u_loc,  # combine, per-pair grads, merge the N lists
        u_glob,
        out * rb + n * chunk,
        rb,
        mem,
    )
    ring = 2 * (n - 1) / n * t.table_bytes
    dense = Load(
        fwd,
        _split(ring, ring, n, g, collectives=1),
        cold,
        hot + pairs,
        t.rows,
        out * rb + 2 * t.table_bytes,  # zero + accumulate the dense gradient
        rb,
        mem + t.table_bytes,
    )
    costs = {
        "sparse": StrategyCost("data_parallel", t.name, n, b, n, sparse, sparse, "sparse"),
        "dense": StrategyCost("data_parallel", t.name, n, b, n, dense, dense, "dense"),
    }
    if variant is not None:
        return costs[variant]
    return min(costs.values(), key=lambda c: _load_time(c.owner, t.slots, m))


def _table_wise(t: TableStats, n: int, b: int, m: Machine) -> StrategyCost:
    L, rb = t.ids_per_sample, t.row_bytes
    pairs = b * L
    out = _outputs(t, b, pairs)
    u_glob = expected_unique(t, n * pairs)
    g = m.devices_per_host
    # pairs + distinct ids, in the lookup (the update keeps the owner's view of them)
    ids = pairs * PAIR_BYTES + expected_unique(t, pairs) * ID_BYTES
    # the owner: receives N-1 slices' ids, sends N-1 outputs; its own slice stays local
    cold, hot = _pair_reads(n * pairs, u_glob)
    owner = Load(
        _split((n - 1) * out * rb, (n - 1) * ids, n, g, collectives=2),
        _split(0.0, (n - 1) * out * rb, n, g, collectives=1),
        cold,
        hot + n * pairs,
        u_glob,
        n * out * rb,
        rb,
        t.state_bytes,
    )
    source = Load(
        _split(ids, out * rb, n, g, collectives=2),
        _split(out * rb, 0.0, n, g, collectives=1),
        0.0,
        0.0,
        0.0,
        0.0,
        rb,
        0.0,
    )
    if n == 1:
        source = owner
    return StrategyCost("table_wise", t.name, n, b, 1, owner, source)


def _row_wise_rows(t: TableStats, n: int, b: int, m: Machine) -> StrategyCost:
    L, rb = t.ids_per_sample, t.row_bytes
    pairs = b * L
    out = _outputs(t, b, pairs)
    u_loc, u_glob = expected_unique(t, pairs), expected_unique(t, n * pairs)
    mem = math.ceil(t.rows / n) * rb * (1 + t.slots)
    cold, hot = _pair_reads(pairs, u_loc)
    if n == 1:
        load = Load(Traffic(), Traffic(), cold, hot + pairs, u_loc, out * rb, rb, mem)
        return StrategyCost("row_wise_rows", t.name, n, b, 1, load, load)
    g = m.devices_per_host
    remote = u_loc * (n - 1) / n  # distinct ids of this slice owned by others
    fwd_bytes = remote * (ID_BYTES + rb)
    bwd_bytes = remote * (ID_BYTES + rb)
    if m.intra.zero_copy and n <= g:
        # the shared-memory kernels: the source combines its pairs straight from the
        # owners' tables; each owner reads its sources' pairs and gradients in place:
        # nothing is copied (the reads are the table reads and pairs counted here)
        reads, buffer = cold, hot + pairs
        written = out * rb
        fwd_bytes = bwd_bytes = 0.0
    else:
        # owners gather the distinct rows asked of them (u_loc from N sources of
        # u_loc/N each); the source combines pairs from them, sums gradients per
        # distinct id; the owner merges N lists of u_loc/N
        reads, buffer = u_loc, 2 * pairs + u_loc
        written = out * rb + 2 * u_loc * rb
    load = Load(
        _split(fwd_bytes, fwd_bytes, n, g, collectives=2),
        _split(bwd_bytes, bwd_bytes, n, g, collectives=2),
        reads,
        buffer,
        u_glob / n,
        written,
        rb,
        mem,
    )
    return StrategyCost("row_wise_rows", t.name, n, b, n, load, load)


def _row_wise_pooled(t: TableStats, n: int, b: int, m: Machine) -> StrategyCost:
    L, rb = t.ids_per_sample, t.row_bytes
    pairs = b * L
    out = _outputs(t, b, pairs)
    u_glob = expected_unique(t, n * pairs)
    mem = math.ceil(t.rows / n) * rb * (1 + t.slots)
    cold, hot = _pair_reads(pairs, u_glob / n)  # N sources' pairs of this owner's rows
    if n == 1:
        load = Load(Traffic(), Traffic(), cold, hot + pairs, u_glob, out * rb, rb, mem)
        return StrategyCost("row_wise_pooled", t.name, n, b, 1, load, load)
    g = m.devices_per_host
    # pairs + distinct ids to their owners, in the lookup (the update keeps the owners'
    # view of them)
    ids = (pairs * PAIR_BYTES + expected_unique(t, pairs) * ID_BYTES) * (n - 1) / n
    # one partial [out, D] per (owner, source): every output row from every owner
    partials = (n - 1) * out * rb
    load = Load(
        _split(ids + partials, ids + partials, n, g, collectives=2),
        _split(partials, partials, n, g, collectives=1),
        cold,  # N sources x b*L/N pairs
        hot + (n - 1) * out + pairs,  # sum the N partials; per-pair grads
        u_glob / n,
        n * out * rb,
        rb,
        mem,
    )
    return StrategyCost("row_wise_pooled", t.name, n, b, n, load, load)


def _column_reads(pairs: float, distinct: float) -> tuple[float, float]:
    """(table reads, buffer pairs) of a column owner pooling `pairs` and their gradients."""
    cold, hot = _pair_reads(pairs, distinct)
    return cold, hot + pairs


def default_column_shards(t: TableStats, n: int) -> int:
    return max(1, min(n, t.dim // 16))


def _column_wise(t: TableStats, n: int, b: int, m: Machine, k: int | None = None) -> StrategyCost:
    k = default_column_shards(t, n) if k is None else k
    if not 1 <= k <= min(n, t.dim):
        raise ValueError(f"column shards {k} not in 1..min(N={n}, D={t.dim})")
    L = t.ids_per_sample
    rbk = t.row_bytes / k
    pairs = b * L
    out = _outputs(t, b, pairs)
    u_glob = expected_unique(t, n * pairs)
    g = m.devices_per_host
    ids = pairs * ID_BYTES + (b * ID_BYTES if t.pooled else 0)
    owner = Load(
        _split(
            (k - 1) * ids + (n - 1) * out * rbk,
            (n - 1) * ids + (k - 1) * out * rbk,
            n,
            g,
            collectives=2,
        ),
        _split((k - 1) * out * rbk, (n - 1) * out * rbk, n, g, collectives=1),
        *_column_reads(n * pairs, u_glob),
        u_glob,
        n * out * rbk,
        rbk,
        math.ceil(t.dim / k) * t.rows * t.bytes_per_element * (1 + t.slots),
    )
    source = Load(
        _split(k * ids, k * out * rbk, n, g, collectives=2),
        _split(k * out * rbk, 0.0, n, g, collectives=1),
        row_bytes=rbk,
    )
    if k == n:
        source = owner
    return StrategyCost("column_wise", t.name, n, b, k, owner, source)


def _table_row_wise(
    t: TableStats, n: int, b: int, m: Machine, group: int | None = None
) -> StrategyCost:
    gsz = min(n, m.devices_per_host if group is None else group)
    if n <= gsz:  # one group: the same as row_wise_pooled
        c = _row_wise_pooled(t, n, b, m)
        return dataclasses.replace(c, strategy="table_row_wise")
    L, rb = t.ids_per_sample, t.row_bytes
    pairs = b * L
    out = _outputs(t, b, pairs)
    u_glob = expected_unique(t, n * pairs)
    ids = pairs * ID_BYTES + (b * ID_BYTES if t.pooled else 0)
    # a member (also a source): every source sends each id to the member owning its
    # row; members pool [N*out, D] partials and reduce-scatter them in the group, so
    # each holds the sums of 1/G of every source's samples, which it sends on; the
    # backward mirrors it (activation gradients in, all-gathered in the group)
    g_in, g_out = gsz - 1, n - gsz  # other sources on this host / elsewhere
    rs = (gsz - 1) / gsz * n * out * rb  # reduce-scatter (all-gather) in the group
    slice_rb = out / gsz * rb  # one source's samples in a member's slice
    own = (gsz - 1) / gsz
    owner = Load(
        Traffic(
            sent_intra=own * ids + rs + g_in * slice_rb,
            sent_inter=g_out * slice_rb,
            recv_intra=g_in * ids / gsz + rs + own * out * rb,
            recv_inter=g_out * ids / gsz,
            collectives=3,
            peers=n,
        ),
        Traffic(
            sent_intra=own * out * rb + rs,
            sent_inter=0.0,
            recv_intra=g_in * slice_rb + rs,
            recv_inter=g_out * slice_rb,
            collectives=2,
            peers=n,
        ),
        _pair_reads(n * pairs / gsz, u_glob / gsz)[0],
        # the other lookups of those rows; per-pair grads; the reduce-scatter's sums
        _pair_reads(n * pairs / gsz, u_glob / gsz)[1] + n * pairs / gsz + n * out,
        u_glob / gsz,
        2 * n * out * rb,
        rb,
        math.ceil(t.rows / gsz) * rb * (1 + t.slots),
    )
    source = Load(
        Traffic(0.0, ids, 0.0, out * rb, collectives=3, peers=n),
        Traffic(0.0, out * rb, 0.0, 0.0, collectives=2, peers=n),
        row_bytes=rb,
    )
    return StrategyCost("table_row_wise", t.name, n, b, gsz, owner, source)


def strategy_cost(
    strategy: str,
    table: TableStats,
    num_devices: int,
    batch_per_device: int,
    machine: Machine,
    **options,
) -> StrategyCost:
    """What `strategy` moves and touches for `table` (see the module docstring).
    options: `variant` ("sparse"/"dense") for data_parallel, `column_shards` for
    column_wise, `group` for table_row_wise."""
    n, b = int(num_devices), int(batch_per_device)
    if n < 1 or b < 0:
        raise ValueError("num_devices >= 1, batch_per_device >= 0")
    if strategy == "data_parallel":
        return _dp(table, n, b, machine, options.get("variant"))
    if strategy == "table_wise":
        return _table_wise(table, n, b, machine)
    if strategy == "row_wise_rows":
        return _row_wise_rows(table, n, b, machine)
    if strategy == "row_wise_pooled":
        return _row_wise_pooled(table, n, b, machine)
    if strategy == "column_wise":
        return _column_wise(table, n, b, machine, options.get("column_shards"))
    if strategy == "table_row_wise":
        return _table_row_wise(table, n, b, machine, options.get("group"))
    raise ValueError(f"unknown strategy {strategy!r}; one of {STRATEGIES}")


# ---------------------------------------------------------------------------
# Time


def _compute_time(load: Load, slots: int, m: Machine) -> float:
    rb = load.row_bytes
    return (
        load.table_reads * m.t_read(rb)
        + load.buffer_pairs * m.t_pair(rb)
        + load.rows_updated * m.t_update(rb, slots)
        + load.bytes_written / m.mem_bw
    )


def _traffic_time(tr: Traffic, m: Machine, with_latency: bool = True) -> float:
    t = 0.0
    for link, sent, recv in (
        (m.intra, tr.sent_intra, tr.recv_intra),
        (m.inter, tr.sent_inter, tr.recv_inter),
    ):
        # (zero-copy links: the row form's kernels read in place and count no bytes;
        # what the other forms exchange there is a memcpy at the link's bandwidth)
        t += max(sent, recv) / link.bandwidth
    if with_latency and tr.collectives:
        link = m.inter if tr.peers > m.devices_per_host else m.intra
        t += tr.collectives * link.latency(tr.peers)
    return t


def _latency_time(tr: Traffic, m: Machine) -> float:
    if not tr.collectives:
        return 0.0
    link = m.inter if tr.peers > m.devices_per_host else m.intra
    return tr.collectives * link.latency(tr.peers)


def _load_time(load: Load, slots: int, m: Machine, with_latency: bool = True) -> float:
    c = _compute_time(load, slots, m)
    x = _traffic_time(load.fwd, m, with_latency) + _traffic_time(load.bwd, m, with_latency)
    return c + x


def step_time(
    strategy: str | StrategyCost,
    table: TableStats,
    num_devices: int,
    batch_per_device: int,
    machine: Machine,
    **options,
) -> float:
    """Predicted seconds of one training step of `table` alone: the busiest device
    (an owner) under `strategy`, its collectives' latency included, plus
    `step_overhead_s`. With `machine.host_shared` the N devices' compute and
    overheads add up (they share one host's cores)."""
    c = (
        strategy
        if isinstance(strategy, StrategyCost)
        else strategy_cost(strategy, table, num_devices, batch_per_device, machine, **options)
    )
    return plan_step_time([(table, c)], machine)


# ---------------------------------------------------------------------------
# Placement and plans


def table_wise_placement(weights: Sequence[float], num_devices: int, sizes=None):
    """Greedy longest-processing-time bin packing: items in decreasing weight, each onto
    the `sizes[i]` (default 1) least-loaded devices. Returns (device lists per item,
    load per device)."""
    loads = [0.0] * num_devices
    where: list = [None] * len(weights)
    sizes = [1] * len(weights) if sizes is None else list(sizes)
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        k = min(sizes[i], num_devices)
        devs = sorted(range(num_devices), key=lambda d: (loads[d], d))[:k]
        for d in devs:
            loads[d] += weights[i]
        where[i] = tuple(devs)
    return where, loads


@dataclasses.dataclass(frozen=True)
class _Summary:
    """What `plan_step_time` needs of one (table, StrategyCost)."""

    strategy: str
    placed: bool
    owners: int
    src_time: float
    own_time: float
    latency: float
    src_mem: float
    own_mem: float
    src_bytes: float
    own_bytes: float


def _summarise(t: TableStats, c: StrategyCost, m: Machine) -> _Summary:
    return _Summary(
        c.strategy,
        c.placed,
        c.owners,
        _load_time(c.source, t.slots, m, with_latency=False),
        _load_time(c.owner, t.slots, m, with_latency=False),
        _latency_time(c.owner.fwd, m) + _latency_time(c.owner.bwd, m),
        c.source.memory,
        c.owner.memory,
        c.source.bytes_sent + c.source.bytes_recv,
        c.owner.bytes_sent + c.owner.bytes_recv,
    )


def _evaluate(summaries: Sequence[_Summary], n: int, m: Machine):
    """(step seconds, detail) of tables given by their summaries on n devices."""
    work = np.zeros(n)
    mem = np.zeros(n)
    moved = np.zeros(n)
    lat: dict = {}
    placed = []
    for i, x in enumerate(summaries):
        lat[x.strategy] = max(lat.get(x.strategy, 0.0), x.latency)
        if x.placed:
            work += x.src_time
            mem += x.src_mem
            moved += x.src_bytes
            placed.append(i)
        else:
            work += x.own_time
            mem += x.own_mem
            moved += x.own_bytes
    assignment: list = [None] * len(summaries)
    extra = {i: summaries[i].own_time - summaries[i].src_time for i in placed}
    # whole groups first (table_row_wise takes hosts), then the rest, heaviest first,
    # each onto its `owners` least-loaded devices (greedy LPT bin packing)
    groups = [i for i in placed if summaries[i].strategy == "table_row_wise"]
    rest = [i for i in placed if summaries[i].strategy != "table_row_wise"]

    def put(i, d):
        x = summaries[i]
        assignment[i] = d
        work[d] += extra[i]
        mem[d] += x.own_mem - x.src_mem
        moved[d] += x.own_bytes - x.src_bytes

    for i in sorted(groups, key=lambda i: -extra[i]):
        g = summaries[i].owners
        n_groups = max(1, n // g)
        host_load = work[: n_groups * g].reshape(n_groups, g).max(axis=1)
        h = int(np.argmin(host_load))
        put(i, np.arange(h * g, h * g + g))
    for i in sorted(rest, key=lambda i: -extra[i]):
        k = min(summaries[i].owners, n)
        put(i, np.argpartition(work, k - 1)[:k] if k < n else np.arange(n))
    busy = float(work.sum()) if m.host_shared else float(work.max())
    overhead = m.step_overhead_s * (n if m.host_shared else 1)
    total = busy + sum(lat.values()) + overhead
    return total, {
        "per_device": work,
        "memory": mem,
        "bytes": moved,
        "latency": lat,
        "overhead": overhead,
        "assignment": assignment,
    }


def plan_step_time(items, machine: Machine, return_detail: bool = False):
    """Predicted step time of several tables [(TableStats, StrategyCost), ...] on the same
    N devices: every device does each table's `source` work, the owners of a placed
    table also its `owner - source` extra (greedy bin packing by that extra time:
    heaviest first onto the least-loaded devices; table_row_wise onto whole hosts);
    the collectives of one strategy are fused across its tables (as the stacks are),
    so their latency counts once per strategy. Step = the busiest device (with
    `host_shared`: the sum over devices) + latencies + overhead. `return_detail`:
    also per-device time, memory, bytes, the latencies and the placement."""
    if not items:
        return (0.0, {}) if return_detail else 0.0
    n = items[0][1].num_devices
    total, detail = _evaluate([_summarise(t, c, machine) for t, c in items], n, machine)
    return (total, detail) if return_detail else total


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's choice: a strategy per table, their costs, the predicted step."""

    num_devices: int
    batch_per_device: int
    machine: str
    choices: tuple  # ((table name, StrategyCost), ...)
    step_time_s: float
    memory_per_device: tuple  # bytes per device
    memory_limit: float
    bytes_per_device: tuple = ()  # bytes sent + received per step, per device
    overridden: tuple = ()

    def strategy_of(self, name: str) -> str:
        return dict(self.choices)[name].strategy

    @property
    def strategies(self) -> dict:
        return {name: c.strategy for name, c in self.choices}

    @property
    def max_bytes_per_device(self) -> float:
        """Bytes sent + received per step by the device that moves the most."""
        return max(self.bytes_per_device, default=0.0)

    def describe(self) -> str:
        gb = 1e9
        lines = [
            f"plan for N={self.num_devices} devices x {self.batch_per_device} samples "
            f"on {self.machine}: predicted step {self.step_time_s * 1e3:.3f} ms "
            f"({self.num_devices * self.batch_per_device / self.step_time_s:,.0f} samples/s)",
            f"memory per device: max {max(self.memory_per_device) / gb:.2f} GB "
            f"of {self.memory_limit / gb:.2f} GB; moved per step: max "
            f"{self.max_bytes_per_device / 1e6:.2f} MB sent + received",
            f"{'table':<12} {'strategy':<16} {'owners':>6} {'MB moved by an owner':>20} "
            f"{'GB held by an owner':>20}",
        ]
        for name, c in self.choices:
            tag = " (override)" if name in self.overridden else ""
            v = f"/{c.variant}" if c.variant and c.variant != "none" else ""
            lines.append(
                f"{name:<12} {c.strategy + v:<16} {c.owners:>6} "
                f"{(c.owner.bytes_sent + c.owner.bytes_recv) / 1e6:>20.3f} "
                f"{c.owner.memory / gb:>20.3f}{tag}"
            )
        return "\n".join(lines)


def _feasible_memory(mem: np.ndarray, limit: float) -> bool:
    return float(mem.max()) <= limit


def _check_overrides(names: list, overrides: Mapping[str, str]) -> None:
    """ValueError where table names repeat, or `overrides` name an unknown table or
    strategy (`plan_tables`' arguments, before any costing)."""
    if len(set(names)) != len(names):
        raise ValueError("table names must be distinct")
    unknown = set(overrides) - set(names)
    if unknown:
        raise ValueError(f"overrides name unknown tables: {sorted(unknown)}")
    for s in overrides.values():
        if s not in STRATEGIES:
            raise ValueError(f"unknown strategy {s!r}")


def _no_fit_error(tables, assign: Mapping, overrides: Mapping, need, limit: float, n: int):
    """The ValueError of `plan_tables` when even its best assignment `assign` needs more
    than `limit` bytes on a device (`need`: each device's): the worst device, and each
    table's strategy and bytes."""
    worst = int(np.argmax(need))
    tables_text = ", ".join(
        f"{t.name} {assign[t.name]}"
        + (" (as asked)" if t.name in overrides else "")
        + f" ({t.state_bytes:,} bytes of table + slots)"
        for t in tables
    )
    return ValueError(
        f"no plan fits the memory limit of {limit:,.0f} bytes a device on {n} devices: "
        f"the least it found needs {float(need[worst]):,.0f} bytes on device {worst}, with "
        f"tables {tables_text}"
    )


def plan_tables(
    tables: Sequence[TableStats],
    num_devices: int,
    machine: Machine,
    overrides: Mapping[str, str] | None = None,
    *,
    batch_per_device: int,
    strategies: Sequence[str] = STRATEGIES,
    memory_limit: float | None = None,
    passes: int = 3,
    strategy_options: Mapping[str, Mapping] | None = None,
    memory_of: Callable[[Mapping[str, str]], Sequence[float]] | None = None,
    excluded: Mapping[str, Sequence[str]] | None = None,
) -> Plan:
    """A strategy per table minimising `plan_step_time` subject to memory per device.

    `overrides` {table name: strategy} are kept as given. The rest start at the
    strategy that is cheapest for the table alone among those that fit, then local
    search: each table in turn moves to the strategy that lowers the plan's step
    time most while every device's memory stays under `memory_limit` (default
    `machine.memory_per_device`), for `passes` rounds or until nothing moves.
    `strategy_options`: `{strategy: options of strategy_cost}` (e.g. a data_parallel
    variant). `memory_of`: the bytes each device holds under an assignment `{table:
    strategy}` (the built layout's, which pads: `embedmesh.layout.planner`), in place of
    the sum of the strategies' `Load.memory`. `excluded`: `{table name: strategies it
    cannot take}` (e.g. a table of raw ids: not data_parallel), never planned for it.
    Raises ValueError when no assignment fits (the overrides included), naming the
    tables, the bytes and the limit."""
    n, b = int(num_devices), int(batch_per_device)
    overrides = dict(overrides or {})
    banned = {name: set(ss) for name, ss in (excluded or {}).items()}

    def allowed(t) -> list:
        return [s for s in strategies if s not in banned.get(t.name, ())] or list(strategies)

    _check_overrides([t.name for t in tables], overrides)
    limit = machine.memory_per_device if memory_limit is None else float(memory_limit)
    given = dict(strategy_options or {})
    options = {
        t.name: {s: strategy_cost(s, t, n, b, machine, **given.get(s, {})) for s in STRATEGIES}
        for t in tables
    }
    summ = {
        t.name: {s: _summarise(t, c, machine) for s, c in options[t.name].items()} for t in tables
    }

    def score(assign):
        total, detail = _evaluate([summ[t.name][assign[t.name]] for t in tables], n, machine)
        if memory_of is not None:
            detail["memory"] = np.asarray(memory_of(assign), float)
        over = max(0.0, float(detail["memory"].max()) - limit)
        return (over, total), detail

    def search(assign):
        best, detail = score(assign)
        for _ in range(passes):
            moved = False
            for t in sorted(tables, key=lambda t: -t.state_bytes):
                if t.name in overrides:
                    continue
                for s in allowed(t):
                    if s == assign[t.name]:
                        continue
                    trial = dict(assign, **{t.name: s})
                    sc, d = score(trial)
                    if sc < best:
                        best, detail, assign, moved = sc, d, trial, True
            if not moved:
                break
        return best, detail, assign

    # starts: each table's best alone (among those that fit), and every strategy for
    # all tables (one move at a time cannot leave a strategy whose fused collectives
    # the other tables share); then local search from each, the best kept
    starts = []
    alone = {}
    for t in tables:
        if t.name in overrides:
            alone[t.name] = overrides[t.name]
            continue
        fits = [s for s in allowed(t) if options[t.name][s].owner.memory <= limit]
        pool = fits or allowed(t)
        alone[t.name] = min(pool, key=lambda s: step_time(options[t.name][s], t, n, b, machine))
    starts.append(alone)
    for s in strategies:
        starts.append(
            {t.name: overrides.get(t.name, s if s in allowed(t) else alone[t.name]) for t in tables}
        )
    best = None
    for start in starts:
        result = search(start)
        if best is None or result[0] < best[0]:
            best = result
    assert best is not None
    (over, total), detail, assign = best
    if over > 0:
        raise _no_fit_error(tables, assign, overrides, detail["memory"], limit, n)
    return Plan(
        num_devices=n,
        batch_per_device=b,
        machine=machine.name,
        choices=tuple((t.name, options[t.name][assign[t.name]]) for t in tables),
        step_time_s=total,
        memory_per_device=tuple(float(x) for x in detail["memory"]),
        bytes_per_device=tuple(float(x) for x in detail["bytes"]),
        memory_limit=limit,
        overridden=tuple(sorted(overrides)),
    )
