"""Where a small request's time goes with 1, 2 and 4 client threads: the GIL's share.

serving_online.py's model and requests (26 ragged features, numpy outputs,
`set_host_threads(1)`), closed loops of `--seconds` a cell, `--rounds` rounds; per cell
the medians over rounds of what the compiled request path counts (`fast_path.gil_stats`,
`fast_path.handover_stats` with `handover_timing(True)`):

- 1r: one client, every request made to release the GIL for its kernels
  (`hold_gil_below(0)`): its time less its kernels' is the time it holds the GIL (the
  compiled call's part, `held_in`, and the Python around it);
- 1: one client as served by default (a lone small request keeps the GIL);
- 2 / 2own / 4: 2 clients sending the same request objects / each its own copies, 4
  clients; 2spin / 2pause / 2both / 4both: with the next in line for the GIL spinning
  20 us before it sleeps (`turn_spin_us`), the first in line spinning with a pause
  (`first_pause`), both.

Columns: `back` the us from a shared request's kernels' end to its thread holding the GIL
again, of it `turn` in the turns' wait and `first` first in line; `sleeps` the share of
those requests that reached the turns' futex wait; `shared` the share of requests that
released the GIL while other threads served. Then: the Amdahl bound of 2 clients / 1 (a
request's time / its GIL-held time, one client) and, per 2-client cell, the share of
the time the GIL was busy with the requests' own held work (requests/s x held time).
Run in the benchmark environment, alone on the machine:

    PYTHONPATH=. /tmp/benchenv/bin/python benchmarks/serving/serving_handover.py [--batch 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serving_online as so

from embedmesh.serving import fast_path, set_host_threads
from embedmesh.serving.lookup import set_numpy_outputs

# cell: (clients, every request releases the GIL, own request objects, spin us, pause)
CELLS = {
    "1r": (1, True, False, 0, False),
    "1": (1, False, False, 0, False),
    "2": (2, False, False, 0, False),
    "2own": (2, False, True, 0, False),
    "2spin": (2, False, False, 20, False),
    "2pause": (2, False, False, 0, True),
    "2both": (2, False, False, 20, True),
    "4": (4, False, False, 0, False),
    "4both": (4, False, False, 20, True),
}


def cell(call, requests, seconds, clients, release, spin, pause) -> dict:
    """One closed loop and what the compiled path counted meanwhile."""
    fast_path.turn_spin_us(spin)
    fast_path.first_pause(pause)
    fast_path.hold_gil_below(0 if release else 32768)
    g0, h0 = fast_path.gil_stats(), fast_path.handover_stats()
    lat, rps = so.closed_loop(call, requests, clients, seconds)
    g1, h1 = fast_path.gil_stats(), fast_path.handover_stats()
    fast_path.hold_gil_below(32768)
    fast_path.turn_spin_us(0)
    fast_path.first_pause(False)
    released = max(g1[1] - g0[1], 1)
    shared = max(h1[2] - h0[2], 1)
    return {
        "rps": rps,
        "t": 1e6 / rps if rps else float("inf"),
        "p50": float(np.percentile(lat, 50)) * 1e6 if len(lat) else float("nan"),
        "kern": (g1[2] - g0[2]) / released / 1e3,
        "held_in": (h1[1] - h0[1]) / max(h1[0] - h0[0], 1) / 1e3,
        "back": (h1[3] - h0[3]) / shared / 1e3,
        "turn": (h1[5] - h0[5]) / shared / 1e3,
        "first": (h1[6] - h0[6]) / shared / 1e3,
        "sleeps": (h1[4] - h0[4]) / shared,
        "shared": (h1[2] - h0[2]) / max(len(lat), 1),
    }


def report(res: list) -> None:
    def med(k, f):
        return statistics.median(x[k][f] for x in res)

    def ratio(f):
        return statistics.median(f(x) for x in res)

    for k in res[0]:
        print(f"{k:6s} " + " ".join(f"{f} {med(k, f):8.2f}" for f in res[0][k]))
    for k in ("2", "2own", "2spin", "2pause", "2both", "4", "4both"):
        print(f"{k} / 1 client requests/s: {ratio(lambda x: x[k]['rps'] / x['1']['rps']):.2f}")
    print(
        f"own / shared objects, 2 clients: {ratio(lambda x: x['2own']['rps'] / x['2']['rps']):.2f}"
    )
    held = ratio(lambda x: x["1r"]["t"] - x["1r"]["kern"])
    inside = med("1r", "held_in")
    t1 = med("1", "t")
    print(
        f"1 client: {t1:.2f} us a request; released: GIL-held {held:.2f} us (inside the "
        f"compiled call {inside:.2f}, Python around it {held - inside:.2f}), kernels "
        f"{med('1r', 'kern'):.2f}; Amdahl bound of 2 clients / 1 = {t1 / held:.2f}"
    )
    for k in ("2", "2own", "2spin", "2pause", "2both"):
        busy = ratio(lambda x: x[k]["rps"] * (x["1r"]["t"] - x["1r"]["kern"]) / 1e6)
        print(
            f"{k}: GIL busy with the requests' held work {busy:.2f} of the time; kernels' end "
            f"-> GIL back {med(k, 'back'):.2f} us (turn wait {med(k, 'turn'):.2f}, first in "
            f"line {med(k, 'first'):.2f}), {med(k, 'sleeps'):.2f} reached the futex wait; "
            f"held inside the call {med(k, 'held_in'):.2f} us (alone {inside:.2f})"
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seconds", type=float, default=0.4, help="per cell and round")
    args = p.parse_args(argv)
    if fast_path.handover_stats() is None:
        sys.exit("the compiled request path (embedmesh.serving._request) was not built")
    set_host_threads(1)
    set_numpy_outputs(True)
    features, tables, max_ids = so.make_model(50_000)
    reqs = so.make_requests(features, max_ids, args.batch, 32, 50_000, seed=args.batch)
    own = [so.own_copies(reqs) for _ in range(2)]
    call = so.embedmesh_call(features, tables, True)
    call.setup()
    for r in reqs:
        call(r)
    fast_path.handover_timing(True)
    res = []
    for r in range(args.rounds):
        res.append(
            {
                name: cell(call, own if mine else reqs, args.seconds, n, release, spin, pause)
                for name, (n, release, mine, spin, pause) in CELLS.items()
            }
        )
        print(f"round {r + 1} load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    fast_path.handover_timing(False)
    report(res)


if __name__ == "__main__":
    main()
