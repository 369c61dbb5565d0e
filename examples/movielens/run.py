"""MovieLens-100k end to end: sharded embedding tables trained on a mesh, then served.

    python -m examples.movielens                 # 4 CPU devices (or the GPUs), ~1-2 min
    python -m examples.movielens --large-tables  # 26 x 1M-row tables, Zipf data, throughput
                                                 # on 1 device, then on the default mesh

Steps: fetch MovieLens-100k (once, cached), train a DLRM-style click-through
model (embedmesh tables + plain-JAX MLP) with a progress bar per epoch and
validation AUC / log-loss after each, keep the best epoch, evaluate on test,
checkpoint with `embedmesh.checkpoint`, restore for serving on one CPU device
with `serving_embedding_lookup`, check the served predictions against the
trained model's, print a summary table and write a PNG of the curves.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _requested_devices(argv) -> int | None:
    for i, a in enumerate(argv):
        if a == "--devices" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--devices="):
            return int(a.split("=", 1)[1])
    return None


def _configure_host_devices(argv) -> None:
    """Ask XLA for N host (CPU) devices before jax loads (default 4).

    Only the CPU platform reads this flag, so it is harmless on GPU machines.
    An XLA_FLAGS that already sets the count is left alone.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        n = _requested_devices(argv) or 4
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


_configure_host_devices(sys.argv[1:])
if not __package__:  # run as a script: python examples/movielens/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import embedmesh as em  # noqa: E402

try:  # tqdm (train) and matplotlib (plot): the `examples` extra
    from examples.movielens import train as trn
    from examples.movielens.plot import plot_history
except ModuleNotFoundError as e:
    if e.name not in ("tqdm", "matplotlib"):
        raise
    raise SystemExit(
        f"error: the demo needs {e.name}, from the `examples` extra: "
        f"pip install -e '.[examples]' in the repository root"
    ) from None
from examples.movielens import data  # noqa: E402
from examples.movielens import model as mdl  # noqa: E402

