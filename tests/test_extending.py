"""The recipes of docs/extending.md walked on throwaway examples, so they cannot go stale: a toy format held by
the per-format tests and by an independent Fraction arithmetic; a toy study folder (data set, recorder,
headline) and a toy notebook in a temporary tree, found through the same seams the package uses and held by the
checks the recipes cite, each check shown failing where its step is skipped; and every file and test the recipes
name exists."""

from __future__ import annotations

import ast
import inspect
import json
import math
import re
import sys
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat not installed (notebook tooling, absent on the GPU image)")

from dora_num.numerics import formats as fm  # noqa: E402
from dora_num.numerics.arithmetic import Arithmetic  # noqa: E402
from dora_num.numerics.emulate import RoundEach  # noqa: E402
from dora_num.repro import results  # noqa: E402
from dora_num.repro.kernel import KERNELSPEC  # noqa: E402
from dora_num.repro.paths import REPO_ROOT  # noqa: E402
from dora_num.repro.render import rendering_line  # noqa: E402
from dora_num.studies import cli, datasets  # noqa: E402
from numerics import _exact_ref as ref  # noqa: E402  (tests/ is on the path, as for _report)
from numerics import test_arithmetic, test_collapse, test_format_bits, test_formats  # noqa: E402
from repro import test_notebook_conventions, test_rendered, test_runner  # noqa: E402
from studies import test_datasets  # noqa: E402
from test_docs import layout  # noqa: E402

DOC = REPO_ROOT / "docs" / "extending.md"

# ---------------------------------------------------------------------------------------------------------
# Recipe 1: a format
# ---------------------------------------------------------------------------------------------------------

TOY = fm.make_format("toy_e3m1", 3, 1)  # 5 bits with IEEE inf and NaN: a width no numpy type has
TOY_LAYOUT = (3, 1, 3, "ieee")  # for the independent decoder: exponent bits, significand bits, bias, specials
# The tests parametrized over the formats by name that do not apply to the toy: each is about a numpy/ml_dtypes
# or torch type (the toy has none) or about formats it names.  Every other one runs on the toy below.
NOT_FOR_THE_TOY = {"test_constants_match_ml_dtypes_finfo",
                   "test_ml_dtypes_is_exact_from_float32_and_its_float64_conversion_is_as_documented",
                   "test_torch_conversion_matches", "test_torch_fp8_conversion_matches_including_overflow",
                   "test_torch_float64_conversion_double_rounds_through_float32",
                   "test_exact_zone_is_asymmetric_and_matches_rounding",
                   "test_mx_formats_hold_the_values_of_the_specification",
                   "test_mx_formats_round_and_saturate_as_ml_dtypes",
                   "test_ulp_distance_rejects_what_the_sub_byte_formats_cannot_hold"}


def per_format_tests():
    """The tests of the format modules parametrized over format names, less :data:`NOT_FOR_THE_TOY`."""
    found = []
    for mod in (test_format_bits, test_formats, test_collapse):
        for name, fn in vars(mod).items():
            marks = getattr(fn, "pytestmark", [])
            if name.startswith("test_") and any(m.name == "parametrize" and m.args[0] == "name" for m in marks):
                found.append(fn)
    return [fn for fn in found if fn.__name__ not in NOT_FOR_THE_TOY]


