"""Training with the dense model in flax nnx (`model_flax.Ranker`) on embedmesh's
`Embed` module: the demo's default (`--dense flax`; `--dense jax` runs `train.Trainer`,
the same model written in plain JAX over the functional core).

One train step is still one XLA program: the sharded lookup (`model.embed(csr)`),
the MLP forward and backward (`nnx.value_and_grad` over the model's `nnx.Param`s and
the activations), optax's Adam through `nnx.Optimizer` on the MLP, and the fused sparse
Adagrad update (`model.embed.apply_gradients`). The step is a `jax.jit` over the
model's and optimizer's state (`nnx.split` once, `nnx.merge` inside the step: flax's
fast path), with that state donated, so tables and slots are updated in place.
"""

from __future__ import annotations

import jax
from flax import nnx

from examples.movielens import model as mdl
from examples.movielens import model_flax
from examples.movielens.train import Trainer, masked_losses


class FlaxTrainer(Trainer):
    """`Trainer`'s interface (epochs, evaluation, snapshots, the embedding for
    checkpoints) over an nnx `Ranker` and an `nnx.Optimizer`."""

    def _build_model(self, k_dense, model_cfg: mdl.ModelConfig) -> None:
        """The nnx `Ranker` over the embedding (the module takes the facade's state),
        its `nnx.Optimizer` and the jitted steps over their split state."""
        # the same initial values as the plain-JAX trainer's, replicated on the mesh
        params = jax.device_put(
            mdl.init_dense(k_dense, len(self.features), model_cfg), self.core.replicated
        )
        model = model_flax.Ranker(self.emb, params, self.features, model_cfg)
        optimizer = nnx.Optimizer(model, self.tx, wrt=nnx.Param)
        self.graphdef, self.nstate = nnx.split((model, optimizer))
        graphdef, feats, cfg = self.graphdef, self.features, model_cfg

        def train_step(nstate, csr, labels, mask, key):
            model, optimizer = nnx.merge(graphdef, nstate)
            acts = model.embed(csr)
            key = jax.random.fold_in(key, model.embed.step.get_value())

            def loss_fn(model, acts):
                logits = model(acts, dropout_key=key)
                return masked_losses(logits, acts, labels, mask, feats, cfg)

            (_, loss), (g_model, g_acts) = nnx.value_and_grad(
                loss_fn, argnums=(0, 1), has_aux=True
            )(model, acts)
            optimizer.update(model, g_model)  # Adam on the nnx.Params (the MLP)
            model.embed.apply_gradients(g_acts, csr, check_finite=False)  # sparse Adagrad
            return nnx.state((model, optimizer)), loss

        def predict(nstate, csr):
            model, _ = nnx.merge(graphdef, nstate)
            return jax.nn.sigmoid(model(model.embed(csr)))

        self._train_nnx = jax.jit(train_step, donate_argnums=0)
        self._predict_nnx = jax.jit(predict)

    def _merged(self):
        return nnx.merge(self.graphdef, self.nstate)

    @property
    def state(self):
        """The embedding's `EmbeddingState` (for checkpoints)."""
        return self._merged()[0].embed.state

    def _step(self, csr, labels, mask):
        self.nstate, loss = self._train_nnx(self.nstate, csr, labels, mask, self.dropout_key)
        return loss

    def _predict_batch(self, csr):
        return self._predict_nnx(self.nstate, csr)

    def snapshot(self):
        return jax.tree_util.tree_map(lambda x: x.copy(), self.nstate)

    def restore_snapshot(self, snap):
        self.nstate = jax.tree_util.tree_map(lambda x: x.copy(), snap)

    def dense_params(self) -> dict:
        return self._merged()[0].dense_params()
