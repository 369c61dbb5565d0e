"""Training and evaluation: embedmesh's functional core inside one jitted step.

One train step is one XLA program: the sharded lookup (all-to-all of ids and
rows over the mesh), the MLP forward and backward, the fused sparse Adagrad
update of the touched rows (tables and slots donated, updated in place) and
the optax update of the dense parameters. The host side (batching and
embedmesh's preprocessing into fixed-capacity partitions) runs in a
background thread a few batches ahead.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from tqdm import tqdm

import embedmesh as em
from embedmesh.facade import MeshEmbedding
from embedmesh.host.prefetch import background_map
from embedmesh.host.preprocess import compute_sparse_core_stats
from examples.movielens import model as mdl


def make_mesh(num_devices: int | None = None, platform: str | None = None) -> Mesh:
    """A 1-D mesh over the first `num_devices` devices (default: all) of the default backend."""
    devices = jax.devices(platform) if platform else jax.devices()
    if num_devices is not None:
        if num_devices > len(devices):
            raise ValueError(
                f"asked for {num_devices} devices, {devices[0].platform} has {len(devices)}"
            )
        devices = devices[:num_devices]
    return Mesh(np.array(devices), ("devices",))


def prefetch(items: Iterable, fn: Callable, buffer_size: int = 3) -> Iterator:
    """`fn(item)` for each item, computed in a background thread ahead of the consumer."""
    return background_map(fn, items, buffer_size, name="movielens-prefetch")


def progress_bar(total: int, prefix: str, live: bool) -> tqdm:
    """A tqdm bar over one epoch's steps, on stdout with the rest of the demo's output.

    `live` (stdout is a terminal): redrawn at most every 0.1 s, sized to the
    terminal (80 x 24 where it reports no size, as some pseudo-terminals do:
    tqdm would then draw nothing). Otherwise (a log file, pytest) only the
    first and the final state are written.
    """
    size = shutil.get_terminal_size() if live else None
    return tqdm(
        total=total,
        desc=prefix,
        unit="step",
        file=sys.stdout,
        ncols=size.columns if live else None,
        nrows=size.lines if live else None,
        mininterval=0.1 if live else float("inf"),
    )


def masked_losses(logits, acts, labels, mask, feats, cfg: mdl.ModelConfig):
    """(objective, loss) of a batch: the mean over unmasked samples of the binary
    cross-entropy plus the embeddings' penalty (what is minimized), and of the
    cross-entropy alone (what is reported)."""
    bce = mdl.bce_with_logits(logits, labels)
    obj = bce + mdl.penalty(acts, feats, cfg)
    denom = jnp.sum(mask)
    return jnp.sum(obj * mask) / denom, jnp.sum(bce * mask) / denom


class Trainer:
    """A `MeshEmbedding` (state, host preprocessing) + dense parameters + jitted steps.

    The facade owns the embedding state (`emb.state`) and preprocesses
    batches (`emb.enqueue`); the train step runs its functional core
    (`emb.core.lookup` / `emb.core.apply_gradients`) inside one `jax.jit`
    together with the dense model and optax.
    """

    def __init__(
        self,
        vocab_sizes: dict,
        features: Sequence[str],
        mesh: Mesh,
        *,
        model_cfg: mdl.ModelConfig = mdl.ModelConfig(),
        table_optimizer: em.Optimizer | None = None,
        dense_optimizer=None,
        seed: int = 0,
        capacities=None,
        feature_config=None,
    ):
        self.features = tuple(features)
        self.model_cfg = model_cfg
        self.mesh = mesh
        self.feature_config = feature_config or mdl.feature_config(
            vocab_sizes, self.features, model_cfg
        )
        self.table_optimizer = table_optimizer or em.Adagrad(learning_rate=0.05)
        self.seed = seed
        self.emb = MeshEmbedding(
            self.feature_config,
            self.table_optimizer,
            mesh=mesh,
            capacities=capacities,
            overflow="grow",
            seed=seed,
        )
        self.emb.build()
        self.core = self.emb.core
        k_dense = jax.random.fold_in(jax.random.key(seed), 1)
        self.tx = dense_optimizer or optax.adam(1e-3)
        self.dropout_key = jax.random.fold_in(k_dense, 1)
        self.recompiles = 0
        self.max_in_flight = 2
        self._build_model(k_dense, model_cfg)

    def _build_model(self, k_dense, model_cfg: mdl.ModelConfig) -> None:
        """The dense parameters (initialized from `k_dense`), their optimizer state and
        the jitted train and predict steps (a subclass builds its own model here)."""
        params = mdl.init_dense(k_dense, len(self.features), model_cfg)
        self.params = jax.device_put(params, self.core.replicated)
        self.opt_state = jax.device_put(self.tx.init(self.params), self.core.replicated)
        core, feats, tx, cfg = self.core, self.features, self.tx, model_cfg

        def loss_fn(params, acts, labels, mask, key):
            logits = mdl.forward(params, acts, feats, cfg, dropout_key=key)
            return masked_losses(logits, acts, labels, mask, feats, cfg)

        def train_step(state, params, opt_state, csr, labels, mask, key):
            acts = core.lookup(state, csr)
            key = jax.random.fold_in(key, state.step)
            (_, loss), (g_params, g_acts) = jax.value_and_grad(
                loss_fn, argnums=(0, 1), has_aux=True
            )(params, acts, labels, mask, key)
            state, _ = core.apply_gradients(state, g_acts, csr, check_finite=False)
            updates, opt_state = tx.update(g_params, opt_state, params)
            return state, optax.apply_updates(params, updates), opt_state, loss

        def predict(state, params, csr):
            return jax.nn.sigmoid(mdl.forward(params, core.lookup(state, csr), feats, cfg))

        self._train = jax.jit(train_step, donate_argnums=(0, 1, 2))
        self._predict = jax.jit(predict)

    @staticmethod
    def measure_capacities(
        feature_config,
        num_shards: int,
        batches: Iterable,
        model_cfg: mdl.ModelConfig,
        headroom: float = 1.25,
    ) -> dict:
        """`{stack: Capacity}` from sample batches (`compute_sparse_core_stats`) x headroom.

        A later batch that needs more still trains: the engine grows the
        capacity (`overflow="grow"`, one recompilation).
        """
        feats = (mdl.expand_inputs(b[0], model_cfg) for b in batches)
        stats = compute_sparse_core_stats(
            feats, feature_config, num_shards=num_shards, num_devices_local=num_shards
        )
        return dict(stats.capacities(headroom))

    @property
    def state(self):
        return self.emb.state

    @state.setter
    def state(self, value):
        self.emb.state = value

    # -- host side ------------------------------------------------------------

    def enqueue(self, batch: tuple) -> tuple:
        """(features, labels, mask) numpy -> device-placed (csr, labels, mask, ids)."""
        features, labels, mask = batch
        csr = self.emb.enqueue(mdl.expand_inputs(features, self.model_cfg))
        stats = self.emb.last_stats
        if stats.grown:  # a batch larger than any sized for: one recompilation
            self.recompiles += 1
        ids = sum(v.num_ids for v in stats.stacks.values())
        put = lambda x: jax.device_put(np.asarray(x), self.core.row_sharding)
        return csr, put(labels), put(mask), ids

    # -- device side ----------------------------------------------------------

    def _step(self, csr, labels, mask):
        """One train step (dispatched, not waited for); its loss."""
        self.state, self.params, self.opt_state, loss = self._train(
            self.state, self.params, self.opt_state, csr, labels, mask, self.dropout_key
        )
        return loss

    def _predict_batch(self, csr):
        return self._predict(self.state, self.params, csr)

    def train_epoch(self, batches: Iterable, num_batches: int, prefix: str) -> dict:
        live = sys.stdout.isatty()
        bar = progress_bar(num_batches, prefix, live)
        losses = []
        t0 = time.perf_counter()
        samples = ids = 0
        with bar:
            for i, (csr, labels, mask, n_ids) in enumerate(prefetch(batches, self.enqueue)):
                losses.append(self._step(csr, labels, mask))
                if i >= self.max_in_flight:
                    # Bound the steps queued by async dispatch: on XLA:CPU, many queued
                    # multi-device steps can exhaust the client's threads while their
                    # all_to_all rendezvous wait for each other (a 40 s abort).
                    jax.block_until_ready(losses[i - self.max_in_flight])
                samples += labels.shape[0]
                ids += n_ids
                if live and i % 5 == 4:  # reading a loss waits for its step: only now and then
                    dt = time.perf_counter() - t0
                    recent = float(np.mean([float(x) for x in losses[-10:]]))
                    bar.set_postfix_str(
                        f"loss {recent:.4f}  {samples / dt:,.0f} samples/s", refresh=False
                    )
                bar.update(1)
            losses = np.asarray([float(x) for x in losses])
            dt = time.perf_counter() - t0
            bar.set_postfix_str(
                f"loss {losses.mean():.4f}  {samples / dt:,.0f} samples/s  "
                f"{ids / dt:,.0f} ids/s  {dt:.1f}s",
                refresh=False,
            )
        return {
            "loss": float(losses.mean()),
            "losses": losses,
            "seconds": dt,
            "samples_per_s": samples / dt,
            "ids_per_s": ids / dt,
        }

    def predict(self, batches: Iterable) -> tuple:
        """Probabilities and labels of the masked-in samples of `batches`."""
        probs, labels = [], []
        for csr, lab, mask, _ in prefetch(batches, self.enqueue):
            p = self._predict_batch(csr)
            m = np.asarray(mask) > 0
            probs.append(np.asarray(p)[m])
            labels.append(np.asarray(lab)[m])
        return np.concatenate(probs), np.concatenate(labels)

    def evaluate(self, batches: Iterable) -> dict:
        p, y = self.predict(batches)
        return {"auc": mdl.auc(y, p), "logloss": mdl.log_loss(y, p), "probs": p, "labels": y}

    # -- snapshots (best epoch) -----------------------------------------------

    def snapshot(self):
        """A device copy of all trainable state (cheap for small tables)."""
        return jax.tree_util.tree_map(lambda x: x.copy(), (self.state, self.params, self.opt_state))

    def restore_snapshot(self, snap):
        self.state, self.params, self.opt_state = jax.tree_util.tree_map(lambda x: x.copy(), snap)

    def dense_params(self) -> dict:
        return jax.tree_util.tree_map(np.asarray, self.params)
