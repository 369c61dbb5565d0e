"""The documentation's promises that need no Sphinx build (.ci/run builds the site with
warnings as errors; tests/project/test_readme.py runs its code blocks): the API reference names
every public name, the index page links to what a newcomer looks for, and README stays
an overview whose set-up commands are the two CI runs."""

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# module -> its API page (or pages); its public names are its __all__ (plus the lazily
# loaded ones)
API_PAGES = {
    "embedmesh": ("api/embedmesh.md", "api/core.md"),
    "embedmesh.tpu": "api/tpu.md",
    "embedmesh.serving": "api/serving.md",
    "embedmesh.checkpoint": "api/checkpoint.md",
    "embedmesh.flax": "api/flax.md",
    "embedmesh.flax.nnx": "api/flax.md",
    "embedmesh.flax.linen": "api/flax.md",
}
LAZY = {"embedmesh.tpu": ["TPUEmbeddingForServing"]}  # module __getattr__, not in __all__


@pytest.mark.parametrize("module", API_PAGES)
def test_api_reference_names_every_public_name(module):
    if module.startswith("embedmesh.flax"):
        pytest.importorskip("flax")
    names = list(importlib.import_module(module).__all__) + LAZY.get(module, [])
    pages = API_PAGES[module]
    page = "\n".join((DOCS / p).read_text() for p in ([pages] if isinstance(pages, str) else pages))
    if module in ("embedmesh.flax.nnx", "embedmesh.flax.linen"):  # one section of flax.md
        page = page.split(f"## `{module}`", 1)[1].split("\n## ", 1)[0]
    documented = set(
        re.findall(
            r"^\.\. auto(?:class|function|data):: (?:[\w.]+\.)?(\w+)(?:\(.*\))?$", page, re.M
        )
    )
    aliased = set(re.findall(rf"^\| `{re.escape(module)}\.(\w+)` \|", page, re.M))
    missing = [n for n in names if n not in documented | aliased]
    assert not missing, f"{API_PAGES[module]} does not document {module}.{missing}"


def test_index_reaches_what_a_newcomer_looks_for():
    """Each in one click from the index page: a link to the page (and section) holding it."""
    index = (DOCS / "index.md").read_text()
    links = set(re.findall(r"\]\(([^)]+)\)", index))
    for target in [
        "training.md#several-cpu-devices-and-a-mesh",  # training on several devices
        "training.md#several-processes",
        "checkpoints.md#saving-and-restoring-on-any-device-count",  # another device count
        "serving.md#serving-from-a-checkpoint",
        "tpu.md",
    ]:
        assert target in links, target
        page, _, anchor = target.partition("#")
        headings = re.findall(r"^#+ (.+)$", (DOCS / page).read_text(), re.M)
        slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
        assert not anchor or anchor in slugs, f"{page} has no heading for #{anchor}"


def test_readme_is_an_overview_with_the_two_setup_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    setup = readme.split("## Set-up commands\n", 1)[1].split("\n## ", 1)[0]
    commands = [line.strip() for line in setup.splitlines() if line.startswith("    ")]
    assert commands == [
        "python3 -m venv .venv && .venv/bin/pip install -q --no-compile -e '.[examples]' "
        "&& .venv/bin/python -m examples.movielens",
        "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest",
    ]
    # every relative link of README and the guides names a file that exists
    for page in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in link:
                assert (page.parent / link).exists(), f"{page.name}: broken link {link}"
