"""Sphinx configuration of embedmesh's documentation (docs/: MyST Markdown guides and an
API reference from the docstrings). Built by .ci/run with warnings as errors:

    .venv/bin/sphinx-build -W --keep-going -b html docs /tmp/embedmesh-docs

No network is used: no intersphinx inventories, no remote images.
"""

import inspect
import os
import re
import sys

from docutils.utils import new_document
from myst_parser.mdit_to_docutils.sphinx_ import SphinxRenderer
from myst_parser.parsers.mdit import create_md_parser
from sphinx.errors import PycodeError
from sphinx.pycode import ModuleAnalyzer
from sphinx.util.docutils import SphinxDirective
from sphinx.util.inspect import stringify_signature

# Build from this checkout (CI installs it editable; a plain checkout works too).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# `import embedmesh` starts no backend; keep autodoc's imports on the CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import embedmesh

project = "embedmesh"
author = "the embedmesh authors"
copyright = "the embedmesh authors"
version = release = embedmesh.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# MyST: `#section` links to headings up to ### (the same slugs as GitHub's), and
# ```{directive} fences.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_default_options = {"members": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# `Callable[[Any, Sequence[int], Any], Any]`, not `~collections.abc.Callable[...]`; defaults
# as written in the source (`jnp.float32`), not their repr (`<class ...>`, which HTML eats)
autodoc_typehints_format = "short"
python_use_unqualified_type_names = True
autodoc_preserve_defaults = True
autodoc_class_signature = "mixed"

html_theme = "alabaster"
html_title = f"embedmesh {release}"
html_theme_options = {"description": "TPUEmbeddingV2's API on JAX", "fixed_sidebar": True}
html_show_sourcelink = False


# The docstrings are Markdown (`code` spans, `- ` lists, code blocks indented after a
# blank line, `**bold**`), with Google-style `Args:` / `Returns:` / `Raises:` sections,
# not reST: read as reST they give dozens of docutils warnings. Each docstring is parsed
# with MyST instead (the `embedmesh-markdown` directive below, through autodoc's
# docstring hook), its sections turned into Markdown lists first.
SECTIONS = re.compile(r"^(Args|Arguments|Returns|Yields|Raises|Attributes):\s*$")


def google_sections_to_markdown(lines: list[str]) -> list[str]:
    """`Args:` and its indented `name: text` entries -> `**Args:**` and a Markdown list
    (continuation lines join their entry); other sections' text as a paragraph."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = SECTIONS.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        out += [f"**{m.group(1)}:**", ""]
        i += 1
        body = []
        while i < len(lines) and (not lines[i].strip() or lines[i][:1].isspace()):
            body.append(lines[i])
            i += 1
        while body and not body[-1].strip():
            body.pop()
        indent = min((len(b) - len(b.lstrip()) for b in body if b.strip()), default=0)
        listed = m.group(1) != "Returns" and m.group(1) != "Yields"
        for b in body:
            if not b.strip():
                out.append("")
            elif listed and len(b) - len(b.lstrip()) == indent:
                out.append("- " + b.strip())
            else:
                out.append("  " + b.strip())
        out.append("")
    return out


def documented_constant(name: str, obj) -> list[str] | None:
    """The `#:` comment of the module-level constant `name` (a re-exported `str` or `int`
    would otherwise show its builtin type's docstring): looked up in the module that
    assigns it, among embedmesh's modules."""
    attr = name.rpartition(".")[2]
    for modname, module in sorted(sys.modules.items()):
        if not modname.startswith("embedmesh") or getattr(module, attr, None) is not obj:
            continue
        try:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        except PycodeError:
            continue
        if ("", attr) in docs:
            return list(docs[("", attr)])
    return None


def markdown_docstring(app, what, name, obj, options, lines):
    if what == "data" and lines and type(obj).__doc__ and type(obj).__module__ == "builtins":
        builtin = [line.strip() for line in type(obj).__doc__.strip().splitlines()]
        if [line.strip() for line in lines if line.strip()][:2] == [b for b in builtin if b][:2]:
            lines[:] = documented_constant(name, obj) or []
    if lines:
        body = google_sections_to_markdown(lines)
        lines[:] = [".. embedmesh-markdown::", ""] + ["   " + b if b else "" for b in body]


class MarkdownDocstring(SphinxDirective):
    """Its content parsed as MyST Markdown (a docstring), the nodes put in place."""

    has_content = True

    def run(self):
        document = new_document(self.get_source_info()[0], self.state.document.settings)
        parser = create_md_parser(self.env.myst_config, SphinxRenderer)
        parser.options["document"] = document
        parser.render("\n".join(self.content))
        return list(document.children)


# The guides link to files of the repository outside docs/ (`../benchmarks/RESULTS.md`),
# which GitHub shows; in the site they become downloads (copied into it, no network).
REPO_FILE_LINK = re.compile(r"\[([^\]`<>]+)\]\((\.\./[^)#\s]+)\)")


def repository_links_as_downloads(app, docname, source):
    source[0] = REPO_FILE_LINK.sub(r"{download}`\1 <\2>`", source[0])


def own_init_signature(app, what, name, obj, options, signature, return_annotation):
    """A class whose `__new__(cls, *args, **kwargs)` checks its arguments (the optimizers
    refuse TensorFlow's argument names there) shows its `__init__`'s signature, which
    autodoc would otherwise pass over for `__new__`'s `(*args, **kwargs)`."""
    if (
        what != "class"
        or signature is None
        or not re.fullmatch(r"\(\*args(: Any)?, \*\*kwargs(: Any)?\)", signature)
    ):
        return None
    init = obj.__dict__.get("__init__") or getattr(obj, "__init__", None)
    if init is None or init is object.__init__:
        return None
    sig = inspect.signature(init)
    sig = sig.replace(parameters=list(sig.parameters.values())[1:])  # without self
    return stringify_signature(sig, show_return_annotation=False, unqualified_typehints=True), None


def setup(app):
    app.connect("autodoc-process-signature", own_init_signature)
    app.add_directive("embedmesh-markdown", MarkdownDocstring)
    app.connect("source-read", repository_links_as_downloads)
    app.connect("autodoc-process-docstring", markdown_docstring)
