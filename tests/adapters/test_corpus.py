"""The stdlib corpus: extraction rules, determinism, the committed file."""

import hashlib
import json

import pytest

from dora_num.adapters import corpus
from dora_num.repro.paths import committed_data
from dora_num.repro.provenance import read_provenance

SOURCE = '''
def public(a, b: int = 1, *args, key=None, **kw) -> int:
    """Add two numbers together.

    Longer text that is not the summary.
    """

def _private(x):
    """Never extracted, private."""

def sig_summary(x):
    """sig_summary(x) -> y: a summary that is a signature."""

def no_doc(x):
    pass

class Thing:
    """A thing worth having."""

    def __init__(self, size, *, name="t"):
        pass

    def grow(self, by):
        """Grow the thing by some amount."""

    @staticmethod
    def make(n):
        """Make a new thing from n."""

    def _hidden(self):
        """Hidden method, skipped."""
'''


def test_pairs_from_source_rules():
    got = {p.qualname: p for p in corpus.pairs_from_source(SOURCE, "pkg.mod")}
    assert sorted(got) == ["Thing", "Thing.grow", "Thing.make", "public"]
    assert got["public"].summary == "Add two numbers together."
    assert got["public"].signature == "pkg.mod.public(a, b=1, *args, key=None, **kw)"  # annotations dropped
    assert got["Thing"].signature == "pkg.mod.Thing(size, *, name='t')"  # __init__ without self
    assert got["Thing.grow"].signature == "pkg.mod.Thing.grow(by)"
    assert got["Thing.make"].signature == "pkg.mod.Thing.make(n)"  # staticmethod keeps its first argument
    assert {p.kind for p in got.values()} == {"function", "class", "method"}


def test_dedupe_drops_repeated_summaries_and_signatures():
    P = corpus.Pair
    pairs = [P("a", "f", "function", "Do it.", "a.f()"), P("b", "g", "function", "do it.", "b.g()"),
             P("c", "h", "function", "Other.", "a.f()"), P("d", "k", "function", "Fine one.", "d.k()")]
    assert [p.qualname for p in corpus._dedupe(pairs)] == ["f", "k"]


def test_split_is_deterministic_hash():
    assert corpus.split_of("json.dumps") == corpus.split_of("json.dumps")
    h = int.from_bytes(hashlib.sha256(b"json.dumps").digest()[:8], "big") / 2.0**64
    assert corpus.split_of("json.dumps") == ("validation" if h < corpus.VALIDATION_FRACTION else "train")


@pytest.fixture(scope="module")
def committed():
    return corpus.load_corpus()


def test_committed_corpus_size_and_provenance(committed):
    path = committed_data("corpus", corpus.CORPUS_NAME)
    assert path.stat().st_size <= 3 * 2**20
    prov = read_provenance(path)
    assert prov["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    lic = committed_data("corpus", corpus.LICENSE_NAME)
    assert "PYTHON SOFTWARE FOUNDATION LICENSE" in lic.read_text()


def test_committed_corpus_is_clean(committed):
    assert len(committed) > 2000
    summaries = [r["summary"].casefold() for r in committed]
    sigs = [r["signature"] for r in committed]
    assert len(set(summaries)) == len(summaries) and len(set(sigs)) == len(sigs)
    groups = {}
    for r in committed:  # a class's methods never straddle the split
        groups.setdefault(f"{r['module']}.{r['qualname'].split('.')[0]}", set()).add(r["split"])
    assert all(len(s) == 1 for s in groups.values())
    # groups go to validation by a hash: a Bernoulli(0.1) draw each, so the share of groups is
    # within 5 binomial standard deviations of 0.1 (a 1-in-1.7-million miss for a fair hash)
    share = sum("validation" in s for s in groups.values()) / len(groups)
    sigma = (corpus.VALIDATION_FRACTION * (1 - corpus.VALIDATION_FRACTION) / len(groups)) ** 0.5
    assert abs(share - corpus.VALIDATION_FRACTION) < 5 * sigma


def test_load_corpus_rejects_bad_split():
    with pytest.raises(ValueError, match="split must be"):
        corpus.load_corpus(split="test")
    with pytest.raises(FileNotFoundError, match="corpus not found"):
        corpus.load_corpus("/nonexistent.jsonl.gz")


def test_encode_is_deterministic():
    rows = [{"b": 1, "a": "x"}]
    assert corpus.encode_jsonl_gz(rows) == corpus.encode_jsonl_gz(rows)
    import gzip

    assert json.loads(gzip.decompress(corpus.encode_jsonl_gz(rows))) == rows[0]
