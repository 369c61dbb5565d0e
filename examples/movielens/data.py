"""MovieLens-100k for click-through prediction: fetch, validate, encode, split, batch.

The data ships inside the PyPI wheel of RecBole 1.2.1
(`recbole/dataset_example/ml-100k/ml-100k.{inter,user,item}`, RecBole's
"atomic" format: tab-separated, a typed header such as `user_id:token`).
It is fetched at run time with `pip download --no-deps recbole==1.2.1` into a
cache folder and read out of the wheel with `zipfile`; recbole itself is never
installed, and the data is never committed (GroupLens terms forbid
redistribution). The wheel's SHA-256 is pinned, so a second run needs no
network and a damaged cache is refused with a message saying what to do.

Task (RecBole's context-aware set-up): label = rating >= 4; categorical
features user_id, item_id, age, gender, occupation, zip_code, release_year
and genre (multi-hot, a ragged feature); a random 80/10/10 split.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

WHEEL_NAME = "recbole-1.2.1-py3-none-any.whl"
WHEEL_REQUIREMENT = "recbole==1.2.1"
WHEEL_SHA256 = "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407"
MEMBER_DIR = "recbole/dataset_example/ml-100k"
FILES = ("inter", "user", "item")

# Columns each atomic file must have (name -> type); other columns are ignored.
REQUIRED_COLUMNS = {
    "inter": {"user_id": "token", "item_id": "token", "rating": "float"},
    "user": {
        "user_id": "token",
        "age": "token",
        "gender": "token",
        "occupation": "token",
        "zip_code": "token",
    },
    "item": {"item_id": "token", "release_year": "token", "class": "token_seq"},
}
# Sizes of the genuine MovieLens-100k (checked only for the pinned wheel).
EXPECTED_ROWS = {"inter": 100_000, "user": 943, "item": 1682}

SINGLE_FEATURES = ("user_id", "item_id", "age", "gender", "occupation", "zip_code", "release_year")
MULTI_FEATURES = ("genre",)
FEATURES = SINGLE_FEATURES + MULTI_FEATURES
LABEL_THRESHOLD = 4.0  # label = rating >= 4 (RecBole's `threshold: {rating: 4}`)


class MovieLensDataError(ValueError):
    """The data is missing, damaged or not in the expected format."""


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def default_cache_dir() -> Path:
    """`$EMBEDMESH_CACHE/movielens`, else `.cache/movielens` in the repository (gitignored)."""
    env = os.environ.get("EMBEDMESH_CACHE")
    if env:
        return Path(env).expanduser() / "movielens"
    return repo_root() / ".cache" / "movielens"


# ---------------------------------------------------------------------------
# Fetching


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_wheel(path: Path) -> None:
    digest = _sha256(path)
    if digest != WHEEL_SHA256:
        raise MovieLensDataError(
            f"{path} is corrupted or not the expected file: its SHA-256 is {digest}, "
            f"expected {WHEEL_SHA256} ({WHEEL_REQUIREMENT}). Delete it and run again to "
            f"download a fresh copy."
        )


def fetch_wheel(
    cache_dir: Path | None = None, *, download: bool = True, quiet: bool = False
) -> Path:
    """Path of the verified RecBole wheel in `cache_dir`, downloading it if needed.

    A cached wheel is verified against the pinned SHA-256 and never
    re-downloaded silently: a damaged one raises `MovieLensDataError`.
    Without network (or with `download=False`) a missing wheel raises
    `MovieLensDataError` explaining how to provide it.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    wheel = cache_dir / WHEEL_NAME
    if wheel.exists():
        _check_wheel(wheel)
        return wheel
    how = (
        f"Either make PyPI reachable (proxy settings are read by pip), or copy the file "
        f"{WHEEL_NAME} (from `pip download --no-deps {WHEEL_REQUIREMENT}` on another "
        f"machine) to {wheel}."
    )
    if not download:
        raise MovieLensDataError(f"MovieLens-100k is not cached at {wheel}. {how}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(
            f"downloading MovieLens-100k: pip download --no-deps {WHEEL_REQUIREMENT} "
            f"(2 MB, once) into {cache_dir}",
            flush=True,
        )
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            WHEEL_REQUIREMENT,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MovieLensDataError(f"could not download MovieLens-100k ({e}). {how}") from e
        got = Path(tmp) / WHEEL_NAME
        if proc.returncode != 0 or not got.exists():
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-5:])
            raise MovieLensDataError(
                f"could not download MovieLens-100k: `{' '.join(cmd[2:])}` failed "
                f"(exit {proc.returncode}):\n{tail}\n{how}"
            )
        _check_wheel(got)
        os.replace(got, wheel)  # atomic: a cached wheel is always complete
    return wheel


