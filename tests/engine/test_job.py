"""The public, stateless job under the facade (`embedmesh.EmbeddingJob`, issue #39 item
2): the flax modules and checkpoints reach the facade through public names only, and the
job does what the facade did with its state kept elsewhere."""

import ast
import pathlib

import numpy as np
import pytest
from test_layering import private_attribute

import embedmesh as em

PKG = pathlib.Path(__file__).resolve().parents[2] / "embedmesh"


def _private_uses(path: pathlib.Path) -> list[str]:
    """`x._name` attribute reads in a module whose object is not `self`/`cls` or a
    module alias (the names a module calls its facade: layer, emb, embedding, ...)."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if private_attribute(node, {"layer", "emb", "embedding", "facade", "mesh_embedding"}):
            bad.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.value.id}.{node.attr}")
        if (  # self.layer._x (the modules keep their layer as an attribute)
            private_attribute(node)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "layer"
        ):
            bad.append(f"{path.relative_to(PKG.parent)}:{node.lineno} .layer.{node.attr}")
    return bad


def test_flax_and_checkpoints_use_no_private_name_of_the_facade():
    paths = sorted((PKG / "flax").glob("*.py")) + sorted((PKG / "checkpoint").glob("*.py"))
    bad = [b for p in paths for b in _private_uses(p)]
    assert not bad, bad


def test_the_scan_finds_a_private_use(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f(layer):\n    return layer._state, self.layer._seed\n")
    assert len(_private_uses_at(f)) == 2


def _private_uses_at(path):
    global PKG
    saved, PKG = PKG, path.parent
    try:
        return _private_uses(path)
    finally:
        PKG = saved


def _layer():
    t = em.TableConfig(20, 4, name="t", combiner="mean")
    u = em.TableConfig(10, 8, name="u", combiner="sum")
    feats = {"a": em.FeatureConfig(t), "b": em.FeatureConfig(u, output_shape=(4, 2))}
    return em.MeshEmbedding(feats, em.Adagrad(0.3)), t, u


def test_the_job_steps_like_the_facade_with_the_state_outside():
    """Lookup and update through the job and the core, the state held by the caller,
    give the facade's activations and tables; `release_state` hands the state over."""
    r = np.random.default_rng(0)
    batch = {"a": r.integers(0, 20, (8, 2)), "b": r.integers(0, 10, (8,))}
    emb, t, u = _layer()
    acts, pre = emb.dequeue(emb.enqueue(batch))
    grads = {k: r.uniform(-1, 1, np.shape(a)).astype(np.float32) for k, a in acts.items()}
    emb.apply_gradients(grads, pre)
    want = emb.embedding_tables

    layer, t, u = _layer()  # (tables compare by identity: the second layer's own)
    job = layer.job
    assert isinstance(job, em.EmbeddingJob) and job.tables == tuple(layer.job.resolved.tables)
    state = layer.release_state()
    csr = job.placed(layer.enqueue(batch), "test")
    got_acts = job.pack_activations(job.core.lookup(state, csr), csr)
    for k in acts:
        np.testing.assert_array_equal(np.asarray(got_acts[k]), np.asarray(acts[k]))
    job.check_preserved(csr)
    state, ok = job.core.apply_gradients(state, job.flat_gradients(grads, csr), csr)
    assert bool(ok)
    for cfg, name in ((t, "t"), (u, "u")):
        got = job.read_table(state, cfg)
        np.testing.assert_array_equal(got, want[next(k for k in want if k.name == name)])
    # a second owner gets a fresh initial state, not the one handed over
    fresh = layer.release_state()
    assert fresh is not state
    np.testing.assert_array_equal(job.read_table(fresh, t), job.read_table(job.init_state(), t))


