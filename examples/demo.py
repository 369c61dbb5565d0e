"""Small end-to-end tour: two tables, three features, one batch, the CPU serving lookup.

Run: python examples/demo.py
"""

import jax
import numpy as np

import embedmesh as em
from embedmesh.inputs import to_csr


def main():
    rng = np.random.default_rng(0)
    video = em.TableConfig(vocabulary_size=1000, dim=8, combiner="mean", name="video")
    user = em.TableConfig(vocabulary_size=500, dim=4, combiner="sum", name="user")
    features = {
        "watched": em.FeatureConfig(video),  # many ids per sample
        "recent": em.FeatureConfig(video, max_sequence_length=3),  # a sequence feature
        "user_id": em.FeatureConfig(user),  # one id per sample
    }
    batch = 4
    lengths = rng.integers(0, 5, size=batch)
    watched = em.RaggedTensor.from_row_lengths(rng.integers(0, 1000, lengths.sum()), lengths)
    watched_weights = em.RaggedTensor(
        rng.uniform(0.5, 2.0, lengths.sum()).astype(np.float32), watched.row_splits
    )
    recent = em.SparseTensor(
        indices=np.array([[0, 0], [0, 1], [1, 0], [3, 2]]),
        values=np.array([5, 6, 7, 8]),
        dense_shape=(batch, 5),
    )
    inputs = {"watched": watched, "recent": recent, "user_id": rng.integers(0, 500, batch)}
    weights = {"watched": watched_weights, "recent": None, "user_id": None}

    keys = iter(jax.random.split(jax.random.key(0), 2))
    tables = {t: np.asarray(t.initialize(next(keys))) for t in (video, user)}

    resolved = em.resolve_feature_config(features)
    print(
        "tables:",
        dict(zip(resolved.table_names, [f"{t.vocabulary_size}x{t.dim}" for t in resolved.tables])),
    )
    for name, feature in zip(resolved.feature_names, resolved.features):
        csr = to_csr(name, feature, inputs[name], weights[name])
        print(
            f"preprocessed {name:8s}: {csr.ids.size} ids -> {csr.num_rows} output rows "
            f"({csr.layout.kind})"
        )

    activations = em.serving_embedding_lookup(inputs, weights, tables, features)
    for name, act in activations.items():
        first = np.asarray(act).reshape(-1, act.shape[-1])[0]
        print(
            f"activation {name:8s} shape {str(tuple(act.shape)):10s} first row "
            f"[{', '.join(f'{v:+.3f}' for v in first)}]"
        )


if __name__ == "__main__":
    main()