REFERENCE = {"name": "RecBole LR (reference)", "auc": 0.7765, "logloss": 0.562}


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line (every flag with its help and default)."""
    p = argparse.ArgumentParser(
        prog="python -m examples.movielens",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--epochs", type=int, default=10, help="passes over the training split")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and shuffling")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="devices in the mesh (default: 4 CPU devices, or all GPUs)",
    )
    p.add_argument(
        "--large-tables",
        action="store_true",
        help="synthetic Zipf data, 26 x 1M-row tables: throughput only",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder: plot, checkpoint, results.json "
        "(default: .cache/movielens/out in the repository)",
    )
    p.add_argument("--batch-size", type=int, default=1024, help="samples a training step")
    p.add_argument("--dim", type=int, default=32, help="embedding width")
    p.add_argument("--hidden", default="256,128", help="top-MLP widths")
    p.add_argument("--dropout", type=float, default=0.5, help="top-MLP dropout rate")
    p.add_argument("--table-lr", type=float, default=0.04, help="embedmesh Adagrad rate")
    p.add_argument("--dense-lr", type=float, default=1e-3, help="optax Adam rate")
    p.add_argument("--split-seed", type=int, default=2020, help="the 80/10/10 split (fixed)")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where the MovieLens wheel is cached (default: .cache/movielens)",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="read ml-100k.{inter,user,item} from this folder instead",
    )
    p.add_argument("--large-rows", type=int, default=1_000_000, help="--large-tables: rows a table")
    p.add_argument("--large-features", type=int, default=26, help="--large-tables: tables")
    p.add_argument("--large-dim", type=int, default=16, help="--large-tables: embedding width")
    p.add_argument("--large-batch", type=int, default=4096, help="--large-tables: batch")
    p.add_argument("--large-steps", type=int, default=300, help="--large-tables: steps timed")
    p.add_argument("--no-plot", action="store_true", help="skip the history plot")
    p.add_argument(
        "--matmul-precision",
        default="highest",
        choices=("default", "high", "highest"),
        help="the dense model's matmul precision (jax_default_matmul_precision): "
        "'highest' is float32 on every backend; a TPU's 'default' multiplies in bfloat16 "
        "passes, and the served-vs-trained check then reads ~1e-3 instead of ~1e-7",
    )
    p.add_argument(
        "--dense",
        choices=("flax", "jax"),
        default="flax",
        help="the dense model in flax nnx on embedmesh's Embed module (default), or the "
        "same model in plain JAX over the functional core",
    )
    return p


def _mesh(args):
    if args.devices is not None:
        return trn.make_mesh(args.devices)
    n = len(jax.devices())
    return trn.make_mesh(min(4, n) if jax.default_backend() == "cpu" else n)


def _table(rows) -> str:
    w = max(len(r[0]) for r in rows)
    lines = [f"{'':{w}}  {'AUC':>7}  {'log-loss':>8}"]
    for name, a, ll in rows:
        lines.append(f"{name:{w}}  {a:>7}  {ll:>8}")
    return "\n".join(lines)


def _announce(args, ds, splits, mesh, cfg) -> None:
    """The data, the split, the mesh, the tables and the optimizers, printed."""
    tr, va, te = splits
    print(
        f"MovieLens-100k: {ds.num_samples:,} ratings, {ds.labels.mean():.1%} positive "
        f"(rating >= 4); split {len(tr):,}/{len(va):,}/{len(te):,} (seed {args.split_seed})"
    )
    print(
        f"mesh: {mesh.size} {mesh.devices.flat[0].platform} device(s); tables "
        + ", ".join(f"{n} {ds.vocab_sizes[n]}x{args.dim}" for n in data.FEATURES)
        + f" (+ a 1-wide bias table each); top MLP {list(cfg.hidden)}; "
        f"Adagrad({args.table_lr}) on the tables, Adam({args.dense_lr}) on the MLP "
        f"({'flax nnx' if args.dense == 'flax' else 'plain JAX'})"
    )


def _trainer(args, ds, tr, mesh, cfg):
    """The trainer (flax nnx or plain JAX) with capacities measured on the training split."""
    fc = mdl.feature_config(ds.vocab_sizes, data.FEATURES, cfg)
    caps = trn.Trainer.measure_capacities(
        fc,
        mesh.size,
        data.train_batches(ds, tr, args.batch_size, np.random.default_rng(args.split_seed)),
        cfg,
    )
    if args.dense == "flax":
        from examples.movielens.train_flax import FlaxTrainer as trainer_class
    else:
        trainer_class = trn.Trainer
    return trainer_class(
        ds.vocab_sizes,
        data.FEATURES,
        mesh,
        model_cfg=cfg,
        table_optimizer=em.Adagrad(learning_rate=args.table_lr, initial_accumulator_value=1e-4),
        dense_optimizer=optax.adam(args.dense_lr),
        seed=args.seed,
        capacities=caps,
    )


def _train(args, trainer, ds, tr, va) -> tuple[list, list, int]:
    """The epochs, each validated; the trainer left at the best validation epoch.
    Returns (history, step losses, best epoch)."""
    B = args.batch_size
    rng = np.random.default_rng(args.seed)
    history, step_losses = [], []
    best = None
    steps_per_epoch = len(tr) // B
    for epoch in range(1, args.epochs + 1):
        r = trainer.train_epoch(
            data.train_batches(ds, tr, B, rng), steps_per_epoch, f"epoch {epoch:2d}/{args.epochs}"
        )
        v = trainer.evaluate(data.eval_batches(ds, va, B))
        history.append(
            {
                "epoch": epoch,
                "train_loss": r["loss"],
                "val_auc": v["auc"],
                "val_logloss": v["logloss"],
                "seconds": r["seconds"],
                "samples_per_s": r["samples_per_s"],
                "ids_per_s": r["ids_per_s"],
            }
        )
        step_losses.extend(r["losses"].tolist())
        mark = ""
        if best is None or v["auc"] > best[1]:
            best = (epoch, v["auc"], trainer.snapshot())
            mark = "  (best so far)"
        print(
            f"           validation AUC {v['auc']:.4f}  log-loss {v['logloss']:.4f}{mark}",
            flush=True,
        )
    best_epoch = best[0]
    trainer.restore_snapshot(best[2])
    del best
    return history, step_losses, best_epoch


def _serve(args, trainer, ds, te, test, out_dir) -> dict:
    """Checkpoint, then serve the test split from the checkpoint alone on one CPU device,
    from float32 and from int8 tables, each against the trained model's predictions."""
    from examples.movielens import serve  # orbax loads only when needed

    B = args.batch_size
    ckpt = out_dir / "checkpoint"
    if ckpt.exists():
        shutil.rmtree(ckpt)  # our own previous output
    t0 = time.perf_counter()
    serve.save(ckpt, trainer, ds.vocab_sizes, step=int(jax.device_get(trainer.state.step)))
    print(f"checkpoint: {ckpt} ({serve.describe(ckpt)}) in {time.perf_counter() - t0:.1f}s")
    t0 = time.perf_counter()
    server = serve.load_for_serving(ckpt)
    served = []
    for s in range(0, len(te), B):
        served.append(server.predict(ds.features(te[s : s + B])))
    served = np.concatenate(served)
    t_serve = time.perf_counter() - t0
    diff = float(np.max(np.abs(served - test["probs"])))
    served_auc, served_ll = mdl.auc(ds.labels[te], served), mdl.log_loss(ds.labels[te], served)
    print(
        f"served on {server.device} with serving_embedding_lookup: {len(te):,} test "
        f"predictions in {t_serve:.1f}s (restore included), max |served - trained| = {diff:.2e} "
        f"(dense matmuls at precision {args.matmul_precision})"
    )
    # the same checkpoint served from int8 tables (a scale and a bias a row: 4x smaller)
    server8 = serve.load_for_serving(ckpt, dtype="int8")
    served8 = np.concatenate(
        [server8.predict(ds.features(te[s : s + B])) for s in range(0, len(te), B)]
    )
    int8_auc, int8_ll = mdl.auc(ds.labels[te], served8), mdl.log_loss(ds.labels[te], served8)
    print(
        f"served from int8 tables: test AUC {int8_auc:.4f} ({int8_auc - served_auc:+.4f} "
        f"against float32), max |int8 - float32| = {np.max(np.abs(served8 - served)):.2e}"
    )
    return {
        "served_auc": served_auc,
        "served_logloss": served_ll,
        "served_int8_auc": int8_auc,
        "served_int8_logloss": int8_ll,
        "max_abs_diff": diff,
        "checkpoint": ckpt,
    }