def test_job_errors_name_the_feature():
    layer, _, _ = _layer()
    job = layer.job
    csr = job.placed(layer.enqueue({"a": np.zeros((8, 2), int), "b": np.zeros(8, int)}), "x")
    with pytest.raises(ValueError, match="gradient for feature a has shape"):
        job.flat_gradients({"a": np.zeros((3, 4), np.float32), "b": None}, csr)
    with pytest.raises(ValueError, match="preserved_outputs must be the dict"):
        job.check_preserved([1])


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_job_built_on_its_own_steps_like_the_facade(pipelined):
    """`EmbeddingJob.build(JobSpec.of(...))` without a facade: batches through its `Feed`,
    steps through its `Schedule` (state in, state out), the same activations and tables
    as `MeshEmbedding` with the same arguments, pipelined or not."""
    from embedmesh.job import EmbeddingJob, Feed, JobSpec

    r = np.random.default_rng(4)
    data = [{"a": r.integers(0, 20, (8, 2)), "b": r.integers(0, 10, (8,))} for _ in range(3)]
    t = em.TableConfig(20, 4, name="t", combiner="mean")
    u = em.TableConfig(10, 8, name="u", combiner="sum")
    feats = {"a": em.FeatureConfig(t), "b": em.FeatureConfig(u, output_shape=(4, 2))}
    emb = em.MeshEmbedding(feats, em.Adagrad(0.3), pipelined)
    spec = JobSpec.of(feats, em.Adagrad(0.3), pipelined)
    job, state = EmbeddingJob.build(spec)
    schedule, feed = job.schedule(state), Feed()
    for batch in data:
        want, pre = emb(batch)
        grads = {k: np.sin(np.asarray(a)).astype(np.float32) + 0.1 for k, a in want.items()}
        emb.apply_gradients(grads, pre)
        csr, _, feed = job.enqueue(feed, batch)
        acts, csr, schedule = job.dequeue(schedule, csr)
        for k in want:
            np.testing.assert_array_equal(np.asarray(acts[k]), np.asarray(want[k]))
        schedule = job.apply_gradients(schedule, grads, csr)
    observed, schedule = job.observe(schedule)
    got = job.read_tables(observed)
    want_tables = {t.name: v for t, v in emb.embedding_tables.items()}
    for t, v in got.items():
        np.testing.assert_array_equal(v, want_tables[t.name])


def test_update_programs_compiled_in_threads_are_the_ones_the_steps_run(monkeypatch):
    """With `BACKGROUND_COMPILE` on, the first lookup starts the update programs'
    compiles in threads of their own (from the shapes the lookup returns, sharded over
    the mesh as its outputs are): the steps then run those programs, each compiled once,
    and train the tables a float64 SGD of the same batches gives."""
    import threading

    import jax

    from embedmesh.job import steps

    monkeypatch.setattr(steps, "BACKGROUND_COMPILE", True)
    compiled = []

    def record(event, start, end, fun_name=""):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append((fun_name, threading.current_thread().name))

    t = em.TableConfig(16, 4, name="t", combiner="sum", initializer=em.row_id_initializer(1.0))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    emb = em.MeshEmbedding({"a": em.FeatureConfig(t)}, em.SGD(0.5), mesh=mesh)
    r = np.random.default_rng(5)
    batches = [r.integers(0, 16, (8, 2)) for _ in range(2)]
    want = np.broadcast_to(1.0 + np.arange(16.0)[:, None], (16, 4)).copy()
    jax.monitoring.register_event_time_span_listener(record)
    try:
        for ids in batches:
            ragged = em.RaggedTensor.from_row_lengths(ids.ravel(), np.full(8, 2))
            acts, pre = emb.dequeue(emb.enqueue({"a": ragged}))
            np.testing.assert_allclose(np.asarray(acts["a"]), want[ids].sum(1), rtol=1e-6)
            grads = np.cos(np.arange(32.0)).reshape(8, 4) + ids[:, :1]
            emb.apply_gradients({"a": grads.astype(np.float32)}, pre)
            for s in range(8):
                for i in ids[s]:
                    want[i] -= 0.5 * grads.astype(np.float32)[s]
        got = emb.embedding_tables[t]
    finally:
        jax.monitoring.unregister_event_time_span_listener(record)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    updates = [c for c in compiled if c[0] in ("jit(apply)", "jit(apply_then_lookup)")]
    assert sorted(updates) == [
        ("jit(apply)", "embedmesh-apply"),
        ("jit(apply_then_lookup)", "embedmesh-apply_lookup"),
    ], compiled
