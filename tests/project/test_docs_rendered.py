"""The API reference as a reader sees it: the rendered HTML of the site, and the sources
that render into it.

Each test names a class of defect a reader met: a wrapped formula line that Markdown
turned into a list item, a text that HTML took for a tag, a constant shown with its
builtin type's docstring, a public class whose signature reads `(*args, **kwargs)`,
private names and maintainer notes in user pages, objects printed as `<... at 0x...>`.

The site is the one `.ci/run` builds (its directory in `EMBEDMESH_DOCS_HTML`); elsewhere
it is built here once (Sphinx, about 20 s)."""

import ast
import html.parser
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# the HTML tags a Sphinx page of this site uses; any other start tag is text that HTML
# took for markup (`output_<i>` written outside a code span: Sphinx writes <em> and
# <strong>, never <i> or <b>)
HTML_TAGS = frozenset(
    re.findall(
        r"\w+",
        """a abbr article aside blockquote body br button caption cite code col colgroup dd
        details dfn div dl dt em figcaption figure footer form h1 h2 h3 h4 h5 h6 head header
        hr html img input kbd label li link main meta nav noscript ol p path pre samp script
        search section small span strong style sub summary sup svg table tbody td tfoot th
        thead title tr ul var""",
    )
)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    built = os.environ.get("EMBEDMESH_DOCS_HTML")
    if built and (pathlib.Path(built) / "api" / "embedmesh.html").exists():
        return pathlib.Path(built)
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    out = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "sphinx", "-q", "-b", "html", str(DOCS), str(out)],
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return out


def api_pages(site: pathlib.Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((site / "api").glob("*.html"))}


def text_of(fragment: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", fragment).split())


class _Tags(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.unknown: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in HTML_TAGS:
            self.unknown.append(f"<{tag}> at line {self.getpos()[0]}")


def test_no_text_taken_for_a_tag(site):
    for page in [*sorted(site.glob("*.html")), *sorted((site / "api").glob("*.html"))]:
        parser = _Tags()
        parser.feed(page.read_text())
        assert not parser.unknown, f"{page.relative_to(site)}: {parser.unknown}"


def test_no_constant_shows_its_builtin_type_docstring(site):
    builtin = [
        "str(object='') -&gt; str",
        "str(object=&#39;&#39;) -&gt; str",
        "int([x]) -&gt; integer",
        "Convert a number or string to an integer",
        "Create a new string object from the given object",
    ]
    for name, page in api_pages(site).items():
        found = [b for b in builtin if b in page]
        assert not found, f"api/{name} shows a builtin docstring: {found}"


def test_public_classes_show_their_own_signature(site):
    for name, page in api_pages(site).items():
        for m in re.finditer(r'<dt class="sig sig-object py" id="([\w.]+)">(.*?)</dt>', page, re.S):
            sig = text_of(m.group(2))
            assert not re.search(r"\(\s*\*\s*args\b.*\*\*\s*kwargs\b", sig), (
                f"api/{name}: {m.group(1)} renders as {sig!r}"
            )


def test_no_private_names_or_maintainer_notes(site):
    for name, page in api_pages(site).items():
        private = sorted(set(re.findall(r'<span class="pre">(_[a-z]\w*)', page)))
        assert not private, f"api/{name} names private functions: {private}"
        notes = re.findall(r"[Ii]ssue \d+|session [ivx]+\b", text_of(page))
        assert not notes, f"api/{name} carries maintainer notes: {notes}"


def _docstrings():
    """(module path, docstring) of every docstring in the package."""
    for path in sorted((ROOT / "embedmesh").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    yield path.relative_to(ROOT), doc


def _prose_lines(markdown: str):
    """The lines of Markdown text outside fenced code blocks."""
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield line


def test_no_wrapped_line_starts_a_list():
    """A paragraph line that starts with `+ ` or `* ` (a formula wrapped at an operator)
    is a list item to Markdown, and swallows the rest of the paragraph (indented 4 or more
    it continues the paragraph); this project's lists use `- `."""
    sources = [(p.relative_to(ROOT), p.read_text()) for p in sorted(DOCS.rglob("*.md"))]
    sources += list(_docstrings())
    bad = [
        f"{where}: {line.strip()[:60]!r}"
        for where, text in sources
        for line in _prose_lines(text)
        if re.match(r" {0,3}[+*] \S", line)
    ]
    assert not bad, bad


def test_user_objects_say_what_they_hold(tmp_path):
    import numpy as np

    import embedmesh as em
    from embedmesh.serving import EmbeddingForServing, export_serving, load_serving

    t = em.TableConfig(vocabulary_size=10, dim=3, name="genre")
    features = {"g": em.FeatureConfig(t)}
    served = EmbeddingForServing(features)
    assert "genre" in repr(served) and "10 x 3" in repr(served)
    table = np.arange(30, dtype=np.float32).reshape(10, 3)
    export_serving(
        lambda inputs, tables: tables[t][inputs["ids"]],
        tmp_path / "exp",
        tables={t: table},
        input_signature={"ids": em.serving.Dense((), np.int32)},
        batch_sizes=[2],
        feature_config=features,
    )
    fn = load_serving(tmp_path / "exp", precompile=False)
    assert "batch_sizes=[2]" in repr(fn) and "genre: 10 x 3" in repr(fn)
    emb = em.MeshEmbedding(features, optimizer=em.Adagrad(0.1))
    assert "genre: 10 x 3" in repr(emb) and "Adagrad" in repr(emb) and "built" not in repr(emb)
    emb.build()
    assert f"built on {emb.mesh.devices.size} devices" in repr(emb)
    for obj in (served, fn, emb):
        assert " at 0x" not in repr(obj)