def _plot(args, out_dir, history, step_losses, best_epoch, test):
    """The history figure (None with --no-plot)."""
    if args.no_plot:
        return None
    plot_path = plot_history(
        out_dir / "movielens_history.png",
        [h["train_loss"] for h in history],
        [h["val_auc"] for h in history],
        step_losses,
        None if args.data_dir else REFERENCE["auc"],
        val_loss=[h["val_logloss"] for h in history],
        best_epoch=best_epoch,
        title=(
            f"{'MovieLens-100k' if not args.data_dir else args.data_dir}: embedmesh DLRM, "
            f"kept epoch {best_epoch}, test AUC {test['auc']:.4f}, "
            f"log-loss {test['logloss']:.4f}"
        ),
    )
    print(f"plot: {plot_path}")
    return plot_path


def _summary(args, test, best_epoch, served) -> str:
    """The closing table: the reference (MovieLens-100k only), trained and served."""
    rows = (
        []
        if args.data_dir
        else [  # the reference is for MovieLens-100k only
            (REFERENCE["name"], f"{REFERENCE['auc']:.4f}", f"{REFERENCE['logloss']:.3f}")
        ]
    )
    rows += [
        (
            f"embedmesh DLRM, test (epoch {best_epoch})",
            f"{test['auc']:.4f}",
            f"{test['logloss']:.4f}",
        ),
        (
            "served from checkpoint, 1 CPU",
            f"{served['served_auc']:.4f}",
            f"{served['served_logloss']:.4f}",
        ),
        (
            "served from int8 tables",
            f"{served['served_int8_auc']:.4f}",
            f"{served['served_int8_logloss']:.4f}",
        ),
    ]
    return _table(rows)