def read_wheel_files(wheel: Path) -> dict:
    """`{"inter"|"user"|"item": text}` read out of the wheel with zipfile."""
    out = {}
    try:
        with zipfile.ZipFile(wheel) as z:
            for kind in FILES:
                member = f"{MEMBER_DIR}/ml-100k.{kind}"
                try:
                    raw = z.read(member)  # checks the member's CRC
                except KeyError:
                    raise MovieLensDataError(f"{wheel} has no member {member}") from None
                out[kind] = _decode(raw, f"{wheel}!{member}")
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        zlib.error,
        EOFError,
        OSError,
        RuntimeError,
        NotImplementedError,
    ) as e:
        raise MovieLensDataError(f"{wheel} is corrupted ({e}); delete it and run again") from e
    return out


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")  # movie titles in some copies; unused columns


# ---------------------------------------------------------------------------
# Parsing and validation


@dataclasses.dataclass
class AtomicTable:
    columns: dict  # name -> list of str (raw field values)
    num_rows: int


def parse_atomic(text: str, kind: str, where: str) -> AtomicTable:
    """Parse one atomic file, checking header, column count and field types."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise MovieLensDataError(f"{where}: the file is empty")
    header = lines[0].rstrip("\r").split("\t")
    names, types = [], []
    for col in header:
        if ":" not in col:
            raise MovieLensDataError(
                f"{where}, line 1: header field {col!r} is not "
                f"'name:type'; the file is corrupted or not an atomic "
                f"file"
            )
        n, t = col.split(":", 1)
        names.append(n)
        types.append(t)
    need = REQUIRED_COLUMNS[kind]
    for n, t in need.items():
        if n not in names:
            raise MovieLensDataError(
                f"{where}, line 1: missing column {n}:{t} (header {lines[0]!r})"
            )
        got = types[names.index(n)]
        if got != t:
            raise MovieLensDataError(f"{where}, line 1: column {n} has type {got}, expected {t}")
    width = len(names)
    idx = {n: names.index(n) for n in need}
    cols = {n: [] for n in need}
    for lineno, line in enumerate(lines[1:], start=2):
        fields = line.rstrip("\r").split("\t")
        if len(fields) != width:
            raise MovieLensDataError(
                f"{where}, line {lineno}: {len(fields)} fields, expected "
                f"{width} ({lineno - 1} data rows read before it); the "
                f"file is corrupted"
            )
        for n, i in idx.items():
            cols[n].append(fields[i])
    table = AtomicTable(cols, len(lines) - 1)
    for n, t in need.items():
        if t == "token":
            for r, v in enumerate(table.columns[n]):
                if n.endswith("_id") and v == "":
                    raise MovieLensDataError(f"{where}, line {r + 2}: empty {n}")
    return table


def _float_column(table: AtomicTable, name: str, where: str) -> np.ndarray:
    vals = table.columns[name]
    try:
        return np.asarray(vals, dtype=np.float64)
    except ValueError:
        for r, v in enumerate(vals):
            try:
                float(v)
            except ValueError:
                raise MovieLensDataError(
                    f"{where}, line {r + 2}: {name} = {v!r} is not a number; the file is corrupted"
                ) from None
        raise


# ---------------------------------------------------------------------------
# The encoded dataset


@dataclasses.dataclass
class MovieLens:
    """Encoded interactions. Id 0 of every vocabulary means missing/unknown.

    single: [n, 7] int32 ids of SINGLE_FEATURES; item: [n] int32 item index
    (row of the per-item genre lists); labels: [n] float32;
    genre_splits/genre_values: the genres of item i are
    genre_values[genre_splits[i]:genre_splits[i + 1]].
    """

    single: np.ndarray
    labels: np.ndarray
    genre_splits: np.ndarray
    genre_values: np.ndarray
    vocab_sizes: dict
    vocabularies: dict

    @property
    def num_samples(self) -> int:
        return int(self.labels.shape[0])

    def features(self, rows: np.ndarray) -> dict:
        """Model inputs for the samples `rows`: dense ids, genres ragged (numpy)."""
        from embedmesh import RaggedTensor  # jax-free at import time

        out = {name: self.single[rows, i] for i, name in enumerate(SINGLE_FEATURES)}
        items = self.single[rows, SINGLE_FEATURES.index("item_id")]
        starts = self.genre_splits[items]
        lengths = self.genre_splits[items + 1] - starts
        splits = np.zeros(rows.shape[0] + 1, np.int64)
        np.cumsum(lengths, out=splits[1:])
        gather = np.arange(splits[-1], dtype=np.int64) + np.repeat(starts - splits[:-1], lengths)
        out["genre"] = RaggedTensor(values=self.genre_values[gather], row_splits=splits)
        return out


def _vocab(values) -> dict:
    """token -> id, ids 1.. in sorted token order (0: missing/unknown)."""
    toks = sorted({v for v in values if v != ""})
    return {t: i + 1 for i, t in enumerate(toks)}


def encode(texts: dict, where: dict, *, check_sizes: bool = False) -> MovieLens:
    """Validate and encode the three atomic files into a `MovieLens`."""
    inter = parse_atomic(texts["inter"], "inter", where["inter"])
    user = parse_atomic(texts["user"], "user", where["user"])
    item = parse_atomic(texts["item"], "item", where["item"])
    if check_sizes:
        for kind, t in (("inter", inter), ("user", user), ("item", item)):
            if t.num_rows != EXPECTED_ROWS[kind]:
                raise MovieLensDataError(
                    f"{where[kind]}: {t.num_rows} rows, expected "
                    f"{EXPECTED_ROWS[kind]}; the file is corrupted"
                )
    if inter.num_rows == 0:
        raise MovieLensDataError(f"{where['inter']}: no interactions")
    rating = _float_column(inter, "rating", where["inter"])
    if not np.all(np.isfinite(rating)):
        r = int(np.flatnonzero(~np.isfinite(rating))[0])
        raise MovieLensDataError(f"{where['inter']}, line {r + 2}: rating is not finite")

    vocabs = {
        name: _vocab(
            user.columns[name]
            if name in user.columns
            else item.columns[name]
            if name in item.columns
            else []
        )
        for name in SINGLE_FEATURES
    }
    vocabs["genre"] = _vocab(g for v in item.columns["class"] for g in v.split(" "))

    def lookup_rows(kind, table, key):
        pos = {}
        for r, k in enumerate(table.columns[key]):
            if k in pos:
                raise MovieLensDataError(f"{where[kind]}, line {r + 2}: duplicate {key} {k!r}")
            pos[k] = r
        return pos

    user_row = lookup_rows("user", user, "user_id")
    item_row = lookup_rows("item", item, "item_id")
    n = inter.num_rows
    u_rows = np.empty(n, np.int64)
    i_rows = np.empty(n, np.int64)
    for r, (u, i) in enumerate(zip(inter.columns["user_id"], inter.columns["item_id"])):
        if u not in user_row:
            raise MovieLensDataError(
                f"{where['inter']}, line {r + 2}: user_id {u!r} is not in {where['user']}"
            )
        if i not in item_row:
            raise MovieLensDataError(
                f"{where['inter']}, line {r + 2}: item_id {i!r} is not in {where['item']}"
            )
        u_rows[r] = user_row[u]
        i_rows[r] = item_row[i]

    def encoded(name, table):
        v = vocabs[name]
        return np.asarray([v.get(t, 0) for t in table.columns[name]], np.int32)

    single = np.empty((n, len(SINGLE_FEATURES)), np.int32)
    for j, name in enumerate(SINGLE_FEATURES):
        if name in user.columns:
            single[:, j] = encoded(name, user)[u_rows]
        else:
            single[:, j] = encoded(name, item)[i_rows]
    # item_id's column holds ids 1..; the genre lists are indexed by that id.
    item_ids = encoded("item_id", item)
    lists = [[] for _ in range(len(vocabs["item_id"]) + 1)]
    for k, cls in zip(item_ids, item.columns["class"]):
        lists[k] = [vocabs["genre"][g] for g in cls.split(" ") if g]
    lengths = np.asarray([len(x) for x in lists], np.int64)
    splits = np.zeros(len(lists) + 1, np.int64)
    np.cumsum(lengths, out=splits[1:])
    values = np.asarray([g for x in lists for g in x], np.int32)
    vocab_sizes = {name: len(v) + 1 for name, v in vocabs.items()}
    return MovieLens(
        single, (rating >= LABEL_THRESHOLD).astype(np.float32), splits, values, vocab_sizes, vocabs
    )


def load_movielens(
    cache_dir: Path | None = None,
    *,
    data_dir: Path | None = None,
    download: bool = True,
    quiet: bool = False,
) -> MovieLens:
    """The encoded MovieLens-100k.

    `data_dir`: read `ml-100k.{inter,user,item}` from this folder instead of
    the wheel (any data in the same atomic format, e.g. a small synthetic set
    for tests); otherwise the pinned RecBole wheel in `cache_dir`
    (downloaded once). Raises `MovieLensDataError` for missing or damaged data.
    """
    if data_dir is not None:
        data_dir = Path(data_dir)
        texts, where = {}, {}
        for kind in FILES:
            p = data_dir / f"ml-100k.{kind}"
            if not p.exists():
                raise MovieLensDataError(f"{p} does not exist")
            texts[kind] = _decode(p.read_bytes(), str(p))
            where[kind] = str(p)
        return encode(texts, where)
    wheel = fetch_wheel(cache_dir, download=download, quiet=quiet)
    texts = read_wheel_files(wheel)
    where = {k: f"{wheel.name}!{MEMBER_DIR}/ml-100k.{k}" for k in FILES}
    return encode(texts, where, check_sizes=True)


# ---------------------------------------------------------------------------
# Splitting and batching


def split_indices(n: int, seed: int = 2020, fractions=(0.8, 0.1, 0.1)) -> tuple:
    """A random train/validation/test split of `range(n)` with a fixed seed."""
    perm = np.random.default_rng(seed).permutation(n)
    a = int(round(fractions[0] * n))
    b = a + int(round(fractions[1] * n))
    return perm[:a], perm[a:b], perm[b:]


def train_batches(
    ds: MovieLens, rows: np.ndarray, batch_size: int, rng: np.random.Generator
) -> Iterator[tuple]:
    """Shuffled full batches `(features, labels, mask)` (the remainder is dropped)."""
    perm = rows[rng.permutation(rows.shape[0])]
    for s in range(0, perm.shape[0] - batch_size + 1, batch_size):
        b = perm[s : s + batch_size]
        yield ds.features(b), ds.labels[b], np.ones(batch_size, np.float32)


def eval_batches(ds: MovieLens, rows: np.ndarray, batch_size: int) -> Iterator[tuple]:
    """Batches in order, the last one padded (mask 0) to `batch_size`.

    Padding repeats the first samples of `rows` (not one sample many times,
    which would crowd one shard's partition past its capacity).
    """
    for s in range(0, rows.shape[0], batch_size):
        b = rows[s : s + batch_size]
        k = b.shape[0]
        if k < batch_size:
            b = np.concatenate([b, np.resize(rows, batch_size - k)])
        mask = np.zeros(batch_size, np.float32)
        mask[:k] = 1
        yield ds.features(b), ds.labels[b], mask


def write_synthetic(
    folder: Path,
    num_users: int = 60,
    num_items: int = 80,
    num_interactions: int = 4000,
    seed: int = 0,
) -> Path:
    """A small dataset in the same atomic format with a learnable signal (for tests)."""
    rng = np.random.default_rng(seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    occupations = ["artist", "doctor", "engineer", "other", "student", "writer"]
    genres = ["Action", "Comedy", "Drama", "Horror", "Romance", "Sci-Fi", "Children's"]
    with open(folder / "ml-100k.user", "w") as f:
        f.write("user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n")
        for u in range(1, num_users + 1):
            f.write(
                f"{u}\t{rng.integers(18, 70)}\t{'MF'[rng.integers(2)]}\t"
                f"{occupations[rng.integers(len(occupations))]}\t"
                f"{rng.integers(10000, 99999):05d}\n"
            )
    with open(folder / "ml-100k.item", "w") as f:
        f.write("item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n")
        for i in range(1, num_items + 1):
            k = rng.integers(1, 4)
            cls = " ".join(rng.choice(genres, size=k, replace=False))
            year = "" if i % 17 == 0 else str(rng.integers(1950, 1999))
            f.write(f"{i}\tMovie {i}\t{year}\t{cls}\n")
    user_bias = rng.normal(size=num_users + 1)
    item_bias = rng.normal(size=num_items + 1)
    with open(folder / "ml-100k.inter", "w") as f:
        f.write("user_id:token\titem_id:token\trating:float\ttimestamp:float\n")
        for _ in range(num_interactions):
            u = int(rng.integers(1, num_users + 1))
            i = int(rng.integers(1, num_items + 1))
            score = user_bias[u] + item_bias[i] + 0.5 * rng.normal()
            rating = int(np.clip(np.round(3.3 + score), 1, 5))
            f.write(f"{u}\t{i}\t{rating}\t{880000000 + int(rng.integers(10**7))}\n")
    return folder
