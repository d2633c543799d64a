"""English corpora from Debian packages, cleaned to plain text and split by whole document.

    python bench/models/corpora.py --name linux-doc --out ~/.cache/elsa_ds/corpora/linux-doc
    python bench/models/corpora.py --name manpages --out ~/.cache/elsa_ds/corpora/manpages
    python bench/models/corpora.py --name techdocs      # manpages + python-doc + perl-doc, shuffled together per split

- ``linux-doc``: the kernel's ``Documentation/**/*.rst`` from ``linux-doc-<ver>`` (translations
  excluded), reStructuredText with the markup stripped (``clean_rst``).
- ``manpages``: the regular (non-``.so``) pages of ``manpages`` and ``manpages-dev``, rendered by
  ``groff -man -Tutf8`` (no hyphenation, one line per paragraph) and cleaned (``clean_man``).
- ``python-doc``: the Python documentation's pages, the reStructuredText sources Sphinx ships beside the HTML
  (``python3.X-doc``), cleaned as linux-doc's.
- ``perl-doc``: Perl's POD pages (``perl-doc``) rendered by ``pod2text``, one line per paragraph.
- ``techdocs`` (a mix): the splits of manpages, python-doc and perl-doc, each split's documents shuffled together
  (seeded), so any prefix holds every source in proportion and no split shares a document with another; the GPU budget
  curve trains on its train split (4.85 M Gemma-3 tokens, where the man pages alone have 1.5 M).

A document is one source file. Documents are sorted by path, then a seeded permutation assigns whole
documents to train/validation/test (~90/5/5), so no held-out document shares a line with training.
With ``--prune F`` a fourth split, ``prune``, takes a fraction F of the documents away from train: text the
model never trains on, for pruning, calibration and retraining, as a large model pruned on fresh C4 crops
has never memorised them (a small model trained on a few million tokens has: retraining it on its own
training text fits that text and loses held-out quality).
Writes ``train.jsonl``, ``validation.jsonl``, ``test.jsonl`` [, ``prune.jsonl``] (one ``{"text": ...}`` per line, the
``datasets`` convention that ``elsa_ds --dataset DIR`` reads) and ``corpus.json`` (packages and
versions, the document paths of each split, characters per split). The output goes to ``<out>.tmp``
first and is renamed when complete.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from elsa_ds.errors import ElsaError  # noqa: E402

SPLITS = ("train", "validation", "test")
FORMAT_VERSION = 2  # bump when cleaning or splitting changes; a stale corpus dir is then rebuilt


class CorpusError(ElsaError):
    """A corpus cannot be built here (usually: its Debian package is not installed)."""


def package_version(package: str) -> str:
    """Installed version of a Debian package, or CorpusError naming the apt-get command."""
    try:
        res = subprocess.run(["dpkg-query", "-W", "-f=${Status}\t${Version}", package], capture_output=True, text=True)
    except OSError as err:  # no dpkg: not a Debian system
        raise CorpusError(f"dpkg-query cannot run here ({err.strerror or err}): the corpora are built from Debian packages") from None
    status, _, version = res.stdout.partition("\t")
    if res.returncode != 0 or not status.endswith(" installed"):
        raise CorpusError(f"Debian package {package!r} is not installed; run: apt-get install -y {package}")
    return version


def package_files(package: str) -> list[Path]:
    """Files a package installed (``dpkg -L``), sorted; directories excluded."""
    res = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True, check=True)
    return sorted(p for p in map(Path, res.stdout.split("\n")) if str(p).startswith("/") and p.is_file())


def read_maybe_gz(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


# --- linux-doc: reStructuredText -> text -------------------------------------------------------------

ADORNMENT = re.compile(r"^\s*([=\-~^*#+`'\":.])\1{2,}\s*$")  # section under/overlines, simple-table rules
GRID_RULE = re.compile(r"^\s*(\+[-=+]+\+|[=-]{2,}(\s+[=-]{2,})+)\s*$")  # grid borders, '====  ====' rules
DIRECTIVE = re.compile(r"^(\s*)\.\.(\s+(\S.*)?)?$")  # '.. name:: args', '.. _label:', '.. comment', '..'
ROLE = re.compile(r":[\w.+-]+(?::[\w.+-]+)*:`([^`]*)`")  # :c:func:`kmalloc`, :ref:`text <label>`
TARGET = re.compile(r"\s*<[^<>\s]+>$")  # the ' <target>' of `text <target>`


def _role_text(m: re.Match) -> str:
    inner = m.group(1)
    text = TARGET.sub("", inner)
    return text or inner.strip("<>")


def clean_rst(text: str) -> str:
    """Strip reStructuredText markup so the model learns English, not markup.

    Drops: section adornments, grid/simple-table rules, explicit-markup blocks whose content is not prose
    (comments, labels, ``toctree``, ``kernel-doc``, ``include``, ``image``... with their indented body) and
    the option lines of directives. Keeps the body of admonitions (``note``, ``warning``...) and of code
    blocks (kernel docs explain code; a literal block is English-adjacent text the model should see).
    Inline: roles and ``text <target>`` references keep their text, ``literal``/``*em*``/``**strong**``/
    ```link`_`` lose their markers, ``::`` ending a paragraph becomes ``:``.
    """
    keep_body = {"note", "warning", "attention", "caution", "danger", "error", "hint", "important", "tip",
                 "admonition", "seealso", "code-block", "code", "sourcecode", "literalinclude", "topic",
                 "sidebar", "rubric", "container", "highlight", "only", "c:function", "c:type", "c:macro",
                 "c:struct", "c:member", "c:var"}
    out: list[str] = []
    skip_indent: int | None = None  # inside a dropped explicit-markup block: skip lines indented deeper
    in_options = False
    for line in text.replace("\r\n", "\n").split("\n"):
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not line.strip() or indent > skip_indent:
                continue
            skip_indent = None
        if in_options:
            if re.match(r"^\s*:[\w -]+:(\s|$)", line):
                continue
            in_options = False
        m = DIRECTIVE.match(line)
        if m:
            body = (m.group(3) or "").strip()
            d = re.match(r"^([\w:.-]+)::\s*(.*)$", body)
            if d and d.group(1) in keep_body:
                in_options = True
                arg = d.group(2).strip()
                if arg and d.group(1) in {"admonition", "topic", "sidebar", "rubric", "c:function", "c:type",
                                          "c:macro", "c:struct", "c:member", "c:var"}:
                    out.append(" " * indent + arg)
                continue
            skip_indent = indent  # comment, label, or a directive with non-prose body
            continue
        if ADORNMENT.match(line) or GRID_RULE.match(line):
            continue
        if line.strip() == "::":
            continue
        line = re.sub(r"(\S)::$", r"\1:", line)
        line = re.sub(r"\s::$", "", line)
        line = ROLE.sub(_role_text, line)
        line = re.sub(r"``([^`]+)``", r"\1", line)
        line = re.sub(r"`([^`<]*?)\s*<[^<>`]+>`__?", r"\1", line)  # `text <url>`_
        line = re.sub(r"`([^`]+)`__?", r"\1", line)  # `name`_
        line = re.sub(r"`([^`]+)`", r"\1", line)  # default role
        line = re.sub(r"(?<![\w*])\*\*(\S(?:[^*]*?\S)?)\*\*(?![\w*])", r"\1", line)
        line = re.sub(r"(?<![\w*/])\*(\S(?:[^*]*?\S)?)\*(?![\w*/])", r"\1", line)
        line = re.sub(r"\|(\w[\w -]*)\|_?", r"\1", line)  # |substitution|
        out.append(line.rstrip())
    return _squeeze("\n".join(out))


def _squeeze(text: str) -> str:
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    return text + "\n" if text else ""


def linux_doc_root() -> tuple[Path, dict[str, str]]:
    """The installed kernel Documentation/ and the versions of the packages that provide it."""
    versions = {"linux-doc": package_version("linux-doc")}
    roots = sorted(Path("/usr/share/doc").glob("linux-doc-*/Documentation"))
    if not roots:
        raise CorpusError("linux-doc is installed but /usr/share/doc/linux-doc-*/Documentation is missing; "
                          "run: apt-get install --reinstall -y linux-doc")
    root = roots[-1]
    versions[root.parent.name] = package_version(root.parent.name)
    return root, versions


def linux_doc_documents() -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(relative path, cleaned text) of every English .rst file of the kernel documentation."""
    root, versions = linux_doc_root()
    docs = []
    for path in sorted(root.rglob("*.rst.gz")) + sorted(root.rglob("*.rst")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("translations/"):
            continue
        docs.append((rel.removesuffix(".gz"), clean_rst(read_maybe_gz(path))))
    return sorted(docs), versions


# --- manpages: roff -> text -----------------------------------------------------------------------------

MAN_PACKAGES = ("manpages", "manpages-dev")
BOX_RULE = re.compile(r"^\s*[─━┌┐└┘├┤┬┴┼═╪╞╡][\s─━┌┐└┘├┤┬┴┼═╪╞╡]*$")  # tbl box rules
MAX_INDENT = 16
GROFF = ["groff", "-t", "-man", "-Tutf8", "-P-cbou", "-rLL=10000n", "-rHY=0"]  # tbl; no colour/overstrike/hyphens


def render_man(path: Path) -> str:
    """A man page through groff: one output line per paragraph (line length 10000n), no hyphenation."""
    res = subprocess.run(GROFF, input=read_maybe_gz(path), capture_output=True, text=True,
                         env={"LC_ALL": "C.UTF-8", "PATH": "/usr/bin:/bin", "MAN_KEEP_FORMATTING": "0"})
    if res.returncode != 0:
        raise CorpusError(f"groff failed on {path}: {res.stderr.strip()[:200]}")
    return res.stdout


def clean_man(rendered: str) -> str:
    """Drop groff's running header/footer, dedent the 7-column body indent, squeeze runs of spaces.

    groff pads the header (``open(2)   System Calls Manual   open(2)``) and footer (``Linux man-pages
    6.03   2023-02-05   open(2)``) to the line length; they are the first and last non-empty lines.
    Section names (``NAME``, ``DESCRIPTION``) stay: they read like headings. tbl boxes lose their rules
    and bars, and the indent is capped (tbl centres tables on the 10000n line: hundreds of spaces).
    """
    lines = rendered.split("\n")
    nonempty = [i for i, line in enumerate(lines) if line.strip()]
    if len(nonempty) >= 2:
        lines = lines[nonempty[0] + 1:nonempty[-1]]
    out = []
    for line in lines:
        line = line.replace("│", " ").rstrip()
        if BOX_RULE.match(line):
            continue
        body = line.lstrip(" ")
        indent = len(line) - len(body)
        body = re.sub(r"(\S) {2,}(?=\S)", r"\1  ", body)  # justification gaps and table padding
        out.append(" " * min(max(indent - 7, 0), MAX_INDENT) + body)
    return _squeeze("\n".join(out))


def manpage_documents() -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(path under /usr/share/man, cleaned text) of every real page of manpages + manpages-dev."""
    if shutil.which("groff") is None:
        raise CorpusError("groff is not installed; run: apt-get install -y groff-base")
    versions = {pkg: package_version(pkg) for pkg in MAN_PACKAGES}
    versions["groff-base"] = package_version("groff-base")
    docs = []
    for pkg in MAN_PACKAGES:
        for path in package_files(pkg):
            if not re.match(r"^/usr/share/man/man\d/", str(path)) or path.is_symlink():
                continue
            source = read_maybe_gz(path)
            if re.match(r"^\.so\s", source.lstrip()) and len(source.strip().split("\n")) <= 2:
                continue  # a one-line redirect to another page
            text = clean_man(render_man(path))
            if text:
                docs.append((path.relative_to("/usr/share/man").as_posix().removesuffix(".gz"), text))
    return sorted(docs), versions


# --- python-doc: the Python documentation's reStructuredText sources -> text -------------------------------------

def python_doc_documents() -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(path under html/_sources, cleaned text) of every page of the Python documentation (Sphinx ships each page's
    reStructuredText source beside its HTML), markup stripped as linux-doc's."""
    roots = sorted((r for r in Path("/usr/share/doc").glob("python3.*/html/_sources") if re.fullmatch(r"python3\.\d+", r.parents[1].name)),
                   key=lambda r: int(r.parents[1].name.split(".")[1]))
    if not roots:
        raise CorpusError("the Python documentation is not installed (/usr/share/doc/python3.*/html/_sources); "
                          "run: apt-get install -y python3-doc")
    root = roots[-1]
    package = f"{root.parents[1].name}-doc"  # python3.11-doc
    versions = {package: package_version(package)}
    docs = [(path.relative_to(root).as_posix().removesuffix(".txt"), clean_rst(read_maybe_gz(path)))
            for path in sorted(root.rglob("*.rst.txt"))]
    return sorted(docs), versions


# --- perl-doc: POD -> text ----------------------------------------------------------------------------------------

def render_pod(path: Path) -> str:
    """A POD file through pod2text: no indent, one output line per paragraph (verbatim blocks keep theirs)."""
    res = subprocess.run(["pod2text", "--utf8", "--indent", "0", "--width", "10000", str(path)], capture_output=True,
                         text=True, env={"LC_ALL": "C.UTF-8", "PATH": "/usr/bin:/bin"})
    if res.returncode != 0:
        raise CorpusError(f"pod2text failed on {path}: {res.stderr.strip()[:200]}")
    return _squeeze("\n".join(line.rstrip() for line in res.stdout.split("\n")))


def perl_doc_documents() -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(file name, text) of every POD page of perl-doc (perlfunc, perlop, the FAQs, the release notes, ...)."""
    versions = {"perl-doc": package_version("perl-doc")}
    if shutil.which("pod2text") is None:
        raise CorpusError("pod2text is not installed; run: apt-get install -y perl")
    docs = [(path.name, render_pod(path)) for path in package_files("perl-doc") if path.suffix == ".pod"]
    return sorted(docs), versions


# --- splitting and writing ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Corpus:
    name: str
    description: str
    documents: Callable[[], tuple[list[tuple[str, str]], dict[str, str]]]


CORPORA = {
    "linux-doc": Corpus("linux-doc", "Linux kernel Documentation/*.rst (English), markup stripped", linux_doc_documents),
    "manpages": Corpus("manpages", "Linux man-pages (sections 1-8 of manpages, manpages-dev) rendered by groff",
                       manpage_documents),
    "python-doc": Corpus("python-doc", "the Python documentation's pages (python3.X-doc's reStructuredText sources), "
                         "markup stripped", python_doc_documents),
    "perl-doc": Corpus("perl-doc", "Perl's documentation (perl-doc's POD pages) rendered by pod2text", perl_doc_documents),
}


def splits_of(prune: float) -> tuple[str, ...]:
    return SPLITS + (("prune",) if prune > 0 else ())


def split_documents(names: list[str], seed: int, fractions: tuple[float, float], prune: float = 0.0) -> dict[str, list[int]]:
    """Indices of sorted documents per split: a seeded shuffle, then validation, test, [prune,] train in that order
    (with ``prune`` 0 the validation and test documents are those of a corpus built without a prune split)."""
    order = list(range(len(names)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(fractions[0] * len(names)))
    n_test = max(1, round(fractions[1] * len(names)))
    n_prune = round(prune * len(names))
    held = n_val + n_test + n_prune
    out = {"validation": sorted(order[:n_val]), "test": sorted(order[n_val:n_val + n_test]), "train": sorted(order[held:])}
    if prune > 0:
        out["prune"] = sorted(order[n_val + n_test:held])
    return out


def is_complete(out: Path, name: str, seed: int, prune: float = 0.0) -> bool:
    """Whether ``out`` holds a finished corpus of this name, seed, prune fraction and format (whatever package versions
    built it: ``--force`` rebuilds from those installed; bench/device/ship.py names the versions cells ran on)."""
    try:
        meta = json.loads((out / "corpus.json").read_text())
    except (OSError, ValueError):
        return False
    return (meta.get("name") == name and meta.get("seed") == seed and meta.get("format_version") == FORMAT_VERSION
            and meta["held_out_fractions"].get("prune", 0.0) == prune
            and all((out / f"{s}.jsonl").is_file() for s in splits_of(prune)))


def build_corpus(name: str, out: Path, seed: int = 0, held_out: tuple[float, float] = (0.05, 0.05),
                 force: bool = False, prune: float = 0.0) -> dict:
    """Build (or reuse) corpus ``name`` at ``out``; returns its ``corpus.json``. ``prune``: the fraction of documents
    in the ``prune`` split (never trained on by the model build)."""
    if name not in CORPORA:
        raise CorpusError(f"unknown corpus {name!r}; choose one of {', '.join(CORPORA)}")
    if not 0.0 <= prune < 0.5:
        raise CorpusError(f"--prune {prune}: the prune split's fraction must be in [0, 0.5)")
    out = out.expanduser()
    if not force and is_complete(out, name, seed, prune):
        return json.loads((out / "corpus.json").read_text())
    corpus = CORPORA[name]
    docs, versions = corpus.documents()
    docs = [(path, text) for path, text in docs if text.strip()]
    if len(docs) < 20:
        raise CorpusError(f"corpus {name}: only {len(docs)} documents found; is the package complete?")
    index = split_documents([p for p, _ in docs], seed, held_out, prune)
    meta: dict = {"name": name, "description": corpus.description, "packages": versions, "seed": seed,
                  "held_out_fractions": {"validation": held_out[0], "test": held_out[1], **({"prune": prune} if prune else {})},
                  "format_version": FORMAT_VERSION}
    return write_corpus(out, meta, {split: [docs[i][1] for i in index[split]] for split in splits_of(prune)},
                        {split: {"paths": [docs[i][0] for i in index[split]]} for split in splits_of(prune)})


def write_corpus(out: Path, meta: dict, splits: dict[str, list[str]], extra: dict[str, dict]) -> dict:
    """Each split's texts as ``<split>.jsonl`` and ``meta`` (with every split's documents, characters, sha256 and
    ``extra[split]``) as ``corpus.json``, written to ``<out>.tmp`` and renamed to ``out`` when complete."""
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    meta = {**meta, "splits": {}}
    for split, texts in splits.items():
        digest = hashlib.sha256()
        with (tmp / f"{split}.jsonl").open("w", encoding="utf-8") as fh:
            for text in texts:
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                fh.write(line)
                digest.update(line.encode())
        meta["splits"][split] = {"documents": len(texts), "chars": sum(map(len, texts)), "sha256": digest.hexdigest(),
                                 **extra[split]}
    (tmp / "corpus.json").write_text(json.dumps(meta, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return meta


# A mix: the same-named splits of several corpora, documents shuffled together (seeded), so that every prefix of a split
# (what packed training blocks and the first perplexity windows read) holds each source in proportion. A source's test
# documents are the mix's test documents: no mix split shares a document with another.
MIXES = {"techdocs": ("manpages", "python-doc", "perl-doc")}


def build_mix(name: str, out: Path, seed: int = 0, force: bool = False) -> dict:
    """Build (or reuse) mix ``name`` at ``out`` from its sources, each built (or reused) beside it; returns its
    ``corpus.json`` (each source's packages and split digests, and the mix's own per split)."""
    out = out.expanduser()
    sources = {src: build_corpus(src, out.parent / src, seed) for src in MIXES[name]}
    digest_in = hashlib.sha256(json.dumps({k: {s: v["splits"][s]["sha256"] for s in SPLITS} for k, v in sources.items()},
                                          sort_keys=True).encode()).hexdigest()
    if not force and is_complete(out, name, seed) and json.loads((out / "corpus.json").read_text()).get("sources_sha256") == digest_in:
        return json.loads((out / "corpus.json").read_text())
    meta: dict = {"name": name, "description": f"the documents of {', '.join(MIXES[name])}, shuffled together per split",
                  "packages": {k: v for src in sources.values() for k, v in src["packages"].items()}, "seed": seed,
                  "held_out_fractions": {"validation": 0.05, "test": 0.05}, "format_version": FORMAT_VERSION,
                  "sources": {src: {s: {k: v for k, v in meta_s["splits"][s].items() if k != "paths"} for s in SPLITS}
                              for src, meta_s in sources.items()},
                  "sources_sha256": digest_in}
    mixed = {}
    for split in SPLITS:
        docs = [(src, text) for src in MIXES[name] for text in read_split(out.parent / src, split)]
        random.Random(f"{seed}:{split}").shuffle(docs)
        mixed[split] = docs
    return write_corpus(out, meta, {split: [t for _, t in docs] for split, docs in mixed.items()},
                        {split: {"sources": [src for src, _ in docs]} for split, docs in mixed.items()})


def read_split(out: Path, split: str) -> list[str]:
    """The document texts of one split file, in order."""
    with (out / f"{split}.jsonl").open(encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh if line.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", choices=sorted([*CORPORA, *MIXES]), required=True)
    ap.add_argument("--out", type=Path, help="output directory [~/.cache/elsa_ds/corpora/NAME]")
    ap.add_argument("--seed", type=int, default=0, help="document split seed")
    ap.add_argument("--force", action="store_true", help="rebuild even if a complete corpus exists")
    ap.add_argument("--prune", type=float, default=0.0, help="fraction of documents in a prune split, never trained on [0]")
    args = ap.parse_args(argv)
    out = args.out or Path("~/.cache/elsa_ds/corpora") / args.name
    try:
        if args.name in MIXES and args.prune:
            raise CorpusError(f"--prune: a mix ({args.name}) takes its sources' splits as they are")
        meta = (build_mix(args.name, out, args.seed, force=args.force) if args.name in MIXES
                else build_corpus(args.name, out, args.seed, force=args.force, prune=args.prune))
    except CorpusError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    summary = {s: {k: v for k, v in meta["splits"][s].items() if k not in ("paths", "sources")} for s in meta["splits"]}
    print(json.dumps({"name": meta["name"], "packages": meta["packages"], "out": str(out.expanduser()), "splits": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