def run_movielens(args) -> dict:
    t_start = time.perf_counter()
    out_dir = (args.out or data.repo_root() / ".cache" / "movielens" / "out").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    ds = data.load_movielens(args.cache_dir, data_dir=args.data_dir)
    tr, va, te = data.split_indices(ds.num_samples, args.split_seed)
    mesh = _mesh(args)
    B = args.batch_size
    if B % mesh.size:
        raise SystemExit(f"--batch-size {B} must be a multiple of the {mesh.size} devices")
    cfg = mdl.ModelConfig(
        dim=args.dim,
        hidden=tuple(int(x) for x in args.hidden.split(",") if x),
        dropout=args.dropout,
        wide=True,
    )
    _announce(args, ds, (tr, va, te), mesh, cfg)
    trainer = _trainer(args, ds, tr, mesh, cfg)
    history, step_losses, best_epoch = _train(args, trainer, ds, tr, va)
    test = trainer.evaluate(data.eval_batches(ds, te, B))
    print(
        f"test (best validation epoch {best_epoch}): AUC {test['auc']:.4f}  "
        f"log-loss {test['logloss']:.4f}"
    )
    t_train = time.perf_counter() - t_start

    served = _serve(args, trainer, ds, te, test, out_dir)
    plot_path = _plot(args, out_dir, history, step_losses, best_epoch, test)
    wall = time.perf_counter() - t_start
    print()
    print(_summary(args, test, best_epoch, served))
    print(
        f"max |served - trained| {served['max_abs_diff']:.1e}; training throughput "
        f"{np.median([h['samples_per_s'] for h in history[1:] or history]):,.0f} samples/s "
        f"on {mesh.size} device(s); wall time {wall:.0f}s (training + evaluation "
        f"{t_train:.0f}s)"
    )
    results = {
        "test_auc": test["auc"],
        "test_logloss": test["logloss"],
        "best_epoch": best_epoch,
        "served_auc": served["served_auc"],
        "served_logloss": served["served_logloss"],
        "served_int8_auc": served["served_int8_auc"],
        "served_int8_logloss": served["served_int8_logloss"],
        "max_abs_diff": served["max_abs_diff"],
        "wall_s": wall,
        "train_s": t_train,
        "history": history,
        "seed": args.seed,
        "devices": mesh.size,
        "platform": mesh.devices.flat[0].platform,
        "recompiles": trainer.recompiles,
        "reference": REFERENCE,
        "plot": str(plot_path) if plot_path else None,
        "checkpoint": str(served["checkpoint"]),
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    return results


def _large_tables(args) -> dict:
    """Throughput on the requested mesh; by default on 1 device and then on the default
    mesh (4 CPU devices, or all GPUs), so the two can be compared in one run."""
    import gc

    from examples.movielens import large_tables

    meshes = [_mesh(args)]
    if args.devices is None and meshes[0].size > 1:
        meshes.insert(0, trn.make_mesh(1))
    runs = []
    for mesh in meshes:
        runs.append(
            large_tables.run(
                mesh,
                num_features=args.large_features,
                rows=args.large_rows,
                dim=args.large_dim,
                batch=args.large_batch,
                steps=args.large_steps,
                seed=args.seed,
            )
        )
        gc.collect()  # the tables of one run are gone before the next is built
    if len(runs) > 1:
        one, many = runs[0], runs[-1]
        print(
            f"large-table mode: {one['ids_per_s']:,.0f} ids/s on 1 device, "
            f"{many['ids_per_s']:,.0f} on {many['devices']} "
            f"({many['ids_per_s'] / one['ids_per_s']:.2f}x)",
            flush=True,
        )
    return {**runs[-1], "runs": runs}


def main(argv=None) -> dict:
    args = parse_args(argv)
    jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    if args.large_tables:
        return _large_tables(args)
    try:
        return run_movielens(args)
    except data.MovieLensDataError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
