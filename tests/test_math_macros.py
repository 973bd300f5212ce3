"""The site loads only MathJax's base TeX package (book.yml: ``input/tex-base``), so a macro
from the AMS or other packages renders as a red error on the page. tools/site_check.py finds
those in a browser; this test finds the common ones in the sources, without one."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: macros of MathJax packages the book does not load (ams, boldsymbol, mathtools, ...)
NOT_IN_BASE = ("tfrac", "dfrac", "binom", "operatorname", "boldsymbol", "tag",
               "implies", "coloneqq", "eqref", "align", "DeclareMathOperator")
SOURCES = sorted([*ROOT.glob("notebooks/*.md"), *ROOT.glob("docs/*.md")])
MATH = re.compile(r"\$\$(.+?)\$\$|\$([^$\n]+?)\$", re.S)


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_math_uses_only_mathjax_base_macros(source):
    used = [(m.group(0)[:60], name) for m in MATH.finditer(source.read_text())
            for name in re.findall(r"\\([A-Za-z]+)", m.group(0)) if name in NOT_IN_BASE]
    assert not used, f"{source.name}: macros the site's MathJax does not load: {used}"


def test_the_site_loads_only_the_base_package():
    assert '"input/tex-base"' in (ROOT / "book.yml").read_text()
