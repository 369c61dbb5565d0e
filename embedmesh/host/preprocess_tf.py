"""TensorFlow's call form of `preprocess_features` (`TPUEmbeddingV2`'s
SparseCore arguments) on embedmesh's plan: its arguments are checked against
embedmesh's stacking and mapped onto `preprocess_batch`'s (`seed_batch_arguments`).
`embedmesh.host.preprocess` runs the batch (this module imports it not).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from embedmesh.inputs import resolved_structure
from embedmesh.layout.stacking import StackingPlan, plan_stacking

__all__ = ["SEED_ARGS", "seed_batch_arguments"]


def _seed_int(field: str, value, minimum: int = 1) -> int:
    if not (
        isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= minimum
    ):
        raise ValueError(f"preprocess_features: {field} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _seed_features(flat_features):
    """(ResolvedFeatures, names) of TensorFlow's flat_features: `[(joined path,
    FeatureConfig)]` as `nest.flatten_with_joined_string_paths` gives, or a
    (nested) feature config itself."""
    from embedmesh.config import FeatureConfig, _resolve_feature_config, resolve_feature_config

    pairs = (
        isinstance(flat_features, (list, tuple))
        and flat_features
        and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[1], FeatureConfig)
            for p in flat_features
        )
    )
    if not pairs:
        return resolve_feature_config(flat_features), False
    paths = [str(p[0]) for p in flat_features]
    configs = [p[1] for p in flat_features]
    resolved = _resolve_feature_config(configs)
    names = tuple(f.name or path for path, f in zip(paths, configs))
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"preprocess_features: flat_features names are not unique: {dup}")
    return dataclasses.replace(resolved, feature_names=names), True


def seed_batch_arguments(
    num_replicas_in_sync: int,
    max_ids_per_chip_per_sample: int,
    max_minibatches_per_sc: int,
    num_sc_per_chip: int,
    num_sc_shards: int,
    stacked_table_to_tables: Mapping[str, Any] | None,
    table_to_stacked_table_offset: Mapping[str, tuple] | None,
    table_to_sample_count: Mapping[str, int] | None,
    feature_to_sample_offset: Mapping[str, int] | None,
    flat_features: Any,
    flat_inputs: Any,
    flat_weights: Any | None = None,
    **options,
) -> tuple[Any, Any, StackingPlan, dict]:
    """TensorFlow's `TPUEmbeddingV2.preprocess_features` arguments as
    `preprocess_batch`'s: `(features, weights, plan, options)`.

    Mapping of TensorFlow's SparseCore terms:

    - `num_replicas_in_sync` -> the number of shards N (the mesh size); the
      local devices D default to N (one process; pass `num_devices_local`
      with several).
    - `flat_features` -> the feature structure: TensorFlow's `[(joined path,
      FeatureConfig)]` (feature names are `FeatureConfig.name or path`, as
      `MeshEmbedding` names a nested config's features), or a feature config.
      `flat_inputs` / `flat_weights`: the inputs (weights, None entries
      allowed) in that order (a flat list; or nested like a given config).
    - `stacked_table_to_tables` (`{stack: [TableConfig or table name]}`) is
      checked against embedmesh's stacking and selects it: the same groups as
      `plan_stacking(stack_tables=True)` or as `stack_tables=False` (None:
      the default); any other grouping is a ValueError. The returned dict is
      keyed by embedmesh's stack names (a table's name, or names joined by
      "+"), which may differ from the given keys.
    - `table_to_stacked_table_offset` (`{table: (stack, offset, shift)}`):
      checked to name every table and its stack; offsets and shifts are
      ignored (embedmesh's layout: `StackingPlan`, `TablePlacement.rotation`).
    - `table_to_sample_count`, `feature_to_sample_offset`: checked to be
      int-valued dicts over the stacks / feature paths; values ignored
      (embedmesh derives the activation layout from the batch).
    - `num_sc_shards` checked to equal `num_replicas_in_sync *
      num_sc_per_chip`; `num_sc_per_chip`, `max_ids_per_chip_per_sample`,
      `max_minibatches_per_sc` checked to be ints >= 1 and otherwise ignored
      (no SparseCores, no minibatching: partition sizes are `capacities`).
    - `**options`: `preprocess_batch`'s keywords (capacities, overflow,
      num_devices_local, process_index, backend, num_threads).
    """
    n = _seed_int("num_replicas_in_sync", num_replicas_in_sync)
    per_chip = _seed_int("num_sc_per_chip", num_sc_per_chip)
    _seed_int("max_ids_per_chip_per_sample", max_ids_per_chip_per_sample)
    _seed_int("max_minibatches_per_sc", max_minibatches_per_sc)
    if _seed_int("num_sc_shards", num_sc_shards) != n * per_chip:
        raise ValueError(
            f"preprocess_features: num_sc_shards ({num_sc_shards}) must be "
            f"num_replicas_in_sync * num_sc_per_chip = {n * per_chip}"
        )
    resolved, flat = _seed_features(flat_features)
    plan = _seed_plan(resolved, n, stacked_table_to_tables)
    table_names = set(resolved.table_names)
    groups = _seed_groups(stacked_table_to_tables, resolved) if stacked_table_to_tables else {}
    if table_to_stacked_table_offset is not None:
        got = set(map(str, table_to_stacked_table_offset))
        if got != table_names:
            raise ValueError(
                f"preprocess_features: table_to_stacked_table_offset names tables "
                f"{sorted(got)}, the features use {sorted(table_names)}"
            )
        for t, v in table_to_stacked_table_offset.items():
            if not (isinstance(v, (tuple, list)) and len(v) == 3):
                raise ValueError(
                    f"preprocess_features: table_to_stacked_table_offset[{t!r}] "
                    f"must be (stack, offset, shift), got {v!r}"
                )
            if groups and (v[0] not in groups or t not in groups[v[0]]):
                raise ValueError(
                    f"preprocess_features: table_to_stacked_table_offset puts table "
                    f"{t} in stack {v[0]!r}, stacked_table_to_tables does not"
                )
    for field, value, keys in (
        ("table_to_sample_count", table_to_sample_count, set(groups) if groups else None),
        ("feature_to_sample_offset", feature_to_sample_offset, set(resolved.feature_names)),
    ):
        if value is None:
            continue
        if not isinstance(value, Mapping) or not all(
            isinstance(v, (int, np.integer)) for v in value.values()
        ):
            raise ValueError(f"preprocess_features: {field} must be a dict of ints, got {value!r}")
        if keys is not None and set(map(str, value)) != keys:
            raise ValueError(
                f"preprocess_features: {field} has keys {sorted(map(str, value))}, "
                f"expected {sorted(keys)}"
            )
    if flat:
        features = list(flat_inputs) if isinstance(flat_inputs, (list, tuple)) else flat_inputs
        weights = (
            None
            if flat_weights is None
            else list(flat_weights)
            if isinstance(flat_weights, (list, tuple))
            else flat_weights
        )
    else:
        features, weights = flat_inputs, flat_weights
        if isinstance(flat_inputs, (list, tuple)) and not isinstance(
            resolved_structure(resolved), (list, tuple)
        ):
            features = jax.tree_util.tree_unflatten(resolved.treedef, list(flat_inputs))
            if isinstance(flat_weights, (list, tuple)):
                weights = jax.tree_util.tree_unflatten(resolved.treedef, list(flat_weights))
    options.setdefault("num_devices_local", n)
    return features, weights, plan, options


# TensorFlow's parameters of `preprocess_features`, in order (`**options` left out)
SEED_ARGS = tuple(inspect.signature(seed_batch_arguments).parameters)[:-1]


def _seed_groups(stacked_table_to_tables, resolved) -> dict:
    from embedmesh.config import TableConfig

    if not isinstance(stacked_table_to_tables, Mapping):
        raise ValueError(
            f"preprocess_features: stacked_table_to_tables must be a dict "
            f"{{stack: [tables]}}, got {type(stacked_table_to_tables).__name__}"
        )
    groups = {}
    for stack, tables in stacked_table_to_tables.items():
        names = []
        for t in tables if isinstance(tables, (list, tuple)) else [tables]:
            try:
                names.append(resolved.table_name(t) if isinstance(t, TableConfig) else str(t))
            except KeyError:
                raise ValueError(
                    f"preprocess_features: stacked_table_to_tables[{stack!r}] holds "
                    f"a table no feature uses: {t!r}"
                ) from None
        groups[stack] = names
    return groups


def _seed_plan(resolved, n: int, stacked_table_to_tables) -> StackingPlan:
    if stacked_table_to_tables is None:
        return plan_stacking(resolved, n)
    groups = _seed_groups(stacked_table_to_tables, resolved)
    want = sorted(sorted(g) for g in groups.values())
    for stack_tables in (True, False):
        plan = plan_stacking(resolved, n, stack_tables=stack_tables)
        if sorted(sorted(s.tables) for s in plan.stacks) == want:
            return plan
    raise ValueError(
        f"preprocess_features: stacked_table_to_tables groups the tables as {want}; "
        f"embedmesh stacks tables of one padded dim, optimizer and dtype (or each "
        f"alone) and cannot realise that grouping"
    )
