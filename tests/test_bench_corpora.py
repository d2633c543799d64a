"""bench/models/corpora.py: markup cleaners, the document split, the missing-package error (no package needed)."""
from __future__ import annotations

import pytest

from bench.models.corpora import CorpusError, build_corpus, clean_man, clean_rst, package_version, split_documents

RST = """.. SPDX-License-Identifier: GPL-2.0

.. _my_label:

==========
Page title
==========

.. toctree::
   :maxdepth: 2

   other-page

Call :c:func:`kmalloc` with ``GFP_KERNEL``; see :ref:`the guide <guide>` and `LWN <https://lwn.net/>`_.
This is **important** and *emphasised*, but ``*ptr`` keeps its star. For example::

    int x = 1;

.. note::
   Notes keep their body.

=====  =====
a      b
=====  =====
"""


def test_clean_rst_strips_markup_keeps_prose_and_code():
    text = clean_rst(RST)
    assert "SPDX" not in text and "my_label" not in text and "toctree" not in text and "other-page" not in text
    assert "maxdepth" not in text and "====" not in text and ".." not in text
    assert text.startswith("Page title\n")
    assert "Call kmalloc with GFP_KERNEL; see the guide and LWN." in text
    assert "This is important and emphasised, but *ptr keeps its star. For example:\n" in text
    assert "    int x = 1;" in text
    assert "   Notes keep their body." in text
    assert "`" not in text


def test_clean_man_drops_header_footer_boxes_and_padding():
    pad = " " * 300
    rendered = (f"open(2){pad}System Calls Manual{pad}open(2)\n\n\n"
                "NAME\n       open - open a file\n\n"
                "DESCRIPTION\n       The  open()  call   opens.\n\n"
                f"{' ' * 400}┌──────┬─────┐\n{' ' * 400}│a     │ b   │\n{' ' * 400}└──────┴─────┘\n"
                "              indented code\n\n"
                f"Linux man-pages 6.03{pad}2023-02-05{pad}open(2)\n")
    text = clean_man(rendered)
    lines = text.split("\n")
    assert lines[0] == "NAME" and "open(2)" not in text and "─" not in text and "│" not in text
    assert "open - open a file" in lines
    assert "The  open()  call  opens." in lines  # runs of spaces squeezed to two
    assert max(len(line) - len(line.lstrip()) for line in lines) <= 16
    assert "       indented code" in lines


def test_split_is_seeded_disjoint_and_complete():
    names = [f"doc{i}" for i in range(200)]
    a, b = split_documents(names, 0, (0.05, 0.05)), split_documents(names, 0, (0.05, 0.05))
    assert a == b
    assert len(a["validation"]) == len(a["test"]) == 10 and len(a["train"]) == 180
    assert sorted(a["train"] + a["validation"] + a["test"]) == list(range(200))
    assert split_documents(names, 1, (0.05, 0.05))["test"] != a["test"]


def test_prune_split_comes_out_of_train_only():
    """The prune split (never trained on) takes documents from train alone: validation and test are those of the
    corpus without it, so held-out figures stay comparable, and no document is in two splits."""
    names = [f"doc{i}" for i in range(200)]
    plain, pruned = split_documents(names, 0, (0.05, 0.05)), split_documents(names, 0, (0.05, 0.05), prune=0.25)
    assert "prune" not in plain and len(pruned["prune"]) == 50 and len(pruned["train"]) == 130
    assert pruned["validation"] == plain["validation"] and pruned["test"] == plain["test"]
    assert set(pruned["prune"]) | set(pruned["train"]) == set(plain["train"])
    assert not set(pruned["prune"]) & set(pruned["train"])


def test_prune_fraction_out_of_range_is_refused(tmp_path):
    with pytest.raises(CorpusError, match=r"prune split's fraction must be in \[0, 0.5\)"):
        build_corpus("manpages", tmp_path / "c", prune=0.6)


def test_missing_package_names_the_install_command():
    with pytest.raises(CorpusError, match=r"apt-get install -y no-such-package-elsa"):
        package_version("no-such-package-elsa")


def test_a_mix_shuffles_its_sources_splits_together_and_keeps_every_test_document_held_out(tmp_path, monkeypatch):
    """techdocs' construction on three stand-in sources: each split of the mix is the union of the sources' same split
    (no document crosses splits), its documents interleaved (a prefix holds every source), rebuilt only when a source
    changed; a prune split is refused for a mix."""
    from bench.models import corpora

    def source(tag: str):
        return lambda: ([(f"{tag}/{i:03d}", f"{tag} document {i}\n") for i in range(60)], {f"pkg-{tag}": "1.0"})

    monkeypatch.setattr(corpora, "CORPORA", {t: corpora.Corpus(t, t, source(t)) for t in ("a", "b", "c")})
    monkeypatch.setattr(corpora, "MIXES", {"mix": ("a", "b", "c")})
    meta = corpora.build_mix("mix", tmp_path / "mix")
    splits = {s: corpora.read_split(tmp_path / "mix", s) for s in corpora.SPLITS}
    for s in corpora.SPLITS:
        assert sorted(splits[s]) == sorted(t for src in "abc" for t in corpora.read_split(tmp_path / src, s))
        assert meta["splits"][s]["documents"] == len(splits[s])
    assert not set(splits["train"]) & set(splits["test"]) and not set(splits["train"]) & set(splits["validation"])
    assert {t[0] for t in splits["train"][:20]} == {"a", "b", "c"}  # interleaved, not source after source
    assert meta["packages"] == {"pkg-a": "1.0", "pkg-b": "1.0", "pkg-c": "1.0"}
    stamp = (tmp_path / "mix" / "train.jsonl").stat().st_mtime_ns
    assert corpora.build_mix("mix", tmp_path / "mix") == meta and (tmp_path / "mix" / "train.jsonl").stat().st_mtime_ns == stamp
    assert corpora.main(["--name", "mix", "--out", str(tmp_path / "mix"), "--prune", "0.1"]) == 2