class RoundedFractions(Arithmetic):
    """Each operation exact in Fractions and rounded once to ``fmt`` by the independent search of
    tests/numerics/_exact_ref.py: the oracle for ``RoundEach`` on the toy, and a toy arithmetic class."""

    name = "fractions-rounded-once"

    def __init__(self, fmt: str, fma: bool = False):
        self.fmt, self.fma = fmt, fma

    def _rn(self, op, *xs) -> float:
        if not all(math.isfinite(x) for x in xs):  # an infinite operand (an earlier overflow): IEEE's rules
            with np.errstate(all="ignore"):
                return float(op(*map(np.float64, xs)))
        x = op(*map(Fraction, xs))
        r = ref.round_ref(self.fmt, x)
        return math.copysign(math.inf, x) if r == "inf" else float(r)

    def const(self, x):
        return Fraction(x)

    def add(self, a, b):
        return self._rn(lambda s, t: s + t, a, b)

    def sub(self, a, b):
        return self._rn(lambda s, t: s - t, a, b)

    def mul(self, a, b):
        return self._rn(lambda s, t: s * t, a, b)

    def div(self, a, b):
        return self._rn(lambda s, t: s / t, a, b)

    def neg(self, a):
        return -a

    def muladd(self, a, b, c):
        return self._rn(lambda s, t, u: s * t + u, a, b, c) if self.fma else self.add(self.mul(a, b), c)

    def maximum(self, a, b):
        return max(a, b)

    def zero_to(self, a, b):
        return b if a == 0 else a

    def sqrt(self, a):
        # floor(sqrt(a) 2^200) / 2^200: within 2^-200 below sqrt(a), no midpoint of the toy lies in between
        return self._rn(lambda s: Fraction(math.isqrt(s.numerator * 4**200 // s.denominator), 2**200), a)


def test_a_format_recipe(monkeypatch):
    # step 1: one line in FORMATS; everything else derived from the layout
    assert (TOY.bits, TOY.p, TOY.max, TOY.np_dtype, TOY.torch_dtype) == (5, 2, 12.0, None, None)
    assert TOY.seed == fm.name_seed("toy_e3m1")
    with pytest.raises(ValueError, match="unknown format name 'toy_e3m1'"):
        fm.get_format("toy_e3m1")
    monkeypatch.setitem(fm.FORMATS, TOY.name, TOY)  # the line of step 1, for this test only
    assert fm.get_format("toy_e3m1") is TOY
    # step 2 skipped: the per-format tests stop at the missing layout, naming the format
    with pytest.raises(KeyError, match="toy_e3m1"):
        test_format_bits.test_width_and_types_are_derived_from_the_layout(TOY.name)
    monkeypatch.setitem(ref.LAYOUTS, TOY.name, TOY_LAYOUT)
    tests = per_format_tests()
    assert len(tests) >= 10, [t.__name__ for t in tests]
    for test in tests:
        test(TOY.name)
    # step 3 skipped, then done
    with pytest.raises(AssertionError):
        test_format_bits.test_torch_and_numpy_types_are_the_expected_ones()
    monkeypatch.setitem(test_format_bits.TYPES, TOY.name, (None, None))
    test_format_bits.test_torch_and_numpy_types_are_the_expected_ones()
    test_format_bits.test_seeds_are_recorded_for_the_studied_formats_and_derived_from_the_name_for_new_ones()


def test_the_format_recipes_arithmetic(monkeypatch):
    """Step 5: RoundEach on the toy is its ground truth, every operation on every pair (triple for muladd) of
    finite values, exact in Fractions and rounded once; a class that names the protocol passes its check, one
    that leaves a member to the protocol's stub does not."""
    monkeypatch.setitem(ref.LAYOUTS, TOY.name, TOY_LAYOUT)
    v = fm.from_bits(np.arange(1 << TOY.bits), TOY)
    v = v[np.isfinite(v)]
    a, b = (x.ravel() for x in np.meshgrid(v, v, indexing="ij"))
    nz = b != 0
    for fma in (False, True):
        ours, oracle = RoundEach(TOY, fma=fma), RoundedFractions(TOY.name, fma=fma)
        for op, x, y in (("add", a, b), ("sub", a, b), ("mul", a, b), ("div", a[nz], b[nz])):
            want = [getattr(oracle, op)(s, t) for s, t in zip(x.tolist(), y.tolist())]
            np.testing.assert_array_equal(getattr(ours, op)(x, y), want, err_msg=op)
        c = np.repeat(v, a.size)
        want = [oracle.muladd(s, t, u) for s, t, u in zip(np.tile(a, v.size), np.tile(b, v.size), c)]
        np.testing.assert_array_equal(ours.muladd(np.tile(a, v.size), np.tile(b, v.size), c), want)
    np.testing.assert_array_equal(RoundEach(TOY).sqrt(np.abs(v)), [oracle.sqrt(t) for t in np.abs(v)])
    monkeypatch.setitem(test_arithmetic.ARITHMETICS, "RoundedFractions", RoundedFractions(TOY.name))
    test_arithmetic.test_each_arithmetic_declares_and_satisfies_the_protocol("RoundedFractions")
    partial = type("Partial", (Arithmetic,), {k: f for k, f in vars(RoundedFractions).items() if k != "sqrt"})
    monkeypatch.setitem(test_arithmetic.ARITHMETICS, "Partial", partial(TOY.name))
    with pytest.raises(AssertionError):
        test_arithmetic.test_each_arithmetic_declares_and_satisfies_the_protocol("Partial")


# ---------------------------------------------------------------------------------------------------------
# Recipes 2 and 3: a study folder with a data set, its recorder and headline, and a notebook, in a temporary tree
# ---------------------------------------------------------------------------------------------------------

PKG, STEM = "toy_studies", "98_toy_sample"  # a stand-in for dora_num.studies; the toy notebook
TREE = {
    "__init__.py": '"""Toy study folders."""\n',
    "sample/__init__.py": f'"""Notebook 98: a toy question."""\n\nNOTEBOOK = "{STEM}"\n',
    "sample/datasets.py": '''"""The recorded data of notebook 98."""

from dora_num.repro.paths import DataSet

SAMPLES = DataSet("toy-samples", {"table": "toy/samples.csv"}, recorder="toy-samples", where="the CPU",
                  ingest=False, notebooks=("98",), module="toy_studies.sample.record_samples",
                  about="CPU: a toy table (98)")

DATASETS = (SAMPLES,)
''',
    "sample/record_samples.py": '''"""``dora-num record toy-samples --out DIR``: a toy table."""

import pandas as pd

from dora_num.repro.provenance import save_dataframe
from dora_num.repro.recording import parser

from .datasets import SAMPLES


def build_parser(prog, name):
    return parser(prog, __doc__, ingest=None, smoke=None)


def record(args):
    save_dataframe(pd.DataFrame({"x": [1.0, 2.0]}), SAMPLES.path("table", args.out), producer=SAMPLES.producer)
    return 0
''',
    "sample/headline.py": '''"""Notebook 98's headline."""

import pandas as pd

from .datasets import SAMPLES

FIGURES = ()


def headline(d):
    n = len(pd.read_csv(SAMPLES.path("table", d / SAMPLES.folder)))
    return [f"the toy table has {n} rows"], {"rows": n}
''',
}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The tree: ``toy_studies/`` (importable) and ``notebooks/rendered/``; its modules forgotten afterwards."""
    root = tmp_path_factory.mktemp("toy")
    for rel, src in TREE.items():
        (root / PKG / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / PKG / rel).write_text(src)
    (root / "notebooks" / "rendered").mkdir(parents=True)
    (root / "notebooks" / "rendered" / f"{STEM}.md").write_text("# A toy notebook\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        yield root
    for name in [m for m in sys.modules if m.split(".")[0] == PKG]:
        del sys.modules[name]


def test_a_recorder_recipe(toy, tmp_path, capsys):
    table = datasets.declared(PKG)  # steps 1-2: the folder is found by looking, its declaration read
    assert [d.name for d in table] == ["toy-samples"]
    registry = datasets.recorders(table)
    assert registry == {"toy-samples": datasets.Recorder(f"{PKG}.sample.record_samples", "CPU: a toy table (98)")}
    assert test_datasets.registry_problems(table, registry) == []
    bare = [replace(table[0], about="")]  # step 2 without about=: no subcommand
    assert test_datasets.registry_problems(bare, datasets.recorders(bare)) == [
        "toy-samples: named by a data set, declared by none (module=, about=)"]
    with pytest.raises(SystemExit) as e:  # step 3: the recorder, behind dora-num record
        cli.run("toy-samples", ["--help"], recorders=registry)
    assert e.value.code == 0 and "dora-num record toy-samples" in capsys.readouterr().out
    out = tmp_path / "record"  # steps 4-5: it writes the declared file, by its role, with a sidecar
    assert [p.name for p in table[0].missing(out)] == ["samples.csv"]
    assert cli.run("toy-samples", ["--out", str(out)], recorders=registry) == 0
    assert table[0].missing(out) == []
    sidecar = table[0].path("table", out).with_name("samples.csv.provenance.json")
    assert json.loads(sidecar.read_text())["producer"] == "dora-num record toy-samples"
    src = (toy / PKG / "sample" / "record_samples.py").read_text()
    assert test_datasets.typed_names(src, set(table[0].files)) == []
    typed = src.replace('SAMPLES.path("table", args.out)', 'args.out / "samples.csv"')
    assert test_datasets.typed_names(typed, set(table[0].files)) == [(16, "samples.csv")]
    assert ("| `toy_studies/sample/record_samples.py` | records | ``dora-num record toy-samples --out DIR``: a toy "
            "table. |") in layout(toy / PKG)  # step 7: the row docs/design.md must then hold


def _notebook(folder, requires, *, first=None, params="SMOKE: bool = False  # tiny sizes", last="assert len(t) == 2"):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata["dora_num"] = {"requires": requires}
    cell = nbformat.v4.new_code_cell(params)
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell(first or f"# A toy notebook\n\n{rendering_line(STEM)}\n\nA question."),
                cell, nbformat.v4.new_code_cell(
                    f"import pandas as pd\n\nimport dora_num as dn\nfrom {PKG}.sample.datasets import SAMPLES\n\n"
                    f'ctx = dn.setup("{STEM}", globals())\n(path,) = ctx.recorded(SAMPLES)\nt = pd.read_csv(path)'),
                nbformat.v4.new_code_cell(last)]
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / f"{STEM}.ipynb")
    return folder / f"{STEM}.ipynb"


def test_a_notebook_recipe(toy, tmp_path):
    table = {d.name: d for d in datasets.declared(PKG)}
    requires = datasets.requires(STEM, table.values())
    assert requires == ["data/toy/samples.csv"]
    nb = _notebook(toy / "notebooks", requires)  # steps 1-4, each held by the check the recipe names
    checks = (test_rendered.test_notebook_opens_with_a_link_to_its_rendering,
              test_notebook_conventions.test_help_notebook_lists_every_parameter,
              test_runner.test_notebook_is_committed_clean)
    for check in checks:
        check(nb)
    assert test_datasets.read_problems(nb, table, PKG) == []
    skipped = ((dict(first="# A toy notebook\n\nA question."), checks[0]),  # no link to its rendering
               (dict(params="SMOKE = False  # tiny sizes"), checks[1]),  # a parameter without a type
               (dict(last="t"), checks[2]))  # no assertion of the headline claim
    for i, (change, check) in enumerate(skipped):
        with pytest.raises(AssertionError):
            check(_notebook(tmp_path / str(i), requires, **change))
    stale = _notebook(tmp_path / "stale", [])
    assert test_datasets.read_problems(stale, table, PKG) == [f"metadata dora_num.requires is [], not {requires}"]
    data = tmp_path / "data"  # step 6: its headline, gathered from the study folder into the README's results
    table["toy-samples"].path("table", data / "toy").parent.mkdir(parents=True)
    table["toy-samples"].path("table", data / "toy").write_text("x\n1.0\n2.0\n")
    text = results.section(data, toy, results.headlines(results.headline_modules(PKG)))
    assert f"**[{STEM}](notebooks/rendered/{STEM}.md)**\n\n- the toy table has 2 rows" in text
    assert "- unavailable: LookupError: this notebook has no headline" in results.section(data, toy, {})


# ---------------------------------------------------------------------------------------------------------
# The recipes name what exists
# ---------------------------------------------------------------------------------------------------------

def _top_level(path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) else [])
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def citation_problems(text: str) -> list[str]:
    """What ``text`` cites that is not there: a repository file (`path`, placeholders in <> left out) or a
    top-level name in one (`path::name`); and a numbered step that names no test (`tests/...::test_...`)."""
    found = []
    for token in re.findall(r"`((?:dora_num|tests|docs|notebooks)/[\w./-]+|README\.md)(?:::(\w+))?`", text):
        path, name = REPO_ROOT / token[0], token[1]
        if not path.is_file():
            found.append(f"{token[0]}: no such file")
        elif name and name not in _top_level(path):
            found.append(f"{token[0]}::{name}: no such name")
    for step in re.findall(r"^\d+\. .*?(?=^\d+\. |^#|\Z)", text, flags=re.M | re.S):
        if not re.search(r"`tests/[\w./-]+::test_\w+`", step):
            found.append(f"a step names no test: {step[:60]!r}")
    return found


def test_the_recipes_name_files_and_tests_that_exist():
    text = DOC.read_text()
    assert citation_problems(text) == []
    walked = {n for n, f in globals().items() if n.startswith("test_a_") and inspect.isfunction(f)}
    assert walked == {"test_a_format_recipe", "test_a_recorder_recipe", "test_a_notebook_recipe"}
    assert all(f"`tests/test_extending.py::{n}`" in text for n in walked)


def test_the_citation_check_can_fail():
    text = ("1. Add `dora_num/numerics/formats.py::NO_SUCH` and `tests/no_such.py`; `dora_num/studies/<study>/x.py`.\n"
            "2. Held by `tests/numerics/test_format_bits.py::test_to_bits_inverts_from_bits`.\n")
    *missing, step = citation_problems(text)
    assert missing == ["dora_num/numerics/formats.py::NO_SUCH: no such name", "tests/no_such.py: no such file"]
    assert step.startswith("a step names no test: '1. Add")
